//! What the gateway reports of itself: request ids, the access log, OpenTelemetry traces,
//! `/metrics` and the usage history. Nothing here sits on the request path beyond an id,
//! a few atomic adds and, when configured, one queue push per request.

pub mod access_log;
pub mod analytics;
pub mod logged;
pub mod metrics;
pub mod record;
pub mod request_id;
pub mod scrape;
pub mod series;
pub mod text_format;
pub mod trace;

/// The status class (1–5) of a status code, as an index 0–4.
pub fn class_index(status: u16) -> usize {
    usize::from((status / 100).clamp(1, 5) - 1)
}

/// `2xx` and so on.
pub const CLASSES: [&str; 5] = ["1xx", "2xx", "3xx", "4xx", "5xx"];
