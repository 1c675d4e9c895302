//! Header rewriting for the hop to and from the upstream.

use http::header::{self, HeaderMap, HeaderName, HeaderValue};

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
const KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");
const PROXY_CONNECTION: HeaderName = HeaderName::from_static("proxy-connection");

fn is_hop(n: &HeaderName) -> bool {
    *n == header::CONNECTION
        || *n == header::TE
        || *n == header::TRAILER
        || *n == header::TRANSFER_ENCODING
        || *n == header::UPGRADE
        || *n == KEEP_ALIVE
        || *n == PROXY_CONNECTION
}

/// Removes the hop-by-hop headers (RFC 9110 §7.6.1), including those named in `Connection`.
/// One pass over the names first: most messages carry none, and then nothing is removed.
pub fn strip_hop_headers(h: &mut HeaderMap) {
    if !h.keys().any(is_hop) {
        return;
    }
    if let Some(conn) = h.get(header::CONNECTION).cloned() {
        if let Ok(list) = conn.to_str() {
            for name in list.split(',') {
                let name = name.trim();
                if !name.is_empty() {
                    h.remove(name);
                }
            }
        }
    }
    for name in [
        header::CONNECTION,
        KEEP_ALIVE,
        PROXY_CONNECTION,
        header::TE,
        header::TRAILER,
        header::TRANSFER_ENCODING,
        header::UPGRADE,
    ] {
        h.remove(name);
    }
}

/// Rewrites a request's headers for the hop: hop-by-hop removed, `X-Forwarded-For`,
/// `-Proto` and `-Host` (the client's `Host`) set. `Host` itself is the caller's to set.
pub fn rewrite_request(h: &mut HeaderMap, peer_ip: &HeaderValue) {
    strip_hop_headers(h);
    if let Some(v) = h.get(header::HOST).cloned() {
        h.insert(X_FORWARDED_HOST, v);
    }
    let xff = match h.get(&X_FORWARDED_FOR) {
        Some(prev) => {
            let mut v = Vec::with_capacity(prev.len() + 2 + peer_ip.len());
            v.extend_from_slice(prev.as_bytes());
            v.extend_from_slice(b", ");
            v.extend_from_slice(peer_ip.as_bytes());
            HeaderValue::from_bytes(&v).unwrap_or_else(|_| peer_ip.clone())
        }
        None => peer_ip.clone(),
    };
    h.insert(X_FORWARDED_FOR, xff);
    h.insert(X_FORWARDED_PROTO, HeaderValue::from_static("http"));
}
