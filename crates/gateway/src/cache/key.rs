//! A request's key: the route, what the upstream is told of scheme and host, the path and
//! the keyed query (matched as backends read names), then the variant (the consumer unless
//! shared, the key headers, and the headers the answer varies on, as sent upstream).

use super::store::Varies;
use crate::clock::Clock;
use crate::exchange::{Fields, Parts};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::Method;
use smallvec::SmallVec;
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use tollgate_config::{KeyQuery, RouteCacheConfig};

/// A request's key, built once: the URI key (route, host, path and keyed query), then the
/// variant without varying headers. The URI key and the URL are slices of it.
#[derive(Debug)]
pub struct Key {
    pub(super) plain: String,
    pub(super) url_start: usize,
    pub(super) uri_len: usize,
    /// The request may neither be answered from the cache nor stored: it names a keyed
    /// query parameter in two spellings, asks for `no-store`, or its URI is longer than
    /// [`MAX_CACHED_URI`].
    pub(super) bypass: bool,
}

/// The longest URI key (route, host, path and keyed query) the cache keeps answers for:
/// nginx's and Varnish's default limit on a request line. The index keeps a URI's key a
/// while after its answers are evicted, so longer ones would let unique long URLs hold
/// many times the cache's size there.
pub const MAX_CACHED_URI: usize = 8 * 1024;

impl Key {
    /// The key of the request `parts` asks on its route.
    pub fn of(ask: &Ask<'_>, parts: &Parts) -> Key {
        let mut plain = String::with_capacity(128);
        plain.push_str(ask.route);
        plain.push('\u{0}');
        authority_into(ask, &parts.headers, &mut plain);
        plain.push('\u{0}');
        let url_start = plain.len();
        let ambiguous = url_into(
            parts.uri.path(),
            parts.uri.query(),
            (ask.cfg, ask.credentials),
            &mut plain,
        );
        let uri_len = plain.len();
        variant_into(ask, &ask.cfg.key_headers, &parts.headers, &mut plain);
        Key {
            plain,
            url_start,
            uri_len,
            bypass: ambiguous || asks_no_store(&parts.headers) || uri_len > MAX_CACHED_URI,
        }
    }
}

/// What the cache needs of a request and its route.
pub struct Ask<'a> {
    /// The route's caching.
    pub cfg: &'a RouteCacheConfig,
    /// The route's name (part of every key).
    pub route: &'a str,
    /// The authenticated consumer's name.
    pub consumer: Option<&'a str>,
    /// The query parameters that carried the API key: never part of a key.
    pub credentials: &'a [String],
    /// Longest wait for another request's answer to the same key.
    pub wait: Duration,
    /// The gateway's clock, nanoseconds (monotonic).
    pub now_ns: u64,
    /// The gateway's clock: wall time, for `Date` and `Expires`, is read from it only when
    /// an answer is judged for storing (most requests are hits or never-stored misses).
    pub clock: &'a Arc<dyn Clock>,
    /// The client's address, as `X-Forwarded-For` sends it upstream.
    pub peer: &'a HeaderValue,
    /// The client is a trusted proxy: its `X-Forwarded-*` headers go upstream.
    pub trusted: bool,
    /// The client came over TLS (`X-Forwarded-Proto: https`).
    pub https: bool,
}

impl Ask<'_> {
    /// Wall time now.
    pub(super) fn wall(&self) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_nanos(self.clock.wall_nanos())
    }
}

/// Whether the client asked that nothing of this exchange be stored (`no-store`): its
/// answer is neither stored nor taken as the key's, and it is not answered from the store.
pub(super) fn asks_no_store(req: &Fields) -> bool {
    asks(req, "no-store")
}

/// Whether the request carries credentials (RFC 9111 §3.5: `Authorization`, and for a
/// proxy on the way `Proxy-Authorization`): what it gets may be its own.
pub(super) fn has_credentials(req: &Fields) -> bool {
    req.contains_key(header::AUTHORIZATION) || req.contains_key(header::PROXY_AUTHORIZATION)
}

/// Whether the client asked to be answered from the store or not at all
/// (`only-if-cached`, RFC 9111 §5.2.1.7).
pub fn only_if_cached(req: &Fields) -> bool {
    asks(req, "only-if-cached")
}

/// Whether the request's `Cache-Control` holds `directive` (one without a value).
pub(super) fn asks(req: &Fields, directive: &str) -> bool {
    req.get_all(header::CACHE_CONTROL).iter().any(|v| {
        v.to_str().is_ok_and(|v| {
            v.split(',')
                .any(|d| d.trim().eq_ignore_ascii_case(directive))
        })
    })
}

