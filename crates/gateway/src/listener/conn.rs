//! One client connection: HTTP/1.1 (with upgrades), HTTP/2 by ALPN on TLS or by prior
//! knowledge on `h2c` listeners, TLS handshakes bounded by the header timeout, and a
//! graceful close when the server shuts down.

use super::h1_only::H1Only;
use super::h2::{Connection, Limits, PREFACE};
use super::handler::Handler;
use super::send_timeout::SendTimeout;
pub use super::stop::Stop;
use crate::exchange::ConnInfo;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tollgate_config::{Http2Config, ListenerConfig};

/// The protocol settings of one listener, made once.
#[derive(Clone)]
pub struct Builders {
    /// The listener's HTTP/2 limits.
    http2: Http2Config,
    /// How long a connection waits for a request head, or for an HTTP/2 stream.
    header_timeout: std::time::Duration,
    h2c: bool,
    /// The TLS config the listener started with, for when a reload dropped the listener
    /// (listener changes wait for a restart; its connections keep being served).
    tls: Option<Arc<rustls::ServerConfig>>,
}

impl Builders {
    /// Whether the listener serves cleartext HTTP/2 beside HTTP/1.1.
    pub fn h2c(&self) -> bool {
        self.h2c
    }

    /// Builders for `cfg`'s limits.
    pub fn new(cfg: &ListenerConfig) -> Self {
        let tls = cfg.tls.as_ref().and_then(|t| {
            super::tls::server_config(t)
                .map_err(|e| tracing::error!(listener = %cfg.address, "TLS config: {e}"))
                .ok()
        });
        Builders {
            http2: cfg.http2.clone(),
            header_timeout: cfg.header_timeout,
            h2c: cfg.h2c,
            tls,
        }
    }
}

pin_project_lite::pin_project! {
    /// A connection run to its end: once the server stops, it is asked to close gracefully
    /// (finish in-flight requests, then close), and `done` gets its result. A struct, not an
    /// async fn, so that the connection's state is stored once (an async fn keeps its
    /// arguments beside what it awaits) and an idle connection costs no more than it must.
    /// The stop notification is polled once, to register the task's waker (which stays the
    /// same); each later poll reads the flag.
    pub struct Drive<F, S, D> {
        #[pin]
        conn: F,
        #[pin]
        stopped: tokio::sync::futures::OwnedNotified,
        flag: Arc<AtomicBool>,
        registered: bool,
        shutdown: Option<S>,
        done: Option<D>,
    }
}

impl<F, E, S, D> Future for Drive<F, S, D>
where
    F: Future<Output = Result<(), E>>,
    S: FnOnce(Pin<&mut F>),
    D: FnOnce(Result<(), E>),
{
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<()> {
        let mut this = self.project();
        if this.shutdown.is_some() {
            if !*this.registered {
                *this.registered = true;
                let _ = this.stopped.as_mut().poll(cx);
            }
            if this.flag.load(Ordering::Acquire) {
                if let Some(f) = this.shutdown.take() {
                    f(this.conn.as_mut());
                }
            }
        }
        let r = std::task::ready!(this.conn.poll(cx));
        if let Some(d) = this.done.take() {
            d(r);
        }
        std::task::Poll::Ready(())
    }
}

/// Runs `conn` until it ends, closing it gracefully when `stop` fires; `done` gets the result.
fn drive<F, E, S, D>(conn: F, stop: Stop, shutdown: S, done: D) -> Drive<F, S, D>
where
    F: Future<Output = Result<(), E>>,
    S: FnOnce(Pin<&mut F>),
    D: FnOnce(Result<(), E>),
{
    Drive {
        conn,
        stopped: stop.notify.notified_owned(),
        flag: stop.flag,
        registered: false,
        shutdown: Some(shutdown),
        done: Some(done),
    }
}

/// Serves HTTP/1.1 on a cleartext connection: the whole task is this one future, so an
/// idle keep-alive connection holds the server's state and little else. `done` runs at the
/// end.
pub fn serve_h1<H: Handler>(
    gw: Arc<H>,
    stream: TcpStream,
    info: Arc<ConnInfo>,
    stop: Stop,
    done: impl FnOnce() + Send + 'static,
) -> impl Future<Output = ()> + Send + 'static {
    let io = SendTimeout::new(H1Only::new(stream), info.listener.send_timeout);
    async move {
        super::h1::serve(gw, io, info, stop).await;
        done();
    }
}

