//! Upstreams: a keep-alive pool per upstream, round-robin over its targets, header
//! rewriting for the hop, timeouts, and retries only when they are safe.
//!
//! Retries: a request that was never written (connect failure, a pooled connection found
//! closed before the write) moves on to the next connection or target, whatever its method.
//! When a backend's close of a kept-alive connection races the write, an idempotent request
//! without a body (GET, HEAD, OPTIONS, PUT, DELETE, TRACE) is sent again on another
//! connection. A new connection that fails is not retried on the same target. A
//! non-idempotent request is never sent twice.

mod dial;
mod h1;
mod headers;
mod idle;
mod pool;

pub use dial::ConnectError;
pub use pool::{BodyError, PooledBody};

use crate::response::Refusal;
use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::request::Parts;
use http::uri::PathAndQuery;
use http::{Method, Request, Response, Uri, Version};
use http_body_util::{Either, Empty, Limited};
use hyper::body::{Body as _, Incoming};
use pool::Pool;
use std::error::Error as StdError;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tollgate_config::UpstreamConfig;

/// Body sent upstream: the client's, streamed and capped, or none (then replayable).
pub type UpBody = Either<Limited<Incoming>, Empty<Bytes>>;

struct Target {
    /// `Host` header value for requests to this target.
    host: HeaderValue,
    /// hyper's client connections, for requests with a body.
    pool: Arc<Pool>,
    /// The lean client's connections, for requests without one.
    raw: Arc<h1::RawPool>,
}

/// One upstream: its settings, a pool per target, and the round-robin position.
pub struct Upstream {
    /// Settings it was built from (pools are shared across reloads while they are unchanged).
    pub cfg: UpstreamConfig,
    targets: Vec<Target>,
    next: AtomicUsize,
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upstream")
            .field("name", &self.cfg.name)
            .finish()
    }
}

impl Upstream {
    /// Pools for `cfg`'s targets (validated as `host:port`).
    pub fn new(cfg: UpstreamConfig) -> Self {
        let targets = cfg
            .targets
            .iter()
            .filter_map(|t| {
                Some(Target {
                    host: HeaderValue::from_str(t).ok()?,
                    pool: Pool::new(t, cfg.pool_max_idle, cfg.idle_timeout, cfg.connect_timeout),
                    raw: h1::RawPool::new(
                        t,
                        cfg.pool_max_idle,
                        cfg.idle_timeout,
                        cfg.connect_timeout,
                    ),
                })
            })
            .collect();
        Upstream {
            cfg,
            targets,
            next: AtomicUsize::new(0),
        }
    }

    /// The next target, round-robin, with its index.
    fn pick(&self) -> Option<(usize, &Target)> {
        if self.targets.is_empty() {
            return None;
        }
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.targets.len();
        self.targets.get(i).map(|t| (i, t))
    }
}

/// How to rewrite a request for its hop upstream.
pub struct Hop<'a> {
    /// The client's IP, appended to `X-Forwarded-For`.
    pub peer_ip: &'a HeaderValue,
    /// The client is a trusted proxy: its `X-Forwarded-*` headers are kept.
    pub trusted: bool,
    /// Prefix to remove from the path, if the route strips one.
    pub strip_prefix: Option<&'a str>,
    /// Keep the client's `Host`.
    pub preserve_host: bool,
    /// Largest body accepted.
    pub max_body: u64,
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

enum Failure {
    /// The connection closed or reset around the write; only idempotent requests may be
    /// replayed.
    Stale,
    /// The client's body was larger than allowed.
    TooLarge,
    /// Anything else: the backend broke the exchange.
    Other,
}

