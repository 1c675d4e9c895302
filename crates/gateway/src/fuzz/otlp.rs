//! `otlp_span`: the hand-written OTLP span encoder against opentelemetry-proto's decoder.
//! A record made from arbitrary bytes is written as an export request, which must decode,
//! hold exactly that span, and say what the record says (credentials left out).

use crate::observe::record::{Names, Record};
use crate::observe::trace::otlp::{self, Batch, SpanWriter};
use crate::observe::trace::{RequestTrace, SpanHead};
use http::{HeaderValue, Method};
use opentelemetry::trace::{SpanId, TraceId};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use prost::Message;
use smallvec::SmallVec;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

/// Names from the input.
#[derive(Debug)]
struct Snap {
    consumer: String,
    credentials: Vec<String>,
}

impl Names for Snap {
    fn consumer_name(&self, _: usize) -> &str {
        &self.consumer
    }

    fn credential_params(&self) -> &[String] {
        &self.credentials
    }
}

/// Input: fields separated by `0xff`: knobs (status, flags, sizes, ids), method, target,
/// client, host, user agent, request id, route, consumer, limit, cache status, upstream
/// target, tracestate, route path, and a credential parameter name.
pub fn otlp_span(data: &[u8]) {
    let mut f = data.split(|b| *b == 0xff);
    let mut next = || f.next().unwrap_or_default();
    let knobs = next();
    let k = |i: usize| knobs.get(i).copied().unwrap_or(0);
    let wide = |i: usize| u64::from_le_bytes(std::array::from_fn(|j| k(i + j)));
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    let header = |b: &[u8]| HeaderValue::from_bytes(b).ok();
    let method = Method::from_bytes(next()).unwrap_or(Method::GET);
    let uri = text(next());
    let client = header(next()).unwrap_or(HeaderValue::from_static("127.0.0.1"));
    let host = next();
    let user_agent = next();
    let request_id = next().to_vec();
    let route = text(next());
    let consumer = text(next());
    let limit = text(next());
    let cache = header(next());
    let target = text(next());
    let state = header(next());
    let route_path = text(next());
    let credential = text(next());
    let flags = k(0);
    let status = 100 + u16::from(k(1)) * 2 + u16::from(k(2) & 1);
    let trace_id = TraceId::from(u128::from(wide(3)) << 64 | u128::from(wide(11)) | 1);
    let span_id = SpanId::from(wide(19) | 1);
    let parent = (flags & 1 != 0).then(|| SpanId::from(wide(27) | 1));
    let on = |bit: u8| flags & (1 << bit) != 0;
    let rec = Record {
        start: Instant::now(),
        request_id: SmallVec::from_slice(&request_id),
        client: client.clone(),
        method: method.clone(),
        uri: SmallVec::from_slice(uri.as_bytes()),
        snap: Arc::new(Snap {
            consumer: consumer.clone(),
            credentials: vec![credential.clone()],
        }),
        route: on(1).then(|| Arc::from(route.as_str())),
        consumer: on(2).then_some(0),
        status,
        bytes_in: on(3).then(|| wide(35)),
        bytes_out: wide(43),
        duration: Duration::from_nanos(wide(51) >> 20),
        upstream_ns: on(4).then(|| wide(59) >> 20),
        target: on(5).then(|| Arc::from(target.as_str())),
        refusal: on(6).then_some("rate_limited"),
        limit: on(6).then(|| Arc::from(limit.as_str())),
        cache: cache.filter(|_| on(7)),
        trace: Some(RequestTrace {
            trace_id,
            span_id,
            sampled: true,
            parent,
            state: state.filter(|_| parent.is_some()),
            id_from_request: flags & 1 == 0 && k(70) & 1 != 0,
        }),
        span_head: (k(67) & 1 != 0).then(|| {
            Box::new(SpanHead {
                host: (!host.is_empty()).then(|| SpanHead::copy(host)),
                user_agent: (!user_agent.is_empty()).then(|| SpanHead::copy(user_agent)),
                version: http::Version::HTTP_11,
                https: k(67) & 2 != 0,
                port: u16::from(k(68)),
                route_path: (k(67) & 4 != 0).then(|| route_path.clone().into()),
            })
        }),
        retries: u32::from(k(69)),
    };
    let end = SystemTime::UNIX_EPOCH + Duration::from_secs(1_795_000_000);
    let mut writer = SpanWriter::new();
    let mut batch = Batch::new(1 << 10);
    // Twice: a writer is reused, and two spans must come out as two.
    batch.push(writer.write(&rec, end));
    batch.push(writer.write(&rec, end));
    let body = otlp::request(
        std::slice::from_mut(&mut batch),
        &otlp::resource("svc"),
        &otlp::scope(),
    );
    let req = ExportTraceServiceRequest::decode(body.as_slice())
        .unwrap_or_else(|e| panic!("not an export request: {e}"));
    assert_eq!(req.resource_spans.len(), 1);
    let rs = &req.resource_spans[0];
    assert_eq!(rs.scope_spans.len(), 1);
    assert_eq!(rs.scope_spans[0].spans.len(), 2);
    assert_eq!(rs.scope_spans[0].spans[0], rs.scope_spans[0].spans[1]);
    let s = &rs.scope_spans[0].spans[0];
    assert_eq!(s.trace_id, trace_id.to_bytes());
    assert_eq!(s.span_id, span_id.to_bytes());
    assert_eq!(
        s.parent_span_id,
        parent.map_or(Vec::new(), |p| p.to_bytes().to_vec())
    );
    assert_eq!(s.kind, 2);
    assert_eq!(
        s.end_time_unix_nano - s.start_time_unix_nano,
        rec.duration.as_nanos() as u64
    );
    let attr = |key: &str| {
        s.attributes
            .iter()
            .find(|kv| kv.key == key)
            .and_then(|kv| kv.value.as_ref()?.value.clone())
    };
    assert_eq!(
        attr("http.response.status_code"),
        Some(Value::IntValue(i64::from(status)))
    );
    let id_from_request = rec.trace.as_ref().is_some_and(|t| t.id_from_request);
    // What a string attribute says: the value, cut at `MAX_VALUE` on a character boundary.
    let said = |v: &str| {
        let mut end = v.len().min(otlp::MAX_VALUE);
        while !v.is_char_boundary(end) {
            end -= 1;
        }
        Value::StringValue(v[..end].to_string())
    };
    assert_eq!(
        attr("tollgate.request_id"),
        (!id_from_request).then(|| said(&text(&request_id)))
    );
    assert_eq!(attr("tollgate.route"), rec.route.as_deref().map(said));
    assert_eq!(
        attr("tollgate.consumer"),
        rec.consumer.map(|_| said(&consumer))
    );
    let (path, _) = uri.split_once('?').unwrap_or((&uri, ""));
    assert_eq!(attr("url.path"), Some(said(path)));
    for kv in &s.attributes {
        if let Some(Value::StringValue(v)) = kv.value.as_ref().and_then(|v| v.value.as_ref()) {
            assert!(
                v.len() <= otlp::MAX_VALUE,
                "{} is {} bytes",
                kv.key,
                v.len()
            );
        }
    }
    if let (Some(h), Some(Value::StringValue(ua))) = (&rec.span_head, attr("user_agent.original")) {
        let kept = h.user_agent.as_ref().expect("a user agent was given");
        assert!(kept.len() <= SpanHead::MAX_VALUE);
        assert!(String::from_utf8_lossy(kept).starts_with(ua.as_str()));
    }
    let plain = !credential.is_empty() && credential.bytes().all(|b| b.is_ascii_alphanumeric());
    if let (Some(Value::StringValue(q)), true) = (attr("url.query"), plain) {
        // A value cut at `MAX_VALUE` may end in a piece cut short, whose name is then only
        // the start of the one sent (a cut `apikey2` reads `api`): not a credential.
        let pieces: Vec<&str> = q.split(['&', ';']).collect();
        let whole = if q.len() + 4 > otlp::MAX_VALUE {
            pieces.len() - 1
        } else {
            pieces.len()
        };
        for piece in &pieces[..whole] {
            let name = piece.split('=').next().unwrap_or_default();
            assert!(
                !name.eq_ignore_ascii_case(&credential),
                "a credential in the query: {q:?}"
            );
        }
    }
    assert_eq!(
        s.status.as_ref().map(|st| st.code),
        (status >= 500).then_some(2)
    );
}
