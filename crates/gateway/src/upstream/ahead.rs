//! Reading an upstream answer ahead of its client, for the cache: the copy being stored is
//! filled at the upstream's pace, whatever the client that asked for it does (as nginx's
//! `proxy_cache_lock` fill does), so a client that stops reading stalls neither the store
//! nor the requests waiting for it.
//!
//! A task reads the upstream body into a queue the client's body reads from. While the
//! copy is being collected the queue holds at most the cache's largest object (past
//! [`ALL_QUEUED_HIGH`] for all fills together, a fill whose client lags gives its copy up,
//! so that no request waits on a client that does not read); once
//! the answer is known not to be stored (larger than that, or broken), the task reads on
//! only as fast as the client takes it, and stops when the client is gone.

use super::gather::SMALL_PIECE;
use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

/// Bytes queued for a client past which, when nothing is being stored, the task waits for
/// the client to take some.
const QUEUE_HIGH: usize = 64 * 1024;

/// Bytes queued for clients by every fill together past which a fill whose client lags
/// gives its copy up and goes at its client's pace: clients that never read cannot make
/// the gateway hold more than this (plus [`QUEUE_HIGH`] each) however many fills they lead.
const ALL_QUEUED_HIGH: usize = 64 << 20;

/// Bytes queued for clients by every fill.
static ALL_QUEUED: AtomicUsize = AtomicUsize::new(0);

/// What a queued piece costs beyond its bytes (its entry, its allocation), counted with
/// them: an upstream that sends its body a byte at a time cannot make the queue hold 40
/// times what it counts.
const PIECE_COST: usize = 64;

/// What a queued piece counts for, the same when it is queued and when it is taken.
fn cost(d: &Bytes) -> usize {
    d.len() + PIECE_COST
}

/// `d` as it is queued (a copy when small, so that it does not hold on to the whole read
/// buffer it was cut from) and what it counts for.
fn queued_piece(d: Bytes) -> (Bytes, usize) {
    let d = if d.len() < SMALL_PIECE {
        Bytes::copy_from_slice(&d)
    } else {
        d
    };
    let cost = cost(&d);
    (d, cost)
}

/// What the task and the client's body share.
#[derive(Default)]
struct Queue {
    chunks: VecDeque<Bytes>,
    trailers: Option<HeaderMap>,
    queued: usize,
    /// The upstream body ended: `Ok` at its end, `Err` when it broke off.
    end: Option<Result<(), String>>,
    /// The client's body is gone.
    reader_gone: bool,
    reader: Option<Waker>,
    filler: Option<Waker>,
}

/// The client's side of an answer read ahead.
pub struct AheadBody {
    queue: Arc<Mutex<Queue>>,
    /// Bytes still to come, when the answer said how many.
    remaining: Option<u64>,
    done: bool,
}

impl Drop for AheadBody {
    fn drop(&mut self) {
        let mut q = self.queue.lock();
        q.reader_gone = true;
        q.chunks.clear();
        ALL_QUEUED.fetch_sub(std::mem::take(&mut q.queued), Ordering::Relaxed);
        if let Some(w) = q.filler.take() {
            w.wake();
        }
    }
}

/// What the fill does next.
enum Next {
    /// Read the next piece from upstream.
    Read,
    /// Stop collecting the copy, and go on at the client's pace.
    GiveUp,
    /// The client is gone and nothing is collected: stop.
    Stop,
}

/// What a fill needs of the upstream body it reads ahead: whether a copy of it is still
/// being collected, and a way to give that copy up.
pub(super) trait Fill:
    Body<Data = Bytes, Error: std::fmt::Display> + Unpin + Send + 'static
{
    /// Whether a copy of the body is being collected for the cache.
    fn is_collecting(&self) -> bool;
    /// Stops collecting the copy: the requests waiting for it go upstream on their own.
    fn give_up_collecting(&mut self);
}

