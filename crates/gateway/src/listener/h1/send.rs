//! An answer on an HTTP/1.1 connection: the head encoded into the connection's write
//! buffer with the framing this server chooses (the handler's `Transfer-Encoding` is never
//! trusted), then the body as it comes. Small pieces are copied beside the head so that a
//! head and a small body leave in one write; large ones go out by `writev` uncopied.

use super::head::{digits, has_token};
use bytes::{Buf, Bytes};
use http::header::{self, HeaderName, HeaderValue};
use http::{response, StatusCode, Version};
use http_body::Body;
use std::io::{self, IoSlice};
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use tokio::io::AsyncWrite;

/// Pieces up to this size are copied into the write buffer; larger ones are written as
/// they are.
const COPY_UP_TO: usize = 8 * 1024;
/// The write buffer is flushed once it holds this much.
const FLUSH_AT: usize = 16 * 1024;

/// What the request says about its answer.
#[derive(Debug, Clone, Copy)]
pub struct Asked {
    /// The request was `HEAD`.
    pub head: bool,
    /// The request was `CONNECT`.
    pub connect: bool,
    /// The request's version.
    pub version: Version,
    /// The client said `TE: trailers`: declared trailer fields are sent (RFC 9110 §6.5.1).
    pub trailers: bool,
}

/// How the answer's body is framed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Coding {
    /// None is written (HEAD, 1xx, 204, 304, or a 2xx to CONNECT).
    Bodiless,
    /// Exactly this many bytes.
    Length(u64),
    /// Chunks.
    Chunked,
    /// Until the connection closes (an HTTP/1.0 client, length unknown).
    UntilClose,
}

/// Encodes the head of an answer into `out`. `exact` is the body's exact length when known,
/// `empty` whether it has nothing at all. Returns the body's coding, whether the connection
/// may be kept after it, and the trailer fields the answer declared (sent when chunked).
pub fn encode_head(
    parts: &response::Parts,
    exact: Option<u64>,
    empty: bool,
    asked: Asked,
    mut keep_alive: bool,
    date: &[u8],
    out: &mut Vec<u8>,
) -> (Coding, bool, Vec<HeaderName>) {
    let status = parts.status;
    status_line(status, out);
    let connect_ok = asked.connect && status.is_success();
    let no_length = status.is_informational() || status == StatusCode::NO_CONTENT || connect_ok;
    let bodiless = no_length || asked.head || status == StatusCode::NOT_MODIFIED;
    let mut declared: Option<u64> = None;
    let mut said_close = false;
    let mut has_date = false;
    let mut trailer_names: Vec<HeaderName> = Vec::new();
    let mut trailer_values: Vec<&HeaderValue> = Vec::new();
    for (name, value) in &parts.headers {
        match *name {
            header::CONTENT_LENGTH => {
                if declared.is_none() {
                    declared = digits(value.as_bytes());
                }
                continue;
            }
            header::TRANSFER_ENCODING => continue,
            header::TRAILER => {
                trailer_values.push(value);
                continue;
            }
            header::CONNECTION if has_token(value.as_bytes(), b"close") => {
                keep_alive = false;
                said_close = true;
            }
            header::DATE => has_date = true,
            _ => {}
        }
        field(out, name.as_str().as_bytes(), value.as_bytes());
    }
    let mut digits_buf = itoa::Buffer::new();
    let coding = if bodiless {
        if !no_length {
            // HEAD and 304 say what a GET would have had.
            let n = declared.or(exact.filter(|n| *n > 0));
            if let Some(n) = n {
                field(out, b"content-length", digits_buf.format(n).as_bytes());
            }
        }
        Coding::Bodiless
    } else {
        let length = if empty { Some(0) } else { exact.or(declared) };
        match length {
            Some(n) => {
                field(out, b"content-length", digits_buf.format(n).as_bytes());
                Coding::Length(n)
            }
            None if asked.version == Version::HTTP_11 => {
                out.extend_from_slice(b"transfer-encoding: chunked\r\n");
                let sent = if asked.trailers {
                    &trailer_values[..]
                } else {
                    &[]
                };
                for v in sent {
                    field(out, b"trailer", v.as_bytes());
                    trailer_names.extend(
                        v.to_str()
                            .unwrap_or("")
                            .split(',')
                            .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok()),
                    );
                }
                Coding::Chunked
            }
            None => {
                keep_alive = false;
                Coding::UntilClose
            }
        }
    };
    if !keep_alive && !said_close && status != StatusCode::SWITCHING_PROTOCOLS {
        out.extend_from_slice(b"connection: close\r\n");
    } else if keep_alive && asked.version == Version::HTTP_10 {
        out.extend_from_slice(b"connection: keep-alive\r\n");
    }
    if !has_date {
        field(out, b"date", date);
    }
    out.extend_from_slice(b"\r\n");
    (coding, keep_alive, trailer_names)
}

