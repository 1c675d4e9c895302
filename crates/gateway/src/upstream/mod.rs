//! Upstreams: a keep-alive pool per upstream, round-robin over its targets, header
//! rewriting for the hop, timeouts, and retries only when they are safe.
//!
//! Retries: a request that was never written (connect failure, a pooled connection found
//! closed before the write) moves on to the next connection or target, whatever its method.
//! When a backend's close of a kept-alive connection races the write, an idempotent request
//! without a body (GET, HEAD, OPTIONS, PUT, DELETE, TRACE) is sent again on another
//! connection. A new connection that fails is not retried on the same target. A
//! non-idempotent request is never sent twice.

mod ahead;
mod body;
pub(crate) mod cap;
mod client;
mod dial;
pub(crate) mod h1;
mod headers;
pub use headers::{forwarding_header, sent, Sent};
pub mod health;
mod idle;
mod pool;
pub mod report;
mod upgrade;
mod with_body;

pub use body::{ClientFault, UpBody, BUFFER};
pub use dial::ConnectError;
pub use pool::{BodyError, Collector, PooledBody};
pub use upgrade::{upgrade, UpgradeAsk};

use crate::exchange::Refusal;
use crate::listener::RequestBody;
use crate::observe::metrics::UpstreamStats;
use cap::{Cap, Slot};
use http::header::{self, HeaderValue};
use http::request::Parts;
use http::uri::PathAndQuery;
use http::{Method, Response, Uri};
use hyper::body::Body as _;
use pool::Pool;
use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tollgate_config::UpstreamConfig;

struct Target {
    /// `host:port`, for logs and metrics.
    name: Arc<str>,
    /// `Host` header value for requests to this target.
    host: HeaderValue,
    /// hyper's client connections, for requests with a body.
    pool: Arc<Pool>,
    /// The lean client's connections, for requests without one.
    raw: Arc<h1::RawPool>,
    /// The cap on connections open at once, shared by both.
    cap: Arc<Cap>,
    /// Whether requests may go to it.
    health: health::Health,
}

impl Target {
    /// A connection: an idle one from `checkout`, or a new one from `connect` under the cap
    /// (the wait at the cap is bounded by the connect timeout; at the cap, `evict` closes an
    /// idle connection of the other client). The bool tells whether it was reused.
    async fn conn<T, F>(
        &self,
        up: &Upstream,
        checkout: impl Fn() -> Option<T>,
        evict: impl Fn() -> bool,
        connect: impl FnOnce(tokio::sync::OwnedSemaphorePermit) -> F,
    ) -> Result<(T, bool), Refusal>
    where
        F: Future<Output = Result<T, ConnectError>>,
    {
        match self.cap.slot(checkout, evict, up.cfg.connect_timeout).await {
            Some(Slot::Idle(c)) => Ok((c, true)),
            Some(Slot::New(permit)) => connect(permit)
                .await
                .map(|c| (c, false))
                .map_err(|e| connect_refusal(up, &e)),
            None => Err(Refusal::UpstreamBusy),
        }
    }

    /// A connection for the lean client.
    async fn raw_conn(&self, up: &Upstream) -> Result<(h1::H1Conn, bool), Refusal> {
        self.conn(
            up,
            || self.raw.checkout(),
            || self.pool.evict_one(),
            |p| self.raw.connect(p),
        )
        .await
    }

    /// A connection for hyper's client.
    async fn hyper_conn(
        &self,
        up: &Upstream,
    ) -> Result<(hyper::client::conn::http1::SendRequest<UpBody>, bool), Refusal> {
        self.conn(
            up,
            || self.pool.checkout(),
            || self.raw.evict_one(),
            |p| self.pool.connect(p),
        )
        .await
    }
}

/// One upstream: its settings, a pool per target, and the round-robin position.
pub struct Upstream {
    /// Settings it was built from (pools are shared across reloads while they are unchanged).
    pub cfg: UpstreamConfig,
    targets: Vec<Target>,
    /// The client for `https://` and `h2` upstreams, which skip the lean and pooled ones.
    alt: Option<client::AltClient>,
    /// An HTTP/1.1 client for upgraded connections, made on the first upgrade.
    upgrades: std::sync::OnceLock<Option<client::AltClient>>,
    next: AtomicUsize,
    /// Second of the last failure logged, so that failures log once a second at most.
    last_logged: AtomicU64,
    /// Failure and retry counters for `/metrics`.
    stats: UpstreamStats,
}

