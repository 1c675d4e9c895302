//! `h1_framing`: the HTTP/1.1 server's framing decision held against a reference parser,
//! hyper's HTTP/1.1 server, on the same bytes. Request smuggling is two parsers reading one
//! message two ways; this target reports every way the two differ that is not one of the
//! server's deliberate refusals (where it is stricter than hyper, listed in `DELIBERATE`).

use super::runtime::{HANG, RUNTIME};
use crate::listener::h1::chunked::{Decoded, Decoder};
use crate::listener::h1::head::{self, Framing, Limits};
use bytes::{Bytes, BytesMut};
use http_body_util::BodyExt;
use hyper::service::service_fn;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The limits both parsers run with.
const LIMITS: Limits = Limits {
    max_bytes: 8 * 1024,
    max_headers: 32,
};

/// Refusals where the server is stricter than hyper on purpose: only `chunked`, once, as a
/// transfer coding (hyper takes any list ending in it); no control bytes in a chunk-size
/// line; trailers only as a complete, well-formed field section with CRLF line ends; 16 KiB
/// of chunk extensions per body, counted with their whitespace (hyper counts a little less).
const DELIBERATE: &[&str] = &[
    "transfer coding not supported (only chunked)",
    "chunked given twice",
    "chunked is not the last transfer coding",
    "transfer coding with parameters",
    "empty element in Transfer-Encoding",
    "Transfer-Encoding given twice",
    "control byte in a chunk size line",
    "malformed trailer section",
    "trailers larger than max_header_bytes",
    "chunk extensions too large",
];

/// A refusal that is deliberate only beside a `Transfer-Encoding`: an invalid length is
/// refused even then, where hyper does not read the length at all.
const INVALID_LENGTH: &str = "invalid Content-Length";

/// Whether the head at the start of `data` has a `Transfer-Encoding` field.
fn has_transfer_coding(data: &[u8]) -> bool {
    let mut fields = [httparse::EMPTY_HEADER; 64];
    let mut req = httparse::Request::new(&mut fields);
    req.parse(data).is_ok()
        && req
            .headers
            .iter()
            .any(|h| h.name.eq_ignore_ascii_case("transfer-encoding"))
}

/// What hyper's service saw of the first request's body (its bytes, or whether it broke
/// off incomplete), and the request line of the second request it was given.
type Seen = Arc<Mutex<(Option<Result<Vec<u8>, bool>>, Option<String>)>>;

