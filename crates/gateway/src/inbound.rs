//! What a request must look like before routing, so that routing and authorization see what
//! the backend will see:
//!
//! - **Host**: exactly one `Host` on HTTP/1.1 (RFC 9112 §3.2); an absolute-form target must
//!   name the same host. Routes match it case-insensitively, without port or trailing dot.
//! - **Path**: percent-encoded unreserved characters decoded, repeated slashes merged;
//!   dot-segments, encoded `/` `\` and NUL, raw `\` and broken escapes refused (400). The
//!   normalized path is the one forwarded. Routes match it without `;` segment parameters.
//! - **Headers**: hop-by-hop headers removed first (a `Connection` header may not name a
//!   header the gateway sets); every client header that spells a name the gateway owns (the
//!   consumer header, `X-Forwarded-*`, credential headers) with `_` for `-` is removed, and
//!   the consumer header itself is always removed: only the gateway sets it.
//! - **Cookies**: the `cookie` fields an HTTP/2 client splits a cookie list into are joined
//!   with `; ` (RFC 9113 §8.2.3), as an HTTP/1.1 backend expects one `Cookie` header.

use crate::exchange::{Fields, Lines, Parts, Refusal};
use http::header::{self, HeaderName};
use http::uri::{PathAndQuery, Uri};
use http::Version;
use smallvec::SmallVec;
use std::borrow::Cow;

/// `Keep-Alive` and `Proxy-Connection`: hop-by-hop, and connection-specific in HTTP/2.
pub(crate) const KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");
pub(crate) const PROXY_CONNECTION: HeaderName = HeaderName::from_static("proxy-connection");

/// Checks and rewrites the request head in place; a refusal is a 400.
pub fn prepare(owned: &Owned, parts: &mut Parts) -> Result<(), Refusal> {
    check_method(parts.method.as_str())?;
    check_host(parts)?;
    if let Some(path) = normalize_path(parts.uri.path())? {
        let pq = match parts.uri.query() {
            Some(q) => format!("{path}?{q}"),
            None => path,
        };
        let pq = PathAndQuery::try_from(pq)
            .map_err(|_| Refusal::BadRequest("invalid request target"))?;
        parts.uri = Uri::from(pq);
    } else if parts.uri.scheme().is_some() {
        // Absolute form: the Host header (checked equal) carries the authority from here on.
        let pq = parts
            .uri
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| PathAndQuery::from_static("/"));
        parts.uri = Uri::from(pq);
    }
    strip_hop_headers(&mut parts.headers, owned);
    remove_owned(&mut parts.headers, owned);
    if parts.version == Version::HTTP_2 {
        join_cookies(&mut parts.headers)?;
    }
    Ok(())
}

/// Refuses a method with a lower-case letter (`post`, `Get`, `move`), as nginx does.
/// Methods are case-sensitive (RFC 9110 §9.1) and every method a route lists is upper
/// case, so no route's `methods` takes `post`; yet a backend that reads methods in any
/// case would act on it as `POST`, past a route's method filter or a more specific route.
fn check_method(m: &str) -> Result<(), Refusal> {
    if m.bytes().any(|b| b.is_ascii_lowercase()) {
        return Err(Refusal::BadRequest("method must be in upper case"));
    }
    Ok(())
}

/// Joins the `cookie` fields of an HTTP/2 request into one, separated by `; ` (RFC 9113
/// §8.2.3: they MUST be before going to HTTP/1.1; browsers send each cookie as its own
/// field). A single field is left as it is.
fn join_cookies(headers: &mut Fields) -> Result<(), Refusal> {
    let mut all = headers.get_all(header::COOKIE).iter();
    if all.next().is_none() || all.next().is_none() {
        return Ok(());
    }
    let mut joined = Vec::new();
    for v in headers.get_all(header::COOKIE) {
        if !joined.is_empty() {
            joined.extend_from_slice(b"; ");
        }
        joined.extend_from_slice(v.as_bytes());
    }
    let v = http::HeaderValue::from_bytes(&joined)
        .map_err(|_| Refusal::BadRequest("invalid Cookie header"))?;
    headers.insert(header::COOKIE, v);
    Ok(())
}

/// The protocol an HTTP/1.1 request asks to upgrade to (`Connection: upgrade` with an
/// `Upgrade` value), if any; `h2c` is never passed on.
pub fn upgrade_asked(parts: &Parts) -> Option<http::HeaderValue> {
    if parts.version != Version::HTTP_11 {
        return None;
    }
    let up = parts.headers.get(header::UPGRADE)?;
    let asked = parts
        .headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case("upgrade"));
    let h2c = up
        .to_str()
        .is_ok_and(|v| v.split(',').any(|p| p.trim().eq_ignore_ascii_case("h2c")));
    (asked && !h2c).then(|| up.clone())
}

