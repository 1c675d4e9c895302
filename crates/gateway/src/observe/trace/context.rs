//! W3C Trace Context on the request path: the client's `traceparent`/`tracestate` read
//! (through OpenTelemetry's propagator) when the listener trusts the client, and the
//! gateway's own `traceparent` sent upstream, its span as the parent.

use crate::exchange::Fields;
use crate::observe::request_id::{hex16, hex32};
use http::{HeaderName, HeaderValue, Version};
use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceId};
use opentelemetry::Context;
use opentelemetry_sdk::propagation::TraceContextPropagator;

/// `traceparent`.
pub const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
/// `tracestate`.
pub const TRACESTATE: HeaderName = HeaderName::from_static("tracestate");

/// The trace a request belongs to and the gateway's span in it.
#[derive(Debug, Clone)]
pub struct RequestTrace {
    /// The trace: the client's, when continued, or a new one.
    pub trace_id: TraceId,
    /// The gateway's span for this request.
    pub span_id: SpanId,
    /// Whether the span is recorded and exported (and says so upstream).
    pub sampled: bool,
    /// The client's span, when its trace is continued.
    pub parent: Option<SpanId>,
    /// The client's `tracestate`, passed upstream unchanged, when its trace is continued.
    pub state: Option<HeaderValue>,
    /// The trace id is the request id's bits (both made by the gateway): the span need not
    /// say the request id again.
    pub id_from_request: bool,
}

impl RequestTrace {
    /// The `traceparent` sent upstream: this trace, the gateway's span as the parent, as
    /// the header's bytes (the lean upstream client writes them into the request head).
    pub fn traceparent(&self) -> [u8; 55] {
        let mut out = *b"00-00000000000000000000000000000000-0000000000000000-00";
        out[3..35].copy_from_slice(&hex32(u128::from_be_bytes(self.trace_id.to_bytes())));
        out[36..52].copy_from_slice(&hex16(u64::from_be_bytes(self.span_id.to_bytes())));
        if self.sampled {
            out[54] = b'1';
        }
        out
    }

    /// Readies the request's headers for the upstream: the client's trace headers off
    /// (the gateway's `traceparent` replaces them), and a continued trace's `tracestate`
    /// on. Most requests carry none: a look at the names spares them two lookups.
    pub fn prepare(&self, headers: &mut Fields) {
        if headers.names().any(|k| {
            k.eq_ignore_ascii_case(TRACEPARENT.as_str().as_bytes())
                || k.eq_ignore_ascii_case(TRACESTATE.as_str().as_bytes())
        }) {
            headers.remove(TRACEPARENT);
            headers.remove(TRACESTATE);
        }
        if let Some(s) = &self.state {
            headers.insert(TRACESTATE, s.clone());
        }
    }
}

/// What a recorded span tells of the request head beyond the access log's record. Copies,
/// cut at [`SpanHead::MAX_VALUE`]: a header value would hold the connection's whole read
/// buffer for as long as the span waits for export.
#[derive(Debug, Clone)]
pub struct SpanHead {
    /// `Host` (or HTTP/2's `:authority`).
    pub host: Option<smallvec::SmallVec<[u8; 32]>>,
    /// `User-Agent`.
    pub user_agent: Option<smallvec::SmallVec<[u8; 64]>>,
    /// The client's HTTP version.
    pub version: Version,
    /// The client came over TLS.
    pub https: bool,
    /// The listener's port.
    pub port: u16,
    /// The matched route's path, as a trace names it (`/v1/*`, `/health`).
    pub route_path: Option<std::sync::Arc<str>>,
}

impl SpanHead {
    /// The most bytes of a header value a span keeps.
    pub const MAX_VALUE: usize = 512;

    /// A bounded copy of `v`.
    pub fn copy<const N: usize>(v: &[u8]) -> smallvec::SmallVec<[u8; N]> {
        smallvec::SmallVec::from_slice(&v[..v.len().min(Self::MAX_VALUE)])
    }
}

/// A new trace id: random, never zero (zero means "none" in W3C).
pub fn new_trace_id() -> TraceId {
    TraceId::from(fastrand::u128(1..))
}

/// A new span id, never zero.
pub fn new_span_id() -> SpanId {
    SpanId::from(fastrand::u64(1..))
}

