//! The cache's targets: `Cache-Control` and its kin, `Range`, query parameter names.

use crate::cache::control;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, StatusCode};
use std::time::{Duration, SystemTime};

/// The headers `cache_control` lines may set, chosen by their first byte.
const CACHE_HEADERS: [(bool, HeaderName); 11] = [
    (false, header::CACHE_CONTROL),
    (false, header::CACHE_CONTROL),
    (false, header::VARY),
    (false, header::EXPIRES),
    (false, header::DATE),
    (false, header::AGE),
    (false, header::ETAG),
    (true, header::CACHE_CONTROL),
    (false, header::LAST_MODIFIED),
    (false, HeaderName::from_static("surrogate-control")),
    (false, HeaderName::from_static("cdn-cache-control")),
];

/// `cache_control`: `directives` and `storable` on arbitrary headers. Input: lines, each a
/// byte choosing the header (and whether request or response) and its value; the first line
/// chooses status, method and `authorized` instead.
pub fn cache_control(data: &[u8]) {
    let mut lines = data.split(|b| *b == b'\n');
    let knobs = lines.next().unwrap_or_default();
    let knob = |i: usize| knobs.get(i).copied().unwrap_or(0);
    let (mut req, mut resp) = (HeaderMap::new(), HeaderMap::new());
    for line in lines {
        let Some((&which, value)) = line.split_first() else {
            continue;
        };
        let Ok(value) = HeaderValue::from_bytes(value) else {
            continue;
        };
        let (on_request, name) = &CACHE_HEADERS[usize::from(which) % CACHE_HEADERS.len()];
        let map = if *on_request { &mut req } else { &mut resp };
        map.append(name.clone(), value);
    }
    // The directives this cache follows: a targeted field's, or else Cache-Control's.
    let (d, _) = control::response_directives(&resp);
    assert!(control::age(&resp).is_none_or(|a| a <= 1 << 31));
    for v in [
        d.max_age,
        d.s_maxage,
        d.stale_while_revalidate,
        d.stale_if_error,
    ]
    .into_iter()
    .flatten()
    {
        assert!(v <= 1 << 31, "{v} seconds");
    }
    // What of Surrogate-Control is this cache's never reaches a client; another device's
    // members pass.
    let mut out = resp.clone();
    control::strip_surrogate(&mut out);
    for v in out.get_all("surrogate-control") {
        for item in v.as_bytes().split(|&b| b == b',') {
            assert!(item.contains(&b';'), "{v:?}");
        }
    }
    let status = [200, 203, 204, 206, 301, 304, 404, 418, 500, 101][usize::from(knob(0)) % 10];
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::OK);
    let method = if knob(1) & 1 == 0 {
        Method::GET
    } else {
        Method::POST
    };
    let authorized = knob(1) & 2 != 0;
    let arrived = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
    let ttl = Duration::from_secs(u64::from(knob(2)));
    let Some(f) = control::storable(&method, status, &req, &resp, authorized, ttl, arrived) else {
        return;
    };
    // `must-understand` on a status the cache knows sets `no-store` aside.
    assert!(method == Method::GET && (!d.no_store || d.must_understand));
    assert!(!d.private && !d.malformed);
    assert!(!control::directives(&req).no_store);
    assert!(!authorized || d.public || d.must_revalidate || d.s_maxage.is_some());
    assert_eq!(f.must_revalidate, d.must_revalidate || d.proxy_revalidate);
    assert_eq!(f.no_cache, d.no_cache);
    let validators = resp.contains_key(header::ETAG) || resp.contains_key(header::LAST_MODIFIED);
    assert!(!f.lifetime.is_zero() || validators);
    if let Some(s) = d.s_maxage.or(d.max_age) {
        assert_eq!(f.lifetime, Duration::from_secs(s));
    }
}

/// `range_query`: the request pieces the cache reads by hand. The first line is a `Range`
/// value judged against a body length taken from the second line's length; every later
/// line is a query parameter name. A range served must lie inside the body; a name must
/// decode without panicking and match itself as it would be configured.
pub fn range_query(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let mut lines = text.split('\n');
    let range = lines.next().unwrap_or("");
    let len = lines.next().map_or(0, str::len) * 37;
    if let Ok(v) = HeaderValue::from_str(range) {
        let mut req = crate::exchange::Fields::default();
        req.insert(header::RANGE, v);
        if let Some(Ok(r)) = crate::cache::answer::byte_range(&req, len) {
            assert!(
                r.start < r.end && r.end <= len,
                "{range:?} on {len} bytes: {r:?}"
            );
        }
    }
    for raw in lines {
        let name = crate::query::param_name(raw);
        assert!(!name.contains('\0'), "{raw:?} → {name:?}");
        assert!(!name.starts_with(' '), "{raw:?} → {name:?}");
        assert!(crate::query::same_param(&name, &name), "{raw:?}");
        let _ = crate::query::is_one_of(raw, &[name.to_string()]);
    }
}
