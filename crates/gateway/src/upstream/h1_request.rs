//! The lean HTTP/1.1 client's request side: the head written with one `write`, a body read
//! whole written with it, a streaming body written as it comes (with `Content-Length` or
//! chunked) while the response head is awaited, and after it by the response body (full
//! duplex); the response head parsed in place.

use super::body::{BodyFault, UpBody};
use super::h1::{parse_head, H1Conn, H1Error, Head, Parsed, MAX_HEAD};
use super::h1_response::H1Body;
use super::h1_upload::{Upload, UploadError};
use crate::exchange::Fields;
use crate::listener::h1::head::may_end;
use bytes::{Buf, Bytes};
use http::header::{self, HeaderValue};
use http::{Method, StatusCode};
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::task::coop;
use tokio::time::Instant;

/// A deadline past any wait a config can set, for a wait too long to add to now.
const FAR: Duration = Duration::from_secs(86_400 * 365 * 30);

/// A request body as the lean client frames it ([`frame_request`]).
pub enum Outgoing<'a> {
    /// Read whole: written with the head, and can be sent again.
    Whole(&'a [Bytes]),
    /// Coming from the client: written as it comes, once ([`H1Conn::exchange`]).
    Streaming,
}

/// How a request body is framed on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// `Content-Length` (the client's, or the whole body's length).
    Length,
    /// `Transfer-Encoding: chunked`, for a streaming body of unknown length.
    Chunked,
}

/// Sets the framing headers of a request with `body` and says how it is framed. A body
/// read whole goes with the length of what was read (the gateway's own count, as nginx
/// sends it; none for no body unless the client declared one); a streaming body keeps the
/// length the client declared (which the listener holds it to), written plainly, or goes
/// chunked.
pub fn frame_request(headers: &mut Fields, body: &Outgoing<'_>) -> Framing {
    match body {
        Outgoing::Whole(chunks) => {
            let n: usize = chunks.iter().map(Bytes::len).sum();
            if n > 0 || headers.contains_key(header::CONTENT_LENGTH) {
                let mut digits = itoa::Buffer::new();
                if let Ok(v) = HeaderValue::from_str(digits.format(n)) {
                    headers.insert(header::CONTENT_LENGTH, v);
                }
            }
            Framing::Length
        }
        Outgoing::Streaming => {
            // The number the listener framed the body by, written plainly and once (a
            // client's `070000` or repeated copies could be read otherwise upstream).
            let declared = headers
                .get(header::CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok())
                .filter(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|v| v.parse::<u64>().ok());
            if let Some(n) = declared {
                let mut digits = itoa::Buffer::new();
                if let Ok(v) = HeaderValue::from_str(digits.format(n)) {
                    headers.insert(header::CONTENT_LENGTH, v);
                    return Framing::Length;
                }
            }
            // A length that is not plain digits (the listener does not let one through)
            // is not passed on: the body goes chunked.
            headers.remove(header::CONTENT_LENGTH);
            headers.insert(
                header::TRANSFER_ENCODING,
                HeaderValue::from_static("chunked"),
            );
            Framing::Chunked
        }
    }
}

/// Why an exchange with a body failed before its answer.
#[derive(Debug)]
pub enum SendError {
    /// The head could not be written whole: the upstream has no complete request, and a
    /// streaming body has not been touched. It can go elsewhere, whatever its method.
    Unsent(io::Error),
    /// The client's body broke (its fault is in the body's watch).
    Body(BodyFault),
    /// As [`H1Error`].
    H1(H1Error),
    /// No response head came within the exchange's wait.
    TimedOut,
}

