//! A request body on an HTTP/1.1 connection: the handler reads [`H1RecvBody`]; the
//! connection's task reads the socket for it only when it asks (one piece at a time, so a
//! slow upstream slows the client down instead of filling memory), sending `100 Continue`
//! first when the client waits for it.

use super::chunked::{Broken, Decoded, Decoder};
use bytes::{Bytes, BytesMut};
use http::HeaderMap;
use http_body::{Frame, SizeHint};
use parking_lot::Mutex;
use std::future::poll_fn;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};

/// What passes between the body's reader and the connection.
#[derive(Default)]
struct Slot {
    data: Option<Bytes>,
    trailers: Option<HeaderMap>,
    ended: bool,
    broken: Option<&'static str>,
    /// The reader waits for the next piece.
    want: bool,
    /// The reader is gone: nothing more will be asked.
    dropped: bool,
    reader: Option<Waker>,
    conn: Option<Waker>,
    /// Bytes left, when known, for the size hint.
    left: Option<u64>,
    /// Bytes a chunk's size line announced that have not come yet: the size hint's lower
    /// bound, so that a chunk larger than what the body may still hold is refused at once.
    announced: u64,
}

/// The body of a request on an HTTP/1.1 connection, as the handler reads it.
pub struct H1RecvBody {
    slot: Arc<Mutex<Slot>>,
}

/// The connection's side of a request body.
pub struct Pump {
    slot: Arc<Mutex<Slot>>,
    decoder: Decoder,
    /// The rest of a `100 Continue` still to write.
    continue_left: &'static [u8],
    /// The `100 Continue` is written but not yet flushed.
    continue_unflushed: bool,
    finished: bool,
}

const CONTINUE: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\n";

/// A body and the connection's side of it.
pub fn channel(decoder: Decoder, expect_continue: bool) -> (H1RecvBody, Pump) {
    let slot = Arc::new(Mutex::new(Slot {
        left: decoder.remaining(),
        ..Slot::default()
    }));
    (
        H1RecvBody { slot: slot.clone() },
        Pump {
            slot,
            decoder,
            continue_left: if expect_continue { CONTINUE } else { &[] },
            continue_unflushed: false,
            finished: false,
        },
    )
}

impl H1RecvBody {
    /// Polls for the next frame.
    pub fn poll_frame(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Broken>>> {
        let mut s = self.slot.lock();
        if let Some(d) = s.data.take() {
            if let Some(n) = s.left.as_mut() {
                *n = n.saturating_sub(d.len() as u64);
            }
            return Poll::Ready(Some(Ok(Frame::data(d))));
        }
        if let Some(t) = s.trailers.take() {
            return Poll::Ready(Some(Ok(Frame::trailers(t))));
        }
        if let Some(why) = s.broken {
            return Poll::Ready(Some(Err(Broken(why))));
        }
        if s.ended {
            return Poll::Ready(None);
        }
        s.want = true;
        if !s.reader.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
            s.reader = Some(cx.waker().clone());
        }
        if let Some(c) = s.conn.take() {
            c.wake();
        }
        Poll::Pending
    }

    /// Whether the body has ended.
    pub fn is_end_stream(&self) -> bool {
        let s = self.slot.lock();
        s.ended && s.data.is_none() && s.trailers.is_none()
    }

    /// What is left, when known.
    pub fn size_hint(&self) -> SizeHint {
        // `left` counts what the reader has not taken, the piece waiting for it included.
        let s = self.slot.lock();
        match s.left {
            Some(n) => SizeHint::with_exact(n),
            None => {
                let mut h = SizeHint::new();
                let waiting = s.data.as_ref().map_or(0, |d| d.len() as u64);
                h.set_lower(s.announced.saturating_add(waiting));
                h
            }
        }
    }
}

impl Drop for H1RecvBody {
    fn drop(&mut self) {
        let mut s = self.slot.lock();
        s.dropped = true;
        if let Some(c) = s.conn.take() {
            c.wake();
        }
    }
}

