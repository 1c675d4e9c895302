//! The gateway: the pinned-snapshot request path, and reloads that swap the snapshot.

use crate::cache::{self, Ask, Cache};
use crate::clock::Clock;
use crate::cluster::{spawn_syncer, Cluster};
use crate::inbound;
use crate::limiter::Now;
use crate::metrics::Metrics;
use crate::policy::{self, cors, Verdict};
use crate::response::{refuse, Body, Refusal};
use crate::route;
use crate::snapshot::{Registry, Snapshot};
use crate::upstream::{self, Hop};
use arc_swap::ArcSwap;
use http::HeaderValue;
use http::{Method, Request, Response};
use http_body_util::Either;
use hyper::body::{Body as _, Incoming};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use tokio::sync::watch;
use tollgate_config::{Config, ConfigError, ListenerConfig};

/// Where reloads stand: a new generation after each applied config, and the last failure.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReloadStatus {
    /// Number of configs applied since start (the first is 1).
    pub generation: u64,
    /// The problem with the last rejected config, if the last attempt failed.
    pub last_error: Option<String>,
}

/// A fingerprint of config file content, to tell a change from the content running.
pub fn fingerprint(bytes: &[u8]) -> u64 {
    use std::hash::{DefaultHasher, Hash, Hasher};
    let mut h = DefaultHasher::new();
    bytes.hash(&mut h);
    h.finish() | 1
}

/// What the request path knows of the client connection, computed once per connection.
#[derive(Debug)]
pub struct ConnInfo {
    /// The client's IP as a header value, for `X-Forwarded-For`.
    pub peer_ip: HeaderValue,
    /// The client is a proxy the listener trusts with `X-Forwarded-*`.
    pub trusted: bool,
    /// The listener's settings.
    pub listener: Arc<ListenerConfig>,
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
        ConnInfo {
            peer_ip,
            trusted,
            listener,
        }
    }
}

/// The cache's way upstream: the route's upstream and the hop's settings, owned, so that a
/// background refresh can use them after the request has been answered.
struct UpFetch {
    upstream: Arc<upstream::Upstream>,
    peer_ip: HeaderValue,
    trusted: bool,
    strip_prefix: Option<Arc<str>>,
    preserve_host: bool,
    max_body: u64,
    body_timeout: Duration,
    route: Arc<str>,
}

