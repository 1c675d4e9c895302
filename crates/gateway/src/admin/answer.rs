//! The admin API's answers: JSON or text, with the status and content type.

use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_TYPE};
use http::{Response, StatusCode};
use http_body_util::Full;

pub(super) const JSON: &str = "application/json";

pub(super) type Answer = Response<Full<Bytes>>;

/// An answer with `body` as `content_type`, never cached.
pub(super) fn answer(
    status: StatusCode,
    content_type: &'static str,
    body: impl Into<Bytes>,
) -> Answer {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    r.headers_mut().insert(
        http::header::CACHE_CONTROL,
        HeaderValue::from_static("no-store"),
    );
    r
}

/// A JSON answer.
pub(super) fn json(status: StatusCode, v: &serde_json::Value) -> Answer {
    answer(status, JSON, v.to_string())
}

/// A JSON error: `{"status": N, "error": why}`.
pub(super) fn error(status: StatusCode, why: &str) -> Answer {
    json(
        status,
        &serde_json::json!({"status": status.as_u16(), "error": why}),
    )
}

/// Longest a request body may take to arrive whole: a client that stalls mid-body gets
/// 408 and its connection back, instead of holding one of the listener's connections.
pub(super) const BODY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// A request body read whole: 413 past `limit` bytes (`at_most` says it), 400 when it
/// broke off, 408 when it took longer than [`BODY_TIMEOUT`].
pub(super) async fn read_body(
    req: http::Request<hyper::body::Incoming>,
    limit: usize,
    at_most: &str,
) -> Result<Bytes, Answer> {
    read_body_within(req.into_body(), limit, at_most, BODY_TIMEOUT).await
}

async fn read_body_within<B>(
    body: B,
    limit: usize,
    at_most: &str,
    within: std::time::Duration,
) -> Result<Bytes, Answer>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let collect = http_body_util::BodyExt::collect(http_body_util::Limited::new(body, limit));
    match tokio::time::timeout(within, collect).await {
        Ok(Ok(b)) => Ok(b.to_bytes()),
        Ok(Err(e)) => Err(body_error(&*e, at_most)),
        Err(_) => {
            let mut r = error(
                StatusCode::REQUEST_TIMEOUT,
                &format!("the body did not arrive within {}s", within.as_secs()),
            );
            r.headers_mut()
                .insert(http::header::CONNECTION, HeaderValue::from_static("close"));
            Err(r)
        }
    }
}

/// The answer to a request body that could not be read whole: 413 past the endpoint's
/// limit (`at_most`), 400 when it broke off.
fn body_error(e: &(dyn std::error::Error + 'static), at_most: &str) -> Answer {
    if e.is::<http_body_util::LengthLimitError>() {
        error(
            StatusCode::PAYLOAD_TOO_LARGE,
            &format!("the body must be JSON of at most {at_most}"),
        )
    } else {
        error(StatusCode::BAD_REQUEST, "the body broke off")
    }
}

/// Why a query is refused (400) where `endpoint` takes no parameters: the first name
/// given, which it does not know. `None` for no query (or an empty one).
pub fn takes_none(endpoint: &str, query: Option<&str>) -> Option<String> {
    let first = query?.split('&').find(|p| !p.is_empty())?;
    let name = crate::query::percent_decode(first.split('=').next().unwrap_or(first));
    Some(format!(
        "unknown query parameter {name:?}: {endpoint} takes none"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_body_that_stalls_gets_408() {
        let (mut tx, body) = http_body_util::channel::Channel::<Bytes, std::io::Error>::new(1);
        tx.send_data(Bytes::from_static(b"{\"a\":"))
            .await
            .expect("send");
        // The rest never comes (the sender is kept).
        let r = read_body_within(body, 1024, "1KiB", BODY_TIMEOUT)
            .await
            .expect_err("stalled");
        assert_eq!(r.status(), StatusCode::REQUEST_TIMEOUT);
        assert_eq!(r.headers()[http::header::CONNECTION], "close");
        drop(tx);
    }
}
