//! The request body on its way upstream, with the client's faults told apart from the
//! upstream's: a malformed body (400), a client that stops sending for `body_timeout` (408)
//! and a body over `max_body_bytes` (413) are the client's, whatever hyper's client says.
//!
//! Bodies up to [`BUFFER`] are read whole before an upstream connection is taken (as nginx
//! buffers request bodies): a client that trickles its body pins no upstream connection,
//! and a whole body can be sent again. Larger bodies, and every body on routes with
//! `request_buffering: false`, stream as they arrive, after what was read first.

use super::gather::Gather;
use crate::exchange::{Lines, Refusal};
use crate::listener::body::Held;
use crate::listener::RequestBody;
use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::{Instant, Sleep};

/// Most of a request body read before an upstream connection is taken.
pub const BUFFER: usize = 64 * 1024;

/// A fault of the client's in sending its body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientFault {
    /// The body's framing is broken (bad chunk) or the client went away mid-body.
    Malformed,
    /// No part of the body came for `body_timeout`.
    Timeout,
    /// The body is larger than the listener allows.
    TooLarge,
}

impl ClientFault {
    /// The answer for this fault.
    pub fn refusal(self) -> Refusal {
        match self {
            ClientFault::Malformed => Refusal::BadRequest("malformed request body"),
            ClientFault::Timeout => Refusal::RequestTimeout,
            ClientFault::TooLarge => Refusal::PayloadTooLarge,
        }
    }
}

/// What the forwarding side can learn of a streaming body: whether it ended, when it last
/// moved, and the client's fault if it broke.
#[derive(Debug)]
pub struct BodyWatch {
    fault: Mutex<Option<ClientFault>>,
    moved: Mutex<Instant>,
    waiting_on_client: AtomicBool,
    done: AtomicBool,
    ended: Notify,
    /// Bytes of the body read from the client so far.
    read: AtomicU64,
}

impl BodyWatch {
    fn new() -> Arc<BodyWatch> {
        Arc::new(BodyWatch {
            fault: Mutex::new(None),
            moved: Mutex::new(Instant::now()),
            waiting_on_client: AtomicBool::new(false),
            done: AtomicBool::new(false),
            ended: Notify::new(),
            read: AtomicU64::new(0),
        })
    }

    /// Bytes of the body read from the client so far (all of them once it is finished).
    pub fn bytes_read(&self) -> u64 {
        self.read.load(Ordering::Relaxed)
    }

    /// The client's fault, if the body broke because of it.
    pub fn fault(&self) -> Option<ClientFault> {
        *self.fault.lock()
    }

    /// When the body last moved (a piece read from the client).
    pub fn last_moved(&self) -> Instant {
        *self.moved.lock()
    }

    /// Whether the body is stalled on the client (rather than on the upstream not reading).
    pub fn waiting_on_client(&self) -> bool {
        self.waiting_on_client.load(Ordering::Relaxed)
    }

    /// Resolves once the whole body has been read from the client.
    pub async fn finished(&self) {
        loop {
            let notified = self.ended.notified();
            if self.done.load(Ordering::Acquire) {
                return;
            }
            notified.await;
        }
    }

    fn finish(&self) {
        self.done.store(true, Ordering::Release);
        self.ended.notify_waiters();
    }

    fn broke(&self, fault: ClientFault) {
        *self.fault.lock() = Some(fault);
        self.finish();
    }
}

/// Bytes a body streaming upstream must bring within each `body_timeout` (unless it
/// ends): a piece alone does not restart the wait. A client trickling a byte now and then
/// would otherwise hold an upstream connection as long as it liked (1,024 of them, a
/// target's default cap, from one HTTP/2 connection's streams and a few more); at the
/// default 30 s this asks 546 B/s, as Kestrel's minimum request body rate asks 240 B/s.
/// Routes with `request_buffering: false` (streams by design: small messages now and then)
/// keep the wait per piece.
pub const PROGRESS: u64 = 16 * 1024;

/// The rest of a body still coming from the client.
struct Rest {
    incoming: RequestBody,
    /// Bytes the body may still bring before it is too large.
    allowed: u64,
    /// Bytes that restart the wait for the next ones ([`PROGRESS`], or 0: any piece).
    progress: u64,
    /// Bytes come since the wait last restarted.
    since: u64,
    timeout: Duration,
    sleep: Pin<Box<Sleep>>,
    watch: Arc<BodyWatch>,
}

/// A request body sent upstream: read whole, streaming, or none.
pub struct UpBody {
    read: VecDeque<Bytes>,
    rest: Option<Rest>,
    /// `read` counted against the client connection's budget, given back once sent.
    _held: Held,
}

/// The body error hyper's client sees; the fault itself is in [`BodyWatch`].
#[derive(Debug, thiserror::Error)]
#[error("request body: {0:?}")]
pub struct BodyFault(pub ClientFault);

impl UpBody {
    /// No body.
    pub fn empty() -> UpBody {
        UpBody {
            read: VecDeque::new(),
            rest: None,
            _held: Held::default(),
        }
    }

    /// A body read whole; can be sent again.
    pub fn whole(chunks: &[Bytes]) -> UpBody {
        UpBody {
            read: chunks.iter().filter(|c| !c.is_empty()).cloned().collect(),
            rest: None,
            _held: Held::default(),
        }
    }
}

/// A body being read from the client.
pub enum Received {
    /// All of it, in pieces, counted as held until the guard is dropped; its length.
    Whole(Vec<Bytes>, Held, u64),
    /// What came first, and the rest streaming, watched.
    Streaming(UpBody, Arc<BodyWatch>),
}

