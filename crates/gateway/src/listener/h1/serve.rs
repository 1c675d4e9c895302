//! One HTTP/1.1 connection, served request after request: the head is read into one
//! buffer (with what follows it: a body, the next pipelined request), the handler answers,
//! the body is read for it while it works, and the answer is written. One deadline per
//! connection covers the wait for a head (`header_timeout`, idle keep-alive included): it
//! is moved by a store per request and re-armed only when it fires early.

use super::chunked::Decoder;
use super::date::with_date;
use super::head::{self, Framing, Head, Limits};
use super::recv::{self, Pump};
use super::send::{self, Asked, Sent, Writer};
use super::upgrade;
use crate::exchange::{ConnInfo, Parts};
use crate::listener::body::RequestBody;
use crate::listener::handler::Handler;
use crate::listener::stop::Stop;
use bytes::BytesMut;
use http::{Method, StatusCode};
use http_body::Body;
use std::future::{poll_fn, Future};
use std::pin::pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::time::Instant;

/// What the wait for a head came to.
enum Waited {
    Read(std::io::Result<usize>),
    TimedOut,
    Stopped,
}

/// The most read (and dropped) from a client after a refusal, before closing, so that the
/// close does not reset the connection under the answer.
const LINGER_BYTES: usize = 64 * 1024;
const LINGER_FOR: Duration = Duration::from_secs(1);

/// A head longer than this leaves the read buffer it grew behind once its request is
/// done: an idle connection holds a small buffer, not one of `max_header_bytes`.
const LARGE_HEAD: usize = 16 * 1024;

/// The most of a request body read and dropped after its answer to keep the connection
/// (nginx discards a body of any size; this bounds what one client can make it read).
const DISCARD_BYTES: u64 = 1024 * 1024;

