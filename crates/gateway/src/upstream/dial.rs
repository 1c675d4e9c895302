//! Opening TCP connections to one target, for both upstream clients.

use std::net::SocketAddr;
use std::time::Duration;
use tokio::net::TcpStream;

/// Why a new connection could not be made.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// Name resolution or the TCP connect failed.
    #[error("connect failed: {0}")]
    Io(#[from] std::io::Error),
    /// The connect did not finish within `connect_timeout`.
    #[error("connect timed out")]
    Timeout,
    /// The HTTP/1 handshake failed.
    #[error("handshake failed: {0}")]
    Handshake(#[from] hyper::Error),
}

/// How to reach one target.
#[derive(Debug)]
pub struct Dialer {
    /// `host:port` as configured.
    pub target: String,
    /// Parsed once when the target is an IP literal; names are resolved at each connect.
    addr: Option<SocketAddr>,
    timeout: Duration,
}

impl Dialer {
    /// A dialer for `target` (`host:port`) with a connect timeout.
    pub fn new(target: &str, timeout: Duration) -> Self {
        Dialer {
            target: target.to_string(),
            addr: target.parse().ok(),
            timeout,
        }
    }

    /// A new connection with `TCP_NODELAY`, within the connect timeout.
    pub async fn dial(&self) -> Result<TcpStream, ConnectError> {
        let stream = tokio::time::timeout(self.timeout, async {
            match self.addr {
                Some(a) => TcpStream::connect(a).await,
                None => TcpStream::connect(self.target.as_str()).await,
            }
        })
        .await
        .map_err(|_| ConnectError::Timeout)??;
        stream.set_nodelay(true)?;
        Ok(stream)
    }
}