/// Whether the request asks its upstream to take it as another method
/// (`X-HTTP-Method-Override`, `X-HTTP-Method`, `X-Method-Override`, in `-` or `_`
/// spelling, which Express, Rails and ASP.NET middlewares act on): its answer may be a
/// `DELETE`'s or a `PUT`'s, never one to store for a `GET`, and the cache does not handle
/// it at all.
pub fn overrides_method(req: &Fields) -> bool {
    req.names().any(is_override)
}

fn is_override(n: &[u8]) -> bool {
    let whole: &[u8] = match n.len() {
        13 => b"x-http-method",
        17 => b"x-method-override",
        22 => b"x-http-method-override",
        _ => return false,
    };
    crate::inbound::spells(n, whole)
}

/// Whether the request asks its upstream to take it as an unsafe method that `allows`
/// (the route's methods) takes: only then may its success have changed the resource, and
/// invalidate what is stored for it. Middlewares read the value in any case (Express
/// upper-cases it); `GET` or a method the route refuses changes nothing that the cache
/// should drop, or anyone could empty it with a header.
pub fn overrides_to_unsafe(req: &Fields, allows: impl Fn(&Method) -> bool) -> bool {
    req.iter().any(|(n, v)| {
        is_override(n)
            && Method::from_bytes(v.as_bytes().trim_ascii().to_ascii_uppercase().as_slice())
                .is_ok_and(|m| is_unsafe(&m) && allows(&m))
    })
}

/// Whether the request sets a precondition the cache does not judge itself (`If-Match`,
/// `If-Unmodified-Since`): such a request goes upstream as it is, and what it gets is
/// never stored nor decides anything for the key. (A `Range` is served from the whole
/// answer, stored or fetched.)
pub(super) fn shapes_its_answer(req: &Fields) -> bool {
    req.contains_key(header::IF_MATCH) || req.contains_key(header::IF_UNMODIFIED_SINCE)
}

pub(super) const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
pub(super) const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

/// Appends what the upstream is told of the request's scheme and host, lower case: the
/// scheme (`X-Forwarded-Proto`), the `Host` as sent, port included, and a trusted proxy's
/// `X-Forwarded-Host`. Two requests the upstream could answer differently never share a key.
pub(super) fn authority_into(ask: &Ask<'_>, req: &Fields, out: &mut String) {
    let start = out.len();
    if ask.trusted && req.contains_key(X_FORWARDED_PROTO) {
        header_for_key(req, &X_FORWARDED_PROTO, out);
    } else {
        out.push_str(if ask.https { "https" } else { "http" });
    }
    out.push('\u{0}');
    header_for_key(req, &header::HOST, out);
    if ask.trusted && req.contains_key(X_FORWARDED_HOST) {
        out.push('\u{0}');
        header_for_key(req, &X_FORWARDED_HOST, out);
    }
    if ask.trusted {
        // The rest of the family a trusted proxy sends goes upstream too, and frameworks
        // build links from it (`X-Forwarded-Prefix`, `-Port`, `Forwarded`): keyed. Who the
        // client is (`X-Forwarded-For`, `X-Real-IP`, the CDNs' client-address headers) is
        // not part of a URL.
        const NOT_KEYED: [&[u8]; 20] = [
            b"x-forwarded-for",
            b"x-real-ip",
            b"x-forwarded-proto",
            b"x-forwarded-host",
            b"x-forwarded",
            b"x-client-ip",
            b"client-ip",
            b"true-client-ip",
            b"cf-connecting-ip",
            b"fastly-client-ip",
            b"x-cluster-client-ip",
            b"x-original-forwarded-for",
            b"forwarded-for",
            b"x-originating-ip",
            b"x-remote-ip",
            b"x-remote-addr",
            b"proxy-client-ip",
            b"wl-proxy-client-ip",
            b"http-x-forwarded-for",
            b"http-client-ip",
        ];
        // In any case, and `_` for `-`, as the hop reads them.
        for (name, value) in req.iter() {
            if crate::upstream::forwarding_name(name)
                && !NOT_KEYED.iter().any(|n| crate::inbound::spells(name, n))
            {
                out.push('\u{0}');
                // Lower-cased with the rest below.
                push_key_bytes(out, name);
                out.push('=');
                push_key_bytes(out, value.as_bytes());
            }
        }
    }
    out[start..].make_ascii_lowercase();
}

