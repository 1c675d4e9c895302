//! The runtime snapshot: a validated [`Config`] compiled into what the request path reads,
//! swapped atomically on reload. State that must outlive a reload (limit counters, upstream
//! pools) lives in [`Registry`], keyed by stable identities, and is shared into each snapshot.
//! Nothing here is per consumer: consumers stay in their compact table, and their counters
//! are made on first call.

use crate::cluster::Cluster;
use crate::inbound::Owned;
use crate::jwks::{KeyRing, KeySet, TokenCache};
use crate::limiter::live::Live;
use crate::limiter::shared::SharedStore;
use crate::limiter::table::{Counters, Group, Layout};
use crate::limiter::LimitCell;
use crate::observe::metrics::{Metrics, RouteStats};
use crate::roster::Roster;
use crate::upstream::Upstream;
use http::HeaderValue;
use parking_lot::Mutex;
use prometheus_client::metrics::counter::Counter;
use smallvec::SmallVec;
use std::collections::HashMap;
use std::sync::{Arc, Weak};
use tollgate_config::{Config, JwtConfig, JwtKeys, LimitConfig, RouteConfig, UpstreamConfig};

/// State kept across reloads.
#[derive(Debug)]
pub struct Registry {
    live: Arc<Live>,
    cluster: Option<Arc<Cluster>>,
    upstreams: Mutex<HashMap<UpstreamConfig, Weak<Upstream>>>,
    /// The upstreams in use, for `/metrics`.
    pools: Arc<crate::upstream::report::Pools>,
    /// Token signing keys, by source.
    keys: Arc<KeyRing>,
    /// Consumers managed through the admin API.
    roster: Arc<Roster>,
    metrics: Arc<Metrics>,
}

impl Default for Registry {
    fn default() -> Self {
        Registry::new(None)
    }
}

impl Registry {
    /// A registry whose limits are shared through `cluster` when given.
    pub fn new(cluster: Option<Arc<Cluster>>) -> Self {
        Registry::with_metrics(cluster, Arc::default())
    }

    /// A registry counting into `metrics`.
    pub fn with_metrics(cluster: Option<Arc<Cluster>>, metrics: Arc<Metrics>) -> Self {
        let store = cluster
            .clone()
            .map(|c| c as Arc<dyn SharedStore<crate::limiter::LimitCell>>);
        Registry::with_live(Arc::new(Live::new(store, None)), cluster, metrics)
    }

    /// A registry whose limit cells are `live` (shared, or written to a state file).
    pub fn with_live(
        live: Arc<Live>,
        cluster: Option<Arc<Cluster>>,
        metrics: Arc<Metrics>,
    ) -> Self {
        let pools = Arc::new(crate::upstream::report::Pools::default());
        metrics.report(pools.clone());
        let keys = Arc::new(KeyRing::default());
        metrics.report(keys.clone());
        Registry {
            live,
            cluster,
            upstreams: Mutex::default(),
            pools,
            keys,
            roster: Arc::new(Roster::in_memory()),
            metrics,
        }
    }

    /// This registry with `roster` as its managed consumers.
    pub fn with_roster(mut self, roster: Arc<Roster>) -> Self {
        self.roster = roster;
        self
    }

    /// The metrics the snapshots count into.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// The cluster link, if limits are shared.
    pub fn cluster(&self) -> Option<&Arc<Cluster>> {
        self.cluster.as_ref()
    }

    /// Every limit cell in use.
    pub fn live(&self) -> &Arc<Live> {
        &self.live
    }

    fn upstream(&self, cfg: &UpstreamConfig) -> Arc<Upstream> {
        let mut ups = self.upstreams.lock();
        if let Some(u) = ups.get(cfg).and_then(Weak::upgrade) {
            return u;
        }
        let u = Arc::new(Upstream::new(cfg.clone(), self.metrics.upstream(&cfg.name)));
        u.start_checks();
        self.pools.watch(&u);
        ups.insert(cfg.clone(), Arc::downgrade(&u));
        u
    }

    /// Forgets upstreams no snapshot uses any more.
    fn prune(&self) {
        self.upstreams.lock().retain(|_, w| w.strong_count() > 0);
    }
}

