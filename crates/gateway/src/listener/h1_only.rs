//! An HTTP/2 client on a listener without `h2c`: answered the way HTTP/2 says a server
//! that requires HTTP/1.1 answers (RFC 9113 §3.4 and §7: its preface, then `GOAWAY` with
//! `HTTP_1_1_REQUIRED`), instead of an HTTP/1 error the client cannot read, and closed
//! cleanly once the client has had its say.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{ready, Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// The first line of an HTTP/2 client's connection preface.
const PREFACE_LINE: &[u8] = b"PRI * HTTP/2.0\r\n";

/// An empty `SETTINGS` frame (the server's preface), then `GOAWAY` for no stream with the
/// error `HTTP_1_1_REQUIRED` (0xd).
const REFUSAL: [u8; 26] = [
    0, 0, 0, 0x4, 0, 0, 0, 0, 0, // SETTINGS, empty, stream 0
    0, 0, 8, 0x7, 0, 0, 0, 0, 0, // GOAWAY, 8 bytes, stream 0
    0, 0, 0, 0, // last stream: none
    0, 0, 0, 0xd, // HTTP_1_1_REQUIRED
];

/// Where a connection is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Nothing read yet.
    First,
    /// HTTP/1: bytes pass through.
    Http1,
    /// An HTTP/2 preface came and was refused: what else arrives is taken in and dropped
    /// until the client closes (the HTTP/1.1 server's header timeout bounds the wait).
    Refused,
}

pin_project_lite::pin_project! {
    /// A cleartext connection on an HTTP/1-only listener. Costs one comparison per read.
    pub struct H1Only {
        #[pin]
        io: TcpStream,
        state: State,
    }
}

impl H1Only {
    /// Wraps a freshly accepted connection.
    pub fn new(io: TcpStream) -> Self {
        H1Only {
            io,
            state: State::First,
        }
    }
}

impl AsyncRead for H1Only {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let mut this = self.project();
        match this.state {
            State::Http1 => return this.io.poll_read(cx, buf),
            State::First => {
                let before = buf.filled().len();
                ready!(this.io.as_mut().poll_read(cx, buf))?;
                if !buf.filled()[before..].starts_with(PREFACE_LINE) {
                    *this.state = State::Http1;
                    return Poll::Ready(Ok(()));
                }
                // Nothing of it goes to the HTTP/1.1 server, which would answer in HTTP/1.
                buf.set_filled(before);
                *this.state = State::Refused;
                said_once(this.io.local_addr().ok());
                // A fresh connection's send buffer takes 26 bytes at once.
                let _ = this.io.as_mut().poll_write(cx, &REFUSAL);
                let _ = this.io.as_mut().poll_shutdown(cx);
            }
            State::Refused => {}
        }
        // Taken in, so that the close is a FIN rather than a reset that could destroy the
        // GOAWAY before the client reads it. The end of the client's data is the end here.
        let mut sink = [0u8; 1024];
        loop {
            let mut b = ReadBuf::new(&mut sink);
            ready!(this.io.as_mut().poll_read(cx, &mut b))?;
            if b.filled().is_empty() {
                return Poll::Ready(Ok(()));
            }
        }
    }
}

impl AsyncWrite for H1Only {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.project().io.poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.project().io.poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.project().io.poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.project().io.poll_shutdown(cx)
    }
}

/// An HTTP/2 preface on a listener without `h2c`: say so once per process, at info.
pub fn said_once(listener: Option<std::net::SocketAddr>) {
    static SAID: AtomicBool = AtomicBool::new(false);
    if !SAID.swap(true, Ordering::Relaxed) {
        let listener = listener.map(|a| a.to_string()).unwrap_or_default();
        tracing::info!(
            %listener,
            "a client sent an HTTP/2 preface to a listener without `h2c: true`; refused with \
             GOAWAY (HTTP_1_1_REQUIRED) and closed (said once)"
        );
    }
}
