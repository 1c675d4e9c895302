//! The runtime snapshot: a validated [`Config`] compiled into what the request path reads,
//! swapped atomically on reload. State that must outlive a reload (limit counters, upstream
//! pools) lives in [`Registry`], keyed by stable identities, and is shared into each snapshot.

use crate::cluster::Cluster;
use crate::inbound::Owned;
use crate::limiter::LimitCell;
use crate::observe::metrics::{Metrics, RouteStats};
use crate::upstream::Upstream;
use http::HeaderValue;
use parking_lot::Mutex;
use prometheus_client::metrics::counter::Counter;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use tollgate_config::{Config, LimitConfig, RouteConfig, UpstreamConfig};

/// Identity of a limit's counters: who is counted, and the limit itself. Same key across a
/// reload → same counters.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct CellKey {
    scope: String,
    limit: LimitConfig,
}

/// State kept across reloads.
#[derive(Debug, Default)]
pub struct Registry {
    cells: Mutex<HashMap<CellKey, Weak<LimitCell>>>,
    upstreams: Mutex<HashMap<UpstreamConfig, Weak<Upstream>>>,
    next_id: AtomicU64,
    cluster: Option<Arc<Cluster>>,
    metrics: Arc<Metrics>,
}

impl Registry {
    /// A registry whose limits are shared through `cluster` when given.
    pub fn new(cluster: Option<Arc<Cluster>>) -> Self {
        Registry {
            cluster,
            ..Registry::default()
        }
    }

    /// A registry counting into `metrics`.
    pub fn with_metrics(cluster: Option<Arc<Cluster>>, metrics: Arc<Metrics>) -> Self {
        Registry {
            cluster,
            metrics,
            ..Registry::default()
        }
    }

    /// The metrics the snapshots count into.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// The cluster link, if limits are shared.
    pub fn cluster(&self) -> Option<&Arc<Cluster>> {
        self.cluster.as_ref()
    }

    fn cell(&self, scope: &str, limit: &LimitConfig) -> Arc<LimitCell> {
        let key = CellKey {
            scope: scope.to_string(),
            limit: limit.clone(),
        };
        let mut cells = self.cells.lock();
        if let Some(c) = cells.get(&key).and_then(Weak::upgrade) {
            return c;
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed) + 1;
        let c = Arc::new(match &self.cluster {
            Some(cluster) => LimitCell::new_shared(
                id,
                limit.requests,
                limit.window,
                cluster.limit(scope, limit),
            ),
            None => LimitCell::new(id, limit.requests, limit.window),
        });
        cells.insert(key, Arc::downgrade(&c));
        c
    }

    fn upstream(&self, cfg: &UpstreamConfig) -> Arc<Upstream> {
        let mut ups = self.upstreams.lock();
        if let Some(u) = ups.get(cfg).and_then(Weak::upgrade) {
            return u;
        }
        let u = Arc::new(Upstream::new(cfg.clone(), self.metrics.upstream(&cfg.name)));
        self.metrics.watch_upstream(&u);
        ups.insert(cfg.clone(), Arc::downgrade(&u));
        u
    }

    /// Forgets entries no snapshot uses any more.
    fn prune(&self) {
        self.cells.lock().retain(|_, w| w.strong_count() > 0);
        self.upstreams.lock().retain(|_, w| w.strong_count() > 0);
    }
}

/// A consumer as the request path sees it.
#[derive(Debug)]
pub struct Consumer {
    /// Name.
    pub name: Arc<str>,
    /// The name as a header value, for the consumer header.
    pub header_value: HeaderValue,
}

/// The limits that apply to one consumer on one route, ready to check.
#[derive(Debug, Default)]
pub struct LimitSet {
    /// Counters, sorted by id (lock order).
    pub cells: Vec<Arc<LimitCell>>,
    /// What each limit is, in the same order as `cells`.
    pub info: Vec<LimitInfo>,
    /// The `RateLimit-Policy` header value, listing every limit.
    pub policy: Option<HeaderValue>,
}

