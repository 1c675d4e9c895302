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

/// The answer to a request body that could not be read whole: 413 past the endpoint's
/// limit (`at_most`), 400 when it broke off.
pub(super) fn body_error(e: &(dyn std::error::Error + 'static), at_most: &str) -> Answer {
    if e.is::<http_body_util::LengthLimitError>() {
        error(
            StatusCode::PAYLOAD_TOO_LARGE,
            &format!("the body must be JSON of at most {at_most}"),
        )
    } else {
        error(StatusCode::BAD_REQUEST, "the body broke off")
    }
}