/// Where a request notes the target that answered it (for the access log).
pub type AnsweredBy = std::sync::OnceLock<Arc<str>>;

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
            .filter_map(|t| {
                let cap = Cap::new(cfg.max_connections);
                Some(Target {
                    name: Arc::from(t.as_str()),
                    host: HeaderValue::from_str(t).ok()?,
                    pool: Pool::new(
                        t,
                        cfg.pool_max_idle,
                        cfg.idle_timeout,
                        cfg.connect_timeout,
                        cap.clone(),
                    ),
                    raw: h1::RawPool::new(
                        t,
                        cfg.pool_max_idle,
                        cfg.idle_timeout,
                        cfg.connect_timeout,
                        cap.clone(),
                    ),
                    cap,
                    health: health::Health::default(),
                })
            })
            .collect();
        let alt = client::AltClient::needed(&cfg)
            .then(|| {
                client::AltClient::new(&cfg, cfg.protocol == tollgate_config::UpstreamProtocol::H2)
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

    /// Per target: its name, connections open, idle connections in the pools, and
    /// whether it is in rotation.
    pub fn pool_figures(&self) -> Vec<(String, usize, usize, bool)> {
        self.targets
            .iter()
            .map(|t| {
                (
                    t.name.to_string(),
                    t.cap.open(),
                    t.pool.idle_len() + t.raw.idle_len(),
                    t.health.is_up(),
                )
            })
            .collect()
    }

    /// The next healthy target, round-robin, with its index. When there is none: after a
    /// try that was made (`tried`), `Err(None)`, since that try's failure is the answer;
    /// otherwise the refusal, counted when it is for want of a healthy target (503).
    fn pick(&self, tried: bool) -> Result<(usize, &Target), Option<Refusal>> {
        let n = self.targets.len();
        if n == 0 {
            return Err(Some(Refusal::Upstream("no target")));
        }
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        for k in 0..n {
            let i = start.wrapping_add(k) % n;
            if let Some(t) = self.targets.get(i).filter(|t| t.health.is_up()) {
                return Ok((i, t));
            }
        }
        if tried {
            return Err(None);
        }
        self.stats.no_healthy.inc();
        Err(Some(Refusal::NoHealthyTarget))
    }

    /// Notes how a request to `t` went, for passive health checks: connect failures,
    /// timeouts and 5xx answers count against it, anything else clears it.
    fn outcome(&self, t: &Target, ok: bool) {
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

    /// The HTTP/1.1 client for upgrades (and active checks), made once.
    fn upgrade_client(&self) -> Option<client::AltClient> {
        self.upgrades
            .get_or_init(|| {
                client::AltClient::new(&self.cfg, false)
                    .map_err(|e| tracing::error!(upstream = %self.cfg.name, "client: {e}"))
                    .ok()
            })
            .clone()
    }
}

/// How to rewrite a request for its hop upstream.
pub struct Hop<'a> {
    /// The client's IP, appended to `X-Forwarded-For`.
    pub peer_ip: &'a HeaderValue,
    /// The client is a trusted proxy: its `X-Forwarded-*` headers are kept.
    pub trusted: bool,
    /// The client came over TLS (`X-Forwarded-Proto: https`).
    pub https: bool,
    /// Prefix to remove from the path, if the route strips one.
    pub strip_prefix: Option<&'a str>,
    /// Keep the client's `Host`.
    pub preserve_host: bool,
    /// Largest body accepted.
    pub max_body: u64,
    /// Longest wait for the next piece of the request body.
    pub body_timeout: Duration,
    /// Stream the request body at once instead of reading up to [`BUFFER`] first.
    pub stream_body: bool,
    /// The route's name, for logs.
    pub route: &'a str,
    /// Where to note the target that answered, when the access log wants it.
    pub note_target: Option<&'a AnsweredBy>,
}

fn is_idempotent(m: &Method) -> bool {
    matches!(
        *m,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::PUT | Method::DELETE | Method::TRACE
    )
}

fn path_and_query(uri: &Uri, strip: Option<&str>) -> PathAndQuery {
    let pq = uri
        .path_and_query()
        .cloned()
        .unwrap_or_else(|| PathAndQuery::from_static("/"));
    let Some(prefix) = strip else {
        return pq;
    };
    let rest = pq.path().strip_prefix(prefix).unwrap_or(pq.path());
    let mut s = String::with_capacity(pq.as_str().len() + 1);
    if !rest.starts_with('/') {
        s.push('/');
    }
    s.push_str(rest);
    if let Some(q) = pq.query() {
        s.push('?');
        s.push_str(q);
    }
    PathAndQuery::try_from(s).unwrap_or(pq)
}

/// The request's method, target and headers rewritten for the hop. Rewritten once; only
/// `Host` changes from one target to the next.
fn for_hop(parts: Parts, hop: &Hop<'_>) -> (Method, PathAndQuery, http::HeaderMap) {
    let Parts {
        method,
        uri,
        mut headers,
        ..
    } = parts;
    let pq = path_and_query(&uri, hop.strip_prefix);
    headers::rewrite_request(&mut headers, hop.peer_ip, hop.trusted, hop.https);
    if !hop.preserve_host {
        headers.remove(header::HOST);
    }
    (method, pq, headers)
}

/// Sends a request without a body (GET or HEAD, for the cache) on the lean client.
pub async fn fetch(
    up: &Upstream,
    parts: Parts,
    hop: Hop<'_>,
) -> Result<Response<PooledBody>, Refusal> {
    let (method, pq, headers) = for_hop(parts, &hop);
    if let Some(alt) = &up.alt {
        return Box::pin(client::forward(up, alt, method, pq, headers, None, &hop)).await;
    }
    forward_lean(up, &method, &pq, headers, &hop).await
}

/// Sends the request to `up` and returns its response head with the body streaming.
pub async fn forward(
    up: &Upstream,
    parts: Parts,
    body: RequestBody,
    hop: Hop<'_>,
) -> Result<Response<PooledBody>, Refusal> {
    let (method, pq, headers) = for_hop(parts, &hop);
    // The lean path inline; the others boxed, so that every request's future (moved into
    // hyper's connection at each request) stays the size the lean path needs.
    if let Some(alt) = &up.alt {
        return Box::pin(client::forward(
            up,
            alt,
            method,
            pq,
            headers,
            Some(body),
            &hop,
        ))
        .await;
    }
    if body.is_end_stream()
        && matches!(
            method,
            Method::GET | Method::HEAD | Method::DELETE | Method::OPTIONS
        )
    {
        return forward_lean(up, &method, &pq, headers, &hop).await;
    }
    Box::pin(with_body::forward_hyper(up, method, pq, headers, body, hop)).await
}

/// The 502 for a `101` to a request that asked for no upgrade (each client path's answer
/// to it): logged and counted as any 502.
fn unasked_switch(up: &Upstream, route: &str, target: &Target) -> Refusal {
    let refusal = Refusal::Upstream("a protocol switch nobody asked for");
    log_failure(up, route, target, &refusal);
    refusal
}

/// Counts a 502, 503 or 504, and logs it at info at most once a second per upstream.
fn log_failure(up: &Upstream, route: &str, target: &Target, refusal: &Refusal) {
    match refusal {
        Refusal::Upstream(_) => up.stats.errors.inc(),
        Refusal::UpstreamTimeout => up.stats.timeouts.inc(),
        Refusal::UpstreamBusy => up.stats.busy.inc(),
        Refusal::NoHealthyTarget => up.stats.no_healthy.inc(),
        _ => return,
    };
    let now = crate::clock::coarse_secs();
    let last = up.last_logged.load(Ordering::Relaxed);
    if now != last
        && up
            .last_logged
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    {
        let target = target.host.to_str().unwrap_or("?");
        tracing::info!(route, upstream = %up.cfg.name, target, "{refusal}");
    }
}

/// How many more tries a request gets. Connect failures and closed pooled connections move
/// it on; only new connections spend the budget (targets + 2), since every pooled connection
/// found dead is dropped on the way. A hard bound (16 more) holds should live traffic keep
/// returning connections that die on reuse.
struct Tries {
    new: usize,
    total: usize,
    started: usize,
}

impl Tries {
    fn new(up: &Upstream) -> Self {
        let new = up.targets.len() + 2;
        Tries {
            new,
            total: new + 16,
            started: new + 16,
        }
    }

    /// Whether another try is allowed (and counts it).
    fn next(&mut self) -> bool {
        if self.new == 0 || self.total == 0 {
            return false;
        }
        self.total -= 1;
        true
    }

    /// Whether the try just counted is not the first.
    fn retried(&self) -> bool {
        self.started - self.total > 1
    }

    /// A new connection was opened, or failed to open.
    fn spend_new(&mut self) {
        self.new = self.new.saturating_sub(1);
    }

    /// No connection to `target` could be had (`e`). A full pool ends the request (503,
    /// counted and logged): `Err`. Any other failure counts against the target and spends
    /// a new connection; the next try may go on: `Ok` with the refusal to answer if none
    /// is left.
    fn no_conn(
        &mut self,
        up: &Upstream,
        route: &str,
        target: &Target,
        e: Refusal,
    ) -> Result<Refusal, Refusal> {
        if matches!(e, Refusal::UpstreamBusy) {
            log_failure(up, route, target, &e);
            return Err(e);
        }
        up.outcome(target, false);
        self.spend_new();
        Ok(e)
    }
}

fn connect_refusal(up: &Upstream, e: &ConnectError) -> Refusal {
    up.stats.connect_errors.inc();
    tracing::debug!(upstream = %up.cfg.name, error = %e, "connect failed");
    match e {
        ConnectError::Timeout => Refusal::UpstreamTimeout,
        _ => Refusal::Upstream("connection refused"),
    }
}

/// The hot path: an idempotent request without a body, on the lean client. Its head is
/// encoded once per target and can be sent again as it is, so a connection found closed
/// (before or during the exchange) costs a replay, never an error.
async fn forward_lean(
    up: &Upstream,
    method: &Method,
    pq: &PathAndQuery,
    mut headers: http::HeaderMap,
    hop: &Hop<'_>,
) -> Result<Response<PooledBody>, Refusal> {
    let mut last = Refusal::Upstream("no target");
    let mut last_target = None;
    let mut head = Vec::with_capacity(512);
    let mut encoded_for: Option<usize> = None;
    let mut fresh_failures = 0;
    let mut tries = Tries::new(up);
    while tries.next() {
        if tries.retried() {
            up.stats.retries.inc();
        }
        let (key, target) = match up.pick(last_target.is_some()) {
            Ok(t) => t,
            Err(none) => {
                last = none.unwrap_or(last);
                break;
            }
        };
        last_target = Some(target);
        if encoded_for != Some(key) {
            if !hop.preserve_host {
                headers.insert(header::HOST, target.host.clone());
            }
            h1::encode_head(method, pq.as_str(), &headers, &mut head);
            encoded_for = Some(key);
        }
        let (conn, reused) = match target.raw_conn(up).await {
            Ok(c) => c,
            Err(e) => {
                last = tries.no_conn(up, hop.route, target, e)?;
                continue;
            }
        };
        if !reused {
            tries.spend_new();
        }
        match tokio::time::timeout(up.cfg.response_timeout, conn.exchange(&head, method)).await {
            Err(_) => {
                up.outcome(target, false);
                log_failure(up, hop.route, target, &Refusal::UpstreamTimeout);
                return Err(Refusal::UpstreamTimeout);
            }
            Ok(Ok((h, body))) => {
                up.outcome(target, !h.status.is_server_error());
                let body = body.with_pool(target.raw.clone());
                let mut resp = Response::new(PooledBody::raw(body, up.cfg.read_timeout));
                *resp.status_mut() = h.status;
                *resp.headers_mut() = h.headers;
                headers::rewrite_response(resp.headers_mut());
                if let Some(n) = hop.note_target {
                    let _ = n.set(target.name.clone());
                }
                return Ok(resp);
            }
            Ok(Err(h1::H1Error::Closed(e))) => {
                tracing::debug!(upstream = %up.cfg.name, reused, error = %e, "connection closed under the request");
                last = Refusal::Upstream("connection reset or closed");
                // A kept-alive connection closed by the backend while idle is replayed; a
                // new connection that fails moves on to another target, never the same one.
                if !reused {
                    up.outcome(target, false);
                    fresh_failures += 1;
                    if fresh_failures >= up.targets.len() {
                        break;
                    }
                }
            }
            Ok(Err(h1::H1Error::Malformed)) => {
                up.outcome(target, false);
                let refusal = Refusal::Upstream("malformed or truncated response");
                log_failure(up, hop.route, target, &refusal);
                return Err(refusal);
            }
            Ok(Err(h1::H1Error::Switched)) => return Err(unasked_switch(up, hop.route, target)),
        }
    }
    if let Some(t) = last_target {
        log_failure(up, hop.route, t, &last);
    }
    Err(last)
}
