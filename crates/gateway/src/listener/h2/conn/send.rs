//! Answers: headers, body as the windows allow, trailers; resets; the credit given back
//! for what the streams read.

use super::super::frame::{self, code};
use super::super::{hpack, request};
use super::streams::{Out, StreamState, LINGER, MAX_LINGERING};
use super::{Connection, WRITE_HIGH};
use crate::exchange::Parts;
use crate::listener::body::RequestBody;
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Response, StatusCode};
use http_body::Body;
use std::future::Future;

/// What an answer waiting on the client's window must send before its wait ends (the
/// largest frame a client must take, RFC 9113 §4.2): a stream moves at least that much, or
/// the whole piece waiting, per `send_timeout` (273 bytes a second at the default 60 s).
/// Not less for a client that asks for a smaller window: it would choose its own bar. One
/// giving a byte at a time holds the stream (and the upstream connection behind it) only
/// until `send_timeout`.
const PROGRESS: usize = 16_384;
use std::pin::Pin;
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::time::Instant;

impl<S, F, M, B> Connection<S, F, M, B>
where
    S: AsyncRead + AsyncWrite + Unpin,
    M: FnMut(Parts, RequestBody) -> F + Unpin,
    F: Future<Output = Response<B>>,
    B: Body<Data = Bytes> + Unpin,
{
    /// Resets stream `id` with `code` (a stream error) and forgets it.
    /// A reset of a stream already handed to the gateway spends the same balance as a
    /// client's reset (MadeYouReset, CVE-2025-8671: a client can make the server reset
    /// streams it already sent upstream); one that never reached it counts towards
    /// [`super::flood::MAX_LOCAL_RESETS`].
    pub(super) fn reset(&mut self, id: u32, code: u32) {
        frame::rst_stream(&mut self.wbuf, id, code);
        if self.streams.contains_key(&id) {
            // The flood is acted on once the frame in hand is done.
            self.flood.spend_reset(Instant::now());
        } else {
            self.flood.local_reset();
        }
        self.remove(id, "stream reset");
        self.remember(id);
    }

    /// Resets stream `id` for a fault that is not the client's (its answer's body broke
    /// upstream): nothing is spent.
    pub(super) fn reset_for_upstream(&mut self, id: u32) {
        frame::rst_stream(&mut self.wbuf, id, code::INTERNAL_ERROR);
        self.remove(id, "stream reset");
        self.remember(id);
    }

    pub(super) fn remember(&mut self, id: u32) {
        self.streams.remember(id);
    }

    /// Drops a stream: its future, and its body's feed with the reason.
    pub(super) fn remove(&mut self, id: u32, why: &'static str) {
        if let Some(st) = self.streams.remove(&id) {
            if st.state == StreamState::HalfClosedLocal {
                self.lingering -= 1;
            }
            if let Some(slot) = st.slot {
                self.exec.cancel(slot);
                self.held -= st.held;
            }
            if let Some(tx) = st.recv {
                tx.break_off(why);
            }
        }
    }

    /// A fixed answer without a body, for a stream that never reaches the gateway.
    pub(super) fn answer_now(&mut self, id: u32, status: StatusCode, end_stream: bool) {
        let mut block = std::mem::take(&mut self.scratch);
        block.clear();
        hpack::encode_status(&mut block, status);
        frame::header_block(&mut self.wbuf, id, &block, true, self.peer_frame);
        self.scratch = block;
        if !end_stream {
            frame::rst_stream(&mut self.wbuf, id, code::NO_ERROR);
            self.remember(id);
        }
    }

    /// Starts the answer of stream `id`: its headers, and as much body as may go.
    pub(super) fn answer(&mut self, cx: &mut Context<'_>, id: u32, resp: Response<B>) {
        let Some(st) = self.streams.get_mut(&id) else {
            return;
        };
        st.slot = None;
        self.held -= std::mem::take(&mut st.held);
        let (parts, body) = resp.into_parts();
        st.upstream = parts
            .extensions
            .get::<crate::exchange::UpstreamWork>()
            .is_some();
        let end = st.head || body.is_end_stream();
        let mut block = std::mem::take(&mut self.scratch);
        block.clear();
        hpack::encode_status(&mut block, parts.status);
        let (mut date, mut length) = (false, false);
        for (n, v) in &parts.headers {
            if request::is_connection_specific(n) {
                continue;
            }
            date |= *n == http::header::DATE;
            length |= *n == http::header::CONTENT_LENGTH;
            hpack::encode_field(&mut block, n, v);
        }
        let bodiless = st.head
            || parts.status == StatusCode::NO_CONTENT
            || parts.status == StatusCode::NOT_MODIFIED;
        if !length && !bodiless {
            if let Some(n) = body.size_hint().exact() {
                let mut digits = itoa::Buffer::new();
                let v = HeaderValue::from_str(digits.format(n))
                    .unwrap_or(HeaderValue::from_static("0"));
                hpack::encode_field(&mut block, &http::header::CONTENT_LENGTH, &v);
            }
        }
        if !date {
            // The coarse clock, as HTTP/1.1's `Date`: a second's precision is all it shows.
            let now = crate::clock::coarse::wall();
            let secs = now
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            if secs != self.date.0 {
                let v = httpdate::fmt_http_date(now);
                self.date = (
                    secs,
                    HeaderValue::from_str(&v).unwrap_or(HeaderValue::from_static("")),
                );
            }
            hpack::encode_field(&mut block, &http::header::DATE, &self.date.1);
        }
        frame::header_block(&mut self.wbuf, id, &block, end, self.peer_frame);
        self.scratch = block;
        if end {
            self.done(id);
            return;
        }
        st.out = Some(Out {
            body,
            pending: None,
            end_after: false,
        });
        if self.pump(cx, id) {
            self.sending.push(id);
        }
    }

    /// Sends what stream `id`'s body has and the windows allow; true while it has more.
    pub(super) fn pump(&mut self, cx: &mut Context<'_>, id: u32) -> bool {
        loop {
            let Some(st) = self.streams.get_mut(&id) else {
                return false;
            };
            let Some(out) = st.out.as_mut() else {
                return false;
            };
            // Enough waits to be written: the rest when it is.
            if self.wbuf.len() - self.wpos >= WRITE_HIGH {
                return true;
            }
            if let Some(data) = out.pending.take() {
                let end = out.end_after;
                if data.is_empty() {
                    frame::data(&mut self.wbuf, id, &data, end);
                } else {
                    let room = st
                        .window_out
                        .room()
                        .min(self.window_out.room())
                        .min(self.peer_frame as i64);
                    if room <= 0 {
                        out.pending = Some(data);
                        if st.blocked_since.is_none() {
                            let now = Instant::now();
                            st.blocked_since = Some(now);
                            let at = now + self.limits.send_timeout;
                            if self.timer.deadline() > at {
                                self.timer.as_mut().reset(at);
                            }
                        }
                        return true;
                    }
                    let n = data.len().min(room as usize);
                    if st.blocked_since.is_some() {
                        // A window given a byte at a time is not a client reading (as a
                        // TCP socket is not writable again for one byte): the wait ends
                        // once a frame's worth, or the whole piece waiting, has gone.
                        st.sent_blocked += n;
                        if st.sent_blocked >= PROGRESS.min(data.len()) {
                            st.blocked_since = None;
                            st.sent_blocked = 0;
                        }
                    }
                    st.window_out.spend(n);
                    self.window_out.spend(n);
                    frame::data(&mut self.wbuf, id, &data[..n], end && n == data.len());
                    if n < data.len() {
                        out.pending = Some(data.slice(n..));
                        continue;
                    }
                }
                if end {
                    self.done(id);
                    return false;
                }
                continue;
            }
            match Pin::new(&mut out.body).poll_frame(cx) {
                Poll::Pending => return true,
                Poll::Ready(None) => {
                    frame::data(&mut self.wbuf, id, &[], true);
                    self.done(id);
                    return false;
                }
                Poll::Ready(Some(Err(_))) => {
                    tracing::debug!(stream = id, "answer body failed: stream reset");
                    self.reset_for_upstream(id);
                    return false;
                }
                Poll::Ready(Some(Ok(f))) => match f.into_data() {
                    Ok(d) => {
                        out.end_after = out.body.is_end_stream();
                        if !d.is_empty() || out.end_after {
                            out.pending = Some(d);
                        }
                    }
                    Err(f) => {
                        let trailers = f.into_trailers().unwrap_or_default();
                        self.send_trailers(id, &trailers);
                        self.done(id);
                        return false;
                    }
                },
            }
        }
    }

    pub(super) fn send_trailers(&mut self, id: u32, trailers: &HeaderMap) {
        let mut block = std::mem::take(&mut self.scratch);
        block.clear();
        for (n, v) in trailers {
            if !request::is_connection_specific(n) {
                hpack::encode_field(&mut block, n, v);
            }
        }
        frame::header_block(&mut self.wbuf, id, &block, true, self.peer_frame);
        self.scratch = block;
    }

    /// Stream `id`'s answer has ended. A client still sending is told to stop.
    pub(super) fn done(&mut self, id: u32) {
        let Some(upstream) = self.streams.get(&id).map(|st| st.upstream) else {
            return;
        };
        // Only an answer that took upstream work banks a reset: a cheap refusal does not.
        if upstream {
            self.flood.bank(Instant::now());
        }
        // A body its window cannot bring whole (the stream's window is not given back
        // while it lingers) is not waited for.
        let Some((open, fits)) = self.streams.get(&id).map(|s| {
            let rest = s.length.map(|l| l.saturating_sub(s.received));
            (
                s.state == StreamState::Open,
                rest.is_none_or(|r| i64::try_from(r).is_ok_and(|r| r <= s.window_in.left())),
            )
        }) else {
            return;
        };
        if !open || !fits || self.lingering >= MAX_LINGERING {
            if open {
                frame::rst_stream(&mut self.wbuf, id, code::NO_ERROR);
                self.remember(id);
            }
            self.remove(id, "answered before the body ended");
            return;
        }
        let Some(st) = self.streams.get_mut(&id) else {
            return;
        };
        // The client still sends: its side may end within LINGER (the body it had under
        // way), its frames checked as ever; the request's future and body feed are done.
        let until = Instant::now() + LINGER;
        self.lingering += 1;
        st.state = StreamState::HalfClosedLocal;
        st.linger_until = Some(until);
        st.out = None;
        st.blocked_since = None;
        st.sent_blocked = 0;
        st.expects_continue = false;
        let (slot, recv) = (st.slot.take(), st.recv.take());
        if let Some(slot) = slot {
            self.exec.cancel(slot);
            self.held -= std::mem::take(&mut st.held);
        }
        if let Some(tx) = recv {
            tx.break_off("answered before the body ended");
        }
        if until < self.timer.deadline() {
            self.timer.as_mut().reset(until);
        }
    }

    /// Credits the client with what the streams have read.
    pub(super) fn credit(&mut self, cx: &mut Context<'_>) {
        let mut i = 0;
        while i < self.bodies.len() {
            let (id, tx) = &self.bodies[i];
            let id = *id;
            let (n, gone, waited) = tx.take_released(cx.waker());
            self.window_in.owe(n);
            if let Some(st) = self.streams.get_mut(&id) {
                st.give_back(&mut self.wbuf, id, n);
                // Only before the answer: a 100 after it would be a protocol error.
                if st.expects_continue && st.slot.is_some() && st.out.is_none() && waited {
                    st.expects_continue = false;
                    let mut block = Vec::with_capacity(5);
                    hpack::encode_status(&mut block, StatusCode::CONTINUE);
                    frame::header_block(&mut self.wbuf, id, &block, false, self.peer_frame);
                }
            }
            // A reader gone has released all it will: nothing more to credit from it.
            if gone {
                self.bodies.swap_remove(i);
            } else {
                i += 1;
            }
        }
        if let Some(inc) = self.window_in.due() {
            frame::window_update(&mut self.wbuf, 0, inc);
        }
    }
}