/// What a limit is, for headers, errors and usage reports.
#[derive(Debug)]
pub struct LimitInfo {
    /// Name, for the RateLimit header and 429 bodies.
    pub name: String,
    /// Window in seconds.
    pub window_secs: u64,
    /// `plan` or `route:NAME`.
    pub scope: String,
    /// `"name";r=`: the start of its `RateLimit` value.
    pub ratelimit_prefix: String,
    /// The name, shared cheaply with the access log.
    pub label: Arc<str>,
    /// Its refusals, for `/metrics`.
    pub refused: Counter,
}

/// A route compiled for the request path.
#[derive(Debug)]
pub struct Route {
    /// The validated route.
    pub cfg: RouteConfig,
    /// Its name, shared cheaply (the cache's background work keeps it).
    pub name: Arc<str>,
    /// The prefix removed before forwarding, if the route strips one.
    pub strip: Option<Arc<str>>,
    /// Its upstream.
    pub upstream: Arc<Upstream>,
    /// `allowed[consumer]`: may this consumer call the route.
    pub allowed: Vec<bool>,
    /// `limits[consumer]`: the consumer's limits on this route (plan + route limits).
    pub limits: Vec<LimitSet>,
    /// `Allow` header value for 405 answers.
    pub allow_header: Option<HeaderValue>,
    /// Its counters in `/metrics`, kept across reloads.
    pub stats: Arc<RouteStats>,
}

/// Everything a request reads, pinned for its whole life.
#[derive(Debug)]
pub struct Snapshot {
    /// The validated config it was built from.
    pub config: Config,
    /// Routes, most specific first.
    pub routes: Vec<Route>,
    /// Consumers by index.
    pub consumers: Vec<Consumer>,
    /// Header names only the gateway may set.
    pub owned: Owned,
    /// API key → consumer index. foldhash with a random seed: fast, and keys chosen by
    /// clients cannot be aimed at one bucket without knowing the seed.
    pub keys: HashMap<String, usize, foldhash::fast::RandomState>,
    /// Every query parameter any route reads a key from, removed from logged URLs.
    pub credential_params: Arc<[String]>,
    /// `-`: the consumer or route of requests that had none, in the usage history.
    pub anonymous: Arc<str>,
}

impl Snapshot {
    /// Compiles `config`, reusing counters and pools from `registry` where unchanged.
    pub fn build(config: Config, registry: &Registry) -> Snapshot {
        let consumers: Vec<Consumer> = config
            .consumers
            .iter()
            .map(|c| Consumer {
                name: Arc::from(c.name.as_str()),
                // Validation guarantees printable ASCII.
                header_value: HeaderValue::from_str(&c.name)
                    .unwrap_or_else(|_| HeaderValue::from_static("invalid")),
            })
            .collect();
        let mut keys = HashMap::with_hasher(foldhash::fast::RandomState::default());
        for (i, c) in config.consumers.iter().enumerate() {
            for k in &c.keys {
                keys.insert(k.clone(), i);
            }
        }
        // Plan limits are per consumer and shared by every route.
        let plan_cells: Vec<Vec<(LimitConfig, Arc<LimitCell>, String)>> = config
            .consumers
            .iter()
            .map(|c| {
                c.plan
                    .map(|p| {
                        config.plans[p]
                            .limits
                            .iter()
                            .map(|l| {
                                (
                                    l.clone(),
                                    registry.cell(&format!("consumer:{}", c.name), l),
                                    "plan".to_string(),
                                )
                            })
                            .collect()
                    })
                    .unwrap_or_default()
            })
            .collect();

        let mut handles = LimitHandles {
            metrics: &registry.metrics,
            seen: HashMap::new(),
        };
        let routes = config
            .routes
            .iter()
            .map(|r| {
                let upstream = registry.upstream(&config.upstreams[r.upstream]);
                let allowed = config
                    .consumers
                    .iter()
                    .enumerate()
                    .map(|(i, c)| match &r.allow {
                        None => true,
                        Some(a) => {
                            a.consumers.contains(&i) || c.plan.is_some_and(|p| a.plans.contains(&p))
                        }
                    })
                    .collect();
                let limits = if r.auth.is_none() {
                    Vec::new()
                } else {
                    config
                        .consumers
                        .iter()
                        .enumerate()
                        .map(|(i, c)| {
                            let mut all = plan_cells[i].clone();
                            for l in &r.limits {
                                let scope = format!("route:{}:consumer:{}", r.name, c.name);
                                all.push((
                                    l.clone(),
                                    registry.cell(&scope, l),
                                    format!("route:{}", r.name),
                                ));
                            }
                            limit_set(all, &mut handles)
                        })
                        .collect()
                };
                let allow_header = r.methods.as_ref().and_then(|m| {
                    let list: Vec<&str> = m.iter().map(|m| m.as_str()).collect();
                    HeaderValue::from_str(&list.join(", ")).ok()
                });
                let strip = match (&r.path, r.strip_prefix) {
                    (tollgate_config::PathMatch::Prefix(p), true) => Some(Arc::from(p.as_str())),
                    _ => None,
                };
                Route {
                    name: Arc::from(r.name.as_str()),
                    strip,
                    cfg: r.clone(),
                    upstream,
                    allowed,
                    limits,
                    allow_header,
                    stats: registry.metrics.route(&r.name),
                }
            })
            .collect();
        registry.prune();
        let owned = owned_names(&config);
        let mut params: Vec<String> = Vec::new();
        for r in &config.routes {
            for q in r.auth.iter().flat_map(|a| a.query.iter()) {
                if !params.iter().any(|p| p.eq_ignore_ascii_case(q)) {
                    params.push(q.clone());
                }
            }
        }
        Snapshot {
            credential_params: params.into(),
            anonymous: Arc::from(crate::observe::analytics::NONE),
            config,
            routes,
            consumers,
            owned,
            keys,
        }
    }
}