fn status_line(status: StatusCode, out: &mut Vec<u8>) {
    if status == StatusCode::OK {
        out.extend_from_slice(b"HTTP/1.1 200 OK\r\n");
        return;
    }
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(status.as_str().as_bytes());
    out.push(b' ');
    // A status without a registered reason (an upstream's 599, 999) goes with an empty
    // one, as RFC 9112 §4 allows.
    out.extend_from_slice(status.canonical_reason().unwrap_or("").as_bytes());
    out.extend_from_slice(b"\r\n");
}

fn field(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

/// How writing an answer ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Sent {
    /// Whole, and framed so that the connection can serve another request.
    Whole,
    /// Cut short or framed by the close: the connection must close.
    Close,
}

/// Writes an answer's body after its head (already in the write buffer).
pub struct Writer<B> {
    body: Option<B>,
    coding: Coding,
    /// Bytes the length still expects.
    left: u64,
    /// A large piece being written uncopied, then CRLF when chunked.
    big: Option<Bytes>,
    crlf_after_big: bool,
    /// How much of the write buffer is written.
    written: usize,
    trailers: Vec<HeaderName>,
    /// The body broke or overran its length: the connection closes after.
    cut: bool,
}

impl<B> Writer<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    /// A writer for `body` framed by `coding`.
    pub fn new(body: B, coding: Coding, trailers: Vec<HeaderName>) -> Writer<B> {
        let left = match coding {
            Coding::Length(n) => n,
            _ => 0,
        };
        Writer {
            body: (coding != Coding::Bodiless && !(coding == Coding::Length(0))).then_some(body),
            coding,
            left,
            big: None,
            crlf_after_big: false,
            written: 0,
            trailers,
            cut: false,
        }
    }

    /// Writes the head and the body to `io`; ready when all of it is written.
    pub fn poll<S: AsyncWrite + Unpin>(
        &mut self,
        io: &mut S,
        wbuf: &mut Vec<u8>,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<Sent>> {
        loop {
            if self.written == wbuf.len() {
                wbuf.clear();
                self.written = 0;
            }
            self.fill(wbuf, cx);
            if self.written < wbuf.len() || self.big.is_some() {
                ready!(self.poll_flush(io, wbuf, cx))?;
                continue;
            }
            // What was written leaves now: a TLS layer may hold written bytes until flushed.
            ready!(Pin::new(&mut *io).poll_flush(cx))?;
            if self.body.is_some() {
                // Waiting on the body; its waker is registered.
                return Poll::Pending;
            }
            let whole = !self.cut
                && match self.coding {
                    Coding::Length(_) => self.left == 0,
                    Coding::UntilClose => false,
                    Coding::Bodiless | Coding::Chunked => true,
                };
            return Poll::Ready(Ok(if whole { Sent::Whole } else { Sent::Close }));
        }
    }

    /// Takes what the body has ready into the write buffer, until it would wait, ends, or a
    /// large piece is to be written.
    fn fill(&mut self, wbuf: &mut Vec<u8>, cx: &mut Context<'_>) {
        if self.big.is_some() {
            return;
        }
        if self.crlf_after_big {
            self.crlf_after_big = false;
            wbuf.extend_from_slice(b"\r\n");
        }
        while wbuf.len() < FLUSH_AT && self.big.is_none() {
            let Some(body) = self.body.as_mut() else {
                return;
            };
            match Pin::new(body).poll_frame(cx) {
                Poll::Pending => return,
                Poll::Ready(None) => {
                    if self.coding == Coding::Chunked {
                        wbuf.extend_from_slice(b"0\r\n\r\n");
                    }
                    self.body = None;
                }
                Poll::Ready(Some(Err(_))) => {
                    // The answer broke off: the client must see it cut, not ended.
                    self.cut = true;
                    self.body = None;
                }
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => self.data(data, wbuf),
                    Err(frame) => {
                        if let (Ok(t), Coding::Chunked) = (frame.into_trailers(), self.coding) {
                            wbuf.extend_from_slice(b"0\r\n");
                            for (n, v) in &t {
                                if self.trailers.contains(n) {
                                    field(wbuf, n.as_str().as_bytes(), v.as_bytes());
                                }
                            }
                            wbuf.extend_from_slice(b"\r\n");
                            self.body = None;
                        }
                    }
                },
            }
        }
    }

    fn data(&mut self, mut data: Bytes, wbuf: &mut Vec<u8>) {
        if data.is_empty() {
            return;
        }
        match self.coding {
            Coding::Length(_) => {
                if data.len() as u64 > self.left {
                    // More than the length said: what is over is not sent.
                    data.truncate(usize::try_from(self.left).unwrap_or(usize::MAX));
                    self.cut = true;
                    self.body = None;
                }
                self.left -= data.len() as u64;
                if self.left == 0 {
                    self.body = None;
                }
            }
            Coding::Chunked => {
                let mut hex = [0u8; 16];
                let n = hex_digits(data.len(), &mut hex);
                wbuf.extend_from_slice(&hex[..n]);
                wbuf.extend_from_slice(b"\r\n");
            }
            Coding::UntilClose | Coding::Bodiless => {}
        }
        if data.len() <= COPY_UP_TO {
            wbuf.extend_from_slice(&data);
            if self.coding == Coding::Chunked {
                wbuf.extend_from_slice(b"\r\n");
            }
        } else {
            self.crlf_after_big = self.coding == Coding::Chunked;
            self.big = Some(data);
        }
    }

    fn poll_flush<S: AsyncWrite + Unpin>(
        &mut self,
        io: &mut S,
        wbuf: &[u8],
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            let head = &wbuf[self.written..];
            let big: &[u8] = self.big.as_deref().unwrap_or(&[]);
            if head.is_empty() && big.is_empty() {
                self.big = None;
                return Poll::Ready(Ok(()));
            }
            let n = if head.is_empty() {
                ready!(Pin::new(&mut *io).poll_write(cx, big))?
            } else if big.is_empty() {
                ready!(Pin::new(&mut *io).poll_write(cx, head))?
            } else {
                let bufs = [IoSlice::new(head), IoSlice::new(big)];
                ready!(Pin::new(&mut *io).poll_write_vectored(cx, &bufs))?
            };
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            let from_head = n.min(head.len());
            self.written += from_head;
            if let Some(b) = self.big.as_mut() {
                b.advance(n - from_head);
                if b.is_empty() {
                    self.big = None;
                }
            }
        }
    }
}

