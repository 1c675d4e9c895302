//! A response body from upstream, whichever client brought it: it gives its connection
//! back to its pool once read to the end, times out a stalled upstream, can hand a copy of
//! itself to the cache, and can be read ahead of its client.

use super::gather::Gather;
use super::h1_response::H1Body;
use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

/// A response body from upstream that returns its connection to its pool once read to
/// the end. Dropped early, the connection is closed instead (its state is unknown).
pub struct PooledBody {
    inner: Inner,
    /// Takes a copy of the body as it streams (for the cache).
    collect: Option<Box<Collector>>,
    /// Longest wait for the next piece of the body (`read_timeout`).
    read_timeout: Duration,
    /// Armed while the body waits on the upstream.
    stall: Option<Pin<Box<tokio::time::Sleep>>>,
    /// The client connection's place for a stream holding an upstream connection, given
    /// back with the body.
    share: Option<crate::exchange::UpstreamShare>,
    /// Its stream's place among an HTTP/2 upstream connection's, given back with it.
    lane: Option<super::alt::LaneSlot>,
    /// The byte range of the answer its client gets (a `Range` served from a whole answer).
    part: Option<Part>,
}

/// What is left of a byte range: bytes to skip, then bytes to give.
#[derive(Clone, Copy, Debug)]
struct Part {
    skip: u64,
    left: u64,
}

enum Inner {
    /// From the alternative client (HTTPS, HTTP/2, upgrades), which pools by itself.
    Plain(Incoming),
    /// From the lean client.
    Raw(H1Body),
    /// Read ahead of the client by a task of its own (for the cache).
    Ahead(super::ahead::AheadBody),
}

/// Gathers a body as it streams, up to a limit, and hands the whole of it over at the end.
pub struct Collector {
    chunks: Gather,
    len: u64,
    limit: u64,
    done: Option<Box<dyn FnOnce(Bytes) + Send>>,
    too_large: Option<Box<dyn FnOnce() + Send>>,
}

impl Collector {
    /// A collector of at most `limit` bytes that calls `done` with the whole body.
    pub fn new(limit: u64, done: impl FnOnce(Bytes) + Send + 'static) -> Collector {
        Collector {
            chunks: Gather::default(),
            len: 0,
            limit,
            done: Some(Box::new(done)),
            too_large: None,
        }
    }

    /// Calls `f` if the body turns out larger than the limit.
    pub fn on_too_large(mut self, f: impl FnOnce() + Send + 'static) -> Collector {
        self.too_large = Some(Box::new(f));
        self
    }

    /// Takes a piece; false once the body is larger than the limit.
    fn push(&mut self, b: &Bytes) -> bool {
        self.len += b.len() as u64;
        if self.len > self.limit {
            if let Some(f) = self.too_large.take() {
                f();
            }
            return false;
        }
        self.chunks.push(b.clone());
        true
    }

    fn finish(mut self) {
        let mut chunks = std::mem::take(&mut self.chunks).into_pieces();
        let body = match chunks.len() {
            0 => Bytes::new(),
            1 => chunks.pop().unwrap_or_default(),
            _ => {
                let mut all = Vec::with_capacity(self.len as usize);
                for c in &chunks {
                    all.extend_from_slice(c);
                }
                Bytes::from(all)
            }
        };
        if let Some(done) = self.done.take() {
            done(body);
        }
    }
}

/// Error of a response body from upstream.
pub type BodyError = Box<dyn std::error::Error + Send + Sync>;

impl PooledBody {
    /// A body from a client that pools by itself (HTTPS, HTTP/2, upgrades): trailers and
    /// all pass through as they come.
    pub(crate) fn plain(body: Incoming, read_timeout: Duration) -> Self {
        PooledBody {
            inner: Inner::Plain(body),
            read_timeout,
            stall: None,
            collect: None,
            share: None,
            lane: None,
            part: None,
        }
    }

    pub(crate) fn raw(body: H1Body, read_timeout: Duration) -> Self {
        PooledBody {
            inner: Inner::Raw(body),
            read_timeout,
            stall: None,
            collect: None,
            share: None,
            lane: None,
            part: None,
        }
    }

    /// Hands a copy of the whole body to `c` once it has streamed to its end; a body that
    /// breaks off or outgrows the collector's limit is never handed over.
    pub fn collect_into(&mut self, c: Collector) {
        if self.whole_ended() {
            c.finish();
        } else {
            self.collect = Some(Box::new(c));
        }
    }

    /// Holds its stream's place on an HTTP/2 upstream connection until the body is done
    /// with, so that the connection is known to have room again only then.
    pub(crate) fn on_lane(mut self, slot: super::alt::LaneSlot) -> Self {
        self.lane = Some(slot);
        self
    }

    /// Holds the client connection's `share` until the body is done with.
    pub fn holding(mut self, share: Option<crate::exchange::UpstreamShare>) -> Self {
        self.share = share;
        self
    }

    /// Stops collecting a copy: it is never handed over (whoever waits for it goes on).
    pub fn give_up_collecting(&mut self) {
        self.collect = None;
    }

    /// Whether a copy is still being collected (not yet handed over, nor given up).
    pub fn is_collecting(&self) -> bool {
        self.collect.is_some()
    }