/// Header names only the gateway may set, for the checks above.
#[derive(Debug, Default)]
pub struct Owned {
    /// Headers the gateway sets on some route (consumer, claims of a token): removed from
    /// every request.
    pub consumer_headers: Vec<HeaderName>,
    /// Every owned name, lowercase with `-`: client headers that spell one with `_` are
    /// removed, and `Connection` may not name one.
    pub dashed: Vec<String>,
}

impl Owned {
    /// Whether `name` (in any case) is an owned name, with `_` and `-` taken as the same.
    fn matches(&self, name: &[u8]) -> bool {
        self.dashed.iter().any(|d| spells(name, d.as_bytes()))
    }
}

/// Whether header `name` spells `want` (lower case, with `-`) in any case and with `_` for
/// `-`, as CGI and WSGI backends read names (`X_Real_IP` is `HTTP_X_REAL_IP`).
pub(crate) fn spells(name: &[u8], want: &[u8]) -> bool {
    name.len() == want.len()
        && name
            .iter()
            .zip(want)
            .all(|(&c, &w)| c.to_ascii_lowercase() == w || (w == b'-' && c == b'_'))
}

fn check_host(parts: &mut Parts) -> Result<(), Refusal> {
    let mut hosts = parts.headers.get_all(header::HOST).iter();
    let first = hosts.next();
    if hosts.next().is_some() {
        return Err(Refusal::BadRequest("more than one Host header"));
    }
    let host = match first {
        Some(h) => {
            let s = h
                .to_str()
                .map_err(|_| Refusal::BadRequest("invalid Host header"))?;
            if !valid_host(s) {
                return Err(Refusal::BadRequest("invalid Host header"));
            }
            Some(s)
        }
        None => None,
    };
    // An absolute-form target's (or HTTP/2's `:authority`) host is held to the same rules,
    // userinfo (`user@host`) included, which HTTP forbids there.
    if let Some(auth) = parts.uri.authority() {
        if !valid_host(auth.as_str()) {
            return Err(Refusal::BadRequest("invalid host in request target"));
        }
    }
    let from_target = match (parts.uri.authority(), host) {
        (Some(auth), Some(h)) => {
            if !host_only(h).eq_ignore_ascii_case(host_only(auth.as_str())) {
                return Err(Refusal::BadRequest(
                    "request target and Host header name different hosts",
                ));
            }
            // The target's authority is the request's, port included (RFC 9112 §3.2.2,
            // RFC 9113 §8.3.1): a Host naming another port does not go upstream.
            (h != auth.as_str())
                .then(|| http::HeaderValue::from_str(auth.as_str()))
                .transpose()
                .map_err(|_| Refusal::BadRequest("invalid request target"))?
        }
        (_, None) if parts.version == Version::HTTP_11 => {
            return Err(Refusal::BadRequest("HTTP/1.1 request without Host header"));
        }
        // HTTP/1.0 may name its host in the target alone.
        (Some(auth), None) => Some(
            http::HeaderValue::from_str(auth.as_str())
                .map_err(|_| Refusal::BadRequest("invalid request target"))?,
        ),
        (None, _) => None,
    };
    if let Some(v) = from_target {
        parts.headers.insert(header::HOST, v);
    }
    Ok(())
}

/// Whether `s` is a host every reader takes the same way (RFC 9110's `uri-host [":"
/// port]`, held tighter): a name of letters, digits, `-` and `_` in non-empty dot-separated
/// labels (one trailing dot allowed), or a bracketed IPv6 literal; then at most a `:` and up
/// to five digits. Userinfo, percent-escapes, a second `:`, empty labels and other
/// characters are refused, as nginx refuses `..` and a leading dot: a backend, cache or log
/// could read such a value as another host than routing did (`a.example:80:80`,
/// `secret%2eexample.com`). An empty value is a request without a host.
pub fn valid_host(s: &str) -> bool {
    // One pass over the bytes: this runs for every request.
    let b = s.as_bytes();
    if b.is_empty() {
        return true;
    }
    let (name_ok, port) = if b[0] == b'[' {
        let Some(end) = b.iter().position(|&c| c == b']') else {
            return false;
        };
        let ip = &b[1..end];
        let ok = ip.contains(&b':')
            && ip
                .iter()
                .all(|&c| c.is_ascii_hexdigit() || c == b':' || c == b'.');
        (ok, &b[end + 1..])
    } else {
        let end = b.iter().position(|&c| c == b':').unwrap_or(b.len());
        // Labels are not empty: no leading dot and no `..`; one trailing dot is allowed.
        let mut after_dot = true;
        let mut ok = end > 0;
        for &c in &b[..end] {
            if c == b'.' {
                ok &= !after_dot;
                after_dot = true;
            } else {
                ok &= c.is_ascii_alphanumeric() || c == b'-' || c == b'_';
                after_dot = false;
            }
        }
        (ok, &b[end..])
    };
    name_ok
        && match port.split_first() {
            None => true,
            Some((&b':', digits)) => digits.len() <= 5 && digits.iter().all(u8::is_ascii_digit),
            Some(_) => false,
        }
}