/// HTTP/2 with prior knowledge and HTTP/1.1 on one cleartext connection: the first bytes
/// say which, and are then read again by the protocol's server.
pub async fn serve_h2c<H: Handler>(
    gw: Arc<H>,
    mut stream: TcpStream,
    info: Arc<ConnInfo>,
    b: &Builders,
    stop: Stop,
) {
    if !b.h2c {
        return;
    }
    let (first, head) = first_line(&mut stream, info.listener.header_timeout).await;
    let h2 = match first {
        FirstLine::H2 => true,
        FirstLine::Http1 => false,
        // Nothing within the header timeout: closed, as an idle HTTP/1.1 connection is.
        FirstLine::Silent => return,
        FirstLine::Other => {
            tracing::debug!(peer = ?info.peer_ip, "neither HTTP/1 nor an HTTP/2 preface: closed");
            // What came has been read, so the close is a FIN, not a reset.
            let _ = stream.shutdown().await;
            return;
        }
    };
    serve_stream(gw, Replay::new(head, stream), info, b, h2, stop).await
}

/// What the first bytes on an h2c listener say.
#[derive(Debug, PartialEq)]
enum FirstLine {
    /// The HTTP/2 preface, whole.
    H2,
    /// An HTTP/1 request line, or the start of one.
    Http1,
    /// Something else: a broken preface.
    Other,
    /// Nothing (or only part of a preface) within the header timeout, or the client closed.
    Silent,
}

/// On an h2c listener, reads the first bytes and says what they are. A preface that comes
/// in pieces is waited for (within the header timeout); anything else is decided from the
/// first packet. A broken preface is closed without an answer, as HTTP/2 requires (RFC
/// 9113 §3.4), rather than answered as a bad HTTP/1 request. Returns the bytes read.
async fn first_line(stream: &mut TcpStream, timeout: std::time::Duration) -> (FirstLine, Vec<u8>) {
    use tokio::io::AsyncReadExt;
    let deadline = tokio::time::Instant::now() + timeout;
    let mut head = Vec::with_capacity(256);
    let mut buf = [0u8; 256];
    loop {
        let room = buf.len() - head.len();
        let n = match tokio::time::timeout_at(deadline, stream.read(&mut buf[..room])).await {
            Ok(Ok(n)) if n > 0 => n,
            _ => return (FirstLine::Silent, head),
        };
        head.extend_from_slice(&buf[..n]);
        if head.starts_with(PREFACE) {
            return (FirstLine::H2, head);
        }
        if PREFACE.starts_with(&head) {
            continue;
        }
        return (first_line_of(&head), head);
    }
}

/// What the first packet on an h2c listener is, when it is not a whole preface: an HTTP/1
/// request line (after any empty lines a request may follow, ended by CRLF or a bare LF, or
/// not ended yet) goes to the HTTP/1.1 server, which answers a version it does not serve
/// with its precise 400; anything else is a broken preface, closed without an answer.
fn first_line_of(head: &[u8]) -> FirstLine {
    let rest = super::h1::head::after_empty_lines(head);
    let Some(end) = rest.iter().position(|&b| b == b'\n') else {
        return FirstLine::Http1;
    };
    let line = rest[..end].strip_suffix(b"\r").unwrap_or(&rest[..end]);
    match line.len().checked_sub(9).map(|at| &line[at..]) {
        Some([b' ', b'H', b'T', b'T', b'P', b'/', b'1', b'.', d]) if d.is_ascii_digit() => {
            FirstLine::Http1
        }
        _ => FirstLine::Other,
    }
}

pin_project_lite::pin_project! {
    /// A stream whose first bytes were already read: they are read again first.
    pub struct Replay<S> {
        head: Vec<u8>,
        at: usize,
        #[pin]
        inner: S,
    }
}

impl<S> Replay<S> {
    fn new(head: Vec<u8>, inner: S) -> Self {
        Replay { head, at: 0, inner }
    }
}

impl<S: AsyncRead> AsyncRead for Replay<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let this = self.project();
        if *this.at < this.head.len() {
            let k = (this.head.len() - *this.at).min(buf.remaining());
            buf.put_slice(&this.head[*this.at..*this.at + k]);
            *this.at += k;
            if *this.at == this.head.len() {
                *this.head = Vec::new();
                *this.at = 0;
            }
            return std::task::Poll::Ready(Ok(()));
        }
        this.inner.poll_read(cx, buf)
    }
}

impl<S: AsyncWrite> AsyncWrite for Replay<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        self.project().inner.poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        self.project().inner.poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        self.project().inner.poll_flush(cx)
    }

    fn poll_shutdown(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        self.project().inner.poll_shutdown(cx)
    }
}

