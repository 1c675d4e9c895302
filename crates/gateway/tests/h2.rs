//! HTTP/2 to clients in cleartext (h2c with prior knowledge), the HTTP/2 guards against
//! rapid-reset and CONTINUATION floods, an HTTP/2 preface on an HTTP/1-only listener, the
//! streams of one connection served side by side (bodies beyond the flow-control windows
//! included), and h2spec's conformance run against a TLS and an h2c listener.

mod common;

use bytes::Bytes;
use common::tls::TestCa;
use common::*;
use http::Request;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::{TokioExecutor, TokioIo};
use std::net::SocketAddr;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tollgate_gateway::SystemClock;

fn h2c_yaml(backend: SocketAddr, listener: &str) -> String {
    format!(
        "listeners:\n  - {{address: \"127.0.0.1:0\", h2c: true{listener}}}\nupstreams:\n  backend: {{targets: [\"{backend}\"]}}\nconsumers:\n  - {{name: alice, keys: [k-alice]}}\nroutes:\n  - {{name: open, path_prefix: /, upstream: backend}}\n  - {{name: keyed, path_prefix: /keyed, upstream: backend, auth: {{header: [x-api-key]}}, methods: [GET]}}\n"
    )
}

/// An HTTP/2 client connection (prior knowledge) to `addr`, driven in a task of its own.
async fn h2_client<B>(addr: SocketAddr) -> hyper::client::conn::http2::SendRequest<B>
where
    B: hyper::body::Body + Send + Unpin + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let io = TokioIo::new(TcpStream::connect(addr).await.expect("connect"));
    let (tx, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
        .await
        .expect("h2 handshake");
    tokio::spawn(conn);
    tx
}

async fn h2_get(addr: SocketAddr, path: &str, key: Option<&str>) -> (u16, String) {
    h2_get_at(addr, "api.test", path, key).await
}

