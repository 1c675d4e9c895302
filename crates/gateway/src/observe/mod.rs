//! What the gateway reports of itself: request ids, the per-request [`Trace`], the access
//! log, `/metrics` and the usage history. Nothing here sits on the request path beyond an
//! id, a few atomic adds and, when configured, one queue push per request.

pub mod access_log;
pub mod analytics;
pub mod metrics;
pub mod request_id;
mod scrape;
pub mod series;

use crate::snapshot::Route;
use http::HeaderValue;
use std::sync::Arc;
use std::time::Instant;

/// What one request did, filled in as it goes through the gateway, for the access log,
/// the metrics and the usage history. It borrows from the request's pinned snapshot.
#[derive(Debug)]
pub struct Trace<'s> {
    /// When the request head was handed over.
    pub start: Instant,
    /// `X-Request-Id`: the client's, when trusted, or a new one.
    pub request_id: HeaderValue,
    /// The route, once one matched.
    pub route: Option<&'s Route>,
    /// The consumer, once authenticated, by index in the snapshot.
    pub consumer: Option<usize>,
    /// Why the gateway answered itself, if it did ([`crate::response::REASONS`] index).
    pub refusal: Option<usize>,
    /// The limit that refused, for a 429.
    pub limit: Option<Arc<str>>,
    /// Time waiting for the upstream's response head, when the request went upstream.
    pub upstream_ns: Option<u64>,
}

impl Trace<'_> {
    /// A trace for a request that arrived now, with its id.
    pub fn new(request_id: HeaderValue) -> Self {
        Trace {
            start: Instant::now(),
            request_id,
            route: None,
            consumer: None,
            refusal: None,
            limit: None,
            upstream_ns: None,
        }
    }
}

/// The status class (1–5) of a status code, as an index 0–4.
pub fn class_index(status: u16) -> usize {
    usize::from((status / 100).clamp(1, 5) - 1)
}

/// `2xx` and so on.
pub const CLASSES: [&str; 5] = ["1xx", "2xx", "3xx", "4xx", "5xx"];
