//! A request head, parsed by `httparse` straight from the connection's read buffer, and the
//! framing decision made from it: how long the body is, whether the connection may be kept,
//! whether the client asks for an upgrade. This is where request smuggling is won or lost,
//! so it refuses what is ambiguous rather than guess (RFC 9112 §6).

use crate::exchange::Fields;
use bytes::{Bytes, BytesMut};
use http::header::HeaderValue;
use http::{Method, Uri, Version};
use smallvec::SmallVec;
use std::mem::MaybeUninit;

/// The longest request target taken (as hyper: longer ones get 414).
const MAX_URI_LEN: usize = u16::MAX as usize - 1;

/// How the request body is framed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// No body.
    Empty,
    /// `Content-Length` bytes.
    Length(u64),
    /// `Transfer-Encoding: chunked`.
    Chunked,
}

/// A parsed request head.
#[derive(Debug)]
pub struct Head {
    /// Method, target, version and headers.
    pub method: Method,
    /// The request target.
    pub uri: Uri,
    /// HTTP/1.0 or HTTP/1.1.
    pub version: Version,
    /// The header fields, in order; their names are slices of the head.
    pub headers: Fields,
    /// How the body is framed.
    pub framing: Framing,
    /// Whether the connection may serve another request after this one.
    pub keep_alive: bool,
    /// `Expect: 100-continue` (HTTP/1.1 only).
    pub expect_continue: bool,
    /// An `Upgrade` header (HTTP/1.1) on a request without a body, or `CONNECT`.
    pub upgrade: bool,
    /// `TE: trailers`: the client takes trailer fields in a chunked answer.
    pub te_trailers: bool,
}

/// Why a head is refused: the status and a word for the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refused {
    /// 400, 414, 431 or 501.
    pub status: u16,
    /// What was wrong, for the answer's body and the log.
    pub reason: &'static str,
}

const fn refused(status: u16, reason: &'static str) -> Refused {
    Refused { status, reason }
}

/// The head's limits: the listener's `max_header_bytes` and `max_headers`.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Largest head, request line included.
    pub max_bytes: usize,
    /// Most header fields.
    pub max_headers: usize,
}

/// Header fields the request path may add before the request goes upstream.
const ADDED_ON_THE_WAY: usize = 8;

/// The longest field name taken (as `http`'s `HeaderName`).
const MAX_NAME_LEN: usize = (1 << 16) - 1;

/// The fields the framing decision reads.
enum Known {
    TransferEncoding,
    ContentLength,
    Connection,
    Expect,
    Upgrade,
    Te,
}

/// Which framing field `name` is, in any case: the length picks the one name to compare.
fn framing_field(name: &[u8]) -> Option<Known> {
    let (known, spelled): (Known, &[u8]) = match name.len() {
        17 => (Known::TransferEncoding, b"transfer-encoding"),
        14 => (Known::ContentLength, b"content-length"),
        10 => (Known::Connection, b"connection"),
        6 => (Known::Expect, b"expect"),
        7 => (Known::Upgrade, b"upgrade"),
        2 => (Known::Te, b"te"),
        _ => return None,
    };
    name.eq_ignore_ascii_case(spelled).then_some(known)
}

/// Header slots kept on the stack; more (a larger `max_headers`) are allocated.
const STACK_HEADERS: usize = 100;

/// Where a field's name and value lie in the head.
#[derive(Clone, Copy)]
struct Field {
    name: (usize, usize),
    value: (usize, usize),
}

/// A head larger than `max_header_bytes`.
pub const TOO_LARGE: Refused = refused(431, "request head larger than max_header_bytes");

/// Whether `buf` may hold the end of a head (an empty line) past `scanned`, the length
/// it had when last looked at: a head is parsed only when it may be whole, as hyper does.
pub fn may_end(buf: &[u8], scanned: usize) -> bool {
    let from = scanned.saturating_sub(2).min(buf.len());
    let tail = &buf[from..];
    tail.iter().enumerate().any(|(i, b)| {
        *b == b'\n'
            && (tail.get(i + 1) == Some(&b'\n')
                || (tail.get(i + 1) == Some(&b'\r') && tail.get(i + 2) == Some(&b'\n')))
    })
}

/// Parses the head at the start of `buf`. `Ok(None)`: not complete yet (read more). On
/// success the head's bytes are taken out of `buf`; what follows (body, next request)
/// stays.
pub fn parse(buf: &mut BytesMut, limits: Limits) -> Result<Option<Head>, Refused> {
    parse_with(buf, limits, &mut Spots::new())
}

/// Where the fields lie; kept on the stack for a usual head, and not zeroed first.
type Spots = SmallVec<[Field; 32]>;

/// The request line as positions in the head.
struct Located {
    len: usize,
    method: Method,
    target: (usize, usize),
    version: Version,
    count: usize,
}