/// A Host value without port and trailing dot (`API.example.com.:80` → `API.example.com`).
pub fn host_only(raw: &str) -> &str {
    // Strip a port, keeping IPv6 literals intact.
    let h = match raw.rfind(':') {
        Some(i) if !raw[i..].contains(']') => &raw[..i],
        _ => raw,
    };
    h.strip_suffix('.').unwrap_or(h)
}

/// The path routes are matched against: without `;` segment parameters (`/admin;x=1/y` is
/// `/admin/y`), as Tomcat, Jetty and Spring resolve it before they route. A segment that
/// was a parameter alone leaves no empty segment (`/api/;/admin` is `/api/admin`), since
/// those servers merge the slashes after. The request is forwarded with its parameters.
pub fn routing_path(path: &str) -> Cow<'_, str> {
    if !path.contains(';') {
        return Cow::Borrowed(path);
    }
    let mut out = String::with_capacity(path.len());
    for (i, seg) in path.split('/').enumerate() {
        if i > 0 && !out.ends_with('/') {
            out.push('/');
        }
        out.push_str(seg.split(';').next().unwrap_or(""));
    }
    Cow::Owned(out)
}

fn is_unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// The path as the backend will see it, or `None` when it is already normal. Refuses what
/// a backend could resolve to a path no route allowed.
pub fn normalize_path(path: &str) -> Result<Option<String>, Refusal> {
    if !path.starts_with('/') {
        if path == "*" {
            return Ok(None);
        }
        return Err(Refusal::BadRequest(
            "request target must be an absolute path",
        ));
    }
    let b = path.as_bytes();
    if is_plain(b) {
        return Ok(None);
    }
    let mut out: Vec<u8> = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' => {
                let (Some(hi), Some(lo)) = (
                    b.get(i + 1).copied().and_then(hex),
                    b.get(i + 2).copied().and_then(hex),
                ) else {
                    return Err(Refusal::BadRequest("path has an invalid percent-encoding"));
                };
                let v = hi * 16 + lo;
                match v {
                    b'/' | b'\\' => {
                        return Err(Refusal::BadRequest("path contains an encoded slash"))
                    }
                    0 => return Err(Refusal::BadRequest("path contains an encoded NUL")),
                    v if is_unreserved(v) => out.push(v),
                    _ => {
                        out.push(b'%');
                        out.push(b[i + 1].to_ascii_uppercase());
                        out.push(b[i + 2].to_ascii_uppercase());
                    }
                }
                i += 3;
            }
            b'\\' => return Err(Refusal::BadRequest("path contains a backslash")),
            b'/' if out.last() == Some(&b'/') => i += 1,
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    let last = out.split(|c| *c == b'/').count() - 1;
    for (i, seg) in out.split(|c| *c == b'/').enumerate() {
        // `..;x` counts too: some servers drop `;` parameters before resolving dots.
        let name = seg.split(|c| *c == b';').next().unwrap_or(seg);
        if name == b"." || name == b".." {
            return Err(Refusal::BadRequest("path contains dot-segments"));
        }
        // A segment of parameters alone (`/a/;x/b`): Tomcat and Spring drop it and merge
        // the slashes, other servers keep an empty segment, so no routing agrees with
        // every backend. As the last segment (`/a/;jsessionid=1`) every reading agrees.
        if name.is_empty() && !seg.is_empty() && i < last {
            return Err(Refusal::BadRequest(
                "path has a segment of parameters alone",
            ));
        }
    }
    let out = String::from_utf8(out).map_err(|_| Refusal::BadRequest("invalid path"))?;
    Ok((out != path).then_some(out))
}

