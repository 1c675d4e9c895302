//! `X-Request-Id`: kept from a client the listener trusts, otherwise made here (128 random
//! bits as 32 hex digits), sent upstream, returned to the client and written in every log
//! line and refusal body.

use crate::exchange::Fields;
use http::{HeaderName, HeaderValue};

/// The header name.
pub const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// The id made of `n`'s 128 bits (drawn from a per-thread generator seeded at random, so
/// making one takes no lock and no system call). Marked sensitive, see [`unindexed`]. The
/// digits are owned by one shared allocation: the id goes upstream, into the answer and the
/// log, and each copy is a count, where a copied buffer is moved to the heap again on the
/// first clone.
fn from_bits(n: u128) -> HeaderValue {
    unindexed(
        HeaderValue::from_maybe_shared(bytes::Bytes::from_owner(hex32(n)))
            .unwrap_or_else(|_| HeaderValue::from_static("0")),
    )
}

/// `n` as 32 lowercase hex digits, most significant first: a request id, a trace id.
pub(crate) fn hex32(n: u128) -> [u8; 32] {
    let mut out = [0u8; 32];
    out[..16].copy_from_slice(&hex16((n >> 64) as u64));
    out[16..].copy_from_slice(&hex16(n as u64));
    out
}

/// `x` as 16 lowercase hex digits, most significant first, computed on all digits at
/// once: every request makes an id, and a forwarded one with tracing on a `traceparent`;
/// a loop over a table cost about 240 instructions of the 750 tracing adds (callgrind).
pub(crate) fn hex16(x: u64) -> [u8; 16] {
    const fn lanes(b: u8) -> u128 {
        u128::from_ne_bytes([b; 16])
    }
    // Spread the 16 nibbles into 16 bytes, nibble k (from the lowest) into byte k.
    let mut v = u128::from(x);
    v = (v & 0xffff_ffff) | ((v & 0xffff_ffff_0000_0000) << 32);
    v = (v & 0x0000_ffff_0000_ffff_0000_ffff_0000_ffff)
        | ((v & 0xffff_0000_ffff_0000_ffff_0000_ffff_0000) << 16);
    v = (v & 0x00ff_00ff_00ff_00ff_00ff_00ff_00ff_00ff)
        | ((v & 0xff00_ff00_ff00_ff00_ff00_ff00_ff00_ff00) << 8);
    v = (v & lanes(0x0f)) | ((v & lanes(0xf0)) << 4);
    // '0' + n, and 39 more ('a' - '0' - 10) where n > 9.
    let letters = ((v + lanes(0x06)) >> 4) & lanes(0x01);
    (v + lanes(b'0') + letters * 39).to_be_bytes()
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
pub fn pick(headers: &Fields, trusted: bool) -> (HeaderValue, Option<u128>) {
    if trusted {
        let mut all = headers.get_all(X_REQUEST_ID).iter();
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
        let a = pick(&Fields::default(), false).0;
        let b = pick(&Fields::default(), false).0;
        assert_eq!(a.len(), 32);
        assert!(a.as_bytes().iter().all(u8::is_ascii_hexdigit));
        assert_ne!(a, b);
        assert!(
            a.is_sensitive(),
            "sent as a never-indexed literal in HTTP/2"
        );
    }

    #[test]
    fn hex_digits_are_those_of_format() {
        let mut x = 0x0123_4567_89ab_cdefu64;
        for _ in 0..10_000 {
            assert_eq!(hex16(x), *format!("{x:016x}").as_bytes(), "{x:#x}");
            x = x
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
        }
        for x in [0, u64::MAX, 0xa, 0x9, 0xf0f0_f0f0_0909_0a0a] {
            assert_eq!(hex16(x), *format!("{x:016x}").as_bytes(), "{x:#x}");
        }
    }

    #[test]
    fn keeps_only_a_trusted_clean_single_id() {
        let mut h = Fields::default();
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