fn classify(e: &hyper::Error) -> Failure {
    if e.is_incomplete_message() || e.is_canceled() {
        return Failure::Stale;
    }
    let mut src: Option<&(dyn StdError + 'static)> = e.source();
    while let Some(s) = src {
        if s.is::<http_body_util::LengthLimitError>() {
            return Failure::TooLarge;
        }
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            use std::io::ErrorKind::*;
            // A backend that closes a kept-alive connection with our request unread resets it.
            if matches!(io.kind(), ConnectionReset | BrokenPipe | UnexpectedEof) {
                return Failure::Stale;
            }
        }
        src = s.source();
    }
    Failure::Other
}

/// Sends the request to `up` and returns its response head with the body streaming.
pub async fn forward(
    up: &Upstream,
    parts: Parts,
    body: Incoming,
    hop: Hop<'_>,
) -> Result<Response<PooledBody>, Refusal> {
    let Parts {
        method,
        uri,
        mut headers,
        ..
    } = parts;
    let pq = path_and_query(&uri, hop.strip_prefix);
    // Rewritten once; only `Host` changes from one target to the next.
    headers::rewrite_request(&mut headers, hop.peer_ip, hop.trusted);
    if !hop.preserve_host {
        headers.remove(header::HOST);
    }

    if body.is_end_stream()
        && matches!(
            method,
            Method::GET | Method::HEAD | Method::DELETE | Method::OPTIONS
        )
    {
        return forward_lean(up, &method, &pq, headers, hop.preserve_host).await;
    }

    let mut body = if body.is_end_stream() {
        // No body to stream: send none (and drop a stray `Content-Length: 0`).
        Some(Either::Right(Empty::new()))
    } else {
        let declared = headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > hop.max_body) {
            return Err(Refusal::PayloadTooLarge);
        }
        let limit = usize::try_from(hop.max_body).unwrap_or(usize::MAX);
        Some(Either::Left(Limited::new(body, limit)))
    };
    let replayable = matches!(body, Some(Either::Right(_)));

    let mut last = Refusal::Upstream("no target");
    let mut req: Option<Request<UpBody>> = None;
    let mut tries = Tries::new(up);
    while tries.next() {
        let Some((_, target)) = up.pick() else { break };
        let mut r = match req.take() {
            Some(r) => r,
            None => {
                let Some(b) = body.take() else { break };
                let mut r = Request::new(b);
                *r.method_mut() = method.clone();
                *r.uri_mut() = Uri::from(pq.clone());
                *r.version_mut() = Version::HTTP_11;
                *r.headers_mut() = std::mem::take(&mut headers);
                r
            }
        };
        if !hop.preserve_host {
            r.headers_mut().insert(header::HOST, target.host.clone());
        }

        let (mut tx, reused) = match target.pool.checkout() {
            Some(tx) => (tx, true),
            None => match target.pool.connect().await {
                Ok(tx) => (tx, false),
                Err(e) => {
                    tracing::debug!(upstream = %up.cfg.name, error = %e, "connect failed");
                    last = connect_refusal(&e);
                    // Nothing was sent: the request can go to the next target.
                    req = Some(r);
                    tries.spend_new();
                    continue;
                }
            },
        };
        if !reused {
            tries.spend_new();
        }
        if tx.ready().await.is_err() {
            // Closed while idle: nothing was sent.
            req = Some(r);
            continue;
        }
        // Kept for a replay: only idempotent requests without a body, and only when a
        // kept-alive connection closes under them (the backend closed it while idle).
        let replay = (reused && replayable && is_idempotent(&method)).then(|| clone_head(&r));
        let sent = tokio::time::timeout(up.cfg.response_timeout, tx.try_send_request(r)).await;
        let mut err = match sent {
            Ok(Ok(mut resp)) => {
                let stale_length = headers::rewrite_response(resp.headers_mut());
                let pool = (!stale_length).then(|| target.pool.clone());
                return Ok(resp.map(|b| PooledBody::new(b, tx, pool)));
            }
            Ok(Err(e)) => e,
            Err(_) => return Err(Refusal::UpstreamTimeout),
        };
        if let Some(unsent) = err.take_message() {
            // The connection failed before the request was written: safe to send again.
            req = Some(unsent);
            continue;
        }
        let err = err.into_error();
        match classify(&err) {
            Failure::TooLarge => return Err(Refusal::PayloadTooLarge),
            Failure::Stale if replay.is_some() => {
                tracing::debug!(upstream = %up.cfg.name, error = %err, "connection closed under the request; replaying");
                last = Refusal::Upstream("connection closed");
                req = replay;
            }
            Failure::Stale | Failure::Other => {
                tracing::debug!(upstream = %up.cfg.name, error = %err, "upstream failed");
                return Err(Refusal::Upstream("connection reset or closed"));
            }
        }
    }
    Err(last)
}

