//! The lean HTTP/1.1 client, for every request to a cleartext HTTP/1.1 upstream, driven
//! inline by the request's own task; its one pool of connections per target.
//!
//! hyper's client connection runs a task per connection and hands each request and response
//! through channels; measured here it was a third of the CPU of a proxied request. This
//! client writes the request head with one `write` and parses the response head in place
//! with `httparse`, on the request's task. The response body streams from the connection
//! (`Content-Length`, chunked, or until close); when it has been read to the end the
//! connection goes back to the pool. The request side (bodies) is in `h1_request.rs`.

use super::cap::Cap;
use super::dial::{ConnectError, Dialer};
use super::idle::{spawn_reaper, IdleList};
use crate::exchange::Fields;
use bytes::{Bytes, BytesMut};
use http::header::{HeaderName, HeaderValue};
use http::{HeaderMap, Method, StatusCode, Version};
use std::io;
use std::mem::MaybeUninit;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::sync::OwnedSemaphorePermit;

/// Most response headers accepted from an upstream.
const MAX_HEADERS: usize = 100;
/// Largest response head accepted from an upstream.
pub(super) const MAX_HEAD: usize = 64 * 1024;
pub(super) const READ_CHUNK: usize = 16 * 1024;

/// Why an exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum H1Error {
    /// The connection closed or reset before a complete response head: on a reused
    /// connection, the backend closed it while idle (the request may be replayed).
    #[error("connection closed before the response: {0}")]
    Closed(io::Error),
    /// The response is not valid HTTP/1.x, or broke off after it had begun.
    #[error("malformed or truncated response from upstream")]
    Malformed,
    /// A `101` to a request that asked for no upgrade: no answer follows on the connection.
    #[error("a protocol switch nobody asked for")]
    Switched,
    /// A body under a transfer coding the gateway does not pass on
    /// ([`super::headers::coded_answer`]): well-formed, so no fault of the target's health.
    #[error("an answer under a transfer coding other than chunked")]
    Coded,
}

/// One kept-alive connection.
pub struct H1Conn {
    pub(super) stream: TcpStream,
    pub(super) buf: BytesMut,
    /// How much of `buf` was looked at for the end of a head that was not there: a head
    /// trickled a byte at a time is not parsed again from its start after every byte.
    pub(super) scanned: usize,
    /// The deadline of the exchange under way, kept for the next one (made on the first).
    pub(super) timer: Option<Pin<Box<tokio::time::Sleep>>>,
    /// Room under the target's connection cap, given back when the connection closes.
    _permit: OwnedSemaphorePermit,
}

/// The response head.
pub struct Head {
    /// Status.
    pub status: StatusCode,
    /// Headers as received.
    pub headers: HeaderMap,
    /// Whether no header is hop-by-hop (so none is to be taken out before the client's).
    pub plain: bool,
}

/// How a response body is framed.
#[derive(Debug, Clone, Copy)]
pub(super) enum Framing {
    Empty,
    Length(u64),
    Chunked,
    UntilClose,
}

impl H1Conn {
    /// A client on a connected stream.
    fn new(stream: TcpStream, permit: OwnedSemaphorePermit) -> H1Conn {
        H1Conn {
            stream,
            buf: BytesMut::with_capacity(READ_CHUNK),
            scanned: 0,
            timer: None,
            _permit: permit,
        }
    }

    /// Whether the peer has closed (or sent something unasked): checked without blocking
    /// before reusing an idle connection.
    fn is_stale(&self) -> bool {
        let mut probe = [0u8; 1];
        match self.stream.try_read(&mut probe) {
            Ok(_) => true,
            Err(e) => e.kind() != io::ErrorKind::WouldBlock,
        }
    }

    /// Reads more of the answer into the buffer, with room for a read of at least 1 KiB.
    pub(super) fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        if self.buf.capacity() - self.buf.len() < 1024 {
            self.buf.reserve(READ_CHUNK);
        }
        tokio_util::io::poll_read_buf(Pin::new(&mut self.stream), cx, &mut self.buf)
    }
}

/// A parsed response head: the head, its length, how its body is framed, and whether the
/// connection may be kept.
pub(super) type Parsed = (Head, usize, Framing, bool);

/// A `Content-Length` value: digits only (no sign, no spaces, no list).
fn parse_length(v: &[u8]) -> Option<u64> {
    if v.is_empty() || v.len() > 19 || !v.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(v).ok()?.parse().ok()
}

