//! Fuzz harnesses for the gateway's hand-written parsers: one `fn(&[u8])` per target of
//! `fuzz/` (`cargo +nightly fuzz run <target>`), replayed on stable over the committed
//! corpora by `tests/fuzz_corpus.rs`. Each panics when an invariant breaks, so that a
//! fuzzer reports it; none of this is used by the gateway itself.

use crate::cache::control;
use crate::inbound;
use crate::listener::h2::hpack::{self, Decoder, Field};
use crate::listener::h2::{Connection, Limits};
use crate::listener::RequestBody;
use crate::upstream::h1::{H1Body, RawPool};
use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use std::future::poll_fn;
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::runtime::Runtime;

/// How long one input may take before the harness calls it a hang.
const HANG: Duration = Duration::from_secs(5);

thread_local! {
    /// One single-threaded runtime per thread, reused by every input.
    static RUNTIME: Runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a current-thread runtime");
}

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
fn round_trip(name: &HeaderName, value: &HeaderValue) -> Option<(HeaderName, HeaderValue)> {
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
    }
}

/// The handler of `h2_frames`: reads the request body (up to 1 MiB), then answers 200;
/// with a body larger than the initial window when the path starts with `/big`.
async fn h2_answer(req: Request<RequestBody>) -> Response<Full<Bytes>> {
    let big = req.uri().path().starts_with("/big");
    let mut body = req.into_body();
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

thread_local! {
    /// The loopback backend of `upstream_h1` and a pool that keeps nothing idle (made
    /// outside any runtime: no reaper task is left behind).
    static BACKEND: (std::net::TcpListener, Arc<RawPool>) = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a loopback listener");
        listener.set_nonblocking(true).expect("non-blocking");
        let addr = listener.local_addr().expect("its address");
        let cap = crate::upstream::cap::Cap::new(usize::MAX >> 4);
        let pool = RawPool::new(
            &addr.to_string(),
            0,
            Duration::from_secs(60),
            Duration::from_secs(1),
            cap,
        );
        (listener, pool)
    };
}

/// `upstream_h1`: the lean HTTP/1.1 client's response parsing, head and body, over a
/// loopback connection. Input: a byte choosing the method (HEAD or GET) and the size of the
/// pieces the backend writes, then the bytes the backend answers before it closes.
pub fn upstream_h1(data: &[u8]) {
    let Some((&first, response)) = data.split_first() else {
        return;
    };
    let method = if first & 1 == 1 {
        Method::HEAD
    } else {
        Method::GET
    };
    let piece = [1, 7, 64, 512, 4096, usize::MAX][usize::from(first >> 1) % 6];
    let (listener, pool) = BACKEND.with(|(l, p)| (l.try_clone().expect("the listener"), p.clone()));
    RUNTIME.with(|rt| {
        rt.block_on(async {
            let listener =
                tokio::net::TcpListener::from_std(listener).expect("the listener registered");
            let request = b"GET / HTTP/1.1\r\nhost: fuzz\r\n\r\n";
            let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
            let backend = async {
                let Ok((mut s, _)) = listener.accept().await else {
                    return;
                };
                // Read the request first: closing on unread bytes would reset the connection.
                let mut req = [0u8; 64];
                let _ = s.read_exact(&mut req[..request.len()]).await;
                for chunk in response.chunks(piece) {
                    if s.write_all(chunk).await.is_err() {
                        break;
                    }
                    tokio::task::yield_now().await;
                }
                let _ = s.shutdown().await;
                let _ = done_rx.await;
            };
            let client = async {
                let permit = Arc::new(tokio::sync::Semaphore::new(1))
                    .acquire_owned()
                    .await
                    .expect("a permit");
                let conn = pool.connect(permit).await.expect("a loopback connection");
                exchange(conn, request, &method, response, &pool).await;
                let _ = done_tx.send(());
            };
            let both = async { tokio::join!(backend, client) };
            assert!(
                tokio::time::timeout(HANG, both).await.is_ok(),
                "the exchange did not end after the backend closed"
            );
        });
    });
}

