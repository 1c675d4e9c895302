//! Answers from a stored entry: whole, HEAD, 304 to a satisfied conditional request, or
//! a byte range (206, 416).

use super::store::Entry;
use crate::exchange::{Fields, Parts};
use crate::response::{full, Body};
use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderValue};
use http::{Method, Response, StatusCode};

/// `Cache-Status` (RFC 9211).
pub const CACHE_STATUS: http::HeaderName = http::HeaderName::from_static("cache-status");

/// Adds the gateway's member to `Cache-Status`, after what a cache nearer the origin wrote
/// there (RFC 9211 §2: a cache keeps the field's value and adds its own at the end), so
/// the whole chain can be read. One field line: the upstream's lines joined, then ours.
pub(crate) fn add_status(h: &mut HeaderMap, ours: HeaderValue) {
    let mut upstream = h.get_all(&CACHE_STATUS).iter().peekable();
    if upstream.peek().is_none() {
        h.insert(CACHE_STATUS, ours);
        return;
    }
    let mut joined = Vec::new();
    for v in upstream {
        let v = v.as_bytes().trim_ascii();
        if !v.is_empty() {
            joined.extend_from_slice(v);
            joined.extend_from_slice(b", ");
        }
    }
    joined.extend_from_slice(ours.as_bytes());
    // Every byte came from a header value or from ours, so this holds; ours alone if not.
    let v = HeaderValue::from_bytes(&joined).unwrap_or(ours);
    h.insert(CACHE_STATUS, v);
}

/// The gateway's own member of a `Cache-Status` value: its last (the gateway's never holds
/// a comma).
pub fn own_status(v: &HeaderValue) -> &[u8] {
    let v = v.as_bytes();
    let start = v.iter().rposition(|&b| b == b',').map_or(0, |i| i + 1);
    v[start..].trim_ascii()
}

pub(super) fn etag_matches(inm: &str, etag: &str) -> bool {
    let weak = |t: &str| t.trim().trim_start_matches("W/").to_string();
    inm.split(',')
        .any(|t| t.trim() == "*" || weak(t) == weak(etag))
}

/// Whether the client's conditional request is satisfied by `e` (RFC 9110 §13.2.2).
pub(super) fn not_modified(req: &Fields, e: &Entry) -> bool {
    satisfied(req, &e.headers)
}

/// Whether the conditional request `req` is satisfied by an answer with `headers`.
pub(super) fn satisfied(req: &Fields, headers: &HeaderMap) -> bool {
    if let Some(inm) = req.get(header::IF_NONE_MATCH).and_then(|v| v.to_str().ok()) {
        return headers
            .get(header::ETAG)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|etag| etag_matches(inm, etag));
    }
    let Some(since) = req
        .get(header::IF_MODIFIED_SINCE)
        .and_then(|v| httpdate::parse_http_date(v.to_str().ok()?).ok())
    else {
        return false;
    };
    // Without `Last-Modified`, the answer's `Date` tells when it was last known as it is
    // (RFC 9111 §4.3.2).
    let modified = headers
        .get(header::LAST_MODIFIED)
        .or_else(|| headers.get(header::DATE))
        .and_then(|v| httpdate::parse_http_date(v.to_str().ok()?).ok());
    modified.is_some_and(|m| m <= since)
}

/// The answer to a client that asked for a stored answer only (`only-if-cached`) when
/// none can be given without the upstream (RFC 9111 §5.2.1.7).
pub fn only_if_cached() -> Response<Body> {
    let mut r = Response::new(full(Bytes::from_static(b"not in the cache\n")));
    *r.status_mut() = StatusCode::GATEWAY_TIMEOUT;
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    add_status(
        h,
        HeaderValue::from_static("tollgate; detail=only-if-cached"),
    );
    r
}

/// A 304 for a client whose conditional the upstream's fresh 200 satisfies: that answer's
/// headers (its `Cache-Status` already says how it was had) without the body's length.
/// The body is stored on its own (see [`crate::upstream::PooledBody::read_ahead`]).
pub(super) fn not_modified_from<B>(resp: &Response<B>) -> Response<Body> {
    let mut r = Response::new(full(Bytes::new()));
    *r.status_mut() = StatusCode::NOT_MODIFIED;
    let h = r.headers_mut();
    *h = resp.headers().clone();
    h.remove(header::CONTENT_LENGTH);
    h.remove(header::TRANSFER_ENCODING);
    r
}