/// Whether `n` (in any case) names a header every message loses (RFC 9110 §7.6.1),
/// beside those its `Connection` names.
pub(crate) fn is_hop(n: &[u8]) -> bool {
    // The length picks the names to compare: this runs for every field of every message.
    let spelled: &[&str] = match n.len() {
        2 => &["te"],
        7 => &["trailer", "upgrade"],
        10 => &["connection", "keep-alive"],
        16 => &["proxy-connection"],
        17 => &["transfer-encoding"],
        _ => return false,
    };
    spelled.iter().any(|h| n.eq_ignore_ascii_case(h.as_bytes()))
}

/// Names a `Connection` header may never remove (in any case): what the gateway sets or
/// frames by.
fn protected(name: &[u8], owned: &Owned) -> bool {
    name.eq_ignore_ascii_case(b"host")
        || name.eq_ignore_ascii_case(b"content-length")
        || owned.matches(name)
}

/// Removes the hop-by-hop headers (RFC 9110 §7.6.1), including those a `Connection` header
/// names, except names the gateway owns or frames by. One pass over the names first: most
/// messages carry none.
pub fn strip_hop_headers<H: Lines>(h: &mut H, owned: &Owned) {
    if !h.any_name(is_hop) {
        return;
    }
    // The lists are shared pieces of the head: kept aside, so the names they give can be
    // read while the fields are changed.
    let lists: SmallVec<[http::HeaderValue; 2]> = h.values("connection").cloned().collect();
    // Read as bytes: a byte past ASCII elsewhere in a list does not cancel the names in it.
    let mut named: SmallVec<[&[u8]; 8]> = lists
        .iter()
        .flat_map(|list| list.as_bytes().split(|b| *b == b','))
        .map(|n| n.trim_ascii())
        .filter(|n| !n.is_empty() && !is_hop(n) && !protected(n, owned))
        .collect();
    // A client may name many headers (or one many times): then they are sorted once, and
    // each field is looked up among them rather than compared with every one.
    let many = named.len() > 8;
    if many {
        named.sort_unstable_by(|a, b| cmp_names(a, b));
        named.dedup_by(|a, b| a.eq_ignore_ascii_case(b));
    }
    h.strip_where(|name| {
        is_hop(name)
            || if many {
                named.binary_search_by(|n| cmp_names(n, name)).is_ok()
            } else {
                named.iter().any(|n| n.eq_ignore_ascii_case(name))
            }
    });
}

/// Orders two field names as their lower-case spellings order.
fn cmp_names(a: &[u8], b: &[u8]) -> std::cmp::Ordering {
    a.iter()
        .map(u8::to_ascii_lowercase)
        .cmp(b.iter().map(u8::to_ascii_lowercase))
}

/// Removes the consumer headers and every `_` spelling of an owned name.
fn remove_owned(h: &mut Fields, owned: &Owned) {
    for name in &owned.consumer_headers {
        h.remove(name);
    }
    if h.names().any(|k| k.contains(&b'_')) {
        h.retain(|k, _| !(k.contains(&b'_') && owned.matches(k)));
    }
}