/// One exchange and its body read to the end, with what must hold of them.
async fn exchange(
    conn: crate::upstream::h1::H1Conn,
    request: &[u8],
    method: &Method,
    response: &[u8],
    pool: &Arc<RawPool>,
) {
    let Ok((head, body)) = conn.exchange(request, method).await else {
        return;
    };
    assert!(!head.status.is_informational(), "a 1xx head came through");
    let mut body: H1Body = body.with_pool(pool.clone());
    let mut total = 0usize;
    let clean = loop {
        match poll_fn(|cx| body.poll_data(cx)).await {
            Some(Ok(piece)) => total += piece.len(),
            Some(Err(_)) => break false,
            None => break true,
        }
    };
    assert!(total <= response.len(), "more body than was sent");
    let framed_by_length = !head.headers.contains_key(header::TRANSFER_ENCODING)
        && *method == Method::GET
        && !matches!(head.status.as_u16(), 204 | 304);
    if let (true, true, Some(len)) = (
        clean,
        framed_by_length,
        head.headers.get(header::CONTENT_LENGTH),
    ) {
        let len = len.to_str().ok().and_then(|l| l.parse::<usize>().ok());
        assert_eq!(
            len,
            Some(total),
            "a body that ended cleanly short of its length"
        );
    }
    if clean {
        assert!(body.is_done());
    }
}

/// `path_host`: the request-target and Host checks. The input as a string is a path and a
/// host; their invariants are asserted (see [`check_path`] and [`check_host`]).
pub fn path_host(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    check_path(&text);
    check_host(&text);
    // A `/`-rooted variant, so that paths are reached whatever the first byte.
    check_path(&format!("/{text}"));
}

/// What a normalized path must be: a fixed point of `normalize_path`, without `.` or `..`
/// segments (`;` parameters aside), empty segments, backslashes or encoded slashes.
pub fn check_path(path: &str) {
    let normal = match inbound::normalize_path(path) {
        Err(_) => return,
        Ok(None) if path == "*" => return,
        Ok(None) => path.to_string(),
        Ok(Some(n)) => {
            assert!(
                matches!(inbound::normalize_path(&n), Ok(None)),
                "not idempotent: {path:?} → {n:?} → {:?}",
                inbound::normalize_path(&n)
            );
            n
        }
    };
    assert!(normal.starts_with('/'), "{path:?} → {normal:?}");
    assert!(!normal.contains('\\'), "{path:?} → {normal:?}");
    let upper = normal.to_ascii_uppercase();
    assert!(
        !upper.contains("%2F") && !upper.contains("%5C") && !upper.contains("%00"),
        "{path:?} → {normal:?}"
    );
    for seg in normal.split('/') {
        let name = seg.split(';').next().unwrap_or(seg);
        assert!(
            name != "." && name != "..",
            "dot-segment in {normal:?} (from {path:?})"
        );
    }
    for seg in inbound::routing_path(&normal).split('/') {
        assert!(seg != "." && seg != "..", "dot-segment routed: {normal:?}");
    }
}

/// What a host `valid_host` accepts must be: ASCII, without userinfo, percent-escapes,
/// slashes, or a second `:` outside brackets; `host_only` of it valid and a fixed point.
pub fn check_host(host: &str) {
    if !inbound::valid_host(host) {
        return;
    }
    assert!(host.is_ascii(), "{host:?}");
    assert!(!host.contains(['@', '%', '/', '\\', ' ']), "{host:?}");
    let outside = match (host.find('['), host.find(']')) {
        (Some(0), Some(end)) => &host[end + 1..],
        (None, None) => host,
        _ => panic!("unbalanced brackets accepted: {host:?}"),
    };
    assert!(outside.matches(':').count() <= 1, "two colons: {host:?}");
    assert!(HeaderValue::from_str(host).is_ok(), "{host:?}");
    let only = inbound::host_only(host);
    assert!(inbound::valid_host(only), "{host:?} → {only:?}");
    assert_eq!(inbound::host_only(only), only, "{host:?}");
    assert!(!only.ends_with('.'), "{host:?} → {only:?}");
}

/// The headers `cache_control` lines may set, chosen by their first byte.
const CACHE_HEADERS: [(bool, HeaderName); 11] = [
    (false, header::CACHE_CONTROL),
    (false, header::CACHE_CONTROL),
    (false, header::VARY),
    (false, header::EXPIRES),
    (false, header::DATE),
    (false, header::AGE),
    (false, header::ETAG),
    (true, header::CACHE_CONTROL),
    (false, header::LAST_MODIFIED),
    (false, HeaderName::from_static("surrogate-control")),
    (false, HeaderName::from_static("cdn-cache-control")),
];