    /// The bytes `range` of this body only: those before it are skipped, and the body ends
    /// after it (a `Range` served from a whole answer, as nginx's range filter does).
    /// Applied last, after [`PooledBody::read_ahead`]: what is stored is the whole.
    pub fn only(mut self, range: std::ops::Range<u64>) -> Self {
        self.part = Some(Part {
            skip: range.start,
            left: range.end.saturating_sub(range.start),
        });
        self
    }

    /// Reads the rest of this body ahead of its reader, in a task of its own (see
    /// [`super::ahead`]): what it collects is handed over at the upstream's pace.
    pub fn read_ahead(self) -> PooledBody {
        let read_timeout = self.read_timeout;
        if self.whole_ended() {
            return self;
        }
        PooledBody {
            inner: Inner::Ahead(super::ahead::spawn(self)),
            read_timeout,
            stall: None,
            collect: None,
            share: None,
            lane: None,
            part: None,
        }
    }

    fn poll_inner(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        match &mut self.inner {
            Inner::Raw(body) => body
                .poll_data(cx)
                .map(|o| o.map(|r| r.map(Frame::data).map_err(BodyError::from))),
            Inner::Ahead(body) => body.poll_frame(cx).map_err(BodyError::from),
            Inner::Plain(body) => Pin::new(body)
                .poll_frame(cx)
                .map(|o| o.map(|r| r.map_err(BodyError::from))),
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
        let this = &mut *self;
        loop {
            let polled = this.poll_whole(cx);
            let Some(p) = this.part.as_mut() else {
                return polled;
            };
            match polled {
                Poll::Ready(Some(Ok(frame))) => {
                    // The whole answer's trailers are not the part's: dropped.
                    if let Ok(mut d) = frame.into_data() {
                        let skip = p.skip.min(d.len() as u64) as usize;
                        p.skip -= skip as u64;
                        bytes::Buf::advance(&mut d, skip);
                        let take = p.left.min(d.len() as u64) as usize;
                        d.truncate(take);
                        p.left -= take as u64;
                        if !d.is_empty() {
                            return Poll::Ready(Some(Ok(Frame::data(d))));
                        }
                    }
                    if p.left == 0 {
                        return Poll::Ready(None);
                    }
                }
                // Shorter than its length said: the part's length was a lie, and the
                // client's connection must not be kept.
                Poll::Ready(None) if p.left > 0 => {
                    return Poll::Ready(Some(Err("upstream answer ended before the range".into())));
                }
                other => return other,
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.part {
            Some(p) if p.left == 0 => true,
            _ => self.whole_ended(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.part {
            Some(p) => SizeHint::with_exact(p.left),
            None => self.whole_size(),
        }
    }
}

impl PooledBody {
    /// The next frame of the whole answer, its copy taken for the cache.
    fn poll_whole(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = self;
        match this.poll_inner(cx) {
            Poll::Pending => {
                let timeout = this.read_timeout;
                let stall = this
                    .stall
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
                match stall.as_mut().poll(cx) {
                    Poll::Pending => Poll::Pending,
                    Poll::Ready(()) => {
                        // The upstream stopped sending: drop its connection, end the body
                        // with an error so the client's connection is closed, not finished.
                        this.inner = Inner::Raw(H1Body::closed());
                        Poll::Ready(Some(Err("upstream read timeout".into())))
                    }
                }
            }
            ready => {
                if let Some(s) = this.stall.as_mut() {
                    s.as_mut()
                        .reset(tokio::time::Instant::now() + this.read_timeout);
                }
                if this.collect.is_some() {
                    match &ready {
                        Poll::Ready(Some(Ok(frame))) => {
                            let fits = match (frame.data_ref(), this.collect.as_mut()) {
                                (Some(d), Some(c)) => c.push(d),
                                _ => true,
                            };
                            if !fits {
                                this.collect = None;
                            } else if this.whole_ended() {
                                if let Some(c) = this.collect.take() {
                                    c.finish();
                                }
                            }
                        }
                        Poll::Ready(None) => {
                            if let Some(c) = this.collect.take() {
                                c.finish();
                            }
                        }
                        _ => this.collect = None,
                    }
                }
                ready
            }
        }
    }

    /// Whether the whole answer has been read.
    fn whole_ended(&self) -> bool {
        match &self.inner {
            Inner::Plain(body) => body.is_end_stream(),
            Inner::Raw(body) => body.is_done(),
            Inner::Ahead(body) => body.is_done(),
        }
    }

    fn whole_size(&self) -> SizeHint {
        match &self.inner {
            Inner::Plain(body) => body.size_hint(),
            Inner::Raw(body) => match body.remaining() {
                Some(n) => SizeHint::with_exact(n),
                None => SizeHint::default(),
            },
            Inner::Ahead(body) => body.size_hint(),
        }
    }
}

impl super::ahead::Fill for PooledBody {
    fn is_collecting(&self) -> bool {
        PooledBody::is_collecting(self)
    }

    fn give_up_collecting(&mut self) {
        PooledBody::give_up_collecting(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    #[test]
    fn a_collector_stops_past_its_limit() {
        let (tx, _rx) = mpsc::channel::<Bytes>();
        let (big_tx, big_rx) = mpsc::channel();
        let mut c = Collector::new(10, move |b| tx.send(b).expect("send"))
            .on_too_large(move || big_tx.send(()).expect("send"));
        assert!(c.push(&Bytes::from_static(b"0123456789")));
        assert!(!c.push(&Bytes::from_static(b"x")));
        assert!(big_rx.try_recv().is_ok());
    }
}