/// `n` in lower-case hex, into `out`; returns how many digits.
fn hex_digits(mut n: usize, out: &mut [u8; 16]) -> usize {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut tmp = [0u8; 16];
    let mut i = 0;
    loop {
        tmp[i] = HEX[n & 0xf];
        i += 1;
        n >>= 4;
        if n == 0 {
            break;
        }
    }
    for (k, d) in tmp[..i].iter().rev().enumerate() {
        out[k] = *d;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{Empty, Full};

    fn head_of(
        resp: http::Response<()>,
        exact: Option<u64>,
        empty: bool,
        asked: Asked,
    ) -> (String, Coding, bool) {
        let (parts, ()) = resp.into_parts();
        let mut out = Vec::new();
        let (c, keep, _) = encode_head(&parts, exact, empty, asked, true, b"D", &mut out);
        (String::from_utf8(out).unwrap(), c, keep)
    }

    const GET11: Asked = Asked {
        head: false,
        connect: false,
        version: Version::HTTP_11,
        trailers: false,
    };

    #[test]
    fn framing_is_chosen_here() {
        let r = http::Response::builder()
            .header("transfer-encoding", "gzip")
            .header("content-length", "99")
            .body(())
            .unwrap();
        let (h, c, keep) = head_of(r, Some(5), false, GET11);
        assert_eq!(c, Coding::Length(5));
        assert!(keep);
        assert_eq!(h, "HTTP/1.1 200 OK\r\ncontent-length: 5\r\ndate: D\r\n\r\n");
        let (h, c, _) = head_of(http::Response::new(()), None, false, GET11);
        assert_eq!(c, Coding::Chunked);
        assert!(h.contains("transfer-encoding: chunked\r\n"));
        let ten = Asked {
            version: Version::HTTP_10,
            ..GET11
        };
        let (h, c, keep) = head_of(http::Response::new(()), None, false, ten);
        assert_eq!((c, keep), (Coding::UntilClose, false));
        assert!(h.contains("connection: close\r\n"));
        let r = http::Response::builder()
            .status(204)
            .header("content-length", "0")
            .body(())
            .unwrap();
        let (h, c, _) = head_of(r, Some(0), true, GET11);
        assert_eq!(c, Coding::Bodiless);
        assert!(!h.contains("content-length"), "{h}");
        let head = Asked {
            head: true,
            ..GET11
        };
        let r = http::Response::builder()
            .header("content-length", "42")
            .body(())
            .unwrap();
        let (h, c, _) = head_of(r, Some(0), true, head);
        assert_eq!(c, Coding::Bodiless);
        assert!(h.contains("content-length: 42\r\n"), "{h}");
    }

    #[test]
    fn trailers_are_declared_only_to_a_client_that_takes_them() {
        let declared = || {
            http::Response::builder()
                .header("trailer", "x-sum")
                .body(())
                .unwrap()
        };
        let (h, c, _) = head_of(declared(), None, false, GET11);
        assert_eq!(c, Coding::Chunked);
        assert!(!h.contains("trailer:"), "{h}");
        let takes = Asked {
            trailers: true,
            ..GET11
        };
        let (h, _, _) = head_of(declared(), None, false, takes);
        assert!(h.contains("trailer: x-sum\r\n"), "{h}");
    }

    #[tokio::test]
    async fn a_small_body_leaves_with_its_head_and_chunks_are_framed() {
        let mut out = Vec::new();
        let mut wbuf = b"HEAD\r\n".to_vec();
        let mut w = Writer::new(
            Full::new(Bytes::from_static(b"hello")),
            Coding::Length(5),
            vec![],
        );
        let sent = std::future::poll_fn(|cx| w.poll(&mut out, &mut wbuf, cx))
            .await
            .unwrap();
        assert_eq!((sent, &out[..]), (Sent::Whole, &b"HEAD\r\nhello"[..]));
        let mut out = Vec::new();
        let mut w = Writer::new(
            Full::new(Bytes::from(vec![b'x'; 20_000])),
            Coding::Chunked,
            vec![],
        );
        std::future::poll_fn(|cx| w.poll(&mut out, &mut wbuf, cx))
            .await
            .unwrap();
        assert!(
            out.starts_with(b"4e20\r\nxxx"),
            "{:?}",
            String::from_utf8_lossy(&out[..20])
        );
        assert!(out.ends_with(b"xx\r\n0\r\n\r\n"));
        let mut out = Vec::new();
        let mut w = Writer::new(Empty::<Bytes>::new(), Coding::Length(3), vec![]);
        let sent = std::future::poll_fn(|cx| w.poll(&mut out, &mut wbuf, cx))
            .await
            .unwrap();
        assert_eq!(sent, Sent::Close, "a body short of its length closes");
    }
}