impl Pump {
    /// Serves the reader: while it wants a piece, decodes one from `buf`, reading the
    /// socket when `buf` has too little. Never ready; the connection polls it beside the
    /// handler until the body ends or breaks (then it does nothing more).
    pub fn poll<S: AsyncRead + AsyncWrite + Unpin>(
        &mut self,
        io: &mut S,
        buf: &mut BytesMut,
        cx: &mut Context<'_>,
    ) {
        if self.finished {
            return;
        }
        loop {
            let mut s = self.slot.lock();
            if s.broken.is_some() || s.ended || s.dropped {
                return;
            }
            if !s.want || s.data.is_some() {
                if !s.conn.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                    s.conn = Some(cx.waker().clone());
                }
                return;
            }
            drop(s);
            while !self.continue_left.is_empty() {
                match Pin::new(&mut *io).poll_write(cx, self.continue_left) {
                    Poll::Ready(Ok(n)) if n > 0 => self.continue_left = &self.continue_left[n..],
                    Poll::Ready(_) => return self.broke("client connection failed"),
                    Poll::Pending => return,
                }
                self.continue_unflushed = self.continue_left.is_empty();
            }
            if self.continue_unflushed {
                // Flushed at once, or a TLS layer could keep it.
                match Pin::new(&mut *io).poll_flush(cx) {
                    Poll::Ready(Ok(())) => self.continue_unflushed = false,
                    Poll::Ready(Err(_)) => return self.broke("client connection failed"),
                    Poll::Pending => return,
                }
            }
            let step = self.decoder.decode(buf);
            let mut s = self.slot.lock();
            let before = s.announced;
            s.announced = self.decoder.announced();
            match step {
                Ok(Decoded::Data(d)) => {
                    s.data = Some(d);
                    s.want = false;
                }
                Ok(Decoded::Trailers(t)) => {
                    s.trailers = Some(t);
                    s.ended = true;
                    self.finished = true;
                }
                Ok(Decoded::End) => {
                    s.ended = true;
                    self.finished = true;
                }
                Ok(Decoded::Need) => {
                    // A size line read with none of its chunk yet: the reader learns what
                    // it announced, so that a body that says it will be too large is
                    // refused now, not when (or if) its bytes come.
                    if s.announced > before {
                        if let Some(r) = s.reader.take() {
                            r.wake();
                        }
                    }
                    drop(s);
                    match read_more(io, buf, cx) {
                        Poll::Ready(Ok(0)) => return self.broke("client closed mid-body"),
                        Poll::Ready(Ok(_)) => continue,
                        Poll::Ready(Err(_)) => return self.broke("client connection failed"),
                        Poll::Pending => return,
                    }
                }
                Err(Broken(why)) => {
                    s.broken = Some(why);
                }
            }
            if let Some(r) = s.reader.take() {
                r.wake();
            }
            if self.finished || s.broken.is_some() {
                return;
            }
        }
    }

    /// Whether the body has been read whole: what the socket brings now is the client's
    /// next request, or its close.
    pub fn finished(&self) -> bool {
        self.finished
    }

    /// Whether the client still waits for a `100 Continue` before it sends its body: an
    /// answer written now may be all it sends, and the body may never come.
    pub fn withheld(&self) -> bool {
        !self.finished && self.continue_left.len() == CONTINUE.len()
    }

    /// The answer's head is about to be written: a `100 Continue` not begun is never
    /// sent (the client learns from the answer); one begun is finished first, so that the
    /// answer does not start inside it.
    pub fn poll_answering<S: AsyncWrite + Unpin>(
        &mut self,
        io: &mut S,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<()>> {
        if self.continue_left.len() == CONTINUE.len() {
            self.continue_left = &[];
        }
        while !self.continue_left.is_empty() {
            match std::task::ready!(Pin::new(&mut *io).poll_write(cx, self.continue_left)) {
                Ok(n) if n > 0 => self.continue_left = &self.continue_left[n..],
                Ok(_) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
        Poll::Ready(Ok(()))
    }

    /// Whether more than `most` bytes of the body are known to be still to come (the rest
    /// of its length, or of the chunk under way): more than would be dropped after an
    /// answer to keep the connection.
    pub fn rest_over(&self, most: u64) -> bool {
        !self.finished && self.decoder.announced() > most
    }

    /// Whether the reader is gone or the body broke: nothing more of it will be read for
    /// the handler.
    pub fn abandoned(&self) -> bool {
        let s = self.slot.lock();
        s.dropped || s.broken.is_some()
    }

    fn broke(&mut self, why: &'static str) {
        let mut s = self.slot.lock();
        s.broken = Some(why);
        if let Some(r) = s.reader.take() {
            r.wake();
        }
    }

    /// After the answer: reads what is left of the body from what is already buffered,
    /// without waiting. Whether the body ended there (the connection can then be kept).
    pub fn skip_buffered(&mut self, buf: &mut BytesMut) -> bool {
        self.skip(buf) == Some(true)
    }

    /// Drops what is buffered of the body: `Some(true)` when it ended there, `Some(false)`
    /// when it broke, `None` when more is to come.
    fn skip(&mut self, buf: &mut BytesMut) -> Option<bool> {
        if self.finished {
            return Some(true);
        }
        if self.slot.lock().broken.is_some() {
            return Some(false);
        }
        loop {
            match self.decoder.decode(buf) {
                Ok(Decoded::Data(_)) => {}
                Ok(Decoded::Trailers(_) | Decoded::End) => {
                    self.finished = true;
                    // A reader still holding the body learns it will see no more of it.
                    self.broke("the body was skipped");
                    return Some(true);
                }
                Ok(Decoded::Need) => return None,
                Err(_) => return Some(false),
            }
        }
    }

    /// After an answer written before the body ended (an upstream that answered without
    /// reading it all): reads the rest and drops it, as nginx does, so that the connection
    /// and a request pipelined after the body are kept. Gives up (the connection is then
    /// closed) on a body that broke, one with more than `most` bytes still to come, or one
    /// whose rest takes longer than `wait` in all. Whether the body ended.
    pub async fn discard<S: AsyncRead + AsyncWrite + Unpin>(
        &mut self,
        io: &mut S,
        buf: &mut BytesMut,
        most: u64,
        wait: Duration,
    ) -> bool {
        let mut taken: u64 = 0;
        // One deadline for the whole rest, as nginx's `lingering_time`: a client that
        // trickles its body does not hold the connection read by read.
        let until = tokio::time::Instant::now() + wait;
        loop {
            if let Some(ended) = self.skip(buf) {
                return ended;
            }
            if taken > most || self.decoder.announced() > most - taken {
                return false;
            }
            match tokio::time::timeout_at(until, poll_fn(|cx| read_more(io, buf, cx))).await {
                Ok(Ok(n)) if n > 0 => taken += n as u64,
                _ => return false,
            }
        }
    }
}

impl Drop for Pump {
    /// The connection is done with the body (it closes, or serves the next request): a
    /// reader still waiting learns that no more will come.
    fn drop(&mut self) {
        if !self.finished {
            self.broke("the connection ended before the body");
        }
    }
}

/// Reads into `buf`, making room first.
pub fn read_more<S: AsyncRead + Unpin>(
    io: &mut S,
    buf: &mut BytesMut,
    cx: &mut Context<'_>,
) -> Poll<io::Result<usize>> {
    if buf.capacity() - buf.len() < 1024 {
        buf.reserve(8 * 1024);
    }
    tokio_util::io::poll_read_buf(Pin::new(io), cx, buf)
}