/// Starts reading `body` ahead (in a task of its own) and returns the client's side.
pub(super) fn spawn<B: Fill>(mut body: B) -> AheadBody {
    let remaining = body.size_hint().exact();
    let queue = Arc::new(Mutex::new(Queue::default()));
    let q = queue.clone();
    tokio::spawn(async move {
        loop {
            // Past what is stored, read only as fast as the client takes it.
            let collecting = body.is_collecting();
            let next = std::future::poll_fn(|cx| {
                let mut g = q.lock();
                if collecting && ALL_QUEUED.load(Ordering::Relaxed) < ALL_QUEUED_HIGH {
                    return Poll::Ready(Next::Read);
                }
                if g.reader_gone {
                    return Poll::Ready(Next::Stop);
                }
                if g.queued < QUEUE_HIGH {
                    return Poll::Ready(Next::Read);
                }
                if collecting {
                    // Fills together hold all they may, and this client lags: the copy is
                    // given up rather than made to wait on it, so the requests waiting for
                    // it go on at once.
                    return Poll::Ready(Next::GiveUp);
                }
                g.filler = Some(cx.waker().clone());
                Poll::Pending
            })
            .await;
            match next {
                Next::Read => {}
                Next::GiveUp => {
                    body.give_up_collecting();
                    continue;
                }
                // Dropping the body closes the upstream connection, whose state is unknown.
                Next::Stop => return,
            }
            let frame = http_body_util::BodyExt::frame(&mut body).await;
            let mut g = q.lock();
            let ended = match frame {
                Some(Ok(f)) => match f.into_data() {
                    Ok(d) => {
                        if !g.reader_gone && !d.is_empty() {
                            let (d, cost) = queued_piece(d);
                            g.queued += cost;
                            ALL_QUEUED.fetch_add(cost, Ordering::Relaxed);
                            g.chunks.push_back(d);
                        }
                        if body.is_end_stream() {
                            g.end = Some(Ok(()));
                            true
                        } else {
                            false
                        }
                    }
                    Err(f) => {
                        g.trailers = f.into_trailers().ok();
                        false
                    }
                },
                None => {
                    g.end = Some(Ok(()));
                    true
                }
                Some(Err(e)) => {
                    g.end = Some(Err(e.to_string()));
                    true
                }
            };
            if let Some(w) = g.reader.take() {
                w.wake();
            }
            if ended {
                return;
            }
        }
    });
    AheadBody {
        queue,
        remaining,
        done: false,
    }
}

impl AheadBody {
    /// Whether nothing more will come.
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// Bytes still to come, when known.
    pub fn size_hint(&self) -> SizeHint {
        match self.remaining {
            Some(n) => SizeHint::with_exact(n),
            None => SizeHint::default(),
        }
    }

    /// The next frame of the answer.
    pub fn poll_frame(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, String>>> {
        if self.done {
            return Poll::Ready(None);
        }
        let mut q = self.queue.lock();
        if let Some(d) = q.chunks.pop_front() {
            let cost = cost(&d);
            q.queued -= cost;
            ALL_QUEUED.fetch_sub(cost, Ordering::Relaxed);
            if let Some(w) = q.filler.take() {
                w.wake();
            }
            if let Some(r) = self.remaining.as_mut() {
                *r = r.saturating_sub(d.len() as u64);
            }
            if q.chunks.is_empty() && q.trailers.is_none() && matches!(q.end, Some(Ok(()))) {
                self.done = true;
            }
            return Poll::Ready(Some(Ok(Frame::data(d))));
        }
        if let Some(t) = q.trailers.take() {
            return Poll::Ready(Some(Ok(Frame::trailers(t))));
        }
        match q.end.take() {
            Some(Ok(())) => {
                self.done = true;
                Poll::Ready(None)
            }
            Some(Err(e)) => {
                self.done = true;
                Poll::Ready(Some(Err(e)))
            }
            None => {
                q.reader = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

impl std::fmt::Debug for AheadBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AheadBody")
            .field("remaining", &self.remaining)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_pieces_are_copied_out_of_their_buffer_and_counted_with_their_cost() {
        let buf = Bytes::from(vec![7u8; 16 * 1024]);
        let (small, cost) = queued_piece(buf.slice(10..11));
        assert_eq!(&small[..], [7]);
        assert_eq!(cost, 1 + PIECE_COST);
        assert!(
            !buf.as_ptr_range().contains(&small.as_ptr()),
            "a byte does not hold 16 KiB"
        );
        let (large, cost) = queued_piece(buf.slice(..8192));
        assert_eq!(large.as_ptr(), buf.as_ptr(), "a large piece is not copied");
        assert_eq!(cost, 8192 + PIECE_COST);
    }
}
