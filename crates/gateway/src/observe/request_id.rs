//! `X-Request-Id`: kept from a client the listener trusts, otherwise made here (128 random
//! bits as 32 hex digits), sent upstream, returned to the client and written in every log
//! line and refusal body.

use http::{HeaderMap, HeaderName, HeaderValue};

/// The header name.
pub const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// The id made of `n`'s 128 bits (drawn from a per-thread generator seeded at random, so
/// making one takes no lock and no system call). Marked sensitive, see [`unindexed`].
fn from_bits(n: u128) -> HeaderValue {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut out = [0u8; 32];
    for (i, b) in out.iter_mut().enumerate() {
        *b = HEX[usize::try_from((n >> (124 - 4 * i)) & 0xf).unwrap_or(0)];
    }
    unindexed(HeaderValue::from_bytes(&out).unwrap_or_else(|_| HeaderValue::from_static("0")))
}

/// `v` marked sensitive, which HTTP/2's header compression (HPACK) sends as a literal
/// never indexed: an id is new in every message, so indexing it would only evict useful
/// entries from the connection's table and make every later id compare against a chain of
/// old ones. HTTP/1.1 ignores the mark.
pub fn unindexed(mut v: HeaderValue) -> HeaderValue {
    v.set_sensitive(true);
    v
}

/// Whether a client's id may be kept: 1 to 200 visible ASCII characters, none that would
/// need escaping in JSON.
pub fn acceptable(v: &HeaderValue) -> bool {
    let b = v.as_bytes();
    !b.is_empty()
        && b.len() <= 200
        && b.iter()
            .all(|&c| (0x21..0x7f).contains(&c) && c != b'"' && c != b'\\')
}

/// The request's id: the client's when `trusted` and acceptable, else a new one, with
/// its random bits (which a new trace takes as its id: one draw, and a trace id that
/// reads as the request id).
pub fn pick(headers: &HeaderMap, trusted: bool) -> (HeaderValue, Option<u128>) {
    if trusted {
        let mut all = headers.get_all(&X_REQUEST_ID).iter();
        if let (Some(v), None) = (all.next(), all.next()) {
            if acceptable(v) {
                return (unindexed(v.clone()), None);
            }
        }
    }
    let n = fastrand::u128(..);
    (from_bits(n), Some(n))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_hex_and_distinct() {
        let a = pick(&HeaderMap::new(), false).0;
        let b = pick(&HeaderMap::new(), false).0;
        assert_eq!(a.len(), 32);
        assert!(a.as_bytes().iter().all(u8::is_ascii_hexdigit));
        assert_ne!(a, b);
        assert!(
            a.is_sensitive(),
            "sent as a never-indexed literal in HTTP/2"
        );
    }

    #[test]
    fn keeps_only_a_trusted_clean_single_id() {
        let mut h = HeaderMap::new();
        h.insert(X_REQUEST_ID, HeaderValue::from_static("abc-123"));
        assert_eq!(pick(&h, true).0, "abc-123");
        let (id, bits) = pick(&h, false);
        assert_ne!(id, "abc-123");
        assert_eq!(id, format!("{:032x}", bits.expect("made here")).as_str());
        h.insert(X_REQUEST_ID, HeaderValue::from_static("a\"b"));
        assert_ne!(pick(&h, true).0, "a\"b");
        h.insert(X_REQUEST_ID, HeaderValue::from_static("one"));
        h.append(X_REQUEST_ID, HeaderValue::from_static("two"));
        let got = pick(&h, true).0;
        assert!(got != "one" && got != "two");
    }
}