/// The body a TLS listener answers a client that speaks plain HTTP to it.
const PLAIN_ON_TLS: &str =
    "{\"status\":400,\"error\":\"plain HTTP sent to a TLS port; use https:// for this address\"}\n";

/// The whole answer to plain HTTP on a TLS port, its length taken from the body.
fn plain_on_tls() -> String {
    format!(
        "HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\nconnection: close\r\n\
         content-length: {}\r\n\r\n{PLAIN_ON_TLS}",
        PLAIN_ON_TLS.len()
    )
}

/// Why a TLS connection never reached HTTP.
#[derive(Debug, thiserror::Error)]
pub enum TlsFailure {
    /// Nothing or not enough arrived within the header timeout.
    #[error("TLS handshake did not finish within the header timeout")]
    Stalled,
    /// The client spoke plain HTTP; it was answered 400.
    #[error("plain HTTP on a TLS port")]
    Plaintext,
    /// The handshake failed (bad certificate, no shared cipher, ...).
    #[error("TLS handshake failed: {0}")]
    Handshake(std::io::Error),
}

/// Serves a TLS connection: checks it is TLS at all, completes the handshake within the
/// header timeout, then serves HTTP/2 or HTTP/1.1 as ALPN chose.
pub async fn serve_tls<H: Handler>(
    gw: Arc<H>,
    stream: TcpStream,
    peer: SocketAddr,
    place: crate::exchange::Place,
    listener: Arc<ListenerConfig>,
    b: &Builders,
    stop: Stop,
) -> Result<(), TlsFailure> {
    let Some(tls) = gw.tls_for(listener.address).or_else(|| b.tls.clone()) else {
        return Err(TlsFailure::Handshake(std::io::Error::other(
            "no TLS config for this listener",
        )));
    };
    let timeout = listener.header_timeout;
    let deadline = tokio::time::Instant::now() + timeout;
    let mut first = [0u8; 1];
    match tokio::time::timeout_at(deadline, stream.peek(&mut first)).await {
        Err(_) => return Err(TlsFailure::Stalled),
        Ok(Err(e)) => return Err(TlsFailure::Handshake(e)),
        Ok(Ok(0)) => return Ok(()),
        Ok(Ok(_)) => {}
    }
    // Every TLS record starts with its content type; a handshake is 22.
    if first[0] != 0x16 {
        if first[0].is_ascii_uppercase() {
            let mut s = stream;
            let _ = tokio::time::timeout(timeout, async {
                let _ = s.write_all(plain_on_tls().as_bytes()).await;
                let _ = s.shutdown().await;
            })
            .await;
        }
        return Err(TlsFailure::Plaintext);
    }
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    let tls_stream = match tokio::time::timeout_at(deadline, acceptor.accept(stream)).await {
        Err(_) => return Err(TlsFailure::Stalled),
        Ok(Err(e)) => return Err(TlsFailure::Handshake(e)),
        Ok(Ok(s)) => s,
    };
    let (_, session) = tls_stream.get_ref();
    let h2 = session.alpn_protocol() == Some(b"h2");
    let client_names = session
        .peer_certificates()
        .and_then(|c| c.first())
        .map(|c| super::tls::client_names(c));
    let mut info = ConnInfo::new(peer, listener);
    info.client_names = client_names;
    info.place = Some(place);
    serve_stream(gw, tls_stream, Arc::new(info), b, h2, stop).await;
    Ok(())
}

/// Logs how a connection from `peer` ended, if it failed (at debug: clients end
/// connections in many ways).
fn log_end<E: std::fmt::Display>(peer: http::HeaderValue) -> impl FnOnce(Result<(), E>) {
    move |r| {
        if let Err(e) = r {
            tracing::debug!(?peer, "connection ended: {e}");
        }
    }
}

async fn serve_stream<H: Handler, S>(
    gw: Arc<H>,
    stream: S,
    info: Arc<ConnInfo>,
    b: &Builders,
    h2: bool,
    stop: Stop,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let io = SendTimeout::new(stream, info.listener.send_timeout);
    let peer = info.peer_ip.clone();
    if h2 {
        let limits = Limits {
            max_headers: info.listener.max_headers,
            ..Limits::new(&b.http2, b.header_timeout, info.listener.send_timeout)
        };
        let make = move |req, body| {
            let gw = gw.clone();
            let info = info.clone();
            async move { gw.serve(req, body, &info).await }
        };
        drive(
            Connection::new(io, limits, make),
            stop,
            |c| c.get_mut().shutdown(),
            log_end(peer),
        )
        .await
    } else {
        super::h1::serve(gw, io, info, stop).await
    }
}
