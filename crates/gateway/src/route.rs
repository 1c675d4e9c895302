//! Route selection: host and path (and method) → the route, from the pinned snapshot.

use crate::policy::method;
use crate::response::Refusal;
use crate::snapshot::{Route, Snapshot};
use http::request::Parts;
use http::HeaderValue;
use tollgate_config::{HostMatch, PathMatch};

/// The request's host, lowercase-insensitive comparison is done by the matchers; port removed.
fn host(parts: &Parts) -> Option<&str> {
    let raw = parts
        .headers
        .get(http::header::HOST)
        .and_then(|h| h.to_str().ok())
        .or_else(|| parts.uri.host())?;
    // Strip a port, keeping IPv6 literals intact.
    Some(match raw.rfind(':') {
        Some(i) if !raw[i..].contains(']') => &raw[..i],
        _ => raw,
    })
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

fn path_matches(m: &PathMatch, path: &str) -> bool {
    match m {
        PathMatch::Exact(p) => path == p,
        PathMatch::Prefix(p) => path.starts_with(p.as_str()),
    }
}

/// Finds the route for a request: the most specific route whose host and path match and
/// whose method filter lets the request through. When routes match host and path but none
/// takes the method, the answer is 405 with the methods they take.
pub fn find<'s>(snap: &'s Snapshot, parts: &Parts, preflight: bool) -> Result<&'s Route, Refusal> {
    let host = host(parts);
    let path = parts.uri.path();
    let mut path_matched = false;
    for route in &snap.routes {
        if !path_matches(&route.cfg.path, path) || !host_matches(&route.cfg.host, host) {
            continue;
        }
        if method::allows(route, &parts.method, preflight) {
            return Ok(route);
        }
        path_matched = true;
    }
    if !path_matched {
        return Err(Refusal::NoRoute);
    }
    // Cold path: collect the methods of every route that matched host and path.
    let mut allow: Vec<&str> = Vec::new();
    for route in &snap.routes {
        if path_matches(&route.cfg.path, path) && host_matches(&route.cfg.host, host) {
            for m in route.cfg.methods.iter().flatten() {
                if !allow.contains(&m.as_str()) {
                    allow.push(m.as_str());
                }
            }
        }
    }
    Err(Refusal::MethodNotAllowed {
        allow: HeaderValue::from_str(&allow.join(", ")).ok(),
    })
}

/// Rejects paths with dot-segments (`/a/../b`), which a backend could resolve to a path no
/// route allowed.
pub fn check_path(path: &str) -> Result<(), Refusal> {
    if !path.starts_with('/') && path != "*" {
        return Err(Refusal::BadRequest(
            "request target must be an absolute path",
        ));
    }
    if !path.contains("/.") && !path.contains("%2") && !path.contains("%5") {
        return Ok(());
    }
    for seg in path.split('/') {
        let lower = seg.to_ascii_lowercase();
        let dots = lower.replace("%2e", ".");
        if dots == "." || dots == ".." {
            return Err(Refusal::BadRequest("path contains dot-segments"));
        }
        if lower.contains("%2f") || lower.contains("%5c") {
            return Err(Refusal::BadRequest("path contains an encoded slash"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::check_path;

    #[test]
    fn dot_segments_are_refused() {
        assert!(check_path("/test/a.json").is_ok());
        assert!(check_path("/test/.well-known/x").is_ok());
        assert!(check_path("/test/../admin").is_err());
        assert!(check_path("/test/%2e%2E/admin").is_err());
        assert!(check_path("/test/.").is_err());
        assert!(check_path("/test/a%2Fb").is_err());
    }
}
