//! Upstreams: a keep-alive pool per upstream, round-robin over its targets, header
//! rewriting for the hop, timeouts, and retries only when they are safe.
//!
//! Retries: a request with no body is replayable. A connect failure moves it to the next
//! target (nothing was sent). A pooled connection that the backend closed while idle is
//! caught by the pool before the request is written, and the pool retries on a new one;
//! when the close races the write instead, an idempotent replayable request (GET, HEAD,
//! OPTIONS, PUT, DELETE, TRACE) is sent once more on a new connection. A non-idempotent
//! request is never sent twice.

use crate::response::Refusal;
use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::request::Parts;
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{Method, Request, Response, Uri, Version};
use http_body_util::{Either, Empty, Limited};
use hyper::body::{Body as _, Incoming};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use std::error::Error as StdError;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use tollgate_config::UpstreamConfig;

/// Body sent upstream: the client's, streamed and capped, or none (then replayable).
pub type UpBody = Either<Limited<Incoming>, Empty<Bytes>>;

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
const KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");
const PROXY_CONNECTION: HeaderName = HeaderName::from_static("proxy-connection");

/// One upstream: its settings, pool and round-robin position.
#[derive(Debug)]
pub struct Upstream {
    /// Settings it was built from (pools are shared across reloads while they are unchanged).
    pub cfg: UpstreamConfig,
    client: Client<HttpConnector, UpBody>,
    targets: Vec<Authority>,
    next: AtomicUsize,
}

impl Upstream {
    /// A pool for `cfg`. Targets were validated as `host:port`.
    pub fn new(cfg: UpstreamConfig) -> Self {
        let mut conn = HttpConnector::new();
        conn.set_nodelay(true);
        conn.set_connect_timeout(Some(cfg.connect_timeout));
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(cfg.idle_timeout)
            .pool_max_idle_per_host(cfg.pool_max_idle)
            .pool_timer(TokioTimer::new())
            .timer(TokioTimer::new())
            .retry_canceled_requests(true)
            .build(conn);
        let targets = cfg
            .targets
            .iter()
            .filter_map(|t| t.parse::<Authority>().ok())
            .collect();
        Upstream {
            cfg,
            client,
            targets,
            next: AtomicUsize::new(0),
        }
    }

    fn pick(&self) -> Option<&Authority> {
        if self.targets.is_empty() {
            return None;
        }
        let i = self.next.fetch_add(1, Ordering::Relaxed);
        self.targets.get(i % self.targets.len())
    }
}

/// How to rewrite a request for its hop upstream.
pub struct Hop<'a> {
    /// The client's address, appended to `X-Forwarded-For`.
    pub peer: SocketAddr,
    /// Prefix to remove from the path, if the route strips one.
    pub strip_prefix: Option<&'a str>,
    /// Keep the client's `Host`.
    pub preserve_host: bool,
    /// Largest body accepted.
    pub max_body: u64,
}

/// Removes the hop-by-hop headers (RFC 9110 §7.6.1), including those named in `Connection`.
pub fn strip_hop_headers(h: &mut HeaderMap) {
    if let Some(conn) = h.get(header::CONNECTION).cloned() {
        if let Ok(list) = conn.to_str() {
            for name in list.split(',') {
                let name = name.trim();
                if !name.is_empty() {
                    h.remove(name);
                }
            }
        }
    }
    for name in [
        header::CONNECTION,
        KEEP_ALIVE,
        PROXY_CONNECTION,
        header::TE,
        header::TRAILER,
        header::TRANSFER_ENCODING,
        header::UPGRADE,
    ] {
        h.remove(name);
    }
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
    let path = if rest.starts_with('/') {
        rest.to_string()
    } else {
        format!("/{rest}")
    };
    let s = match pq.query() {
        Some(q) => format!("{path}?{q}"),
        None => path,
    };
    PathAndQuery::try_from(s).unwrap_or(pq)
}

/// Rewrites headers for the hop: hop-by-hop removed, `X-Forwarded-*` set, `Host` left to
/// the target unless preserved.
fn rewrite_headers(h: &mut HeaderMap, hop: &Hop<'_>) {
    strip_hop_headers(h);
    let host = h.get(header::HOST).cloned();
    if !hop.preserve_host {
        h.remove(header::HOST);
    }
    if let Some(host) = host {
        h.insert(X_FORWARDED_HOST, host);
    }
    let ip = hop.peer.ip().to_string();
    let xff = match h.get(&X_FORWARDED_FOR).and_then(|v| v.to_str().ok()) {
        Some(prev) => HeaderValue::from_str(&format!("{prev}, {ip}")),
        None => HeaderValue::from_str(&ip),
    };
    if let Ok(v) = xff {
        h.insert(X_FORWARDED_FOR, v);
    }
    h.insert(X_FORWARDED_PROTO, HeaderValue::from_static("http"));
}

