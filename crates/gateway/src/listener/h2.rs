//! HTTP/2 streams served inside their connection's task.
//!
//! hyper hands each accepted HTTP/2 stream to an executor; with tokio's, every stream is a
//! task of its own, and each stream's answer wakes the connection task to write it: one
//! spawn, one wake-up and often one write (and TLS record) per request. [`Streams`] is an
//! executor that keeps a connection's streams in the connection's own task instead, and
//! [`WithStreams`] polls them there: the streams that are ready answer first, then the
//! connection writes all their answers at once. This is how HAProxy and nginx serve a
//! connection's streams. One connection's streams share one core, as they do there.
//!
//! [`WithStreams`] also closes a connection that has had no stream for the listener's
//! `header_timeout` (GOAWAY, then the close), as an idle HTTP/1.1 keep-alive connection is
//! closed: hyper's HTTP/2 server has no idle timeout of its own.

use super::stream_stall::{Guarded, Progress};
use futures_util::stream::{FuturesUnordered, StreamExt};
use parking_lot::Mutex;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;
use tokio::time::{Instant, Sleep};

/// A stream's future, as hyper gives it.
type StreamFuture = Pin<Box<dyn Future<Output = ()> + Send>>;

/// The executor of one HTTP/2 connection: the streams it is given wait here until the
/// connection's [`WithStreams`] takes them into its own task. Each stream is
/// [`Guarded`] against a client that gives it no window for `send_timeout`.
#[derive(Clone)]
pub struct Streams(Arc<Inbox>);

struct Inbox {
    /// The listener's `send_timeout`.
    send_timeout: Duration,
    /// The progress of the stream whose service was called last: hyper calls the service,
    /// then gives the stream's future to [`Streams`], so the two meet here.
    next: Mutex<Option<Arc<Progress>>>,
    /// Streams given and not yet taken.
    new: Mutex<Vec<StreamFuture>>,
    /// The connection's task, woken when a stream is given from outside its poll.
    waker: Mutex<Option<Waker>>,
    /// Set while [`WithStreams`] polls: streams given then are taken before the poll ends,
    /// and waking the task would only poll it once more for nothing.
    polling: AtomicBool,
}

impl Streams {
    /// An executor whose streams are reset after waiting on the client for `send_timeout`.
    pub fn new(send_timeout: Duration) -> Self {
        Streams(Arc::new(Inbox {
            send_timeout,
            next: Mutex::new(None),
            new: Mutex::default(),
            waker: Mutex::default(),
            polling: AtomicBool::new(false),
        }))
    }

    /// The progress of the stream whose service is being called, for its response body
    /// ([`super::stream_stall::Watched`]); the stream's future, given next, watches it.
    pub fn next_progress(&self) -> Arc<Progress> {
        let progress = Arc::new(Progress::default());
        *self.0.next.lock() = Some(progress.clone());
        progress
    }
}

impl<F> hyper::rt::Executor<F> for Streams
where
    F: Future<Output = ()> + Send + 'static,
{
    fn execute(&self, fut: F) {
        let progress = self.0.next.lock().take().unwrap_or_default();
        let fut = Guarded::new(fut, progress, self.0.send_timeout);
        self.0.new.lock().push(Box::pin(fut));
        // hyper gives streams while the connection is polled, i.e. from the task that
        // takes them; the wake-up is for any other caller.
        if !self.0.polling.load(Ordering::Relaxed) {
            if let Some(w) = self.0.waker.lock().as_ref() {
                w.wake_by_ref();
            }
        }
    }
}