/// `cache_control`: `directives` and `storable` on arbitrary headers. Input: lines, each a
/// byte choosing the header (and whether request or response) and its value; the first line
/// chooses status, method and `authorized` instead.
pub fn cache_control(data: &[u8]) {
    let mut lines = data.split(|b| *b == b'\n');
    let knobs = lines.next().unwrap_or_default();
    let knob = |i: usize| knobs.get(i).copied().unwrap_or(0);
    let (mut req, mut resp) = (HeaderMap::new(), HeaderMap::new());
    for line in lines {
        let Some((&which, value)) = line.split_first() else {
            continue;
        };
        let Ok(value) = HeaderValue::from_bytes(value) else {
            continue;
        };
        let (on_request, name) = &CACHE_HEADERS[usize::from(which) % CACHE_HEADERS.len()];
        let map = if *on_request { &mut req } else { &mut resp };
        map.append(name.clone(), value);
    }
    // The directives this cache follows: a targeted field's, or else Cache-Control's.
    let (d, _) = control::response_directives(&resp);
    assert!(control::age(&resp).is_none_or(|a| a <= 1 << 31));
    for v in [
        d.max_age,
        d.s_maxage,
        d.stale_while_revalidate,
        d.stale_if_error,
    ]
    .into_iter()
    .flatten()
    {
        assert!(v <= 1 << 31, "{v} seconds");
    }
    let status = [200, 203, 204, 206, 301, 304, 404, 418, 500, 101][usize::from(knob(0)) % 10];
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::OK);
    let method = if knob(1) & 1 == 0 {
        Method::GET
    } else {
        Method::POST
    };
    let authorized = knob(1) & 2 != 0;
    let arrived = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
    let ttl = Duration::from_secs(u64::from(knob(2)));
    let Some(f) = control::storable(&method, status, &req, &resp, authorized, ttl, arrived) else {
        return;
    };
    // `must-understand` on a status the cache knows sets `no-store` aside.
    assert!(method == Method::GET && (!d.no_store || d.must_understand));
    assert!(!d.private && !d.malformed);
    assert!(!control::directives(&req).no_store);
    assert!(!authorized || d.public || d.must_revalidate || d.s_maxage.is_some());
    assert_eq!(f.must_revalidate, d.must_revalidate);
    assert_eq!(f.no_cache, d.no_cache);
    let validators = resp.contains_key(header::ETAG) || resp.contains_key(header::LAST_MODIFIED);
    assert!(!f.lifetime.is_zero() || validators);
    if let Some(s) = d.s_maxage.or(d.max_age) {
        assert_eq!(f.lifetime, Duration::from_secs(s));
    }
}

/// `range_query`: the request pieces the cache reads by hand. The first line is a `Range`
/// value judged against a body length taken from the second line's length; every later
/// line is a query parameter name. A range served must lie inside the body; a name must
/// decode without panicking and match itself as it would be configured.
pub fn range_query(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let mut lines = text.split('\n');
    let range = lines.next().unwrap_or("");
    let len = lines.next().map_or(0, str::len) * 37;
    if let Ok(v) = HeaderValue::from_str(range) {
        let mut req = HeaderMap::new();
        req.insert(header::RANGE, v);
        if let Some(Ok(r)) = crate::cache::answer::byte_range(&req, len) {
            assert!(
                r.start < r.end && r.end <= len,
                "{range:?} on {len} bytes: {r:?}"
            );
        }
    }
    for raw in lines {
        let name = crate::query::param_name(raw);
        assert!(!name.contains('\0'), "{raw:?} → {name:?}");
        assert!(!name.starts_with(' '), "{raw:?} → {name:?}");
        assert!(crate::query::same_param(&name, &name), "{raw:?}");
        let _ = crate::query::is_one_of(raw, &[name.to_string()]);
    }
}

#[cfg(test)]
mod props {
    //! Property tests of the same parsers: normalization, the HPACK encoder against the
    //! decoder, and the access log's JSON strings against serde_json's.

    use super::*;
    use proptest::prelude::*;

    /// Path pieces that meet the normalizer's cases: dots, parameters, escapes, slashes.
    fn path() -> impl Strategy<Value = String> {
        let piece = prop::sample::select(vec![
            "/",
            "/",
            "a",
            "b~",
            ".",
            "..",
            ";",
            ";x=1",
            "%2e",
            "%2E",
            "%2f",
            "%5c",
            "%00",
            "%25",
            "%41",
            "%7e",
            "%e2%82%ac",
            "%",
            "%g1",
            "\\",
            "//",
            "é",
            "?",
            "#",
            "*",
        ]);
        prop_oneof![
            prop::collection::vec(piece, 0..16).prop_map(|p| p.concat()),
            any::<String>().prop_map(|s| format!("/{s}")),
        ]
    }