/// The part of a `len`-byte body a `Range` asks for (RFC 9110 §14): `Some(Ok(range))` for
/// one satisfiable byte range, `Some(Err(()))` when it cannot be satisfied, `None` when the
/// whole answer is given instead (no range, several ranges, another unit, or a form not
/// read here).
pub(crate) fn byte_range(req: &Fields, len: usize) -> Option<Result<std::ops::Range<usize>, ()>> {
    let v = req.get(header::RANGE)?.to_str().ok()?.trim();
    let spec = v.strip_prefix("bytes=")?.trim();
    if spec.contains(',') {
        return None;
    }
    let (first, last) = spec.split_once('-')?;
    let (first, last) = (first.trim(), last.trim());
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let num = |s: &str| {
        s.parse::<u64>()
            .ok()
            .map(|n| usize::try_from(n).unwrap_or(usize::MAX))
    };
    if first.is_empty() {
        // A suffix: the last N bytes.
        if !digits(last) {
            return None;
        }
        let n = num(last)?;
        if n == 0 || len == 0 {
            return Some(Err(()));
        }
        return Some(Ok(len.saturating_sub(n)..len));
    }
    if !digits(first) || !(last.is_empty() || digits(last)) {
        return None;
    }
    let start = num(first)?;
    let end = if last.is_empty() {
        usize::MAX
    } else {
        num(last)?
    };
    if end < start {
        return None;
    }
    if start >= len {
        return Some(Err(()));
    }
    Some(Ok(start..end.min(len - 1) + 1))
}

/// Whether `If-Range` lets a range of an answer with `headers` be served (RFC 9110
/// §13.1.5): its strong entity tag, or its exact `Last-Modified` date when that is a
/// strong validator (at least a second before the answer's `Date`, §8.8.2.2: a file
/// changed twice within its second would otherwise mix two versions' bytes; without a
/// `Date` nothing shows it strong, so it is weak).
pub(super) fn if_range_holds(req: &Fields, headers: &HeaderMap) -> bool {
    let Some(v) = req.get(header::IF_RANGE) else {
        return true;
    };
    let v = v.as_bytes();
    if v.starts_with(b"\"") {
        return headers.get(header::ETAG).is_some_and(|t| t.as_bytes() == v);
    }
    if v.starts_with(b"W/") {
        return false;
    }
    let date = |name| {
        headers
            .get(name)
            .and_then(|v: &HeaderValue| httpdate::parse_http_date(v.to_str().ok()?).ok())
    };
    let strong = match (date(header::LAST_MODIFIED), date(header::DATE)) {
        (Some(modified), Some(dated)) => dated
            .duration_since(modified)
            .is_ok_and(|d| d >= std::time::Duration::from_secs(1)),
        _ => false,
    };
    headers
        .get(header::LAST_MODIFIED)
        .is_some_and(|t| t.as_bytes() == v)
        && strong
}

/// The byte range `asked` (the client's `Range` and `If-Range`) of an upstream's whole
/// 200 as it streams: a 206 with that part, or a 416 past its end, as nginx's range
/// filter answers a miss it fetched whole. The whole answer when its length is not known
/// or the range is not one this cache serves (see [`byte_range`]).
pub(super) fn part_of(resp: Response<Body>, asked: &Fields) -> Response<Body> {
    let h = resp.headers();
    let len = h
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    let (Some(len), true) = (len, resp.status() == StatusCode::OK) else {
        return resp;
    };
    let whole = usize::try_from(len).unwrap_or(usize::MAX);
    let range = byte_range(asked, whole).filter(|_| if_range_holds(asked, h));
    let (mut parts, body) = resp.into_parts();
    let (content_range, body) = match (range, body) {
        (Some(Ok(r)), http_body_util::Either::Left(b)) => {
            parts.status = StatusCode::PARTIAL_CONTENT;
            let (start, end) = (r.start as u64, r.end as u64);
            let v = format!("bytes {start}-{}/{len}", end - 1);
            parts
                .headers
                .insert(header::CONTENT_LENGTH, HeaderValue::from(end - start));
            (v, http_body_util::Either::Left(b.only(start..end)))
        }
        (Some(Err(())), _) => {
            // The whole answer goes on being read, and stored, without this client.
            parts.status = StatusCode::RANGE_NOT_SATISFIABLE;
            parts
                .headers
                .insert(header::CONTENT_LENGTH, HeaderValue::from(0u64));
            (format!("bytes */{len}"), full(Bytes::new()))
        }
        (_, body) => return Response::from_parts(parts, body),
    };
    if let Ok(v) = HeaderValue::from_str(&content_range) {
        parts.headers.insert(header::CONTENT_RANGE, v);
    }
    Response::from_parts(parts, body)
}