/// Runs httparse over `bytes`, noting where each field lies in `fields`.
fn locate(bytes: &[u8], limits: Limits, fields: &mut Spots) -> Result<Option<Located>, Refused> {
    let mut stack = [MaybeUninit::<httparse::Header<'_>>::uninit(); STACK_HEADERS];
    let mut heap = Vec::new();
    let slots = if limits.max_headers <= STACK_HEADERS {
        &mut stack[..limits.max_headers]
    } else {
        heap.resize(limits.max_headers, MaybeUninit::uninit());
        &mut heap[..]
    };
    let mut req = httparse::Request::new(&mut []);
    match httparse::ParserConfig::default()
        .parse_request_with_uninit_headers(&mut req, bytes, slots)
    {
        Ok(httparse::Status::Complete(len)) => {
            if len > limits.max_bytes {
                return Err(TOO_LARGE);
            }
            let target = req.path.unwrap_or("");
            if target.len() > MAX_URI_LEN {
                return Err(refused(414, "request target too long"));
            }
            let method = Method::from_bytes(req.method.unwrap_or("").as_bytes())
                .map_err(|_| refused(400, "invalid method"))?;
            fields.extend(req.headers.iter().map(|h| Field {
                name: range_in(bytes, h.name.as_bytes()),
                value: range_in(bytes, h.value),
            }));
            let version = if req.version == Some(1) {
                Version::HTTP_11
            } else {
                Version::HTTP_10
            };
            Ok(Some(Located {
                len,
                method,
                target: range_in(bytes, target.as_bytes()),
                version,
                count: req.headers.len(),
            }))
        }
        Ok(httparse::Status::Partial) => {
            if bytes.len() > limits.max_bytes {
                return Err(TOO_LARGE);
            }
            Ok(None)
        }
        Err(e) => Err(refusal_of(e, req.method.is_none(), bytes)),
    }
}

fn parse_with(
    buf: &mut BytesMut,
    limits: Limits,
    fields: &mut Spots,
) -> Result<Option<Head>, Refused> {
    // The head is parsed from a view of the buffer, then the buffer is split: the fields
    // become slices of one shared piece, copied nowhere.
    let Some(Located {
        len,
        method,
        target,
        version,
        count,
    }) = locate(buf, limits, fields)?
    else {
        return Ok(None);
    };
    let head = buf.split_to(len).freeze();
    let read = Located {
        len,
        method,
        target,
        version,
        count,
    };
    match head_of(&head, read, fields) {
        Ok(h) => Ok(Some(h)),
        Err(r) => {
            // Refused once taken out of the buffer: the head is put back, so that its
            // answer (a `HEAD` gets none of the body) and its log read its request line.
            let mut whole = BytesMut::with_capacity(head.len() + buf.len());
            whole.extend_from_slice(&head);
            whole.extend_from_slice(buf);
            *buf = whole;
            Err(r)
        }
    }
}

/// The head located in `head` (its bytes, taken out of the buffer), its fields checked.
fn head_of(head: &Bytes, read: Located, fields: &Spots) -> Result<Head, Refused> {
    let Located {
        method,
        target,
        version,
        count,
        ..
    } = read;
    let uri = Uri::from_maybe_shared(head.slice(target.0..target.1))
        .map_err(|_| refused(400, "invalid request target"))?;
    // Room for what the gateway adds on the way (forwarding headers, request id, consumer).
    let mut headers = Fields::in_head(head.clone(), count + ADDED_ON_THE_WAY);
    let mut framing = Framing::Empty;
    let mut length: Option<u64> = None;
    let mut chunked = false;
    let is_11 = version == Version::HTTP_11;
    let mut keep_alive = is_11;
    let mut close = false;
    let mut expect_continue = false;
    let mut upgrade = method == Method::CONNECT;
    let mut te_trailers = false;
    for f in &fields[..count] {
        // httparse took the name as a token; the value is checked as `http` checks it.
        let name = &head[f.name.0..f.name.1];
        if name.len() > MAX_NAME_LEN {
            return Err(refused(400, "invalid header name"));
        }
        let value = HeaderValue::from_maybe_shared(head.slice(f.value.0..f.value.1))
            .map_err(|_| refused(400, "invalid header value"))?;
        match framing_field(name) {
            Some(Known::TransferEncoding) => {
                if !is_11 {
                    return Err(refused(400, "Transfer-Encoding in an HTTP/1.0 request"));
                }
                // Only `chunked`, once: a list, a second coding or a repeat is refused
                // rather than read one way here and another way behind.
                if chunked {
                    return Err(refused(400, "Transfer-Encoding given twice"));
                }
                if !value
                    .as_bytes()
                    .trim_ascii()
                    .eq_ignore_ascii_case(b"chunked")
                {
                    return Err(transfer_coding_refused(value.as_bytes()));
                }
                chunked = true;
            }
            Some(Known::ContentLength) => {
                let n = digits(value.as_bytes()).ok_or(refused(400, "invalid Content-Length"))?;
                if length.is_some_and(|prev| prev != n) {
                    return Err(refused(400, "two different Content-Length values"));
                }
                // An equal repeat is taken once: one length goes on, for upstreams that
                // refuse a repeated field.
                if length.replace(n).is_some() {
                    continue;
                }
            }
            Some(Known::Connection) => {
                if has_token(value.as_bytes(), b"close") {
                    close = true;
                } else if has_token(value.as_bytes(), b"keep-alive") {
                    keep_alive = true;
                }
            }
            Some(Known::Expect) => {
                expect_continue = is_11 && value.as_bytes().eq_ignore_ascii_case(b"100-continue");
            }
            Some(Known::Upgrade) => upgrade |= is_11,
            Some(Known::Te) => te_trailers |= has_token(value.as_bytes(), b"trailers"),
            None => {}
        }
        headers.push_at(f.name.0..f.name.1, value);
    }
    if chunked {
        framing = Framing::Chunked;
        if length.is_some() {
            // Both: chunked wins (RFC 9112 §6.3), the length is dropped so nothing behind
            // reads it, and the connection ends after this request.
            headers.remove("content-length");
            close = true;
        }
    } else if let Some(n) = length.filter(|n| *n > 0) {
        framing = Framing::Length(n);
    }
    // An upgrade asked with a body is not taken (RFC 9110 §7.8 lets a server stay on its
    // protocol): the request goes on as an ordinary one, body and all, and no body is left
    // between the answer and the new protocol's first bytes.
    // What follows a `CONNECT` is the tunnel the client means to open, never a request to
    // read as HTTP, whatever the answer.
    let connect = method == Method::CONNECT;
    if framing != Framing::Empty && !connect {
        upgrade = false;
    }
    Ok(Head {
        method,
        uri,
        version,
        headers,
        framing,
        keep_alive: keep_alive && !close && !connect,
        expect_continue,
        upgrade,
        te_trailers,
    })
}

/// The answer to a `Transfer-Encoding` other than `chunked` alone. RFC 9112 §6.3: one
/// whose last coding is not `chunked` leaves the body's length unknown (400, as is
/// `chunked` applied twice, which §7.1 forbids); a list ending in it, with a coding the
/// gateway does not decode before, is a coding not implemented (§6.1: 501). The
/// connection is closed either way.
fn transfer_coding_refused(value: &[u8]) -> Refused {
    let codings = || {
        value
            .split(|b| *b == b',')
            .map(<[u8]>::trim_ascii)
            .filter(|c| !c.is_empty())
    };
    let is_chunked = |c: &[u8]| c.eq_ignore_ascii_case(b"chunked");
    if codings().any(|c| c.contains(&b';')) {
        return refused(400, "transfer coding with parameters");
    }
    if codings().filter(|c| is_chunked(c)).count() > 1 {
        return refused(400, "chunked given twice");
    }
    if !codings().next_back().is_some_and(is_chunked) {
        return refused(400, "chunked is not the last transfer coding");
    }
    // `chunked` with empty list elements beside it (`chunked,`): RFC 9110 §5.6.1 has them
    // ignored, but not every reader does; refused rather than guessed.
    if codings().count() == 1 {
        return refused(400, "empty element in Transfer-Encoding");
    }
    refused(501, "transfer coding not supported (only chunked)")
}

/// Where `part` (a sub-slice of `whole`) lies in it.
fn range_in(whole: &[u8], part: &[u8]) -> (usize, usize) {
    let start = (part.as_ptr() as usize).saturating_sub(whole.as_ptr() as usize);
    (start, start + part.len())
}

/// The answer to a head httparse refused.
fn refusal_of(e: httparse::Error, no_method: bool, bytes: &[u8]) -> Refused {
    use httparse::Error as E;
    match e {
        E::TooManyHeaders => refused(431, "more than max_headers header fields"),
        E::Token if no_method => refused(400, "invalid method"),
        // A line that ends after its target (`GET /x`, HTTP/0.9's form) has no version:
        // the line itself is wrong, not the target.
        E::Token if !target_ends_in_space(bytes) => refused(400, "malformed request line"),
        E::Token => refused(400, "invalid request target"),
        E::Version if other_major(bytes) => refused(505, "HTTP version not supported"),
        E::Version => refused(400, "invalid HTTP version"),
        E::HeaderName => refused(400, "invalid header name"),
        E::HeaderValue => refused(400, "invalid header value"),
        E::NewLine | E::Status => refused(400, "malformed request line"),
    }
}

/// Whether the request line ends in a well-formed version of another major than 1
/// (`HTTP/2.0`, `HTTP/3.0`, `HTTP/0.9`): one the gateway does not speak on this line,
/// RFC 9110 §15.6.6's 505, as nginx answers it. A malformed version stays a 400.
fn other_major(bytes: &[u8]) -> bool {
    // (The line as the log shows it: after empty lines, without its end, 2 KiB at most.)
    let line = request_line(bytes);
    // Method, target, version: a target with a space in it is the line's fault (400).
    if line.iter().filter(|b| **b == b' ').count() != 2 {
        return false;
    }
    let version = line.rsplit(|b| *b == b' ').next().unwrap_or_default();
    match version.strip_prefix(b"HTTP/") {
        Some([major, b'.', minor]) => {
            major.is_ascii_digit() && minor.is_ascii_digit() && *major != b'1'
        }
        _ => false,
    }
}

/// Whether the request line holds a space after its method's: a target followed by more.
fn target_ends_in_space(bytes: &[u8]) -> bool {
    let line = after_empty_lines(bytes)
        .split(|b| *b == b'\n')
        .next()
        .unwrap_or_default();
    line.iter().filter(|b| **b == b' ').count() >= 2
}

/// A `Content-Length` value: digits only (no sign, no spaces, no list), no overflow.
pub fn digits(v: &[u8]) -> Option<u64> {
    if v.is_empty() {
        return None;
    }
    v.iter().try_fold(0u64, |n, b| {
        if b.is_ascii_digit() {
            n.checked_mul(10)?.checked_add(u64::from(b - b'0'))
        } else {
            None
        }
    })
}

/// Whether a comma-separated header value holds `token` (any case).
pub fn has_token(v: &[u8], token: &[u8]) -> bool {
    v.split(|b| *b == b',')
        .any(|t| t.trim_ascii().eq_ignore_ascii_case(token))
}

/// The bytes of a head's answer when it is refused: a JSON body as every answer the gateway
/// gives itself (its length alone when the request was a `HEAD`), naming the request's
/// `id` when it has one, and `Connection: close` (the framing is in doubt).
pub fn refusal_answer(r: Refused, head: bool, id: Option<&[u8]>, date: &[u8], out: &mut Vec<u8>) {
    // The id is one the handler made (the gateway's: 32 hex digits): it needs no escaping.
    let id = id.map(String::from_utf8_lossy);
    let body = refusal_body(r, id.as_deref());
    let reason = http::StatusCode::from_u16(r.status)
        .ok()
        .and_then(|s| s.canonical_reason())
        .unwrap_or("Bad Request");
    out.extend_from_slice(
        format!(
            "HTTP/1.1 {} {reason}\r\ncontent-type: application/json\r\nconnection: close\r\n\
             content-length: {}\r\ndate: ",
            r.status,
            body.len()
        )
        .as_bytes(),
    );
    out.extend_from_slice(date);
    if let Some(id) = &id {
        out.extend_from_slice(b"\r\nx-request-id: ");
        out.extend_from_slice(id.as_bytes());
    }
    out.extend_from_slice(b"\r\n\r\n");
    if !head {
        out.extend_from_slice(body.as_bytes());
    }
}

/// The JSON body of [`refusal_answer`] (what its access log line counts as sent).
pub fn refusal_body(r: Refused, id: Option<&str>) -> String {
    match id {
        Some(id) => format!(
            "{{\"status\":{},\"error\":\"{}\",\"request_id\":\"{id}\"}}\n",
            r.status, r.reason
        ),
        None => format!("{{\"status\":{},\"error\":\"{}\"}}\n", r.status, r.reason),
    }
}

/// What came of a request line (after any empty lines), for the log of a head refused
/// before it parsed: at most 2 KiB of it, without its line end.
pub fn request_line(buf: &[u8]) -> &[u8] {
    let b = after_empty_lines(buf);
    let b = &b[..b.len().min(2048)];
    let end = b.iter().position(|&c| c == b'\n').unwrap_or(b.len());
    b[..end].strip_suffix(b"\r").unwrap_or(&b[..end])
}

/// Whether a head refused before it parsed whole asked with `HEAD`: its answer then carries
/// no body (RFC 9110 §9.3.2).
pub fn asks_head(buf: &[u8]) -> bool {
    after_empty_lines(buf).starts_with(b"HEAD ")
}

/// `buf` from its first byte that is neither CR nor LF: the empty lines a request line may
/// follow (RFC 9112 §2.2) are skipped.
pub fn after_empty_lines(buf: &[u8]) -> &[u8] {
    let start = buf
        .iter()
        .position(|&b| b != b'\r' && b != b'\n')
        .unwrap_or(buf.len());
    &buf[start..]
}