/// How many more tries a request gets. Connect failures and closed pooled connections move
/// it on; only new connections spend the budget (targets + 2), since every pooled connection
/// found dead is dropped on the way. A hard bound (16 more) holds should live traffic keep
/// returning connections that die on reuse.
struct Tries {
    new: usize,
    total: usize,
}

impl Tries {
    fn new(up: &Upstream) -> Self {
        let new = up.targets.len() + 2;
        Tries {
            new,
            total: new + 16,
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

    /// A new connection was opened, or failed to open.
    fn spend_new(&mut self) {
        self.new = self.new.saturating_sub(1);
    }
}

fn connect_refusal(e: &ConnectError) -> Refusal {
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
    preserve_host: bool,
) -> Result<Response<PooledBody>, Refusal> {
    let mut last = Refusal::Upstream("no target");
    let mut head = Vec::with_capacity(512);
    let mut encoded_for: Option<usize> = None;
    let mut fresh_failures = 0;
    let mut tries = Tries::new(up);
    while tries.next() {
        let Some((key, target)) = up.pick() else {
            break;
        };
        if encoded_for != Some(key) {
            if !preserve_host {
                headers.insert(header::HOST, target.host.clone());
            }
            h1::encode_head(method, pq.as_str(), &headers, &mut head);
            encoded_for = Some(key);
        }
        let (conn, reused) = match target.raw.checkout() {
            Some(c) => (c, true),
            None => match target.raw.connect().await {
                Ok(c) => (c, false),
                Err(e) => {
                    tracing::debug!(upstream = %up.cfg.name, error = %e, "connect failed");
                    last = connect_refusal(&e);
                    tries.spend_new();
                    continue;
                }
            },
        };
        if !reused {
            tries.spend_new();
        }
        match tokio::time::timeout(up.cfg.response_timeout, conn.exchange(&head, method)).await {
            Err(_) => return Err(Refusal::UpstreamTimeout),
            Ok(Ok((h, body))) => {
                let mut resp = Response::new(PooledBody::raw(body.with_pool(target.raw.clone())));
                *resp.status_mut() = h.status;
                *resp.headers_mut() = h.headers;
                headers::rewrite_response(resp.headers_mut());
                return Ok(resp);
            }
            Ok(Err(h1::H1Error::Closed(e))) => {
                tracing::debug!(upstream = %up.cfg.name, reused, error = %e, "connection closed under the request");
                last = Refusal::Upstream("connection reset or closed");
                // A kept-alive connection closed by the backend while idle is replayed; a
                // new connection that fails moves on to another target, never the same one.
                if !reused {
                    fresh_failures += 1;
                    if fresh_failures >= up.targets.len() {
                        break;
                    }
                }
            }
            Ok(Err(h1::H1Error::Malformed)) => {
                return Err(Refusal::Upstream("malformed response"));
            }
        }
    }
    Err(last)
}

/// A copy of a body-less request, for a replay.
fn clone_head(r: &Request<UpBody>) -> Request<UpBody> {
    let mut c = Request::new(Either::Right(Empty::new()));
    *c.method_mut() = r.method().clone();
    *c.uri_mut() = r.uri().clone();
    *c.version_mut() = r.version();
    *c.headers_mut() = r.headers().clone();
    c
}
