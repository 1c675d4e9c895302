//! `tracing:`: the OTLP collector, the sampling ratio and the batching of spans.

use super::problems::Problems;
use crate::file;
use crate::model::{OtlpProtocol, TracingConfig};
use std::time::Duration;

/// Validates the `tracing:` section.
pub(crate) fn tracing(t: &file::Tracing, p: &mut Problems) -> TracingConfig {
    let o = &t.otlp;
    let protocol = match o.protocol.as_deref() {
        None | Some("grpc") => OtlpProtocol::Grpc,
        Some("http" | "http/protobuf") => OtlpProtocol::Http,
        Some(other) => {
            p.add(
                "tracing.otlp.protocol",
                format!("{other:?} must be \"grpc\" or \"http\""),
            );
            OtlpProtocol::Grpc
        }
    };
    let endpoint = endpoint(o.endpoint.as_deref(), protocol, p);
    let timeout = o.timeout.map_or(Duration::from_secs(10), |d| d.0);
    if timeout < Duration::from_millis(1) || timeout > Duration::from_secs(60) {
        p.add("tracing.otlp.timeout", "must be between 1ms and 60s");
    }
    let mut headers = Vec::with_capacity(o.headers.len());
    for (name, value) in &o.headers {
        let at = format!("tracing.otlp.headers.{name}");
        let lower = name.to_ascii_lowercase();
        if http::HeaderName::from_bytes(lower.as_bytes()).is_err() {
            p.add(at, "is not a valid header name");
        } else if lower.ends_with("-bin") {
            p.add(
                at,
                "binary gRPC metadata (a name ending in `-bin`) is not supported; use a text header",
            );
        } else if lower.starts_with("grpc-") {
            p.add(at, "names starting with `grpc-` belong to gRPC itself");
        } else if http::HeaderValue::from_str(value).is_err() {
            p.add(at, "the value must be visible ASCII text");
        } else {
            headers.push((lower, value.clone()));
        }
    }
    let sample_ratio = t.sample_ratio.unwrap_or(1.0);
    if !(0.0..=1.0).contains(&sample_ratio) {
        p.add(
            "tracing.sample_ratio",
            "must be between 0 (no new trace recorded) and 1 (every one)",
        );
    }
    let service_name = t.service_name.clone().unwrap_or_else(|| "tollgate".into());
    if service_name.trim().is_empty() {
        p.add("tracing.service_name", "must not be empty");
    }
    let queue_size = o.queue_size.unwrap_or(2048);
    if !(1..=1 << 20).contains(&queue_size) {
        p.add("tracing.otlp.queue_size", "must be between 1 and 1048576");
    }
    let batch_size = o.batch_size.unwrap_or(512.min(queue_size));
    if batch_size == 0 || batch_size > queue_size {
        p.add(
            "tracing.otlp.batch_size",
            "must be between 1 and `queue_size`",
        );
    }
    let export_interval = o.export_interval.map_or(Duration::from_secs(1), |d| d.0);
    if export_interval < Duration::from_millis(10) || export_interval > Duration::from_secs(60) {
        p.add(
            "tracing.otlp.export_interval",
            "must be between 10ms and 60s",
        );
    }
    TracingConfig {
        endpoint,
        protocol,
        timeout,
        headers,
        sample_ratio,
        service_name,
        queue_size,
        batch_size,
        export_interval,
    }
}

/// The collector's URL: `http://` or `https://` with a host. For OTLP/HTTP a URL without
/// a path gets `/v1/traces`, as the OpenTelemetry exporters do with a base endpoint.
fn endpoint(given: Option<&str>, protocol: OtlpProtocol, p: &mut Problems) -> String {
    let Some(given) = given else {
        return match protocol {
            OtlpProtocol::Grpc => "http://localhost:4317".into(),
            OtlpProtocol::Http => "http://localhost:4318/v1/traces".into(),
        };
    };
    let uri = match given.parse::<http::Uri>() {
        Ok(u) => u,
        Err(e) => {
            p.add(
                "tracing.otlp.endpoint",
                format!("{:?} is not a URL: {e}", crate::redacted_url(given)),
            );
            return given.into();
        }
    };
    if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.host().is_none() {
        p.add(
            "tracing.otlp.endpoint",
            format!(
                "{:?} must be an http:// or https:// URL with a host",
                crate::redacted_url(given)
            ),
        );
        return given.into();
    }
    // The exporter sends no user info: credentials go in `headers`.
    if uri.authority().is_some_and(|a| a.as_str().contains('@')) {
        p.warn(
            "tracing.otlp.endpoint",
            "user info in the URL is not sent to the collector: give credentials in `tracing.otlp.headers` (e.g. `authorization: Basic …`)",
        );
    }
    let bare = matches!(uri.path(), "" | "/") && uri.query().is_none();
    match protocol {
        OtlpProtocol::Http if bare => format!("{}/v1/traces", given.trim_end_matches('/')),
        _ => given.into(),
    }
}
