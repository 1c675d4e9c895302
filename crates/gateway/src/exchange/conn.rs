//! What the request path knows of the client connection, shared by the listener that makes
//! it and the phases that read it.

use http::HeaderValue;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tollgate_config::ListenerConfig;

/// A response extension: the answer took upstream work. On HTTP/2 only such answers bank
/// a reset for the rapid-reset guard; a cheap refusal does not.
#[derive(Debug, Clone, Copy)]
pub struct UpstreamWork;

/// What the request path knows of the client connection, computed once per connection.
#[derive(Debug)]
pub struct ConnInfo {
    /// The client's IP as a header value, for `X-Forwarded-For`.
    pub peer_ip: HeaderValue,
    /// The client is a proxy the listener trusts with `X-Forwarded-*`.
    pub trusted: bool,
    /// The listener's settings.
    pub listener: Arc<ListenerConfig>,
    /// Names of the client's verified certificate (SANs, then subject CNs), under mTLS.
    pub client_names: Option<Box<[Box<str>]>>,
    /// The connection's place, given back when the last holder (the connection, or the
    /// upgraded connection it became) is done.
    pub place: Option<Place>,
    /// Places for the connection's streams that hold an upstream connection (HTTP/2's
    /// `max_upstream_streams`): one client takes at most that share of an upstream.
    upstream_share: Semaphore,
}

/// What a client connection holds for as long as it, or the upgraded connection it
/// became, lives.
#[derive(Debug)]
pub struct Place {
    /// Its place under the listener's `max_connections`.
    pub permit: OwnedSemaphorePermit,
    /// What the server's drain (SIGTERM) waits for: an upgraded connection (a WebSocket
    /// tunnel) is drained as the connection it came from, up to `drain_timeout`.
    pub drain: tokio_util::task::task_tracker::TaskTrackerToken,
}

/// One of a connection's places for a stream holding an upstream connection; given back
/// when dropped (with the answer's body).
pub struct UpstreamShare(Arc<ConnInfo>);

impl Drop for UpstreamShare {
    fn drop(&mut self) {
        self.0.upstream_share.add_permits(1);
    }
}

impl std::fmt::Debug for UpstreamShare {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("UpstreamShare")
    }
}

impl ConnInfo {
    /// Connection info for a client at `peer` on `listener`.
    pub fn new(peer: SocketAddr, listener: Arc<ListenerConfig>) -> Self {
        let peer_ip = HeaderValue::from_str(&peer.ip().to_string())
            .unwrap_or_else(|_| HeaderValue::from_static("unknown"));
        let trusted = listener
            .trusted_proxies
            .iter()
            .any(|n| n.contains(peer.ip()));
        let share = listener.http2.max_upstream_streams as usize;
        ConnInfo {
            peer_ip,
            trusted,
            listener,
            client_names: None,
            place: None,
            upstream_share: Semaphore::new(share),
        }
    }

    /// A place for one more stream holding an upstream connection, waiting for one at most
    /// `wait`; `None` when none came free.
    pub async fn upstream_share(self: &Arc<Self>, wait: Duration) -> Option<UpstreamShare> {
        let permit = tokio::time::timeout(wait, self.upstream_share.acquire())
            .await
            .ok()?
            .ok()?;
        permit.forget();
        Some(UpstreamShare(self.clone()))
    }
}
