//! CORS: preflights (OPTIONS with `Origin` and `Access-Control-Request-Method`) are
//! answered here and never forwarded; responses to allowed origins get the CORS headers.

use crate::exchange::{Parts, Refusal};
use crate::response::{full, Body};
use crate::snapshot::Route;
use bytes::Bytes;
use http::header::{
    ACCESS_CONTROL_ALLOW_CREDENTIALS, ACCESS_CONTROL_ALLOW_HEADERS, ACCESS_CONTROL_ALLOW_METHODS,
    ACCESS_CONTROL_ALLOW_ORIGIN, ACCESS_CONTROL_EXPOSE_HEADERS, ACCESS_CONTROL_MAX_AGE,
    ACCESS_CONTROL_REQUEST_HEADERS, ACCESS_CONTROL_REQUEST_METHOD, ORIGIN, VARY,
};
use http::{HeaderMap, HeaderValue, Method, Response, StatusCode};
use tollgate_config::CorsConfig;

/// Headers tollgate adds that scripts should be able to read.
const ALWAYS_EXPOSED: &str = "RateLimit, RateLimit-Policy, Retry-After";

/// Whether the request is a CORS preflight.
pub fn is_preflight(parts: &Parts) -> bool {
    parts.method == Method::OPTIONS
        && parts.headers.contains_key(ORIGIN)
        && parts.headers.contains_key(ACCESS_CONTROL_REQUEST_METHOD)
}

/// The request's origin if the route does CORS and allows it.
pub fn allowed_origin(route: &Route, parts: &Parts) -> Option<HeaderValue> {
    let cors = route.cfg.cors.as_ref()?;
    let origin = parts.headers.get(ORIGIN)?;
    match &cors.origins {
        None if !cors.credentials => Some(HeaderValue::from_static("*")),
        None => Some(origin.clone()),
        Some(list) => list
            .iter()
            .any(|o| o.as_bytes() == origin.as_bytes())
            .then(|| origin.clone()),
    }
}

/// Answers a preflight for a CORS route: 204 with the CORS headers, or 403 for an origin
/// that is not allowed. Other requests go on (`Ok(None)`).
pub fn preflight(route: &Route, parts: &Parts) -> Result<Option<Response<Body>>, Refusal> {
    let Some(cors) = route.cfg.cors.as_ref() else {
        return Ok(None);
    };
    if !is_preflight(parts) {
        return Ok(None);
    }
    let origin = allowed_origin(route, parts).ok_or(Refusal::OriginNotAllowed)?;
    let mut r = Response::new(full(Bytes::new()));
    *r.status_mut() = StatusCode::NO_CONTENT;
    let h = r.headers_mut();
    h.insert(ACCESS_CONTROL_ALLOW_ORIGIN, origin);
    let methods: Vec<&str> = cors.methods.iter().map(Method::as_str).collect();
    if let Ok(v) = HeaderValue::from_str(&methods.join(", ")) {
        h.insert(ACCESS_CONTROL_ALLOW_METHODS, v);
    }
    // `*` with credentials would be read as a header named `*`: the headers the preflight
    // asks for are what it means, but for `Authorization`, which the Fetch standard's `*`
    // never covers (it must be named).
    let wildcard = |l: &Vec<http::HeaderName>| l.iter().any(|n| n.as_str() == "*");
    let asked = parts.headers.get(ACCESS_CONTROL_REQUEST_HEADERS);
    match &cors.headers {
        Some(list) if cors.credentials && wildcard(list) => {
            let named = list.contains(&http::header::AUTHORIZATION);
            if let Some(v) = asked.and_then(|a| but_authorization(a, named)) {
                h.insert(ACCESS_CONTROL_ALLOW_HEADERS, v);
            }
            h.append(
                VARY,
                HeaderValue::from_static("Access-Control-Request-Headers"),
            );
        }
        Some(list) if !list.is_empty() => {
            let names: Vec<&str> = list.iter().map(|n| n.as_str()).collect();
            if let Ok(v) = HeaderValue::from_str(&names.join(", ")) {
                h.insert(ACCESS_CONTROL_ALLOW_HEADERS, v);
            }
        }
        Some(_) => {}
        None => {
            if let Some(asked) = asked {
                h.insert(ACCESS_CONTROL_ALLOW_HEADERS, asked.clone());
            }
            h.append(
                VARY,
                HeaderValue::from_static("Access-Control-Request-Headers"),
            );
        }
    }
    if let Some(age) = cors.max_age {
        h.insert(ACCESS_CONTROL_MAX_AGE, HeaderValue::from(age.as_secs()));
    }
    if cors.credentials {
        h.insert(
            ACCESS_CONTROL_ALLOW_CREDENTIALS,
            HeaderValue::from_static("true"),
        );
    }
    vary_origin(cors, h);
    Ok(Some(r))
}

/// The header names `asked` lists, less `Authorization` unless `named`; `None` when none
/// is left.
pub(crate) fn but_authorization(asked: &HeaderValue, named: bool) -> Option<HeaderValue> {
    if named {
        return Some(asked.clone());
    }
    let text = asked.to_str().ok()?;
    let kept: Vec<&str> = text
        .split(',')
        .map(str::trim)
        .filter(|n| !n.is_empty() && !n.eq_ignore_ascii_case("authorization"))
        .collect();
    if kept.is_empty() {
        return None;
    }
    HeaderValue::from_str(&kept.join(", ")).ok()
}

/// Adds the CORS headers for an allowed origin to an actual (non-preflight) response.
pub fn decorate(cors: &CorsConfig, origin: HeaderValue, h: &mut HeaderMap) {
    h.insert(ACCESS_CONTROL_ALLOW_ORIGIN, origin);
    let mut expose = String::from(ALWAYS_EXPOSED);
    for name in &cors.expose_headers {
        expose.push_str(", ");
        expose.push_str(name.as_str());
    }
    if let Ok(v) = HeaderValue::from_str(&expose) {
        h.insert(ACCESS_CONTROL_EXPOSE_HEADERS, v);
    }
    if cors.credentials {
        h.insert(
            ACCESS_CONTROL_ALLOW_CREDENTIALS,
            HeaderValue::from_static("true"),
        );
    }
    vary_origin(cors, h);
}

/// Says that the answer depends on `Origin` where the route's CORS headers do (a list of
/// origins, or credentials): on every answer, those without CORS headers too (no `Origin`,
/// one not allowed), so that no cache serves an answer without them to an allowed origin.
pub fn vary_origin(cors: &CorsConfig, h: &mut HeaderMap) {
    if cors.origins.is_some() || cors.credentials {
        h.append(VARY, HeaderValue::from_static("Origin"));
    }
}
