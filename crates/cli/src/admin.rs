//! Talking to a running node's admin endpoint: one request, its JSON answer.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use tollgate_config::AdminConfig;

/// Sends `method path` (with `body` as JSON) to the admin endpoint, with the token when one
/// is set; the answer's JSON, or its `error` when it is not a success.
pub async fn call(
    admin_cfg: &AdminConfig,
    method: http::Method,
    path: &str,
    body: Option<&serde_json::Value>,
) -> Result<serde_json::Value, String> {
    let (status, value) = send(admin_cfg, method, path, body).await?;
    if !status.is_success() {
        return Err(value["error"]
            .as_str()
            .unwrap_or("admin endpoint error")
            .to_string());
    }
    Ok(value)
}

/// The status `GET path` gets from the admin endpoint, or `None` when it cannot be asked.
pub async fn status_of(admin_cfg: &AdminConfig, path: &str) -> Option<http::StatusCode> {
    send(admin_cfg, http::Method::GET, path, None)
        .await
        .ok()
        .map(|(status, _)| status)
}

/// One request to the admin endpoint: the answer's status and JSON body.
async fn send(
    admin_cfg: &AdminConfig,
    method: http::Method,
    path: &str,
    body: Option<&serde_json::Value>,
) -> Result<(http::StatusCode, serde_json::Value), String> {
    let admin = admin_cfg.address;
    let stream = tokio::net::TcpStream::connect(admin).await.map_err(|e| {
        format!("cannot reach the admin endpoint at {admin}: {e} (is the node running?)")
    })?;
    let (mut tx, conn) =
        hyper::client::conn::http1::handshake::<_, Full<Bytes>>(TokioIo::new(stream))
            .await
            .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let mut req = http::Request::builder()
        .method(method)
        .uri(path)
        .header("host", admin.to_string());
    if let Some(t) = &admin_cfg.token {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    let body = match body {
        Some(v) => {
            req = req.header("content-type", "application/json");
            Bytes::from(v.to_string())
        }
        None => Bytes::new(),
    };
    let req = req.body(Full::new(body)).map_err(|e| e.to_string())?;
    let resp = tx.send_request(req).await.map_err(|e| e.to_string())?;
    let status = resp.status();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    let value: serde_json::Value = serde_json::from_slice(&body).map_err(|e| e.to_string())?;
    Ok((status, value))
}
