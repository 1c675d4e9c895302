//! A finished request's record as an OpenTelemetry server span: the HTTP semantic
//! conventions' attributes, then the gateway's own (`tollgate.*`).

use crate::observe::record::Record;
use opentelemetry::trace::{SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceState};
use opentelemetry::{InstrumentationScope, KeyValue};
use opentelemetry_sdk::trace::{SpanData, SpanEvents, SpanLinks};
use std::borrow::Cow;
use std::time::SystemTime;

/// Methods the conventions name as they are; any other is `_OTHER` with its original.
const KNOWN: [&str; 9] = [
    "GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH",
];

fn text(v: &http::HeaderValue) -> String {
    String::from_utf8_lossy(v.as_bytes()).into_owned()
}

/// The span of `rec`, which arrived at `start` (wall clock).
pub(super) fn span_of(rec: &Record, start: SystemTime, scope: &InstrumentationScope) -> SpanData {
    let trace = rec.trace.as_ref();
    let method = rec.method.as_str();
    let route_path = rec.span_head.as_ref().and_then(|h| h.route_path.as_deref());
    let name = match route_path {
        Some(r) => format!("{method} {r}"),
        None => method.to_string(),
    };
    let uri = std::str::from_utf8(&rec.uri).unwrap_or("");
    let (path, query) = uri.split_once('?').unwrap_or((uri, ""));
    let mut a = Vec::with_capacity(24);
    if KNOWN.contains(&method) {
        a.push(KeyValue::new("http.request.method", method.to_string()));
    } else {
        a.push(KeyValue::new("http.request.method", "_OTHER"));
        a.push(KeyValue::new(
            "http.request.method_original",
            method.to_string(),
        ));
    }
    a.push(KeyValue::new("url.path", path.to_string()));
    if !query.is_empty() {
        let mut kept = String::new();
        crate::query::kept_pieces(query, rec.snap.credential_params(), |sep, piece| {
            if sep != b'?' {
                kept.push(char::from(sep));
            }
            kept.push_str(piece);
        });
        if !kept.is_empty() {
            a.push(KeyValue::new("url.query", kept));
        }
    }
    a.push(KeyValue::new(
        "http.response.status_code",
        i64::from(rec.status),
    ));
    a.push(KeyValue::new("client.address", text(&rec.client)));
    if let Some(h) = &rec.span_head {
        a.push(KeyValue::new(
            "url.scheme",
            if h.https { "https" } else { "http" },
        ));
        let version = match h.version {
            http::Version::HTTP_10 => "1.0",
            http::Version::HTTP_2 => "2",
            http::Version::HTTP_3 => "3",
            _ => "1.1",
        };
        a.push(KeyValue::new("network.protocol.name", "http"));
        a.push(KeyValue::new("network.protocol.version", version));
        if let Some(host) = &h.host {
            let host = text(host);
            let (name, port) = match host.rsplit_once(':') {
                Some((n, p)) if !n.ends_with(']') || n.starts_with('[') => {
                    (n.to_string(), p.parse::<i64>().ok())
                }
                _ => (host.clone(), None),
            };
            a.push(KeyValue::new("server.address", name));
            a.push(KeyValue::new(
                "server.port",
                port.unwrap_or(i64::from(h.port)),
            ));
        }
        if let Some(ua) = &h.user_agent {
            a.push(KeyValue::new("user_agent.original", text(ua)));
        }
        if let Some(r) = route_path {
            a.push(KeyValue::new("http.route", r.to_string()));
        }
    }
    if let Some(n) = rec.bytes_in {
        a.push(KeyValue::new(
            "http.request.body.size",
            i64::try_from(n).unwrap_or(i64::MAX),
        ));
    }
    a.push(KeyValue::new(
        "http.response.body.size",
        i64::try_from(rec.bytes_out).unwrap_or(i64::MAX),
    ));
    let status = if rec.status >= 500 {
        a.push(KeyValue::new("error.type", rec.status.to_string()));
        Status::error("")
    } else {
        Status::Unset
    };
    a.push(KeyValue::new(
        "tollgate.request_id",
        String::from_utf8_lossy(&rec.request_id).into_owned(),
    ));
    if let Some(r) = &rec.route {
        a.push(KeyValue::new("tollgate.route", r.to_string()));
    }
    if let Some(c) = rec.consumer {
        a.push(KeyValue::new(
            "tollgate.consumer",
            rec.snap.consumer_name(c).to_string(),
        ));
    }
    if let Some(r) = rec.refusal {
        a.push(KeyValue::new("tollgate.refusal", r));
    }
    if let Some(l) = &rec.limit {
        a.push(KeyValue::new("tollgate.limit", l.to_string()));
    }
    if let Some(c) = &rec.cache {
        a.push(KeyValue::new("tollgate.cache_status", text(c)));
    }
    if let Some(t) = &rec.target {
        a.push(KeyValue::new("tollgate.upstream.target", t.to_string()));
    }
    if let Some(ns) = rec.upstream_ns {
        a.push(KeyValue::new(
            "tollgate.upstream.duration_ms",
            ns as f64 / 1e6,
        ));
    }
    if rec.retries > 0 {
        a.push(KeyValue::new(
            "tollgate.upstream.retries",
            i64::from(rec.retries),
        ));
    }
    let (trace_id, span_id, parent, state) = match trace {
        Some(t) => (
            t.trace_id,
            t.span_id,
            t.parent,
            t.state
                .as_ref()
                .and_then(|s| s.to_str().ok())
                .and_then(|s| s.parse::<TraceState>().ok())
                .unwrap_or_default(),
        ),
        None => (
            super::context::new_trace_id(),
            super::context::new_span_id(),
            None,
            TraceState::default(),
        ),
    };
    SpanData {
        span_context: SpanContext::new(trace_id, span_id, TraceFlags::SAMPLED, false, state),
        parent_span_id: parent.unwrap_or(SpanId::INVALID),
        parent_span_is_remote: parent.is_some(),
        span_kind: SpanKind::Server,
        name: Cow::Owned(name),
        start_time: start,
        end_time: start + rec.duration,
        attributes: a,
        dropped_attributes_count: 0,
        events: SpanEvents::default(),
        links: SpanLinks::default(),
        status,
        instrumentation_scope: scope.clone(),
    }
}
