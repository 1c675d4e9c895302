//! Header rewriting for the hop to the upstream: `X-Forwarded-*` set by the gateway.
//! Hop-by-hop headers were removed on the way in ([`crate::inbound`]).

use crate::exchange::Fields;
use crate::inbound::spells;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

/// Whether `b` (in any case) names one of the headers a proxy tells its upstream about the
/// client with: `Forwarded`, `X-Forwarded`, `X-Real-IP` and the whole `X-Forwarded-*`
/// family (`-Port`, `-Prefix`, `-Scheme`, `-Ssl`, ... which Spring and Rack act on), the
/// client-address headers of CDNs and load balancers that client-IP libraries and
/// snippets read (`X-Client-IP`, `Client-IP`, `True-Client-IP`, `CF-Connecting-IP`,
/// `Fastly-Client-IP`, `X-Cluster-Client-IP`, `X-Original-Forwarded-For`, `Forwarded-For`,
/// `X-Originating-IP`, `X-Remote-IP`, `X-Remote-Addr`, `Proxy-Client-IP`,
/// `WL-Proxy-Client-IP`, and `HTTP_CLIENT_IP` and `HTTP_X_FORWARDED_FOR` as names), and those that tell it the URL or
/// host the client asked for (`X-Original-URL` and `X-Rewrite-URL`, which Symfony, Zend
/// and IIS act on, `X-Host`, `X-Original-Host`), in `-` or `_` spelling.
pub fn forwarding_name(b: &[u8]) -> bool {
    const FAMILY: &[u8] = b"x-forwarded-";
    // The length picks the whole names to compare: this runs for every request field of
    // an untrusted client.
    let whole: &[&[u8]] = match b.len() {
        6 => &[b"x-host"],
        9 => &[b"x-real-ip", b"forwarded", b"client-ip"],
        11 => &[b"x-forwarded", b"x-client-ip", b"x-remote-ip"],
        13 => &[b"x-rewrite-url", b"forwarded-for", b"x-remote-addr"],
        14 => &[b"true-client-ip", b"x-original-url", b"http-client-ip"],
        15 => &[b"x-original-host", b"proxy-client-ip"],
        16 => &[
            b"cf-connecting-ip",
            b"fastly-client-ip",
            b"x-originating-ip",
        ],
        18 => &[b"wl-proxy-client-ip"],
        19 => &[b"x-cluster-client-ip"],
        20 => &[b"http-x-forwarded-for"],
        24 => &[b"x-original-forwarded-for"],
        _ => &[],
    };
    whole.iter().any(|n| spells(b, n)) || b.get(..FAMILY.len()).is_some_and(|p| spells(p, FAMILY))
}

/// What the hop sends for a request header: the client's value as it is, nothing, or a
/// value the gateway sets.
#[derive(Debug)]
pub enum Sent {
    /// The client's value, as it came.
    AsIs,
    /// Nothing: the header is dropped.
    Dropped,
    /// This value, set by the gateway.
    Set(HeaderValue),
}

/// What the hop sends for header `name` (lower case) of the request headers `h`, from a
/// client at `peer_ip` (a trusted proxy or not, over TLS or not). One rule for the hop
/// itself ([`rewrite_request`]) and for whatever must judge a request as its upstream
/// will see it (the cache's `Vary`): from a trusted proxy, `X-Forwarded-For` is appended
/// to and the rest of the family kept; from anyone else the family is dropped. Either
/// way `X-Forwarded-For` names the peer, and `-Proto` and `-Host` are set when not kept
/// (`https` over TLS; the client's `Host`).
pub fn sent(h: &Fields, name: &str, peer_ip: &HeaderValue, trusted: bool, https: bool) -> Sent {
    let kept = trusted && h.contains_key(name);
    match name {
        "x-forwarded-for" if kept => {
            let mut v = Vec::with_capacity(64);
            for prev in h.get_all(X_FORWARDED_FOR) {
                v.extend_from_slice(prev.as_bytes());
                v.extend_from_slice(b", ");
            }
            v.extend_from_slice(peer_ip.as_bytes());
            Sent::Set(HeaderValue::from_bytes(&v).unwrap_or_else(|_| peer_ip.clone()))
        }
        "x-forwarded-for" => Sent::Set(peer_ip.clone()),
        "x-forwarded-proto" | "x-forwarded-host" if kept => Sent::AsIs,
        "x-forwarded-proto" => Sent::Set(HeaderValue::from_static(if https {
            "https"
        } else {
            "http"
        })),
        "x-forwarded-host" => h
            .get(header::HOST)
            .map_or(Sent::Dropped, |v| Sent::Set(v.clone())),
        n if !trusted && forwarding_name(n.as_bytes()) => Sent::Dropped,
        _ => Sent::AsIs,
    }
}