impl H1Conn {
    /// Sends a request whose bytes are all in `bytes` (a head of `head` bytes, and a body
    /// read whole or none) and reads the response head, within `wait` (else
    /// [`SendError::TimedOut`]). One state machine, write and read inline: this is the hot
    /// path. The deadline is the connection's own timer, moved for each exchange: a timer
    /// made and dropped per request cost its registration and removal in the runtime's
    /// timer wheel.
    pub async fn exchange_whole(
        mut self,
        bytes: &[u8],
        head: usize,
        method: &Method,
        wait: Duration,
    ) -> Result<(Head, H1Body), SendError> {
        let now = Instant::now();
        let deadline = now.checked_add(wait).unwrap_or(now + FAR);
        let mut timer = match self.timer.take() {
            Some(mut t) => {
                t.as_mut().reset(deadline);
                t
            }
            None => Box::pin(tokio::time::sleep_until(deadline)),
        };
        let mut written = 0;
        // Closed before any byte of a response: the request may be replayed. After some,
        // the exchange is broken, never replayed.
        let mut received = false;
        let parsed = std::future::poll_fn(|cx| {
            let had_budget = coop::has_budget_remaining();
            let polled = self.poll_whole(cx, bytes, head, method, &mut written, &mut received);
            if polled.is_ready() {
                return polled;
            }
            // An upstream that keeps the exchange busy (a flood of 1xx heads) can spend
            // the task's whole budget: the timer is then looked at outside it, or it would
            // never fire (as `tokio::time::Timeout` does).
            let fired = if had_budget && !coop::has_budget_remaining() {
                Pin::new(&mut coop::unconstrained(timer.as_mut())).poll(cx)
            } else {
                timer.as_mut().poll(cx)
            };
            match fired {
                Poll::Ready(()) => Poll::Ready(Err(SendError::TimedOut)),
                Poll::Pending => Poll::Pending,
            }
        })
        .await;
        self.timer = Some(timer);
        let (head, _, framing, keep_alive) = parsed?;
        Ok((head, H1Body::new(self, framing, keep_alive)))
    }

    /// Writes what is left of `bytes`, then reads until a response head is whole.
    fn poll_whole(
        &mut self,
        cx: &mut Context<'_>,
        bytes: &[u8],
        head: usize,
        method: &Method,
        written: &mut usize,
        received: &mut bool,
    ) -> Poll<Result<Parsed, SendError>> {
        while *written < bytes.len() {
            let e = match ready!(Pin::new(&mut self.stream).poll_write(cx, &bytes[*written..])) {
                Ok(0) => io::Error::from(io::ErrorKind::WriteZero),
                Ok(n) => {
                    *written += n;
                    continue;
                }
                Err(e) => e,
            };
            // Before the head is written whole, the upstream has no request.
            return Poll::Ready(Err(if *written < head {
                SendError::Unsent(e)
            } else {
                SendError::H1(H1Error::Closed(e))
            }));
        }
        loop {
            match self.take_head(method) {
                Ok(Some(parsed)) => return Poll::Ready(Ok(parsed)),
                Ok(None) => {}
                Err(e) => return Poll::Ready(Err(SendError::H1(e))),
            }
            let e = match ready!(self.poll_fill(cx)) {
                Ok(0) => io::Error::from(io::ErrorKind::UnexpectedEof),
                Ok(_) => {
                    *received = true;
                    continue;
                }
                Err(e) => e,
            };
            return Poll::Ready(Err(SendError::H1(if *received {
                H1Error::Malformed
            } else {
                H1Error::Closed(e)
            })));
        }
    }

    /// Sends a request (`head`, then a body streaming from the client, framed as
    /// `framing`) and reads the response head. The body goes on being sent after the head,
    /// by the response body. The body is taken from `slot` once the head is written whole:
    /// until then, a request that fails can go elsewhere with it. The caller bounds the
    /// wait (`forward.rs`: the body's stalls, then the response timeout).
    pub async fn exchange(
        mut self,
        head: &[u8],
        method: &Method,
        slot: &mut Option<UpBody>,
        framing: Framing,
    ) -> Result<(Head, H1Body), SendError> {
        let Some(body) = slot.take() else {
            return Err(SendError::Unsent(io::ErrorKind::InvalidInput.into()));
        };
        if let Err(e) = self.stream.write_all(head).await {
            // The head did not go whole, and nothing of the body went: the upstream has no
            // request, and the body can go elsewhere.
            *slot = Some(body);
            return Err(SendError::Unsent(e));
        }
        let mut upload = Some(Upload::new(body, framing == Framing::Chunked));
        let (mut received, mut complete) = (false, true);
        let (head, _, framing, keep_alive) = std::future::poll_fn(|cx| {
            self.poll_head_uploading(cx, method, &mut upload, &mut received, &mut complete)
        })
        .await?;
        let mut body = H1Body::new(self, framing, keep_alive && complete);
        if let Some(up) = upload {
            body.uploading(up);
        }
        Ok((head, body))
    }

