//! `send_timeout` for one HTTP/2 stream. A client can keep its connection busy and still
//! give one stream no flow-control window: that stream, and through back-pressure the
//! upstream connection feeding it, would wait for ever, and the connection's writes never
//! wait, so [`super::send_timeout`] does not see it. hyper stops polling a response body
//! while its stream waits for window, so the body ([`Watched`]) tells its stream's future
//! ([`Guarded`]) when it has handed a piece over; from then on every poll of the stream
//! comes from `h2` (more window, data sent, a reset) or from the future's own timer. A
//! stream that waits `send_timeout` without any is dropped, which resets it
//! (`RST_STREAM CANCEL`), as nginx's `send_timeout` does for HTTP/2 streams.

use http_body::{Body, Frame, SizeHint};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::time::{Instant, Sleep};

/// What a stream's response body tells the stream's future.
#[derive(Debug, Default)]
pub struct Progress {
    /// Whether the body's last poll handed a piece over: the stream now waits for `h2` to
    /// send it, that is for the client's window.
    handed: AtomicBool,
}

pin_project_lite::pin_project! {
    /// A response body that reports each piece it hands over to its stream's [`Guarded`].
    pub struct Watched<B> {
        #[pin]
        inner: B,
        progress: Arc<Progress>,
    }
}

impl<B> Watched<B> {
    /// `inner`, reporting to `progress`.
    pub fn new(inner: B, progress: Arc<Progress>) -> Self {
        Watched { inner, progress }
    }
}

impl<B: Body> Body for Watched<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        let this = self.project();
        let r = this.inner.poll_frame(cx);
        let handed = matches!(&r, Poll::Ready(Some(Ok(f))) if f.is_data());
        this.progress.handed.store(handed, Ordering::Relaxed);
        r
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

pin_project_lite::pin_project! {
    /// A stream's future, dropped (the stream reset) once its body has waited on the client
    /// for `timeout` with nothing from `h2` in between. The timer is made only for a stream
    /// that has to wait.
    pub struct Guarded<F> {
        #[pin]
        fut: F,
        progress: Arc<Progress>,
        timeout: Duration,
        sleep: Option<Pin<Box<Sleep>>>,
        // Whether `sleep` times the current wait.
        armed: bool,
    }
}

impl<F> Guarded<F> {
    /// `fut`, whose response body reports to `progress`.
    pub fn new(fut: F, progress: Arc<Progress>, timeout: Duration) -> Self {
        Guarded {
            fut,
            progress,
            timeout,
            sleep: None,
            armed: false,
        }
    }
}

impl<F: Future<Output = ()>> Future for Guarded<F> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.project();
        if this.fut.poll(cx).is_ready() {
            return Poll::Ready(());
        }
        if !this.progress.handed.load(Ordering::Relaxed) {
            *this.armed = false;
            return Poll::Pending;
        }
        let now = Instant::now();
        let timeout = *this.timeout;
        let sleep = this
            .sleep
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        if *this.armed && sleep.deadline() <= now {
            tracing::debug!("an HTTP/2 stream got no window for send_timeout: reset");
            return Poll::Ready(());
        }
        // Polled before the deadline: woken by `h2` (window came, data went out), or the
        // wait has just begun. Either way it starts anew.
        *this.armed = true;
        sleep.as_mut().reset(now + timeout);
        // Registers the waker for the new deadline (not reached yet).
        let _ = sleep.as_mut().poll(cx);
        Poll::Pending
    }
}
