//! The rest of a streaming request body on its way up the lean client's connection,
//! written as it comes and as the connection takes it, without waiting on either: polled
//! while the response head is awaited, then by the response body (full duplex).

use super::body::{BodyFault, UpBody};
use http_body::Body;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use tokio::io::AsyncWrite;
use tokio::net::TcpStream;

/// A request body being sent.
pub(super) struct Upload {
    body: UpBody,
    /// Framed with chunks (else by the length the request declared).
    chunked: bool,
    /// Bytes framed and not yet written, from `pos`.
    out: Vec<u8>,
    pos: usize,
    /// The body has ended: once `out` is written, all of it is sent.
    ended: bool,
}

/// Why an upload stopped.
#[derive(Debug)]
pub(super) enum UploadError {
    /// The client's body broke (its fault is in the body's watch).
    Body(BodyFault),
    /// The upstream stopped taking it.
    Io(io::Error),
}

impl Upload {
    /// An upload of `body`, chunked or not.
    pub(super) fn new(body: UpBody, chunked: bool) -> Self {
        Upload {
            body,
            chunked,
            out: Vec::new(),
            pos: 0,
            ended: false,
        }
    }

    /// Sends what the body has and `stream` takes; `Ready(Ok)` once all of it is sent.
    pub(super) fn poll_send(
        &mut self,
        stream: &mut TcpStream,
        cx: &mut Context<'_>,
    ) -> Poll<Result<(), UploadError>> {
        loop {
            while self.pos < self.out.len() {
                match Pin::new(&mut *stream).poll_write(cx, &self.out[self.pos..]) {
                    Poll::Ready(Ok(0)) => {
                        return Poll::Ready(Err(UploadError::Io(io::ErrorKind::WriteZero.into())))
                    }
                    Poll::Ready(Ok(n)) => self.pos += n,
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(UploadError::Io(e))),
                    Poll::Pending => return Poll::Pending,
                }
            }
            self.out.clear();
            self.pos = 0;
            if self.ended {
                return Poll::Ready(Ok(()));
            }
            let frame = match Pin::new(&mut self.body).poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(None) => {
                    if self.chunked {
                        self.out.extend_from_slice(b"0\r\n\r\n");
                    }
                    self.ended = true;
                    continue;
                }
                Poll::Ready(Some(Err(fault))) => return Poll::Ready(Err(UploadError::Body(fault))),
                Poll::Ready(Some(Ok(frame))) => frame,
            };
            match frame.into_data() {
                Ok(data) if data.is_empty() => {}
                Ok(data) if self.chunked => {
                    let mut digits = [0u8; 16];
                    self.out.extend_from_slice(hex(data.len(), &mut digits));
                    self.out.extend_from_slice(b"\r\n");
                    self.out.extend_from_slice(&data);
                    self.out.extend_from_slice(b"\r\n");
                }
                Ok(data) => self.out.extend_from_slice(&data),
                Err(_trailers) => {
                    // Trailers end the body. The client's are not sent on: the gateway's
                    // rules on headers (owned names, forwarding) read the head alone, and
                    // an upstream that merges trailers into headers would trust forged ones
                    // (as hyper's client and nginx, nothing but the last chunk goes).
                    if self.chunked {
                        self.out.extend_from_slice(b"0\r\n\r\n");
                    }
                    self.ended = true;
                }
            }
        }
    }
}

/// `n` in lowercase hexadecimal, written into `buf`.
fn hex(mut n: usize, buf: &mut [u8; 16]) -> &[u8] {
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b"0123456789abcdef"[n % 16];
        n /= 16;
        if n == 0 || i == 0 {
            break;
        }
    }
    &buf[i..]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_sizes_are_lowercase_hex() {
        let mut b = [0u8; 16];
        assert_eq!(hex(0, &mut b), b"0");
        assert_eq!(hex(255, &mut b), b"ff");
        assert_eq!(hex(65_536, &mut b), b"10000");
    }
}