/// A chunk-size line: hex digits only, then optional whitespace and `;` extensions.
pub(super) fn parse_chunk_size(line: &[u8]) -> Option<u64> {
    let digits = line.iter().take_while(|b| b.is_ascii_hexdigit()).count();
    if digits == 0 || digits > 16 {
        return None;
    }
    let rest = &line[digits..];
    // Only spaces and tabs may come before an extension (RFC 9112 §7.1.1's BWS), or end
    // the line, as the listener takes them; and no control byte but a tab anywhere (a
    // bare CR, a NUL: what another reader of the same bytes could end the line at).
    let rest_ok = matches!(
        rest.iter().find(|b| !matches!(b, b' ' | b'\t')),
        None | Some(b';')
    ) && field_text(rest);
    if !rest_ok {
        return None;
    }
    u64::from_str_radix(std::str::from_utf8(&line[..digits]).ok()?, 16).ok()
}

/// Whether `bytes` are field text: no control byte but a horizontal tab (RFC 9110 §5.5).
pub(super) fn field_text(bytes: &[u8]) -> bool {
    bytes
        .iter()
        .all(|&b| b == b'\t' || (b >= 0x20 && b != 0x7f))
}

pub(super) fn parse_head(buf: &BytesMut, method: &Method) -> Result<Option<Parsed>, H1Error> {
    // Uninitialised: filling 100 empty headers before each parse cost about 300
    // instructions per answer.
    let mut slots = [MaybeUninit::<httparse::Header<'_>>::uninit(); MAX_HEADERS];
    let mut resp = httparse::Response::new(&mut []);
    let len = match httparse::ParserConfig::default()
        .parse_response_with_uninit_headers(&mut resp, buf, &mut slots)
    {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(_) => return Err(H1Error::Malformed),
    };
    // Statuses are 100 to 599 (RFC 9110 §15): `600` to `999`, which `httparse` and `http`
    // take, is no answer a client could read.
    let status = resp
        .code
        .filter(|c| *c < 600)
        .and_then(|c| StatusCode::from_u16(c).ok())
        .ok_or(H1Error::Malformed)?;
    let version = if resp.version == Some(1) {
        Version::HTTP_11
    } else {
        Version::HTTP_10
    };
    let mut keep_alive = version == Version::HTTP_11;
    let mut length: Option<u64> = None;
    let mut has_te = false;
    // `close` anywhere ends the connection, whatever else a `Connection` header says
    // (RFC 9112 §9.6), as hyper reads it.
    let mut close = false;
    // One copy of the head holds every value: a value is a slice of it, not an allocation
    // of its own. Not a slice of the connection's buffer, which an answer kept for long
    // (the cache copies what it keeps, but not only the cache keeps answers) would pin.
    let raw = Bytes::copy_from_slice(&buf[..len]);
    // No hop-by-hop field: nothing for `rewrite_response` to take out.
    let mut plain = true;
    // Room for what the gateway adds (RateLimit, Cache-Status, CORS) without a rehash.
    let mut headers = HeaderMap::with_capacity(resp.headers.len() + 6);
    for h in resp.headers.iter() {
        let name = HeaderName::from_bytes(h.name.as_bytes()).map_err(|_| H1Error::Malformed)?;
        let at = (h.value.as_ptr() as usize).wrapping_sub(buf.as_ptr() as usize);
        let end = at.checked_add(h.value.len()).filter(|&e| e <= len);
        let value = end
            .and_then(|end| HeaderValue::from_maybe_shared(raw.slice(at..end)).ok())
            .ok_or(H1Error::Malformed)?;
        plain &= !crate::inbound::is_hop(h.name.as_bytes());
        if name == http::header::CONTENT_LENGTH {
            let n = parse_length(h.value).ok_or(H1Error::Malformed)?;
            if length.is_some_and(|prev| prev != n) {
                return Err(H1Error::Malformed);
            }
            length = Some(n);
        } else if name == http::header::TRANSFER_ENCODING {
            has_te = true;
        } else if name == http::header::CONNECTION {
            for token in h.value.split(|b| *b == b',') {
                let token = token.trim_ascii();
                if token.eq_ignore_ascii_case(b"close") {
                    close = true;
                } else if token.eq_ignore_ascii_case(b"keep-alive") {
                    keep_alive = true;
                }
            }
        }
        headers.append(name, value);
    }
    // Decided once every field is read: the order of the fields changes nothing.
    let mut framing = match (has_te, length) {
        (true, _) => Framing::Chunked,
        (false, Some(n)) => Framing::Length(n),
        (false, None) => Framing::UntilClose,
    };
    if !super::headers::carries_body(method, status) {
        framing = Framing::Empty;
    } else if has_te && super::headers::coded_answer(method, status, &headers) {
        return Err(H1Error::Coded);
    }
    if has_te && length.is_some() {
        // Both framings in one message (RFC 9112 §6.3): frame by chunks, then close.
        keep_alive = false;
    }
    if matches!(framing, Framing::UntilClose) {
        keep_alive = false;
    }
    if close || (has_te && version == Version::HTTP_10) {
        // Closed as the upstream says; and a transfer coding in HTTP/1.0 is faulty
        // framing: read as chunked, then closed (RFC 9112 §6.1).
        keep_alive = false;
    }
    Ok(Some((
        Head {
            status,
            headers,
            plain,
        },
        len,
        framing,
        keep_alive,
    )))
}

/// Idle connections of one target for the lean client.
pub struct Pool {
    dialer: Dialer,
    idle: IdleList<H1Conn>,
    cap: Arc<Cap>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("target", &self.dialer.target)
            .finish()
    }
}

