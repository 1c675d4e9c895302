//! The admin listener: health, status, metrics, usage, analytics, config, reload, cache
//! purge and the dashboard.
//!
//! Every endpoint but `/healthz` and the dashboard page (`/`, which holds no data and asks
//! for the token itself) requires `Authorization: Bearer TOKEN` when a token is set
//! (`admin.token_file` or `TOLLGATE_ADMIN_TOKEN`), compared in constant time; a wrong or
//! missing token gets 401 with no detail. The listener has its own connection cap, head
//! timeout and idle limit, so it never takes connections from the proxy listeners.

mod answer;
mod api;
mod consumers;
mod purge;
mod strict;

use answer::{answer, error, json, Answer, JSON};

use crate::gateway::Gateway;
use crate::listener::{accept_capped, AcceptErrors};
use crate::observe::text_format;
use http::header::HeaderValue;
use http::{Method, Request, StatusCode};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use std::convert::Infallible;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tollgate_config::AdminConfig;

/// The dashboard: one self-contained page, no external scripts or fonts.
const DASHBOARD: &str = include_str!("dashboard.html");

/// Compares in time that does not depend on where the first difference is.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn authorized(req: &Request<Incoming>, token: Option<&str>) -> bool {
    let Some(token) = token else { return true };
    req.headers()
        .get(http::header::AUTHORIZATION)
        .and_then(|v| bearer(v.as_bytes()))
        .is_some_and(|got| same_secret(got, token.as_bytes()))
}

/// The credentials of a `Bearer` authorization: the scheme in any case (RFC 9110 §11.1),
/// spaces around the token allowed.
fn bearer(value: &[u8]) -> Option<&[u8]> {
    let (scheme, rest) = value.split_at_checked(6)?;
    if !scheme.eq_ignore_ascii_case(b"bearer") || !rest.starts_with(b" ") {
        return None;
    }
    Some(rest.trim_ascii())
}

fn method_not_allowed(allow: &'static str) -> Answer {
    let mut r = error(StatusCode::METHOD_NOT_ALLOWED, "method not allowed");
    r.headers_mut()
        .insert(http::header::ALLOW, HeaderValue::from_static(allow));
    r
}

/// Without a token, the admin port's only guard against web pages is the browser's: a
/// page can send a "simple" cross-site POST, and a DNS-rebound name makes the browser read
/// answers as its own. So without a token only `Host`s that name the admin address (`own`)
/// or a loopback address or name (`localhost`) are answered, and a POST must be
/// `application/json` (which no page sends cross-site without a preflight the admin port
/// never grants, whatever the browser's age) and is refused when the browser says it comes
/// from elsewhere: a foreign (or `null`) `Origin`, or a `Sec-Fetch-Site` other than
/// `same-origin` or `none`.
fn same_site(req: &Request<Incoming>, own: Option<std::net::IpAddr>) -> Result<(), &'static str> {
    let host = req
        .headers()
        .get(http::header::HOST)
        .map(|h| h.to_str().unwrap_or("\u{0}"));
    if let Some(host) = host {
        let name = crate::inbound::host_only(host);
        let ip = name.trim_start_matches('[').trim_end_matches(']');
        let ok = ip
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback() || Some(ip) == own)
            || name.eq_ignore_ascii_case("localhost")
            || name.to_ascii_lowercase().ends_with(".localhost");
        if !ok || !crate::inbound::valid_host(host) {
            return Err(
                "without an admin token, only the admin address or a loopback name is answered",
            );
        }
    }
    if req.method() == Method::POST {
        if let Some(origin) = req.headers().get(http::header::ORIGIN) {
            let own = host.is_some_and(|h| {
                origin.as_bytes() == format!("http://{h}").as_bytes()
                    || origin.as_bytes() == format!("https://{h}").as_bytes()
            });
            if !own {
                return Err("without an admin token, a POST from another origin is refused");
            }
        }
        let site = req.headers().get("sec-fetch-site").map(|v| v.as_bytes());
        if site.is_some_and(|s| s != b"same-origin" && s != b"none") {
            return Err("without an admin token, a POST from another site is refused");
        }
        let json = req
            .headers()
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(';').next())
            .is_some_and(|v| v.trim().eq_ignore_ascii_case("application/json"));
        if !json {
            return Err("without an admin token, a POST must be application/json");
        }
    }
    Ok(())
}

