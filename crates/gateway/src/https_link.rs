//! How the gateway's own outbound HTTP(S) links open (a trace collector's OTLP/HTTP, an
//! issuer's keys): hyper's client over rustls with ring and the system's roots, `http://`
//! or `https://`, HTTP/1.1.

use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use std::sync::Arc;

/// A client over `http` (its timeouts and options set by the caller) that also speaks TLS.
pub fn client<B>(
    mut http: HttpConnector,
) -> std::io::Result<Client<HttpsConnector<HttpConnector>, B>>
where
    B: http_body::Body + Send + 'static,
    B::Data: Send,
{
    http.enforce_http(false);
    let connector = hyper_rustls::HttpsConnectorBuilder::new()
        .with_provider_and_native_roots(Arc::new(rustls::crypto::ring::default_provider()))?
        .https_or_http()
        .enable_http1()
        .wrap_connector(http);
    Ok(Client::builder(hyper_util::rt::TokioExecutor::new()).build(connector))
}
