//! nginx's `send_timeout`: a client that takes nothing of what is written to it for the
//! listener's `send_timeout` is closed. Without it, a client that stops reading holds its
//! connection, and through back-pressure the upstream connection that feeds it, for ever.
//! The time counts between two writes that make progress, not over the whole answer.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

pin_project_lite::pin_project! {
    /// A client connection whose writes may wait at most `timeout` for the client to read.
    /// Costs a branch per write until a write first has to wait; then one timer, kept.
    pub struct SendTimeout<S> {
        #[pin]
        io: S,
        timeout: Duration,
        sleep: Option<Pin<Box<Sleep>>>,
        // Whether the last write waited (its wait started when the timer was last reset).
        waiting: bool,
    }
}

impl<S> SendTimeout<S> {
    /// Wraps `io`.
    pub fn new(io: S, timeout: Duration) -> Self {
        SendTimeout {
            io,
            timeout,
            sleep: None,
            waiting: false,
        }
    }
}

/// What a write that made progress (`Ready`) or has to wait (`Pending`) returns, once the
/// wait is timed.
fn timed<T>(
    r: Poll<io::Result<T>>,
    timeout: Duration,
    sleep: &mut Option<Pin<Box<Sleep>>>,
    waiting: &mut bool,
    cx: &mut Context<'_>,
) -> Poll<io::Result<T>> {
    if r.is_ready() {
        *waiting = false;
        return r;
    }
    let sleep = sleep.get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
    if !*waiting {
        *waiting = true;
        sleep.as_mut().reset(Instant::now() + timeout);
    }
    match sleep.as_mut().poll(cx) {
        Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "the client took nothing for send_timeout",
        ))),
        Poll::Pending => Poll::Pending,
    }
}

impl<S: AsyncRead> AsyncRead for SendTimeout<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        self.project().io.poll_read(cx, buf)
    }
}

impl<S: AsyncWrite> AsyncWrite for SendTimeout<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.project();
        let r = this.io.poll_write(cx, buf);
        timed(r, *this.timeout, this.sleep, this.waiting, cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.project();
        let r = this.io.poll_write_vectored(cx, bufs);
        timed(r, *this.timeout, this.sleep, this.waiting, cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.project();
        let r = this.io.poll_flush(cx);
        timed(r, *this.timeout, this.sleep, this.waiting, cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.project();
        let r = this.io.poll_shutdown(cx);
        timed(r, *this.timeout, this.sleep, this.waiting, cx)
    }
}
