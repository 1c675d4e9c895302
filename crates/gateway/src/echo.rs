//! The built-in echo backend: answers every request with 200 and a short body over
//! keep-alive. The "Dummy API" of the benchmarks, for quick starts, tests and benchmarks.

use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_TYPE};
use http::Response;
use http_body_util::{BodyExt, Full};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use std::convert::Infallible;
use tokio::net::TcpListener;

const BODY: &[u8] = b"{\"message\":\"hello from tollgate echo\"}\n";

/// Serves the echo backend on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener) {
    let mut errors = crate::listener::AcceptErrors::default();
    loop {
        let (stream, _) = crate::listener::accept(&listener, &mut errors).await;
        tokio::spawn(async move {
            let svc = service_fn(|req: http::Request<hyper::body::Incoming>| async move {
                // Read (and drop) any request body so the connection stays usable.
                let _ = req.into_body().collect().await;
                let mut r = Response::new(Full::new(Bytes::from_static(BODY)));
                r.headers_mut()
                    .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
                Ok::<_, Infallible>(r)
            });
            let _ = http1::Builder::new()
                .keep_alive(true)
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}
