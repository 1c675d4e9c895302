//! How a client's request body can break off, whichever protocol brought it.

/// Why a request body broke off.
#[derive(Debug, thiserror::Error)]
pub enum RequestBodyError {
    /// The HTTP/1.1 connection failed or framed the body wrongly.
    #[error("request body: {0}")]
    Http1(#[from] super::h1::chunked::Broken),
    /// The HTTP/2 stream was reset or its connection ended first.
    #[error("HTTP/2 stream ended before its body: {0}")]
    Http2(&'static str),
}