/// The limits that apply on one route to the consumers of one plan, ready to check.
#[derive(Debug, Default)]
pub struct LimitSet {
    /// Where each limit's cell is in a consumer's group (its plan's [`Layout`]).
    pub positions: SmallVec<[usize; 4]>,
    /// What each limit is, in the same order as `positions`.
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
    /// Requests allowed per window.
    pub requests: u64,
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
    pub strip: Option<crate::upstream::Strip>,
    /// Its upstream.
    pub upstream: Arc<Upstream>,
    /// The limits of its consumers (plan + route limits), by plan slot (see
    /// [`Counters::plan_slot`]); empty on a route without `auth`.
    pub limit_sets: Vec<LimitSet>,
    /// `Allow` header value for 405 answers.
    pub allow_header: Option<HeaderValue>,
    /// Its path as a trace's `http.route` says it: `/v1/items` (exact) or `/v1/*` (prefix).
    pub template: Arc<str>,
    /// Its counters in `/metrics`, kept across reloads.
    pub stats: Arc<RouteStats>,
    /// Its bearer tokens' keys and the tokens verified, when it takes tokens.
    pub jwt: Option<RouteJwt>,
}

/// A route's token check, compiled.
#[derive(Debug)]
pub struct RouteJwt {
    /// The route's `auth.jwt`.
    pub cfg: Arc<JwtConfig>,
    /// The keys that sign its tokens (shared with routes naming the same source).
    pub keys: Arc<KeySet>,
    /// The algorithms it accepts.
    pub algorithms: SmallVec<[jsonwebtoken::Algorithm; 4]>,
    /// Tokens verified on it, until they expire.
    pub tokens: TokenCache,
}

/// Bytes of verified tokens a route remembers.
const TOKEN_CACHE_BYTES: u64 = 32 << 20;

/// Everything a request reads, pinned for its whole life.
#[derive(Debug)]
pub struct Snapshot {
    /// The validated config it was built from.
    pub config: Config,
    /// Routes, most specific first.
    pub routes: Vec<Route>,
    /// Each consumer's limit counters, made on first call.
    pub counters: Counters,
    /// Header names only the gateway may set.
    pub owned: Owned,
    /// Every query parameter any route reads a key from, removed from logged URLs.
    pub credential_params: Arc<[String]>,
    /// `-`: the consumer or route of requests that had none, in the usage history.
    pub anonymous: Arc<str>,
    /// TLS listeners' rustls configs, by address: built per snapshot so that renewed
    /// certificates serve new connections after a reload.
    pub tls: Vec<(std::net::SocketAddr, Arc<rustls::ServerConfig>)>,
    /// Consumers managed through the admin API, over the config's (shared by every
    /// snapshot: a change applies at once).
    pub roster: Arc<Roster>,
}

