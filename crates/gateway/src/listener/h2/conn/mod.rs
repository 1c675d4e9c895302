//! One HTTP/2 server connection (RFC 9113): frames in, requests to the gateway, answers
//! out, flow control both ways, the protocol's errors and the flood limits.
//!
//! Everything runs in the connection's task: the frames read in one go are handled, the
//! streams they opened are polled at once (a refusal answers in that poll), and all the
//! answers go out in one write.

mod flood;
mod flow;
mod recv;
mod send;
mod streams;

use super::body::{Budget, Sender};
use super::exec::Exec;
use super::frame::{self, code};
use super::hpack::Decoder;
use crate::exchange::Parts;
use crate::listener::body::RequestBody;
use bytes::{Bytes, BytesMut};
use flood::FloodGuard;
use flow::{RecvWindow, SendWindow};
use http::{HeaderValue, Response};
use http_body::Body;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use streams::{Stream, Streams};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::time::{Instant, Sleep};
use tollgate_config::Http2Config;

/// Our SETTINGS_MAX_FRAME_SIZE: the protocol's default.
const MAX_FRAME: usize = 16_384;
/// Output not yet written past which nothing more is read or made.
const WRITE_HIGH: usize = 64 * 1024;

/// A connection's limits, from the listener's config.
#[derive(Debug, Clone)]
pub struct Limits {
    pub max_streams: u32,
    pub max_header_list: u32,
    pub stream_window: u32,
    pub connection_window: u32,
    /// Streams the client may reset before their answer, net of answered ones.
    pub max_resets: usize,
    /// How long the connection may stay without a stream.
    pub idle: Duration,
    /// How long an answer may wait on the client's window.
    pub send_timeout: Duration,
    /// Most header fields in a request (the listener's `max_headers`; 0: no limit).
    pub max_headers: usize,
    /// Request-body bytes the streams may hold before going upstream.
    pub max_request_buffer: usize,
    /// Header bytes sent as literals that the running streams whose body is still to come
    /// may hold together (4 × `max_header_list`): past it, such a new stream is refused
    /// until some finish or end their bodies.
    pub max_header_held: usize,
}

impl Limits {
    /// The limits of a listener with `h`, `header_timeout` and `send_timeout`.
    pub fn new(h: &Http2Config, idle: Duration, send_timeout: Duration) -> Self {
        Limits {
            max_streams: h.max_concurrent_streams,
            max_header_list: h.max_header_list_size,
            stream_window: h.stream_window,
            connection_window: h.connection_window,
            max_resets: h.max_pending_resets,
            max_request_buffer: usize::try_from(h.max_request_buffer).unwrap_or(usize::MAX),
            max_header_held: held_headers(h.max_header_list_size),
            idle,
            send_timeout,
            max_headers: 0,
        }
    }
}

/// The literal header bytes one connection's running streams may hold together: four
/// header lists at their largest, as the encoded block is allowed four times its list.
pub fn held_headers(max_header_list: u32) -> usize {
    usize::try_from(max_header_list)
        .unwrap_or(usize::MAX)
        .saturating_mul(4)
}

/// A connection error: GOAWAY with this code, then the close.
#[derive(Debug, Clone, Copy)]
struct ConnError(u32);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Taking new streams.
    Open,
    /// GOAWAY sent (or received): the open streams finish, then the connection closes.
    Closing,
    /// GOAWAY sent for an error: what is queued is written, then the connection closes.
    Failed,
}

/// A header block that goes on in CONTINUATION frames.
struct Continued {
    id: u32,
    end_stream: bool,
    self_dependent: bool,
    block: BytesMut,
    /// CONTINUATION frames so far.
    frames: u32,
    /// When the block must be whole (the listener's `header_timeout`).
    deadline: Instant,
}

/// One HTTP/2 connection, served to its end. `make` turns each request into the future
/// of its answer.
pub struct Connection<S, F, M, B> {
    io: S,
    make: M,
    limits: Limits,
    rbuf: BytesMut,
    wbuf: Vec<u8>,
    wpos: usize,
    flush: bool,
    read_closed: bool,
    preface: bool,
    got_settings: bool,
    decoder: Decoder,
    streams: Streams<Stream<B>>,
    exec: Exec<F>,
    /// The stream of each slot.
    slot_ids: Vec<u32>,
    /// Futures that finished in the last poll of `exec`.
    finished: Vec<(usize, Response<B>)>,
    /// Streams with an answer to send, and request bodies being read (for credit).
    sending: Vec<u32>,
    bodies: Vec<(u32, Sender)>,
    /// The client's SETTINGS_INITIAL_WINDOW_SIZE and SETTINGS_MAX_FRAME_SIZE.
    peer_window: i64,
    peer_frame: usize,
    /// What the client lets the answers send, all streams together.
    window_out: SendWindow,
    /// What the client may still send, all streams together, and the credit owed back.
    window_in: RecvWindow,
    cont: Option<Continued>,
    /// What the client may make the server do for nothing.
    flood: FloodGuard,
    /// The last stream id a GOAWAY named: a later GOAWAY never names a higher one.
    goaway_last: Option<u32>,
    state: State,
    timer: Pin<Box<Sleep>>,
    idle_since: Instant,
    busy: bool,
    /// Streams half closed (local): answered while their clients still send.
    lingering: usize,
    date: (u64, HeaderValue),
    scratch: Vec<u8>,
    /// What the streams' bodies hold before going upstream.
    budget: Arc<Budget>,
    /// Literal header bytes the running streams' requests hold (`Stream::held`'s sum).
    held: usize,
}

