//! Method filter: a route lists the methods it takes; others get 405 with `Allow`.
//! It runs during route selection ([`crate::route::find`]), so two routes on one path may
//! take different methods.

use crate::snapshot::Route;
use http::Method;

/// Whether `route` takes `method`. A CORS preflight (OPTIONS) is taken by any route that
/// does CORS, whatever its methods, so the preflight can be answered at the edge. `TRACE`
/// (which echoes the request, credentials included, back) is taken only by a route that
/// lists it. `CONNECT` is taken by none: the gateway opens no tunnels (nginx answers it
/// 405 too), and one forwarded as an ordinary request would be read as a tunnel's start.
/// Methods are matched as written (RFC 9110 §9.1); a method with a lower-case letter
/// (`connect`, `post`) was refused before routing ([`crate::inbound::prepare`]), and
/// `CONNECT` and `TRACE` are compared in any case here all the same.
pub fn allows(route: &Route, method: &Method, preflight: bool) -> bool {
    let m = method.as_str();
    if m.eq_ignore_ascii_case("CONNECT") {
        return false;
    }
    match &route.cfg.methods {
        None => !m.eq_ignore_ascii_case("TRACE"),
        Some(list) => list.contains(method) || (preflight && route.cfg.cors.is_some()),
    }
}

/// What a route without a list of methods takes, for `Allow`: every method but `TRACE`.
pub const OPEN: &[&str] = &["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"];
