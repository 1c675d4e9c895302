//! One upstream as the clients see it: its targets (each with its connections and health),
//! round-robin picking, the retry budget, and how failures
//! are counted and logged.

use super::alt::AltClient;
use super::cap::{Cap, Slot};
use super::dial::ConnectError;
use super::h1;
use super::health::Health;
use crate::exchange::Refusal;
use crate::observe::metrics::UpstreamStats;
use http::header::HeaderValue;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use tollgate_config::UpstreamConfig;

pub(super) struct Target {
    /// `host:port`, for logs and metrics.
    pub(super) name: Arc<str>,
    /// `Host` header value for requests to this target.
    pub(super) host: HeaderValue,
    /// The kept-alive connections of the lean client.
    pub(super) pool: Arc<h1::Pool>,
    /// The cap on connections open at once.
    pub(super) cap: Arc<Cap>,
    /// Whether requests may go to it.
    pub(super) health: Health,
}

impl Target {
    /// A connection: an idle one from the pool, or a new one under the cap (the wait at the
    /// cap is bounded by the connect timeout). The bool tells whether it was reused.
    pub(super) async fn conn(&self, up: &Upstream) -> Result<(h1::H1Conn, bool), Refusal> {
        match self
            .cap
            .slot(|| self.pool.checkout(), up.cfg.connect_timeout)
            .await
        {
            Some(Slot::Idle(c)) => Ok((c, true)),
            Some(Slot::New(permit)) => self
                .pool
                .connect(permit)
                .await
                .map(|c| (c, false))
                .map_err(|e| connect_refusal(up, &e)),
            None => Err(Refusal::UpstreamBusy),
        }
    }
}

/// One upstream: its settings, a pool per target, and the round-robin position.
pub struct Upstream {
    /// Settings it was built from (pools are shared across reloads while they are unchanged).
    pub cfg: UpstreamConfig,
    pub(super) targets: Vec<Target>,
    /// The client for `https://` and `h2` upstreams, which skip the lean and pooled ones.
    pub(super) alt: Option<AltClient>,
    /// An HTTP/1.1 client for upgraded connections, made on the first upgrade.
    pub(super) upgrades: std::sync::OnceLock<Option<AltClient>>,
    pub(super) next: AtomicUsize,
    /// When the last failure was logged (coarse milliseconds, offset by a second), so that
    /// failures log once a second at most.
    pub(super) last_logged: AtomicU64,
    /// Failure and retry counters for `/metrics`.
    pub(super) stats: UpstreamStats,
}

/// What a failure's log line says of its request: the route and the request id.
#[derive(Clone, Copy, Debug)]
pub(super) struct At<'a> {
    /// The route's name.
    pub route: &'a str,
    /// Where the request's `X-Request-Id` is: looked up only for a line written.
    pub request_id: IdIn<'a>,
}