impl<S, F, M, B> Connection<S, F, M, B>
where
    S: AsyncRead + AsyncWrite + Unpin,
    M: FnMut(Parts, RequestBody) -> F + Unpin,
    F: Future<Output = Response<B>>,
    B: Body<Data = Bytes> + Unpin,
{
    /// Serves `io`, whose first bytes are the client's preface.
    pub fn new(io: S, limits: Limits, make: M) -> Self {
        let now = Instant::now();
        let mut c = Connection {
            io,
            make,
            rbuf: BytesMut::with_capacity(MAX_FRAME + 9),
            wbuf: Vec::with_capacity(4096),
            wpos: 0,
            flush: false,
            read_closed: false,
            preface: false,
            got_settings: false,
            decoder: Decoder::default(),
            streams: Streams::default(),
            exec: Exec::new(),
            slot_ids: Vec::new(),
            finished: Vec::new(),
            sending: Vec::new(),
            bodies: Vec::new(),
            peer_window: 65_535,
            peer_frame: MAX_FRAME,
            window_out: SendWindow::new(65_535),
            window_in: RecvWindow::new(
                i64::from(limits.connection_window.max(65_535)),
                limits.connection_window,
            ),
            cont: None,
            flood: FloodGuard::new(limits.max_resets, limits.max_streams, now),
            goaway_last: None,
            state: State::Open,
            timer: Box::pin(tokio::time::sleep_until(now + limits.idle)),
            idle_since: now,
            busy: false,
            lingering: 0,
            date: (0, HeaderValue::from_static("")),
            scratch: Vec::new(),
            budget: Budget::new(limits.max_request_buffer),
            held: 0,
            limits,
        };
        let settings = [
            (frame::MAX_CONCURRENT_STREAMS, c.limits.max_streams),
            (frame::INITIAL_WINDOW_SIZE, c.limits.stream_window),
            (frame::MAX_HEADER_LIST_SIZE, c.limits.max_header_list),
        ];
        frame::settings(&mut c.wbuf, &settings);
        let more = c.limits.connection_window.saturating_sub(65_535);
        if more > 0 {
            frame::window_update(&mut c.wbuf, 0, more);
        }
        c
    }

    /// Stops taking new streams (GOAWAY); the connection closes once the open ones are done.
    pub fn shutdown(&mut self) {
        if self.state == State::Open {
            self.goaway(code::NO_ERROR);
            self.state = State::Closing;
        }
    }

    /// Queues GOAWAY with `code`; its last stream id never grows past an earlier one's.
    fn goaway(&mut self, code: u32) {
        let last = self
            .goaway_last
            .map_or(self.streams.last_id(), |g| g.min(self.streams.last_id()));
        self.goaway_last = Some(last);
        frame::goaway(&mut self.wbuf, last, code);
    }

    fn fail(&mut self, e: ConnError) {
        if self.state == State::Failed {
            return;
        }
        tracing::debug!(code = e.0, "HTTP/2 connection error: GOAWAY");
        self.goaway(e.0);
        self.state = State::Failed;
        self.cont = None;
        let ids = self.streams.ids();
        for id in ids {
            self.remove(id, "connection error");
        }
    }

    /// Writes what is queued; Ok(true) if anything went out.
    fn write(&mut self, cx: &mut Context<'_>) -> std::io::Result<bool> {
        let mut wrote = false;
        while self.wpos < self.wbuf.len() {
            match Pin::new(&mut self.io).poll_write(cx, &self.wbuf[self.wpos..]) {
                Poll::Ready(Ok(0)) => return Err(std::io::ErrorKind::WriteZero.into()),
                Poll::Ready(Ok(n)) => {
                    self.wpos += n;
                    wrote = true;
                    self.flush = true;
                }
                Poll::Ready(Err(e)) => return Err(e),
                Poll::Pending => return Ok(wrote),
            }
        }
        self.wbuf.clear();
        self.wpos = 0;
        if self.flush {
            match Pin::new(&mut self.io).poll_flush(cx) {
                Poll::Ready(Ok(())) => self.flush = false,
                Poll::Ready(Err(e)) => return Err(e),
                Poll::Pending => {}
            }
        }
        Ok(wrote)
    }

    fn read(&mut self, cx: &mut Context<'_>) -> std::io::Result<bool> {
        if self.read_closed
            || self.state == State::Failed
            || self.wbuf.len() - self.wpos >= WRITE_HIGH
        {
            return Ok(false);
        }
        if self.rbuf.capacity() - self.rbuf.len() < 4096 {
            self.rbuf.reserve(MAX_FRAME + 9);
        }
        match tokio_util::io::poll_read_buf(Pin::new(&mut self.io), cx, &mut self.rbuf) {
            Poll::Ready(Ok(0)) => {
                self.read_closed = true;
                Ok(true)
            }
            Poll::Ready(Ok(_)) => {
                if let Err(e) = self.input() {
                    self.fail(e);
                }
                Ok(true)
            }
            Poll::Ready(Err(e)) => Err(e),
            Poll::Pending => Ok(false),
        }
    }

    /// The timer: the idle close and answers that waited on the client too long.
    fn timers(&mut self, cx: &mut Context<'_>) {
        if self.timer.as_mut().poll(cx).is_pending() {
            return;
        }
        let now = Instant::now();
        let mut next = now + self.limits.idle;
        if let Some(c) = &self.cont {
            if c.deadline <= now {
                tracing::debug!("an HTTP/2 header block did not end within header_timeout");
                self.fail(ConnError(code::PROTOCOL_ERROR));
            } else {
                next = next.min(c.deadline);
            }
        }
        let expired: Vec<u32> = self
            .streams
            .iter()
            .filter_map(|(id, st)| {
                let at = st.blocked_since? + self.limits.send_timeout;
                (at <= now).then_some(*id)
            })
            .collect();
        for id in expired {
            tracing::debug!(
                stream = id,
                "an HTTP/2 stream got no window for send_timeout: reset"
            );
            self.reset(id, code::CANCEL);
        }
        // Answered streams whose clients still send past LINGER are told to stop, and
        // their late frames ignored.
        let lingered: Vec<u32> = self
            .streams
            .iter()
            .filter_map(|(id, st)| (st.linger_until? <= now).then_some(*id))
            .collect();
        for id in lingered {
            frame::rst_stream(&mut self.wbuf, id, code::NO_ERROR);
            self.remove(id, "answered before the body ended");
            self.remember(id);
        }
        // Streams just removed here leave the connection idle from now, not from when it
        // was last idle.
        if self.streams.is_empty() && self.busy {
            self.busy = false;
            self.idle_since = now;
        }
        for st in self.streams.values() {
            if let Some(since) = st.blocked_since {
                next = next.min(since + self.limits.send_timeout);
            }
            if let Some(until) = st.linger_until {
                next = next.min(until);
            }
        }
        // A header block on its way is not idle: its own deadline (above) bounds it.
        if self.streams.is_empty() && self.cont.is_none() {
            let idle_until = self.idle_since + self.limits.idle;
            if idle_until <= now {
                // Idle too long: GOAWAY, then the close once it is written.
                self.shutdown();
            } else {
                next = next.min(idle_until);
            }
        }
        self.timer.as_mut().reset(next);
        let _ = self.timer.as_mut().poll(cx);
        // A reset or GOAWAY queued here goes out in the next poll.
        if !self.wbuf.is_empty() {
            cx.waker().wake_by_ref();
        }
    }
}

