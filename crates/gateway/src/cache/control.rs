//! RFC 9111 for a shared cache: `Cache-Control` directives, whether a response may be
//! stored, how long it stays fresh, and its age. A malformed `Cache-Control` makes a
//! response "not cacheable", never an error.

use crate::exchange::Lines;
use http::header::{self, HeaderMap};
use http::{Method, StatusCode};
use std::time::{Duration, SystemTime};

/// The directives of one `Cache-Control` (all its header lines together).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Directives {
    /// `no-store`.
    pub no_store: bool,
    /// `no-cache` (with or without field names): revalidate before every use.
    pub no_cache: bool,
    /// `private`: not for a shared cache.
    pub private: bool,
    /// `public`.
    pub public: bool,
    /// `must-revalidate` or `s-maxage`: never served stale.
    pub must_revalidate: bool,
    /// `proxy-revalidate`: never served stale by a shared cache, like `must-revalidate`,
    /// but not among what lets an answer to a request with credentials be stored (§3.5).
    pub proxy_revalidate: bool,
    /// `max-age`, seconds.
    pub max_age: Option<u64>,
    /// `s-maxage`, seconds (for shared caches, over `max-age`).
    pub s_maxage: Option<u64>,
    /// `stale-while-revalidate`, seconds (RFC 5861).
    pub stale_while_revalidate: Option<u64>,
    /// `stale-if-error`, seconds (RFC 5861).
    pub stale_if_error: Option<u64>,
    /// `must-understand`: stored only for a status whose caching rules the cache knows,
    /// and then `no-store` is ignored (RFC 9111 §5.2.2.3).
    pub must_understand: bool,
    /// Something in it could not be read: the response is not cacheable.
    pub malformed: bool,
    /// It held no directive at all.
    pub empty: bool,
}

fn seconds(v: Option<&str>) -> Option<u64> {
    let v = v?.trim_matches('"');
    if v.is_empty() || !v.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    // Larger than any sensible lifetime: RFC 9111 §1.2.2 says to take 2^31.
    Some(v.parse::<u64>().unwrap_or(1 << 31).min(1 << 31))
}

/// Reads every `Cache-Control` line of `headers`.
pub fn directives(headers: &impl Lines) -> Directives {
    directives_of(headers, &header::CACHE_CONTROL)
}

/// `Surrogate-Control` (Edge Architecture): directives aimed at a gateway cache.
const SURROGATE_CONTROL: header::HeaderName = header::HeaderName::from_static("surrogate-control");
/// `CDN-Cache-Control` (RFC 9213): directives aimed at caches run by the provider.
const CDN_CACHE_CONTROL: header::HeaderName = header::HeaderName::from_static("cdn-cache-control");

/// The directives a response gives this cache (RFC 9213 §2.1): those of the first
/// targeted field on its list (`Surrogate-Control`, then `CDN-Cache-Control`) with a
/// valid, non-empty value, or else `Cache-Control`'s. The bool says whether a targeted
/// field was used: then `Expires` is not read either.
pub fn response_directives(resp: &HeaderMap) -> (Directives, bool) {
    for name in [SURROGATE_CONTROL, CDN_CACHE_CONTROL] {
        if resp.contains_key(&name) {
            let d = directives_of(resp, &name);
            if !d.malformed && !d.empty {
                return (d, true);
            }
        }
    }
    (directives(resp), false)
}