enum Failure {
    /// Nothing reached the backend; any request with no body may go elsewhere.
    Connect { timeout: bool },
    /// The connection closed or reset around the write; only idempotent requests may be
    /// replayed.
    Stale,
    /// The client's body was larger than allowed.
    TooLarge,
    /// Anything else: the backend broke the exchange.
    Other,
}

fn classify(e: &hyper_util::client::legacy::Error) -> Failure {
    let mut src: Option<&(dyn StdError + 'static)> = e.source();
    let mut timeout = false;
    while let Some(s) = src {
        if s.is::<http_body_util::LengthLimitError>() {
            return Failure::TooLarge;
        }
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            use std::io::ErrorKind::*;
            timeout |= io.kind() == TimedOut;
            // A backend that closes a kept-alive connection with our request unread
            // resets it; on a connection that was never established this is a connect error.
            if !e.is_connect() && matches!(io.kind(), ConnectionReset | BrokenPipe | UnexpectedEof)
            {
                return Failure::Stale;
            }
        }
        if let Some(h) = s.downcast_ref::<hyper::Error>() {
            if h.is_incomplete_message() || h.is_canceled() {
                return Failure::Stale;
            }
        }
        src = s.source();
    }
    if e.is_connect() {
        return Failure::Connect { timeout };
    }
    Failure::Other
}

/// Sends the request to `up` and returns its response head with the body streaming.
pub async fn forward(
    up: &Upstream,
    parts: Parts,
    body: Incoming,
    hop: Hop<'_>,
) -> Result<Response<Incoming>, Refusal> {
    let Parts {
        method,
        uri,
        mut headers,
        ..
    } = parts;
    rewrite_headers(&mut headers, &hop);
    let pq = path_and_query(&uri, hop.strip_prefix);

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
    let attempts = if replayable { up.targets.len() + 1 } else { 1 };

    let mut last = Refusal::Upstream("no target");
    for attempt in 0..attempts {
        let Some(target) = up.pick() else { break };
        let uri = Uri::from_parts({
            let mut p = http::uri::Parts::default();
            p.scheme = Some(Scheme::HTTP);
            p.authority = Some(target.clone());
            p.path_and_query = Some(pq.clone());
            p
        })
        .map_err(|_| Refusal::BadRequest("cannot build the upstream URI"))?;
        let this_body = match body.take() {
            Some(b) => b,
            None => Either::Right(Empty::new()),
        };
        let mut req = Request::new(this_body);
        *req.method_mut() = method.clone();
        *req.uri_mut() = uri;
        *req.version_mut() = Version::HTTP_11;
        *req.headers_mut() = if attempt + 1 < attempts {
            headers.clone()
        } else {
            std::mem::take(&mut headers)
        };

        let sent = tokio::time::timeout(up.cfg.response_timeout, up.client.request(req)).await;
        let err = match sent {
            Ok(Ok(mut resp)) => {
                strip_hop_headers(resp.headers_mut());
                return Ok(resp);
            }
            Ok(Err(e)) => e,
            Err(_) => return Err(Refusal::UpstreamTimeout),
        };
        match classify(&err) {
            Failure::TooLarge => return Err(Refusal::PayloadTooLarge),
            Failure::Connect { timeout } => {
                tracing::debug!(upstream = %up.cfg.name, %target, error = %err, "connect failed");
                last = if timeout {
                    Refusal::UpstreamTimeout
                } else {
                    Refusal::Upstream("connection refused")
                };
                if !replayable {
                    return Err(last);
                }
            }
            Failure::Stale if replayable && is_idempotent(&method) => {
                tracing::debug!(upstream = %up.cfg.name, %target, error = %err, "connection closed under the request; replaying");
                last = Refusal::Upstream("connection closed");
            }
            Failure::Stale | Failure::Other => {
                tracing::debug!(upstream = %up.cfg.name, %target, error = %err, "upstream failed");
                return Err(Refusal::Upstream("connection reset or closed"));
            }
        }
    }
    Err(last)
}