/// Headers as OpenTelemetry's propagator reads them; `tracestate` sent as several fields
/// is read as their one combined list (W3C Trace Context §3.3.1).
struct Headers<'a> {
    map: &'a Fields,
    state: Option<String>,
}

impl<'a> Headers<'a> {
    fn new(map: &'a Fields) -> Self {
        let mut all = map.get_all(TRACESTATE).iter();
        let state = match (all.next(), all.next()) {
            (Some(_), Some(_)) => Some(
                map.get_all(TRACESTATE)
                    .iter()
                    .filter_map(|v| v.to_str().ok())
                    .collect::<Vec<_>>()
                    .join(","),
            ),
            _ => None,
        };
        Headers { map, state }
    }
}

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        if let (Some(s), true) = (&self.state, key.eq_ignore_ascii_case("tracestate")) {
            return Some(s);
        }
        self.map.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.map
            .names()
            .filter_map(|n| std::str::from_utf8(n).ok())
            .collect()
    }
}

/// The client's trace context, when `traceparent` is valid: as a context the sampler
/// reads (its remote span), with its `tracestate` as a header to pass on.
pub fn extract(headers: &Fields) -> Option<(Context, Option<HeaderValue>)> {
    // Most requests carry none: no propagator, no context for them.
    if !headers.contains_key(TRACEPARENT) {
        return None;
    }
    // Two `traceparent` fields cannot be told apart: W3C says to start a new trace.
    let mut all = headers.get_all(TRACEPARENT).iter();
    if let (Some(_), Some(_)) = (all.next(), all.next()) {
        return None;
    }
    let cx = TraceContextPropagator::new().extract(&Headers::new(headers));
    let state = {
        let span = cx.span();
        let sc: &SpanContext = span.span_context();
        if !sc.is_valid() {
            return None;
        }
        let state = sc.trace_state().header();
        (!state.is_empty())
            .then(|| HeaderValue::from_str(&state).ok())
            .flatten()
    };
    Some((cx, state))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn traced(t: &str, s: &str) -> RequestTrace {
        RequestTrace {
            trace_id: TraceId::from_hex(t).expect("hex"),
            span_id: SpanId::from_hex(s).expect("hex"),
            sampled: true,
            parent: None,
            state: None,
            id_from_request: false,
        }
    }

    #[test]
    fn traceparent_is_the_w3c_form() {
        let t = traced("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7");
        assert_eq!(
            &t.traceparent(),
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        );
        let t = RequestTrace {
            sampled: false,
            ..traced("00000000000000000000000000000001", "0000000000000002")
        };
        assert_eq!(
            &t.traceparent(),
            b"00-00000000000000000000000000000001-0000000000000002-00"
        );
    }

    #[test]
    fn a_valid_parent_is_read_with_its_state_and_a_bad_one_is_not() {
        let mut h = Fields::default();
        assert!(extract(&h).is_none());
        h.insert(
            TRACEPARENT,
            HeaderValue::from_static("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
        );
        h.insert(TRACESTATE, HeaderValue::from_static("congo=t61rcWkgMzE"));
        let (cx, state) = extract(&h).expect("valid");
        let sc = cx.span().span_context().clone();
        assert_eq!(
            sc.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(sc.span_id().to_string(), "00f067aa0ba902b7");
        assert!(sc.is_sampled() && sc.is_remote());
        assert_eq!(state.expect("state"), "congo=t61rcWkgMzE");
        for bad in [
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "garbage",
        ] {
            h.insert(TRACEPARENT, HeaderValue::from_static(bad));
            assert!(extract(&h).is_none(), "{bad}");
        }
        h.insert(
            TRACEPARENT,
            HeaderValue::from_static("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
        );
        h.append(
            TRACEPARENT,
            HeaderValue::from_static("00-4bf92f3577b34da6a3ce929d0e0e4737-00f067aa0ba902b7-01"),
        );
        assert!(extract(&h).is_none(), "two parents: a new trace");
        h.remove(TRACEPARENT);
        h.insert(
            TRACEPARENT,
            HeaderValue::from_static("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
        );
        h.append(
            TRACESTATE,
            HeaderValue::from_static("rojo=00f067aa0ba902b7"),
        );
        let (_, state) = extract(&h).expect("valid");
        assert_eq!(
            state.expect("state"),
            "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7",
            "several tracestate fields are one list"
        );
    }
}