    /// Polls for the response head while `upload` goes on; `complete` turns false when
    /// the upstream stopped taking the body (its answer may still come).
    fn poll_head_uploading(
        &mut self,
        cx: &mut Context<'_>,
        method: &Method,
        upload: &mut Option<Upload>,
        received: &mut bool,
        complete: &mut bool,
    ) -> Poll<Result<Parsed, SendError>> {
        if let Some(up) = upload.as_mut() {
            match up.poll_send(&mut self.stream, cx) {
                Poll::Ready(Ok(())) => *upload = None,
                Poll::Ready(Err(UploadError::Body(fault))) => {
                    return Poll::Ready(Err(SendError::Body(fault)))
                }
                Poll::Ready(Err(UploadError::Io(e))) => {
                    tracing::debug!("upstream stopped taking the request body: {e}");
                    *upload = None;
                    *complete = false;
                }
                Poll::Pending => {}
            }
        }
        loop {
            match self.take_head(method) {
                Ok(Some(parsed)) => return Poll::Ready(Ok(parsed)),
                Ok(None) => {}
                Err(e) => return Poll::Ready(Err(SendError::H1(e))),
            }
            let failed = match std::task::ready!(self.poll_fill(cx)) {
                Ok(0) => io::Error::from(io::ErrorKind::UnexpectedEof),
                Ok(_) => {
                    *received = true;
                    continue;
                }
                Err(e) => e,
            };
            return Poll::Ready(Err(SendError::H1(if *received {
                H1Error::Malformed
            } else {
                H1Error::Closed(failed)
            })));
        }
    }

    /// The response head in the buffer, if it is whole (1xx answers skipped).
    fn take_head(&mut self, method: &Method) -> Result<Option<Parsed>, H1Error> {
        while !self.buf.is_empty() {
            // Parsed at once on a first look, then only once the end of a head may have
            // come, as the listener does.
            let parsed = if self.scanned == 0 || may_end(&self.buf, self.scanned) {
                parse_head(&self.buf, method)?
            } else {
                None
            };
            let Some(parsed) = parsed else {
                if self.buf.len() > MAX_HEAD {
                    return Err(H1Error::Malformed);
                }
                self.scanned = self.buf.len();
                return Ok(None);
            };
            self.scanned = 0;
            self.buf.advance(parsed.1);
            // A switch of protocols nobody asked for (upgrades take another client): no
            // answer follows it on this connection.
            if parsed.0.status == StatusCode::SWITCHING_PROTOCOLS {
                return Err(H1Error::Switched);
            }
            // 100 Continue and the like: the real answer follows.
            if !parsed.0.status.is_informational() {
                return Ok(Some(parsed));
            }
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_framing_follows_what_the_client_declared_and_the_body() {
        let mut h = Fields::default();
        h.insert(header::CONTENT_LENGTH, HeaderValue::from_static("3"));
        assert_eq!(frame_request(&mut h, &Outgoing::Streaming), Framing::Length);
        assert_eq!(
            *h.get(header::CONTENT_LENGTH).expect("set"),
            "3",
            "a streaming body keeps it"
        );
        h.insert(header::CONTENT_LENGTH, HeaderValue::from_static("070000"));
        assert_eq!(frame_request(&mut h, &Outgoing::Streaming), Framing::Length);
        assert_eq!(
            *h.get(header::CONTENT_LENGTH).expect("set"),
            "70000",
            "written plainly: no leading zeros an octal reader would take"
        );
        let three = [Bytes::from_static(b"abc")];
        h.insert(header::CONTENT_LENGTH, HeaderValue::from_static("03"));
        assert_eq!(
            frame_request(&mut h, &Outgoing::Whole(&three)),
            Framing::Length
        );
        assert_eq!(
            *h.get(header::CONTENT_LENGTH).expect("set"),
            "3",
            "a whole body goes with its own count"
        );
        let mut h = Fields::default();
        let chunks = [Bytes::from_static(b"ab"), Bytes::from_static(b"cde")];
        assert_eq!(
            frame_request(&mut h, &Outgoing::Whole(&chunks)),
            Framing::Length
        );
        assert_eq!(*h.get(header::CONTENT_LENGTH).expect("set"), "5");
        let mut h = Fields::default();
        assert_eq!(
            frame_request(&mut h, &Outgoing::Whole(&[])),
            Framing::Length
        );
        assert!(
            !h.contains_key(header::CONTENT_LENGTH),
            "no length for no body"
        );
        let mut h = Fields::default();
        assert_eq!(
            frame_request(&mut h, &Outgoing::Streaming),
            Framing::Chunked
        );
        assert_eq!(*h.get(header::TRANSFER_ENCODING).expect("set"), "chunked");
    }
}