/// Serves HTTP/1.1 on `io` until the client closes, a request asks to close, the head
/// deadline passes while waiting, or the server stops (then after the request in hand).
pub async fn serve<H, S>(gw: Arc<H>, mut io: S, info: Arc<ConnInfo>, stop: Stop)
where
    H: Handler,
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let limits = Limits {
        max_bytes: info.listener.max_header_bytes,
        max_headers: info.listener.max_headers,
    };
    let header_timeout = info.listener.header_timeout;
    let mut rbuf = BytesMut::new();
    let mut wbuf: Vec<u8> = Vec::new();
    let mut due = Instant::now() + header_timeout;
    let mut deadline = pin!(tokio::time::sleep_until(due));
    let mut stopped = pin!(stop.notify.notified());
    stopped.as_mut().enable();
    loop {
        // The head.
        // How much of the buffer is known not to end a head: bytes that come one at a time
        // are not parsed again and again. A head that comes whole is parsed at once.
        let mut scanned = 0;
        // With whether it was larger than [`LARGE_HEAD`].
        let (head, large_head): (Head, bool) = loop {
            if !rbuf.is_empty() {
                let held = rbuf.len();
                let parsed = if scanned == 0 || head::may_end(&rbuf, scanned) {
                    head::parse(&mut rbuf, limits)
                } else if rbuf.len() > limits.max_bytes {
                    Err(head::TOO_LARGE)
                } else {
                    Ok(None)
                };
                scanned = rbuf.len();
                match parsed {
                    Ok(Some(h)) => break (h, held - rbuf.len() > LARGE_HEAD),
                    Ok(None) => {}
                    Err(r) => {
                        tracing::debug!(peer = ?info.peer_ip, status = r.status, "{}", r.reason);
                        wbuf.clear();
                        let asked_head = head::asks_head(&rbuf);
                        let line = head::request_line(&rbuf);
                        let id = gw.refused_unread(r, asked_head, line, &info);
                        let id = id.as_ref().map(|v| v.as_bytes());
                        with_date(|d| head::refusal_answer(r, asked_head, id, d, &mut wbuf));
                        let _ = io.write_all(&wbuf).await;
                        linger(&mut io, &mut rbuf).await;
                        return;
                    }
                }
            }
            if rbuf.is_empty() && stop.flag.load(Ordering::Acquire) {
                return;
            }
            let waited = poll_fn(|cx| {
                if let Poll::Ready(r) = recv::read_more(&mut io, &mut rbuf, cx) {
                    return Poll::Ready(Waited::Read(r));
                }
                if rbuf.is_empty() && stopped.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(Waited::Stopped);
                }
                // The timer may be set for an earlier wait: it is moved only when it fires.
                while deadline.as_mut().poll(cx).is_ready() {
                    if Instant::now() >= due {
                        return Poll::Ready(Waited::TimedOut);
                    }
                    deadline.as_mut().reset(due);
                }
                Poll::Pending
            })
            .await;
            match waited {
                Waited::Read(Ok(n)) if n > 0 => {}
                // The client closed, failed, took too long or the server stops: nothing
                // is owed (a partial head gets no answer, as nginx and hyper do).
                Waited::Read(_) | Waited::TimedOut | Waited::Stopped => return,
            }
        };

        // The request.
        let asked = Asked {
            head: head.method == Method::HEAD,
            connect: head.method == Method::CONNECT,
            version: head.version,
            trailers: head.te_trailers,
        };
        let (body, mut pump): (RequestBody, Option<Pump>) = match head.framing {
            Framing::Empty => (RequestBody::Empty, None),
            Framing::Length(n) => {
                let (b, p) = recv::channel(Decoder::length(n), head.expect_continue);
                (RequestBody::Http1(b), Some(p))
            }
            Framing::Chunked => {
                let d = Decoder::chunked(limits.max_bytes, limits.max_headers);
                let (b, p) = recv::channel(d, head.expect_continue);
                (RequestBody::Http1(b), Some(p))
            }
        };
        let mut req = Parts::new(head.method, head.uri, head.version, head.headers);
        let handover = head.upgrade.then(|| {
            let (tx, rx) = upgrade::pending();
            req.extensions.insert(rx);
            tx
        });

        // The answer. The connection is watched while the handler works (once the body,
        // if any, has been read whole): a client that goes away (or closes its side, as
        // hyper takes it) takes its request with it (the upstream exchange is dropped, and
        // the request is counted and logged as such); the first bytes of a next request
        // are kept. The handler is polled before the watch: a request is its own from its
        // first poll, so a client that closed at once is counted too.
        let resp = {
            let mut answer = pin!(gw.serve(req, body, &info));
            let mut gone = false;
            poll_fn(|cx| {
                if let Some(p) = pump.as_mut() {
                    p.poll(&mut io, &mut rbuf, cx);
                }
                if let Poll::Ready(resp) = answer.as_mut().poll(cx) {
                    return Poll::Ready(Some(resp));
                }
                // Only while nothing is buffered: a client that sent its next requests
                // and then closed its side still has them answered.
                if !gone && rbuf.is_empty() && pump.as_ref().is_none_or(Pump::finished) {
                    if let Poll::Ready(r) = recv::read_more(&mut io, &mut rbuf, cx) {
                        gone = !matches!(r, Ok(n) if n > 0);
                        if gone {
                            return Poll::Ready(None);
                        }
                        cx.waker().wake_by_ref();
                    }
                }
                Poll::Pending
            })
            .await
        };
        let Some(resp) = resp else {
            tracing::debug!(peer = ?info.peer_ip, "the client left before its answer");
            return;
        };
        let (parts, body) = resp.into_parts();
        let mut keep_alive = head.keep_alive && !stop.flag.load(Ordering::Acquire);
        if let Some(p) = pump.as_mut() {
            // A body no one reads any more: the connection is kept only if its rest is
            // here, and the answer says so when it is not. So is a body the client may
            // hold back for a `100 Continue` that will not come (unless it sent the body
            // anyway, as RFC 9110 lets it, and all of it is here), and one with more
            // still to come than would be dropped after the answer.
            let skipped = p.abandoned() && p.skip_buffered(&mut rbuf);
            if ((p.withheld() || p.abandoned()) && !skipped) || p.rest_over(DISCARD_BYTES) {
                keep_alive = false;
            }
            if poll_fn(|cx| p.poll_answering(&mut io, cx)).await.is_err() {
                return;
            }
        }
        wbuf.clear();
        let exact = body.size_hint().exact();
        let empty = body.is_end_stream();
        let (coding, mut keep_alive, trailers) =
            with_date(|d| send::encode_head(&parts, exact, empty, asked, keep_alive, d, &mut wbuf));
        let switched = parts.status == StatusCode::SWITCHING_PROTOCOLS
            || (asked.connect && parts.status.is_success());
        if let (true, Some(handover)) = (switched, handover) {
            // A body sent with the upgrade request is not the new protocol's: it is skipped
            // if it is all here, else the connection is not handed over.
            if let Some(p) = pump.as_mut() {
                if !p.skip_buffered(&mut rbuf) {
                    tracing::debug!(peer = ?info.peer_ip, "upgrade with an unread body: closed");
                    linger(&mut io, &mut rbuf).await;
                    return;
                }
            }
            if io.write_all(&wbuf).await.is_err() || io.flush().await.is_err() {
                return;
            }
            // What the client sent past the request is the upgraded protocol's.
            if !handover.hand_over(io, rbuf.split().freeze()) {
                tracing::debug!(peer = ?info.peer_ip, "upgrade answered but not taken");
            }
            return;
        }
        let mut writer = Writer::new(body, coding, trailers);
        let sent = poll_fn(|cx| {
            if let Some(p) = pump.as_mut() {
                p.poll(&mut io, &mut rbuf, cx);
            }
            writer.poll(&mut io, &mut wbuf, cx)
        })
        .await;
        drop(writer);
        match sent {
            Ok(Sent::Whole) => {}
            Ok(Sent::Close) => keep_alive = false,
            Err(e) => {
                tracing::debug!(peer = ?info.peer_ip, "answer not written: {e}");
                return;
            }
        }
        // A body the handler did not read whole (an upstream that answered before it
        // ended): the answer promised to keep the connection, so the body's rest is read
        // and dropped, within bounds; past them the connection is closed.
        if let Some(mut p) = pump.take() {
            if keep_alive && !p.skip_buffered(&mut rbuf) {
                // A server that stops does not wait on the rest: the connection closes.
                let wait = info.listener.body_timeout;
                keep_alive = !stop.flag.load(Ordering::Acquire)
                    && p.discard(&mut io, &mut rbuf, DISCARD_BYTES, wait).await;
            }
        }
        // An idle connection keeps a write buffer the size of a small answer, not of the
        // largest it ever wrote.
        if wbuf.capacity() > 32 * 1024 {
            wbuf = Vec::new();
        }
        // Nor the read buffer a large head grew (up to `max_header_bytes`): the head's
        // bytes are gone with the request, and the next read starts a small buffer.
        if large_head && rbuf.is_empty() {
            rbuf = BytesMut::new();
        }
        if !keep_alive {
            linger(&mut io, &mut rbuf).await;
            return;
        }
        due = Instant::now() + header_timeout;
    }
}

/// Reads and drops what the client still sends, briefly and up to a bound, so that closing
/// with unread bytes does not reset the connection before the client has read its answer.
async fn linger<S: AsyncRead + AsyncWrite + Unpin>(io: &mut S, buf: &mut BytesMut) {
    let _ = io.shutdown().await;
    let mut taken = 0;
    let _ = tokio::time::timeout(LINGER_FOR, async {
        while taken < LINGER_BYTES {
            buf.clear();
            match poll_fn(|cx| recv::read_more(io, buf, cx)).await {
                Ok(n) if n > 0 => taken += n,
                _ => return,
            }
        }
    })
    .await;
}