impl UpFetch {
    fn new(route: &crate::snapshot::Route, conn: &ConnInfo) -> Self {
        UpFetch {
            upstream: route.upstream.clone(),
            peer_ip: conn.peer_ip.clone(),
            trusted: conn.trusted,
            strip_prefix: route.strip.clone(),
            preserve_host: route.cfg.preserve_host,
            max_body: conn.listener.max_body_bytes,
            body_timeout: conn.listener.body_timeout,
            route: route.name.clone(),
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
            strip_prefix: self.strip_prefix.as_deref(),
            preserve_host: self.preserve_host,
            max_body: self.max_body,
            body_timeout: self.body_timeout,
            stream_body: false,
            route: &self.route,
        };
        upstream::fetch(&self.upstream, parts, hop).await
    }
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
    metrics: Metrics,
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
        let cluster = config.cluster.clone().map(|c| {
            let cluster = Cluster::new(c);
            spawn_syncer(cluster.clone(), clock.clone());
            cluster
        });
        let registry = Registry::new(cluster);
        let snapshot = Snapshot::build(config, &registry);
        let (status, _) = watch::channel(ReloadStatus {
            generation: 1,
            last_error: None,
        });
        let cache = Cache::new(
            snapshot.config.cache.max_size,
            snapshot.config.cache.max_object_size,
        );
        Arc::new(Gateway {
            snapshot: ArcSwap::from_pointee(snapshot),
            cache,
            running: AtomicU64::new(0),
            registry,
            clock,
            status,
            metrics: Metrics::default(),
        })
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
        let reloads = self.status.borrow().generation.saturating_sub(1);
        self.metrics.render(
            reloads,
            self.cluster().map(|c| c.as_ref()),
            &self.cache.store,
        )
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
        if old.config.listeners != config.listeners {
            tracing::warn!("listener changes take effect at the next restart");
        }
        if old.config.cache != config.cache {
            tracing::warn!("cache size changes take effect at the next restart");
        }
        if old.config.cluster != config.cluster {
            tracing::warn!("cluster changes take effect at the next restart");
        }
        if old.config.admin != config.admin {
            tracing::warn!(
                "admin changes (address, token, limits) take effect at the next restart"
            );
        }
        let snapshot = Snapshot::build(config, &self.registry);
        self.snapshot.store(Arc::new(snapshot));
        self.status.send_modify(|s| {
            s.generation += 1;
            s.last_error = None;
        });
    }

    /// Records the content the running config was read from, so the same content is
    /// never applied again.
    pub fn loaded_from(&self, bytes: &[u8]) {
        self.running.store(fingerprint(bytes), Ordering::Relaxed);
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
        if fingerprint(&bytes) == self.running_fingerprint() {
            tracing::info!(path = %path.display(), "config unchanged; nothing to reload");
            return Ok(());
        }
        self.reload_bytes(path, &bytes)
    }

    /// Validates and applies `bytes`, read from `path` (relative file names in it are
    /// read beside it).
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
                self.apply(cfg);
                self.loaded_from(bytes);
                tracing::info!(path = %path.display(), generation = self.status.borrow().generation, "config reloaded");
                Ok(())
            }
            Err(e) => {
                self.metrics
                    .reload_errors
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
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

    /// Handles one request on the snapshot current when it arrived.
    pub async fn handle(&self, req: Request<Incoming>, conn: &ConnInfo) -> Response<Body> {
        let snap = self.snapshot.load_full();
        let (mut parts, body) = req.into_parts();
        if let Err(r) = inbound::prepare(&snap, &mut parts) {
            return refuse(r);
        }
        let preflight = cors::is_preflight(&parts);
        let route = match route::find(&snap, &parts, preflight) {
            Ok(r) => r,
            Err(r) => return refuse(r),
        };
        let origin = policy::cors_origin(route, &parts);

        let result: Result<Response<Body>, Refusal> = async {
            let admitted = match policy::run(&snap, route, &mut parts, self.clock.as_ref())? {
                Verdict::Answer(r) => return Ok(*r),
                Verdict::Forward(a) => a,
            };
            let hop = Hop {
                peer_ip: &conn.peer_ip,
                trusted: conn.trusted,
                strip_prefix: route.strip.as_deref(),
                preserve_host: route.cfg.preserve_host,
                max_body: conn.listener.max_body_bytes,
                body_timeout: conn.listener.body_timeout,
                stream_body: !route.cfg.request_buffering,
                route: &route.cfg.name,
            };
            let Some(cc) = &route.cfg.cache else {
                let resp = upstream::forward(&route.upstream, parts, body, hop).await?;
                let mut resp = resp.map(Either::Left);
                policy::decorate(route, &admitted, resp.headers_mut());
                return Ok(resp);
            };
            let ask = Ask {
                cfg: cc,
                route: &route.cfg.name,
                consumer: admitted.consumer.map(|c| snap.consumers[c].name.as_str()),
                credentials: route.cfg.auth.as_ref().map_or(&[], |a| a.query.as_slice()),
                wait: route.upstream.cfg.response_timeout,
                now_ns: self.clock.now_nanos(),
                wall: SystemTime::UNIX_EPOCH + Duration::from_nanos(self.clock.wall_nanos()),
            };
            let mut resp =
                if matches!(parts.method, Method::GET | Method::HEAD) && body.is_end_stream() {
                    let fetch = Arc::new(UpFetch::new(route, conn));
                    self.cache.serve(ask, parts, fetch).await?
                } else {
                    let sent = cache::is_unsafe(&parts.method).then(|| cache::copy_parts(&parts));
                    let resp = upstream::forward(&route.upstream, parts, body, hop).await?;
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

        let mut resp = result.unwrap_or_else(refuse);
        if let (Some(origin), Some(c), false) = (origin, &route.cfg.cors, preflight) {
            cors::decorate(c, origin, resp.headers_mut());
        }
        resp
    }

    /// Handles one request and counts its answer for `/metrics`.
    pub async fn serve(&self, req: Request<Incoming>, conn: &ConnInfo) -> Response<Body> {
        let resp = self.handle(req, conn).await;
        self.metrics.response(resp.status().as_u16());
        resp
    }
}
