//! Route validation: path and host matching, methods, auth, allow, limits, CORS.

use super::limits::limits;
use super::problems::Problems;
use crate::file;
use crate::model::*;
use http::{HeaderName, Method};
use std::collections::{HashMap, HashSet};

const DEFAULT_CONSUMER_HEADER: &str = "x-consumer";

/// The methods of IANA's HTTP Method Registry (RFC 9110 and the WebDAV family): a route
/// may name others, but a typo (`FETCH`, `GTE`) is more likely than a method of its own.
const REGISTERED: &[&str] = &[
    "ACL",
    "BASELINE-CONTROL",
    "BIND",
    "CHECKIN",
    "CHECKOUT",
    "CONNECT",
    "COPY",
    "DELETE",
    "GET",
    "HEAD",
    "LABEL",
    "LINK",
    "LOCK",
    "MERGE",
    "MKACTIVITY",
    "MKCALENDAR",
    "MKCOL",
    "MKREDIRECTREF",
    "MKWORKSPACE",
    "MOVE",
    "OPTIONS",
    "ORDERPATCH",
    "PATCH",
    "POST",
    "PRI",
    "PROPFIND",
    "PROPPATCH",
    "PUT",
    "QUERY",
    "REBIND",
    "REPORT",
    "SEARCH",
    "TRACE",
    "UNBIND",
    "UNCHECKOUT",
    "UNLINK",
    "UNLOCK",
    "UPDATE",
    "UPDATEREDIRECTREF",
    "VERSION-CONTROL",
];

fn methods(raw: &[String], at: &str, p: &mut Problems) -> Vec<Method> {
    let mut out = Vec::new();
    for (i, m) in raw.iter().enumerate() {
        let upper = m.to_ascii_uppercase();
        if upper == "CONNECT" {
            p.warn(
                format!("{at}[{i}]"),
                "CONNECT is never forwarded (the gateway opens no tunnels): such requests get 405"
                    .to_string(),
            );
        }
        if Method::from_bytes(upper.as_bytes()).is_ok() && !REGISTERED.contains(&upper.as_str()) {
            p.warn(
                format!("{at}[{i}]"),
                format!("{m:?} is not a registered HTTP method (taken as {upper})"),
            );
        } else if Method::from_bytes(upper.as_bytes()).is_ok() && *m != upper {
            // Clients' methods are case-sensitive (a `get` gets 400): the list is read in
            // upper case, and says so.
            p.warn(
                format!("{at}[{i}]"),
                format!("methods are case-sensitive: {m:?} is taken as {upper}"),
            );
        }
        match Method::from_bytes(upper.as_bytes()) {
            Ok(m) if !out.contains(&m) => out.push(m),
            Ok(_) => {}
            Err(_) => p.add(format!("{at}[{i}]"), format!("{m:?} is not an HTTP method")),
        }
    }
    if out.is_empty() {
        p.add(at, "at least one method is required when the list is given");
    }
    out
}

fn header_names(raw: &[String], at: &str, p: &mut Problems) -> Vec<HeaderName> {
    let mut out = Vec::new();
    for (i, h) in raw.iter().enumerate() {
        match HeaderName::from_bytes(h.as_bytes()) {
            Ok(n) => out.push(n),
            Err(_) => p.add(format!("{at}[{i}]"), format!("{h:?} is not a header name")),
        }
    }
    out
}

/// The consumers routes may name: those the config holds, and the names written inline
/// (a consumer refused for its own problem is not "unknown" as well).
pub(super) struct ConsumerNames<'a> {
    /// The consumers taken.
    pub table: &'a crate::Consumers,
    /// Every inline consumer's name, taken or not.
    pub written: HashSet<&'a str>,
}