impl Pool {
    /// A pool for `target`; reaps idle connections when a runtime runs.
    pub fn new(
        target: &str,
        max_idle: usize,
        idle_timeout: Duration,
        connect_timeout: Duration,
        cap: Arc<Cap>,
    ) -> Arc<Pool> {
        let pool = Arc::new(Pool {
            dialer: Dialer::new(target, connect_timeout),
            idle: IdleList::new(max_idle, idle_timeout),
            cap,
        });
        spawn_reaper(Arc::downgrade(&pool), idle_timeout, |p: &Pool| {
            p.idle.trim(|_| true)
        });
        pool
    }

    /// The most recently used idle connection that still looks open.
    pub fn checkout(&self) -> Option<H1Conn> {
        self.idle.checkout(|c| !c.is_stale())
    }

    pub(super) fn checkin(&self, conn: H1Conn) {
        self.idle.checkin(conn);
        self.cap.returned.notify_one();
    }

    /// Idle connections waiting now.
    pub fn idle_len(&self) -> usize {
        self.idle.len()
    }

    /// A new connection, within the connect timeout, holding `permit` while it is open.
    pub async fn connect(&self, permit: OwnedSemaphorePermit) -> Result<H1Conn, ConnectError> {
        Ok(H1Conn::new(self.dialer.dial().await?, permit))
    }
}

/// What the hop writes into a request head besides the client's headers: written here,
/// not inserted into the map (each insert hashes its name).
#[derive(Debug, Default)]
pub struct Added<'a> {
    /// The target's `Host`, sent instead of the client's; none keeps the client's.
    pub host: Option<&'a HeaderValue>,
    /// Headers the gateway sets, each sent instead of the client's of that name.
    pub set: &'a [(HeaderName, HeaderValue)],
    /// The W3C `traceparent` (the gateway's span as the parent).
    pub traceparent: Option<&'a [u8; 55]>,
}

/// Serializes a request head: `METHOD path HTTP/1.1`, the headers with what the hop adds
/// in place of the client's, a blank line.
pub fn encode_head(
    method: &Method,
    path_and_query: &str,
    headers: &Fields,
    added: &Added<'_>,
    out: &mut Vec<u8>,
) {
    out.clear();
    out.extend_from_slice(method.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(path_and_query.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
    if let Some(host) = added.host {
        out.extend_from_slice(b"host: ");
        out.extend_from_slice(host.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    for (name, value) in headers.iter() {
        if (added.host.is_some() && name.eq_ignore_ascii_case(b"host"))
            || added
                .set
                .iter()
                .any(|(n, _)| name.eq_ignore_ascii_case(n.as_str().as_bytes()))
        {
            continue;
        }
        line(out, name, value);
    }
    for (name, value) in added.set {
        line(out, name.as_str().as_bytes(), value);
    }
    if let Some(tp) = added.traceparent {
        out.extend_from_slice(b"traceparent: ");
        out.extend_from_slice(tp);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
}

fn line(out: &mut Vec<u8>, name: &[u8], value: &HeaderValue) {
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    out.extend_from_slice(value.as_bytes());
    out.extend_from_slice(b"\r\n");
}

#[cfg(test)]
#[path = "h1_tests.rs"]
mod tests;
