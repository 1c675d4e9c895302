//! The gateway: the pinned-snapshot request path, and reloads that swap the snapshot.

use crate::cache::{self, Ask, Cache};
use crate::clock::Clock;
use crate::cluster::{spawn_syncer, Cluster};
use crate::exchange::ConnInfo;
use crate::exchange::{Refusal, REASONS};
use crate::inbound;
use crate::limiter::persist::StateStore;
use crate::limiter::table::Live;
use crate::limiter::Now;
use crate::listener::RequestBody;
use crate::observe::access_log::{AccessLog, Logged, Record};
use crate::observe::analytics::{self, Analytics};
use crate::observe::metrics::Metrics;
use crate::observe::request_id::{self, X_REQUEST_ID};
use crate::policy::{self, cors, Verdict};
use crate::response::{refuse, Body};
use crate::route;
use crate::snapshot::Route;
use crate::snapshot::{Registry, Snapshot};
use crate::upstream::{self, Hop};
use arc_swap::{ArcSwap, ArcSwapOption};
use http::HeaderValue;
use http::{Method, Request, Response};
use http_body_util::Either;
use hyper::body::Body as _;
use smallvec::SmallVec;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;
use tollgate_config::{Config, ConfigError};

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
    /// Why the gateway answered itself, if it did ([`crate::exchange::REASONS`] index).
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

/// Where reloads stand: a new generation after each applied config, and the last failure.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReloadStatus {
    /// Number of configs applied since start (the first is 1).
    pub generation: u64,
    /// The problem with the last rejected config, if the last attempt failed.
    pub last_error: Option<String>,
}

pub use tollgate_config::fingerprint;

/// The cache's way upstream: the route's upstream and the hop's settings, owned, so that a
/// background refresh can use them after the request has been answered.
struct UpFetch {
    upstream: Arc<upstream::Upstream>,
    peer_ip: HeaderValue,
    trusted: bool,
    https: bool,
    strip_prefix: Option<Arc<str>>,
    preserve_host: bool,
    max_body: u64,
    body_timeout: Duration,
    route: Arc<str>,
    stats: Arc<crate::observe::metrics::RouteStats>,
    /// How long the last fetch waited for the answer's head, nanoseconds: the request
    /// that went upstream reads it instead of timing the cache around the fetch.
    took_ns: AtomicU64,
    /// The client connection, whose share of upstream connections a fetch takes.
    conn: Arc<ConnInfo>,
}

impl UpFetch {
    fn new(route: &crate::snapshot::Route, conn: &Arc<ConnInfo>) -> Self {
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
        }
    }
}

impl cache::Fetch for UpFetch {
    async fn fetch(
        &self,
        parts: http::request::Parts,
    ) -> Result<Response<upstream::PooledBody>, Refusal> {
        let hop = Hop {
            peer_ip: &self.peer_ip,
            trusted: self.trusted,
            https: self.https,
            strip_prefix: self.strip_prefix.as_deref(),
            preserve_host: self.preserve_host,
            max_body: self.max_body,
            body_timeout: self.body_timeout,
            stream_body: false,
            route: &self.route,
            note_target: None,
        };
        let share = share_for(&self.conn, parts.version, &self.upstream).await?;
        let t = Instant::now();
        let r = upstream::fetch(&self.upstream, parts, hop).await;
        let ns = nanos(t);
        self.took_ns.store(ns, Ordering::Relaxed);
        self.stats.upstream(ns as f64 / 1e9);
        r.map(|resp| resp.map(|b| b.holding(share)))
    }
}

/// For an HTTP/2 request, a place among its connection's streams that hold an upstream
/// connection (`max_upstream_streams`), so that one client cannot take a whole upstream:
/// 503 when none comes free within the upstream's `connect_timeout`, as when the upstream's
/// own connections stay busy. HTTP/1.1 connections carry one request at a time.
async fn share_for(
    conn: &Arc<ConnInfo>,
    version: http::Version,
    up: &upstream::Upstream,
) -> Result<Option<crate::exchange::UpstreamShare>, Refusal> {
    if version != http::Version::HTTP_2 {
        return Ok(None);
    }
    conn.upstream_share(up.cfg.connect_timeout)
        .await
        .map(Some)
        .ok_or(Refusal::UpstreamBusy)
}

