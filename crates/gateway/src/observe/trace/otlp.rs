//! A finished request as an OTLP span, written straight from its record into the
//! protobuf bytes of an `ExportTraceServiceRequest` (opentelemetry-proto's
//! `collector/trace/v1`): the HTTP semantic conventions' required and recommended
//! attributes (not the opt-in ones, such as body sizes: the access log has those; nor
//! `network.protocol.name`, which the conventions leave out for `http`), then the
//! gateway's own (`tollgate.*`).
//!
//! Written by hand because it is the whole cost of a recorded span: going through the
//! OpenTelemetry SDK's `SpanData` and the OTLP exporter's conversion and encoding cost about
//! 37,000 instructions per span (prost computes nested lengths again at every level, and
//! every string is copied twice), against about 25,000 for the whole proxied request
//! (callgrind, scenario 1, `docs/benchmarks.md`). Here each nested message's length is
//! known before it is written, or the message is written to a scratch buffer once. The
//! `otlp_span` fuzz target decodes what this writes with opentelemetry-proto and compares.

use crate::observe::record::Record;
use std::borrow::Cow;
use std::time::{SystemTime, UNIX_EPOCH};

/// Wire types.
const VARINT: u8 = 0;
const I64: u8 = 1;
const LEN: u8 = 2;
const I32: u8 = 5;

/// `Span.kind`: SERVER.
const KIND_SERVER: u64 = 2;
/// `Status.code`: ERROR.
const STATUS_ERROR: u64 = 2;
/// `Span.flags`: the W3C flags (sampled) and "whether the parent is remote is known".
const FLAG_SAMPLED: u32 = 0x01;
const FLAG_HAS_IS_REMOTE: u32 = 0x100;
const FLAG_IS_REMOTE: u32 = 0x200;

/// Methods the conventions name as they are; any other is `_OTHER` with its original.
const KNOWN: [&str; 9] = [
    "GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH",
];

#[inline]
fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

#[inline]
fn varint_len(v: u64) -> usize {
    (64 - (v | 1).leading_zeros() as usize).div_ceil(7)
}

#[inline]
fn tag(out: &mut Vec<u8>, field: u32, wire: u8) {
    varint(out, u64::from(field << 3 | u32::from(wire)));
}

#[inline]
fn len_field(out: &mut Vec<u8>, field: u32, b: &[u8]) {
    tag(out, field, LEN);
    varint(out, b.len() as u64);
    out.extend_from_slice(b);
}

#[inline]
fn fixed64(out: &mut Vec<u8>, field: u32, v: u64) {
    tag(out, field, I64);
    out.extend_from_slice(&v.to_le_bytes());
}

/// An attribute's key as written: `KeyValue.key`'s tag and length, then the name, made at
/// compile time, so that writing it is one copy.
struct Key {
    bytes: [u8; 40],
    len: usize,
}

const fn key(name: &str) -> Key {
    let b = name.as_bytes();
    assert!(b.len() <= 38);
    let mut bytes = [0u8; 40];
    bytes[0] = 0x0a; // field 1, length-delimited
    bytes[1] = b.len() as u8;
    let mut i = 0;
    while i < b.len() {
        bytes[2 + i] = b[i];
        i += 1;
    }
    Key {
        bytes,
        len: b.len() + 2,
    }
}

const K_CLIENT_ADDRESS: Key = key("client.address");
const K_ERROR_TYPE: Key = key("error.type");
const K_HTTP_REQUEST_METHOD: Key = key("http.request.method");
const K_HTTP_REQUEST_METHOD_ORIGINAL: Key = key("http.request.method_original");
const K_HTTP_RESPONSE_STATUS_CODE: Key = key("http.response.status_code");
const K_HTTP_ROUTE: Key = key("http.route");
const K_NETWORK_PROTOCOL_VERSION: Key = key("network.protocol.version");
const K_SERVER_ADDRESS: Key = key("server.address");
const K_SERVER_PORT: Key = key("server.port");
const K_SERVICE_NAME: Key = key("service.name");
const K_SERVICE_VERSION: Key = key("service.version");
const K_TELEMETRY_SDK_LANGUAGE: Key = key("telemetry.sdk.language");
const K_TOLLGATE_CACHE_STATUS: Key = key("tollgate.cache_status");
const K_TOLLGATE_CONSUMER: Key = key("tollgate.consumer");
const K_TOLLGATE_LIMIT: Key = key("tollgate.limit");
const K_TOLLGATE_REFUSAL: Key = key("tollgate.refusal");
const K_TOLLGATE_REQUEST_ID: Key = key("tollgate.request_id");
const K_TOLLGATE_ROUTE: Key = key("tollgate.route");
const K_TOLLGATE_UPSTREAM_DURATION_MS: Key = key("tollgate.upstream.duration_ms");
const K_TOLLGATE_UPSTREAM_RETRIES: Key = key("tollgate.upstream.retries");
const K_TOLLGATE_UPSTREAM_TARGET: Key = key("tollgate.upstream.target");
const K_URL_PATH: Key = key("url.path");
const K_URL_QUERY: Key = key("url.query");
const K_URL_SCHEME: Key = key("url.scheme");
const K_USER_AGENT_ORIGINAL: Key = key("user_agent.original");

