//! Route selection: host and path (and method) → the route, from the pinned snapshot.

use crate::exchange::{Parts, Refusal};
use crate::inbound::{host_only, routing_path};
use crate::policy::method;
use crate::snapshot::{Route, Snapshot};
use http::HeaderValue;
use tollgate_config::{HostMatch, PathMatch};

/// The request's host without port and trailing dot (checked by [`crate::inbound`]).
fn host(parts: &Parts) -> Option<&str> {
    let raw = parts
        .headers
        .get(http::header::HOST)
        .and_then(|h| h.to_str().ok())?;
    Some(host_only(raw)).filter(|h| !h.is_empty())
}

fn host_matches(m: &Option<HostMatch>, host: Option<&str>) -> bool {
    match (m, host) {
        (None, _) => true,
        (Some(_), None) => false,
        (Some(HostMatch::Exact(h)), Some(got)) => got.eq_ignore_ascii_case(h),
        (Some(HostMatch::Suffix(s)), Some(got)) => {
            got.len() > s.len()
                && got.as_bytes()[got.len() - s.len()..].eq_ignore_ascii_case(s.as_bytes())
        }
    }
}

fn path_matches(m: &PathMatch, path: &str, any_case: bool) -> bool {
    match (m, any_case) {
        (PathMatch::Exact(p), false) => path == p,
        (PathMatch::Prefix(p), false) => path.starts_with(p.as_str()),
        (PathMatch::Exact(p), true) => path.eq_ignore_ascii_case(p),
        (PathMatch::Prefix(p), true) => path
            .as_bytes()
            .get(..p.len())
            .is_some_and(|head| head.eq_ignore_ascii_case(p.as_bytes())),
    }
}

fn matches(route: &Route, host: Option<&str>, path: &str) -> bool {
    path_matches(&route.cfg.path, path, route.cfg.case_insensitive)
        && host_matches(&route.cfg.host, host)
}

/// Finds the route for a request: the most specific route whose host and path match and
/// whose method filter lets the request through. When routes match host and path but none
/// takes the method, the answer is 405 with the methods they take, given with the first of
/// those routes: a 405 is counted and logged under the route the request meant.
pub fn find<'s>(
    snap: &'s Snapshot,
    parts: &Parts,
    preflight: bool,
) -> Result<&'s Route, (Refusal, Option<&'s Route>)> {
    let host = host(parts);
    let path = routing_path(parts.uri.path());
    let path = path.as_ref();
    let mut meant: Option<&'s Route> = None;
    for route in &snap.routes {
        if !matches(route, host, path) {
            continue;
        }
        if method::allows(route, &parts.method, preflight) {
            return Ok(route);
        }
        meant = meant.or(Some(route));
    }
    if meant.is_none() {
        return Err((Refusal::NoRoute, None));
    }
    // Cold path: collect the methods of every route that matched host and path.
    let mut allow: Vec<&str> = Vec::new();
    for route in &snap.routes {
        if matches(route, host, path) {
            let listed = (route.cfg.methods.iter().flatten())
                .filter(|m| **m != http::Method::CONNECT)
                .map(http::Method::as_str);
            let open = route
                .cfg
                .methods
                .is_none()
                .then_some(method::OPEN.iter().copied());
            for m in listed.chain(open.into_iter().flatten()) {
                if !allow.contains(&m) {
                    allow.push(m);
                }
            }
        }
    }
    Err((
        Refusal::MethodNotAllowed {
            allow: HeaderValue::from_str(&allow.join(", ")).ok(),
        },
        meant,
    ))
}