/// A running gateway's state: the current snapshot and what outlives it.
pub struct Gateway {
    snapshot: ArcSwap<Snapshot>,
    /// The response cache; outlives reloads.
    cache: Arc<Cache>,
    /// Fingerprint of the file content the running config came from.
    running: AtomicU64,
    registry: Registry,
    clock: Arc<dyn Clock>,
    status: watch::Sender<ReloadStatus>,
    metrics: Arc<Metrics>,
    access_log: ArcSwapOption<AccessLog>,
    analytics: Option<Arc<Analytics>>,
    analytics_error: Option<String>,
    started: Instant,
    /// The config file reloads read, when the config came from one.
    source: parking_lot::Mutex<Option<PathBuf>>,
    /// The text of the running config, for `/config`.
    running_text: parking_lot::Mutex<Option<Arc<[u8]>>>,
    /// Where limit counters are written, when `state:` is set.
    state: Option<Arc<StateStore>>,
    /// The last minutes of the request series, for the dashboard.
    series: crate::observe::series::Series,
}

/// How often limit cells whose windows have all passed are retired.
const SWEEP_EVERY: Duration = Duration::from_secs(10);

/// Retires idle limit cells every [`SWEEP_EVERY`] on a thread of its own, until the gateway
/// is gone.
fn spawn_sweeper(gw: std::sync::Weak<Gateway>) {
    let spawned = std::thread::Builder::new()
        .name("tollgate-sweep".into())
        .spawn(move || loop {
            std::thread::park_timeout(SWEEP_EVERY);
            let Some(gw) = gw.upgrade() else { return };
            gw.sweep();
        });
    if let Err(e) = spawned {
        tracing::error!("cannot start the limit sweeper thread: {e}; idle counters are kept");
    }
}

impl std::fmt::Debug for Gateway {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gateway").finish_non_exhaustive()
    }
}

impl Gateway {
    /// A gateway serving `config`, counting time with `clock`.
    /// With `cluster:` in the config, limits are shared through Redis and the syncer task
    /// starts (this must run inside a tokio runtime).
    pub fn new(config: Config, clock: Arc<dyn Clock>) -> Arc<Self> {
        let metrics = Arc::new(Metrics::new());
        let cluster = config.cluster.clone().map(|c| {
            let cluster = Cluster::new(c);
            spawn_syncer(cluster.clone(), clock.clone());
            metrics.report(cluster.clone());
            cluster
        });
        let state = match (&config.state, &cluster) {
            (Some(_), Some(_)) => {
                tracing::warn!(
                    "with `cluster:`, limit counters live in Redis; `state.path` is not used"
                );
                None
            }
            (Some(s), None) => {
                let (store, saved) = StateStore::open(s, clock.clone());
                store.spawn_flusher(s.flush_interval);
                metrics.report(store.stats.clone());
                Some((store, saved))
            }
            (None, _) => None,
        };
        let live = Arc::new(Live::new(
            cluster.clone().map(|c| {
                c as Arc<dyn crate::limiter::shared::SharedStore<crate::limiter::LimitCell>>
            }),
            state.as_ref().map(|(s, _)| s.queue.clone()),
        ));
        metrics.report(Arc::new(crate::limiter::report::CellCount(Arc::downgrade(
            &live,
        ))));
        let state = state.map(|(store, saved)| {
            live.restore(saved);
            store
        });
        let registry = Registry::with_live(live, cluster, metrics.clone());
        let access_log = config
            .access_log
            .as_ref()
            .map(|c| AccessLog::start(c, metrics.clone()));
        let (analytics, analytics_error) = match &config.analytics {
            None => (None, None),
            Some(a) => match Analytics::open(a, config.cluster.as_ref(), metrics.clone()) {
                Ok(an) => {
                    let c = clock.clone();
                    analytics::spawn_flusher(&an, move || c.wall_nanos() / 1_000_000_000);
                    (Some(an), None)
                }
                Err(e) => {
                    tracing::error!("{e}; serving without usage history");
                    (None, Some(e.to_string()))
                }
            },
        };
        let snapshot = Snapshot::build(config, &registry);
        let (status, _) = watch::channel(ReloadStatus {
            generation: 1,
            last_error: None,
        });
        let cache = Cache::new(
            snapshot.config.cache.max_size,
            snapshot.config.cache.max_object_size,
        );
        metrics.report(cache.clone());
        let gw = Arc::new(Gateway {
            snapshot: ArcSwap::from_pointee(snapshot),
            cache,
            running: AtomicU64::new(0),
            registry,
            clock,
            status,
            metrics,
            access_log: ArcSwapOption::new(access_log),
            analytics,
            analytics_error,
            started: Instant::now(),
            source: parking_lot::Mutex::new(None),
            running_text: parking_lot::Mutex::new(None),
            state,
            series: Default::default(),
        });
        spawn_sweeper(Arc::downgrade(&gw));
        gw
    }