/// Reads every line of the directives field `name`. A directive aimed at another device
/// (`max-age=60;edge2` in `Surrogate-Control`) is not this cache's and is skipped.
fn directives_of(headers: &impl Lines, name: &header::HeaderName) -> Directives {
    let mut d = Directives {
        empty: true,
        ..Directives::default()
    };
    for line in headers.values(name.as_str()) {
        let Ok(line) = line.to_str() else {
            d.malformed = true;
            continue;
        };
        // `;` is no separator in `Cache-Control`, but backends write `no-store; private`
        // for `no-store, private`, and nginx and Varnish find the words there: read as
        // one, so that what such a backend meant to keep private is not stored. In
        // `Surrogate-Control` it targets a device instead (above).
        let targets = *name == SURROGATE_CONTROL;
        let separators: &[char] = if targets { &[','] } else { &[',', ';'] };
        for item in line.split(separators) {
            let item = item.trim();
            if item.is_empty() {
                continue;
            }
            if targets && item.contains(';') {
                continue;
            }
            d.empty = false;
            let (name, value) = match item.split_once('=') {
                Some((n, v)) => (n.trim(), Some(v.trim())),
                None => (item, None),
            };
            // A directive's name in quotes (`"private"`) is still that directive.
            let name = name
                .strip_prefix('"')
                .and_then(|n| n.strip_suffix('"'))
                .unwrap_or(name);
            // A directive given twice keeps its first value (RFC 9111 §4.2.1).
            let timed =
                |d: &mut Directives, slot: fn(&mut Directives) -> &mut Option<u64>| match seconds(
                    value,
                ) {
                    Some(s) => {
                        slot(d).get_or_insert(s);
                    }
                    None => d.malformed = true,
                };
            match name.to_ascii_lowercase().as_str() {
                "no-store" => d.no_store = true,
                "no-cache" => d.no_cache = true,
                "private" => d.private = true,
                "public" => d.public = true,
                "must-revalidate" => d.must_revalidate = true,
                "proxy-revalidate" => d.proxy_revalidate = true,
                "must-understand" => d.must_understand = true,
                "max-age" => timed(&mut d, |d| &mut d.max_age),
                "s-maxage" => {
                    timed(&mut d, |d| &mut d.s_maxage);
                    d.must_revalidate = true;
                }
                "stale-while-revalidate" => timed(&mut d, |d| &mut d.stale_while_revalidate),
                "stale-if-error" => timed(&mut d, |d| &mut d.stale_if_error),
                _ => {}
            }
        }
    }
    d
}

/// The `Age` a response arrived with (RFC 9111 §5.1): the first member of its value, when
/// that is a plain non-negative integer (larger ones are taken as 2^31). Anything else (a
/// sign, a fraction, a suffix, a parameter, quotes) makes the field invalid, and it is
/// ignored.
pub fn age(resp: &HeaderMap) -> Option<u64> {
    let first = resp.get(header::AGE)?.to_str().ok()?;
    let member = first.split(',').next()?.trim_matches([' ', '\t']);
    if member.is_empty() || !member.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(member.parse::<u64>().unwrap_or(1 << 31).min(1 << 31))
}

/// Statuses whose caching rules this cache knows, for `must-understand`.
fn understood(status: StatusCode) -> bool {
    heuristic(status) || matches!(status.as_u16(), 302 | 303 | 307)
}

/// Statuses a cache may give a heuristic (default) lifetime (RFC 9110 §15.1).
fn heuristic(status: StatusCode) -> bool {
    matches!(
        status.as_u16(),
        200 | 203 | 204 | 300 | 301 | 308 | 404 | 405 | 410 | 414 | 501
    )
}

fn date(headers: &HeaderMap, name: header::HeaderName) -> Option<SystemTime> {
    let v = headers.get(name)?.to_str().ok()?;
    httpdate::parse_http_date(v).ok()
}

/// What a stored response needs to know of its freshness.
#[derive(Debug, Default, Clone, Copy)]
pub struct Freshness {
    /// How long it is fresh after it left the origin.
    pub lifetime: Duration,
    /// Its age when it arrived (`Age`, and `Date` against the arrival time).
    pub initial_age: Duration,
    /// Never served stale, never served without revalidation past its lifetime.
    pub must_revalidate: bool,
    /// Revalidated before every use.
    pub no_cache: bool,
    /// Served stale while one refresh runs in the background, this long past its lifetime.
    pub stale_while_revalidate: Duration,
    /// Served stale when the upstream fails, this long past its lifetime.
    pub stale_if_error: Duration,
    /// It came with a `Surrogate-Control`: what of it is this cache's is not passed on.
    pub surrogate: bool,
}

