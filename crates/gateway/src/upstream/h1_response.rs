//! The lean HTTP/1.1 client's response body: read from the connection by its framing
//! (`Content-Length`, chunked, or until close), the rest of a streaming request body sent
//! on the way; the connection goes back to its pool when both have ended.

use super::h1::{parse_chunk_size, Framing, H1Conn, Pool, MAX_HEAD};
use super::h1_upload::{Upload, UploadError};
use bytes::{Buf, Bytes};
use std::io;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

enum Chunk {
    /// Reading a chunk-size line.
    Size,
    /// In a chunk's data, this many bytes left (then CRLF).
    Data(u64),
    /// Expecting the CRLF after a chunk's data.
    DataEnd,
    /// After the last chunk: trailers until an empty line.
    Trailers,
}

enum State {
    Length(u64),
    Chunked(Chunk),
    UntilClose,
    Done,
}

/// A response body read from an [`H1Conn`]; gives the connection back to its pool at the end.
pub struct H1Body {
    conn: Option<H1Conn>,
    /// The rest of a request body still going up while the answer comes down (full
    /// duplex); the connection is kept only once it has all gone.
    upload: Option<Box<Upload>>,
    state: State,
    keep_alive: bool,
    pool: Option<Arc<Pool>>,
}

impl H1Body {
    pub(super) fn new(conn: H1Conn, framing: Framing, keep_alive: bool) -> H1Body {
        let state = match framing {
            Framing::Empty | Framing::Length(0) => State::Done,
            Framing::Length(n) => State::Length(n),
            Framing::Chunked => State::Chunked(Chunk::Size),
            Framing::UntilClose => State::UntilClose,
        };
        H1Body {
            conn: Some(conn),
            upload: None,
            state,
            keep_alive,
            pool: None,
        }
    }

    /// A body with nothing left and no connection.
    pub(crate) fn closed() -> H1Body {
        H1Body {
            conn: None,
            upload: None,
            state: State::Done,
            keep_alive: false,
            pool: None,
        }
    }

    /// Sends the rest of a request body while this body is read (full duplex).
    pub(super) fn uploading(&mut self, upload: Upload) {
        self.upload = Some(Box::new(upload));
    }

    /// Returns the connection to `pool` once the body is read.
    pub(crate) fn with_pool(mut self, pool: Arc<Pool>) -> Self {
        self.pool = Some(pool);
        if matches!(self.state, State::Done) {
            self.finish();
        }
        self
    }

    /// Whether nothing is left to read.
    pub fn is_done(&self) -> bool {
        matches!(self.state, State::Done)
    }

    /// Bytes left, when known.
    pub fn remaining(&self) -> Option<u64> {
        match self.state {
            State::Length(n) => Some(n),
            State::Done => Some(0),
            _ => None,
        }
    }