/// The answer for `req` from `e`: whole, HEAD, 304 to a satisfied conditional request,
/// or a byte range of a stored whole answer (206, or 416 past its end), as Varnish does.
pub(super) fn answer(e: &Entry, req: &Parts, now_ns: u64, status: String) -> Response<Body> {
    let not_mod = e.status == StatusCode::OK && not_modified(&req.headers, e);
    let range = (e.status == StatusCode::OK && req.method == Method::GET && !not_mod)
        .then(|| byte_range(&req.headers, e.body.len()))
        .flatten()
        .filter(|_| if_range_holds(&req.headers, &e.headers));
    let (code, body) = if not_mod {
        (StatusCode::NOT_MODIFIED, Bytes::new())
    } else if req.method == Method::HEAD {
        (e.status, Bytes::new())
    } else {
        match &range {
            Some(Ok(r)) => (StatusCode::PARTIAL_CONTENT, e.body.slice(r.clone())),
            Some(Err(())) => (StatusCode::RANGE_NOT_SATISFIABLE, Bytes::new()),
            None => (e.status, e.body.clone()),
        }
    };
    let len = if req.method == Method::HEAD {
        e.body.len()
    } else {
        body.len()
    };
    let mut r = Response::new(full(body));
    *r.status_mut() = code;
    let h = r.headers_mut();
    *h = e.headers.clone();
    if e.fresh.surrogate {
        super::control::strip_surrogate(h);
    }
    if not_mod {
        h.remove(header::CONTENT_LENGTH);
    } else {
        h.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
    }
    match &range {
        Some(Ok(r)) => {
            let v = format!("bytes {}-{}/{}", r.start, r.end - 1, e.body.len());
            if let Ok(v) = HeaderValue::from_str(&v) {
                h.insert(header::CONTENT_RANGE, v);
            }
        }
        Some(Err(())) => {
            if let Ok(v) = HeaderValue::from_str(&format!("bytes */{}", e.body.len())) {
                h.insert(header::CONTENT_RANGE, v);
            }
        }
        None => {}
    }
    h.insert(header::AGE, HeaderValue::from(e.age(now_ns).as_secs()));
    if let Ok(v) = HeaderValue::from_str(&status) {
        add_status(h, v);
    }
    r
}

/// An upstream's answer as a client gets it: with the gateway's `Cache-Status` member, and
/// without the `Surrogate-Control` directives this cache acts on.
pub(super) fn with_status(mut r: Response<Body>, status: &'static str) -> Response<Body> {
    forwarded(r.headers_mut(), status);
    r
}

/// Makes the headers of an upstream's answer passed on through a caching route (stored or
/// not) as a client gets them: the `Surrogate-Control` directives this cache acts on taken
/// out, its `Cache-Status` member added.
pub fn forwarded(h: &mut HeaderMap, status: &'static str) {
    super::control::strip_surrogate(h);
    add_status(h, HeaderValue::from_static(status));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gateways_member_goes_last_and_is_read_back_alone() {
        let mut h = HeaderMap::new();
        add_status(&mut h, HeaderValue::from_static("tollgate; hit"));
        assert_eq!(h[&CACHE_STATUS], "tollgate; hit");
        assert_eq!(own_status(&h[&CACHE_STATUS]), b"tollgate; hit");

        let mut h = HeaderMap::new();
        h.append(CACHE_STATUS, HeaderValue::from_static("a; hit "));
        h.append(CACHE_STATUS, HeaderValue::from_static(""));
        h.append(CACHE_STATUS, HeaderValue::from_static("b; fwd=miss"));
        add_status(&mut h, HeaderValue::from_static("tollgate; fwd=method"));
        assert_eq!(h.get_all(&CACHE_STATUS).iter().count(), 1);
        assert_eq!(
            h[&CACHE_STATUS],
            "a; hit, b; fwd=miss, tollgate; fwd=method"
        );
        assert_eq!(own_status(&h[&CACHE_STATUS]), b"tollgate; fwd=method");
    }
}
