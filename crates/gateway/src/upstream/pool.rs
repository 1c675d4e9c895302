//! A keep-alive connection pool for one upstream target, over hyper's HTTP/1 client
//! connection. Leaner than a general-purpose client: one target per pool (no keys to hash),
//! most recently used connection first (warm), and a connection goes back to the pool when
//! its response body has been read to the end.

use super::dial::{ConnectError, Dialer};
use super::h1::H1Body;
use super::idle::{spawn_reaper, IdleList};
use super::UpBody;
use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

/// The pool of one target.
pub struct Pool {
    dialer: Dialer,
    idle: IdleList<SendRequest<UpBody>>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("target", &self.dialer.target)
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
            dialer: Dialer::new(target, connect_timeout),
            idle: IdleList::new(max_idle, idle_timeout),
        });
        spawn_reaper(Arc::downgrade(&pool), idle_timeout, |p: &Pool| {
            p.idle.trim(|tx| !tx.is_closed())
        });
        pool
    }

    /// The most recently used idle connection that is still open, if any.
    pub fn checkout(&self) -> Option<SendRequest<UpBody>> {
        self.idle.checkout(|tx| !tx.is_closed())
    }

    /// Returns a connection whose exchange is complete.
    pub fn checkin(&self, tx: SendRequest<UpBody>) {
        if !tx.is_closed() {
            self.idle.checkin(tx);
        }
    }

    /// Opens a new connection (`TCP_NODELAY`), its I/O driven by a task of its own.
    pub async fn connect(&self) -> Result<SendRequest<UpBody>, ConnectError> {
        let stream = self.dialer.dial().await?;
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
}

/// A response body from upstream that returns its connection to its pool once read to
/// the end. Dropped early, the connection is closed instead (its state is unknown).
pub struct PooledBody {
    inner: Inner,
}

enum Inner {
    /// From hyper's client connection.
    Hyper {
        body: Incoming,
        lease: Option<(SendRequest<UpBody>, Arc<Pool>)>,
    },
    /// From the lean client.
    Raw(H1Body),
}

/// Error of a response body from upstream.
pub type BodyError = Box<dyn std::error::Error + Send + Sync>;

impl PooledBody {
    /// A body from hyper's client; its connection goes back to `pool` at the end, or is
    /// closed when there is no pool to go back to.
    pub(crate) fn new(body: Incoming, tx: SendRequest<UpBody>, pool: Option<Arc<Pool>>) -> Self {
        PooledBody {
            inner: Inner::Hyper {
                body,
                lease: pool.map(|p| (tx, p)),
            },
        }
    }

    pub(crate) fn raw(body: H1Body) -> Self {
        PooledBody {
            inner: Inner::Raw(body),
        }
    }

    fn release(&mut self) {
        if let Inner::Hyper { lease, .. } = &mut self.inner {
            if let Some((tx, pool)) = lease.take() {
                pool.checkin(tx);
            }
        }
    }
}

impl Body for PooledBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        match &mut self.inner {
            Inner::Raw(body) => body
                .poll_data(cx)
                .map(|o| o.map(|r| r.map(Frame::data).map_err(BodyError::from))),
            Inner::Hyper { body, lease } => {
                let polled = Pin::new(&mut *body).poll_frame(cx);
                let end = body.is_end_stream();
                match &polled {
                    Poll::Ready(Some(Err(_))) => *lease = None,
                    Poll::Ready(None) => self.release(),
                    _ if end => self.release(),
                    _ => {}
                }
                polled.map(|o| o.map(|r| r.map_err(BodyError::from)))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.inner {
            Inner::Hyper { body, .. } => body.is_end_stream(),
            Inner::Raw(body) => body.is_done(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.inner {
            Inner::Hyper { body, .. } => body.size_hint(),
            Inner::Raw(body) => match body.remaining() {
                Some(n) => SizeHint::with_exact(n),
                None => SizeHint::default(),
            },
        }
    }
}

impl Drop for PooledBody {
    fn drop(&mut self) {
        // A body with nothing left (Content-Length: 0, HEAD, 204, 304) may never be polled.
        if let Inner::Hyper { body, .. } = &self.inner {
            if body.is_end_stream() {
                self.release();
            }
        }
    }
}