    /// A regular field HTTP/2 allows: a lowercase name and a value without edge white space.
    fn field() -> impl Strategy<Value = (HeaderName, HeaderValue, bool)> {
        let name = prop_oneof![
            prop::sample::select(vec![
                "content-type",
                "content-length",
                "date",
                "server",
                "cache-control",
                "etag",
                "set-cookie",
                "www-authenticate",
                "via",
                "link",
                "x-request-id",
            ])
            .prop_map(String::from),
            "[a-z0-9!#$%&'*+.^_`|~-]{1,24}",
        ];
        let value =
            prop::collection::vec(prop_oneof![0x20u8..0x7f, Just(b'\t'), 0x80u8..=0xff], 0..64)
                .prop_map(|v| {
                    let edge = |b: &u8| *b == b' ' || *b == b'\t';
                    let start = v.iter().position(|b| !edge(b)).unwrap_or(v.len());
                    let end = v.iter().rposition(|b| !edge(b)).map_or(start, |e| e + 1);
                    v[start..end].to_vec()
                });
        (name, value, any::<bool>()).prop_filter_map("a valid field", |(n, v, s)| {
            let n = HeaderName::from_lowercase(n.as_bytes()).ok()?;
            let mut v = HeaderValue::from_bytes(&v).ok()?;
            v.set_sensitive(s);
            Some((n, v, s))
        })
    }

    /// serde_json's string escapes, with `\b` and `\f` written as `\u00XX` as the
    /// access log writes them: both are valid JSON for the same string.
    struct LogEscapes;

    impl serde_json::ser::Formatter for LogEscapes {
        fn write_char_escape<W: ?Sized + std::io::Write>(
            &mut self,
            w: &mut W,
            e: serde_json::ser::CharEscape,
        ) -> std::io::Result<()> {
            use serde_json::ser::CharEscape;
            match e {
                CharEscape::Backspace => w.write_all(b"\\u0008"),
                CharEscape::FormFeed => w.write_all(b"\\u000c"),
                other => serde_json::ser::CompactFormatter.write_char_escape(w, other),
            }
        }
    }

    fn serde_escaped(s: &str) -> Vec<u8> {
        let mut out = Vec::new();
        let mut ser = serde_json::Serializer::with_formatter(&mut out, LogEscapes);
        serde::Serialize::serialize(s, &mut ser).expect("a string serializes");
        out
    }

    proptest! {
        #[test]
        fn normalized_paths_are_fixed_points_without_dot_segments(p in path()) {
            check_path(&p);
        }

        #[test]
        fn accepted_hosts_hold_no_second_authority(h in "[a-zA-Z0-9.:\\[\\]@%/_-]{0,24}") {
            check_host(&h);
        }

        #[test]
        fn hpack_encoded_fields_decode_to_themselves(
            blocks in prop::collection::vec(
                (100u16..1000, prop::collection::vec(field(), 0..12)),
                1..4,
            )
        ) {
            let mut decoder = Decoder::default();
            for (status, fields) in blocks {
                let status = StatusCode::from_u16(status).expect("100..1000");
                let mut out = Vec::new();
                hpack::encode_status(&mut out, status);
                for (n, v, _) in &fields {
                    hpack::encode_field(&mut out, n, v);
                }
                let got = decoder.decode(Bytes::from(out), usize::MAX).expect("decodes");
                prop_assert!(!got.too_large);
                prop_assert_eq!(got.fields.len(), fields.len() + 1);
                match &got.fields[0] {
                    Field::Pseudo(hpack::Pseudo::Other, v) => {
                        prop_assert_eq!(&v[..], status.as_str().as_bytes());
                    }
                    _ => prop_assert!(false, "not :status"),
                }
                for (got, (n, v, _)) in got.fields[1..].iter().zip(&fields) {
                    match got {
                        Field::Header(gn, gv) => {
                            prop_assert_eq!(gn, n);
                            prop_assert_eq!(gv, v);
                        }
                        _ => prop_assert!(false, "{n}: {v:?} came back malformed"),
                    }
                }
            }
        }

        #[test]
        fn log_strings_escape_as_serde_json_does(
            s in prop_oneof![
                any::<String>(),
                prop::collection::vec(prop::char::range('\0', '\u{7f}'), 0..40)
                    .prop_map(|c| c.into_iter().collect::<String>()),
            ]
        ) {
            let mut out = Vec::new();
            crate::observe::access_log::escape(&mut out, &s);
            let want = serde_escaped(&s);
            prop_assert_eq!(String::from_utf8_lossy(&out), String::from_utf8_lossy(&want));
            let back: String = serde_json::from_slice(&out).expect("valid JSON");
            prop_assert_eq!(back, s);
        }
    }
}
