//! The request readied for its hop upstream: the path with a route's prefix removed,
//! the `X-Forwarded-*` headers, and what each client needs to send it.

use super::headers::{put, rewrite_request, Forwarding};
use super::target::{AnsweredBy, At, IdIn};
use crate::exchange::{Fields, Parts};
use http::header::{self, HeaderValue};
use http::uri::PathAndQuery;
use http::Method;
use std::sync::Arc;
use std::time::Duration;
/// A route's path prefix removed before forwarding.
#[derive(Clone, Debug)]
pub struct Strip {
    /// The route's `path_prefix`.
    pub prefix: Arc<str>,
    /// The route matches its path in any ASCII case, so the prefix is removed in any case.
    pub any_case: bool,
}

/// How to rewrite a request for its hop upstream.
pub struct Hop<'a> {
    /// The client's IP, appended to `X-Forwarded-For`.
    pub peer_ip: &'a HeaderValue,
    /// The client is a trusted proxy: its `X-Forwarded-*` headers are kept.
    pub trusted: bool,
    /// The client came over TLS (`X-Forwarded-Proto: https`).
    pub https: bool,
    /// Prefix to remove from the path, if the route strips one.
    pub strip_prefix: Option<&'a Strip>,
    /// Keep the client's `Host`.
    pub preserve_host: bool,
    /// Largest body accepted.
    pub max_body: u64,
    /// Longest wait for the next piece of the request body.
    pub body_timeout: Duration,
    /// Stream the request body at once instead of reading up to [`BUFFER`](super::body::BUFFER) first.
    pub stream_body: bool,
    /// The route's name, for logs.
    pub route: &'a str,
    /// Where to note the target that answered, when the access log wants it.
    pub note_target: Option<&'a AnsweredBy>,
    /// The W3C `traceparent` to send (the gateway's span as the parent), when tracing is
    /// on. The lean HTTP/1.1 client writes it straight into the request head; the others
    /// take it as a header.
    pub traceparent: Option<[u8; 55]>,
}

impl Hop<'_> {
    /// What a failure's log line says of this request: its route, and its id from the
    /// `X-Request-Id` the gateway put on the request it sends.
    pub(super) fn at<'h>(&'h self, request_id: IdIn<'h>) -> At<'h> {
        At {
            route: self.route,
            request_id,
        }
    }
}

impl Hop<'_> {
    /// Puts the `traceparent` on `headers`, for the clients that send a header map.
    pub(super) fn put_traceparent(&self, headers: &mut http::HeaderMap) {
        if let Some(v) = self
            .traceparent
            .and_then(|t| HeaderValue::from_bytes(&t).ok())
        {
            headers.insert(crate::observe::trace::context::TRACEPARENT, v);
        }
    }
}

pub(super) fn is_idempotent(m: &Method) -> bool {
    matches!(
        *m,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::PUT | Method::DELETE | Method::TRACE
    )
}

/// The path and query sent upstream: the request's, less the first `end` bytes of its
/// path (the prefix a route strips, found by [`prefix_end`]), keeping a leading `/`.
pub(super) fn path_and_query(pq: PathAndQuery, end: Option<usize>) -> PathAndQuery {
    let Some(end) = end else {
        return pq;
    };
    let rest = &pq.path()[end..];
    let mut s = String::with_capacity(pq.as_str().len() + 1);
    if !rest.starts_with('/') {
        s.push('/');
    }
    s.push_str(rest);
    if let Some(q) = pq.query() {
        s.push('?');
        s.push_str(q);
    }
    PathAndQuery::try_from(s).unwrap_or(pq)
}

/// Where `prefix` ends in `path`, matched as routing matches it: a segment's `;`
/// parameters are not part of its name, and `any_case` compares ASCII letters in any case.
/// A segment the prefix takes whole takes its parameters with it (`/orders;v=1/7` less
/// `/orders` is `/7`); an empty segment's (`/cart/;jsessionid=1` less `/cart/`) stay.
fn prefix_end(path: &str, prefix: &str, any_case: bool) -> Option<usize> {
    let (p, want) = (path.as_bytes(), prefix.as_bytes());
    let params_end = |i: usize| {
        p[i..]
            .iter()
            .position(|&b| b == b'/')
            .map_or(p.len(), |n| i + n)
    };
    let mut i = 0;
    for &w in want {
        if p.get(i) == Some(&b';') && i > 0 && p[i - 1] != b'/' {
            i = params_end(i);
        }
        let c = *p.get(i)?;
        if c != w && !(any_case && c.eq_ignore_ascii_case(&w)) {
            return None;
        }
        i += 1;
    }
    if p.get(i) == Some(&b';') && i > 0 && p[i - 1] != b'/' {
        i = params_end(i);
    }
    Some(i)
}

const X_FORWARDED_PREFIX: http::HeaderName = http::HeaderName::from_static("x-forwarded-prefix");

/// The `X-Forwarded-Prefix` of a route that strips its prefix: the part of the client's
/// path taken off, as the client spelled it and without its trailing `/` (`/v1/users` on
/// `path_prefix: /v1/` → `/v1`), so the backend can make its links whole again (Spring,
/// ASP.NET and Traefik read it; Kong sets it too). None for a prefix of `/` alone. A
/// trusted proxy's own (kept, as the rest of its family) comes first: the backend's links
/// need both parts (`/outer` then `/v1` → `/outer/v1`).
fn stripped(path: &str, end: Option<usize>, h: &Fields, trusted: bool) -> Option<HeaderValue> {
    let taken = path[..end?].trim_end_matches('/');
    if taken.is_empty() {
        return None;
    }
    // Looked for only behind a trusted proxy: a scan of the names, on a route that strips.
    let outer = trusted
        .then(|| h.get(X_FORWARDED_PREFIX))
        .flatten()
        .map(|v| v.as_bytes().trim_ascii());
    match outer {
        None => HeaderValue::from_str(taken).ok(),
        Some(outer) => {
            let outer = outer.strip_suffix(b"/").unwrap_or(outer);
            let mut both = Vec::with_capacity(outer.len() + taken.len());
            both.extend_from_slice(outer);
            both.extend_from_slice(taken.as_bytes());
            HeaderValue::from_bytes(&both).ok()
        }
    }
}

