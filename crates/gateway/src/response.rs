//! Every answer tollgate gives itself: [`Refusal`] lists them, [`refuse`] maps each to its
//! status, headers and small JSON body (with the request id), in this one place.

use crate::exchange::Refusal;
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

/// A JSON answer: `fields` (the members of the object, without braces) and the request id.
fn json(status: StatusCode, fields: &str, request_id: &HeaderValue) -> Response<Body> {
    // Request ids are validated to need no JSON escaping.
    let id = std::str::from_utf8(request_id.as_bytes()).unwrap_or("");
    // Sized once: this is the whole cost of an answer at the edge beyond its headers.
    let mut body = String::with_capacity(fields.len() + id.len() + 18);
    body.push('{');
    body.push_str(fields);
    body.push_str(r#","request_id":""#);
    body.push_str(id);
    body.push_str("\"}");
    let mut r = Response::new(full(body));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

/// `r` with one more header.
fn with(mut r: Response<Body>, name: http::HeaderName, value: HeaderValue) -> Response<Body> {
    r.headers_mut().insert(name, value);
    r
}

/// A duration as whole seconds, rounded up (`Retry-After`, the `t` of `RateLimit`).
pub fn secs_up(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

/// Maps a refusal to its answer: status, headers, and a small JSON body that names the
/// request id.
pub fn refuse(refusal: Refusal, request_id: &HeaderValue) -> Response<Body> {
    let close = || HeaderValue::from_static("close");
    let json = |status, fields: &str| json(status, fields, request_id);
    match refusal {
        Refusal::BadRequest(why) => with(
            json(
                StatusCode::BAD_REQUEST,
                &format!(r#""status":400,"error":"{why}""#),
            ),
            CONNECTION,
            close(),
        ),
        Refusal::NoRoute => json(
            StatusCode::NOT_FOUND,
            r#""status":404,"error":"no route matches this request""#,
        ),
        Refusal::MethodNotAllowed { allow } => with(
            json(
                StatusCode::METHOD_NOT_ALLOWED,
                r#""status":405,"error":"method not allowed""#,
            ),
            ALLOW,
            allow.unwrap_or_else(|| HeaderValue::from_static("")),
        ),
        Refusal::MissingKey => unauthorized(json(
            StatusCode::UNAUTHORIZED,
            r#""status":401,"error":"missing API key""#,
        )),
        Refusal::UnknownKey => unauthorized(json(
            StatusCode::UNAUTHORIZED,
            r#""status":401,"error":"unknown API key""#,
        )),
        Refusal::AmbiguousKey => json(
            StatusCode::BAD_REQUEST,
            r#""status":400,"error":"more than one API key""#,
        ),
        Refusal::Forbidden => json(
            StatusCode::FORBIDDEN,
            r#""status":403,"error":"consumer not allowed on this route""#,
        ),
        Refusal::OriginNotAllowed => json(
            StatusCode::FORBIDDEN,
            r#""status":403,"error":"CORS origin not allowed""#,
        ),
        Refusal::RateLimited {
            limit,
            retry_after,
            policy,
            ratelimit,
        } => {
            let secs = secs_up(retry_after);
            // Limit names are validated to hold no quotes or backslashes.
            let fields = format!(
                r#""status":429,"error":"rate limit exceeded","limit":"{limit}","retry_after":{secs}"#
            );
            let mut r = with(
                json(StatusCode::TOO_MANY_REQUESTS, &fields),
                RETRY_AFTER,
                HeaderValue::from(secs),
            );
            if let Some(p) = policy {
                r.headers_mut().insert(RATELIMIT_POLICY, p);
            }
            with(r, RATELIMIT, ratelimit)
        }
        Refusal::LimitStoreDown => with(
            json(
                StatusCode::SERVICE_UNAVAILABLE,
                r#""status":503,"error":"rate limit store unavailable""#,
            ),
            RETRY_AFTER,
            HeaderValue::from_static("1"),
        ),
        Refusal::PayloadTooLarge => with(
            json(
                StatusCode::PAYLOAD_TOO_LARGE,
                r#""status":413,"error":"request body too large""#,
            ),
            CONNECTION,
            close(),
        ),
        Refusal::Upstream(why) => json(
            StatusCode::BAD_GATEWAY,
            &format!(r#""status":502,"error":"bad gateway","detail":"{why}""#),
        ),
        Refusal::UpstreamTimeout => json(
            StatusCode::GATEWAY_TIMEOUT,
            r#""status":504,"error":"upstream timeout""#,
        ),
        Refusal::UpstreamBusy => with(
            json(
                StatusCode::SERVICE_UNAVAILABLE,
                r#""status":503,"error":"upstream busy""#,
            ),
            RETRY_AFTER,
            HeaderValue::from_static("1"),
        ),
        Refusal::RequestTimeout => with(
            json(
                StatusCode::REQUEST_TIMEOUT,
                r#""status":408,"error":"request body timeout""#,
            ),
            CONNECTION,
            close(),
        ),
        Refusal::NoClientCert => with(
            json(
                StatusCode::UNAUTHORIZED,
                r#""status":401,"error":"client certificate required""#,
            ),
            WWW_AUTHENTICATE,
            HeaderValue::from_static("mTLS"),
        ),
        Refusal::UnknownClientCert => with(
            json(
                StatusCode::UNAUTHORIZED,
                r#""status":401,"error":"client certificate names no consumer""#,
            ),
            WWW_AUTHENTICATE,
            HeaderValue::from_static("mTLS"),
        ),
        Refusal::NoHealthyTarget => with(
            json(
                StatusCode::SERVICE_UNAVAILABLE,
                r#""status":503,"error":"no healthy upstream target""#,
            ),
            RETRY_AFTER,
            HeaderValue::from_static("1"),
        ),
        // RFC 6750 §3.1: a request without credentials gets the challenge without an error.
        Refusal::MissingToken { or_key } => {
            let mut r = with(
                json(
                    StatusCode::UNAUTHORIZED,
                    if or_key {
                        r#""status":401,"error":"missing bearer token or API key""#
                    } else {
                        r#""status":401,"error":"missing bearer token""#
                    },
                ),
                WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer"),
            );
            if or_key {
                r.headers_mut()
                    .append(WWW_AUTHENTICATE, HeaderValue::from_static("ApiKey"));
            }
            r
        }
        Refusal::InvalidToken(why) | Refusal::KeysComing { why, .. } => {
            // The reasons are fixed strings without quotes or backslashes.
            let challenge = format!(r#"Bearer error="invalid_token", error_description="{why}""#);
            with(
                json(
                    StatusCode::UNAUTHORIZED,
                    &format!(r#""status":401,"error":"invalid token","detail":"{why}""#),
                ),
                WWW_AUTHENTICATE,
                HeaderValue::from_str(&challenge).unwrap_or_else(|_| {
                    HeaderValue::from_static(r#"Bearer error="invalid_token""#)
                }),
            )
        }
        Refusal::AmbiguousToken => with(
            json(
                StatusCode::BAD_REQUEST,
                r#""status":400,"error":"more than one bearer token""#,
            ),
            WWW_AUTHENTICATE,
            HeaderValue::from_static(
                r#"Bearer error="invalid_request", error_description="more than one bearer token""#,
            ),
        ),
        Refusal::TooManyGuests => with(
            json(
                StatusCode::SERVICE_UNAVAILABLE,
                r#""status":503,"error":"too many unlisted callers""#,
            ),
            RETRY_AFTER,
            HeaderValue::from_static("60"),
        ),
        Refusal::UnknownPlan => with(
            json(
                StatusCode::SERVICE_UNAVAILABLE,
                r#""status":503,"error":"the consumer's plan is not defined on this node""#,
            ),
            // It lasts until an operator moves the consumer or brings the plan.
            RETRY_AFTER,
            HeaderValue::from_static("60"),
        ),
    }
}

fn unauthorized(r: Response<Body>) -> Response<Body> {
    with(r, WWW_AUTHENTICATE, HeaderValue::from_static("ApiKey"))
}
