//! A request body arriving on an HTTP/2 stream. The connection pushes DATA into it; the
//! gateway reads it; what has been read is credited back to the client as window.

use crate::listener::body_error::RequestBodyError;
use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

/// What the connection and the body's reader share.
#[derive(Default)]
pub struct Shared {
    chunks: VecDeque<Bytes>,
    trailers: Option<HeaderMap>,
    /// The client ended the stream.
    ended: bool,
    /// The stream broke off: why.
    broken: Option<&'static str>,
    /// Bytes read (or dropped unread) and not yet credited to the client.
    released: usize,
    /// The reader is gone: what comes is released at once.
    dropped: bool,
    /// The reader has waited for data: a client that expects `100 Continue` may be told.
    waited: bool,
    waker: Option<Waker>,
    /// The connection's task: the reader may run in another task (hyper's client sending
    /// the body upstream), and the connection must learn what it read to credit it.
    conn: Option<Waker>,
}

/// Request-body bytes one connection's streams hold in the gateway before their requests
/// go upstream (`max_request_buffer`): what the readers read while buffering, until they
/// stop buffering or are dropped.
#[derive(Debug)]
pub struct Budget {
    held: AtomicUsize,
    max: usize,
}

impl Budget {
    /// A budget of `max` bytes.
    pub fn new(max: usize) -> Arc<Budget> {
        Arc::new(Budget {
            held: AtomicUsize::new(0),
            max,
        })
    }
}

/// The connection's side of a request body.
#[derive(Clone)]
pub struct Sender(Arc<Mutex<Shared>>);

impl Sender {
    /// A sender and the body it feeds; `length` is the declared `Content-Length`, `budget`
    /// the connection's.
    pub fn pair(length: Option<u64>, budget: Arc<Budget>) -> (Sender, RecvBody) {
        let shared = Arc::new(Mutex::new(Shared::default()));
        (
            Sender(shared.clone()),
            RecvBody {
                shared,
                length,
                done: false,
                budget,
                buffering: false,
                held: 0,
            },
        )
    }

    /// Hands a piece of DATA over; false when the reader is gone (credit it at once).
    pub fn push(&self, data: Bytes) -> bool {
        let mut s = self.0.lock();
        if s.dropped {
            return false;
        }
        if !data.is_empty() {
            s.chunks.push_back(data);
        }
        if let Some(w) = s.waker.take() {
            w.wake();
        }
        true
    }

    /// The client ended the stream, with trailers or without.
    pub fn end(&self, trailers: Option<HeaderMap>) {
        let mut s = self.0.lock();
        s.ended = true;
        s.trailers = trailers;
        if let Some(w) = s.waker.take() {
            w.wake();
        }
    }

    /// The stream broke off (reset, protocol error, connection gone).
    pub fn break_off(&self, why: &'static str) {
        let mut s = self.0.lock();
        if !s.ended {
            s.broken = Some(why);
        }
        if let Some(w) = s.waker.take() {
            w.wake();
        }
    }

    /// Takes the bytes read since the last call, whether the reader is gone and whether
    /// it has waited for data; `conn` is woken when it reads or waits next.
    pub fn take_released(&self, conn: &Waker) -> (usize, bool, bool) {
        let mut s = self.0.lock();
        if !s.conn.as_ref().is_some_and(|w| w.will_wake(conn)) {
            s.conn = Some(conn.clone());
        }
        (std::mem::take(&mut s.released), s.dropped, s.waited)
    }
}

/// The body of a request on an HTTP/2 stream.
pub struct RecvBody {
    shared: Arc<Mutex<Shared>>,
    length: Option<u64>,
    done: bool,
    /// The connection's budget for bytes held before going upstream.
    budget: Arc<Budget>,
    /// What is read now is held (see [`RecvBody::buffering`]).
    buffering: bool,
    /// Bytes this body counts in the budget.
    held: usize,
}

/// Bytes counted against a connection's budget, given back when this is dropped (with the
/// buffered pieces of a request body, once they went upstream or the request is done).
pub struct HeldBytes {
    budget: Arc<Budget>,
    n: usize,
}

impl Drop for HeldBytes {
    fn drop(&mut self) {
        self.budget.held.fetch_sub(self.n, Ordering::Relaxed);
    }
}

impl RecvBody {
    /// While on, what is read is counted as held in the gateway, against the connection's
    /// budget; turned off (or dropped), what it counted is given back.
    pub fn buffering(&mut self, on: bool) {
        self.buffering = on;
        if !on && self.held > 0 {
            self.budget.held.fetch_sub(self.held, Ordering::Relaxed);
            self.held = 0;
        }
    }

    /// Stops counting what is read, and hands over what was counted: it stays counted
    /// until the returned guard is dropped (the pieces read are still held elsewhere).
    pub fn keep_held(&mut self) -> Option<HeldBytes> {
        self.buffering = false;
        let n = std::mem::take(&mut self.held);
        (n > 0).then(|| HeldBytes {
            budget: self.budget.clone(),
            n,
        })
    }

    /// Whether the connection's streams may hold more: past the budget, a body streams
    /// upstream as it comes instead of being read ahead.
    pub fn may_buffer(&self) -> bool {
        self.budget.held.load(Ordering::Relaxed) < self.budget.max
    }
}

impl Drop for RecvBody {
    fn drop(&mut self) {
        self.buffering(false);
        let mut s = self.shared.lock();
        s.dropped = true;
        let unread: usize = s.chunks.drain(..).map(|c| c.len()).sum();
        s.released += unread;
        if let Some(w) = s.conn.take() {
            w.wake();
        }
    }
}

impl Body for RecvBody {
    type Data = Bytes;
    type Error = RequestBodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, RequestBodyError>>> {
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(None);
        }
        let mut s = this.shared.lock();
        if let Some(c) = s.chunks.pop_front() {
            if this.buffering {
                this.held += c.len();
                this.budget.held.fetch_add(c.len(), Ordering::Relaxed);
            }
            if s.released == 0 {
                if let Some(w) = &s.conn {
                    w.wake_by_ref();
                }
            }
            s.released += c.len();
            if let Some(n) = this.length.as_mut() {
                *n = n.saturating_sub(c.len() as u64);
            }
            return Poll::Ready(Some(Ok(Frame::data(c))));
        }
        if let Some(why) = s.broken {
            this.done = true;
            return Poll::Ready(Some(Err(RequestBodyError::Http2(why))));
        }
        if s.ended {
            this.done = true;
            return Poll::Ready(s.trailers.take().map(|t| Ok(Frame::trailers(t))));
        }
        if !s.waited {
            s.waited = true;
            if let Some(w) = &s.conn {
                w.wake_by_ref();
            }
        }
        match &s.waker {
            Some(w) if w.will_wake(cx.waker()) => {}
            _ => s.waker = Some(cx.waker().clone()),
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        if self.done {
            return true;
        }
        let s = self.shared.lock();
        s.ended && s.chunks.is_empty() && s.trailers.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        match self.length {
            Some(n) => SizeHint::with_exact(n),
            None => SizeHint::default(),
        }
    }
}