/// A request readied for the hop, once; only `Host` changes from one target to the next.
pub(super) struct HopRequest {
    pub(super) method: Method,
    pub(super) pq: PathAndQuery,
    /// The client's headers less what the hop must not send (`Host` still the client's).
    pub(super) headers: Fields,
    /// The `X-Forwarded-*` headers the gateway sets, each replacing the client's.
    pub(super) forwarding: Forwarding,
}

impl HopRequest {
    /// Method, target and one map of every header the hop sends but a target's `Host`, for
    /// the clients that send a map (they set `Host` themselves).
    pub(super) fn into_map(self, hop: &Hop<'_>) -> (Method, PathAndQuery, http::HeaderMap) {
        let HopRequest {
            method,
            pq,
            mut headers,
            forwarding,
        } = self;
        if !hop.preserve_host {
            headers.remove(header::HOST);
        }
        let mut map = headers.to_map();
        put(&mut map, forwarding);
        (method, pq, map)
    }
}

/// The request's method, target and headers rewritten for the hop.
pub(super) fn for_hop(parts: Parts, hop: &Hop<'_>) -> HopRequest {
    let Parts {
        method,
        uri,
        mut headers,
        ..
    } = parts;
    let full = uri
        .path_and_query()
        .cloned()
        .unwrap_or_else(|| PathAndQuery::from_static("/"));
    // Where the route's prefix ends, found once: for the path sent and for the header.
    let end = hop
        .strip_prefix
        .and_then(|s| prefix_end(full.path(), &s.prefix, s.any_case));
    let mut forwarding = rewrite_request(&mut headers, hop.peer_ip, hop.trusted, hop.https);
    if let Some(v) = stripped(full.path(), end, &headers, hop.trusted) {
        forwarding.push((X_FORWARDED_PREFIX, v));
    }
    let pq = path_and_query(full, end);
    HopRequest {
        method,
        pq,
        headers,
        forwarding,
    }
}

#[cfg(test)]
mod tests {
    use super::{prefix_end, stripped, Strip, X_FORWARDED_PREFIX};
    use crate::exchange::Fields;
    use http::HeaderValue;

    #[test]
    fn the_prefix_taken_off_is_said_as_the_client_spelled_it() {
        let strip = |prefix: &str, any_case| Strip {
            prefix: prefix.into(),
            any_case,
        };
        let none = Fields::default();
        let said = |path, s: &Strip, h: &Fields, trusted| {
            let end = prefix_end(path, &s.prefix, s.any_case);
            stripped(path, end, h, trusted).map(|v| v.to_str().expect("ascii").to_string())
        };
        assert_eq!(
            said("/v1/users", &strip("/v1/", false), &none, false).as_deref(),
            Some("/v1")
        );
        assert_eq!(
            said("/V1/users", &strip("/v1/", true), &none, false).as_deref(),
            Some("/V1")
        );
        assert_eq!(
            said("/api/v2", &strip("/api", false), &none, false).as_deref(),
            Some("/api")
        );
        assert_eq!(said("/users", &strip("/", false), &none, false), None);
        // A trusted proxy's own comes first; an untrusted client's was dropped before.
        let mut theirs = Fields::default();
        theirs.insert(X_FORWARDED_PREFIX, HeaderValue::from_static("/edge"));
        assert_eq!(
            said("/v1/users", &strip("/v1/", false), &theirs, true).as_deref(),
            Some("/edge/v1")
        );
        let mut slashed = Fields::default();
        slashed.insert(X_FORWARDED_PREFIX, HeaderValue::from_static("/edge/"));
        assert_eq!(
            said("/v1/users", &strip("/v1/", false), &slashed, true).as_deref(),
            Some("/edge/v1")
        );
        // Nothing taken off here: theirs goes as it came (kept, not set).
        assert_eq!(said("/users", &strip("/", false), &theirs, true), None);
        assert_eq!(
            said("/v1/users", &strip("/v1/", false), &theirs, false).as_deref(),
            Some("/v1")
        );
    }

    #[test]
    fn a_prefix_ends_where_routing_matched_it() {
        let end = |path: &'static str, prefix, any_case| {
            prefix_end(path, prefix, any_case).map(|i| &path[i..])
        };
        assert_eq!(end("/v1/users", "/v1/", false), Some("users"));
        assert_eq!(end("/v1;v=3/users", "/v1/", false), Some("users"));
        assert_eq!(end("/v1;v=3/users", "/v1", false), Some("/users"));
        assert_eq!(end("/v1;v=3", "/v1", false), Some(""));
        assert_eq!(end("/v1/;j=1", "/v1/", false), Some(";j=1"));
        assert_eq!(end("/v1x;p/y", "/v1", false), Some("x;p/y"));
        assert_eq!(end("/V1/users", "/v1/", false), None);
        assert_eq!(end("/V1/users", "/v1/", true), Some("users"));
        assert_eq!(end("/v", "/v1/", false), None);
    }
}
