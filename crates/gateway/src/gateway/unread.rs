//! A request the listener refused before its head could be read whole (framing in doubt,
//! a head too large): counted among the answers and refusals and written to the access
//! log, and named by an id in its answer, so that an operator sees 400s, 431s and 501s
//! where the others are.

use super::state::Gateway;
use crate::exchange::{ConnInfo, Fields, REASONS};
use crate::listener::h1::head::{refusal_body, Refused};
use crate::observe::record::Record;
use crate::observe::request_id;
use http::{HeaderValue, Method};
use smallvec::SmallVec;
use std::sync::Arc;
use std::time::{Duration, Instant};

impl Gateway {
    /// Counts and logs a request `refused` before its head parsed, from what came of its
    /// `request_line` (`asked_head`: a `HEAD`, answered without a body); the id its answer
    /// names.
    pub(super) fn note_unread(
        &self,
        refused: Refused,
        asked_head: bool,
        request_line: &[u8],
        conn: &Arc<ConnInfo>,
    ) -> HeaderValue {
        let status = refused.status;
        // A head that did not parse gives no id to trust: one is made.
        let (id, _) = request_id::pick(&Fields::default(), false);
        // A method as written when it is one, else `-`; the target as far as it came.
        let mut words = request_line.split(|&b| b == b' ').filter(|w| !w.is_empty());
        let method = words
            .next()
            .and_then(|m| Method::from_bytes(m).ok())
            .unwrap_or_else(|| Method::from_bytes(b"-").unwrap_or_default());
        let target = words.next().unwrap_or(b"");
        // Not in a route's counts: it never had one, and its time would be no latency.
        self.metrics.response(status);
        // Every one of them is a request the gateway could not take as one.
        self.metrics.refusal(0);
        if let Some(log) = self.access_log.load_full() {
            // The answer's body, as for every answer (none to a HEAD).
            let bytes_out = match asked_head {
                true => 0,
                false => refusal_body(refused, id.to_str().ok()).len() as u64,
            };
            log.log(Box::new(Record {
                start: Instant::now(),
                request_id: SmallVec::from_slice(id.as_bytes()),
                client: conn.peer_ip.clone(),
                method,
                uri: SmallVec::from_slice(target),
                snap: self.snapshot.load_full(),
                route: None,
                consumer: None,
                status,
                bytes_in: None,
                bytes_out,
                duration: Duration::ZERO,
                upstream_ns: None,
                target: None,
                refusal: REASONS.first().copied(),
                limit: None,
                cache: None,
                trace: None,
                span_head: None,
                retries: 0,
            }));
        }
        id
    }
}