/// A GET whose `:authority` is `authority`.
async fn h2_get_at(
    addr: SocketAddr,
    authority: &str,
    path: &str,
    key: Option<&str>,
) -> (u16, String) {
    let mut tx = h2_client(addr).await;
    let mut req = Request::builder().uri(format!("http://{authority}{path}"));
    if let Some(k) = key {
        req = req.header("x-api-key", k);
    }
    let resp = bounded(
        "h2c request",
        tx.send_request(req.body(Empty::<Bytes>::new()).expect("req")),
    )
    .await
    .expect("response");
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.expect("body").to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

#[tokio::test]
async fn h2c_serves_http2_and_http1_on_one_port_with_the_same_policies() {
    let (backend, _) = inspect_backend().await;
    let g = TestGateway::start(&h2c_yaml(backend, ""), SystemClock::new()).await;
    let (status, body) = h2_get(g.addr, "/x", None).await;
    assert_eq!(status, 200, "{body}");
    assert!(
        body.contains("host: api.test"),
        "the :authority reaches the backend as Host: {body}"
    );
    assert_eq!(h2_get(g.addr, "/keyed/x", None).await.0, 401);
    assert_eq!(h2_get(g.addr, "/keyed/x", Some("nope")).await.0, 401);
    let (status, body) = h2_get(g.addr, "/keyed/x", Some("k-alice")).await;
    assert_eq!(status, 200);
    assert!(body.contains("x-consumer: alice"), "{body}");
    assert!(!body.contains("k-alice"), "the key was forwarded: {body}");
    // HTTP/1.1 on the same listener.
    let a = TestClient::default().get(&g.url("/x")).await;
    assert_eq!(a.status, 200);
    // Whatever is not a broken preface is HTTP/1.1's, answered as without h2c: an empty
    // line before the request, a line ended by a bare LF, a version it does not serve.
    let r = raw(
        g.addr,
        b"\r\nGET /a HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(status_of(&r), 200, "{r}");
    let r = raw(
        g.addr,
        b"GET /a HTTP/1.1\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(status_of(&r), 200, "{r}");
    let r = raw(g.addr, b"GET /a HTTP/1.2\r\nHost: x\r\n\r\n").await;
    assert_eq!(status_of(&r), 400, "{r}");
    // A broken preface, or a line that is no HTTP/1 request line, gets no answer.
    for broken in [
        &b"PRI * HTTP/2.0\r\n\r\nXX\r\n\r\n"[..],
        b"GET / HTTP/2.0\r\n\r\n",
        b"INVALID CONNECTION PREFACE\r\n\r\n",
    ] {
        let r = raw(g.addr, broken).await;
        assert!(r.is_empty(), "{r}");
    }
}

#[tokio::test]
async fn the_gateways_own_answers_carry_the_date() {
    let (backend, _) = inspect_backend().await;
    let g = TestGateway::start(&h2c_yaml(backend, ""), SystemClock::new()).await;
    let mut tx = h2_client(g.addr).await;
    let req = Request::builder()
        .uri("http://api.test/keyed/x")
        .body(Empty::<Bytes>::new())
        .expect("req");
    let resp = bounded("h2c request", tx.send_request(req))
        .await
        .expect("response");
    assert_eq!(resp.status(), 401);
    let date = resp
        .headers()
        .get("date")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| httpdate::parse_http_date(v).ok())
        .expect("a Date in IMF-fixdate");
    let off = date
        .duration_since(std::time::SystemTime::now())
        .unwrap_or_else(|e| e.duration());
    assert!(off < std::time::Duration::from_secs(5), "{off:?}");
}

#[tokio::test]
async fn cookie_fields_reach_an_http1_backend_as_one_header() {
    let (backend, _) = inspect_backend().await;
    let g = TestGateway::start(&h2c_yaml(backend, ""), SystemClock::new()).await;
    let mut tx = h2_client(g.addr).await;
    // Browsers send each cookie as a field of its own over HTTP/2.
    let req = Request::builder()
        .uri("http://api.test/x")
        .header("cookie", "a=1")
        .header("cookie", "b=2")
        .body(Empty::<Bytes>::new())
        .expect("req");
    let resp = bounded("request", tx.send_request(req))
        .await
        .expect("response");
    assert_eq!(resp.status(), 200);
    let body = resp.into_body().collect().await.expect("body").to_bytes();
    let body = String::from_utf8_lossy(&body);
    assert!(body.contains("cookie: a=1; b=2"), "{body}");
    assert_eq!(body.matches("cookie:").count(), 1, "{body}");
}

#[tokio::test]
async fn an_authority_with_userinfo_is_refused_not_routed() {
    let (backend, _) = inspect_backend().await;
    let g = TestGateway::start(&h2c_yaml(backend, ""), SystemClock::new()).await;
    // `user@host` may not stand in `:authority` (RFC 9113 §8.3.1); routed by its full text
    // it would miss a route keyed to `host`, while a backend reads it as `host`.
    let (status, body) = h2_get_at(g.addr, "user@api.test", "/x", None).await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("invalid host in request target"), "{body}");
    assert_eq!(h2_get_at(g.addr, "API.test:80", "/x", None).await.0, 200);
}

#[tokio::test]
async fn an_http2_preface_on_an_http1_listener_gets_goaway_and_a_clean_close() {
    let backend = echo_backend().await;
    let g = TestGateway::start(
        &yaml(backend, "routes: [{path_prefix: /, upstream: backend}]\n"),
        SystemClock::new(),
    )
    .await;
    let mut s = TcpStream::connect(g.addr).await.expect("connect");
    let mut hello = PREFACE.to_vec();
    hello.extend(frame(0x4, 0, 0, &[]));
    s.write_all(&hello).await.expect("write");
    // The server's preface (an empty SETTINGS), then GOAWAY for no stream: HTTP/1.1 required.
    let mut answer = [0u8; 26];
    bounded("refusal", s.read_exact(&mut answer))
        .await
        .expect("read refusal");
    assert_eq!(answer[..9], frame(0x4, 0, 0, &[])[..]);
    assert_eq!(
        answer[9..],
        frame(0x7, 0, 0, &[0, 0, 0, 0, 0, 0, 0, 0xd])[..]
    );
    // What the client sends next is taken in, and its close is answered by a close, not a
    // reset.
    s.write_all(&frame(0x4, 0x1, 0, &[])).await.expect("write");
    s.shutdown().await.expect("shutdown");
    let mut rest = Vec::new();
    let n = bounded("close", s.read_to_end(&mut rest)).await;
    assert_eq!(n.expect("a clean end, not a reset"), 0, "{rest:?}");
    // HTTP/1.1 on the same listener is served as ever.
    let ok = raw(
        g.addr,
        b"GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");
}

/// One HTTP/2 frame.
fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// A header block of static-table entries only: GET, http, /, and `:authority: a`.
const GET_ROOT: &[u8] = &[0x82, 0x86, 0x84, 0x41, 0x01, b'a'];

/// The client preface and an empty SETTINGS: what every raw connection opens with.
fn preface() -> Vec<u8> {
    let mut out = PREFACE.to_vec();
    out.extend(frame(0x4, 0, 0, &[]));
    out
}

/// Reads frames until a GOAWAY arrives (returns its error code) or the connection ends.
async fn goaway(s: &mut TcpStream) -> Option<u32> {
    let (_, p) = frame_of(s, 0x7).await?;
    Some(u32::from_be_bytes(p.get(4..8)?.try_into().ok()?))
}

/// Reads frames until one of type `kind` arrives (returns its stream and payload) or the
/// connection ends.
async fn frame_of(s: &mut TcpStream, kind: u8) -> Option<(u32, Vec<u8>)> {
    let (_, id, payload) = frame_where(s, |k, _| k == kind).await?;
    Some((id, payload))
}

/// Reads frames until one whose type and stream satisfy `want` arrives (returns its type,
/// stream and payload) or the connection ends.
async fn frame_where(
    s: &mut (impl tokio::io::AsyncRead + Unpin),
    want: impl Fn(u8, u32) -> bool,
) -> Option<(u8, u32, Vec<u8>)> {
    let mut frames = Frames::default();
    loop {
        let (k, _, id, payload) = frames.next(s).await?;
        if want(k, id) {
            return Some((k, id, payload));
        }
    }
}

#[tokio::test]
async fn a_connection_without_streams_is_closed_after_the_header_timeout() {
    let backend = echo_backend().await;
    let g = TestGateway::start(
        &h2c_yaml(backend, ", header_timeout: 300ms"),
        SystemClock::new(),
    )
    .await;
    // Idle from the start, and idle once its one stream was answered: GOAWAY NO_ERROR,
    // then the close, without waiting on the client.
    for requests in [0u32, 1] {
        let mut s = TcpStream::connect(g.addr).await.expect("connect");
        let mut out = preface();
        for i in 0..requests {
            out.extend(frame(0x1, 0x5, 2 * i + 1, GET_ROOT));
        }
        s.write_all(&out).await.expect("write");
        let code = bounded("GOAWAY", goaway(&mut s)).await;
        assert_eq!(code, Some(0), "after {requests} streams");
        let mut rest = Vec::new();
        bounded("close", s.read_to_end(&mut rest))
            .await
            .expect("a clean close");
    }
    // A preface that stops halfway is closed without an answer.
    let mut s = TcpStream::connect(g.addr).await.expect("connect");
    s.write_all(&PREFACE[..10]).await.expect("write");
    let mut rest = Vec::new();
    let n = bounded("close", s.read_to_end(&mut rest))
        .await
        .expect("a clean close");
    assert_eq!(n, 0, "{rest:?}");
    // A connection that keeps asking is served past the timeout (three times it). A
    // timeout of its own, long beside any pause a busy machine puts between two requests.
    let g = TestGateway::start(
        &h2c_yaml(backend, ", header_timeout: 1s"),
        SystemClock::new(),
    )
    .await;
    let mut tx = h2_client(g.addr).await;
    let until = tokio::time::Instant::now() + std::time::Duration::from_secs(3);
    let mut served = 0;
    while tokio::time::Instant::now() < until {
        let req = Request::builder()
            .uri("http://a/x")
            .body(Empty::<Bytes>::new())
            .expect("req");
        let resp = bounded("request", tx.send_request(req))
            .await
            .expect("served on the same connection");
        assert_eq!(resp.status(), 200);
        served += 1;
    }
    assert!(served > 3, "{served}");
}

/// A GET on a gateway (`send_timeout: 300ms`) before a backend with an endless answer, by
/// a client that asks for a window of nothing (SETTINGS_INITIAL_WINDOW_SIZE 0: no DATA may
/// be sent on any stream until it gives some). The backend reports its connection's end.
async fn zero_window_get() -> (TestGateway, TcpStream, tokio::sync::mpsc::Receiver<()>) {
    let (backend, broke) = huge_answer_backend().await;
    let g = TestGateway::start(
        &h2c_yaml(backend, ", send_timeout: 300ms"),
        SystemClock::new(),
    )
    .await;
    let mut s = TcpStream::connect(g.addr).await.expect("connect");
    let mut out = PREFACE.to_vec();
    out.extend(frame(0x4, 0, 0, &[0, 0x4, 0, 0, 0, 0]));
    out.extend(frame(0x1, 0x5, 1, GET_ROOT));
    s.write_all(&out).await.expect("write");
    (g, s, broke)
}

/// The stream is reset with CANCEL, and the upstream connection that fed it let go.
async fn reset_and_let_go(
    s: &mut (impl tokio::io::AsyncRead + Unpin),
    broke: &mut tokio::sync::mpsc::Receiver<()>,
) {
    let (_, id, payload) = bounded("RST_STREAM", frame_where(s, |k, _| k == 0x3))
        .await
        .expect("the stream was reset");
    assert_eq!((id, payload), (1, 8u32.to_be_bytes().to_vec()), "CANCEL");
    bounded("the upstream connection closed", broke.recv())
        .await
        .expect("the backend saw its connection end");
}

#[tokio::test]
async fn a_stream_given_no_window_is_reset_after_send_timeout() {
    // The client goes on reading, so the connection's writes never wait.
    let (_g, mut s, mut broke) = zero_window_get().await;
    reset_and_let_go(&mut s, &mut broke).await;
}

#[tokio::test]
async fn a_stream_given_its_window_a_byte_at_a_time_is_reset_after_send_timeout() {
    let (_g, s, mut broke) = zero_window_get().await;
    let (mut r, mut w) = s.into_split();
    // One byte of window every 50 ms, for as long as the stream lives: 20 bytes a second
    // is no client reading, however often it speaks.
    let trickle = tokio::spawn(async move {
        let mut tick = tokio::time::interval(std::time::Duration::from_millis(50));
        for _ in 0..200 {
            tick.tick().await;
            if w.write_all(&frame(0x8, 0, 1, &1u32.to_be_bytes()))
                .await
                .is_err()
            {
                return;
            }
        }
    });
    reset_and_let_go(&mut r, &mut broke).await;
    trickle.abort();
}

#[tokio::test]
async fn a_client_with_a_small_window_that_gives_it_back_is_served_on() {
    let (backend, _broke) = huge_answer_backend().await;
    let g = TestGateway::start(&h2c_yaml(backend, ", send_timeout: 5s"), SystemClock::new()).await;
    let mut s = TcpStream::connect(g.addr).await.expect("connect");
    let mut out = PREFACE.to_vec();
    // SETTINGS_INITIAL_WINDOW_SIZE 4096: a small window (a quarter of the 16 KiB a
    // waiting stream must move), given back as each DATA frame is read.
    out.extend(frame(0x4, 0, 0, &[0, 0x4, 0, 0, 0x10, 0]));
    out.extend(frame(0x1, 0x5, 1, GET_ROOT));
    s.write_all(&out).await.expect("write");
    let mut frames = Frames::default();
    let mut read = 0usize;
    bounded("256 KiB read", async {
        while read < 256 * 1024 {
            let (k, _, id, payload) = frames.next(&mut s).await.expect("the connection ended");
            assert_ne!(k, 0x3, "the stream was reset after {read} bytes");
            if k == 0x0 && id == 1 && !payload.is_empty() {
                read += payload.len();
                let n = (payload.len() as u32).to_be_bytes();
                let mut f = frame(0x8, 0, 1, &n);
                f.extend(frame(0x8, 0, 0, &n));
                s.write_all(&f).await.expect("window");
            }
        }
    })
    .await;
}

#[tokio::test]
async fn rapid_reset_floods_get_goaway() {
    let (backend, hits) = inspect_backend().await;
    let g = TestGateway::start(
        &h2c_yaml(backend, ", http2: {max_pending_resets: 20}"),
        SystemClock::new(),
    )
    .await;
    let mut s = TcpStream::connect(g.addr).await.expect("connect");
    let mut out = preface();
    for i in 0..2_000u32 {
        let id = 2 * i + 1;
        out.extend(frame(0x1, 0x5, id, GET_ROOT)); // HEADERS, END_STREAM | END_HEADERS
        out.extend(frame(0x3, 0, id, &8u32.to_be_bytes())); // RST_STREAM CANCEL
    }
    // The server may close before reading it all.
    let _ = s.write_all(&out).await;
    let code = bounded("GOAWAY", goaway(&mut s)).await;
    assert_eq!(code, Some(0xb), "expected GOAWAY ENHANCE_YOUR_CALM");
    assert!(
        hits.load(std::sync::atomic::Ordering::Relaxed) < 2_000,
        "every reset stream reached the backend"
    );
}

#[tokio::test]
async fn continuation_floods_are_cut_off() {
    let backend = echo_backend().await;
    let g = TestGateway::start(
        &h2c_yaml(backend, ", max_header_bytes: 16KiB"),
        SystemClock::new(),
    )
    .await;
    let mut s = TcpStream::connect(g.addr).await.expect("connect");
    let mut out = preface();
    out.extend(frame(0x1, 0x1, 1, GET_ROOT)); // HEADERS without END_HEADERS
    s.write_all(&out).await.expect("write");
    // Literal header fields, never indexed: 16KiB of them a frame, 64MiB offered in all.
    let mut block = Vec::new();
    while block.len() < 16_000 {
        block.extend_from_slice(&[0x10, 0x03, b'x', b'-', b'a', 0x7f, 0x00]);
        block.extend(std::iter::repeat_n(b'v', 127));
    }
    let cont = frame(0x9, 0, 1, &block);
    let mut sent = 0usize;
    let cut = bounded("flood cut off", async {
        for _ in 0..4_000 {
            if s.write_all(&cont).await.is_err() {
                return true;
            }
            sent += cont.len();
        }
        false
    })
    .await;
    let code = if cut {
        None
    } else {
        bounded("GOAWAY", goaway(&mut s)).await
    };
    assert!(
        cut || code.is_some(),
        "64MiB of CONTINUATION frames were taken without a GOAWAY or close"
    );
    assert!(
        sent < 32 << 20,
        "the server read {sent} bytes of one header block"
    );
}

/// The h2spec binary: `$H2SPEC`, `~/go/bin/h2spec`, or on the PATH.
fn h2spec() -> std::path::PathBuf {
    if let Some(p) = std::env::var_os("H2SPEC") {
        return p.into();
    }
    let home = std::env::var_os("HOME")
        .map(std::path::PathBuf::from)
        .unwrap_or_default();
    let gobin = home.join("go/bin/h2spec");
    if gobin.exists() {
        return gobin;
    }
    "h2spec".into()
}

async fn run_h2spec(addr: SocketAddr, tls: bool) {
    let mut cmd = tokio::process::Command::new(h2spec());
    cmd.args([
        "-h",
        "127.0.0.1",
        "-p",
        &addr.port().to_string(),
        "-o",
        "5",
        "-j",
    ])
    .arg(std::env::temp_dir().join(format!("h2spec-{}-{tls}.xml", std::process::id())));
    if tls {
        cmd.args(["-t", "-k"]);
    }
    let out = tokio::time::timeout(std::time::Duration::from_secs(240), cmd.output())
        .await
        .expect("h2spec did not finish in 240s")
        .expect("h2spec could not run: scripts/test installs it (go install github.com/summerwind/h2spec/cmd/h2spec)");
    let text = String::from_utf8_lossy(&out.stdout);
    let summary = text
        .lines()
        .rev()
        .find(|l| l.contains("tests,"))
        .unwrap_or("");
    assert!(
        out.status.success() && summary.contains(" 0 failed"),
        "h2spec (tls={tls}) failed: {summary}\n{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2spec_passes_on_tls_and_h2c_listeners() {
    let backend = echo_backend().await;
    let g = TestGateway::start(&h2c_yaml(backend, ""), SystemClock::new()).await;
    run_h2spec(g.addr, false).await;

    let dir = tempdir("h2spec-tls");
    let ca = TestCa::new(&dir, "ca");
    let leaf = ca.server("api", &["127.0.0.1", "localhost"]);
    let tls = format!(
        "listeners:\n  - address: \"127.0.0.1:0\"\n    tls: {{certificates: [{{cert: \"{}\", key: \"{}\"}}]}}\nupstreams:\n  backend: {{targets: [\"{backend}\"]}}\nroutes:\n  - {{path_prefix: /, upstream: backend}}\n",
        leaf.cert.display(),
        leaf.key.display()
    );
    let g = TestGateway::start(&tls, SystemClock::new()).await;
    run_h2spec(g.addr, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2spec_passes_where_the_gateway_answers_before_the_body_ends() {
    // Every request h2spec sends gets the gateway's own 401 at once, most before their
    // body's frames arrive: those are checked all the same while the client's side is
    // open.
    let backend = echo_backend().await;
    let keyed = "listeners:\n  - {address: \"127.0.0.1:0\", h2c: true}\nupstreams:\n  backend: {targets: [\"BACKEND\"]}\nconsumers:\n  - {name: alice, keys: [k-alice]}\nroutes:\n  - {name: keyed, path_prefix: /, upstream: backend, auth: {header: [x-api-key]}}\n"
        .replace("BACKEND", &backend.to_string());
    let g = TestGateway::start(&keyed, SystemClock::new()).await;
    run_h2spec(g.addr, false).await;
}

#[tokio::test]
async fn the_streams_of_one_connection_do_not_wait_for_each_other() {
    // The streams of a connection run in the connection's task: one waiting on its
    // upstream must not hold up another, nor its answer the connection's other traffic.
    let (backend, mut arrived, release) = gated_backend_with(|req, _| {
        let gated = req.uri().path() == "/slow";
        (hyper::Response::new(req.uri().path().to_string()), gated)
    })
    .await;
    let mut g = TestGateway::start(&h2c_yaml(backend, ""), SystemClock::new()).await;
    let tx = h2_client(g.addr).await;
    let get = |path: &str| {
        let mut tx = tx.clone();
        let req = Request::builder()
            .uri(format!("http://api.test{path}"))
            .body(Empty::<Bytes>::new())
            .expect("req");
        async move {
            let resp = tx.send_request(req).await.expect("response");
            let status = resp.status().as_u16();
            let body = resp.into_body().collect().await.expect("body").to_bytes();
            (status, String::from_utf8_lossy(&body).into_owned())
        }
    };
    let slow = tokio::spawn(get("/slow"));
    bounded("the slow stream reaches the backend", arrived.recv()).await;
    for _ in 0..3 {
        assert_eq!(
            bounded("a stream beside a waiting one", get("/fast")).await,
            (200, "/fast".to_string())
        );
        assert_eq!(
            bounded("a refusal beside a waiting one", get("/keyed/x"))
                .await
                .0,
            401
        );
    }
    assert!(
        !slow.is_finished(),
        "the slow stream was answered before its release"
    );
    // A server that stops still answers the stream in flight, then reports itself drained.
    let server = g.server.take().expect("server");
    let shutdown = tokio::spawn(server.shutdown(std::time::Duration::from_secs(10)));
    release.notify_one();
    let (status, body) = bounded("the slow stream once released", slow)
        .await
        .expect("task");
    assert_eq!((status, body.as_str()), (200, "/slow"));
    assert!(
        bounded("drained", shutdown).await.expect("join"),
        "the connection closed once its last stream was answered"
    );
}

#[tokio::test]
async fn request_bodies_larger_than_the_flow_control_windows_pass_both_ways() {
    // Two uploads at once on one connection, each larger than the stream window (256 KiB)
    // and together larger than the connection window (1 MiB): they pass only if the
    // connection's task sends window updates as the streams in it read their bodies.
    let (backend, _) = inspect_backend().await;
    let g = TestGateway::start(&h2c_yaml(backend, ""), SystemClock::new()).await;
    let tx = h2_client(g.addr).await;
    let upload = |n: u8| {
        let mut tx = tx.clone();
        let body: Vec<u8> = (0..1_500_000u32)
            .map(|i| b'a' + ((i % 26) as u8 + n) % 26)
            .collect();
        let req = Request::builder()
            .method("POST")
            .uri("http://api.test/upload")
            .body(http_body_util::Full::new(Bytes::from(body.clone())))
            .expect("req");
        async move {
            let resp = tx.send_request(req).await.expect("response");
            let status = resp.status().as_u16();
            let got = resp.into_body().collect().await.expect("body").to_bytes();
            (status, got.ends_with(&body), got.len() - body.len())
        }
    };
    let (a, b) = bounded("two large uploads", async {
        tokio::join!(tokio::spawn(upload(0)), tokio::spawn(upload(7)))
    })
    .await;
    for (status, echoed, head) in [a.expect("task"), b.expect("task")] {
        assert_eq!(status, 200);
        assert!(
            echoed,
            "the backend got the body whole and it came back whole"
        );
        assert!(
            head > 0 && head < 2_000,
            "head of {head} bytes before the body"
        );
    }
}

#[tokio::test]
async fn a_client_expecting_100_continue_is_told_when_its_body_is_wanted() {
    let backend = echo_backend().await;
    let g = TestGateway::start(&h2c_yaml(backend, ""), SystemClock::new()).await;
    let mut s = TcpStream::connect(g.addr).await.expect("connect");
    // POST, http, :path /upload, :authority a, expect: 100-continue, content-length: 5.
    let mut block = vec![0x83, 0x86, 0x04, 0x07];
    block.extend_from_slice(b"/upload");
    block.extend_from_slice(&[0x41, 0x01, b'a', 0x0f, 0x14, 0x0c]);
    block.extend_from_slice(b"100-continue");
    block.extend_from_slice(&[0x0f, 0x0d, 0x01, b'5']);
    let mut out = preface();
    out.extend(frame(0x1, 0x4, 1, &block)); // HEADERS, END_HEADERS: a body follows
    s.write_all(&out).await.expect("write");
    let (id, head) = bounded("100 Continue", frame_of(&mut s, 0x1))
        .await
        .expect("an interim answer before the body");
    assert_eq!(id, 1);
    assert!(
        head.windows(3).any(|w| w == b"100"),
        "not a 100 Continue: {head:?}"
    );
    s.write_all(&frame(0x0, 0x1, 1, b"hello"))
        .await
        .expect("write body");
    let (id, head) = bounded("the final answer", frame_of(&mut s, 0x1))
        .await
        .expect("the answer");
    assert_eq!((id, head.first()), (1, Some(&0x88)), ":status 200");
}

/// A header block: GET `/keyed/x` (the keyed route), http, `:authority: a`.
fn keyed_get() -> Vec<u8> {
    let mut block = vec![0x82, 0x86, 0x04, 0x08];
    block.extend_from_slice(b"/keyed/x");
    block.extend_from_slice(&[0x41, 0x01, b'a']);
    block
}

/// The preface, then SETTINGS and WINDOW_UPDATE giving the server all the window it may
/// want: the client's reading never holds an answer back.
fn preface_granting_all() -> Vec<u8> {
    let mut out = PREFACE.to_vec();
    out.extend(frame(0x4, 0, 0, &[0, 0x4, 0x7f, 0xff, 0xff, 0xff]));
    out.extend(frame(0x8, 0, 0, &0x7fff_0000u32.to_be_bytes()));
    out
}

/// Writes `out` while reading, until the answer's HEADERS on stream `last` or a GOAWAY
/// arrives (its type, stream and payload).
async fn send_for_answer(s: &mut TcpStream, out: &[u8], last: u32) -> (u8, u32, Vec<u8>) {
    let (mut r, mut w) = s.split();
    let (_, answer) = bounded("an answer or GOAWAY", async {
        tokio::join!(
            async { w.write_all(out).await.expect("write") },
            frame_where(&mut r, |k, id| k == 0x7 || (k == 0x1 && id == last))
        )
    })
    .await;
    answer.expect("an answer, not the connection's end")
}

#[tokio::test]
async fn refused_uploads_give_their_window_back() {
    // 1,100 streams, each a GET with 1,000 bytes of body that the keyed route refuses
    // (401) without reading it: 1.1 MB in all, past the connection's 1 MiB window, sent
    // without waiting for window updates. Only if the server credits what it dropped
    // unread is that within the window; otherwise it is a FLOW_CONTROL_ERROR.
    let backend = echo_backend().await;
    let g = TestGateway::start(&h2c_yaml(backend, ""), SystemClock::new()).await;
    let mut s = TcpStream::connect(g.addr).await.expect("connect");
    let block = keyed_get();
    let body = vec![b'x'; 1_000];
    // The client grants all the window its answers need (401s have a body).
    let mut out = preface_granting_all();
    for i in 0..1_100u32 {
        out.extend(frame(0x1, 0x4, 2 * i + 1, &block)); // HEADERS, END_HEADERS
        out.extend(frame(0x0, 0, 2 * i + 1, &body)); // DATA, the stream still open
    }
    out.extend(frame(0x1, 0x5, 2_201, GET_ROOT)); // and a last GET
    let (kind, id, payload) = send_for_answer(&mut s, &out, 2_201).await;
    assert_eq!(
        (kind, id),
        (0x1, 2_201),
        "GOAWAY instead of the last answer: {payload:?}"
    );
}

#[tokio::test]
async fn data_on_a_stream_already_answered_is_credited_too() {
    // A stream refused (401) while its client still sends: the DATA in flight after the
    // answer, 1.1 MB of it here, is ignored but still counts against the connection's
    // 1 MiB window, so it must be given back as well, or the next stream stalls.
    let backend = echo_backend().await;
    let g = TestGateway::start(&h2c_yaml(backend, ""), SystemClock::new()).await;
    let mut s = TcpStream::connect(g.addr).await.expect("connect");
    let block = keyed_get();
    let mut out = preface_granting_all();
    out.extend(frame(0x1, 0x4, 1, &block)); // HEADERS, END_HEADERS: a body follows
    s.write_all(&out).await.expect("write");
    let (id, _) = bounded("the refusal", frame_of(&mut s, 0x3))
        .await
        .expect("RST_STREAM after the answer");
    assert_eq!(id, 1);
    let data = frame(0x0, 0, 1, &[b'x'; 16_000]);
    let mut out = Vec::new();
    for _ in 0..70 {
        out.extend_from_slice(&data);
    }
    out.extend(frame(0x1, 0x5, 3, GET_ROOT));
    let (kind, id, payload) = send_for_answer(&mut s, &out, 3).await;
    assert_eq!((kind, id), (0x1, 3), "GOAWAY instead: {payload:?}");
}

#[tokio::test]
async fn a_client_that_does_not_read_its_replies_is_not_read_either() {
    // PINGs are answered; a client that sends them without reading the answers would
    // grow the server's queue of replies without bound. The server stops reading once
    // 64 KiB of replies wait, so the client's writes stall long before 64 MiB.
    let backend = echo_backend().await;
    let g = TestGateway::start(&h2c_yaml(backend, ""), SystemClock::new()).await;
    let mut s = TcpStream::connect(g.addr).await.expect("connect");
    let out = preface();
    s.write_all(&out).await.expect("write");
    let pings: Vec<u8> = (0..60_000u32)
        .flat_map(|_| frame(0x6, 0, 0, &[1, 2, 3, 4, 5, 6, 7, 8]))
        .collect();
    let mut sent = 0usize;
    let mut stalled = false;
    while sent < 64 << 20 {
        match tokio::time::timeout(std::time::Duration::from_secs(2), s.write_all(&pings)).await {
            Ok(Ok(())) => sent += pings.len(),
            Ok(Err(_)) => break,
            Err(_) => {
                stalled = true;
                break;
            }
        }
    }
    assert!(
        stalled,
        "the server took {sent} bytes of PINGs whose answers were not read"
    );
}

/// A header block of `n` regular fields after GET `/`: `x-f0: v` … (literals, not indexed).
fn get_with_fields(n: usize) -> Vec<u8> {
    let mut block = GET_ROOT.to_vec();
    for i in 0..n {
        let name = format!("x-f{i}");
        block.extend_from_slice(&[0x00, name.len() as u8]);
        block.extend_from_slice(name.as_bytes());
        block.extend_from_slice(&[0x01, b'v']);
    }
    block
}

#[tokio::test]
async fn resets_the_server_is_made_to_send_spend_the_reset_budget() {
    // MadeYouReset (CVE-2025-8671): WINDOW_UPDATE 0, or a PRIORITY that depends on its own
    // stream, makes the server reset a stream it has already taken.
    for (name, provoke) in [
        (
            "WINDOW_UPDATE 0",
            (|id: u32| frame(0x8, 0, id, &0u32.to_be_bytes())) as fn(u32) -> Vec<u8>,
        ),
        ("self-dependent PRIORITY", |id: u32| {
            let mut p = id.to_be_bytes().to_vec();
            p.push(16);
            frame(0x2, 0, id, &p)
        }),
    ] {
        let (backend, _) = inspect_backend().await;
        let g = TestGateway::start(
            &h2c_yaml(backend, ", http2: {max_pending_resets: 20}"),
            SystemClock::new(),
        )
        .await;
        let mut s = TcpStream::connect(g.addr).await.expect("connect");
        let mut out = preface();
        // Far fewer than the cap on malformed streams, far more than the reset budget.
        for i in 0..200u32 {
            let id = 2 * i + 1;
            out.extend(frame(0x1, 0x5, id, GET_ROOT));
            out.extend(provoke(id));
        }
        let _ = s.write_all(&out).await;
        let code = bounded(name, goaway(&mut s)).await;
        assert_eq!(code, Some(0xb), "{name}: expected GOAWAY ENHANCE_YOUR_CALM");
    }
}

#[tokio::test]
async fn frames_that_carry_nothing_are_counted() {
    let backend = echo_backend().await;
    let g = TestGateway::start(&h2c_yaml(backend, ""), SystemClock::new()).await;
    // Empty CONTINUATION frames that never end their block.
    let mut s = TcpStream::connect(g.addr).await.expect("connect");
    let mut out = preface();
    out.extend(frame(0x1, 0x1, 1, GET_ROOT));
    for _ in 0..5_000 {
        out.extend(frame(0x9, 0, 1, &[]));
    }
    let _ = s.write_all(&out).await;
    assert_eq!(
        bounded("GOAWAY", goaway(&mut s)).await,
        Some(0xb),
        "empty CONTINUATION"
    );
    // Frames of an unknown type while a stream is open, and empty DATA.
    // PRIORITY between them does not start the count again, and padding is no data.
    let mut unknown_and_priority = frame(0x20, 0, 0, &[]);
    unknown_and_priority.extend(frame(0x2, 0, 3, &[0, 0, 0, 0, 16]));
    for (name, useless) in [
        ("unknown type", frame(0x20, 0, 0, &[])),
        ("empty DATA", frame(0x0, 0, 1, &[])),
        ("padding-only DATA", frame(0x0, 0x8, 1, &[4, 0, 0, 0, 0])),
        ("unknown type and PRIORITY", unknown_and_priority),
    ] {
        let mut s = TcpStream::connect(g.addr).await.expect("connect");
        let mut out = preface();
        out.extend(frame(0x1, 0x4, 1, GET_ROOT)); // END_HEADERS, body to come
        for _ in 0..5_000 {
            out.extend(useless.clone());
        }
        let _ = s.write_all(&out).await;
        assert_eq!(bounded(name, goaway(&mut s)).await, Some(0xb), "{name}");
    }
}

#[tokio::test]
async fn a_header_block_must_end_within_the_header_timeout() {
    let backend = echo_backend().await;
    let g = TestGateway::start(
        &h2c_yaml(backend, ", header_timeout: 300ms"),
        SystemClock::new(),
    )
    .await;
    let mut s = TcpStream::connect(g.addr).await.expect("connect");
    let mut out = preface();
    out.extend(frame(0x1, 0x1, 1, GET_ROOT)); // no END_HEADERS, and nothing after
    s.write_all(&out).await.expect("write");
    let code = bounded("GOAWAY", goaway(&mut s)).await;
    assert_eq!(code, Some(0x1), "GOAWAY PROTOCOL_ERROR, not an idle close");
}

#[tokio::test]
async fn max_headers_holds_on_http2_and_a_short_goaway_is_a_frame_size_error() {
    let backend = echo_backend().await;
    let g = TestGateway::start(&h2c_yaml(backend, ", max_headers: 5"), SystemClock::new()).await;
    let mut s = TcpStream::connect(g.addr).await.expect("connect");
    let mut out = preface_granting_all();
    out.extend(frame(0x1, 0x5, 1, &get_with_fields(5)));
    let (_, _, first) = send_for_answer(&mut s, &out, 1).await;
    assert_eq!(first.first(), Some(&0x88), "5 fields: 200");
    // Cookies a browser sends one field each count as the one header they join into.
    let mut cookies = get_with_fields(4);
    for c in ["a=1", "b=2", "c=3"] {
        cookies.extend_from_slice(&[0x00, 0x06]);
        cookies.extend_from_slice(b"cookie");
        cookies.push(c.len() as u8);
        cookies.extend_from_slice(c.as_bytes());
    }
    let (_, _, cookied) = send_for_answer(&mut s, &frame(0x1, 0x5, 5, &cookies), 5).await;
    assert_eq!(cookied.first(), Some(&0x88), "4 fields and 3 cookies: 200");
    let more = frame(0x1, 0x5, 7, &get_with_fields(6));
    let (_, _, second) = send_for_answer(&mut s, &more, 7).await;
    assert!(
        second.windows(3).any(|w| w == b"431"),
        "6 fields: 431, got {second:?}"
    );
    // A GOAWAY without its 8 bytes of last-stream-id and code.
    s.write_all(&frame(0x7, 0, 0, &[0, 0, 0, 0]))
        .await
        .expect("write");
    assert_eq!(bounded("GOAWAY", goaway(&mut s)).await, Some(0x6));
}

/// A HEADERS frame opening stream `id` with a POST to `path`, `content-length: 1000000`.
fn post_head(id: u32, path: &str) -> Vec<u8> {
    let mut block = vec![0x83, 0x86, 0x04, path.len() as u8];
    block.extend_from_slice(path.as_bytes());
    block.extend_from_slice(&[0x41, 0x01, b'a', 0x5c, 0x07]);
    block.extend_from_slice(b"1000000");
    frame(0x1, 0x4, id, &block)
}

/// DATA frames on stream `id` carrying `n` bytes in all, none ending the stream.
fn data_of(id: u32, n: usize) -> Vec<u8> {
    let mut out = Vec::new();
    let mut left = n;
    while left > 0 {
        let k = left.min(16_384);
        out.extend(frame(0x0, 0, id, &vec![b'd'; k]));
        left -= k;
    }
    out
}

#[tokio::test]
async fn request_bodies_held_ahead_have_a_budget_per_connection() {
    // A backend that tells each request head as it arrives, body or not, held open
    // unanswered while the body trickles.
    let (backend, mut heads) = holding_backend().await;
    let g = TestGateway::start(
        &h2c_yaml(
            backend,
            ", http2: {stream_window: 65535, max_request_buffer: 64KiB}",
        ),
        SystemClock::new(),
    )
    .await;
    let mut s = TcpStream::connect(g.addr).await.expect("connect");
    let mut out = preface();
    out.extend(post_head(1, "/one"));
    // Its whole window: one byte under both 64 KiB and the budget.
    out.extend(data_of(1, 65_535));
    // A PING after it: its ACK is written once every frame before it was handled and the
    // stream's reader has taken what they brought.
    out.extend(frame(0x6, 0, 0, &[0; 8]));
    s.write_all(&out).await.expect("write");
    // Stream 1's body is read ahead, as a body under 64 KiB is: all of it is held.
    let (_, _, ack) = bounded(
        "the PING's ACK",
        frame_where(&mut s, |k, id| k == 0x6 && id == 0),
    )
    .await
    .expect("an ACK");
    assert_eq!(ack, [0; 8]);
    // Past the budget, stream 2's body is not held: it streams upstream as it comes.
    let mut more = post_head(3, "/two");
    more.extend(data_of(3, 10_000));
    s.write_all(&more).await.expect("write");
    let head = bounded("stream 2 upstream", heads.recv())
        .await
        .expect("a request head");
    assert!(
        head.starts_with("POST /two "),
        "stream 1 is still held: {head}"
    );
}

/// A backend that tells each request head as it arrives and never answers.
async fn holding_backend() -> (SocketAddr, tokio::sync::mpsc::UnboundedReceiver<String>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let backend = l.local_addr().expect("addr");
    let (tx, heads) = tokio::sync::mpsc::unbounded_channel::<String>();
    tokio::spawn(async move {
        while let Ok((mut c, _)) = l.accept().await {
            let tx = tx.clone();
            tokio::spawn(async move {
                if let Some(h) = read_head(&mut c).await {
                    let _ = tx.send(h);
                }
                let mut sink = [0u8; 4096];
                while matches!(c.read(&mut sink).await, Ok(n) if n > 0) {}
            });
        }
    });
    (backend, heads)
}

/// An HPACK integer with an `n`-bit prefix, the prefix's other bits `high`.
fn hpack_int(out: &mut Vec<u8>, high: u8, n: u32, v: usize) {
    let max = (1usize << n) - 1;
    if v < max {
        out.push(high | v as u8);
        return;
    }
    out.push(high | max as u8);
    let mut rest = v - max;
    while rest >= 128 {
        out.push((rest % 128) as u8 | 0x80);
        rest /= 128;
    }
    out.push(rest as u8);
}

#[tokio::test]
async fn streams_of_large_literal_headers_have_a_budget_per_connection() {
    let (backend, _heads) = holding_backend().await;
    // Four lists of 8 KiB: 32 KiB of literal header bytes for the running streams.
    let g = TestGateway::start(
        &h2c_yaml(backend, ", http2: {max_header_list_size: 8KiB}"),
        SystemClock::new(),
    )
    .await;
    // 6,000 bytes of a header sent as a literal not to be indexed: each stream costs the
    // gateway its own copy while it runs.
    let pad = |block: &mut Vec<u8>| {
        block.extend_from_slice(&[0x00, 0x05]);
        block.extend_from_slice(b"x-pad");
        hpack_int(block, 0, 7, 6_000);
        block.extend(std::iter::repeat_n(b'p', 6_000));
    };
    // A POST whose body has not come: it runs, waiting for it.
    let post = |id: u32| {
        let mut block = vec![
            0x83, 0x86, 0x04, 0x02, b'/', b'p', 0x41, 0x01, b'a', 0x5c, 0x07,
        ];
        block.extend_from_slice(b"1000000");
        pad(&mut block);
        frame(0x1, 0x4, id, &block)
    };
    // A GET without its key (401 at once), or a POST declaring more body than the
    // listener takes (413 at once).
    let ask = |id: u32, post: bool| {
        let mut block = vec![if post { 0x83 } else { 0x82 }, 0x86, 0x04, 0x08];
        block.extend_from_slice(b"/keyed/x");
        block.extend_from_slice(&[0x41, 0x01, b'a']);
        if post {
            block.extend_from_slice(&[0x5c, 0x0b]);
            block.extend_from_slice(b"99999999999");
        }
        pad(&mut block);
        // A GET ends with its headers; a POST's body is still to come.
        frame(0x1, if post { 0x4 } else { 0x5 }, id, &block)
    };
    let mut s = TcpStream::connect(g.addr).await.expect("connect");
    let mut out = preface();
    for id in [1, 3, 5, 7, 9] {
        out.extend(post(id));
    }
    // The budget is full. A stream that ends with its headers is not held by its client:
    // taken. One whose body is still to come is refused as unprocessed (the client may
    // send it again), however many times: the connection is kept.
    out.extend(ask(11, false));
    let refused: Vec<u32> = (0..70).map(|i| 13 + 2 * i).collect();
    for id in &refused {
        out.extend(ask(*id, true));
    }
    s.write_all(&out).await.expect("write");
    let mut frames = Frames::default();
    let mut seen = Vec::new();
    while seen.len() < 1 + refused.len() {
        let (k, _, id, p) = bounded("a frame", frames.next(&mut s))
            .await
            .expect("the connection stays");
        match k {
            0x1 => seen.push((id, "answered")),
            0x3 if p == 7u32.to_be_bytes() => seen.push((id, "refused")),
            0x3 | 0x7 => panic!("type {k} on {id}: {p:?}"),
            _ => {}
        }
    }
    assert_eq!(seen[0], (11, "answered"));
    assert!(
        seen[1..].iter().all(|(_, what)| *what == "refused"),
        "{seen:?}"
    );
    // One of the held streams ends (the client cancels it): the same request is taken now.
    let last = 13 + 2 * refused.len() as u32;
    let mut more = frame(0x3, 0, 1, &8u32.to_be_bytes());
    more.extend(ask(last, true));
    s.write_all(&more).await.expect("write");
    let (k, id, _) = bounded(
        "an answer",
        frame_where(&mut s, |k, _| matches!(k, 0x1 | 0x3 | 0x7)),
    )
    .await
    .expect("a frame");
    assert_eq!((k, id), (0x1, last), "the last stream answered");
}

#[tokio::test]
async fn one_connection_takes_a_bounded_share_of_an_upstream() {
    let (backend, _) = huge_answer_backend().await;
    let cfg = format!(
        "listeners:\n  - {{address: \"127.0.0.1:0\", h2c: true, http2: {{max_upstream_streams: 2}}}}\nupstreams:\n  backend: {{targets: [\"{backend}\"], max_connections: 6, connect_timeout: 1s}}\nroutes:\n  - {{name: open, path_prefix: /, upstream: backend}}\n"
    );
    let g = TestGateway::start(&cfg, SystemClock::new()).await;
    // Two clients that never grant a byte of window, five large answers each.
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut s = TcpStream::connect(g.addr).await.expect("connect");
        let mut out = PREFACE.to_vec();
        out.extend(frame(0x4, 0, 0, &[0, 0x4, 0, 0, 0, 0])); // INITIAL_WINDOW_SIZE 0
        for i in 0..5u32 {
            out.extend(frame(0x1, 0x5, 2 * i + 1, GET_ROOT));
        }
        s.write_all(&out).await.expect("write");
        for _ in 0..2 {
            bounded("an answer's head", frame_of(&mut s, 0x1))
                .await
                .expect("HEADERS");
        }
        held.push(s);
    }
    // A request from anyone else still gets an upstream connection.
    let mut c = TcpStream::connect(g.addr).await.expect("connect");
    c.write_all(b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n")
        .await
        .expect("write");
    let mut line = Vec::new();
    bounded("the status line", async {
        let mut b = [0u8; 1];
        while !line.ends_with(b"\r\n") {
            let n = c.read(&mut b).await.expect("read");
            assert!(n > 0, "closed");
            line.push(b[0]);
        }
    })
    .await;
    let line = String::from_utf8_lossy(&line).into_owned();
    assert!(line.starts_with("HTTP/1.1 200"), "{line}");
    // Each client's three other streams found no place within connect_timeout: 503, counted
    // with the upstream's busy answers.
    let busy = "tollgate_upstream_failures_total{upstream=\"backend\",kind=\"busy\"} 6";
    let m = metrics_with(&g.gw, busy).await;
    assert!(m.lines().any(|l| l == busy), "{m}");
}

#[tokio::test]
async fn a_goaway_never_names_a_later_stream_than_one_before_it() {
    let (backend, mut arrived, release) = gated_backend_with(|req, _| {
        let gated = req.uri().path() == "/slow";
        (hyper::Response::new(req.uri().path().to_string()), gated)
    })
    .await;
    let mut g = TestGateway::start(&h2c_yaml(backend, ""), SystemClock::new()).await;
    let mut s = TcpStream::connect(g.addr).await.expect("connect");
    let mut out = preface_granting_all();
    let mut slow = vec![0x82, 0x86, 0x04, 0x05];
    slow.extend_from_slice(b"/slow");
    slow.extend_from_slice(&[0x41, 0x01, b'a']);
    out.extend(frame(0x1, 0x5, 1, &slow));
    s.write_all(&out).await.expect("write");
    bounded("stream 1 reaches the backend", arrived.recv()).await;
    // The server stops: GOAWAY naming stream 1, the last it took.
    let server = g.server.take().expect("server");
    let shutdown = tokio::spawn(server.shutdown(std::time::Duration::from_secs(10)));
    let (_, first) = bounded("the first GOAWAY", frame_of(&mut s, 0x7))
        .await
        .expect("GOAWAY");
    assert_eq!(first[..4], 1u32.to_be_bytes());
    // A stream opened after it is not taken, and a connection error that follows names
    // no later stream than the first GOAWAY did.
    let mut more = frame(0x1, 0x5, 3, GET_ROOT);
    more.extend(frame(0x6, 0, 1, &[0; 8])); // PING on a stream: PROTOCOL_ERROR
    s.write_all(&more).await.expect("write");
    let (_, second) = bounded("the second GOAWAY", frame_of(&mut s, 0x7))
        .await
        .expect("GOAWAY");
    assert_eq!(second[..4], 1u32.to_be_bytes(), "{second:?}");
    assert_eq!(second[4..8], 1u32.to_be_bytes(), "PROTOCOL_ERROR");
    release.notify_one();
    let _ = bounded("drained", shutdown).await;
}
