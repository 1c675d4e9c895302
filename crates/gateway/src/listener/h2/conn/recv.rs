//! The frames a client sends: each checked as RFC 9113 asks, and turned into streams,
//! request bodies, settings and window.

use super::super::body::Sender;
use super::super::frame::{self, code, flag, kind, PREFACE};
use super::super::{hpack, request};
use super::flood::block_flood;
use super::flow::{RecvWindow, SendWindow, MAX_WINDOW};
use super::streams::{Stream, StreamState};
use super::{ConnError, Connection, Continued, State, MAX_FRAME};
use crate::exchange::Parts;
use crate::listener::body::RequestBody;
use bytes::{Buf, Bytes, BytesMut};
use http::{Method, Response, StatusCode};
use http_body::Body;
use std::future::Future;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::time::Instant;

impl<S, F, M, B> Connection<S, F, M, B>
where
    S: AsyncRead + AsyncWrite + Unpin,
    M: FnMut(Parts, RequestBody) -> F + Unpin,
    F: Future<Output = Response<B>>,
    B: Body<Data = Bytes> + Unpin,
{
    pub(super) fn input(&mut self) -> Result<(), ConnError> {
        if !self.preface {
            let n = self.rbuf.len().min(PREFACE.len());
            if self.rbuf[..n] != PREFACE[..n] {
                return Err(ConnError(code::PROTOCOL_ERROR));
            }
            if n < PREFACE.len() {
                return Ok(());
            }
            self.rbuf.advance(PREFACE.len());
            self.preface = true;
        }
        while self.rbuf.len() >= 9 && self.state != State::Failed {
            let len = usize::from(self.rbuf[0]) << 16
                | usize::from(self.rbuf[1]) << 8
                | usize::from(self.rbuf[2]);
            if len > MAX_FRAME {
                return Err(ConnError(code::FRAME_SIZE_ERROR));
            }
            if self.rbuf.len() < 9 + len {
                self.rbuf.reserve(9 + len - self.rbuf.len());
                break;
            }
            let (k, flags) = (self.rbuf[3], self.rbuf[4]);
            let id = u32::from_be_bytes([self.rbuf[5], self.rbuf[6], self.rbuf[7], self.rbuf[8]])
                & 0x7fff_ffff;
            let payload = self.rbuf.split_to(9 + len).freeze().slice(9..);
            // DATA's padding carries nothing either.
            let pad = (k == kind::DATA && flags & flag::PADDED != 0)
                .then(|| payload.first().map_or(0, |&p| usize::from(p) + 1));
            if self
                .flood
                .frame(k, flags, len.saturating_sub(pad.unwrap_or(0)))
            {
                tracing::debug!("HTTP/2 client sent too many empty or unknown frames: GOAWAY");
                return Err(ConnError(code::ENHANCE_YOUR_CALM));
            }
            self.frame(k, flags, id, payload)?;
            if self.flood.exceeded() {
                return Err(ConnError(code::ENHANCE_YOUR_CALM));
            }
        }
        Ok(())
    }

    pub(super) fn frame(&mut self, k: u8, flags: u8, id: u32, p: Bytes) -> Result<(), ConnError> {
        if let Some(c) = &self.cont {
            if k != kind::CONTINUATION || id != c.id {
                return Err(ConnError(code::PROTOCOL_ERROR));
            }
        }
        if !self.got_settings && (k != kind::SETTINGS || flags & flag::ACK != 0) {
            return Err(ConnError(code::PROTOCOL_ERROR));
        }
        match k {
            kind::DATA => self.on_data(flags, id, p),
            kind::HEADERS => self.on_headers(flags, id, p),
            kind::PRIORITY => {
                if id == 0 {
                    return Err(ConnError(code::PROTOCOL_ERROR));
                }
                if p.len() != 5 {
                    self.reset(id, code::FRAME_SIZE_ERROR);
                } else if dependency(&p) == id {
                    self.reset(id, code::PROTOCOL_ERROR);
                }
                Ok(())
            }
            kind::RST_STREAM => self.on_reset(id, &p),
            kind::SETTINGS => self.on_settings(flags, id, &p),
            kind::PUSH_PROMISE => Err(ConnError(code::PROTOCOL_ERROR)),
            kind::PING => {
                if id != 0 {
                    return Err(ConnError(code::PROTOCOL_ERROR));
                }
                if p.len() != 8 {
                    return Err(ConnError(code::FRAME_SIZE_ERROR));
                }
                if flags & flag::ACK == 0 {
                    frame::head(&mut self.wbuf, 8, kind::PING, flag::ACK, 0);
                    self.wbuf.extend_from_slice(&p);
                }
                Ok(())
            }
            kind::GOAWAY => {
                if id != 0 {
                    return Err(ConnError(code::PROTOCOL_ERROR));
                }
                // Last-stream-id and error code (RFC 9113 §6.8).
                if p.len() < 8 {
                    return Err(ConnError(code::FRAME_SIZE_ERROR));
                }
                // The client opens no more streams: finish the open ones, then close.
                if self.state == State::Open {
                    self.state = State::Closing;
                }
                Ok(())
            }
            kind::WINDOW_UPDATE => self.on_window_update(id, &p),
            kind::CONTINUATION => {
                let Some(c) = self.cont.as_mut() else {
                    return Err(ConnError(code::PROTOCOL_ERROR));
                };
                c.block.extend_from_slice(&p);
                c.frames += 1;
                // A block this large decodes past any header list allowed: a flood; so is
                // a block cut into more pieces than any client needs.
                if block_flood(
                    c.block.len(),
                    c.frames,
                    self.limits.max_header_list as usize,
                    MAX_FRAME,
                ) {
                    return Err(ConnError(code::ENHANCE_YOUR_CALM));
                }
                if flags & flag::END_HEADERS != 0 {
                    if let Some(c) = self.cont.take() {
                        return self.on_block(
                            c.id,
                            c.end_stream,
                            c.self_dependent,
                            c.block.freeze(),
                        );
                    }
                }
                Ok(())
            }
            // Unknown frame types are ignored (RFC 9113 §4.1).
            _ => Ok(()),
        }
    }

    pub(super) fn on_headers(&mut self, flags: u8, id: u32, mut p: Bytes) -> Result<(), ConnError> {
        if id == 0 || id.is_multiple_of(2) {
            return Err(ConnError(code::PROTOCOL_ERROR));
        }
        let pad = strip_pad(flags, &mut p)?;
        let mut self_dependent = false;
        if flags & flag::PRIORITY != 0 {
            if p.len() < 5 {
                return Err(ConnError(code::FRAME_SIZE_ERROR));
            }
            self_dependent = dependency(&p) == id;
            p.advance(5);
        }
        if pad > p.len() {
            return Err(ConnError(code::PROTOCOL_ERROR));
        }
        p.truncate(p.len() - pad);
        let end_stream = flags & flag::END_STREAM != 0;
        if flags & flag::END_HEADERS != 0 {
            return self.on_block(id, end_stream, self_dependent, p);
        }
        let deadline = Instant::now() + self.limits.idle;
        if self.timer.deadline() > deadline {
            self.timer.as_mut().reset(deadline);
        }
        self.cont = Some(Continued {
            id,
            end_stream,
            self_dependent,
            block: BytesMut::from(&p[..]),
            frames: 0,
            deadline,
        });
        Ok(())
    }

    /// A whole header block: a new request, trailers, or an error.
    pub(super) fn on_block(
        &mut self,
        id: u32,
        end_stream: bool,
        self_dependent: bool,
        block: Bytes,
    ) -> Result<(), ConnError> {
        let max_list = self.limits.max_header_list as usize;
        let decoded = self
            .decoder
            .decode(block, max_list)
            .map_err(|_| ConnError(code::COMPRESSION_ERROR))?;
        if let Some(st) = self.streams.get_mut(&id) {
            if st.state == StreamState::HalfClosedRemote {
                self.reset(id, code::STREAM_CLOSED);
                return Ok(());
            }
            if !end_stream || self_dependent || decoded.too_large {
                self.reset(id, code::PROTOCOL_ERROR);
                return Ok(());
            }
            let Ok(trailers) = request::trailers(decoded.fields) else {
                self.reset(id, code::PROTOCOL_ERROR);
                return Ok(());
            };
            if st.length.is_some_and(|l| l != st.received) {
                self.reset(id, code::PROTOCOL_ERROR);
                return Ok(());
            }
            if st.state == StreamState::HalfClosedLocal {
                // Both sides ended: closed.
                self.remove(id, "answered before the body ended");
                return Ok(());
            }
            st.state = StreamState::HalfClosedRemote;
            // Its body is whole: the client no longer decides how long it stays.
            self.held -= std::mem::take(&mut st.held);
            if let Some(tx) = st.recv.take() {
                tx.end(Some(trailers));
            }
            return Ok(());
        }
        if !self.streams.idle(id) {
            return if self.streams.was_reset(id) {
                Ok(())
            } else {
                Err(ConnError(code::STREAM_CLOSED))
            };
        }
        self.streams.opened(id);
        if self_dependent {
            self.reset(id, code::PROTOCOL_ERROR);
            return Ok(());
        }
        if self.state != State::Open {
            // Past our GOAWAY's last stream: ignored; the client may retry elsewhere.
            return Ok(());
        }
        // The `cookie` fields a browser sends one per cookie are one header once joined
        // (as an HTTP/1.1 request carries them), and count as one.
        let too_many = self.limits.max_headers > 0 && {
            let (mut n, mut cookie) = (0, false);
            for f in &decoded.fields {
                match f {
                    hpack::Field::Pseudo(..) => {}
                    hpack::Field::Header(name, _) if *name == http::header::COOKIE => cookie = true,
                    _ => n += 1,
                }
            }
            n + usize::from(cookie) > self.limits.max_headers
        };
        if decoded.too_large || too_many {
            self.answer_now(id, StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE, end_stream);
            return Ok(());
        }
        if self.streams.len() >= self.limits.max_streams as usize {
            self.reset(id, code::REFUSED_STREAM);
            return Ok(());
        }
        // Streams whose body is still to come are kept as long as the client sends it (a
        // byte at a time, if it likes): their literal header bytes may add up to four lists
        // at their largest, so that many such streams cannot hold more than a few lists'
        // worth. A stream that ends with its headers waits on the gateway and the upstream
        // only, whose timeouts bound it. A stream refused here was not processed: the client
        // may send it again, and is not counted for it (it could not know the budget).
        let held = if end_stream { 0 } else { decoded.held };
        if self.held + held > self.limits.max_header_held {
            frame::rst_stream(&mut self.wbuf, id, code::REFUSED_STREAM);
            self.remember(id);
            return Ok(());
        }
        let head = match request::head(decoded.fields) {
            Ok(h) => h,
            Err(why) => {
                tracing::debug!(stream = id, "malformed HTTP/2 request: {why}");
                self.reset(id, code::PROTOCOL_ERROR);
                return Ok(());
            }
        };
        if end_stream && head.length.is_some_and(|l| l != 0) {
            self.reset(id, code::PROTOCOL_ERROR);
            return Ok(());
        }
        let (recv, body) = if end_stream {
            (None, RequestBody::Empty)
        } else {
            let (tx, rx) = Sender::pair(head.length, self.budget.clone());
            self.bodies.push((id, tx.clone()));
            (Some(tx), RequestBody::Http2(rx))
        };
        let is_head = head.parts.method == Method::HEAD;
        let expects_continue = !end_stream
            && head
                .parts
                .headers
                .get(http::header::EXPECT)
                .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
        let length = head.length;
        let fut = (self.make)(head.parts, body);
        let slot = self.exec.spawn(fut);
        if self.slot_ids.len() <= slot {
            self.slot_ids.resize(slot + 1, 0);
        }
        self.slot_ids[slot] = id;
        self.busy = true;
        self.held += held;
        self.streams.insert(
            id,
            Stream {
                slot: Some(slot),
                held,
                recv,
                state: if end_stream {
                    StreamState::HalfClosedRemote
                } else {
                    StreamState::Open
                },
                window_in: RecvWindow::new(
                    i64::from(self.limits.stream_window),
                    self.limits.stream_window,
                ),
                length,
                received: 0,
                window_out: SendWindow::new(self.peer_window),
                out: None,
                head: is_head,
                expects_continue,
                blocked_since: None,
                sent_blocked: 0,
                upstream: false,
                linger_until: None,
            },
        );
        Ok(())
    }

    pub(super) fn on_data(&mut self, flags: u8, id: u32, mut p: Bytes) -> Result<(), ConnError> {
        if id == 0 {
            return Err(ConnError(code::PROTOCOL_ERROR));
        }
        let total = p.len();
        if !self.window_in.take(total) {
            return Err(ConnError(code::FLOW_CONTROL_ERROR));
        }
        let pad = strip_pad(flags, &mut p)?;
        if pad > p.len() {
            return Err(ConnError(code::PROTOCOL_ERROR));
        }
        p.truncate(p.len() - pad);
        let Some(st) = self.streams.get_mut(&id) else {
            self.window_in.owe(total);
            if self.streams.idle(id) {
                return Err(ConnError(code::PROTOCOL_ERROR));
            }
            return if self.streams.was_reset(id) {
                Ok(())
            } else {
                Err(ConnError(code::STREAM_CLOSED))
            };
        };
        if st.state == StreamState::HalfClosedRemote {
            self.window_in.owe(total);
            self.reset(id, code::STREAM_CLOSED);
            return Ok(());
        }
        if !st.window_in.take(total) {
            self.window_in.owe(total);
            self.reset(id, code::FLOW_CONTROL_ERROR);
            return Ok(());
        }
        st.received += p.len() as u64;
        st.expects_continue = false;
        let end = flags & flag::END_STREAM != 0;
        // DATA past the declared length, or an end short of it (RFC 9113 §8.1.1).
        if st
            .length
            .is_some_and(|l| st.received > l || end && st.received != l)
        {
            self.window_in.owe(total);
            self.reset(id, code::PROTOCOL_ERROR);
            return Ok(());
        }
        // Padding is credited at once; the data once it is read.
        let mut unread = total - p.len();
        let len = p.len();
        match &st.recv {
            Some(tx) if tx.push(p) => {}
            // Nobody reads it: credited at once.
            _ => unread += len,
        }
        self.window_in.owe(unread);
        st.give_back(&mut self.wbuf, id, unread);
        if end {
            if st.state == StreamState::HalfClosedLocal {
                // Both sides ended: closed.
                self.remove(id, "answered before the body ended");
                return Ok(());
            }
            st.state = StreamState::HalfClosedRemote;
            self.held -= std::mem::take(&mut st.held);
            if let Some(tx) = st.recv.take() {
                tx.end(None);
            }
        }
        Ok(())
    }

    pub(super) fn on_reset(&mut self, id: u32, p: &[u8]) -> Result<(), ConnError> {
        if p.len() != 4 {
            return Err(ConnError(code::FRAME_SIZE_ERROR));
        }
        if id == 0 || self.streams.idle(id) {
            return Err(ConnError(code::PROTOCOL_ERROR));
        }
        if let Some(st) = self.streams.get(&id) {
            // A client stopping a body whose answer it has is no abuse.
            let answered = st.state == StreamState::HalfClosedLocal;
            if !answered && self.flood.spend_reset(Instant::now()) {
                return Err(ConnError(code::ENHANCE_YOUR_CALM));
            }
            self.remove(id, "stream reset by the client");
        }
        Ok(())
    }

    pub(super) fn on_settings(&mut self, flags: u8, id: u32, p: &[u8]) -> Result<(), ConnError> {
        if id != 0 {
            return Err(ConnError(code::PROTOCOL_ERROR));
        }
        if flags & flag::ACK != 0 {
            return if p.is_empty() {
                Ok(())
            } else {
                Err(ConnError(code::FRAME_SIZE_ERROR))
            };
        }
        if !p.len().is_multiple_of(6) {
            return Err(ConnError(code::FRAME_SIZE_ERROR));
        }
        for s in p.chunks_exact(6) {
            let v = u32::from_be_bytes([s[2], s[3], s[4], s[5]]);
            match u16::from_be_bytes([s[0], s[1]]) {
                frame::ENABLE_PUSH if v > 1 => return Err(ConnError(code::PROTOCOL_ERROR)),
                frame::INITIAL_WINDOW_SIZE => {
                    let v = i64::from(v);
                    if v > MAX_WINDOW {
                        return Err(ConnError(code::FLOW_CONTROL_ERROR));
                    }
                    let delta = v - self.peer_window;
                    self.peer_window = v;
                    for st in self.streams.values_mut() {
                        if !st.window_out.grow(delta) {
                            return Err(ConnError(code::FLOW_CONTROL_ERROR));
                        }
                    }
                }
                frame::MAX_FRAME_SIZE => {
                    if !(16_384..=16_777_215).contains(&v) {
                        return Err(ConnError(code::PROTOCOL_ERROR));
                    }
                    self.peer_frame = v as usize;
                }
                _ => {}
            }
        }
        self.got_settings = true;
        frame::head(&mut self.wbuf, 0, kind::SETTINGS, flag::ACK, 0);
        Ok(())
    }

    pub(super) fn on_window_update(&mut self, id: u32, p: &[u8]) -> Result<(), ConnError> {
        if p.len() != 4 {
            return Err(ConnError(code::FRAME_SIZE_ERROR));
        }
        let inc = i64::from(u32::from_be_bytes([p[0], p[1], p[2], p[3]]) & 0x7fff_ffff);
        if id == 0 {
            if inc == 0 {
                return Err(ConnError(code::PROTOCOL_ERROR));
            }
            if !self.window_out.grow(inc) {
                return Err(ConnError(code::FLOW_CONTROL_ERROR));
            }
            return Ok(());
        }
        if self.streams.idle(id) {
            return Err(ConnError(code::PROTOCOL_ERROR));
        }
        if let Some(st) = self.streams.get_mut(&id) {
            if inc == 0 {
                self.reset(id, code::PROTOCOL_ERROR);
            } else if !st.window_out.grow(inc) {
                self.reset(id, code::FLOW_CONTROL_ERROR);
            }
        }
        Ok(())
    }
}

fn strip_pad(flags: u8, p: &mut Bytes) -> Result<usize, ConnError> {
    if flags & flag::PADDED == 0 {
        return Ok(0);
    }
    if p.is_empty() {
        return Err(ConnError(code::FRAME_SIZE_ERROR));
    }
    let pad = usize::from(p[0]);
    p.advance(1);
    Ok(pad)
}

/// The stream a PRIORITY field depends on.
fn dependency(p: &[u8]) -> u32 {
    u32::from_be_bytes([p[0], p[1], p[2], p[3]]) & 0x7fff_ffff
}
