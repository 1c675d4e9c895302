//! `POST /cache/purge`: what an operator names to drop from the cache, read as requests'
//! URLs are keyed.

use super::answer::{error, json, Answer};
use crate::cache::{Keying, Purge};
use crate::gateway::Gateway;
use http::{Request, StatusCode};
use hyper::body::Incoming;
use serde_json::json as j;

/// `POST /cache/purge` with a JSON body: `{"url": "http://host/path?q"}` (or a path for
/// every host), `{"prefix": "/path/"}`, `{"tag": "surrogate-key"}` or `{"all": true}`.
pub async fn purge(gw: &Gateway, req: Request<Incoming>) -> Answer {
    let bad = |why: &str| error(StatusCode::BAD_REQUEST, why);
    let body = match super::answer::read_body(req, 64 * 1024, "64KiB").await {
        Ok(b) => b,
        Err(answer) => return answer,
    };
    let Ok(v) = super::strict::parse(&body) else {
        return bad(
            "the body must be JSON: {\"url\": …}, {\"prefix\": …}, {\"tag\": …} or {\"all\": true}",
        );
    };
    let text = |k: &str| v.get(k).and_then(|s| s.as_str()).map(str::to_string);
    let what = if v.get("all").and_then(|b| b.as_bool()) == Some(true) {
        Purge::All
    } else if let Some(u) = text("url") {
        match purged_url(&u) {
            Ok(u) => Purge::Url(u),
            Err(why) => return bad(&format!("url {u:?}: {why}")),
        }
    } else if let Some(p) = text("prefix") {
        match normal_path(&p) {
            Ok(p) => Purge::Prefix(p),
            Err(why) => return bad(&format!("prefix {p:?}: {why}")),
        }
    } else if let Some(t) = text("tag") {
        Purge::Tag(t)
    } else {
        return bad("name what to purge: url, prefix, tag, or all: true");
    };
    let snap = gw.snapshot();
    let routes: Vec<Keying<'_>> = snap
        .routes
        .iter()
        .filter_map(|r| {
            Some(Keying {
                route: &r.cfg.name,
                cfg: r.cfg.cache.as_ref()?,
                credentials: r.cfg.auth.as_ref().map_or(&[], |a| a.query.as_slice()),
            })
        })
        .collect();
    let n = gw.cache().purge(what, &routes);
    json(StatusCode::OK, &j!({"purged": n}))
}

/// A path as the listener makes a request's before it is keyed (`/a%7Eb` is `/a~b`,
/// `//` is `/`), so that a purge finds what a client stored whichever way it spelled it;
/// what no request could have been stored under (dot-segments, an encoded slash) is refused.
fn normal_path(p: &str) -> Result<String, &'static str> {
    // An empty prefix: every path, as ever.
    if p.is_empty() {
        return Ok(String::new());
    }
    match crate::inbound::normalize_path(p) {
        Ok(n) => Ok(n.unwrap_or_else(|| p.to_string())),
        Err(crate::exchange::Refusal::BadRequest(why)) => Err(why),
        Err(_) => Err("invalid path"),
    }
}

/// A purge's URL (`http://host/path?q`, or `/path?q`) with its path made as a request's.
fn purged_url(u: &str) -> Result<String, &'static str> {
    let (before, rest) = if u.starts_with('/') {
        ("", u)
    } else {
        let Some(at) = u.find("://") else {
            return Err("give a path or an http(s) URL");
        };
        let after = &u[at + 3..];
        let path_at = after.find(['/', '?']).map_or(u.len(), |i| at + 3 + i);
        u.split_at(path_at)
    };
    let (path, query) = match rest.split_once('?') {
        Some((p, q)) => (p, Some(q)),
        None => (rest, None),
    };
    let path = if path.is_empty() {
        "/".to_string()
    } else {
        normal_path(path)?
    };
    Ok(match query {
        Some(q) => format!("{before}{path}?{q}"),
        None => format!("{before}{path}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_purged_url_is_read_as_a_request_path_is() {
        let ok = |u| purged_url(u).expect(u);
        assert_eq!(ok("/o/a%7Eb"), "/o/a~b");
        assert_eq!(ok("/o/x//y?q=%7E"), "/o/x/y?q=%7E");
        assert_eq!(ok("/%41bc"), "/Abc");
        assert_eq!(
            ok("http://GW.test:8080/a%7eb?x"),
            "http://GW.test:8080/a~b?x"
        );
        assert_eq!(ok("https://gw.test"), "https://gw.test/");
        assert_eq!(ok("http://gw.test?x=1"), "http://gw.test/?x=1");
        for bad in ["/a/../b", "/a%2Fb", "/a%zz", "gw.test/a"] {
            assert!(purged_url(bad).is_err(), "{bad}");
        }
        assert_eq!(normal_path("/pre%7Efix/").as_deref(), Ok("/pre~fix/"));
        assert!(normal_path("pre").is_err());
        assert_eq!(normal_path("").as_deref(), Ok(""), "every path");
    }
}