    /// The metrics.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// The usage history, when kept.
    pub fn analytics(&self) -> Option<&Arc<Analytics>> {
        self.analytics.as_ref()
    }

    /// Why the usage history could not be opened at start, if it could not.
    pub fn analytics_error(&self) -> Option<&str> {
        self.analytics_error.as_deref()
    }

    /// Time since the gateway started.
    pub fn uptime(&self) -> Duration {
        self.started.elapsed()
    }

    /// Wall-clock seconds since the epoch, on the gateway's clock.
    pub fn wall_secs(&self) -> u64 {
        self.clock.wall_nanos() / 1_000_000_000
    }

    /// Waits until the access log lines of requests answered so far are written (at most
    /// `wait`; blocking). False when there is no access log or the wait ran out.
    pub fn sync_logs(&self, wait: Duration) -> bool {
        self.access_log.load_full().is_some_and(|l| l.sync(wait))
    }

    /// Retires limit cells whose windows have all passed, and clears them from the
    /// running snapshot. Returns how many cells were retired.
    pub fn sweep(&self) -> usize {
        let retired = self.registry.live().sweep(self.now());
        if retired > 0 {
            self.snapshot.load().counters.sweep();
        }
        retired
    }

    /// Writes the limit counters not yet in the state file (blocking). Returns how many
    /// windows were written.
    pub fn flush_state(&self) -> usize {
        self.state.as_ref().map_or(0, |s| s.flush())
    }

    /// Writes out what is still held in memory: limit counters, usage counts not yet in
    /// the database, and queued access log lines (on shutdown).
    pub async fn flush_all(&self) {
        if let Some(s) = self.state.clone() {
            s.stop();
            let _ = tokio::task::spawn_blocking(move || s.flush()).await;
        }
        if let Some(a) = &self.analytics {
            a.flush(self.wall_secs()).await;
        }
        if let Some(l) = self.access_log.load_full() {
            let _ = tokio::task::spawn_blocking(move || l.sync(Duration::from_secs(5))).await;
        }
    }

    /// Reopens the access log file (`SIGUSR1`).
    pub fn reopen_logs(&self) {
        if let Some(l) = self.access_log.load_full() {
            l.reopen();
        }
    }

    /// The config file reloads read (`POST /reload`), when the config came from one.
    pub fn source(&self) -> Option<PathBuf> {
        self.source.lock().clone()
    }

    /// The text of the running config, when it came from a file.
    pub fn running_text(&self) -> Option<Arc<[u8]>> {
        self.running_text.lock().clone()
    }

    /// Where reloads stand now.
    pub fn reload_status(&self) -> ReloadStatus {
        self.status.borrow().clone()
    }

