//! The admin listener: `GET /usage/{consumer}`, `GET /metrics`, `GET /healthz`, `GET /cache`
//! and `POST /cache/purge`.
//! With `admin.token_file`, every endpoint but `/healthz` asks for `Authorization: Bearer
//! TOKEN`. It has its own connection cap, head timeout and idle limit, so it never takes
//! connections from the proxy listeners.

use crate::cache::Purge;
use crate::gateway::Gateway;
use crate::listener::{accept_capped, AcceptErrors};
use crate::usage::{usage, UsageError};
use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_TYPE};
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use std::convert::Infallible;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tollgate_config::AdminConfig;

fn answer(
    status: StatusCode,
    content_type: &'static str,
    body: impl Into<Bytes>,
) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

/// Compares in time that does not depend on where the first difference is.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn authorized(req: &Request<Incoming>, token: Option<&str>) -> bool {
    let Some(token) = token else { return true };
    req.headers()
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "))
        .is_some_and(|got| same_secret(got, token.as_bytes()))
}

async fn handle(
    gw: &Gateway,
    req: Request<Incoming>,
    token: Option<&str>,
) -> Response<Full<Bytes>> {
    const JSON: &str = "application/json";
    if req.uri().path() != "/healthz" && !authorized(&req, token) {
        let mut r = answer(
            StatusCode::UNAUTHORIZED,
            JSON,
            r#"{"status":401,"error":"admin token required"}"#,
        );
        r.headers_mut().insert(
            http::header::WWW_AUTHENTICATE,
            HeaderValue::from_static("Bearer"),
        );
        return r;
    }
    if req.uri().path() == "/cache/purge" {
        if req.method() != Method::POST {
            let mut r = answer(
                StatusCode::METHOD_NOT_ALLOWED,
                JSON,
                r#"{"status":405,"error":"method not allowed"}"#,
            );
            r.headers_mut()
                .insert(http::header::ALLOW, HeaderValue::from_static("POST"));
            return r;
        }
        return purge(gw, req).await;
    }
    if req.method() != Method::GET {
        return answer(
            StatusCode::METHOD_NOT_ALLOWED,
            JSON,
            r#"{"status":405,"error":"method not allowed"}"#,
        );
    }
    let path = req.uri().path();
    if path == "/healthz" {
        return answer(StatusCode::OK, JSON, r#"{"status":"ok"}"#);
    }
    if path == "/cache" {
        let store = &gw.cache().store;
        let (entries, bytes) = store.usage();
        let m = &store.metrics;
        let n = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
        let body = serde_json::json!({
            "entries": entries,
            "bytes": bytes,
            "hits": n(&m.hits),
            "misses": n(&m.misses),
            "stale": n(&m.stale),
            "revalidated": n(&m.revalidated),
            "coalesced": n(&m.coalesced),
            "stored": n(&m.stored),
            "evictions": n(&m.evictions),
            "purged": n(&m.purged),
        });
        return answer(StatusCode::OK, JSON, body.to_string());
    }
    if path == "/metrics" {
        let text = gw.metrics_text();
        return answer(StatusCode::OK, "text/plain; version=0.0.4", text);
    }
    if let Some(name) = path.strip_prefix("/usage/") {
        let snap = gw.snapshot();
        return match usage(&snap, gw.cluster().map(|c| c.as_ref()), name, gw.now()).await {
            Ok(u) => answer(
                StatusCode::OK,
                JSON,
                serde_json::to_string(&u).unwrap_or_default(),
            ),
            Err(UsageError::UnknownConsumer(_)) => answer(
                StatusCode::NOT_FOUND,
                JSON,
                r#"{"status":404,"error":"no such consumer"}"#,
            ),
            Err(e) => answer(
                StatusCode::SERVICE_UNAVAILABLE,
                JSON,
                serde_json::json!({"status": 503, "error": e.to_string()}).to_string(),
            ),
        };
    }
    answer(
        StatusCode::NOT_FOUND,
        JSON,
        r#"{"status":404,"error":"no such admin endpoint"}"#,
    )
}

/// `POST /cache/purge` with a JSON body: `{"url": "http://host/path?q"}` (or a path for
/// every host), `{"prefix": "/path/"}`, `{"tag": "surrogate-key"}` or `{"all": true}`.
async fn purge(gw: &Gateway, req: Request<Incoming>) -> Response<Full<Bytes>> {
    const JSON: &str = "application/json";
    let bad = |why: &str| {
        answer(
            StatusCode::BAD_REQUEST,
            JSON,
            serde_json::json!({"status": 400, "error": why}).to_string(),
        )
    };
    let body = match http_body_util::BodyExt::collect(http_body_util::Limited::new(
        req.into_body(),
        64 * 1024,
    ))
    .await
    {
        Ok(b) => b.to_bytes(),
        Err(_) => return bad("the body must be JSON of at most 64KiB"),
    };
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(&body) else {
        return bad(
            "the body must be JSON: {\"url\": …}, {\"prefix\": …}, {\"tag\": …} or {\"all\": true}",
        );
    };
    let text = |k: &str| v.get(k).and_then(|s| s.as_str()).map(str::to_string);
    let what = if v.get("all").and_then(|b| b.as_bool()) == Some(true) {
        Purge::All
    } else if let Some(u) = text("url") {
        Purge::Url(u)
    } else if let Some(p) = text("prefix") {
        Purge::Prefix(p)
    } else if let Some(t) = text("tag") {
        Purge::Tag(t)
    } else {
        return bad("name what to purge: url, prefix, tag, or all: true");
    };
    let n = gw.cache().purge(what);
    answer(
        StatusCode::OK,
        JSON,
        serde_json::json!({"purged": n}).to_string(),
    )
}

/// Serves the admin endpoints on `listener` until the task is dropped.
pub async fn serve(gw: Arc<Gateway>, listener: TcpListener, cfg: AdminConfig) {
    let cap = Arc::new(Semaphore::new(cfg.max_connections));
    let token: Option<Arc<str>> = cfg.token.map(Arc::from);
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
                async move { Ok::<_, Infallible>(handle(&gw, req, token.as_deref()).await) }
            }),
        );
        tokio::spawn(async move {
            let _ = conn.await;
            drop(permit);
        });
    }
}
