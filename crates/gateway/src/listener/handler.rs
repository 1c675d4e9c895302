//! What a listener serves: a [`Handler`] answers each request; the listener knows nothing of
//! what stands behind it (the gateway, or a test's own handler).

use super::body::RequestBody;
use crate::exchange::{ConnInfo, Parts};
use bytes::Bytes;
use http::Response;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

/// The error a handler's answer body may end with.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The request path as the listeners see it: one call per request, and a few events of the
/// connection for the handler's own counts.
pub trait Handler: Send + Sync + 'static {
    /// The answer's body.
    type Body: http_body::Body<Data = Bytes, Error: Into<BoxError>> + Send + Unpin + 'static;

    /// Answers one request (its head and body) that arrived on `conn`.
    fn serve(
        &self,
        req: Parts,
        body: RequestBody,
        conn: &Arc<ConnInfo>,
    ) -> impl Future<Output = Response<Self::Body>> + Send;

    /// The TLS config the listener at `address` serves now (certificates renew on reload).
    fn tls_for(&self, address: SocketAddr) -> Option<Arc<rustls::ServerConfig>>;

    /// A request the listener refused before its head could be read whole (framing in
    /// doubt, a head too large), with what came of its request line and whether it asked
    /// for the head alone: the handler counts and logs it as it does its own refusals. The
    /// id the answer names, if any.
    fn refused_unread(
        &self,
        _refused: super::h1::head::Refused,
        _asked_head: bool,
        _request_line: &[u8],
        _conn: &Arc<ConnInfo>,
    ) -> Option<http::HeaderValue> {
        None
    }

    /// A connection was accepted.
    fn opened(&self) {}

    /// A connection ended.
    fn closed(&self) {}

    /// A TLS handshake failed.
    fn tls_failed(&self) {}
}