/// The consumer headers of every route, and every name the gateway sets or reads a
/// credential from.
fn owned_names(config: &Config) -> Owned {
    let mut owned = Owned::default();
    let mut add = |name: &str| {
        let dashed = name.to_ascii_lowercase().replace('_', "-");
        if !owned.dashed.contains(&dashed) {
            owned.dashed.push(dashed);
        }
    };
    for n in [
        "x-forwarded-for",
        "x-forwarded-proto",
        "x-forwarded-host",
        "x-real-ip",
        "x-request-id",
    ] {
        add(n);
    }
    for r in &config.routes {
        if let Some(a) = &r.auth {
            add(a.consumer_header.as_str());
            for h in &a.header {
                add(h.as_str());
            }
        }
    }
    // The default name is the gateway's even where no route authenticates.
    owned
        .consumer_headers
        .push(http::HeaderName::from_static("x-consumer"));
    add("x-consumer");
    for r in &config.routes {
        if let Some(a) = &r.auth {
            if !owned.consumer_headers.contains(&a.consumer_header) {
                owned.consumer_headers.push(a.consumer_header.clone());
            }
        }
    }
    owned
}

/// Each limit name's shared label and refusal counter, looked up once per build rather
/// than once per consumer.
struct LimitHandles<'a> {
    metrics: &'a Metrics,
    seen: HashMap<String, (Arc<str>, Counter)>,
}

impl LimitHandles<'_> {
    fn get(&mut self, name: &str) -> (Arc<str>, Counter) {
        if let Some(h) = self.seen.get(name) {
            return h.clone();
        }
        let h = (Arc::from(name), self.metrics.limit(name));
        self.seen.insert(name.to_string(), h.clone());
        h
    }
}

fn limit_set(
    mut all: Vec<(LimitConfig, Arc<LimitCell>, String)>,
    handles: &mut LimitHandles<'_>,
) -> LimitSet {
    all.sort_by_key(|(_, c, _)| c.id);
    let policy = (!all.is_empty())
        .then(|| {
            let items: Vec<String> = all
                .iter()
                .map(|(l, _, _)| {
                    format!("\"{}\";q={};w={}", l.name, l.requests, l.window.as_secs())
                })
                .collect();
            HeaderValue::from_str(&items.join(", ")).ok()
        })
        .flatten();
    let (cells, info) = all
        .into_iter()
        .map(|(l, cell, scope)| {
            let (label, refused) = handles.get(&l.name);
            let info = LimitInfo {
                label,
                refused,
                ratelimit_prefix: format!("\"{}\";r=", l.name),
                window_secs: l.window.as_secs(),
                name: l.name,
                scope,
            };
            (cell, info)
        })
        .unzip();
    LimitSet {
        cells,
        info,
        policy,
    }
}
