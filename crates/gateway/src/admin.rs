//! The admin listener: `GET /usage/{consumer}`, `GET /metrics`, `GET /healthz`.
//! Keep it on a private address: it answers anyone who can reach it.

use crate::gateway::Gateway;
use crate::usage::{usage, UsageError};
use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_TYPE};
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use std::convert::Infallible;
use std::sync::Arc;
use tokio::net::TcpListener;

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

async fn handle(gw: &Gateway, req: Request<Incoming>) -> Response<Full<Bytes>> {
    const JSON: &str = "application/json";
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

/// Serves the admin endpoints on `listener` until the task is dropped.
pub async fn serve(gw: Arc<Gateway>, listener: TcpListener) {
    loop {
        let (stream, _) = crate::listener::accept(&listener).await;
        let gw = gw.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req| {
                let gw = gw.clone();
                async move { Ok::<_, Infallible>(handle(&gw, req).await) }
            });
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}