impl Snapshot {
    /// Compiles `config`, reusing counters and pools from `registry` where unchanged.
    pub fn build(config: Config, registry: &Registry) -> Snapshot {
        let mut handles = LimitHandles {
            metrics: &registry.metrics,
            seen: HashMap::new(),
        };
        let route_names: Vec<Arc<str>> = config
            .routes
            .iter()
            .map(|r| Arc::from(r.name.as_str()))
            .collect();
        let plan_limits = |slot: usize| -> &[LimitConfig] {
            config.plans.get(slot).map_or(&[], |p| p.limits.as_slice())
        };
        // One layout per plan, then one for consumers without a plan: the plan's limits,
        // then each limited route's own. route_at[slot][route]: where that route's start.
        let slots = config.plans.len() + 1;
        let mut layouts = Vec::with_capacity(slots);
        let mut route_at = vec![vec![0usize; config.routes.len()]; slots];
        for (slot, at) in route_at.iter_mut().enumerate() {
            let mut layout = Layout::default();
            for l in plan_limits(slot) {
                layout.limits.push((l.clone(), None));
            }
            for (ri, r) in config.routes.iter().enumerate() {
                at[ri] = layout.limits.len();
                if r.auth.is_some() {
                    for l in &r.limits {
                        layout
                            .limits
                            .push((l.clone(), Some(route_names[ri].clone())));
                    }
                }
            }
            layouts.push(layout);
        }
        let routes = config
            .routes
            .iter()
            .enumerate()
            .map(|(ri, r)| {
                let upstream = registry.upstream(&config.upstreams[r.upstream]);
                let limit_sets = if r.auth.is_none() {
                    Vec::new()
                } else {
                    (0..slots)
                        .map(|slot| {
                            let mut all: Vec<(usize, &LimitConfig, String)> = plan_limits(slot)
                                .iter()
                                .enumerate()
                                .map(|(i, l)| (i, l, "plan".to_string()))
                                .collect();
                            for (j, l) in r.limits.iter().enumerate() {
                                all.push((route_at[slot][ri] + j, l, format!("route:{}", r.name)));
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
                    (tollgate_config::PathMatch::Prefix(p), true) => Some(crate::upstream::Strip {
                        prefix: Arc::from(p.as_str()),
                        any_case: r.case_insensitive,
                    }),
                    _ => None,
                };
                let template = match &r.path {
                    tollgate_config::PathMatch::Exact(p) => Arc::from(p.as_str()),
                    tollgate_config::PathMatch::Prefix(p) => Arc::from(format!("{p}*")),
                };
                let jwt = r.auth.as_ref().and_then(|a| a.jwt.as_ref()).map(|j| {
                    let label = match &j.keys {
                        JwtKeys::Url(u) | JwtKeys::Discovery(u) => u.clone(),
                        JwtKeys::File(_) => format!("route {} jwks_file", r.name),
                        JwtKeys::Secret(_) => format!("route {} secret_file", r.name),
                    };
                    RouteJwt {
                        keys: registry.keys.get(&j.keys, j.fetch_timeout, &label),
                        algorithms: j
                            .algorithms
                            .iter()
                            .map(|a| crate::jwks::algorithm(*a))
                            .collect(),
                        tokens: TokenCache::new(TOKEN_CACHE_BYTES),
                        cfg: j.clone(),
                    }
                });
                Route {
                    jwt,
                    name: route_names[ri].clone(),
                    template,
                    strip,
                    cfg: r.clone(),
                    upstream,
                    limit_sets,
                    allow_header,
                    stats: registry.metrics.route(&r.name),
                }
            })
            .collect();
        // After the routes hold their upstreams: the registry keeps them only weakly.
        reserve_route_hosts(&config, registry);
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
        let tls = config
            .listeners
            .iter()
            .filter_map(|l| {
                let t = l.tls.as_ref()?;
                match crate::listener::tls::server_config(t) {
                    Ok(c) => Some((l.address, c)),
                    Err(e) => {
                        tracing::error!(listener = %l.address, "TLS config: {e}");
                        None
                    }
                }
            })
            .collect();
        Snapshot {
            roster: registry.roster.clone(),
            tls,
            credential_params: params.into(),
            anonymous: Arc::from(crate::observe::analytics::NONE),
            counters: Counters::new(config.consumers.clone(), layouts, registry.live.clone()),
            config,
            routes,
            owned,
        }
    }

    /// Waits (at most `wait`) until every token route's keys have been fetched once, so a
    /// snapshot about to serve does not refuse good tokens for want of keys.
    pub async fn keys_settled(&self, wait: std::time::Duration) {
        let sets = self.routes.iter().filter_map(|r| r.jwt.as_ref());
        futures_util::future::join_all(sets.map(|j| j.keys.settled(wait))).await;
    }

    /// A stable identity of consumer `i` for the usage history.
    pub fn consumer_identity(&self, i: usize) -> (usize, u32) {
        self.counters.identity(i)
    }

    /// Consumer `i`'s name (from its counters line, where the request finds its plan and
    /// counts too).
    pub fn consumer_name(&self, i: usize) -> &str {
        self.counters.name(i)
    }

    /// Every limit consumer `i` is counted in, across the routes, once each: its cell in
    /// `group` (from [`Counters::group`]) and what the limit is.
    pub fn limits_of<'a>(
        &'a self,
        i: usize,
        group: &'a Group,
    ) -> impl Iterator<Item = (&'a Arc<LimitCell>, &'a LimitInfo)> + 'a {
        let slot = self.counters.plan_slot(i);
        let mut seen = std::collections::HashSet::new();
        self.routes
            .iter()
            .filter_map(move |r| r.limit_sets.get(slot))
            .flat_map(|set| set.positions.iter().zip(&set.info))
            .filter_map(|(&at, info)| group.get(at).map(|cell| (cell, info)))
            .filter(move |(cell, _)| seen.insert(cell.id))
    }

    /// Whether consumer `i` may call `route` (its `allow` list of consumers and plans).
    pub fn allowed(&self, route: &Route, i: usize) -> bool {
        match &route.cfg.allow {
            None => true,
            Some(a) => {
                // A listed consumer counted as a guest (its plan changed through the admin
                // API) is still the one `allow.consumers` names.
                let listed = if i < self.config.consumers.len() {
                    Some(i)
                } else {
                    self.config.consumers.find(self.consumer_name(i))
                };
                listed.is_some_and(|l| a.consumers.binary_search(&l).is_ok())
                    || self.counters.plan(i).is_some_and(|p| a.plans.contains(&p))
            }
        }
    }

    /// The consumer named `name` now: a listed one, or one the admin API manages (as a
    /// guest when the API gave it a plan other than its listed one); `None` when neither
    /// has it or the API deleted it. `Err` when the guests are full.
    pub fn find_consumer(&self, name: &str) -> Result<Option<usize>, crate::exchange::Refusal> {
        let listed = self.config.consumers.find(name);
        if self.roster.is_empty() {
            return Ok(listed);
        }
        match self.roster.get(name) {
            None => Ok(listed),
            Some(m) => self.managed(&m, listed).map(Some).or_else(|r| match r {
                crate::exchange::Refusal::UnknownKey => Ok(None),
                other => Err(other),
            }),
        }
    }

    /// The index a managed consumer is counted under: its listed one while its plan is
    /// the listed one, else a guest on its plan. `UnknownKey` when it was deleted,
    /// `UnknownPlan` when its plan is not in this config.
    pub fn managed(
        &self,
        m: &crate::roster::record::Managed,
        listed: Option<usize>,
    ) -> Result<usize, crate::exchange::Refusal> {
        use crate::exchange::Refusal;
        if m.deleted {
            return Err(Refusal::UnknownKey);
        }
        // A plan this config lacks (a change made on a node whose config has it) would
        // leave the consumer without limits: refused until a reload brings the plan.
        let slot = match &m.plan {
            None => self.config.plans.len(),
            Some(p) => self
                .config
                .plans
                .iter()
                .position(|plan| plan.name == *p)
                .ok_or(Refusal::UnknownPlan)?,
        };
        match listed {
            Some(i) if self.counters.plan_slot(i) == slot => Ok(i),
            _ => self
                .counters
                .managed_guest(&m.name, slot, listed)
                .ok_or(Refusal::TooManyGuests),
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
    // The framing fields too: a backend behind CGI or WSGI reads `Transfer_Encoding` as
    // `HTTP_TRANSFER_ENCODING`, the name the gateway's own framing has there.
    for n in [
        "x-forwarded-for",
        "x-forwarded-proto",
        "x-forwarded-host",
        "x-real-ip",
        "x-request-id",
        "content-length",
        "transfer-encoding",
    ] {
        add(n);
    }
    for r in &config.routes {
        if let Some(a) = &r.auth {
            add(a.consumer_header.as_str());
            for h in &a.header {
                add(h.as_str());
            }
            for (h, _) in a.jwt.iter().flat_map(|j| j.claims_to_headers.iter()) {
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
            let claims = a.jwt.iter().flat_map(|j| j.claims_to_headers.iter());
            for h in std::iter::once(&a.consumer_header).chain(claims.map(|(h, _)| h)) {
                if !owned.consumer_headers.contains(h) {
                    owned.consumer_headers.push(h.clone());
                }
            }
        }
    }
    owned
}

/// Tells each upstream the hosts its `preserve_host` routes match exactly, as clients
/// write them in `Host` (bare or with a listener's port, with or without the trailing
/// dot): an HTTP/2 upstream keeps their connections apart whatever hosts clients make up.
fn reserve_route_hosts(config: &Config, registry: &Registry) {
    let mut by_upstream: Vec<Option<Vec<String>>> = vec![None; config.upstreams.len()];
    for r in &config.routes {
        let Some(list) = by_upstream.get_mut(r.upstream) else {
            continue;
        };
        let list = list.get_or_insert_with(Vec::new);
        if let (true, Some(tollgate_config::HostMatch::Exact(h))) = (r.preserve_host, &r.host) {
            let ports = config.listeners.iter().map(|l| l.address.port());
            for name in [h.clone(), format!("{h}.")] {
                for p in ports.clone().filter(|&p| p != 0) {
                    list.push(format!("{name}:{p}"));
                }
                list.push(name);
            }
        }
    }
    for (u, list) in config.upstreams.iter().zip(by_upstream) {
        if let Some(list) = list {
            registry.upstream(u).reserve_hosts(list);
        }
    }
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

fn limit_set(all: Vec<(usize, &LimitConfig, String)>, handles: &mut LimitHandles<'_>) -> LimitSet {
    let policy = (!all.is_empty())
        .then(|| {
            let items: Vec<String> = all
                .iter()
                .map(|(_, l, _)| {
                    format!("\"{}\";q={};w={}", l.name, l.requests, l.window.as_secs())
                })
                .collect();
            HeaderValue::from_str(&items.join(", ")).ok()
        })
        .flatten();
    let (positions, info) = all
        .into_iter()
        .map(|(at, l, scope)| {
            let (label, refused) = handles.get(&l.name);
            let info = LimitInfo {
                label,
                refused,
                ratelimit_prefix: format!("\"{}\";r=", l.name),
                window_secs: l.window.as_secs(),
                requests: l.requests,
                name: l.name.clone(),
                scope,
            };
            (at, info)
        })
        .unzip();
    LimitSet {
        positions,
        info,
        policy,
    }
}

impl crate::observe::record::Names for Snapshot {
    fn consumer_name(&self, index: usize) -> &str {
        Snapshot::consumer_name(self, index)
    }

    fn credential_params(&self) -> &[String] {
        &self.credential_params
    }
}