/// Whether a response to `method` may be stored by a shared cache, and for how long it is
/// fresh. `authorized`: the request went upstream with `Authorization` (RFC 9111 §3.5).
/// `default_ttl` applies to heuristically cacheable statuses that state no lifetime.
pub fn storable(
    method: &Method,
    status: StatusCode,
    req: &impl Lines,
    resp: &HeaderMap,
    authorized: bool,
    default_ttl: Duration,
    arrived: SystemTime,
) -> Option<Freshness> {
    if *method != Method::GET
        || status.is_informational()
        || status == StatusCode::PARTIAL_CONTENT
        || status == StatusCode::NOT_MODIFIED
    {
        return None;
    }
    let (d, targeted) = response_directives(resp);
    if d.must_understand && !understood(status) {
        return None;
    }
    // With `must-understand` on a status it knows, the cache ignores `no-store`.
    let no_store = d.no_store && !d.must_understand;
    if d.malformed || no_store || d.private || directives(req).no_store {
        return None;
    }
    // `*`, or a name no request header can have (`"*"`, `X Foo`): no key can tell the
    // variants apart.
    if resp.get_all(header::VARY).iter().any(|v| {
        v.to_str().map_or(true, |v| {
            v.split(',').map(str::trim).any(|n| {
                n == "*" || (!n.is_empty() && header::HeaderName::from_bytes(n.as_bytes()).is_err())
            })
        })
    }) {
        return None;
    }
    if authorized && !(d.must_revalidate || d.public || d.s_maxage.is_some()) {
        return None;
    }
    let explicit = d.s_maxage.or(d.max_age).map(Duration::from_secs);
    // `Date` is read only when it matters: for `Expires`, and for the age of what is kept.
    let explicit = match explicit {
        Some(l) => Some(l),
        None if !targeted && resp.contains_key(header::EXPIRES) => {
            // An Expires that cannot be read means already expired (RFC 9111 §5.3).
            let expires = date(resp, header::EXPIRES).unwrap_or(SystemTime::UNIX_EPOCH);
            let from = date(resp, header::DATE).unwrap_or(arrived);
            Some(expires.duration_since(from).unwrap_or(Duration::ZERO))
        }
        None => None,
    };
    let lifetime = match explicit {
        Some(l) => l,
        None if heuristic(status) || d.public => default_ttl,
        None => return None,
    };
    let validators = resp.contains_key(header::ETAG) || resp.contains_key(header::LAST_MODIFIED);
    if lifetime.is_zero() && !validators {
        // Stale at once and nothing to revalidate with: no use keeping it.
        return None;
    }
    let age = age(resp).map_or(Duration::ZERO, Duration::from_secs);
    let apparent = date(resp, header::DATE)
        .and_then(|d| arrived.duration_since(d).ok())
        .unwrap_or(Duration::ZERO);
    Some(Freshness {
        lifetime,
        initial_age: age.max(apparent),
        must_revalidate: d.must_revalidate || d.proxy_revalidate,
        no_cache: d.no_cache,
        stale_while_revalidate: Duration::from_secs(d.stale_while_revalidate.unwrap_or(0)),
        stale_if_error: Duration::from_secs(d.stale_if_error.unwrap_or(0)),
        surrogate: resp.contains_key(SURROGATE_CONTROL),
    })
}