/// The `X-Forwarded-*` headers the gateway sets on a hop, each replacing the client's
/// (`-Host`, `-For`, `-Proto`, and `-Prefix` where the route strips one: room for three
/// in place, as a fourth slot would make every hop's future larger to copy).
pub type Forwarding = smallvec::SmallVec<[(HeaderName, HeaderValue); 3]>;

/// Drops the rest of the forwarding family from an untrusted client's headers, and
/// `Expect`; returns the `X-Forwarded-For`, `-Proto` and `-Host` to set, as [`sent`]
/// says. `Host` is the caller's. The lean client writes what is returned straight into
/// the request head (no map insert, no hashing of the names); the others [`put`] it.
pub fn rewrite_request(
    h: &mut Fields,
    peer_ip: &HeaderValue,
    trusted: bool,
    https: bool,
) -> Forwarding {
    // One pass over the names first: most requests carry neither.
    let (mut family, mut expect) = (false, false);
    for k in h.names() {
        if k.eq_ignore_ascii_case(b"expect") {
            expect = true;
        } else if !trusted && forwarding_name(k) {
            family = true;
        }
    }
    if family {
        h.retain(|k, _| !forwarding_name(k));
    }
    let mut set = Forwarding::new();
    for name in [X_FORWARDED_HOST, X_FORWARDED_FOR, X_FORWARDED_PROTO] {
        if let Sent::Set(v) = sent(h, name.as_str(), peer_ip, trusted, https) {
            set.push((name, v));
        }
    }
    // The listener answers a client's `Expect: 100-continue` itself, and the body goes up
    // with the head: an upstream that answered early without reading it would take the body
    // for the next request on a kept-alive connection (nginx drops it too).
    if expect {
        h.remove(header::EXPECT);
    }
    set
}

/// Puts what [`rewrite_request`] returned on `h`, for the clients that send a map.
pub fn put(h: &mut HeaderMap, set: Forwarding) {
    for (name, value) in set {
        h.insert(name, value);
    }
}

/// Whether an answer to `method` with `status` has a body to read: not one to `HEAD`, and
/// not a 1xx, 204 or 304 (RFC 9112 §6.3).
pub fn carries_body(method: &http::Method, status: http::StatusCode) -> bool {
    *method != http::Method::HEAD
        && !status.is_informational()
        && !matches!(status.as_u16(), 204 | 304)
}

/// Whether an answer must be refused for its transfer coding, on every client: a body
/// under a coding other than `chunked` alone (`gzip`, `gzip, chunked`, `identity`, `chunked`
/// twice). The gateway takes `Transfer-Encoding` off as hop-by-hop, so such a body would
/// reach the client coded but labelled as plain; and beside a length no framing can be
/// trusted (RFC 9112 §6.3). nginx and Envoy answer 502.
pub fn coded_answer(method: &http::Method, status: http::StatusCode, h: &HeaderMap) -> bool {
    carries_body(method, status) && coded_beyond_chunked(h)
}

fn coded_beyond_chunked(h: &HeaderMap) -> bool {
    let mut codings = h.get_all(header::TRANSFER_ENCODING).iter();
    codings.next().is_some_and(|first| {
        !first
            .as_bytes()
            .trim_ascii()
            .eq_ignore_ascii_case(b"chunked")
            || codings.next().is_some()
    })
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_untrusted_client_sends_no_header_of_the_forwarding_family() {
        let mut h = HeaderMap::new();
        for name in [
            "x-forwarded-port",
            "x-forwarded-prefix",
            "x_forwarded_scheme",
            "x-forwarded_ssl",
            "x-forwarded-server",
            "x-forwarded-uri",
            "x-forwarded-path",
            "x_real_ip",
            "forwarded",
            "x-forwardedness",
            "x-original-url",
            "X_Rewrite_URL",
            "x-host",
            "x-original-host",
            "x-hostile",
            "x-forwarded",
            "X-Client-IP",
            "true_client_ip",
            "cf-connecting-ip",
            "fastly-client-ip",
            "x-cluster-client-ip",
            "x-original-forwarded-for",
            "client-ip",
            "forwarded-for",
            "x-originating-ip",
            "x-remote-ip",
            "x-remote-addr",
            "proxy-client-ip",
            "wl-proxy-client-ip",
            "http_client_ip",
            "http_x_forwarded_for",
        ] {
            h.insert(
                HeaderName::from_bytes(name.as_bytes()).expect("name"),
                HeaderValue::from_static("evil"),
            );
        }
        h.insert(header::EXPECT, HeaderValue::from_static("100-continue"));
        let mut h = Fields::from(h);
        let set = rewrite_request(&mut h, &HeaderValue::from_static("10.0.0.1"), false, false);
        let mut h = h.to_map();
        put(&mut h, set);
        let mut left: Vec<&str> = h.keys().map(|k| k.as_str()).collect();
        left.sort_unstable();
        assert_eq!(
            left,
            [
                "x-forwarded-for",
                "x-forwarded-proto",
                "x-forwardedness",
                "x-hostile"
            ],
            "{left:?}"
        );
    }
}
