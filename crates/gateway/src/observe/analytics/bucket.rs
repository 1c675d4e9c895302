//! What the usage history counts and how it is asked: buckets, steps, rows.

use serde::Serialize;
use std::sync::Arc;

/// Minute buckets are kept at most this long.
pub(super) const MINUTES_KEPT: u64 = 7 * 86_400;
/// A query may ask for at most this many buckets.
pub const MAX_BUCKETS: u64 = 10_000;
/// The consumer or route of requests that had none.
pub const NONE: &str = tollgate_config::NO_CONSUMER;

/// Why the history cannot be kept or read.
#[derive(Debug, thiserror::Error)]
pub enum AnalyticsError {
    /// The database could not be opened or written.
    #[error("analytics database {path}: {source}")]
    Db {
        /// The file.
        path: String,
        /// What SQLite said.
        source: rusqlite::Error,
    },
    /// Redis could not be asked.
    #[error("analytics in Redis: {0}")]
    Redis(#[from] redis::RedisError),
}

/// Bucket sizes, seconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// One minute.
    Minute,
    /// One hour.
    Hour,
    /// One day.
    Day,
}

impl Step {
    /// Seconds per bucket.
    pub fn secs(self) -> u64 {
        match self {
            Step::Minute => 60,
            Step::Hour => 3600,
            Step::Day => 86_400,
        }
    }

    /// `1m`, `1h`, `1d`.
    pub fn parse(s: &str) -> Option<Step> {
        match s {
            "1m" => Some(Step::Minute),
            "1h" => Some(Step::Hour),
            "1d" => Some(Step::Day),
            _ => None,
        }
    }

    /// `1m`, `1h`, `1d`.
    pub fn name(self) -> &'static str {
        match self {
            Step::Minute => "1m",
            Step::Hour => "1h",
            Step::Day => "1d",
        }
    }

    /// The step that fits a range: minutes up to 6 hours, hours up to 14 days, then days.
    pub fn for_range(secs: u64) -> Step {
        if secs <= 6 * 3600 {
            Step::Minute
        } else if secs <= 14 * 86_400 {
            Step::Hour
        } else {
            Step::Day
        }
    }
}

/// What to read.
#[derive(Debug, Clone)]
pub struct Query {
    /// Only this consumer.
    pub consumer: Option<String>,
    /// Only this route.
    pub route: Option<String>,
    /// Start, unix seconds (inclusive, rounded down to the step).
    pub from: u64,
    /// End, unix seconds (exclusive).
    pub to: u64,
    /// Bucket size.
    pub step: Step,
}

/// One bucket of one consumer on one route with one status class.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct Row {
    /// Bucket start, unix seconds.
    pub ts: u64,
    /// Consumer (`-` for requests without one).
    pub consumer: String,
    /// Route (`-` for requests no route took).
    pub route: String,
    /// `2xx` and so on.
    pub status: String,
    /// Requests.
    pub count: u64,
}

/// One count to store: minute start (unix seconds), consumer, route, status class, requests.
pub(super) type Batch = (u64, Arc<str>, Arc<str>, u8, u64);

pub(super) fn class_name(class: u8) -> String {
    format!("{class}xx")
}