/// Appends the value of `name` as the upstream receives it (for `Vary`), as the hop sets
/// it ([`crate::upstream::sent`]): a dropped header as empty.
pub(super) fn sent_for_key(ask: &Ask<'_>, req: &Fields, name: &HeaderName, out: &mut String) {
    match crate::upstream::sent(req, name.as_str(), ask.peer, ask.trusted, ask.https) {
        crate::upstream::Sent::AsIs => {
            // Present, if empty: an absent field matches only an absent one (RFC 9111
            // §4.1), and a backend may answer `X-Foo:` otherwise than no `X-Foo`.
            if req.contains_key(name) {
                out.push('\u{2}');
            }
            header_for_key(req, name, out)
        }
        crate::upstream::Sent::Dropped => {}
        crate::upstream::Sent::Set(v) => push_key_bytes(out, v.as_bytes()),
    }
}

/// Longest variant part kept as it is in a key; a longer one (a 30 KB `User-Agent` the
/// response varies on) is kept as its SHA-256, so that no key, and no list of a URI's
/// variant keys, grows with what clients send.
const LONGEST_VARIANT: usize = 256;

/// Appends what [`variant_key`] adds to a URI key.
pub(super) fn variant_into(ask: &Ask<'_>, varies: &[HeaderName], req: &Fields, k: &mut String) {
    let start = k.len();
    k.push('\u{0}');
    if !ask.cfg.shared {
        k.push_str(ask.consumer.unwrap_or(""));
    }
    for name in varies {
        k.push('\u{0}');
        sent_for_key(ask, req, name, k);
    }
    if k.len() - start > LONGEST_VARIANT {
        let digest = ring::digest::digest(&ring::digest::SHA256, &k.as_bytes()[start..]);
        k.truncate(start);
        // A part kept whole starts with NUL: the two forms never meet.
        k.push('\u{1}');
        for b in digest.as_ref() {
            k.push(char::from(b"0123456789abcdef"[usize::from(b >> 4)]));
            k.push(char::from(b"0123456789abcdef"[usize::from(b & 15)]));
        }
        // The key is kept as it is (the store's key): not with the room the long part took.
        k.shrink_to_fit();
    }
}

/// The request's host, lower case, without port and trailing dot: what purges match.
pub(super) fn host_of(parts: &Parts) -> String {
    let host = parts
        .headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .map_or("", crate::inbound::host_only);
    host.to_ascii_lowercase()
}

/// Path + the query parameters the route keys on (credentials left out).
pub(super) fn url_of(path: &str, query: Option<&str>, ask: &Ask<'_>) -> String {
    keyed_url(path, query, ask.cfg, ask.credentials)
}

/// Path + the query parameters a route with `cfg` keys on, its API key's parameters
/// (`credentials`) left out: the URL part of that route's keys.
pub fn keyed_url(
    path: &str,
    query: Option<&str>,
    cfg: &RouteCacheConfig,
    credentials: &[String],
) -> String {
    let mut url = String::with_capacity(path.len() + 32);
    url_into(path, query, (cfg, credentials), &mut url);
    url
}

/// Appends [`url_of`]; true when the query names a keyed parameter in more than one
/// spelling (`page` and `%70age`, `PAGE`, `page[]`): backends differ on which one they
/// read, so such a request must not share an entry with any other.
///
/// The query is cut at `&` only, and a piece is kept whole, exactly as sent, when any name
/// in it is keyed: its own, or one after a `;` inside it (`page=1;x=evil` is one value to
/// Python, Node and PHP and two parameters to Java servers, so it never meets `page=1`).
/// Names are matched as backends read them ([`crate::query`]).
pub(super) fn url_into(
    path: &str,
    query: Option<&str>,
    (cfg, credentials): (&RouteCacheConfig, &[String]),
    url: &mut String,
) -> bool {
    url.push_str(path);
    // Where the query starts: `url` may already hold the key's first parts.
    let query_at = url.len();
    let Some(q) = query else { return false };
    let mut ambiguous = false;
    // The first raw spelling seen of each keyed name.
    let mut spelled: SmallVec<[(usize, &str); 4]> = SmallVec::new();
    for piece in q.split('&') {
        if piece.is_empty() {
            continue;
        }
        let mut keep = false;
        for sub in piece.split(';') {
            let raw = crate::query::split_pair(sub).0;
            let name = crate::query::param_name(raw);
            if credentials
                .iter()
                .any(|c| crate::query::same_param(&name, c))
            {
                continue;
            }
            match &cfg.key_query {
                KeyQuery::All => keep = true,
                KeyQuery::None => {}
                KeyQuery::Only(names) => {
                    if let Some(i) = names
                        .iter()
                        .position(|n| crate::query::same_param(&name, n))
                    {
                        match spelled.iter().find(|(j, _)| *j == i) {
                            Some((_, first)) => ambiguous |= *first != raw,
                            None => spelled.push((i, raw)),
                        }
                        keep = true;
                    }
                }
            }
        }
        // A credential alone (on a route that keeps its keys) is never keyed; one beside a
        // keyed name stays in its piece, which only keys more apart.
        if keep {
            url.push(if url.len() == query_at { '?' } else { '&' });
            url.push_str(piece);
        }
    }
    ambiguous
}