pin_project_lite::pin_project! {
    /// One HTTP/2 connection and its streams, in one future: ready with the connection's
    /// result once the connection has ended and its last stream is done.
    pub struct WithStreams<F, E> {
        #[pin]
        conn: F,
        // The connection's result, once it has ended (it is not polled after).
        ended: Option<Result<(), E>>,
        streams: FuturesUnordered<StreamFuture>,
        inbox: Streams,
        // Swapped with the inbox's list, so that neither is allocated again.
        taken: Vec<StreamFuture>,
        registered: bool,
        // How long the connection may stay without a stream, and since when it has been.
        idle: Duration,
        idle_since: Instant,
        // Fires at `idle_since + idle` or later; reset at most once per `idle`, never per
        // request.
        #[pin]
        timer: Sleep,
        // Closes the connection gracefully once it has been idle too long.
        close: fn(Pin<&mut F>),
        // Set once `close` was called for idleness.
        closing: bool,
    }
}

impl<F, E> WithStreams<F, E>
where
    F: Future<Output = Result<(), E>>,
{
    /// `conn`, whose builder was given `inbox` as its executor, with its streams; closed
    /// with `close` once it has had no stream for `idle`.
    pub fn new(conn: F, inbox: Streams, idle: Duration, close: fn(Pin<&mut F>)) -> Self {
        let now = Instant::now();
        WithStreams {
            conn,
            ended: None,
            streams: FuturesUnordered::new(),
            inbox,
            taken: Vec::new(),
            registered: false,
            idle,
            idle_since: now,
            timer: tokio::time::sleep_until(now + idle),
            close,
            closing: false,
        }
    }

    /// Closes the connection gracefully (with the `close` it was made with) unless it has
    /// ended.
    pub fn shutdown(self: Pin<&mut Self>) {
        let this = self.project();
        if this.ended.is_none() {
            (this.close)(this.conn);
        }
    }
}

impl<F, E> Future for WithStreams<F, E>
where
    F: Future<Output = Result<(), E>>,
{
    type Output = Result<(), E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), E>> {
        let mut this = self.project();
        if !*this.registered {
            *this.registered = true;
            *this.inbox.0.waker.lock() = Some(cx.waker().clone());
        }
        this.inbox.0.polling.store(true, Ordering::Relaxed);
        // Whether any stream ran in this poll: the idle time then starts anew.
        let mut busy = !this.streams.is_empty();
        loop {
            // The streams that can go on first: their answers queue in the connection.
            while let Poll::Ready(Some(())) = this.streams.poll_next_unpin(cx) {}
            // Then the connection: it writes what the streams queued, reads what came and
            // accepts new streams into the inbox.
            if this.ended.is_none() {
                if let Poll::Ready(r) = this.conn.as_mut().poll(cx) {
                    *this.ended = Some(r);
                }
            }
            std::mem::swap(&mut *this.inbox.0.new.lock(), this.taken);
            if this.taken.is_empty() {
                break;
            }
            busy = true;
            this.streams.extend(this.taken.drain(..));
        }
        this.inbox.0.polling.store(false, Ordering::Relaxed);
        // A stream given from elsewhere between the last look and now: poll again for it.
        if !this.inbox.0.new.lock().is_empty() {
            cx.waker().wake_by_ref();
        }
        if this.streams.is_empty() {
            if let Some(r) = this.ended.take() {
                return Poll::Ready(r);
            }
            if busy {
                *this.idle_since = Instant::now();
            }
        }
        if this.ended.is_none() && this.timer.as_mut().poll(cx).is_ready() {
            let now = Instant::now();
            let idle_until = *this.idle_since + *this.idle;
            if !this.streams.is_empty() {
                this.timer.as_mut().reset(now + *this.idle);
            } else if idle_until > now {
                this.timer.as_mut().reset(idle_until);
            } else if !*this.closing {
                // Idle too long: GOAWAY; hyper closes once the client has answered its PING.
                *this.closing = true;
                (this.close)(this.conn.as_mut());
                this.timer.as_mut().reset(now + *this.idle);
                cx.waker().wake_by_ref();
            } else {
                // Still open, and idle, a whole period after the GOAWAY: the client never
                // answered. Dropping the connection closes it.
                return Poll::Ready(Ok(()));
            }
            // Registers the waker for the new deadline.
            let _ = this.timer.poll(cx);
        }
        Poll::Pending
    }
}
