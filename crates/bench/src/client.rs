//! A minimal HTTP/1.1 keep-alive client for the load generator: one pre-built request,
//! written with one syscall, the response parsed in place with `httparse`. Hand-written
//! because the generator must not be the bottleneck (it must keep up with wrk).

use std::net::SocketAddr;
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// What an `https://` target needs: the client config and the name to present and check.
#[derive(Clone)]
pub struct Tls {
    /// The client config (ALPN `http/1.1`).
    pub config: Arc<rustls::ClientConfig>,
    /// The server's name.
    pub name: rustls::pki_types::ServerName<'static>,
}

/// A connection's byte stream: plain TCP, or TLS over it. An enum, not a trait object: the
/// plain path stays as cheap as it was.
enum Stream {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::client::TlsStream<TcpStream>>),
}

impl Stream {
    async fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Stream::Plain(s) => s.read(buf).await,
            Stream::Tls(s) => s.read(buf).await,
        }
    }

    async fn write_all(&mut self, buf: &[u8]) -> std::io::Result<()> {
        match self {
            Stream::Plain(s) => s.write_all(buf).await,
            Stream::Tls(s) => {
                s.write_all(buf).await?;
                s.flush().await
            }
        }
    }
}

/// Why an exchange failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The connection could not be opened.
    Connect,
    /// The TLS handshake failed (a certificate not trusted without `-k`, a plain port).
    Tls,
    /// The request could not be written.
    Write,
    /// The server closed the connection before a full response.
    Closed,
    /// Reading failed (reset, …).
    Read,
    /// The response is not valid HTTP/1.x.
    Parse,
    /// No full response within the timeout.
    Timeout,
}

impl ErrorKind {
    /// All kinds, in report order.
    pub const ALL: [ErrorKind; 7] = [
        ErrorKind::Connect,
        ErrorKind::Tls,
        ErrorKind::Write,
        ErrorKind::Closed,
        ErrorKind::Read,
        ErrorKind::Parse,
        ErrorKind::Timeout,
    ];
}

/// One keep-alive connection.
pub struct Conn {
    stream: Stream,
    buf: Vec<u8>,
    /// Bytes of `buf` in use.
    filled: usize,
}

enum Framing {
    None,
    Length(usize),
    Chunked,
    UntilClose,
}

impl Conn {
    /// Opens a connection with `TCP_NODELAY`, with the TLS handshake when `tls` is given
    /// (a failed handshake is a TLS error).
    pub async fn open(addr: SocketAddr, tls: Option<&Tls>) -> Result<Conn, ErrorKind> {
        let tcp = TcpStream::connect(addr)
            .await
            .map_err(|_| ErrorKind::Connect)?;
        let _ = tcp.set_nodelay(true);
        let stream = match tls {
            None => Stream::Plain(tcp),
            Some(t) => {
                let s = tokio_rustls::TlsConnector::from(t.config.clone())
                    .connect(t.name.clone(), tcp)
                    .await
                    .map_err(|_| ErrorKind::Tls)?;
                Stream::Tls(Box::new(s))
            }
        };
        Ok(Conn {
            stream,
            buf: vec![0; 64 * 1024],
            filled: 0,
        })
    }

    async fn fill(&mut self) -> Result<(), ErrorKind> {
        if self.filled == self.buf.len() {
            let n = self.buf.len();
            self.buf.resize(n * 2, 0);
        }
        match self.stream.read(&mut self.buf[self.filled..]).await {
            Ok(0) => Err(ErrorKind::Closed),
            Ok(n) => {
                self.filled += n;
                Ok(())
            }
            Err(_) => Err(ErrorKind::Read),
        }
    }

    /// Sends `req` and reads the whole response. Returns the status and whether the
    /// connection may be reused.
    pub async fn exchange(
        &mut self,
        req: &[u8],
        head_request: bool,
    ) -> Result<(u16, bool), ErrorKind> {
        self.stream
            .write_all(req)
            .await
            .map_err(|_| ErrorKind::Write)?;
        // Head.
        let (status, head_len, framing, keep_alive) = loop {
            let mut headers = [httparse::EMPTY_HEADER; 64];
            let mut resp = httparse::Response::new(&mut headers);
            match resp.parse(&self.buf[..self.filled]) {
                Ok(httparse::Status::Complete(n)) => {
                    let status = resp.code.unwrap_or(0);
                    let mut framing = Framing::UntilClose;
                    let mut keep_alive = resp.version == Some(1);
                    for h in resp.headers.iter() {
                        if h.name.eq_ignore_ascii_case("content-length") {
                            let len = std::str::from_utf8(h.value)
                                .ok()
                                .and_then(|v| v.trim().parse().ok())
                                .ok_or(ErrorKind::Parse)?;
                            framing = Framing::Length(len);
                        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
                            if h.value.eq_ignore_ascii_case(b"chunked") {
                                framing = Framing::Chunked;
                            }
                        } else if h.name.eq_ignore_ascii_case("connection") {
                            if h.value.eq_ignore_ascii_case(b"close") {
                                keep_alive = false;
                            } else if h.value.eq_ignore_ascii_case(b"keep-alive") {
                                keep_alive = true;
                            }
                        }
                    }
                    if head_request || status < 200 || status == 204 || status == 304 {
                        framing = Framing::None;
                    }
                    break (status, n, framing, keep_alive);
                }
                Ok(httparse::Status::Partial) => self.fill().await?,
                Err(_) => return Err(ErrorKind::Parse),
            }
        };
        // Body.
        let end = match framing {
            Framing::None => head_len,
            Framing::Length(len) => {
                let end = head_len + len;
                if self.buf.len() < end {
                    self.buf.resize(end, 0);
                }
                while self.filled < end {
                    self.fill().await?;
                }
                end
            }
            Framing::Chunked => self.read_chunked(head_len).await?,
            Framing::UntilClose => {
                loop {
                    match self.fill().await {
                        Ok(()) => {}
                        Err(ErrorKind::Closed) => break,
                        Err(e) => return Err(e),
                    }
                }
                return Ok((status, false));
            }
        };
        // Keep any bytes past this response (there should be none without pipelining).
        self.buf.copy_within(end..self.filled, 0);
        self.filled -= end;
        Ok((status, keep_alive))
    }

    /// Reads a chunked body starting at `at`; returns where it ends.
    async fn read_chunked(&mut self, mut at: usize) -> Result<usize, ErrorKind> {
        loop {
            // Chunk size line.
            let line_end = loop {
                if let Some(i) = find_crlf(&self.buf[at..self.filled]) {
                    break at + i;
                }
                self.fill().await?;
            };
            let line =
                std::str::from_utf8(&self.buf[at..line_end]).map_err(|_| ErrorKind::Parse)?;
            let size_hex = line.split(';').next().unwrap_or("").trim();
            let size = usize::from_str_radix(size_hex, 16).map_err(|_| ErrorKind::Parse)?;
            at = line_end + 2;
            if size == 0 {
                // Trailers, then an empty line.
                loop {
                    let end = loop {
                        if let Some(i) = find_crlf(&self.buf[at..self.filled]) {
                            break at + i;
                        }
                        self.fill().await?;
                    };
                    let empty = end == at;
                    at = end + 2;
                    if empty {
                        return Ok(at);
                    }
                }
            }
            let need = at + size + 2;
            if self.buf.len() < need {
                self.buf.resize(need, 0);
            }
            while self.filled < need {
                self.fill().await?;
            }
            at = need;
        }
    }
}

fn find_crlf(b: &[u8]) -> Option<usize> {
    b.windows(2).position(|w| w == b"\r\n")
}
