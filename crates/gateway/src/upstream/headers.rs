//! Header rewriting for the hop to the upstream: `X-Forwarded-*` set by the gateway.
//! Hop-by-hop headers were removed on the way in ([`crate::inbound`]).

use http::header::{self, HeaderMap, HeaderName, HeaderValue};

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
const X_REAL_IP: HeaderName = HeaderName::from_static("x-real-ip");
const FORWARDED: HeaderName = HeaderName::from_static("forwarded");

/// Sets `X-Forwarded-For`, `-Proto` and `-Host` for the hop. From a trusted proxy, the
/// client's `X-Forwarded-For` is appended to and its `-Proto` and `-Host` kept; from anyone
/// else, all of them (and `Forwarded`, `X-Real-IP`) are replaced; `-Proto` is `https` when
/// the client came over TLS. `Host` is the caller's.
pub fn rewrite_request(h: &mut HeaderMap, peer_ip: &HeaderValue, trusted: bool, https: bool) {
    if !trusted {
        h.remove(X_FORWARDED_PROTO);
        h.remove(X_FORWARDED_HOST);
        h.remove(FORWARDED);
        h.remove(X_REAL_IP);
    }
    if !h.contains_key(&X_FORWARDED_HOST) {
        if let Some(v) = h.get(header::HOST).cloned() {
            h.insert(X_FORWARDED_HOST, v);
        }
    }
    let xff = if trusted && h.contains_key(&X_FORWARDED_FOR) {
        let mut v = Vec::with_capacity(64);
        for prev in h.get_all(&X_FORWARDED_FOR) {
            v.extend_from_slice(prev.as_bytes());
            v.extend_from_slice(b", ");
        }
        v.extend_from_slice(peer_ip.as_bytes());
        HeaderValue::from_bytes(&v).unwrap_or_else(|_| peer_ip.clone())
    } else {
        peer_ip.clone()
    };
    h.insert(X_FORWARDED_FOR, xff);
    if !h.contains_key(&X_FORWARDED_PROTO) {
        let proto = if https { "https" } else { "http" };
        h.insert(X_FORWARDED_PROTO, HeaderValue::from_static(proto));
    }
}

/// Readies a response head from upstream for the client: a `Content-Length` sent with
/// `Transfer-Encoding` is stale (the body was framed by chunks, RFC 9112 §6.3) and is
/// dropped; then the hop-by-hop headers go. Returns whether the message carried both, in
/// which case its connection must not be reused.
pub fn rewrite_response(h: &mut HeaderMap) -> bool {
    let both = h.contains_key(header::TRANSFER_ENCODING) && h.contains_key(header::CONTENT_LENGTH);
    if h.contains_key(header::TRANSFER_ENCODING) {
        h.remove(header::CONTENT_LENGTH);
    }
    crate::inbound::strip_hop_headers(h, &crate::inbound::Owned::default());
    both
}
