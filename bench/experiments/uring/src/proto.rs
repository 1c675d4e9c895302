//! The work of seed scenario 1 on bytes, shared by every engine: parse the request head,
//! find `apikey` in the query, answer 401 for an unknown key, else rewrite the head for the
//! upstream (key removed from the query, hop-by-hop headers dropped, the consumer and
//! `X-Forwarded-For` added); find where the upstream's answer ends.

/// What to do with one request.
pub enum Action {
    /// Answer the client with these bytes; the upstream is not asked.
    Answer(&'static [u8]),
    /// Send these bytes upstream, and its answer back.
    Forward(Vec<u8>),
}

const UNKNOWN: &[u8] = b"HTTP/1.1 401 Unauthorized\r\ncontent-type: application/json\r\ncontent-length: 40\r\n\r\n{\"status\":401,\"error\":\"unknown API key\"}";
const BAD: &[u8] = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n";

fn consumer(key: &[u8]) -> Option<&'static str> {
    match key {
        b"t1" => Some("consumer-1"),
        b"t2" => Some("consumer-2"),
        b"t3" => Some("consumer-3"),
        _ => None,
    }
}

/// The first request in `buf`: its length and what to do, or `None` while it is incomplete.
pub fn request(buf: &[u8], peer: &str) -> Option<(usize, Action)> {
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut req = httparse::Request::new(&mut headers);
    let len = match req.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return None,
        Err(_) => return Some((buf.len(), Action::Answer(BAD))),
    };
    let (Some(method), Some(target)) = (req.method, req.path) else {
        return Some((buf.len(), Action::Answer(BAD)));
    };
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let mut who = None;
    let mut out = Vec::with_capacity(len + 96);
    out.extend_from_slice(method.as_bytes());
    out.push(b' ');
    out.extend_from_slice(path.as_bytes());
    let mut sep = b'?';
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        if k == "apikey" {
            who = consumer(v.as_bytes());
        } else {
            out.push(sep);
            out.extend_from_slice(pair.as_bytes());
            sep = b'&';
        }
    }
    let Some(who) = who else {
        return Some((len, Action::Answer(UNKNOWN)));
    };
    out.extend_from_slice(b" HTTP/1.1\r\n");
    for h in req.headers.iter() {
        let n = h.name;
        if n.eq_ignore_ascii_case("connection")
            || n.eq_ignore_ascii_case("keep-alive")
            || n.eq_ignore_ascii_case("x-consumer")
            || n.eq_ignore_ascii_case("x-forwarded-for")
        {
            continue;
        }
        out.extend_from_slice(n.as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(h.value);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"x-consumer: ");
    out.extend_from_slice(who.as_bytes());
    out.extend_from_slice(b"\r\nx-forwarded-for: ");
    out.extend_from_slice(peer.as_bytes());
    out.extend_from_slice(b"\r\n\r\n");
    Some((len, Action::Forward(out)))
}

/// The length of the whole answer at the start of `buf` (head and `Content-Length` body),
/// or `None` while it is incomplete. Answers framed otherwise are not handled: the spike's
/// backend always sends a length.
pub fn response_len(buf: &[u8]) -> Option<usize> {
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut resp = httparse::Response::new(&mut headers);
    let head = match resp.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        _ => return None,
    };
    let body = resp
        .headers
        .iter()
        .find(|h| h.name.eq_ignore_ascii_case("content-length"))
        .and_then(|h| {
            std::str::from_utf8(h.value)
                .ok()?
                .trim()
                .parse::<usize>()
                .ok()
        })
        .unwrap_or(0);
    (buf.len() >= head + body).then_some(head + body)
}
