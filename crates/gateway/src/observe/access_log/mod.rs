//! The access log: one JSON object per line per request, written by a thread of its own.
//!
//! The request path only fills a [`Record`] and pushes it onto a bounded queue; the writer
//! takes the queue every 50 ms, formats and writes. When the queue is full, the line is
//! dropped and counted (`tollgate_access_log_dropped_total`): a slow disk never slows
//! requests. A line is
//! queued when the response body has been sent (or abandoned), so it carries the bytes
//! sent and the whole duration. `SIGUSR1` reopens the file, for logrotate.

mod json;
mod queue;

#[cfg(test)]
pub(crate) use json::escape;
pub use queue::AccessLog;
