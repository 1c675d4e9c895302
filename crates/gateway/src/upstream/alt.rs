//! The upstream client for what the lean HTTP/1.1 client does not speak: `https://`
//! targets (certificates verified against the system's roots or `ca_file`, SNI from the
//! host), HTTP/2 (`protocol: h2`: ALPN over TLS, prior knowledge in cleartext, trailers
//! kept for gRPC), and upgraded connections (WebSocket). hyper-util's pooled client over
//! hyper-rustls's connector.

use super::body::UpBody;
use super::dial::ConnectError;
use super::hosts::{Held, Hold, Hosts};
use http::uri::{Authority, Scheme};
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use rustls::crypto::ring::default_provider;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;
use tollgate_config::{UpstreamConfig, UpstreamProtocol};

/// The receive window of one stream to an HTTP/2 upstream (at 1 ms a round trip, 256 MB/s
/// for one stream).
const H2_STREAM_WINDOW: u32 = 256 * 1024;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A connector with the whole connect, TCP and the TLS handshake, bounded by
/// `connect_timeout`, as nginx's `proxy_connect_timeout` and Envoy's `connect_timeout`
/// bound both: a target that accepts and never answers the ClientHello is a connect
/// failure, and the request moves on to the next target.
#[derive(Clone, Debug)]
pub struct Timed<C> {
    inner: C,
    timeout: Duration,
}

impl<C> tower_service::Service<http::Uri> for Timed<C>
where
    C: tower_service::Service<http::Uri>,
    C::Future: Send + 'static,
    C::Error: Into<BoxError>,
{
    type Response = C::Response;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<C::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let connect = self.inner.call(uri);
        let timeout = self.timeout;
        Box::pin(async move {
            match tokio::time::timeout(timeout, connect).await {
                Ok(done) => done.map_err(Into::into),
                Err(_) => Err(Box::new(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    CONNECT_TIMED_OUT,
                )) as BoxError),
            }
        })
    }
}

/// A connector that dials one target whatever authority the request names: the
/// authority is what the target is asked for (`preserve_host` passes the client's `Host`
/// as HTTP/2's `:authority`), never where the gateway connects. TLS names the target (SNI
/// and the certificate's name), as nginx's `proxy_ssl_name` does by default. A connection
/// opened for a client's host holds that host in the upstream's [`Hosts`] until it closes.
#[derive(Clone, Debug)]
pub struct Pinned<C> {
    inner: C,
    to: http::Uri,
    hosts: Arc<Hosts>,
}

impl<C> tower_service::Service<http::Uri> for Pinned<C>
where
    C: tower_service::Service<http::Uri>,
    C::Future: Send + 'static,
{
    type Response = Held<C::Response>;
    type Error = C::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Held<C::Response>, C::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), C::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, asked: http::Uri) -> Self::Future {
        let hold = asked
            .authority()
            .and_then(|a| self.hosts.connection(a.as_str()));
        let connect = self.inner.call(self.to.clone());
        Box::pin(async move {
            let io = connect.await?;
            Ok(Held { io, _hold: hold })
        })
    }
}

/// What a connection not made within `connect_timeout` is called.
pub const CONNECT_TIMED_OUT: &str = "connect timed out";

