//! Why the gateway answers a request itself: every [`Refusal`], and the labels metrics and
//! the access log give them. What each answer looks like is `response::refuse`'s business.

use http::header::HeaderValue;
use std::time::Duration;

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
    /// The request carries two different API keys: never a guess which one counts.
    #[error("more than one API key")]
    AmbiguousKey,
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
        limit: std::sync::Arc<str>,
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
    /// Every connection the upstream target allows is busy, past the wait.
    #[error("upstream busy")]
    UpstreamBusy,
    /// The client stopped sending its body for longer than `body_timeout`.
    #[error("request body timeout")]
    RequestTimeout,
    /// The route names consumers by client certificate and the client sent none.
    #[error("client certificate required")]
    NoClientCert,
    /// The client certificate is valid but names no consumer.
    #[error("client certificate names no consumer")]
    UnknownClientCert,
    /// Every target of the upstream is out of rotation (failed health checks).
    #[error("no healthy upstream target")]
    NoHealthyTarget,
    /// The route takes bearer tokens and the request has none (`or_key`: nor an API key,
    /// which the route also takes).
    #[error("missing bearer token")]
    MissingToken {
        /// The route takes an API key too.
        or_key: bool,
    },
    /// The bearer token is not valid here: the reason, for `error_description`.
    #[error("invalid token: {0}")]
    InvalidToken(&'static str),
    /// The request carries its token more than once (RFC 6750 `invalid_request`).
    #[error("more than one bearer token")]
    AmbiguousToken,
    /// A valid token's caller is not a listed consumer and the gateway holds as many
    /// unlisted callers as it takes until the next reload.
    #[error("too many unlisted callers")]
    TooManyGuests,
    /// A consumer managed through the admin API (on another node, say) is on a plan this
    /// node's config does not define: without its limits it is not served here.
    #[error("the consumer's plan is not defined here")]
    UnknownPlan,
    /// The token names a key its set lacks (or the set has none yet), and a fetch of the
    /// set is under way (an issuer's rotation): the pipeline waits for the fetch after the
    /// `seen`th to end and checks the request once more. Should it reach an answer, it is
    /// `InvalidToken(why)`.
    #[error("invalid token: {why}")]
    KeysComing {
        /// Fetches of the route's key set that had ended when the token was checked.
        seen: u64,
        /// The reason, should the request be refused after all.
        why: &'static str,
    },
}

/// Every reason the gateway answers a request itself, as labels for metrics and the
/// access log; [`Refusal::reason_index`] indexes it.
pub const REASONS: [&str; 23] = [
    "bad_request",
    "no_route",
    "method_not_allowed",
    "missing_key",
    "unknown_key",
    "ambiguous_key",
    "forbidden",
    "origin_not_allowed",
    "rate_limited",
    "limit_store_down",
    "payload_too_large",
    "upstream_error",
    "upstream_timeout",
    "upstream_busy",
    "request_timeout",
    "missing_client_cert",
    "unknown_client_cert",
    "no_healthy_target",
    "missing_token",
    "invalid_token",
    "ambiguous_token",
    "too_many_guests",
    "unknown_plan",
];

impl Refusal {
    /// The reason's place in [`REASONS`].
    pub fn reason_index(&self) -> usize {
        match self {
            Refusal::BadRequest(_) => 0,
            Refusal::NoRoute => 1,
            Refusal::MethodNotAllowed { .. } => 2,
            Refusal::MissingKey => 3,
            Refusal::UnknownKey => 4,
            Refusal::AmbiguousKey => 5,
            Refusal::Forbidden => 6,
            Refusal::OriginNotAllowed => 7,
            Refusal::RateLimited { .. } => 8,
            Refusal::LimitStoreDown => 9,
            Refusal::PayloadTooLarge => 10,
            Refusal::Upstream(_) => 11,
            Refusal::UpstreamTimeout => 12,
            Refusal::UpstreamBusy => 13,
            Refusal::RequestTimeout => 14,
            Refusal::NoClientCert => 15,
            Refusal::UnknownClientCert => 16,
            Refusal::NoHealthyTarget => 17,
            Refusal::MissingToken { .. } => 18,
            Refusal::InvalidToken(_) | Refusal::KeysComing { .. } => 19,
            Refusal::AmbiguousToken => 20,
            Refusal::TooManyGuests => 21,
            Refusal::UnknownPlan => 22,
        }
    }
}
