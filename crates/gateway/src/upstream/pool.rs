//! A keep-alive connection pool for one upstream target, over hyper's HTTP/1 client
//! connection. Leaner than a general-purpose client: one target per pool (no keys to hash),
//! most recently used connection first (warm), and a connection goes back to the pool when
//! its response body has been read to the end.

use super::UpBody;
use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
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

struct Idle {
    tx: SendRequest<UpBody>,
    since: Instant,
}

/// The pool of one target.
pub struct Pool {
    /// `host:port` as configured.
    target: String,
    /// Resolved once when the target is an IP literal.
    addr: Option<SocketAddr>,
    idle: Mutex<Vec<Idle>>,
    max_idle: usize,
    idle_timeout: Duration,
    connect_timeout: Duration,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("target", &self.target)
            .field("idle", &self.idle.lock().len())
            .finish()
    }
}

impl Pool {
    /// A pool for `target` (`host:port`). Starts a task that closes connections idle for
    /// longer than `idle_timeout`, when a runtime is running.
    pub fn new(
        target: &str,
        max_idle: usize,
        idle_timeout: Duration,
        connect_timeout: Duration,
    ) -> Arc<Pool> {
        let pool = Arc::new(Pool {
            target: target.to_string(),
            addr: target.parse().ok(),
            idle: Mutex::new(Vec::new()),
            max_idle,
            idle_timeout,
            connect_timeout,
        });
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(reap(Arc::downgrade(&pool), idle_timeout));
        }
        pool
    }

    /// The most recently used idle connection that is still open, if any.
    pub fn checkout(&self) -> Option<SendRequest<UpBody>> {
        let mut idle = self.idle.lock();
        while let Some(i) = idle.pop() {
            if !i.tx.is_closed() && i.since.elapsed() < self.idle_timeout {
                return Some(i.tx);
            }
        }
        None
    }

    /// Returns a connection whose exchange is complete.
    pub fn checkin(&self, tx: SendRequest<UpBody>) {
        if tx.is_closed() {
            return;
        }
        let mut idle = self.idle.lock();
        if idle.len() < self.max_idle {
            idle.push(Idle {
                tx,
                since: Instant::now(),
            });
        }
    }

    /// Opens a new connection (`TCP_NODELAY`), its I/O driven by a task of its own.
    pub async fn connect(&self) -> Result<SendRequest<UpBody>, ConnectError> {
        let stream = tokio::time::timeout(self.connect_timeout, async {
            match self.addr {
                Some(a) => TcpStream::connect(a).await,
                None => TcpStream::connect(self.target.as_str()).await,
            }
        })
        .await
        .map_err(|_| ConnectError::Timeout)??;
        let _ = stream.set_nodelay(true);
        let (tx, conn) = http1::Builder::new()
            .handshake(TokioIo::new(stream))
            .await?;
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!("upstream connection ended: {e}");
            }
        });
        Ok(tx)
    }

    fn trim(&self) {
        let timeout = self.idle_timeout;
        self.idle
            .lock()
            .retain(|i| !i.tx.is_closed() && i.since.elapsed() < timeout);
    }
}

/// Closes idle connections past their time, until the pool is gone.
async fn reap(pool: Weak<Pool>, idle_timeout: Duration) {
    let every = (idle_timeout / 2).max(Duration::from_millis(500));
    loop {
        tokio::time::sleep(every).await;
        match pool.upgrade() {
            Some(p) => p.trim(),
            None => return,
        }
    }
}

/// A response body from upstream that returns its connection to the pool once read to the
/// end. Dropped early, the connection is closed instead (its state is unknown).
pub struct PooledBody {
    inner: Incoming,
    lease: Option<(SendRequest<UpBody>, Arc<Pool>)>,
}

impl PooledBody {
    pub(crate) fn new(inner: Incoming, tx: SendRequest<UpBody>, pool: Arc<Pool>) -> Self {
        PooledBody {
            inner,
            lease: Some((tx, pool)),
        }
    }

    fn release(&mut self) {
        if let Some((tx, pool)) = self.lease.take() {
            pool.checkin(tx);
        }
    }
}

impl Body for PooledBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(None) => self.release(),
            Poll::Ready(Some(Err(_))) => self.lease = None,
            _ => {
                if self.inner.is_end_stream() {
                    self.release();
                }
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for PooledBody {
    fn drop(&mut self) {
        // A body with nothing left (Content-Length: 0, HEAD, 204, 304) may never be polled.
        if self.inner.is_end_stream() {
            self.release();
        }
    }
}
