//! Upgrades (WebSocket and the like, and `CONNECT`): a request that asks for one carries an
//! [`OnUpgrade`]; once the handler's `101` (or a `2xx` to `CONNECT`) is written, the
//! connection, with what the client sent past the request, is handed over through it.

use bytes::{Buf, Bytes};
use parking_lot::Mutex;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::oneshot;

/// A client connection as an upgrade takes it over.
pub trait Io: AsyncRead + AsyncWrite + Send + Unpin + 'static {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> Io for T {}

/// A connection handed over after an upgrade: first what was read past the request, then
/// the connection itself.
pub struct Upgraded {
    read: Bytes,
    io: Box<dyn Io>,
}

/// The connection was not handed over: the answer was no upgrade, or the connection failed
/// before the answer was written.
#[derive(Debug, thiserror::Error)]
#[error("the connection was not upgraded")]
pub struct NotUpgraded;

/// Resolves to the client's connection once the upgrade's answer is written. Shared (a
/// request's extensions must be cloneable): the first to await it gets the connection.
#[derive(Clone)]
pub struct OnUpgrade(Arc<Mutex<Option<oneshot::Receiver<Upgraded>>>>);

/// The connection's side: it hands the connection over.
pub struct Handover(oneshot::Sender<Upgraded>);

/// A pair for one request that asks for an upgrade.
pub fn pending() -> (Handover, OnUpgrade) {
    let (tx, rx) = oneshot::channel();
    (Handover(tx), OnUpgrade(Arc::new(Mutex::new(Some(rx)))))
}

impl Handover {
    /// Hands `io` over, with `read` (bytes read past the request) to be read first.
    /// Whether someone took it.
    pub fn hand_over<S: Io>(self, io: S, read: Bytes) -> bool {
        self.0
            .send(Upgraded {
                read,
                io: Box::new(io),
            })
            .is_ok()
    }
}

impl Future for OnUpgrade {
    type Output = Result<Upgraded, NotUpgraded>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut slot = self.0.lock();
        let Some(rx) = slot.as_mut() else {
            // Another clone took the connection.
            return Poll::Ready(Err(NotUpgraded));
        };
        let r = std::task::ready!(Pin::new(rx).poll(cx));
        *slot = None;
        Poll::Ready(r.map_err(|_| NotUpgraded))
    }
}

impl AsyncRead for Upgraded {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if !self.read.is_empty() {
            let k = self.read.len().min(buf.remaining());
            buf.put_slice(&self.read[..k]);
            self.read.advance(k);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for Upgraded {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}