impl<S, F, M, B> Future for Connection<S, F, M, B>
where
    S: AsyncRead + AsyncWrite + Unpin,
    M: FnMut(Parts, RequestBody) -> F + Unpin,
    F: Future<Output = Response<B>>,
    B: Body<Data = Bytes> + Unpin,
{
    type Output = std::io::Result<()>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        // Bounded, so that a busy connection lets the other tasks run: after the last
        // round the task is woken again rather than left waiting on readiness it has used.
        let mut rounds = 0;
        loop {
            rounds += 1;
            if rounds > 64 {
                cx.waker().wake_by_ref();
                break;
            }
            let mut progress = this.read(cx)?;
            // The streams that can go on: new ones, and those woken.
            let mut finished = std::mem::take(&mut this.finished);
            this.exec.poll(cx, |slot, resp| finished.push((slot, resp)));
            for (slot, resp) in finished.drain(..) {
                let id = this.slot_ids[slot];
                this.answer(cx, id, resp);
            }
            this.finished = finished;
            let sending = std::mem::take(&mut this.sending);
            for id in &sending {
                let keep = if this.wbuf.len() - this.wpos < WRITE_HIGH {
                    this.pump(cx, *id)
                } else {
                    this.streams.get(id).is_some_and(|s| s.out.is_some())
                };
                if keep {
                    this.sending.push(*id);
                }
            }
            // Bodies being read, or DATA dropped on closed streams: window to give back.
            if !this.bodies.is_empty() || this.window_in.owes() {
                this.credit(cx);
            }
            progress |= this.write(cx)?;
            if !progress {
                break;
            }
        }
        if this.streams.is_empty() && this.busy {
            this.busy = false;
            this.idle_since = Instant::now();
        }
        let finished = match this.state {
            State::Failed => true,
            State::Closing => this.streams.is_empty(),
            State::Open => this.read_closed,
        };
        if this.read_closed && this.state != State::Failed {
            // The client is gone: nothing it asked for can reach it.
            let ids = this.streams.ids();
            for id in ids {
                this.remove(id, "client closed the connection");
            }
            return Poll::Ready(Ok(()));
        }
        if finished && this.wbuf.is_empty() && !this.flush {
            return Pin::new(&mut this.io).poll_shutdown(cx);
        }
        this.timers(cx);
        Poll::Pending
    }
}