    /// The current snapshot.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.snapshot.load_full()
    }

    /// The limiter's time.
    pub fn now(&self) -> Now {
        Now {
            mono: self.clock.now_nanos(),
            wall: self.clock.wall_nanos(),
        }
    }

    /// The `/metrics` text.
    pub fn metrics_text(&self) -> String {
        self.metrics.render()
    }

    /// Takes this second's sample of the request series (the admin listener does, once a
    /// second).
    pub fn sample_series(&self) {
        self.series
            .sample(self.wall_secs(), &self.metrics.render_series());
    }

    /// The last minutes of the request series, oldest first.
    pub fn series(&self) -> Vec<crate::observe::series::Sample> {
        self.series.samples()
    }

    /// The running TLS config of the listener at `address`, if it has TLS.
    pub fn tls_for(&self, address: std::net::SocketAddr) -> Option<Arc<rustls::ServerConfig>> {
        let snap = self.snapshot.load();
        snap.tls
            .iter()
            .find(|(a, _)| *a == address)
            .map(|(_, c)| c.clone())
    }

    /// The response cache.
    pub fn cache(&self) -> &Arc<Cache> {
        &self.cache
    }

    /// The cluster link, when limits are shared.
    pub fn cluster(&self) -> Option<&Arc<Cluster>> {
        self.registry.cluster()
    }

    /// Swaps in a validated config. Requests in flight finish on the snapshot they started
    /// with; counters of unchanged limits and pools of unchanged upstreams carry over.
    pub fn apply(&self, config: Config) {
        let old = self.snapshot.load();
        let same_sockets = old.config.listeners.len() == config.listeners.len()
            && old
                .config
                .listeners
                .iter()
                .zip(&config.listeners)
                .all(|(a, b)| a.same_socket(b));
        if !same_sockets {
            tracing::warn!(
                "listener changes (other than TLS certificates) take effect at the next restart"
            );
        }
        if old.config.cache != config.cache {
            tracing::warn!("cache size changes take effect at the next restart");
        }
        if old.config.cluster != config.cluster {
            tracing::warn!("cluster changes take effect at the next restart");
        }
        if old.config.state != config.state {
            tracing::warn!("state changes take effect at the next restart");
        }
        if old.config.analytics != config.analytics {
            tracing::warn!("analytics changes take effect at the next restart");
        }
        if old.config.access_log != config.access_log {
            self.access_log.store(
                config
                    .access_log
                    .as_ref()
                    .map(|c| AccessLog::start(c, self.metrics.clone())),
            );
        }
        if old.config.admin != config.admin {
            tracing::warn!(
                "admin changes (address, token, limits) take effect at the next restart"
            );
        }
        let snapshot = Snapshot::build(config, &self.registry);
        // Counts the old table kept in its slots move to cells, where the new one finds
        // them.
        old.counters.settle_all(self.now());
        self.snapshot.store(Arc::new(snapshot));
        self.metrics.reloads.inc();
        self.status.send_modify(|s| {
            s.generation += 1;
            s.last_error = None;
        });
    }

    /// Records the content the running config was read from, so the same content is
    /// never applied again.
    pub fn loaded_from(&self, bytes: &[u8]) {
        self.running.store(fingerprint(bytes), Ordering::Relaxed);
        *self.running_text.lock() = Some(Arc::from(bytes));
    }

    /// Records the file the config came from, for `POST /reload`.
    pub fn set_source(&self, path: &Path) {
        *self.source.lock() = Some(path.to_path_buf());
    }

    /// The fingerprint of the content the running config was read from (0 when unknown).
    pub fn running_fingerprint(&self) -> u64 {
        self.running.load(Ordering::Relaxed)
    }

    /// Reads, validates and applies a config file (`SIGHUP`). A bad file is rejected with
    /// every problem logged, and the old config keeps serving; the content already running
    /// is not applied again.
    pub fn reload_file(&self, path: &Path) -> Result<(), ConfigError> {
        let bytes = std::fs::read(path).map_err(|e| ConfigError::Read {
            path: path.display().to_string(),
            source: e,
        })?;
        if fingerprint(&bytes) == self.running_fingerprint()
            && !self.consumers_file_changed()
            && !self.tls_files_changed()
        {
            tracing::info!(path = %path.display(), "config unchanged; nothing to reload");
            return Ok(());
        }
        self.reload_bytes(path, &bytes)
    }

    /// Whether the running config's consumers file now holds other content than it was
    /// loaded from (a file that cannot be read counts as changed: the reload reports it).
    pub fn consumers_file_changed(&self) -> bool {
        let snap = self.snapshot.load();
        snap.config.consumers_file.as_ref().is_some_and(|f| {
            std::fs::read(&f.path).map_or(true, |b| fingerprint(&b) != f.fingerprint)
        })
    }

    /// Whether a certificate, key or CA file the running config names now holds other
    /// content than it was loaded with (renewed certificates).
    pub fn tls_files_changed(&self) -> bool {
        tollgate_config::tls::files_on_disk(&self.snapshot.load().config).is_some_and(|(_, c)| c)
    }

    /// Validates and applies `bytes`, read from `path` (relative file names in it are
    /// read beside it). Blocking: a config with a large consumers file takes a moment to
    /// load, so async callers run this on a blocking thread.
    pub fn reload_bytes(&self, path: &Path, bytes: &[u8]) -> Result<(), ConfigError> {
        let base = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let parsed = std::str::from_utf8(bytes)
            .map_err(|_| {
                ConfigError::Invalid(vec![tollgate_config::Problem::new(
                    "",
                    "the file is not UTF-8 text",
                )])
            })
            .and_then(|text| tollgate_config::from_yaml_in(text, base));
        match parsed {
            Ok(cfg) => {
                for w in &cfg.warnings {
                    tracing::warn!(path = %path.display(), "{w}");
                }
                // Recorded before the swap, so whoever sees the new generation also sees
                // its content as running (and does not apply it again).
                self.loaded_from(bytes);
                self.apply(cfg);
                tracing::info!(path = %path.display(), generation = self.status.borrow().generation, "config reloaded");
                Ok(())
            }
            Err(e) => {
                self.metrics.reload_errors.inc();
                for p in e.problems() {
                    tracing::error!(path = %path.display(), "config rejected, old config keeps serving: {p}");
                }
                self.status
                    .send_modify(|s| s.last_error = Some(e.to_string()));
                Err(e)
            }
        }
    }

    /// Follows reloads: the generation moves after each applied config.
    pub fn reloads(&self) -> watch::Receiver<ReloadStatus> {
        self.status.subscribe()
    }

    /// Handles one request on `snap`, noting what it did in `trace`.
    async fn handle<'s>(
        &self,
        snap: &'s Snapshot,
        req: Request<RequestBody>,
        conn: &Arc<ConnInfo>,
        trace: &mut Trace<'s>,
        note_target: Option<&upstream::AnsweredBy>,
    ) -> Response<Body> {
        let (mut parts, body) = req.into_parts();
        // Read before `prepare` strips the hop-by-hop headers that ask for it.
        let upgrade = inbound::upgrade_asked(&parts);
        if let Err(r) = inbound::prepare(&snap.owned, &mut parts) {
            return refused(trace, r);
        }
        let preflight = cors::is_preflight(&parts);
        let route = match route::find(snap, &parts, preflight) {
            Ok(r) => r,
            Err((r, meant)) => {
                trace.route = meant;
                return refused(trace, r);
            }
        };
        trace.route = Some(route);
        let origin = policy::cors_origin(route, &parts);

        let result: Result<Response<Body>, Refusal> = async {
            let admitted = match policy::run(
                snap,
                route,
                &mut parts,
                self.clock.as_ref(),
                conn.client_names.as_deref(),
                &mut trace.consumer,
            ) {
                Ok(Verdict::Answer(r)) => return Ok(*r),
                Ok(Verdict::Forward(a)) => a,
                Err(r) => {
                    return Err(r);
                }
            };
            trace.consumer = admitted.consumer;
            parts.headers.insert(X_REQUEST_ID, trace.request_id.clone());
            let hop = Hop {
                peer_ip: &conn.peer_ip,
                trusted: conn.trusted,
                https: conn.listener.tls.is_some(),
                strip_prefix: route.strip.as_deref(),
                preserve_host: route.cfg.preserve_host,
                max_body: conn.listener.max_body_bytes,
                body_timeout: conn.listener.body_timeout,
                stream_body: !route.cfg.request_buffering,
                route: &route.cfg.name,
                note_target,
            };
            if let (true, Some(protocol)) = (route.cfg.websocket, upgrade) {
                if let Some(client) = parts.extensions.remove::<hyper::upgrade::OnUpgrade>() {
                    let ask = upstream::UpgradeAsk {
                        protocol,
                        client,
                        metrics: self.metrics.clone(),
                        hold: conn.clone(),
                    };
                    let t = Instant::now();
                    let resp = Box::pin(upstream::upgrade(&route.upstream, parts, ask, hop)).await;
                    upstream_time(trace, route, t);
                    let mut resp = resp?.map(Either::Left);
                    policy::decorate(route, &admitted, resp.headers_mut());
                    return Ok(resp);
                }
            }
            let Some(cc) = &route.cfg.cache else {
                let mut resp = forward_timed(trace, route, conn, parts, body, hop)
                    .await?
                    .map(Either::Left);
                policy::decorate(route, &admitted, resp.headers_mut());
                return Ok(resp);
            };
            let ask = Ask {
                cfg: cc,
                route: &route.cfg.name,
                consumer: admitted.consumer.map(|c| snap.consumer_name(c)),
                credentials: route.cfg.auth.as_ref().map_or(&[], |a| a.query.as_slice()),
                wait: route.upstream.cfg.response_timeout,
                now_ns: self.clock.now_nanos(),
                clock: &self.clock,
                peer: &conn.peer_ip,
                trusted: conn.trusted,
                https: conn.listener.tls.is_some(),
            };
            let mut resp = if matches!(parts.method, Method::GET | Method::HEAD)
                && body.is_end_stream()
            {
                let key = cache::Key::of(&ask, &parts);
                if self.cache.passes(&key, ask.now_ns) {
                    // Nothing to look up or store: the plain path, as without a cache.
                    let mut resp = forward_timed(trace, route, conn, parts, body, hop)
                        .await?
                        .map(Either::Left);
                    resp.headers_mut().insert(
                        cache::CACHE_STATUS,
                        HeaderValue::from_static(cache::PASS_STATUS),
                    );
                    resp
                } else {
                    let fetch = Arc::new(UpFetch::new(route, conn));
                    let resp = Box::pin(self.cache.serve(ask, key, parts, fetch.clone())).await?;
                    if cache::went_upstream(&resp) {
                        trace.upstream_ns = Some(fetch.took_ns.load(Ordering::Relaxed));
                    }
                    resp
                }
            } else {
                let sent = cache::is_unsafe(&parts.method).then(|| cache::copy_parts(&parts));
                let resp = forward_timed(trace, route, conn, parts, body, hop).await?;
                let ok = resp.status().is_success() || resp.status().is_redirection();
                if let (Some(sent), true) = (sent, ok) {
                    self.cache.invalidate(&ask, &sent, resp.headers());
                }
                resp.map(Either::Left)
            };
            policy::decorate(route, &admitted, resp.headers_mut());
            Ok(resp)
        }
        .await;

        let mut resp = result.unwrap_or_else(|r| refused(trace, r));
        if let (Some(origin), Some(c), false) = (origin, &route.cfg.cors, preflight) {
            cors::decorate(c, origin, resp.headers_mut());
        }
        resp
    }

    /// Handles one request on the snapshot current when it arrived: gives it an id, counts
    /// it in the metrics and the usage history, and logs it once its body has been sent.
    pub async fn serve(
        &self,
        req: Request<RequestBody>,
        conn: &Arc<ConnInfo>,
    ) -> Response<Logged<Body>> {
        let snap = self.snapshot.load_full();
        let id = request_id::pick(
            req.headers(),
            conn.trusted || conn.listener.trust_request_id,
        );
        let mut trace = Trace::new(id);
        let method = req.method().clone();
        let h2 = req.version() == http::Version::HTTP_2;
        let log = self.access_log.load_full();
        let wall_ns = self.analytics.is_some().then(|| self.clock.wall_nanos());
        let logged = log.as_ref().map(|_| {
            let bytes_in = req
                .headers()
                .get(http::header::CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse().ok())
                .or_else(|| {
                    (!req.headers().contains_key(http::header::TRANSFER_ENCODING)).then_some(0)
                });
            let target = req.uri().path_and_query().map_or_else(
                || SmallVec::from_slice(req.uri().path().as_bytes()),
                |pq| SmallVec::from_slice(pq.as_str().as_bytes()),
            );
            (target, bytes_in)
        });
        let answered = upstream::AnsweredBy::new();
        let mut resp = self
            .handle(
                &snap,
                req,
                conn,
                &mut trace,
                log.as_ref().map(|_| &answered),
            )
            .await;
        resp.headers_mut()
            .insert(X_REQUEST_ID, trace.request_id.clone());
        // For HTTP/2's reset balance only: an extension map costs an allocation.
        if h2 && trace.upstream_ns.is_some() {
            resp.extensions_mut().insert(crate::exchange::UpstreamWork);
        }
        let status = resp.status().as_u16();
        self.metrics.response(status);
        let stats = trace.route.map_or(self.metrics.unrouted(), |r| &r.stats);
        stats.record(&method, status, trace.start.elapsed().as_secs_f64());
        if let Some(reason) = trace.refusal {
            self.metrics.refusal(reason);
        }
        let consumer = trace.consumer.map(|c| snap.consumer_name(c));
        if snap.config.metrics.per_consumer {
            if let Some(c) = consumer {
                self.metrics.consumer(c, status);
            }
        }
        if let (Some(a), Some(wall)) = (&self.analytics, wall_ns) {
            let table = Arc::as_ptr(&snap.config.consumers) as usize;
            a.count(
                wall / 1_000_000_000,
                trace
                    .consumer
                    .zip(consumer)
                    .map(|(i, name)| ((table, u32::try_from(i).unwrap_or(u32::MAX)), name)),
                trace.route.map_or(&snap.anonymous, |r| &r.name),
                status,
            );
        }
        let pending = match (log, logged) {
            (Some(log), Some((uri, bytes_in))) => {
                let rec = Record {
                    start: trace.start,
                    request_id: SmallVec::from_slice(trace.request_id.as_bytes()),
                    client: conn.peer_ip.clone(),
                    method,
                    uri,
                    route: trace.route.map(|r| r.name.clone()),
                    consumer: trace.consumer,
                    status,
                    bytes_in,
                    bytes_out: 0,
                    duration: Duration::ZERO,
                    upstream_ns: trace.upstream_ns,
                    target: answered.into_inner(),
                    refusal: trace.refusal.and_then(|i| REASONS.get(i).copied()),
                    limit: trace.limit.take(),
                    cache: trace
                        .route
                        .filter(|r| r.cfg.cache.is_some())
                        .and_then(|_| resp.headers().get(cache::CACHE_STATUS).cloned()),
                    snap,
                };
                Some((Box::new(rec), log))
            }
            _ => None,
        };
        resp.map(|b| Logged::new(b, pending))
    }
}

