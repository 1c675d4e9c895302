//! Every answer tollgate gives itself: [`Refusal`] lists them, [`refuse`] maps each to its
//! status, headers and small JSON body, in this one place.

use crate::upstream::PooledBody;
use bytes::Bytes;
use http::header::{HeaderValue, ALLOW, CONNECTION, CONTENT_TYPE, RETRY_AFTER, WWW_AUTHENTICATE};
use http::{Response, StatusCode};
use http_body_util::{Either, Full};
use std::time::Duration;

/// Response body: streamed from the upstream, or a small body made here.
pub type Body = Either<PooledBody, Full<Bytes>>;

/// A body made here.
pub fn full(bytes: impl Into<Bytes>) -> Body {
    Either::Right(Full::new(bytes.into()))
}

/// `RateLimit-Policy` header name (IETF draft-ietf-httpapi-ratelimit-headers).
pub const RATELIMIT_POLICY: http::HeaderName = http::HeaderName::from_static("ratelimit-policy");
/// `RateLimit` header name.
pub const RATELIMIT: http::HeaderName = http::HeaderName::from_static("ratelimit");

/// Why tollgate answers a request itself instead of forwarding it.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    /// The request is malformed in a way hyper let through (e.g. dot-segments in the path).
    #[error("bad request: {0}")]
    BadRequest(&'static str),
    /// No route matches host and path.
    #[error("no route")]
    NoRoute,
    /// A route matches, but not with this method.
    #[error("method not allowed")]
    MethodNotAllowed {
        /// Methods the matching routes accept.
        allow: Option<HeaderValue>,
    },
    /// The route needs an API key and none was sent.
    #[error("missing API key")]
    MissingKey,
    /// The API key is not known.
    #[error("unknown API key")]
    UnknownKey,
    /// The consumer may not call this route.
    #[error("consumer not allowed on this route")]
    Forbidden,
    /// A CORS preflight from an origin that is not allowed.
    #[error("CORS origin not allowed")]
    OriginNotAllowed,
    /// One of the consumer's limits is used up.
    #[error("rate limit {limit:?} exceeded")]
    RateLimited {
        /// Name of the limit that refused.
        limit: String,
        /// Time until a request would pass.
        retry_after: Duration,
        /// `RateLimit-Policy` value listing all of the consumer's limits.
        policy: Option<HeaderValue>,
        /// `RateLimit` value for the limit that refused.
        ratelimit: HeaderValue,
    },
    /// A shared limit cannot be checked: Redis is unreachable and the cluster fails closed.
    #[error("rate limit store unavailable")]
    LimitStoreDown,
    /// The request body is larger than the listener allows.
    #[error("request body too large")]
    PayloadTooLarge,
    /// The upstream refused or reset the connection.
    #[error("upstream unavailable: {0}")]
    Upstream(&'static str),
    /// The upstream did not answer in time.
    #[error("upstream timeout")]
    UpstreamTimeout,
}

fn json(status: StatusCode, body: &'static str) -> Response<Body> {
    let mut r = Response::new(full(Bytes::from_static(body.as_bytes())));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

/// Maps a refusal to its answer. The JSON bodies are static where nothing varies, so an
/// answer at the edge costs no allocation for its body.
pub fn refuse(refusal: Refusal) -> Response<Body> {
    match refusal {
        Refusal::BadRequest(why) => {
            let body = format!(r#"{{"status":400,"error":"{why}"}}"#);
            let mut r = json(StatusCode::BAD_REQUEST, "");
            *r.body_mut() = full(body);
            r.headers_mut()
                .insert(CONNECTION, HeaderValue::from_static("close"));
            r
        }
        Refusal::NoRoute => json(
            StatusCode::NOT_FOUND,
            r#"{"status":404,"error":"no route matches this request"}"#,
        ),
        Refusal::MethodNotAllowed { allow } => {
            let mut r = json(
                StatusCode::METHOD_NOT_ALLOWED,
                r#"{"status":405,"error":"method not allowed"}"#,
            );
            r.headers_mut()
                .insert(ALLOW, allow.unwrap_or_else(|| HeaderValue::from_static("")));
            r
        }
        Refusal::MissingKey => unauthorized(r#"{"status":401,"error":"missing API key"}"#),
        Refusal::UnknownKey => unauthorized(r#"{"status":401,"error":"unknown API key"}"#),
        Refusal::Forbidden => json(
            StatusCode::FORBIDDEN,
            r#"{"status":403,"error":"consumer not allowed on this route"}"#,
        ),
        Refusal::OriginNotAllowed => json(
            StatusCode::FORBIDDEN,
            r#"{"status":403,"error":"CORS origin not allowed"}"#,
        ),
        Refusal::RateLimited {
            limit,
            retry_after,
            policy,
            ratelimit,
        } => {
            let secs = retry_after.as_secs() + u64::from(retry_after.subsec_nanos() > 0);
            // Limit names are validated to hold no quotes or backslashes.
            let body = format!(
                r#"{{"status":429,"error":"rate limit exceeded","limit":"{limit}","retry_after":{secs}}}"#
            );
            let mut r = json(StatusCode::TOO_MANY_REQUESTS, "");
            *r.body_mut() = full(body);
            let h = r.headers_mut();
            h.insert(RETRY_AFTER, HeaderValue::from(secs));
            if let Some(p) = policy {
                h.insert(RATELIMIT_POLICY, p);
            }
            h.insert(RATELIMIT, ratelimit);
            r
        }
        Refusal::LimitStoreDown => {
            let mut r = json(
                StatusCode::SERVICE_UNAVAILABLE,
                r#"{"status":503,"error":"rate limit store unavailable"}"#,
            );
            r.headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from_static("1"));
            r
        }
        Refusal::PayloadTooLarge => {
            let mut r = json(
                StatusCode::PAYLOAD_TOO_LARGE,
                r#"{"status":413,"error":"request body too large"}"#,
            );
            r.headers_mut()
                .insert(CONNECTION, HeaderValue::from_static("close"));
            r
        }
        Refusal::Upstream(why) => {
            let body = format!(r#"{{"status":502,"error":"bad gateway","detail":"{why}"}}"#);
            let mut r = json(StatusCode::BAD_GATEWAY, "");
            *r.body_mut() = full(body);
            r
        }
        Refusal::UpstreamTimeout => json(
            StatusCode::GATEWAY_TIMEOUT,
            r#"{"status":504,"error":"upstream timeout"}"#,
        ),
    }
}

fn unauthorized(body: &'static str) -> Response<Body> {
    let mut r = json(StatusCode::UNAUTHORIZED, body);
    r.headers_mut()
        .insert(WWW_AUTHENTICATE, HeaderValue::from_static("ApiKey"));
    r
}