async fn handle(
    gw: &Arc<Gateway>,
    req: Request<Incoming>,
    token: Option<&str>,
    own: Option<std::net::IpAddr>,
) -> Answer {
    if token.is_none() {
        if let Err(why) = same_site(&req, own) {
            return error(StatusCode::FORBIDDEN, why);
        }
    }
    let path = req.uri().path().to_string();
    let open = path == "/healthz" || path == "/";
    if !open && !authorized(&req, token) {
        let mut r = error(StatusCode::UNAUTHORIZED, "admin token required");
        r.headers_mut().insert(
            http::header::WWW_AUTHENTICATE,
            HeaderValue::from_static("Bearer"),
        );
        return r;
    }
    if path == "/consumers" || path.starts_with("/consumers/") {
        // Consumers and their keys: only with a token, whatever the address.
        if token.is_none() {
            return error(
                StatusCode::FORBIDDEN,
                "managing consumers needs admin.token_file (or TOLLGATE_ADMIN_TOKEN)",
            );
        }
        let rest = path["/consumers".len()..].to_string();
        return consumers::handle(gw, req, &rest).await;
    }
    let post_only = matches!(path.as_str(), "/cache/purge" | "/reload");
    match (post_only, req.method()) {
        (true, &Method::POST) => {}
        (true, _) => return method_not_allowed("POST"),
        (false, &Method::GET | &Method::HEAD) => {}
        (false, _) => return method_not_allowed("GET, HEAD"),
    }
    if let Some(bad) = unknown_query(&path, req.uri().query()) {
        return error(StatusCode::BAD_REQUEST, &bad);
    }
    match path.as_str() {
        "/healthz" => answer(StatusCode::OK, JSON, r#"{"status":"ok"}"#),
        "/" => answer(StatusCode::OK, "text/html; charset=utf-8", DASHBOARD),
        "/metrics" => {
            // OpenMetrics to who asks for it (Prometheus does), else the text format.
            let accept = req
                .headers()
                .get(http::header::ACCEPT)
                .map(|v| v.as_bytes());
            if text_format::wants_openmetrics(accept) {
                answer(
                    StatusCode::OK,
                    crate::observe::metrics::CONTENT_TYPE,
                    gw.metrics_text(),
                )
            } else {
                answer(
                    StatusCode::OK,
                    text_format::CONTENT_TYPE,
                    text_format::from_openmetrics(&gw.metrics_text()),
                )
            }
        }
        "/status" => api::status(gw),
        "/config" => api::config(gw),
        "/reload" => api::reload(gw).await,
        "/cache" => api::cache(gw),
        "/cache/purge" => purge::purge(gw, req).await,
        "/analytics" => api::analytics(gw, req.uri().query()).await,
        "/top" => api::top(gw).await,
        "/series" => json(
            StatusCode::OK,
            &serde_json::json!({ "samples": gw.series() }),
        ),
        p => match p.strip_prefix("/usage/") {
            // Percent-decoded as `/consumers/NAME` is: a name may hold `?`, `#` or `%`.
            Some(name) => api::usage(gw, &consumers::segment(name)).await,
            None => error(StatusCode::NOT_FOUND, "no such admin endpoint"),
        },
    }
}

/// Why a query is refused (400): the endpoints other than `/analytics` (and
/// `/consumers`, which read theirs) take no parameters, so a name given is one they do
/// not know. The dashboard page (`/`, which reads `?token=` in the browser), `/healthz`
/// (probes) and `/metrics` (a scrape config's `params`, a cache-buster) take any; unknown
/// paths get their 404.
fn unknown_query(path: &str, query: Option<&str>) -> Option<String> {
    let known = matches!(
        path,
        "/status" | "/config" | "/reload" | "/cache" | "/cache/purge" | "/top" | "/series"
    ) || path.starts_with("/usage/");
    if !known {
        return None;
    }
    let endpoint = if path.starts_with("/usage/") {
        "/usage/{consumer}"
    } else {
        path
    };
    answer::takes_none(endpoint, query)
}

/// Serves the admin endpoints on `listener` until the task is dropped.
pub async fn serve(gw: Arc<Gateway>, listener: TcpListener, cfg: AdminConfig) {
    let cap = Arc::new(Semaphore::new(cfg.max_connections));
    let token: Option<Arc<str>> = cfg.token.map(Arc::from);
    let own = listener.local_addr().ok().map(|a| a.ip());
    // The dashboard's charts start from the last minutes of these samples.
    let sampled = Arc::downgrade(&gw);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
        loop {
            tick.tick().await;
            let Some(gw) = sampled.upgrade() else { return };
            gw.sample_series();
        }
    });
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .keep_alive(true)
        .header_read_timeout(cfg.header_timeout);
    let mut errors = AcceptErrors::default();
    loop {
        let (stream, _, permit) = accept_capped(&listener, &cap, &mut errors).await;
        let gw = gw.clone();
        let token = token.clone();
        let conn = builder.serve_connection(
            TokioIo::new(stream),
            service_fn(move |req| {
                let gw = gw.clone();
                let token = token.clone();
                async move { Ok::<_, Infallible>(handle(&gw, req, token.as_deref(), own).await) }
            }),
        );
        tokio::spawn(async move {
            let _ = conn.await;
            drop(permit);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::{bearer, unknown_query};

    #[test]
    fn endpoints_without_parameters_name_the_one_given() {
        assert_eq!(
            unknown_query("/status", Some("verbose=1&x")).as_deref(),
            Some("unknown query parameter \"verbose\": /status takes none")
        );
        assert_eq!(
            unknown_query("/usage/alice", Some("hist%6Fry")).as_deref(),
            Some("unknown query parameter \"history\": /usage/{consumer} takes none")
        );
        for (path, query) in [
            ("/status", None),
            ("/status", Some("")),
            ("/status", Some("&")),
            ("/metrics", Some("_=1733")),
            ("/", Some("token=abc")),
            ("/healthz", Some("probe=lb")),
            ("/analytics", Some("step=1h")),
            ("/nowhere", Some("x=1")),
        ] {
            assert_eq!(unknown_query(path, query), None, "{path}?{query:?}");
        }
    }

    #[test]
    fn the_bearer_scheme_is_read_in_any_case() {
        for (value, token) in [
            (&b"Bearer s3cret"[..], Some(&b"s3cret"[..])),
            (b"bearer s3cret", Some(b"s3cret")),
            (b"BEARER   s3cret ", Some(b"s3cret")),
            (b"Bearers3cret", None),
            (b"Basic s3cret", None),
            (b"Bear", None),
        ] {
            assert_eq!(bearer(value), token, "{}", String::from_utf8_lossy(value));
        }
    }
}
