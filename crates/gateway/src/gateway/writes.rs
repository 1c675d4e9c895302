//! What a successful write drops from the cache: its URI as every route that caches keys
//! it, whichever route the write came through (RFC 9111 §4.4).

use super::state::Gateway;
use crate::cache::{self, Ask};
use crate::exchange::{ConnInfo, Parts};
use crate::snapshot::Snapshot;
use http::{HeaderMap, Method};
use std::time::Duration;

impl Gateway {
    /// Whether a request with `method` may have to drop entries once answered: an unsafe
    /// method, with a route that caches. Asked before the request goes, so its head is
    /// kept only then.
    pub(super) fn may_invalidate(snap: &Snapshot, method: &Method) -> bool {
        cache::is_unsafe(method) && snap.routes.iter().any(|r| r.cfg.cache.is_some())
    }

    /// After a successful unsafe request `sent` (answered with `headers`): drops what
    /// every route that caches stored for its URI and for the URIs its `Location` and
    /// `Content-Location` name, each as that route keys them. A `DELETE` through a
    /// route that does not cache drops what the reading route stored.
    pub(super) fn invalidate_writes(
        &self,
        snap: &Snapshot,
        conn: &ConnInfo,
        sent: &Parts,
        headers: &HeaderMap,
    ) {
        let now_ns = self.clock.now_nanos();
        for r in &snap.routes {
            let Some(cfg) = &r.cfg.cache else { continue };
            let ask = Ask {
                cfg,
                route: &r.cfg.name,
                consumer: None,
                credentials: r.cfg.auth.as_ref().map_or(&[], |a| a.query.as_slice()),
                wait: Duration::ZERO,
                now_ns,
                clock: &self.clock,
                peer: &conn.peer_ip,
                trusted: conn.trusted,
                https: conn.listener.tls.is_some(),
            };
            self.cache.invalidate(&ask, sent, headers);
        }
    }
}
