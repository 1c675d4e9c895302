//! HTTP/2 streams served inside their connection's task.
//!
//! hyper hands each accepted HTTP/2 stream to an executor; with tokio's, every stream is a
//! task of its own, and each stream's answer wakes the connection task to write it: one
//! spawn, one wake-up and often one write (and TLS record) per request. [`Streams`] is an
//! executor that keeps a connection's streams in the connection's own task instead, and
//! [`Drive`] polls them there: the streams that are ready answer first, then the connection
//! writes all their answers at once. This is how HAProxy and nginx serve a connection's
//! streams. One connection's streams share one core, as they do there.

use futures_util::stream::{FuturesUnordered, StreamExt};
use parking_lot::Mutex;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

/// A stream's future, as hyper gives it.
type StreamFuture = Pin<Box<dyn Future<Output = ()> + Send>>;

/// The executor of one HTTP/2 connection: the streams it is given wait here until the
/// connection's [`Drive`] takes them into its own task.
#[derive(Clone, Default)]
pub struct Streams(Arc<Inbox>);

#[derive(Default)]
struct Inbox {
    /// Streams given and not yet taken.
    new: Mutex<Vec<StreamFuture>>,
    /// The connection's task, woken when a stream is given from outside its poll.
    waker: Mutex<Option<Waker>>,
    /// Set while [`Drive`] polls: streams given then are taken before the poll ends, and
    /// waking the task would only poll it once more for nothing.
    polling: AtomicBool,
}

impl<F> hyper::rt::Executor<F> for Streams
where
    F: Future<Output = ()> + Send + 'static,
{
    fn execute(&self, fut: F) {
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
    /// One HTTP/2 connection and its streams, run to the end in one task: ended when the
    /// connection has ended and its last stream is done. Once the server stops, the
    /// connection is asked to close gracefully (answer the streams it has, then GOAWAY).
    pub struct Drive<F, S, D> {
        #[pin]
        conn: F,
        conn_done: bool,
        streams: FuturesUnordered<StreamFuture>,
        inbox: Streams,
        // Swapped with the inbox's list, so that neither is allocated again.
        taken: Vec<StreamFuture>,
        #[pin]
        stopped: tokio::sync::futures::OwnedNotified,
        flag: Arc<AtomicBool>,
        registered: bool,
        shutdown: Option<S>,
        done: Option<D>,
    }
}

impl<F, S, D> Drive<F, S, D> {
    /// Drives `conn`, whose builder was given `inbox` as its executor; `done` gets the
    /// connection's result, `shutdown` is called once when `stop` fires.
    pub fn new<E>(conn: F, inbox: Streams, stop: super::conn::Stop, shutdown: S, done: D) -> Self
    where
        F: Future<Output = Result<(), E>>,
        S: FnOnce(Pin<&mut F>),
        D: FnOnce(Result<(), E>),
    {
        Drive {
            conn,
            conn_done: false,
            streams: FuturesUnordered::new(),
            inbox,
            taken: Vec::new(),
            stopped: stop.notify.notified_owned(),
            flag: stop.flag,
            registered: false,
            shutdown: Some(shutdown),
            done: Some(done),
        }
    }
}

impl<F, E, S, D> Future for Drive<F, S, D>
where
    F: Future<Output = Result<(), E>>,
    S: FnOnce(Pin<&mut F>),
    D: FnOnce(Result<(), E>),
{
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let mut this = self.project();
        if !*this.registered {
            *this.registered = true;
            let _ = this.stopped.as_mut().poll(cx);
            *this.inbox.0.waker.lock() = Some(cx.waker().clone());
        }
        if this.flag.load(Ordering::Acquire) {
            if let Some(f) = this.shutdown.take() {
                if !*this.conn_done {
                    f(this.conn.as_mut());
                }
            }
        }
        this.inbox.0.polling.store(true, Ordering::Relaxed);
        loop {
            // The streams that can go on first: their answers queue in the connection.
            while let Poll::Ready(Some(())) = this.streams.poll_next_unpin(cx) {}
            // Then the connection: it writes what the streams queued, reads what came and
            // accepts new streams into the inbox.
            if !*this.conn_done {
                if let Poll::Ready(r) = this.conn.as_mut().poll(cx) {
                    *this.conn_done = true;
                    if let Some(d) = this.done.take() {
                        d(r);
                    }
                }
            }
            std::mem::swap(&mut *this.inbox.0.new.lock(), this.taken);
            if this.taken.is_empty() {
                break;
            }
            this.streams.extend(this.taken.drain(..));
        }
        this.inbox.0.polling.store(false, Ordering::Relaxed);
        // A stream given from elsewhere between the last look and now: poll again for it.
        if !this.inbox.0.new.lock().is_empty() {
            cx.waker().wake_by_ref();
        }
        if *this.conn_done && this.streams.is_empty() {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }
}
