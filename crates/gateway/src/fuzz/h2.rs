//! The HTTP/2 server's targets: HPACK, and whole connections fed arbitrary frames.

use super::runtime::{HANG, RUNTIME};
use crate::listener::h2::hpack::{self, Decoder, Field};
use crate::listener::h2::{Connection, Limits};
use crate::listener::RequestBody;
use bytes::Bytes;
use http::header::{HeaderName, HeaderValue};
use http::Response;
use http_body_util::{BodyExt, Full};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// `hpack`: header blocks decoded in sequence by one decoder, so that later blocks meet
/// the dynamic table earlier ones left. Input: a byte choosing the header list limit, then
/// blocks, each a length byte (`0xff`: the rest of the input) and its bytes. Every regular
/// field decoded must encode back (`encode_field`) to itself.
pub fn hpack(data: &[u8]) {
    let Some((&first, mut rest)) = data.split_first() else {
        return;
    };
    let max_list = 64usize << (first & 0x0f);
    let mut decoder = Decoder::default();
    while let Some((&len, tail)) = rest.split_first() {
        let n = if len == 0xff {
            tail.len()
        } else {
            usize::from(len).min(tail.len())
        };
        let (block, tail) = tail.split_at(n);
        rest = tail;
        let Ok(decoded) = decoder.decode(Bytes::copy_from_slice(block), max_list) else {
            // A compression error ends the connection: the table is no longer in step.
            decoder = Decoder::default();
            continue;
        };
        let mut size = 0usize;
        for field in &decoded.fields {
            match field {
                Field::Header(name, value) => {
                    size += name.as_str().len() + value.len() + 32;
                    assert_eq!(round_trip(name, value), Some((name.clone(), value.clone())));
                }
                Field::Pseudo(_, value) => size += value.len() + 32,
                Field::Malformed => {}
            }
        }
        assert!(
            decoded.too_large || size <= max_list,
            "a header list of {size} bytes passed a limit of {max_list}"
        );
    }
}

/// One field through the encoder and a fresh decoder.
pub(super) fn round_trip(
    name: &HeaderName,
    value: &HeaderValue,
) -> Option<(HeaderName, HeaderValue)> {
    let mut out = Vec::new();
    hpack::encode_field(&mut out, name, value);
    let decoded = Decoder::default()
        .decode(Bytes::from(out), usize::MAX)
        .ok()?;
    match decoded.fields.as_slice() {
        [Field::Header(n, v)] => Some((n.clone(), v.clone())),
        _ => None,
    }
}

/// The limits the `h2_frames` connection runs with: small, so that they are reached.
fn h2_limits() -> Limits {
    Limits {
        max_streams: 16,
        max_header_list: 4096,
        stream_window: 65_535,
        connection_window: 1 << 20,
        max_resets: 32,
        idle: Duration::from_secs(30),
        send_timeout: Duration::from_secs(30),
        max_headers: 16,
        max_request_buffer: 128 << 10,
        max_header_held: crate::listener::h2::held_headers(4096),
    }
}

/// The handler of `h2_frames`: reads the request body (up to 1 MiB), then answers 200;
/// with a body larger than the initial window when the path starts with `/big`.
async fn h2_answer(req: crate::exchange::Parts, mut body: RequestBody) -> Response<Full<Bytes>> {
    let big = req.uri.path().starts_with("/big");
    let mut read = 0usize;
    while read < 1 << 20 {
        match body.frame().await {
            Some(Ok(f)) => read += f.data_ref().map_or(0, Bytes::len),
            _ => break,
        }
    }
    let out = if big {
        Bytes::from(vec![b'x'; 100_000])
    } else {
        Bytes::from(format!("read {read}\n"))
    };
    Response::new(Full::new(out))
}

/// `h2_frames`: one HTTP/2 server connection fed the client preface, then the input, over
/// an in-memory pipe whose other end reads everything the server writes. After the input
/// the client closes its side: the connection must then end, within [`HANG`].
pub fn h2_frames(data: &[u8]) {
    RUNTIME.with(|rt| {
        rt.block_on(async {
            let (mut client, server) = tokio::io::duplex(16 * 1024);
            let conn = Connection::new(server, h2_limits(), h2_answer);
            let peer = async move {
                let (mut rd, mut wr) = tokio::io::split(&mut client);
                let write = async {
                    let _ = wr.write_all(crate::listener::h2::PREFACE).await;
                    let _ = wr.write_all(data).await;
                    // Time for the streams to run before the client goes.
                    for _ in 0..8 {
                        tokio::task::yield_now().await;
                    }
                    let _ = wr.shutdown().await;
                };
                let read = async {
                    let mut sink = [0u8; 16 * 1024];
                    while matches!(rd.read(&mut sink).await, Ok(n) if n > 0) {}
                };
                tokio::join!(write, read);
            };
            let both = async {
                let (_, served) = tokio::join!(peer, conn);
                served
            };
            assert!(
                tokio::time::timeout(HANG, both).await.is_ok(),
                "the connection did not end after the client closed"
            );
        });
    });
}