    fn finish(&mut self) {
        self.state = State::Done;
        // A request body not sent whole leaves the connection in no state to reuse.
        let reusable = self.keep_alive && self.upload.is_none();
        self.upload = None;
        if let (Some(conn), Some(pool), true) = (self.conn.take(), &self.pool, reusable) {
            // Bytes past the response (not asked for) make the connection unusable.
            if conn.buf.is_empty() {
                pool.checkin(conn);
            }
        }
    }

    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        match self.conn.as_mut() {
            Some(conn) => conn.poll_fill(cx),
            None => Poll::Ready(Ok(0)),
        }
    }

    /// Ends the body here: the connection is closed, never pooled.
    fn end(&mut self) {
        self.state = State::Done;
        self.conn = None;
        self.upload = None;
    }

    /// The next piece of body, `None` at the end. After an error there is nothing more: the
    /// connection's state is unknown, and it is closed.
    pub fn poll_data(&mut self, cx: &mut Context<'_>) -> Poll<Option<io::Result<Bytes>>> {
        let polled = self.poll_next(cx);
        if let Poll::Ready(Some(Err(_))) = &polled {
            self.end();
        }
        polled
    }

    fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Option<io::Result<Bytes>>> {
        if let (Some(up), Some(conn)) = (self.upload.as_mut(), self.conn.as_mut()) {
            match up.poll_send(&mut conn.stream, cx) {
                Poll::Ready(Ok(())) => self.upload = None,
                // The upstream stopped taking the body: its answer may still come, and the
                // connection closes after it.
                Poll::Ready(Err(UploadError::Io(e))) => {
                    tracing::debug!("upstream stopped taking the request body: {e}");
                    self.upload = None;
                    self.keep_alive = false;
                }
                // The client's body broke: the upstream waits for a rest that never comes.
                Poll::Ready(Err(UploadError::Body(fault))) => {
                    self.end();
                    return Poll::Ready(Some(Err(io::Error::other(format!(
                        "request body broke: {fault}"
                    )))));
                }
                Poll::Pending => {}
            }
        }
        loop {
            let buffered = self.conn.as_ref().map_or(0, |c| c.buf.len());
            match &mut self.state {
                State::Done => return Poll::Ready(None),
                State::Length(left) => {
                    if buffered > 0 {
                        let take = (*left).min(buffered as u64) as usize;
                        let Some(conn) = self.conn.as_mut() else {
                            return Poll::Ready(None);
                        };
                        let data = conn.buf.split_to(take).freeze();
                        *left -= take as u64;
                        if *left == 0 {
                            self.finish();
                        }
                        return Poll::Ready(Some(Ok(data)));
                    }
                }
                State::UntilClose => {
                    if buffered > 0 {
                        let Some(conn) = self.conn.as_mut() else {
                            return Poll::Ready(None);
                        };
                        return Poll::Ready(Some(Ok(conn.buf.split().freeze())));
                    }
                }
                State::Chunked(chunk) => {
                    let Some(conn) = self.conn.as_mut() else {
                        return Poll::Ready(None);
                    };
                    match chunk {
                        Chunk::Size | Chunk::Trailers => {
                            // A line ends at its LF, which a CR must come before: a bare LF
                            // is refused at once (other readers end the line there), not
                            // waited past.
                            let lf = conn.buf.iter().position(|b| *b == b'\n');
                            // So is a control byte, a CR but right before the LF included,
                            // before the line's end comes (or at once, if it never does).
                            let upto = lf.unwrap_or(conn.buf.len());
                            let stray = conn.buf[..upto].iter().enumerate().any(|(i, &b)| {
                                let cr_at_end = b == b'\r' && (i + 1 == upto);
                                (b < 0x20 && b != b'\t' && !cr_at_end) || b == 0x7f
                            });
                            if stray {
                                return Poll::Ready(Some(Err(io::ErrorKind::InvalidData.into())));
                            }
                            if let Some(lf) = lf {
                                if lf == 0 || conn.buf[lf - 1] != b'\r' {
                                    return Poll::Ready(Some(Err(
                                        io::ErrorKind::InvalidData.into()
                                    )));
                                }
                                let end = lf - 1;
                                let line = conn.buf.split_to(lf + 1);
                                let line = &line[..end];
                                if matches!(chunk, Chunk::Trailers) {
                                    if line.is_empty() {
                                        self.finish();
                                        return Poll::Ready(None);
                                    }
                                    // Trailers are not passed on, and an odd one (a
                                    // space before its colon, a fold) is dropped as they
                                    // are; a control byte another reader could end the
                                    // line at ends the answer.
                                    if !super::h1::field_text(line) {
                                        return Poll::Ready(Some(Err(
                                            io::ErrorKind::InvalidData.into()
                                        )));
                                    }
                                    continue;
                                }
                                *chunk = match parse_chunk_size(line) {
                                    Some(0) => Chunk::Trailers,
                                    Some(n) => Chunk::Data(n),
                                    None => {
                                        return Poll::Ready(Some(Err(
                                            io::ErrorKind::InvalidData.into()
                                        )))
                                    }
                                };
                                continue;
                            }
                            if buffered > MAX_HEAD {
                                return Poll::Ready(Some(Err(io::ErrorKind::InvalidData.into())));
                            }
                        }
                        Chunk::Data(left) => {
                            if buffered > 0 {
                                let take = (*left).min(buffered as u64) as usize;
                                let data = conn.buf.split_to(take).freeze();
                                *left -= take as u64;
                                if *left == 0 {
                                    *chunk = Chunk::DataEnd;
                                }
                                return Poll::Ready(Some(Ok(data)));
                            }
                        }
                        Chunk::DataEnd => {
                            if buffered >= 2 {
                                if &conn.buf[..2] != b"\r\n" {
                                    return Poll::Ready(Some(Err(
                                        io::ErrorKind::InvalidData.into()
                                    )));
                                }
                                conn.buf.advance(2);
                                *chunk = Chunk::Size;
                                continue;
                            }
                        }
                    }
                }
            }
            match ready!(self.poll_fill(cx)) {
                Ok(0) => {
                    if matches!(self.state, State::UntilClose) {
                        self.state = State::Done;
                        self.conn = None;
                        return Poll::Ready(None);
                    }
                    self.conn = None;
                    self.state = State::Done;
                    return Poll::Ready(Some(Err(io::ErrorKind::UnexpectedEof.into())));
                }
                Ok(_) => {}
                Err(e) => {
                    self.conn = None;
                    self.state = State::Done;
                    return Poll::Ready(Some(Err(e)));
                }
            }
        }
    }
}