/// Removes from an answer to a client the `Surrogate-Control` directives this cache acted
/// on (Edge Architecture §3: they are for gateway caches, not for clients), keeping those
/// aimed at another device (`max-age=60;edge2`).
pub fn strip_surrogate(h: &mut HeaderMap) {
    if !h.contains_key(&SURROGATE_CONTROL) {
        return;
    }
    let mut others = Vec::new();
    for line in h.get_all(&SURROGATE_CONTROL) {
        for item in line.as_bytes().split(|&b| b == b',') {
            let item = item.trim_ascii();
            if item.contains(&b';') {
                if !others.is_empty() {
                    others.extend_from_slice(b", ");
                }
                others.extend_from_slice(item);
            }
        }
    }
    h.remove(&SURROGATE_CONTROL);
    // Every byte came from a header value, so this holds.
    if let Ok(v) = header::HeaderValue::from_bytes(&others) {
        if !others.is_empty() {
            h.insert(SURROGATE_CONTROL, v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn resp(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_str(v).expect("value"));
        }
        h
    }

    fn fresh_for(status: u16, pairs: &[(&'static str, &str)], authorized: bool) -> Option<u64> {
        storable(
            &Method::GET,
            StatusCode::from_u16(status).expect("status"),
            &HeaderMap::new(),
            &resp(pairs),
            authorized,
            Duration::from_secs(120),
            SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000_000),
        )
        .map(|f| f.lifetime.as_secs())
    }

    fn age_of(values: &[&str]) -> Option<u64> {
        let pairs: Vec<(&'static str, &str)> = values.iter().map(|v| ("age", *v)).collect();
        age(&resp(&pairs))
    }

    #[test]
    fn only_a_plain_non_negative_age_counts() {
        assert_eq!(age_of(&["7200"]), Some(7200));
        assert_eq!(age_of(&["7200, 10"]), Some(7200), "first member");
        assert_eq!(age_of(&["10", "7200"]), Some(10), "first line");
        assert_eq!(age_of(&["99999999999999999999"]), Some(1 << 31));
        for bad in [
            "abc", "-7200", "7200.0", "7200s", "7200;a=b", "\"7200\"", "", "1e3",
        ] {
            assert_eq!(age_of(&[bad]), None, "{bad}");
        }
    }

    #[test]
    fn an_answer_to_credentials_is_stored_only_on_what_section_3_5_names() {
        let cc = |v| [("cache-control", v)];
        assert_eq!(fresh_for(200, &cc("max-age=60"), true), None);
        assert_eq!(fresh_for(200, &cc("max-age=60, public"), true), Some(60));
        assert_eq!(
            fresh_for(200, &cc("max-age=60, must-revalidate"), true),
            Some(60)
        );
        assert_eq!(fresh_for(200, &cc("s-maxage=60"), true), Some(60));
        // `proxy-revalidate` is not among them: it only forbids serving stale.
        assert_eq!(
            fresh_for(200, &cc("max-age=60, proxy-revalidate"), true),
            None
        );
        let f = storable(
            &Method::GET,
            StatusCode::OK,
            &HeaderMap::new(),
            &resp(&cc("max-age=60, proxy-revalidate")),
            false,
            Duration::ZERO,
            SystemTime::UNIX_EPOCH,
        )
        .expect("stored without credentials");
        assert!(f.must_revalidate, "never served stale");
    }

    #[test]
    fn cache_control_written_with_semicolons_or_quotes_is_read_as_meant() {
        for cc in [
            "no-store; no-cache",
            "private; max-age=0",
            "no-cache; no-store; must-revalidate",
            "public;private",
            "\"private\"",
            "max-age=60, \"no-store\"",
        ] {
            assert_eq!(
                fresh_for(200, &[("cache-control", cc)], false),
                None,
                "{cc}"
            );
        }
        assert_eq!(
            fresh_for(200, &[("cache-control", "max-age=60; foo")], false),
            Some(60)
        );
        for vary in ["\"*\"", "X Foo", "Accept-Encoding, X Foo"] {
            assert_eq!(
                fresh_for(
                    200,
                    &[("cache-control", "max-age=60"), ("vary", vary)],
                    false
                ),
                None,
                "{vary}"
            );
        }
        assert_eq!(
            fresh_for(
                200,
                &[
                    ("cache-control", "max-age=60"),
                    ("vary", "Accept-Encoding, ")
                ],
                false
            ),
            Some(60)
        );
        // In Surrogate-Control a `;` still targets a device: not this cache's.
        assert_eq!(
            fresh_for(
                200,
                &[("surrogate-control", "max-age=60;edge2, max-age=30")],
                false
            ),
            Some(30)
        );
    }

    #[test]
    fn targeted_fields_take_over_from_cache_control() {
        let h = [
            ("cache-control", "no-store"),
            ("surrogate-control", "max-age=30"),
        ];
        assert_eq!(fresh_for(200, &h, false), Some(30));
        let h = [
            ("cache-control", "max-age=60"),
            ("cdn-cache-control", "no-store"),
        ];
        assert_eq!(fresh_for(200, &h, false), None);
        let h = [
            ("cache-control", "max-age=60"),
            ("surrogate-control", "max-age=5;other-device"),
        ];
        assert_eq!(fresh_for(200, &h, false), Some(60), "aimed elsewhere");
        let h = [
            ("cache-control", "max-age=60"),
            ("cdn-cache-control", "max-age=x"),
        ];
        assert_eq!(fresh_for(200, &h, false), Some(60), "invalid: not used");
        let h = [
            ("cdn-cache-control", "max-age=20"),
            ("date", "Sun, 09 Sep 2001 01:46:40 GMT"),
            ("expires", "Sun, 09 Sep 2001 01:46:40 GMT"),
        ];
        assert_eq!(fresh_for(200, &h, false), Some(20), "Expires ignored");
    }

    #[test]
    fn must_understand_stores_only_known_statuses() {
        let h = [("cache-control", "must-understand, no-store, max-age=60")];
        assert_eq!(fresh_for(200, &h, false), Some(60));
        assert_eq!(fresh_for(299, &h, false), None);
        assert_eq!(fresh_for(418, &h, false), None);
    }

    #[test]
    fn lifetimes_follow_rfc_9111() {
        assert_eq!(fresh_for(200, &[], false), Some(120), "default ttl");
        assert_eq!(
            fresh_for(200, &[("cache-control", "max-age=60")], false),
            Some(60)
        );
        assert_eq!(
            fresh_for(200, &[("cache-control", "max-age=60, s-maxage=30")], false),
            Some(30)
        );
        // Given twice, the first counts (§4.2.1), in one line or across lines.
        assert_eq!(
            fresh_for(200, &[("cache-control", "max-age=0, max-age=60")], false),
            None
        );
        assert_eq!(
            fresh_for(
                200,
                &[
                    ("cache-control", "max-age=30"),
                    ("cache-control", "max-age=0")
                ],
                false
            ),
            Some(30)
        );
        assert_eq!(
            fresh_for(
                200,
                &[
                    ("date", "Sun, 09 Sep 2001 01:46:40 GMT"),
                    ("expires", "Sun, 09 Sep 2001 01:47:40 GMT")
                ],
                false
            ),
            Some(60)
        );
        assert_eq!(
            fresh_for(200, &[("cache-control", "no-store")], false),
            None
        );
        assert_eq!(fresh_for(200, &[("cache-control", "private")], false), None);
        assert_eq!(
            fresh_for(200, &[("cache-control", "max-age=abc")], false),
            None
        );
        assert_eq!(
            fresh_for(200, &[("cache-control", "max-age=60")], true),
            None
        );
        assert_eq!(
            fresh_for(200, &[("cache-control", "max-age=60, public")], true),
            Some(60)
        );
        assert_eq!(fresh_for(200, &[("vary", "*")], false), None);
        assert_eq!(fresh_for(302, &[], false), None, "no heuristic for 302");
        assert_eq!(
            fresh_for(302, &[("cache-control", "max-age=5")], false),
            Some(5)
        );
        assert_eq!(
            fresh_for(200, &[("cache-control", "max-age=0")], false),
            None
        );
        assert_eq!(
            fresh_for(
                200,
                &[("cache-control", "max-age=0"), ("etag", "\"a\"")],
                false
            ),
            Some(0),
            "kept to revalidate"
        );
    }
}