/// Notes a refusal in the trace and makes its answer.
fn refused(trace: &mut Trace<'_>, r: Refusal) -> Response<Body> {
    trace.refusal = Some(r.reason_index());
    if let Refusal::RateLimited { limit, .. } = &r {
        trace.limit = Some(limit.clone());
    }
    refuse(r, &trace.request_id)
}

fn nanos(since: Instant) -> u64 {
    u64::try_from(since.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// Forwards a request to the route's upstream, noting how long the upstream took. Boxed: a
/// request's future is moved into place whole (into hyper's connection, or its HTTP/2
/// stream), and a refused request should not pay to move the largest branch it never takes.
fn forward_timed<'a, 's: 'a>(
    trace: &'a mut Trace<'s>,
    route: &'a crate::snapshot::Route,
    conn: &'a Arc<ConnInfo>,
    parts: http::request::Parts,
    body: RequestBody,
    hop: upstream::Hop<'a>,
) -> Pin<Box<dyn Future<Output = Result<Response<upstream::PooledBody>, Refusal>> + Send + 'a>> {
    Box::pin(async move {
        let share = share_for(conn, parts.version, &route.upstream).await?;
        let t = Instant::now();
        let resp = upstream::forward(&route.upstream, parts, body, hop).await;
        upstream_time(trace, route, t);
        resp.map(|r| r.map(|b| b.holding(share)))
    })
}

/// Notes the wait for an upstream's answer in the trace and the route's histogram.
fn upstream_time(trace: &mut Trace<'_>, route: &crate::snapshot::Route, since: Instant) {
    let ns = nanos(since);
    trace.upstream_ns = Some(ns);
    route.stats.upstream(ns as f64 / 1e9);
}

impl crate::listener::Handler for Gateway {
    type Body = Logged<Body>;

    fn serve(
        &self,
        req: Request<RequestBody>,
        conn: &Arc<ConnInfo>,
    ) -> impl Future<Output = Response<Logged<Body>>> + Send {
        Gateway::serve(self, req, conn)
    }

    fn tls_for(&self, address: std::net::SocketAddr) -> Option<Arc<rustls::ServerConfig>> {
        Gateway::tls_for(self, address)
    }

    fn opened(&self) {
        self.metrics.connections_total.inc();
        self.metrics.connections_open.inc();
    }

    fn closed(&self) {
        self.metrics.connections_open.dec();
    }

    fn tls_failed(&self) {
        self.metrics.tls_failures.inc();
    }
}
