//! The upstream client for what the lean HTTP/1.1 client does not speak: `https://`
//! targets (certificates verified against the system's roots or `ca_file`, SNI from the
//! host), HTTP/2 (`protocol: h2`: ALPN over TLS, prior knowledge in cleartext, trailers
//! kept for gRPC), and upgraded connections (WebSocket). hyper-util's pooled client over
//! hyper-rustls's connector.

use super::body::UpBody;
use super::dial::ConnectError;
use http::uri::{Authority, Scheme};
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use rustls::crypto::ring::default_provider;
use std::sync::{Arc, OnceLock};
use tollgate_config::{UpstreamConfig, UpstreamProtocol};

/// A pooled client for one upstream's targets.
#[derive(Clone, Debug)]
pub struct AltClient {
    client: Client<HttpsConnector<HttpConnector>, UpBody>,
    scheme: Scheme,
    h2: bool,
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
        let connector = if h2 {
            b.enable_http2().wrap_connector(http)
        } else {
            b.enable_http1().wrap_connector(http)
        };
        let mut builder = Client::builder(TokioExecutor::new());
        builder
            .timer(TokioTimer::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(cfg.idle_timeout)
            .pool_max_idle_per_host(cfg.pool_max_idle)
            .http2_only(h2);
        Ok(AltClient {
            client: builder.build(connector),
            scheme: if cfg.tls { Scheme::HTTPS } else { Scheme::HTTP },
            h2,
        })
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

    /// Sends `req` (absolute URI) and returns the response head.
    pub async fn send(
        &self,
        req: http::Request<UpBody>,
    ) -> Result<http::Response<hyper::body::Incoming>, hyper_util::client::legacy::Error> {
        self.client.request(req).await
    }
}

/// Forwards a request on the upstream's [`AltClient`]. A request whose body can be sent
/// again (none, or read whole) moves on to the next target when a connection cannot be
/// opened; the client itself replays requests a pooled connection closed under.
pub(super) async fn forward(
    up: &super::Upstream,
    alt: &AltClient,
    method: http::Method,
    pq: http::uri::PathAndQuery,
    mut headers: http::HeaderMap,
    body: Option<crate::listener::RequestBody>,
    hop: &super::Hop<'_>,
) -> Result<http::Response<super::PooledBody>, crate::exchange::Refusal> {
    use super::body::{receive, Received};
    use crate::exchange::Refusal;
    use http::header;
    use hyper::body::Body as _;

    super::body::check_declared(&headers, hop.max_body)?;
    // A whole body stays counted as held (HTTP/2's `max_request_buffer`) until this
    // function is done with it.
    let (mut streaming, whole, _held) = match body {
        Some(b) if !b.is_end_stream() => {
            match receive(b, hop.max_body, hop.body_timeout, hop.stream_body).await? {
                Received::Whole(chunks, held) => (None, Some(chunks), held),
                Received::Streaming(b, _) => (Some(b), None, Default::default()),
            }
        }
        _ => (None, Some(Vec::new()), Default::default()),
    };
    let h2 = alt.client_h2();
    if h2 {
        // gRPC servers want to know trailers are welcome; TE is hop-by-hop, so say it anew.
        let grpc = headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("application/grpc"));
        if grpc {
            headers.insert(header::TE, http::HeaderValue::from_static("trailers"));
        }
    }
    let client_host = headers.get(header::HOST).cloned();
    let mut last = Refusal::Upstream("no target");
    for attempt in 0..up.targets.len().max(1) {
        let target = match up.pick(attempt > 0) {
            Ok((_, t)) => t,
            Err(none) => {
                last = none.unwrap_or(last);
                break;
            }
        };
        let body = match (&whole, streaming.take()) {
            (Some(chunks), _) => UpBody::whole(chunks),
            (None, Some(b)) => b,
            (None, None) => break,
        };
        let authority = if hop.preserve_host {
            client_host
                .as_ref()
                .and_then(|h| h.to_str().ok())
                .unwrap_or(&target.name)
        } else {
            &target.name
        };
        let Some(uri) = alt.uri(authority, &pq) else {
            return Err(Refusal::BadRequest("invalid request target"));
        };
        let mut req = http::Request::new(body);
        *req.method_mut() = method.clone();
        *req.uri_mut() = uri;
        let mut h = headers.clone();
        if h2 {
            // HTTP/2 names the host in `:authority`.
            h.remove(header::HOST);
        } else if !hop.preserve_host {
            h.insert(header::HOST, target.host.clone());
        }
        *req.headers_mut() = h;
        match tokio::time::timeout(up.cfg.response_timeout, alt.send(req)).await {
            Err(_) => {
                up.outcome(target, false);
                super::log_failure(up, hop.route, target, &Refusal::UpstreamTimeout);
                return Err(Refusal::UpstreamTimeout);
            }
            Ok(Ok(resp)) if resp.status() == http::StatusCode::SWITCHING_PROTOCOLS => {
                return Err(super::unasked_switch(up, hop.route, target));
            }
            Ok(Ok(mut resp)) => {
                up.outcome(target, !resp.status().is_server_error());
                super::headers::rewrite_response(resp.headers_mut());
                if let Some(n) = hop.note_target {
                    let _ = n.set(target.name.clone());
                }
                let read_timeout = up.cfg.read_timeout;
                return Ok(resp.map(|b| super::PooledBody::plain(b, read_timeout)));
            }
            Ok(Err(e)) => {
                up.outcome(target, false);
                tracing::debug!(upstream = %up.cfg.name, target = %target.name, error = ?e, "request failed");
                if e.is_connect() {
                    up.stats.connect_errors.inc();
                    last = Refusal::Upstream("connection refused");
                    if whole.is_some() {
                        up.stats.retries.inc();
                        continue;
                    }
                } else {
                    last = Refusal::Upstream("connection reset or closed");
                }
                super::log_failure(up, hop.route, target, &last);
                return Err(last);
            }
        }
    }
    Err(last)
}