/// Where a request's id is found when a failure's line is written: in the headers it is
/// sent with (no lookup on the request path), or given.
#[derive(Clone, Copy, Debug)]
pub(super) enum IdIn<'a> {
    /// The lean client's headers.
    Fields(&'a crate::exchange::Fields),
    /// The other clients' map.
    Map(&'a http::HeaderMap),
    /// Taken out before the headers were given away.
    Value(Option<&'a HeaderValue>),
}

impl<'a> At<'a> {
    /// The request id as text (ids are visible ASCII; another one shows empty).
    fn request_id(&self) -> &'a str {
        const ID: &str = "x-request-id";
        let v = match self.request_id {
            IdIn::Fields(h) => h.get(ID),
            IdIn::Map(h) => h.get(ID),
            IdIn::Value(v) => v,
        };
        v.and_then(|v| v.to_str().ok()).unwrap_or("")
    }
}

/// Where a request notes the target that answered it and how often it was retried (for
/// the access log and the request's span).
#[derive(Debug, Default)]
pub struct AnsweredBy {
    /// The target that answered or, when none did, the last one tried (as nginx's
    /// `$upstream_addr`). A lock taken once a try, uncontended.
    pub target: parking_lot::Mutex<Option<Arc<str>>>,
    /// Tries after the first.
    pub retries: std::sync::atomic::AtomicU32,
    /// The request body read from the client: its length when it was read whole, or
    /// what a streaming body has brought so far.
    body: parking_lot::Mutex<Option<BodyRead>>,
}

/// How much of a request body was read.
#[derive(Debug)]
enum BodyRead {
    Whole(u64),
    Streaming(Arc<super::body::BodyWatch>),
}

impl AnsweredBy {
    /// Notes the target a try goes to: the last one noted is the one that answered, or
    /// the last that failed.
    pub fn tried(&self, target: &Arc<str>) {
        *self.target.lock() = Some(target.clone());
    }

    /// Notes a request body read whole: `len` bytes.
    pub(super) fn body_whole(&self, len: u64) {
        *self.body.lock() = Some(BodyRead::Whole(len));
    }

    /// Notes a request body streaming on: `watch` counts what it brings.
    pub(super) fn body_streaming(&self, watch: &Arc<super::body::BodyWatch>) {
        *self.body.lock() = Some(BodyRead::Streaming(watch.clone()));
    }

    /// The request body's bytes read from the client, if a body was read.
    pub fn body_read(&self) -> Option<u64> {
        match &*self.body.lock() {
            None => None,
            Some(BodyRead::Whole(n)) => Some(*n),
            Some(BodyRead::Streaming(w)) => Some(w.bytes_read()),
        }
    }

    /// Adds what `other` noted (a fetch made for the request) to this.
    pub fn take_from(&self, other: &AnsweredBy) {
        if let Some(t) = other.target.lock().clone() {
            self.tried(&t);
        }
        let n = other.retries.load(std::sync::atomic::Ordering::Relaxed);
        self.retries
            .fetch_add(n, std::sync::atomic::Ordering::Relaxed);
    }

    /// Notes one more try.
    pub fn retried(&self) {
        self.retries
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upstream")
            .field("name", &self.cfg.name)
            .finish()
    }
}

impl Upstream {
    /// Pools for `cfg`'s targets (validated as `host:port`), counting into `stats`.
    pub fn new(cfg: UpstreamConfig, stats: UpstreamStats) -> Self {
        let targets = cfg
            .targets
            .iter()
            .map(|t| {
                let cap = Cap::new(cfg.max_connections);
                // `Host` without the scheme's own port, as clients write it.
                let default = if cfg.tls { ":443" } else { ":80" };
                let host = t.strip_suffix(default).unwrap_or(t);
                // Validated as `host:port`; a target keeps its place either way (it is
                // its lanes' on the alternative client).
                let host = HeaderValue::from_str(host)
                    .unwrap_or_else(|_| HeaderValue::from_static("invalid"));
                Target {
                    name: Arc::from(t.as_str()),
                    host,
                    pool: h1::Pool::new(
                        t,
                        cfg.pool_max_idle,
                        cfg.idle_timeout,
                        cfg.connect_timeout,
                        cap.clone(),
                    ),
                    cap,
                    health: Health::default(),
                }
            })
            .collect();
        let alt = AltClient::needed(&cfg)
            .then(|| {
                AltClient::new(&cfg, cfg.protocol == tollgate_config::UpstreamProtocol::H2)
                    .map_err(|e| tracing::error!(upstream = %cfg.name, "client: {e}"))
                    .ok()
            })
            .flatten();
        Upstream {
            cfg,
            targets,
            alt,
            upgrades: std::sync::OnceLock::new(),
            next: AtomicUsize::new(0),
            last_logged: AtomicU64::new(0),
            stats,
        }
    }

    /// Counts a 503 for a request that found no place among its HTTP/2 connection's
    /// streams holding an upstream connection (`max_upstream_streams`), as the upstream's
    /// own busy 503s are counted.
    pub fn count_busy(&self) {
        self.stats.busy.inc();
    }

    /// Per target: its name, connections open, idle connections in the pools, and
    /// whether it is in rotation.
    pub fn pool_figures(&self) -> Vec<(String, usize, usize, bool)> {
        self.targets
            .iter()
            .map(|t| {
                (
                    t.name.to_string(),
                    t.cap.open(),
                    t.pool.idle_len(),
                    t.health.is_up(),
                )
            })
            .collect()
    }

    /// The next healthy target, round-robin, with its index, past those this request
    /// `failed` on. When there is none, the next target active checks keep in (passive
    /// checks alone do not leave an upstream without targets, and a retry moves on among
    /// those too). When active checks keep none in, or the request has failed on every
    /// healthy one: after a try that was made (`tried`), `Err(None)`, since that try's
    /// failure is the answer; otherwise the refusal, counted and logged (for `route`) as
    /// for want of a healthy target (503).
    pub(super) fn pick(
        &self,
        at: At<'_>,
        tried: bool,
        failed: Failed,
    ) -> Result<(usize, &Target), Option<Refusal>> {
        let n = self.targets.len();
        if n == 0 {
            return Err(Some(Refusal::Upstream("no target")));
        }
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let mut healthy = false;
        for k in 0..n {
            let i = start.wrapping_add(k) % n;
            if let Some(t) = self.targets.get(i).filter(|t| t.health.is_up()) {
                if !failed.has(i) {
                    return Ok((i, t));
                }
                healthy = true;
            }
        }
        if healthy {
            // Every healthy target has failed this request.
            return Err(None);
        }
        // Passive checks alone have taken out every target active checks (if any) keep
        // in: requests go to those anyway, round-robin, and a success brings a target
        // back. A verdict drawn from requests, which a client can provoke (answers it
        // makes fail), holds only while another target takes the load: nginx never
        // takes a lone server out, and Envoy spreads over every host when too few are
        // healthy (its panic threshold).
        for k in 0..n {
            let i = start.wrapping_add(k) % n;
            let t = self.targets.get(i).filter(|t| t.health.actively_up());
            if let Some(t) = t.filter(|_| !failed.has(i)) {
                if !tried {
                    log_every_target_out(self, at);
                }
                return Ok((i, t));
            }
        }
        if tried {
            return Err(None);
        }
        self.stats.no_healthy.inc();
        log_no_healthy_target(self, at);
        Err(Some(Refusal::NoHealthyTarget))
    }

    /// Notes how a request to `t` went, for passive health checks: connect failures,
    /// timeouts and 5xx answers count against it, anything else clears it.
    pub(super) fn outcome(&self, t: &Target, ok: bool) {
        if ok {
            t.health.succeeded();
        } else if t.health.failed(&self.cfg.health) {
            self.stats.taken_out.inc();
            tracing::warn!(
                upstream = %self.cfg.name,
                target = %t.name,
                backoff = ?self.cfg.health.backoff,
                "target taken out of rotation after {} failures in a row",
                self.cfg.health.failures
            );
        }
    }

    /// Lets the hosts routes to this upstream name exactly (`Host` as clients write it,
    /// lowercase) keep their own HTTP/2 connections however many other hosts clients
    /// name; the latest snapshot's list counts.
    pub fn reserve_hosts(&self, hosts: impl IntoIterator<Item = String>) {
        if let Some(alt) = &self.alt {
            alt.reserve_hosts(hosts);
        }
    }

    /// The HTTP/1.1 client for upgrades (and active checks), made once.
    pub(super) fn upgrade_client(&self) -> Option<AltClient> {
        self.upgrades
            .get_or_init(|| {
                AltClient::new(&self.cfg, false)
                    .map_err(|e| tracing::error!(upstream = %self.cfg.name, "client: {e}"))
                    .ok()
            })
            .clone()
    }
}

/// The 502 for a `101` to a request that asked for no upgrade (each client path's answer
/// to it): logged and counted as any 502.
pub(super) fn unasked_switch(up: &Upstream, at: At<'_>, target: &Target) -> Refusal {
    let refusal = Refusal::Upstream("a protocol switch nobody asked for");
    log_failure(up, at, target, &refusal);
    refusal
}

/// The 502 for an answer whose body is under a coding the gateway does not pass on (each
/// client path's answer to it): logged and counted as any 502, but the target answered, so
/// its health is not charged.
pub(super) fn coded(up: &Upstream, at: At<'_>, target: &Target) -> Refusal {
    let refusal = Refusal::Upstream("answer under a transfer coding other than chunked");
    log_failure(up, at, target, &refusal);
    refusal
}

/// Counts a 502, 503 or 504, and logs it at info at most once a second per upstream.
pub(super) fn log_failure(up: &Upstream, at: At<'_>, target: &Target, refusal: &Refusal) {
    log_failure_because(up, at, target, refusal, None);
}

/// Logs that no target of `up` is healthy (counted where it was found): at most one line
/// a second per upstream, as the other failures.
fn log_no_healthy_target(up: &Upstream, at: At<'_>) {
    if log_due(up) {
        let targets = up.targets.len();
        let (route, request_id) = (at.route, at.request_id());
        tracing::info!(route, upstream = %up.cfg.name, targets, request_id, "{}", Refusal::NoHealthyTarget);
    }
}

/// Passive checks have taken out every target: said at most once a second per upstream.
fn log_every_target_out(up: &Upstream, at: At<'_>) {
    if log_due(up) {
        let targets = up.targets.len();
        let (route, request_id) = (at.route, at.request_id());
        tracing::warn!(
            route,
            request_id,
            upstream = %up.cfg.name,
            targets,
            "every target taken out by passive checks: requests go to them all"
        );
    }
}

/// Whether a failure of `up` may be logged now: at most one line a second per upstream,
/// a second being measured from the last line, not the clock's whole seconds.
fn log_due(up: &Upstream) -> bool {
    // Offset by a second, so that the first failure (nothing logged yet: 0) is due.
    let now = crate::clock::coarse::since_boot().as_millis() as u64 + 1_000;
    let last = up.last_logged.load(Ordering::Relaxed);
    now.saturating_sub(last) >= 1_000
        && up
            .last_logged
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
}

/// [`log_failure`], with what caused it in words (a certificate error, say), when there is
/// more to say than the answer's detail.
pub(super) fn log_failure_because(
    up: &Upstream,
    at: At<'_>,
    target: &Target,
    refusal: &Refusal,
    cause: Option<&str>,
) {
    match refusal {
        Refusal::Upstream(_) => up.stats.errors.inc(),
        Refusal::UpstreamTimeout => up.stats.timeouts.inc(),
        Refusal::UpstreamBusy => up.stats.busy.inc(),
        Refusal::NoHealthyTarget => up.stats.no_healthy.inc(),
        _ => return,
    };
    if log_due(up) {
        let target: &str = &target.name;
        let (route, request_id) = (at.route, at.request_id());
        match cause {
            Some(cause) => {
                tracing::info!(route, upstream = %up.cfg.name, target, request_id, "{refusal}: {cause}")
            }
            None => tracing::info!(route, upstream = %up.cfg.name, target, request_id, "{refusal}"),
        }
    }
}

/// The targets (by place) a request failed on with a new connection: its next tries
/// go to others, as nginx's `proxy_next_upstream` never tries a server twice, whatever
/// other requests took from the round-robin meanwhile. The first 64 targets are kept;
/// past them, a retry may land on one again (the tries stay bounded by the targets'
/// count).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Failed(u64);

impl Failed {
    /// Notes that the request failed on target `i`.
    pub(super) fn add(&mut self, i: usize) {
        if i < 64 {
            self.0 |= 1 << i;
        }
    }

    /// Whether the request failed on target `i`.
    fn has(self, i: usize) -> bool {
        i < 64 && self.0 & (1 << i) != 0
    }
}

/// How many more tries a request gets. Connect failures and closed pooled connections move
/// it on; only new connections spend the budget (targets + 2), since every pooled connection
/// found dead is dropped on the way. A hard bound (16 more) holds should live traffic keep
/// returning connections that die on reuse. A request tries to connect at most as many
/// times as there are targets, as nginx tries each server once: a lone target that cannot
/// be reached costs one `connect_timeout`, not three.
pub(super) struct Tries {
    new: usize,
    total: usize,
    started: usize,
    /// Connects that failed, and how many the request may make.
    unreached: usize,
    targets: usize,
}

impl Tries {
    pub(super) fn new(up: &Upstream) -> Self {
        let new = up.targets.len() + 2;
        Tries {
            new,
            total: new + 16,
            started: new + 16,
            unreached: 0,
            targets: up.targets.len().max(1),
        }
    }

    /// Whether another try is allowed (and counts it).
    pub(super) fn next(&mut self) -> bool {
        if self.new == 0 || self.total == 0 {
            return false;
        }
        self.total -= 1;
        true
    }

    /// Whether the try just counted is not the first.
    pub(super) fn retried(&self) -> bool {
        self.started - self.total > 1
    }

    /// A new connection was opened, or failed to open.
    pub(super) fn spend_new(&mut self) {
        self.new = self.new.saturating_sub(1);
    }

    /// No connection to `target` could be had (`e`). A full pool ends the request (503,
    /// counted and logged): `Err`, and so does the failed connect that makes one per target.
    /// Any other failure counts against the target and spends a new connection; the next
    /// try may go on: `Ok` with the refusal to answer if none is left.
    pub(super) fn no_conn(
        &mut self,
        up: &Upstream,
        at: At<'_>,
        target: &Target,
        e: Refusal,
    ) -> Result<Refusal, Refusal> {
        if matches!(e, Refusal::UpstreamBusy) {
            log_failure(up, at, target, &e);
            return Err(e);
        }
        up.outcome(target, false);
        self.spend_new();
        self.unreached += 1;
        if self.unreached >= self.targets {
            log_failure(up, at, target, &e);
            return Err(e);
        }
        Ok(e)
    }
}

pub(super) fn connect_refusal(up: &Upstream, e: &ConnectError) -> Refusal {
    up.stats.connect_errors.inc();
    tracing::debug!(upstream = %up.cfg.name, error = %e, "connect failed");
    match e {
        ConnectError::Timeout => Refusal::UpstreamTimeout,
        // The gateway's own descriptors ran out (EMFILE, ENFILE on Linux), not the
        // target's fault: a 503 as for a full pool, its health not charged.
        ConnectError::Io(io) if matches!(io.raw_os_error(), Some(23 | 24)) => Refusal::UpstreamBusy,
        _ => Refusal::Upstream("connection refused"),
    }
}
