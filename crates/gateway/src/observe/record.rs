//! What one request did, as the access log writes it and its span tells it.

use super::trace::context::{RequestTrace, SpanHead};
use http::{HeaderValue, Method};
use smallvec::SmallVec;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What the access log asks of the snapshot a request was served on: who its consumers
/// are and which query parameters carry keys (removed from the logged target).
pub trait Names: Send + Sync + std::fmt::Debug {
    /// The name of the consumer at `index`.
    fn consumer_name(&self, index: usize) -> &str;
    /// Query parameter names that carry credentials.
    fn credential_params(&self) -> &[String];
}

/// What one request did, as the access log writes it and its span tells it.
#[derive(Debug, Clone)]
pub struct Record {
    /// When the request arrived. The writer turns it into wall-clock time against one
    /// reading of both clocks per batch: no wall-clock read per request.
    pub start: Instant,
    /// `X-Request-Id`.
    /// A copy held inline (a generated id is 32 bytes): a clone of the header would be
    /// freed by the writer, and a client's id would hold the connection's read buffer.
    pub request_id: SmallVec<[u8; 32]>,
    /// The client's address.
    pub client: HeaderValue,
    /// Method.
    pub method: Method,
    /// Path and query as the client sent them; credentials are removed when written. A
    /// copy: holding the request's own bytes would keep the connection's read buffer from
    /// being reused.
    pub uri: SmallVec<[u8; 96]>,
    /// The snapshot the request was served on: it names the consumer and the query
    /// parameters that carry keys (removed from the logged target). The request's own
    /// reference, moved here when it is done, so it costs nothing.
    pub snap: Arc<dyn Names>,
    /// The route taken.
    pub route: Option<Arc<str>>,
    /// The authenticated consumer, by index in `snap`.
    pub consumer: Option<usize>,
    /// Response status.
    pub status: u16,
    /// Request body bytes declared by `Content-Length`, else those read of a chunked body.
    pub bytes_in: Option<u64>,
    /// Response body bytes sent.
    pub bytes_out: u64,
    /// From the request head to the end of the response body.
    pub duration: Duration,
    /// Time waiting for the upstream's response head.
    pub upstream_ns: Option<u64>,
    /// The upstream target that answered.
    pub target: Option<Arc<str>>,
    /// Why the gateway answered itself.
    pub refusal: Option<&'static str>,
    /// The limit that refused.
    pub limit: Option<Arc<str>>,
    /// `Cache-Status`, on routes with a cache.
    pub cache: Option<HeaderValue>,
    /// The trace the request belongs to, when tracing is on.
    pub trace: Option<RequestTrace>,
    /// What a recorded span tells beyond the log line (sampled requests only).
    pub span_head: Option<Box<SpanHead>>,
    /// Tries upstream after the first.
    pub retries: u32,
}