/// The key of everything stored for one URI of one route: the route, what the upstream
/// is told of scheme and host ([`authority_into`]), and `url`.
pub(super) fn uri_key(ask: &Ask<'_>, req: &Fields, url: &str) -> String {
    let mut k = String::with_capacity(ask.route.len() + url.len() + 32);
    k.push_str(ask.route);
    k.push('\u{0}');
    authority_into(ask, req, &mut k);
    k.push('\u{0}');
    k.push_str(url);
    k
}

/// The key of one variant: the consumer (unless shared) and the request headers it varies on.
pub(super) fn variant_key(uri: &str, ask: &Ask<'_>, varies: &[HeaderName], req: &Fields) -> String {
    let mut k = String::with_capacity(uri.len() + 64);
    k.push_str(uri);
    variant_into(ask, varies, req, &mut k);
    k
}

/// What a response varies on: the route's key headers and its `Vary` list.
pub(super) fn varies_of(cfg: &RouteCacheConfig, resp: &HeaderMap) -> Varies {
    let mut names: Vec<HeaderName> = cfg.key_headers.clone();
    for v in resp.get_all(header::VARY) {
        for n in v.to_str().unwrap_or("").split(',') {
            if let Ok(n) = HeaderName::from_bytes(n.trim().to_ascii_lowercase().as_bytes()) {
                if !names.contains(&n) {
                    names.push(n);
                }
            }
        }
    }
    names.into()
}

/// The value of request header `name` for a key: the values of all its lines, joined,
/// then those of the same name spelled with `_` for `-` (`X_Tenant`), which CGI and WSGI
/// backends read as the name itself: an answer made for such a value is not another
/// request's.
pub fn header_for_key(req: &Fields, name: &HeaderName, out: &mut String) {
    let mut first = true;
    for v in req.get_all(name) {
        if !first {
            out.push(',');
        }
        first = false;
        push_key_bytes(out, v.as_bytes());
    }
    let want = name.as_str().as_bytes();
    if want.contains(&b'-') {
        for (n, v) in req.iter() {
            if n.contains(&b'_') && crate::inbound::spells(n, want) {
                // Not a byte a value is written with (`push_key_bytes` escapes it).
                out.push('\u{1}');
                push_key_bytes(out, v.as_bytes());
            }
        }
    }
}

/// Appends `b` to a key, byte for byte: printable ASCII as it is, `%` and every other
/// byte as `%XX`. Two values that differ in any byte never meet in one key (a lossy
/// conversion would make every invalid byte the same replacement character).
pub fn push_key_bytes(out: &mut String, b: &[u8]) {
    let plain = |c: u8| c.is_ascii() && c != b'%';
    match std::str::from_utf8(b) {
        Ok(text) if b.iter().all(|&c| plain(c)) => out.push_str(text),
        _ => {
            for &c in b {
                if plain(c) {
                    out.push(char::from(c));
                } else {
                    out.push('%');
                    out.push(char::from(b"0123456789ABCDEF"[usize::from(c >> 4)]));
                    out.push(char::from(b"0123456789ABCDEF"[usize::from(c & 15)]));
                }
            }
        }
    }
}

/// Whether the method's success invalidates what is stored for its URI (RFC 9111 §4.4):
/// every method not defined as safe, unknown ones (`M-SEARCH`, a client's `PURGE`) among
/// them. Purging by name is an admin action; a client's `PURGE` only invalidates its URI,
/// as any unsafe request does.
pub fn is_unsafe(m: &Method) -> bool {
    !matches!(
        *m,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE
    )
}

#[cfg(test)]
mod tests {
    use super::push_key_bytes;

    #[test]
    fn values_differing_in_any_byte_never_share_a_key() {
        let key = |b: &[u8]| {
            let mut s = String::new();
            push_key_bytes(&mut s, b);
            s
        };
        assert_eq!(key(b"gzip, br"), "gzip, br");
        let spelled = [
            &b"\x80"[..],
            b"\x81",
            "\u{FFFD}".as_bytes(),
            b"%80",
            b"%2580",
            "\u{e9}".as_bytes(),
        ]
        .map(key);
        for (i, a) in spelled.iter().enumerate() {
            for b in &spelled[i + 1..] {
                assert_ne!(a, b);
            }
        }
    }
}