/// Why a connection to an `https://` or `h2` target could not be made, for the answer's
/// detail, and its cause in words for the log (the certificate error, say).
pub fn connect_failure(e: &(dyn std::error::Error + 'static)) -> (&'static str, String) {
    let mut at = Some(e);
    while let Some(err) = at {
        if let Some(tls) = err.downcast_ref::<rustls::Error>() {
            return ("TLS handshake with the target failed", tls.to_string());
        }
        let io = err.downcast_ref::<std::io::Error>();
        if io.is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut) {
            return (CONNECT_TIMED_OUT, err.to_string());
        }
        // An I/O error wrapping another (rustls's, in tokio-rustls's I/O error, in
        // hyper-rustls's) hides it from `source`: its inner error is the next link.
        at = match io.and_then(|io| io.get_ref()) {
            Some(inner) => Some(inner as &(dyn std::error::Error + 'static)),
            None => err.source(),
        };
    }
    ("connection refused", e.to_string())
}

type Pooled = Client<Timed<Pinned<HttpsConnector<HttpConnector>>>, UpBody>;

/// Most HTTP/2 connections to one target: past their streams, requests share the least
/// busy one.
const MAX_LANES: usize = 16;

/// One pooled client to one target: for HTTP/2, one connection (one per authority asked).
#[derive(Debug)]
struct Lane {
    client: Pooled,
    /// Requests on it now (from sending to the end of the answer's body).
    active: Arc<AtomicUsize>,
}

/// A request's place on a lane, and its hold on the client's host asked for, given back
/// when dropped (with the answer's body).
#[derive(Debug)]
pub struct LaneSlot {
    lane: Arc<AtomicUsize>,
    _host: Option<Hold>,
}

impl Drop for LaneSlot {
    fn drop(&mut self) {
        self.lane.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Pooled clients for one upstream's targets, each pinned to its target. Over HTTP/2,
/// hyper's pool keeps one connection per target: streams whose clients stop reading would
/// take all it may carry (the upstream's `SETTINGS_MAX_CONCURRENT_STREAMS`, or its window)
/// and stall every other request. So each target has lanes, each a pool of its own
/// (another connection), and a request takes the first with room for another stream
/// (`max_concurrent_streams`), as Envoy's pool opens a connection when the others are
/// full.
#[derive(Clone, Debug)]
pub struct AltClient {
    /// Each target's lanes, in the order of the upstream's `targets`.
    targets: Arc<[Box<[Lane]>]>,
    /// Streams a lane takes before the next is used.
    per_lane: usize,
    scheme: Scheme,
    h2: bool,
    /// The clients' hosts asked for as HTTP/2's `:authority` (`preserve_host`), each with
    /// connections of its own.
    hosts: Arc<Hosts>,
}

/// The system's trust roots, read once.
fn system_roots() -> Arc<rustls::RootCertStore> {
    static ROOTS: OnceLock<Arc<rustls::RootCertStore>> = OnceLock::new();
    ROOTS
        .get_or_init(|| {
            let mut roots = rustls::RootCertStore::empty();
            let found = rustls_native_certs::load_native_certs();
            for e in &found.errors {
                tracing::warn!("system trust roots: {e}");
            }
            roots.add_parsable_certificates(found.certs);
            Arc::new(roots)
        })
        .clone()
}

impl AltClient {
    /// A client for `cfg`, speaking `h2` only when `h2` (else HTTP/1.1, with upgrades).
    pub fn new(cfg: &UpstreamConfig, h2: bool) -> Result<AltClient, ConnectError> {
        let roots = match &cfg.ca {
            Some(ca) => {
                let mut r = rustls::RootCertStore::empty();
                r.add_parsable_certificates(ca.certs.iter().cloned());
                Arc::new(r)
            }
            None => system_roots(),
        };
        let tls = rustls::ClientConfig::builder_with_provider(Arc::new(default_provider()))
            .with_safe_default_protocol_versions()
            .map_err(|e| ConnectError::Io(std::io::Error::other(e)))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_nodelay(true);
        http.set_connect_timeout(Some(cfg.connect_timeout));
        let b = HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http();
        let inner = if h2 {
            b.enable_http2().wrap_connector(http)
        } else {
            b.enable_http1().wrap_connector(http)
        };
        let lanes = if h2 { MAX_LANES } else { 1 };
        let mut builder = Client::builder(TokioExecutor::new());
        builder
            .timer(TokioTimer::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(cfg.idle_timeout)
            .pool_max_idle_per_host(cfg.pool_max_idle)
            .http2_only(h2)
            // Streams share one connection per target. An answer whose client does not
            // read keeps what its stream's window let in, and that much of the
            // connection's window: with hyper's 2 MiB and 5 MiB, three such clients
            // stopped every other stream until `send_timeout`. A connection's window of
            // 256 streams' is what a usual server's stream limit (100 to 250) can hold.
            .http2_initial_stream_window_size(H2_STREAM_WINDOW)
            .http2_initial_connection_window_size(H2_STREAM_WINDOW * 256);
        let scheme = if cfg.tls { "https" } else { "http" };
        let mut targets = Vec::with_capacity(cfg.targets.len());
        let hosts = Arc::new(Hosts::default());
        for t in &cfg.targets {
            let to = http::Uri::try_from(format!("{scheme}://{t}/"))
                .map_err(|e| ConnectError::Io(std::io::Error::other(format!("{t}: {e}"))))?;
            let connector = Timed {
                inner: Pinned {
                    inner: inner.clone(),
                    to,
                    hosts: hosts.clone(),
                },
                timeout: cfg.connect_timeout,
            };
            let lanes: Box<[Lane]> = (0..lanes)
                .map(|_| Lane {
                    client: builder.build(connector.clone()),
                    active: Arc::default(),
                })
                .collect();
            targets.push(lanes);
        }
        if targets.is_empty() {
            return Err(ConnectError::Io(std::io::Error::other("no targets")));
        }
        Ok(AltClient {
            targets: targets.into(),
            per_lane: cfg.max_concurrent_streams.max(1),
            scheme: if cfg.tls { Scheme::HTTPS } else { Scheme::HTTP },
            h2,
            hosts,
        })
    }

    /// A hold on `host` to be asked for as `:authority`, while fewer than
    /// [`super::hosts::MAX_HOSTS`] hosts are kept apart, it is one of them, or it is
    /// reserved ([`AltClient::reserve_hosts`]): keep it with the request
    /// ([`AltClient::send`]).
    pub fn room_for(&self, host: &str) -> Option<Hold> {
        self.hosts.request(host)
    }

    /// Lets `hosts` (the routes' own, lowercase, as clients write `Host`) keep
    /// connections apart outside the room other hosts share.
    pub fn reserve_hosts(&self, hosts: impl IntoIterator<Item = String>) {
        self.hosts.reserve(hosts);
    }

    /// Whether it speaks HTTP/2.
    pub fn client_h2(&self) -> bool {
        self.h2
    }

    /// Whether an upstream needs this client for every request.
    pub fn needed(cfg: &UpstreamConfig) -> bool {
        cfg.tls || cfg.protocol == UpstreamProtocol::H2
    }

    /// The absolute URI of `pq` on `target`.
    pub fn uri(&self, target: &str, pq: &http::uri::PathAndQuery) -> Option<http::Uri> {
        http::Uri::builder()
            .scheme(self.scheme.clone())
            .authority(Authority::try_from(target).ok()?)
            .path_and_query(pq.clone())
            .build()
            .ok()
    }

    /// Sends `req` (absolute URI) to the upstream's target `at` (its place in `targets`)
    /// and returns the response head, with the request's place on its lane (and its hold
    /// on the client's host, `host`): keep it with the answer's body.
    pub async fn send(
        &self,
        at: usize,
        req: http::Request<UpBody>,
        host: Option<Hold>,
    ) -> Result<(http::Response<hyper::body::Incoming>, LaneSlot), hyper_util::client::legacy::Error>
    {
        let lane = self.lane(at);
        lane.active.fetch_add(1, Ordering::Relaxed);
        let slot = LaneSlot {
            lane: lane.active.clone(),
            _host: host,
        };
        let resp = lane.client.request(req).await?;
        Ok((resp, slot))
    }

    /// Target `at`'s first lane with room for another stream, else its least busy.
    fn lane(&self, at: usize) -> &Lane {
        // Every target has lanes (`new` refuses an upstream without targets).
        let lanes = self.targets.get(at).unwrap_or(&self.targets[0]);
        let busy = |l: &&Lane| l.active.load(Ordering::Relaxed);
        lanes
            .iter()
            .find(|l| busy(l) < self.per_lane)
            .or_else(|| lanes.iter().min_by_key(busy))
            .unwrap_or(&lanes[0])
    }
}