/// An attribute's value.
enum Val<'a> {
    Str(&'a str),
    /// Bytes known to be UTF-8 (from [`text`]).
    Text(&'a [u8]),
    Int(i64),
    Double(f64),
}

/// A `KeyValue` in `field` (9 for a span's attributes, 1 for a resource's). All tags here
/// are one byte, so every length is known before it is written.
#[inline(always)]
fn attr(out: &mut Vec<u8>, field: u32, key: &Key, v: Val<'_>) {
    let v = match v {
        Val::Str(s) => Val::Text(cut(s.as_bytes())),
        Val::Text(b) => Val::Text(cut(b)),
        other => other,
    };
    let any = match &v {
        Val::Str(s) => 1 + varint_len(s.len() as u64) + s.len(),
        Val::Text(s) => 1 + varint_len(s.len() as u64) + s.len(),
        Val::Int(i) => 1 + varint_len(*i as u64),
        Val::Double(_) => 9,
    };
    let kv = key.len + 1 + varint_len(any as u64) + any;
    let field_tag = field << 3 | u32::from(LEN);
    if let (Ok(t @ 0..=127), Ok(kv @ 0..=127), Ok(any @ 0..=127), Val::Text(s)) = (
        u8::try_from(field_tag),
        u8::try_from(kv),
        u8::try_from(any),
        &v,
    ) {
        // Nearly every attribute: every tag and length one byte, each run of them copied
        // as one piece of known size (no call per byte, no `memcpy` call for them).
        out.extend_from_slice(&[t, kv]);
        out.extend_from_slice(&key.bytes[..key.len]);
        out.extend_from_slice(&[2 << 3 | LEN, any, 1 << 3 | LEN, s.len() as u8]);
        out.extend_from_slice(s);
        return;
    }
    tag(out, field, LEN);
    varint(out, kv as u64);
    out.extend_from_slice(&key.bytes[..key.len]);
    tag(out, 2, LEN);
    varint(out, any as u64);
    match v {
        Val::Str(s) => len_field(out, 1, s.as_bytes()),
        Val::Text(s) => len_field(out, 1, s),
        Val::Int(i) => {
            tag(out, 3, VARINT);
            varint(out, i as u64);
        }
        Val::Double(d) => {
            tag(out, 4, I64);
            out.extend_from_slice(&d.to_le_bytes());
        }
    }
}

/// The most bytes of an attribute's string value (as OpenTelemetry's
/// `attribute_value_length_limit`): a long target or header value is cut there, so that a
/// client cannot make a batch too large for the collector to take.
pub(crate) const MAX_VALUE: usize = 1024;

/// UTF-8 bytes cut to [`MAX_VALUE`] bytes, at a character boundary (never inside a
/// character's continuation bytes, `10xxxxxx`).
fn cut(s: &[u8]) -> &[u8] {
    if s.len() <= MAX_VALUE {
        return s;
    }
    let mut end = MAX_VALUE;
    while end > 0 && s[end] & 0xC0 == 0x80 {
        end -= 1;
    }
    &s[..end]
}

/// Bytes as protobuf's `string` needs them: UTF-8 (anything else replaced, as a decoder
/// refuses the whole message over one bad byte).
fn utf8(b: &[u8]) -> Cow<'_, str> {
    // The check first (fast over ASCII); the lossy copy only for what fails it.
    std::str::from_utf8(b).map_or_else(|_| String::from_utf8_lossy(b), Cow::Borrowed)
}