/// What a parser made of the first request in the bytes.
#[derive(Debug, PartialEq)]
enum Verdict {
    /// Refused, with the status and (ours) the reason.
    Refused(u16, &'static str),
    /// Head or body not complete when the bytes ended.
    Incomplete,
    /// Read whole: its body, whether the connection may be kept, and the request line
    /// (method and target) of the request that follows, when one is read whole after it.
    Accepted {
        body: Vec<u8>,
        keep_alive: bool,
        next: Option<String>,
    },
}

/// Ours: the head, then the body decoded from what follows it.
fn ours(data: &[u8]) -> Verdict {
    let mut buf = BytesMut::from(data);
    let h = match head::parse(&mut buf, LIMITS) {
        Ok(None) => return Verdict::Incomplete,
        Err(r) => return Verdict::Refused(r.status, r.reason),
        Ok(Some(h)) => h,
    };
    let mut d = match h.framing {
        Framing::Empty => Decoder::length(0),
        Framing::Length(n) => Decoder::length(n),
        Framing::Chunked => Decoder::chunked(LIMITS.max_bytes, LIMITS.max_headers),
    };
    let mut body = Vec::new();
    loop {
        match d.decode(&mut buf) {
            Ok(Decoded::Data(b)) => body.extend_from_slice(&b),
            Ok(Decoded::Trailers(_) | Decoded::End) => {
                // Where the next request starts is where smuggling would show.
                let next = match head::parse(&mut buf, LIMITS) {
                    Ok(Some(n)) => Some(format!("{} {}", n.method, n.uri)),
                    _ => None,
                };
                return Verdict::Accepted {
                    body,
                    keep_alive: h.keep_alive,
                    next,
                };
            }
            Ok(Decoded::Need) => return Verdict::Incomplete,
            Err(b) => return Verdict::Refused(400, b.0),
        }
    }
}

/// hyper's: its server on an in-memory connection that carries the bytes, then ends; the
/// service reads the body whole and answers 200.
fn theirs(data: &[u8]) -> Verdict {
    RUNTIME.with(|rt| {
        rt.block_on(async {
            let (mut client, server) = tokio::io::duplex(data.len() + 64 * 1024);
            let seen: Seen = Arc::default();
            let record = seen.clone();
            let svc = service_fn(move |req: http::Request<hyper::body::Incoming>| {
                let record = record.clone();
                async move {
                    let line = format!("{} {}", req.method(), req.uri());
                    let got = match req.into_body().collect().await {
                        Ok(c) => Ok(c.to_bytes().to_vec()),
                        Err(e) => Err(e.is_incomplete_message()),
                    };
                    let mut slot = record.lock().unwrap_or_else(|p| p.into_inner());
                    if slot.0.is_none() {
                        slot.0 = Some(got);
                    } else if slot.1.is_none() {
                        slot.1 = Some(line);
                    }
                    Ok::<_, Infallible>(http::Response::new(http_body_util::Empty::<Bytes>::new()))
                }
            });
            let mut b = hyper::server::conn::http1::Builder::new();
            b.max_headers(LIMITS.max_headers)
                .max_header_size(LIMITS.max_bytes)
                .max_buf_size(LIMITS.max_bytes.max(8192))
                .half_close(true)
                .keep_alive(true);
            let conn = b.serve_connection(hyper_util::rt::TokioIo::new(server), svc);
            let _ = client.write_all(data).await;
            let _ = client.shutdown().await;
            let mut answer = Vec::new();
            let read = async {
                let _ = client.read_to_end(&mut answer).await;
            };
            let both = async { tokio::join!(conn, read) };
            if tokio::time::timeout(HANG, both).await.is_err() {
                panic!("hyper's server hung on {data:?}");
            }
            let status = answer
                .get(9..12)
                .and_then(|s| std::str::from_utf8(s).ok())
                .and_then(|s| s.parse::<u16>().ok());
            let first_head_end = answer.windows(4).position(|w| w == b"\r\n\r\n");
            let closes = first_head_end.is_some_and(|end| {
                String::from_utf8_lossy(&answer[..end])
                    .to_ascii_lowercase()
                    .contains("connection: close")
            });
            let (first, next) =
                std::mem::take(&mut *seen.lock().unwrap_or_else(|p| p.into_inner()));
            match (status, first) {
                (None, None) => Verdict::Incomplete,
                (Some(s), None) => Verdict::Refused(s, ""),
                (_, Some(Err(true))) => Verdict::Incomplete,
                (_, Some(Err(false))) => Verdict::Refused(400, ""),
                (_, Some(Ok(body))) => Verdict::Accepted {
                    body,
                    keep_alive: !closes,
                    next,
                },
            }
        })
    })
}

/// `h1_framing`: the bytes a client sends; ours and hyper's reading of the first request
/// must agree (or ours refuse on purpose).
pub fn h1_framing(data: &[u8]) {
    let a = ours(data);
    let b = theirs(data);
    let shown = String::from_utf8_lossy(data);
    match (&a, &b) {
        (
            Verdict::Accepted {
                body: x,
                keep_alive: kx,
                next: nx,
            },
            Verdict::Accepted {
                body: y,
                keep_alive: ky,
                next: ny,
            },
        ) => {
            assert_eq!(x, y, "the two read different bodies from {shown:?}");
            assert!(
                !*kx || *ky,
                "ours keeps the connection where hyper closes it: {shown:?}"
            );
            // Where ours reads a second request, hyper reads the same one: the first ended
            // at the same byte for both. (Where only hyper reads one, ours waits for more or
            // refuses: nothing is served from it.)
            if let (true, Some(a)) = (*kx, nx) {
                assert_eq!(
                    Some(a),
                    ny.as_ref(),
                    "the two read different next requests from {shown:?}"
                );
            }
        }
        (Verdict::Accepted { .. }, _) => {
            panic!("ours accepts what hyper does not ({b:?}): {shown:?}")
        }
        (Verdict::Incomplete, Verdict::Accepted { .. }) => {
            panic!("ours waits for more where hyper read a whole request: {shown:?}")
        }
        (Verdict::Refused(_, why), Verdict::Accepted { .. }) => {
            assert!(
                DELIBERATE.contains(why) || (*why == INVALID_LENGTH && has_transfer_coding(data)),
                "ours refuses ({why}) what hyper accepts: {shown:?}"
            );
        }
        // Both refuse, or one waits where the other refused: no request was read either way.
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_parsers_report_the_request_that_follows() {
        let two = b"POST /a HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\nhiGET /b HTTP/1.1\r\nHost: a\r\n\r\n";
        for v in [ours(two), theirs(two)] {
            match v {
                Verdict::Accepted { body, next, .. } => {
                    assert_eq!(body, b"hi");
                    assert_eq!(next.as_deref(), Some("GET /b"));
                }
                other => panic!("{other:?}"),
            }
        }
        h1_framing(two);
    }
}
