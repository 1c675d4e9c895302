//! The cache's way upstream, owned so that a background refresh can use it after the
//! request has been answered, and an HTTP/2 stream's share of upstream connections.

use crate::cache;
use crate::exchange::{ConnInfo, Refusal, UpstreamShare};
use crate::snapshot::Route;
use crate::upstream::{self, Hop, PooledBody};
use http::{HeaderValue, Response};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The cache's way upstream: the route's upstream and the hop's settings, owned, so that a
/// background refresh can use them after the request has been answered.
pub(super) struct UpFetch {
    upstream: Arc<upstream::Upstream>,
    peer_ip: HeaderValue,
    trusted: bool,
    https: bool,
    strip_prefix: Option<upstream::Strip>,
    preserve_host: bool,
    max_body: u64,
    body_timeout: Duration,
    route: Arc<str>,
    stats: Arc<crate::observe::metrics::RouteStats>,
    /// How long the last fetch waited for the answer's head, nanoseconds: the request
    /// that went upstream reads it instead of timing the cache around the fetch.
    pub(super) took_ns: AtomicU64,
    /// The client connection, whose share of upstream connections a fetch takes.
    conn: Arc<ConnInfo>,
    /// The `traceparent` of the request that made it (a background refresh keeps its
    /// trace).
    traceparent: Option<[u8; 55]>,
    /// The target the last fetch went to, and its retries: the request that went upstream
    /// logs them.
    pub(super) answered: upstream::AnsweredBy,
}

impl UpFetch {
    pub(super) fn new(route: &Route, conn: &Arc<ConnInfo>, traceparent: Option<[u8; 55]>) -> Self {
        UpFetch {
            upstream: route.upstream.clone(),
            peer_ip: conn.peer_ip.clone(),
            trusted: conn.trusted,
            https: conn.listener.tls.is_some(),
            strip_prefix: route.strip.clone(),
            preserve_host: route.cfg.preserve_host,
            max_body: conn.listener.max_body_bytes,
            body_timeout: conn.listener.body_timeout,
            route: route.name.clone(),
            stats: route.stats.clone(),
            took_ns: AtomicU64::new(0),
            conn: conn.clone(),
            traceparent,
            answered: upstream::AnsweredBy::default(),
        }
    }
}

impl cache::Fetch for UpFetch {
    async fn fetch(&self, parts: crate::exchange::Parts) -> Result<Response<PooledBody>, Refusal> {
        let hop = Hop {
            peer_ip: &self.peer_ip,
            trusted: self.trusted,
            https: self.https,
            strip_prefix: self.strip_prefix.as_ref(),
            preserve_host: self.preserve_host,
            max_body: self.max_body,
            body_timeout: self.body_timeout,
            stream_body: false,
            route: &self.route,
            note_target: Some(&self.answered),
            traceparent: self.traceparent,
        };
        let share = share_for(&self.conn, parts.version, &self.upstream).await?;
        let t = Instant::now();
        let r = upstream::fetch(&self.upstream, parts, hop).await;
        let ns = nanos(t);
        self.took_ns.store(ns, Ordering::Relaxed);
        if went_upstream(&r) {
            self.stats.upstream(ns as f64 / 1e9);
        }
        r.map(|resp| resp.map(|b| b.holding(share)))
    }
}

/// For an HTTP/2 request, a place among its connection's streams that hold an upstream
/// connection (`max_upstream_streams`), so that one client cannot take a whole upstream:
/// 503 when none comes free within the upstream's `connect_timeout`, as when the upstream's
/// own connections stay busy. HTTP/1.1 connections carry one request at a time.
pub(super) async fn share_for(
    conn: &Arc<ConnInfo>,
    version: http::Version,
    up: &upstream::Upstream,
) -> Result<Option<UpstreamShare>, Refusal> {
    if version != http::Version::HTTP_2 {
        return Ok(None);
    }
    match conn.upstream_share(up.cfg.connect_timeout).await {
        Some(share) => Ok(Some(share)),
        None => {
            up.count_busy();
            Err(Refusal::UpstreamBusy)
        }
    }
}

/// Nanoseconds since `since`.
pub(super) fn nanos(since: Instant) -> u64 {
    u64::try_from(since.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// Whether a try upstream sent the request to a target: not when none was healthy, nor
/// when every connection stayed busy past the wait (as nginx's `$upstream_header_time` and
/// Envoy's `upstream_rq_time` record nothing then). The upstream histogram times answers.
pub(super) fn went_upstream<T>(outcome: &Result<T, Refusal>) -> bool {
    !matches!(
        outcome,
        Err(Refusal::NoHealthyTarget | Refusal::UpstreamBusy)
    )
}