pub(super) fn route(
    r: &file::Route,
    at: &str,
    base: &std::path::Path,
    upstream_index: &HashMap<String, usize>,
    plan_index: &HashMap<String, usize>,
    consumer_index: &ConsumerNames<'_>,
    p: &mut Problems,
) -> Option<RouteConfig> {
    // A route without one path is checked on all the same, so that every problem of the
    // file is told at once; it is not taken.
    let mut pathless = false;
    let path = match (&r.path_prefix, &r.path) {
        (Some(pre), None) => PathMatch::Prefix(pre.clone()),
        (None, Some(exact)) => PathMatch::Exact(exact.clone()),
        (Some(pre), Some(_)) => {
            p.add(at, "give either `path_prefix` or `path`, not both");
            pathless = true;
            PathMatch::Prefix(pre.clone())
        }
        (None, None) => {
            p.add(at, "a route needs `path_prefix` or `path`");
            pathless = true;
            PathMatch::Prefix("/".to_string())
        }
    };
    let (PathMatch::Prefix(s) | PathMatch::Exact(s)) = &path;
    if !s.starts_with('/') {
        let field = if r.path.is_some() {
            "path"
        } else {
            "path_prefix"
        };
        p.add(
            format!("{at}.{field}"),
            format!("{s:?} must start with '/'"),
        );
    }
    if r.strip_prefix && r.path.is_some() {
        p.add(
            format!("{at}.strip_prefix"),
            "only applies to `path_prefix` routes",
        );
    }
    let host = r.host.as_ref().map(|h| {
        let h = h.to_ascii_lowercase();
        if h.contains([':', '/', ' ']) || h.is_empty() {
            p.add(
                format!("{at}.host"),
                format!("{h:?} must be a host name without port or scheme"),
            );
        }
        let m = match h.strip_prefix('*') {
            Some(suffix) if suffix.starts_with('.') => HostMatch::Suffix(suffix.to_string()),
            _ => HostMatch::Exact(h.clone()),
        };
        let (HostMatch::Suffix(rest) | HostMatch::Exact(rest)) = &m;
        if rest.contains('*') {
            p.add(
                format!("{at}.host"),
                format!("{h:?} never matches: a wildcard may only be the whole first label (*.example.com)"),
            );
        }
        m
    });
    let upstream = upstream_index.get(&r.upstream).copied();
    if upstream.is_none() {
        p.add(
            format!("{at}.upstream"),
            format!("unknown upstream {:?}", r.upstream),
        );
    }
    // `GET` brings `HEAD` (RFC 9110 §9.3.2: a server that answers GET answers HEAD; nginx's
    // `limit_except GET` takes both): a HEAD never falls to a broader route and its
    // policies, past the ones its GET meets.
    let route_methods = r.methods.as_ref().map(|m| {
        let mut list = methods(m, &format!("{at}.methods"), p);
        if list.contains(&Method::GET) && !list.contains(&Method::HEAD) {
            list.push(Method::HEAD);
        }
        list
    });

    let auth = r.auth.as_ref().map(|a| {
        if a.mtls && !(a.query.is_empty() && a.header.is_empty()) {
            p.add(
                format!("{at}.auth.mtls"),
                "names the consumer by its client certificate; leave out `query` and `header`",
            );
        }
        let jwt = a
            .jwt
            .as_ref()
            .and_then(|j| super::jwt::jwt(j, &format!("{at}.auth.jwt"), base, plan_index, p));
        if a.mtls && a.jwt.is_some() {
            p.add(
                format!("{at}.auth.jwt"),
                "a route names its consumer either by client certificate (`mtls`) or by token, not both",
            );
        }
        if a.jwt.is_some() && a.header.iter().any(|h| h.eq_ignore_ascii_case("authorization")) {
            p.add(
                format!("{at}.auth.header"),
                "`Authorization` carries the route's bearer token; take the API key from another header",
            );
        }
        let (query, header) = if a.mtls || (a.jwt.is_some() && a.query.is_empty() && a.header.is_empty()) {
            (Vec::new(), Vec::new())
        } else if a.query.is_empty() && a.header.is_empty() {
            (vec!["apikey".to_string()], vec!["x-api-key".to_string()])
        } else {
            (a.query.clone(), a.header.clone())
        };
        for (i, q) in query.iter().enumerate() {
            if q.is_empty() || q.contains(['&', '=', '#']) {
                p.add(
                    format!("{at}.auth.query[{i}]"),
                    format!("{q:?} is not a query parameter name"),
                );
            }
        }
        let consumer_header = a
            .consumer_header
            .as_deref()
            .unwrap_or(DEFAULT_CONSUMER_HEADER);
        let consumer_header =
            HeaderName::from_bytes(consumer_header.as_bytes()).unwrap_or_else(|_| {
                p.add(
                    format!("{at}.auth.consumer_header"),
                    format!("{consumer_header:?} is not a header name"),
                );
                HeaderName::from_static(DEFAULT_CONSUMER_HEADER)
            });
        for (h, _) in jwt.iter().flat_map(|j| j.claims_to_headers.iter()) {
            if *h == consumer_header || header.iter().any(|k| k.eq_ignore_ascii_case(h.as_str())) {
                p.add(
                    format!("{at}.auth.jwt.claims_to_headers.{h}"),
                    "is the route's consumer or key header; a claim may not set it",
                );
            }
        }
        AuthConfig {
            query,
            header: header_names(&header, &format!("{at}.auth.header"), p),
            keep_credential: a.keep_credential,
            consumer_header,
            mtls: a.mtls,
            jwt: jwt.map(std::sync::Arc::new),
        }
    });

    let allow = r.allow.as_ref().map(|a| {
        if auth.is_none() {
            p.add(
                format!("{at}.allow"),
                "needs `auth` on the route (consumers are identified by API key)",
            );
        }
        let mut out = AllowConfig::default();
        for (i, c) in a.consumers.iter().enumerate() {
            match consumer_index.table.find(c) {
                Some(ix) => out.consumers.push(ix),
                None if consumer_index.written.contains(c.as_str()) => {}
                None => p.add(
                    format!("{at}.allow.consumers[{i}]"),
                    format!("unknown consumer {c:?}"),
                ),
            }
        }
        for (i, pl) in a.plans.iter().enumerate() {
            match plan_index.get(pl) {
                Some(&ix) => out.plans.push(ix),
                None => p.add(
                    format!("{at}.allow.plans[{i}]"),
                    format!("unknown plan {pl:?}"),
                ),
            }
        }
        out.consumers.sort_unstable();
        out.consumers.dedup();
        out
    });

    let limits = limits(&r.limits, &format!("{at}.limits"), p);
    if !limits.is_empty() && auth.is_none() {
        p.add(
            format!("{at}.limits"),
            "needs `auth` on the route (limits are counted per consumer)",
        );
    }

    let cors = r.cors.as_ref().map(|c| {
        let any = c.origins.iter().any(|o| o == "*");
        if c.origins.is_empty() {
            p.add(
                format!("{at}.cors.origins"),
                "at least one origin (or \"*\")",
            );
        }
        // Browsers send `Origin` as `scheme://host[:port]`, in lower case, and it is
        // compared byte for byte: an origin written another way would never match.
        for (i, o) in c.origins.iter().enumerate() {
            if o != "*" && !origin_form(o) {
                p.warn(
                    format!("{at}.cors.origins[{i}]"),
                    format!("{o:?} never matches: browsers send an origin as scheme://host[:port], lower case, with no path or trailing slash, no default port, no wildcard, and a name beyond ASCII in punycode (it is compared byte for byte)"),
                );
            }
        }
        if any && c.credentials {
            p.add(
                format!("{at}.cors.credentials"),
                "cannot be true with origin \"*\"; list the origins",
            );
        }
        // With credentials, browsers read `*` in `Access-Control-Expose-Headers` as a
        // header named `*` (Fetch standard). In `headers` the gateway answers a preflight
        // with the headers it asks for instead, which is what `*` means without them.
        if c.credentials {
            if let Some(i) = c.expose_headers.iter().position(|h| h == "*") {
                p.add(
                    format!("{at}.cors.expose_headers[{i}]"),
                    "\"*\" exposes nothing when credentials are allowed (browsers read it as a header named *); list the headers",
                );
            }
        }
        if let Some(age) = c.max_age.as_ref().filter(|a| a.0.as_secs() > 86_400) {
            p.warn(
                format!("{at}.cors.max_age"),
                format!("browsers keep a preflight at most 24h (Firefox; Chromium 2h): {}s is cut to that", age.0.as_secs()),
            );
        }
        let methods = match (&c.methods, &route_methods) {
            (Some(m), _) => methods(m, &format!("{at}.cors.methods"), p),
            (None, Some(m)) => m.clone(),
            (None, None) => ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE"]
                .iter()
                .filter_map(|m| Method::from_bytes(m.as_bytes()).ok())
                .collect(),
        };
        CorsConfig {
            origins: (!any).then(|| c.origins.clone()),
            methods,
            headers: c
                .headers
                .as_ref()
                .map(|h| header_names(h, &format!("{at}.cors.headers"), p)),
            expose_headers: header_names(
                &c.expose_headers,
                &format!("{at}.cors.expose_headers"),
                p,
            ),
            max_age: c.max_age.map(|d| d.0),
            credentials: c.credentials,
        }
    });

    let cache = r.cache.as_ref().map(|c| {
        let key_query = match &c.key_query {
            None => KeyQuery::All,
            Some(file::KeyQuery::Word(w)) if w == "all" => KeyQuery::All,
            Some(file::KeyQuery::Word(w)) if w == "none" => KeyQuery::None,
            Some(file::KeyQuery::Word(w)) => {
                p.add(
                    format!("{at}.cache.key_query"),
                    format!("{w:?} must be `all`, `none` or a list of parameter names"),
                );
                KeyQuery::All
            }
            Some(file::KeyQuery::Names(n)) => KeyQuery::Only(n.clone()),
        };
        RouteCacheConfig {
            default_ttl: c.default_ttl.map_or(std::time::Duration::ZERO, |d| d.0),
            shared: c.shared,
            key_query,
            key_headers: header_names(&c.key_headers, &format!("{at}.cache.key_headers"), p),
        }
    });

    let name = r.name.clone().unwrap_or_else(|| {
        let host = r.host.as_deref().unwrap_or("");
        format!("{host}{s}")
    });
    if pathless {
        return None;
    }
    Some(RouteConfig {
        name,
        host,
        path,
        methods: route_methods,
        upstream: upstream.unwrap_or(0),
        strip_prefix: r.strip_prefix,
        preserve_host: r.preserve_host,
        case_insensitive: r.case_insensitive,
        request_buffering: r.request_buffering.unwrap_or(true),
        auth,
        allow,
        limits,
        cors,
        cache,
        websocket: r.websocket,
    })
}

/// Whether `o` is written as a browser sends `Origin`: `scheme://host[:port]` in lower
/// case, no path (or the opaque `null`).
fn origin_form(o: &str) -> bool {
    if o == "null" {
        return true;
    }
    let Some((scheme, rest)) = o.split_once("://") else {
        return false;
    };
    // The scheme's own port is left out by browsers; a wildcard is not a pattern here;
    // a name beyond ASCII is sent in its punycode form.
    let default_port = match scheme {
        "https" => rest.ends_with(":443"),
        "http" => rest.ends_with(":80"),
        _ => false,
    };
    !scheme.is_empty()
        && !rest.is_empty()
        && !default_port
        && o.is_ascii()
        && !rest.contains(['/', '?', '#', '*'])
        && !o
            .bytes()
            .any(|b| b.is_ascii_uppercase() || b.is_ascii_whitespace())
}
