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
    /// What came so far is the start of the preface line (held in `stash`): more is read,
    /// no further than the line's end, until it is told apart.
    Partial,
    /// HTTP/1: bytes pass through (after what `stash` holds of them).
    Http1,
    /// An HTTP/2 preface came and was refused: what else arrives is taken in and dropped
    /// until the client closes (the HTTP/1.1 server's header timeout bounds the wait).
    Refused,
}

pin_project_lite::pin_project! {
    /// A cleartext connection on an HTTP/1-only listener. Costs one comparison per read
    /// once the first bytes are told apart from the preface.
    pub struct H1Only {
        #[pin]
        io: TcpStream,
        state: State,
        // The first bytes, while they may be the preface line coming in pieces.
        stash: [u8; 16],
        // How much `stash` holds, and how much of it was given to the reader.
        stashed: u8,
        given: u8,
    }
}

const _: () = assert!(PREFACE_LINE.len() == 16, "the stash holds the preface line");

impl H1Only {
    /// Wraps a freshly accepted connection.
    pub fn new(io: TcpStream) -> Self {
        H1Only {
            io,
            state: State::First,
            stash: [0; 16],
            stashed: 0,
            given: 0,
        }
    }
}

/// Whether `got` may still be the preface line: it starts it, but is shorter.
fn starts_preface(got: &[u8]) -> bool {
    !got.is_empty() && got.len() < PREFACE_LINE.len() && PREFACE_LINE.starts_with(got)
}

impl AsyncRead for H1Only {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let mut this = self.project();
        loop {
            match this.state {
                State::Http1 if this.given < this.stashed => {
                    // Bytes held while the preface was told apart come first.
                    let held = &this.stash[usize::from(*this.given)..usize::from(*this.stashed)];
                    let n = held.len().min(buf.remaining());
                    buf.put_slice(&held[..n]);
                    *this.given += n as u8;
                    return Poll::Ready(Ok(()));
                }
                State::Http1 => return this.io.poll_read(cx, buf),
                State::First => {
                    let before = buf.filled().len();
                    ready!(this.io.as_mut().poll_read(cx, buf))?;
                    let got = &buf.filled()[before..];
                    if starts_preface(got) {
                        // The preface in pieces: held until the line is told apart.
                        this.stash[..got.len()].copy_from_slice(got);
                        *this.stashed = got.len() as u8;
                        buf.set_filled(before);
                        *this.state = State::Partial;
                        continue;
                    }
                    if !got.starts_with(PREFACE_LINE) {
                        *this.state = State::Http1;
                        return Poll::Ready(Ok(()));
                    }
                    // Nothing of it goes to the HTTP/1.1 server, which would answer in HTTP/1.
                    buf.set_filled(before);
                }
                State::Partial => {
                    let have = usize::from(*this.stashed);
                    let mut more = ReadBuf::new(&mut this.stash[have..PREFACE_LINE.len()]);
                    ready!(this.io.as_mut().poll_read(cx, &mut more))?;
                    let n = more.filled().len();
                    *this.stashed += n as u8;
                    let got = &this.stash[..usize::from(*this.stashed)];
                    // The client's end, or bytes that are not the preface: HTTP/1 all along.
                    if n == 0 || !PREFACE_LINE.starts_with(got) {
                        *this.state = State::Http1;
                        continue;
                    }
                    if got.len() < PREFACE_LINE.len() {
                        continue;
                    }
                }
                State::Refused => break,
            }
            // Only the whole preface line comes here: refused.
            *this.state = State::Refused;
            said_once(this.io.local_addr().ok());
            // A fresh connection's send buffer takes 26 bytes at once.
            let _ = this.io.as_mut().poll_write(cx, &REFUSAL);
            let _ = this.io.as_mut().poll_shutdown(cx);
            break;
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

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    /// A connected pair: the client's end, and the server's end wrapped once `first` has
    /// arrived there whole (so the wrapper's first read takes exactly it).
    async fn pair(first: &[u8]) -> (TcpStream, H1Only) {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let mut client = TcpStream::connect(l.local_addr().expect("addr"))
            .await
            .expect("connect");
        let (server, _) = l.accept().await.expect("accept");
        client.write_all(first).await.expect("write");
        let mut peek = vec![0u8; first.len()];
        loop {
            let n = server.peek(&mut peek).await.expect("peek");
            if n == first.len() {
                break;
            }
        }
        (client, H1Only::new(server))
    }

    /// Everything `io` gives until the end.
    async fn rest(io: &mut H1Only) -> Vec<u8> {
        let mut got = Vec::new();
        io.read_to_end(&mut got).await.expect("read");
        got
    }

    /// Polls one read of `io` without waiting: whether it is still waiting for bytes.
    fn waits(io: &mut H1Only) -> bool {
        let mut b = [0u8; 64];
        let mut rb = ReadBuf::new(&mut b);
        let mut cx = Context::from_waker(std::task::Waker::noop());
        Pin::new(io).poll_read(&mut cx, &mut rb).is_pending()
    }

    #[tokio::test]
    async fn a_preface_in_pieces_is_refused_as_a_whole_one_is() {
        let (mut client, mut server) = pair(b"PRI * HT").await;
        assert!(waits(&mut server), "half a preface line is held, not given");
        client
            .write_all(b"TP/2.0\r\n\r\nSM\r\n\r\n")
            .await
            .expect("write");
        client.shutdown().await.expect("shutdown");
        let got = rest(&mut server).await;
        assert!(got.is_empty(), "nothing of it reaches HTTP/1: {got:?}");
        let mut answer = Vec::new();
        client.read_to_end(&mut answer).await.expect("read");
        assert_eq!(answer, REFUSAL);
    }

    #[tokio::test]
    async fn bytes_held_as_a_possible_preface_reach_http1_whole_and_in_order() {
        let (mut client, mut server) = pair(b"PR").await;
        assert!(waits(&mut server));
        client
            .write_all(b"OPFIND / HTTP/1.1\r\n\r\n")
            .await
            .expect("write");
        client.shutdown().await.expect("shutdown");
        assert_eq!(rest(&mut server).await, b"PROPFIND / HTTP/1.1\r\n\r\n");
        // Cut short by the client's end: what came is still given.
        let (mut client, mut server) = pair(b"PRI").await;
        assert!(waits(&mut server));
        client.shutdown().await.expect("shutdown");
        assert_eq!(rest(&mut server).await, b"PRI");
    }
}