/// Refuses (413) a request whose declared `Content-Length` is larger than `max`, before
/// any of its body is read.
pub fn check_declared(headers: &impl Lines, max: u64) -> Result<(), Refusal> {
    let declared = headers
        .first("content-length")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > max) {
        return Err(Refusal::PayloadTooLarge);
    }
    Ok(())
}

/// Reads up to [`BUFFER`] bytes of the client's body (none when `stream_at_once`), each
/// piece within `timeout`. The client's faults come back as refusals.
pub async fn receive(
    mut incoming: RequestBody,
    max: u64,
    timeout: Duration,
    stream_at_once: bool,
) -> Result<Received, Refusal> {
    let whole = |len: u64, chunks: Gather, mut incoming: RequestBody| {
        Ok(Received::Whole(
            chunks.into_pieces(),
            incoming.keep_held(),
            len,
        ))
    };
    // Tiny pieces (a body chunked a byte at a time) are gathered: the buffer holds the
    // body's bytes, not a piece and its read buffer per byte.
    let mut chunks = Gather::default();
    let mut len: u64 = 0;
    if !stream_at_once {
        // Held against the connection's budget while read ahead; past the budget, the
        // rest streams as it comes.
        incoming.buffering(true);
        while len < BUFFER as u64 && incoming.may_buffer() {
            // While it waits, what the body announced (a chunk's size) counts too.
            let next = poll_fn(|cx| match Pin::new(&mut incoming).poll_frame(cx) {
                Poll::Pending if len.saturating_add(incoming.size_hint().lower()) > max => {
                    Poll::Ready(Err(Refusal::PayloadTooLarge))
                }
                p => p.map(Ok),
            });
            let frame = tokio::time::timeout(timeout, next)
                .await
                .map_err(|_| Refusal::RequestTimeout)??;
            match frame {
                None => return whole(len, chunks, incoming),
                Some(Err(_)) => return Err(ClientFault::Malformed.refusal()),
                Some(Ok(f)) => {
                    if let Ok(data) = f.into_data() {
                        len += data.len() as u64;
                        // What the body announced (a chunk's size) counts before it comes.
                        if len.saturating_add(incoming.size_hint().lower()) > max {
                            return Err(Refusal::PayloadTooLarge);
                        }
                        chunks.push(data);
                    }
                }
            }
            if incoming.is_end_stream() {
                return whole(len, chunks, incoming);
            }
        }
    }
    let held = incoming.keep_held();
    let watch = BodyWatch::new();
    watch.read.store(len, Ordering::Relaxed);
    let rest = Rest {
        incoming,
        allowed: max - len,
        progress: if stream_at_once { 0 } else { PROGRESS },
        since: 0,
        timeout,
        sleep: Box::pin(tokio::time::sleep(timeout)),
        watch: watch.clone(),
    };
    Ok(Received::Streaming(
        UpBody {
            read: chunks.into_pieces().into(),
            rest: Some(rest),
            _held: held,
        },
        watch,
    ))
}

impl Body for UpBody {
    type Data = Bytes;
    type Error = BodyFault;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyFault>>> {
        if let Some(b) = self.read.pop_front() {
            if self.read.is_empty() {
                // What was read ahead is on its way: no longer held here.
                self._held = Held::default();
            }
            return Poll::Ready(Some(Ok(Frame::data(b))));
        }
        let Some(rest) = self.rest.as_mut() else {
            return Poll::Ready(None);
        };
        let fault = match Pin::new(&mut rest.incoming).poll_frame(cx) {
            Poll::Ready(None) => {
                rest.watch.finish();
                self.rest = None;
                return Poll::Ready(None);
            }
            Poll::Ready(Some(Ok(frame))) => {
                rest.watch.waiting_on_client.store(false, Ordering::Relaxed);
                let n = frame.data_ref().map_or(0, |d| d.len() as u64);
                rest.since = rest.since.saturating_add(n);
                if rest.since >= rest.progress {
                    rest.since = 0;
                    let now = Instant::now();
                    *rest.watch.moved.lock() = now;
                    rest.sleep.as_mut().reset(now + rest.timeout);
                }
                if n.saturating_add(rest.incoming.size_hint().lower()) > rest.allowed {
                    ClientFault::TooLarge
                } else if frame.is_trailers() {
                    // Trailers end the body, and the client's are not sent on (as on the
                    // lean client): the gateway's rules on headers (owned names, identity)
                    // read the head alone, and an upstream that merges trailers into
                    // headers would trust forged ones.
                    rest.watch.finish();
                    self.rest = None;
                    return Poll::Ready(None);
                } else {
                    rest.allowed -= n;
                    rest.watch.read.fetch_add(n, Ordering::Relaxed);
                    if rest.incoming.is_end_stream() {
                        rest.watch.finish();
                    }
                    return Poll::Ready(Some(Ok(frame)));
                }
            }
            Poll::Ready(Some(Err(_))) => ClientFault::Malformed,
            Poll::Pending if rest.incoming.size_hint().lower() > rest.allowed => {
                ClientFault::TooLarge
            }
            Poll::Pending => {
                rest.watch.waiting_on_client.store(true, Ordering::Relaxed);
                match rest.sleep.as_mut().poll(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(()) => ClientFault::Timeout,
                }
            }
        };
        rest.watch.broke(fault);
        self.rest = None;
        Poll::Ready(Some(Err(BodyFault(fault))))
    }

    fn is_end_stream(&self) -> bool {
        self.read.is_empty() && self.rest.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        let read: u64 = self.read.iter().map(|b| b.len() as u64).sum();
        match &self.rest {
            None => SizeHint::with_exact(read),
            Some(r) => {
                let h = r.incoming.size_hint();
                let mut s = SizeHint::new();
                s.set_lower(read + h.lower());
                if let Some(u) = h.upper() {
                    s.set_upper(read + u);
                }
                s
            }
        }
    }
}