/// Whether `path` needs no normalizing: no escape or backslash, and no `/` followed by
/// `/`, `.` or `;`. One pass over the bytes.
fn is_plain(path: &[u8]) -> bool {
    !path.iter().enumerate().any(|(i, &c)| match c {
        b'%' | b'\\' => true,
        b'/' => matches!(path.get(i + 1), Some(b'/' | b'.' | b';')),
        _ => false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        /// The one pass finds what four searches of the path for each piece would.
        #[test]
        fn a_plain_path_holds_none_of_the_pieces_that_need_normalizing(p in "[a/.;%\\\\]{0,12}") {
            let searched = !p.contains(['%', '\\'])
                && !p.contains("//")
                && !p.contains("/.")
                && !p.contains("/;");
            proptest::prop_assert_eq!(is_plain(p.as_bytes()), searched);
        }
    }

    fn norm(p: &str) -> Result<String, ()> {
        normalize_path(p)
            .map(|o| o.unwrap_or_else(|| p.to_string()))
            .map_err(|_| ())
    }

    #[test]
    fn paths_are_normalized_or_refused() {
        assert_eq!(norm("/test/a.json"), Ok("/test/a.json".into()));
        assert_eq!(
            norm("/test/.well-known/x"),
            Ok("/test/.well-known/x".into())
        );
        assert_eq!(norm("//admin//x"), Ok("/admin/x".into()));
        assert_eq!(norm("/%61dmin/x"), Ok("/admin/x".into()));
        assert_eq!(norm("/a%2db%7e"), Ok("/a-b~".into()));
        assert_eq!(norm("/a%3fb%c3%a9"), Ok("/a%3Fb%C3%A9".into()));
        for bad in [
            "/test/../admin",
            "/test/%2e%2E/admin",
            "/test/.",
            "/test/a%2Fb",
            "/test/a%5cb",
            "/test/a\\b",
            "/x/..;/admin",
            "/api/;/admin",
            "/api/;x=1/admin/",
            "//;//admin",
            "/a%00b",
            "/a%zz",
            "/a%4",
            "/%2e%2e/x",
            "admin",
        ] {
            assert_eq!(norm(bad), Err(()), "{bad}");
        }
    }

    #[test]
    fn routes_see_paths_without_segment_parameters() {
        assert_eq!(routing_path("/admin;x=1/y;v=2"), "/admin/y");
        assert_eq!(routing_path("/admin;/y"), "/admin/y");
        assert_eq!(routing_path("/api/;/admin/users"), "/api/admin/users");
        assert_eq!(routing_path("/api/;x=1/admin"), "/api/admin");
        assert_eq!(routing_path("/;/;x/admin/"), "/admin/");
        assert_eq!(routing_path("/api/;"), "/api/");
        assert!(matches!(routing_path("/plain/path"), Cow::Borrowed(_)));
    }

    #[test]
    fn hop_headers_go_in_any_case_with_few_or_many_names_listed() {
        for extra in [0, 20] {
            let mut list = String::from("X-A, close, HOST, Content-Length");
            for i in 0..extra {
                list.push_str(&format!(", x-n{i}"));
            }
            let mut h = Fields::default();
            for (n, v) in [
                ("connection", list.as_str()),
                ("x-a", "1"),
                ("keep-alive", "timeout=5"),
                ("te", "trailers"),
                ("host", "a"),
                ("content-length", "0"),
                ("x-keep", "1"),
            ] {
                h.append(
                    HeaderName::from_static(n),
                    http::HeaderValue::from_str(v).expect("value"),
                );
            }
            strip_hop_headers(&mut h, &Owned::default());
            let left: Vec<_> = h.names().collect();
            assert_eq!(
                left,
                [&b"host"[..], b"content-length", b"x-keep"],
                "{extra}"
            );
        }
    }

    #[test]
    fn http2_cookie_fields_are_joined_into_one() {
        let mut h = Fields::default();
        h.append(header::COOKIE, http::HeaderValue::from_static("a=1"));
        h.append(header::COOKIE, http::HeaderValue::from_static("b=2"));
        h.append(header::COOKIE, http::HeaderValue::from_static("c=3"));
        join_cookies(&mut h).expect("joined");
        let all: Vec<_> = h.get_all(header::COOKIE).iter().collect();
        assert_eq!(all, ["a=1; b=2; c=3"]);
        let mut one = Fields::default();
        one.insert(header::COOKIE, http::HeaderValue::from_static("a=1, b=2"));
        join_cookies(&mut one).expect("kept");
        assert_eq!(one.get(header::COOKIE).expect("cookie"), "a=1, b=2");
    }

    #[test]
    fn hosts_are_names_or_ip_literals_with_an_optional_port() {
        for ok in [
            "",
            "api",
            "Secret.Example.com.",
            "secret.example.com.:80",
            "a_b-c.example:8080",
            "10.0.0.1:80",
            "[::1]",
            "[::1]:8080",
            "[::ffff:10.0.0.1]",
            "x:",
        ] {
            assert!(valid_host(ok), "{ok}");
        }
        for bad in [
            "user@secret.example.com",
            "secret.example.com:80@x",
            "secret.example.com:80:80",
            "secret.example.com:abc",
            "secret.example.com:123456",
            "secret.example.com..",
            ".secret.example.com",
            "secret..example.com",
            "secret%2eexample.com",
            "secret.example.com/x",
            "secret.example.com\\",
            "secret.example.com ",
            "a,b",
            ":80",
            ".",
            "[::1",
            "[]",
            "[v1.x]",
            "[::1]x",
            "[::1]:8o",
            "[fe80::1%25eth0]",
        ] {
            assert!(!valid_host(bad), "{bad}");
        }
    }

    #[test]
    fn hosts_lose_port_and_trailing_dot() {
        assert_eq!(host_only("secret.example.com."), "secret.example.com");
        assert_eq!(host_only("x.:80"), "x");
        assert_eq!(host_only("[::1]:8080"), "[::1]");
        assert_eq!(host_only("[::1]"), "[::1]");
    }
}