/// [`utf8`] as bytes, for values written as they are: ASCII (nearly every header value,
/// address and path) passes a check of a word at a time without `from_utf8`'s work.
fn text(b: &[u8]) -> Cow<'_, [u8]> {
    if b.is_ascii() {
        return Cow::Borrowed(b);
    }
    match utf8(b) {
        Cow::Borrowed(s) => Cow::Borrowed(s.as_bytes()),
        Cow::Owned(s) => Cow::Owned(s.into_bytes()),
    }
}

fn nanos(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// Writes spans, one at a time, into a buffer of its own: each request thread has one,
/// so a span is written while its record is still in the cache, outside any lock.
pub(crate) struct SpanWriter {
    /// The span being written.
    scratch: Vec<u8>,
    /// The query without its credentials.
    query: String,
}

impl SpanWriter {
    pub(crate) fn new() -> Self {
        SpanWriter {
            scratch: Vec::with_capacity(2 << 10),
            query: String::new(),
        }
    }

    /// `rec`'s span (the body of a `Span` message); it ended at `end` (wall clock), its
    /// `duration` after it arrived.
    pub(crate) fn write(&mut self, rec: &Record, end: SystemTime) -> &[u8] {
        let mut s = std::mem::take(&mut self.scratch);
        s.clear();
        self.write_span(&mut s, rec, end);
        // A span of unusually large values does not keep its buffer.
        if s.capacity() > 16 << 10 {
            s.shrink_to(2 << 10);
        }
        self.scratch = s;
        &self.scratch
    }

    fn write_span(&mut self, s: &mut Vec<u8>, rec: &Record, end: SystemTime) {
        let trace = rec.trace.as_ref();
        if let Some(t) = trace {
            len_field(s, 1, &t.trace_id.to_bytes());
            len_field(s, 2, &t.span_id.to_bytes());
            if let Some(state) = t.state.as_ref() {
                len_field(s, 3, utf8(state.as_bytes()).as_bytes());
            }
            if let Some(p) = t.parent {
                len_field(s, 4, &p.to_bytes());
            }
        }
        let method = rec.method.as_str();
        let route_path = rec.span_head.as_ref().and_then(|h| h.route_path.as_deref());
        // `name`: the method and the matched route's path.
        let name_len = method.len() + route_path.map_or(0, |r| 1 + r.len());
        tag(s, 5, LEN);
        varint(s, name_len as u64);
        s.extend_from_slice(method.as_bytes());
        if let Some(r) = route_path {
            s.push(b' ');
            s.extend_from_slice(r.as_bytes());
        }
        tag(s, 6, VARINT);
        varint(s, KIND_SERVER);
        let end_ns = nanos(end);
        let took = u64::try_from(rec.duration.as_nanos()).unwrap_or(u64::MAX);
        fixed64(s, 7, end_ns.saturating_sub(took));
        fixed64(s, 8, end_ns);

        if KNOWN.contains(&method) {
            attr(s, 9, &K_HTTP_REQUEST_METHOD, Val::Str(method));
        } else {
            attr(s, 9, &K_HTTP_REQUEST_METHOD, Val::Str("_OTHER"));
            attr(s, 9, &K_HTTP_REQUEST_METHOD_ORIGINAL, Val::Str(method));
        }
        let (path, query) = match rec.uri.iter().position(|&b| b == b'?') {
            Some(at) => (&rec.uri[..at], &rec.uri[at + 1..]),
            None => (&rec.uri[..], &[][..]),
        };
        attr(s, 9, &K_URL_PATH, Val::Text(&text(path)));
        if !query.is_empty() {
            let query = utf8(query);
            let q = &mut self.query;
            q.clear();
            crate::query::kept_pieces(&query, rec.snap.credential_params(), |sep, piece| {
                if sep != b'?' {
                    q.push(char::from(sep));
                }
                q.push_str(piece);
            });
            if !q.is_empty() {
                attr(s, 9, &K_URL_QUERY, Val::Str(q));
            }
        }
        attr(
            s,
            9,
            &K_HTTP_RESPONSE_STATUS_CODE,
            Val::Int(i64::from(rec.status)),
        );
        attr(
            s,
            9,
            &K_CLIENT_ADDRESS,
            Val::Text(&text(rec.client.as_bytes())),
        );
        if let Some(h) = &rec.span_head {
            attr(
                s,
                9,
                &K_URL_SCHEME,
                Val::Str(if h.https { "https" } else { "http" }),
            );
            let version = match h.version {
                http::Version::HTTP_10 => "1.0",
                http::Version::HTTP_2 => "2",
                http::Version::HTTP_3 => "3",
                _ => "1.1",
            };
            attr(s, 9, &K_NETWORK_PROTOCOL_VERSION, Val::Str(version));
            if let Some(host) = &h.host {
                let host = text(host);
                let (name, port) = split_host(&host);
                attr(s, 9, &K_SERVER_ADDRESS, Val::Text(name));
                attr(
                    s,
                    9,
                    &K_SERVER_PORT,
                    Val::Int(port.map_or(i64::from(h.port), i64::from)),
                );
            }
            if let Some(ua) = &h.user_agent {
                attr(s, 9, &K_USER_AGENT_ORIGINAL, Val::Text(&text(ua)));
            }
            if let Some(r) = route_path {
                attr(s, 9, &K_HTTP_ROUTE, Val::Str(r));
            }
        }
        let error = rec.status >= 500;
        if error {
            let mut b = itoa::Buffer::new();
            attr(s, 9, &K_ERROR_TYPE, Val::Str(b.format(rec.status)));
        }
        // A request id the gateway made is the trace id: said once.
        if !trace.is_some_and(|t| t.id_from_request) {
            attr(
                s,
                9,
                &K_TOLLGATE_REQUEST_ID,
                Val::Text(&text(&rec.request_id)),
            );
        }
        if let Some(r) = &rec.route {
            attr(s, 9, &K_TOLLGATE_ROUTE, Val::Str(r));
        }
        if let Some(c) = rec.consumer {
            attr(
                s,
                9,
                &K_TOLLGATE_CONSUMER,
                Val::Str(rec.snap.consumer_name(c)),
            );
        }
        if let Some(r) = rec.refusal {
            attr(s, 9, &K_TOLLGATE_REFUSAL, Val::Str(r));
        }
        if let Some(l) = &rec.limit {
            attr(s, 9, &K_TOLLGATE_LIMIT, Val::Str(l));
        }
        if let Some(c) = &rec.cache {
            attr(
                s,
                9,
                &K_TOLLGATE_CACHE_STATUS,
                Val::Text(&text(c.as_bytes())),
            );
        }
        if let Some(t) = &rec.target {
            attr(s, 9, &K_TOLLGATE_UPSTREAM_TARGET, Val::Str(t));
        }
        if let Some(ns) = rec.upstream_ns {
            attr(
                s,
                9,
                &K_TOLLGATE_UPSTREAM_DURATION_MS,
                Val::Double(ns as f64 / 1e6),
            );
        }
        if rec.retries > 0 {
            attr(
                s,
                9,
                &K_TOLLGATE_UPSTREAM_RETRIES,
                Val::Int(i64::from(rec.retries)),
            );
        }
        if error {
            // Status { code = 3: ERROR }.
            tag(s, 15, LEN);
            varint(s, 2);
            tag(s, 3, VARINT);
            varint(s, STATUS_ERROR);
        }
        let mut flags = FLAG_SAMPLED | FLAG_HAS_IS_REMOTE;
        if trace.is_some_and(|t| t.parent.is_some()) {
            flags |= FLAG_IS_REMOTE;
        }
        tag(s, 16, I32);
        s.extend_from_slice(&flags.to_le_bytes());
    }
}

/// Spans written one after another, then wrapped into one export request.
pub(crate) struct Batch {
    /// `ScopeSpans.spans` fields, each with its tag and length.
    spans: Vec<u8>,
    /// Spans written.
    pub(crate) count: usize,
}

impl Batch {
    /// A batch with room for `bytes` of spans.
    pub(crate) fn new(bytes: usize) -> Self {
        Batch {
            spans: Vec::with_capacity(bytes),
            count: 0,
        }
    }

    /// Adds a span written by [`SpanWriter::write`].
    pub(crate) fn push(&mut self, span: &[u8]) {
        tag(&mut self.spans, 2, LEN);
        varint(&mut self.spans, span.len() as u64);
        self.spans.extend_from_slice(span);
        self.count += 1;
    }

    /// Bytes of the spans written so far.
    pub(crate) fn bytes(&self) -> usize {
        self.spans.len()
    }
}

/// One export request of the spans of `batches`, in order, under `resource` and `scope`
/// (each a message's encoded body); the batches are empty again after.
pub(crate) fn request(batches: &mut [Batch], resource: &[u8], scope: &[u8]) -> Vec<u8> {
    let spans: usize = batches.iter().map(Batch::bytes).sum();
    let scope_spans = 1 + varint_len(scope.len() as u64) + scope.len() + spans;
    let resource_spans = 1
        + varint_len(resource.len() as u64)
        + resource.len()
        + 1
        + varint_len(scope_spans as u64)
        + scope_spans;
    let mut out = Vec::with_capacity(resource_spans + 8);
    tag(&mut out, 1, LEN);
    varint(&mut out, resource_spans as u64);
    len_field(&mut out, 1, resource);
    tag(&mut out, 2, LEN);
    varint(&mut out, scope_spans as u64);
    len_field(&mut out, 1, scope);
    for b in batches {
        out.extend_from_slice(&b.spans);
        b.spans.clear();
        b.count = 0;
    }
    out
}

/// `host[:port]` or `[v6]:port`, split; a port that is no number (digits only, at most
/// 65535) is part of the name.
fn split_host(host: &[u8]) -> (&[u8], Option<u16>) {
    if let Some(at) = host.iter().rposition(|&b| b == b':') {
        let (name, port) = (&host[..at], &host[at + 1..]);
        let bracketed = name.first() == Some(&b'[') && name.last() == Some(&b']');
        if (bracketed || !name.contains(&b':')) && !port.is_empty() {
            // Digits only, leading zeros allowed, at most 65535.
            let n = port.iter().try_fold(0u16, |n, &d| {
                let digit = d.checked_sub(b'0').filter(|d| *d <= 9)?;
                n.checked_mul(10)?.checked_add(u16::from(digit))
            });
            if let Some(p) = n {
                return (name, Some(p));
            }
        }
    }
    (host, None)
}

/// The encoded body of the `Resource` every span belongs to: `service.name` and the
/// gateway's version.
pub(crate) fn resource(service_name: &str) -> Vec<u8> {
    let mut r = Vec::new();
    attr(&mut r, 1, &K_SERVICE_NAME, Val::Str(service_name));
    attr(
        &mut r,
        1,
        &K_SERVICE_VERSION,
        Val::Str(env!("CARGO_PKG_VERSION")),
    );
    attr(&mut r, 1, &K_TELEMETRY_SDK_LANGUAGE, Val::Str("rust"));
    r
}

/// The encoded body of the `InstrumentationScope`: `tollgate` and its version.
pub(crate) fn scope() -> Vec<u8> {
    let mut s = Vec::new();
    len_field(&mut s, 1, b"tollgate");
    len_field(&mut s, 2, env!("CARGO_PKG_VERSION").as_bytes());
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varint_lengths_match_what_is_written() {
        for v in [
            0u64,
            1,
            127,
            128,
            16_383,
            16_384,
            u64::from(u32::MAX),
            u64::MAX,
        ] {
            let mut out = Vec::new();
            varint(&mut out, v);
            assert_eq!(out.len(), varint_len(v), "{v}");
        }
    }

    #[test]
    fn hosts_split_into_name_and_port() {
        assert_eq!(
            split_host(b"api.example.com:8443"),
            (&b"api.example.com"[..], Some(8443))
        );
        assert_eq!(
            split_host(b"api.example.com"),
            (&b"api.example.com"[..], None)
        );
        assert_eq!(split_host(b"[::1]:80"), (&b"[::1]"[..], Some(80)));
        assert_eq!(split_host(b"[::1]"), (&b"[::1]"[..], None));
        assert_eq!(split_host(b"::1"), (&b"::1"[..], None));
        assert_eq!(split_host(b"h:x"), (&b"h:x"[..], None));
        assert_eq!(split_host(b"h:65536"), (&b"h:65536"[..], None));
        assert_eq!(split_host(b"h:+80"), (&b"h:+80"[..], None));
        assert_eq!(split_host(b"h:"), (&b"h:"[..], None));
        assert_eq!(split_host(b"h:065535"), (&b"h"[..], Some(65535)));
        assert_eq!(split_host(b"h:00000080"), (&b"h"[..], Some(80)));
        assert_eq!(split_host(b"h:8 0"), (&b"h:8 0"[..], None));
    }
}
