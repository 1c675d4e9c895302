//! No endless waits and no unbounded use: body, read and response timeouts; connection
//! caps on listeners and upstream targets; the admin listener's own limits.

mod common;

use common::*;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tollgate_gateway::SystemClock;

const OPEN: &str = "routes:\n  - {path_prefix: /, upstream: backend}\n";

fn with_listener(cfg: String, extra: &str) -> String {
    cfg.replace(
        "{address: \"127.0.0.1:0\"}",
        &format!("{{address: \"127.0.0.1:0\", {extra}}}"),
    )
}

#[tokio::test]
async fn a_body_that_stops_coming_gets_408_and_takes_no_upstream_connection() {
    let (backend, conns) =
        raw_backend(|_| Some(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n".to_vec())).await;
    let cfg = with_listener(yaml(backend, OPEN), "body_timeout: 300ms");
    let gw = TestGateway::start(&cfg, SystemClock::new()).await;
    // Fifty slow POSTs: a head, a few bytes of a 4 KiB body, then nothing.
    let mut clients = Vec::new();
    for _ in 0..50 {
        let mut s = TcpStream::connect(gw.addr).await.expect("connect");
        s.write_all(b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 4096\r\n\r\nabc")
            .await
            .expect("write");
        clients.push(s);
    }
    for mut s in clients {
        let mut out = String::new();
        bounded("408", s.read_to_string(&mut out)).await.ok();
        assert_eq!(status_of(&out), 408, "{out}");
    }
    assert_eq!(
        conns.load(Ordering::SeqCst),
        0,
        "no upstream connection was pinned"
    );
}

#[tokio::test]
async fn a_client_that_stops_reading_is_closed_after_send_timeout() {
    let (backend, mut broke) = huge_answer_backend().await;
    let cfg = with_listener(yaml(backend, OPEN), "send_timeout: 300ms");
    let gw = TestGateway::start(&cfg, SystemClock::new()).await;
    let mut s = TcpStream::connect(gw.addr).await.expect("connect");
    s.write_all(b"GET /big HTTP/1.1\r\nHost: a\r\n\r\n")
        .await
        .expect("write");
    // The client reads nothing: the gateway gives up on it and on the upstream connection
    // feeding it, whose writes then fail.
    bounded("the upstream connection closed", broke.recv())
        .await
        .expect("the backend saw its connection end");
    // The client's connection ends too, short of the whole answer.
    let mut got = Vec::new();
    let _ = bounded("client connection ends", s.read_to_end(&mut got)).await;
    assert!(got.len() < 64 << 20, "{} bytes", got.len());
}

#[tokio::test]
async fn a_streamed_body_that_stops_coming_gets_408() {
    let (backend, _) = inspect_backend().await;
    let cfg = with_listener(
        yaml(backend, OPEN).replace(
            "upstream: backend}",
            "upstream: backend, request_buffering: false}",
        ),
        "body_timeout: 300ms",
    );
    let gw = TestGateway::start(&cfg, SystemClock::new()).await;
    let mut s = TcpStream::connect(gw.addr).await.expect("connect");
    s.write_all(b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 100\r\n\r\nabc")
        .await
        .expect("write");
    let mut out = String::new();
    bounded("408", s.read_to_string(&mut out)).await.ok();
    assert_eq!(status_of(&out), 408, "{out}");
}

#[tokio::test]
async fn a_body_streaming_upstream_must_bring_16_kib_per_body_timeout() {
    let (backend, _) = inspect_backend().await;
    let cfg = with_listener(yaml(backend, OPEN), "body_timeout: 500ms");
    let gw = TestGateway::start(&cfg, SystemClock::new()).await;
    let s = TcpStream::connect(gw.addr).await.expect("connect");
    let (mut rd, mut wr) = s.into_split();
    // Past the 64 KiB read ahead, so it streams; then a byte every 100 ms, each well
    // within `body_timeout`: a trickle, not progress.
    let mut first = b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 1000000\r\n\r\n".to_vec();
    first.extend(std::iter::repeat_n(b'a', 70 * 1024));
    wr.write_all(&first).await.expect("write");
    let trickle = tokio::spawn(async move {
        for _ in 0..100 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            if wr.write_all(b"a").await.is_err() {
                return true;
            }
        }
        false
    });
    let mut out = String::new();
    bounded("408", rd.read_to_string(&mut out)).await.ok();
    assert_eq!(status_of(&out), 408, "{out}");
    assert!(!trickle.is_finished(), "answered while the trickle went on");
    trickle.abort();
}

#[tokio::test]
async fn an_upstream_that_stops_sending_its_body_is_cut_off_after_read_timeout() {
    // A head and half the body, then silence with the connection open.
    let (backend, _, _) = scripted_backend(|_, _| {
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhello".to_vec(),
            false,
        )
    })
    .await;
    let cfg = yaml(backend, OPEN).replace(
        "response_timeout: 2s",
        "response_timeout: 2s\n    read_timeout: 300ms",
    );
    let gw = TestGateway::start(&cfg, SystemClock::new()).await;
    let a = raw(gw.addr, b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n").await;
    let body = a.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    assert!(body.len() < 10, "never complete: {a:?}");
}

#[tokio::test]
async fn response_timeout_counts_from_the_end_of_the_request_body() {
    let (backend, _) = inspect_backend().await;
    let cfg = with_listener(
        yaml(backend, OPEN)
            .replace("response_timeout: 2s", "response_timeout: 1s")
            .replace(
                "upstream: backend}",
                "upstream: backend, request_buffering: false}",
            ),
        "body_timeout: 5s",
    );
    let gw = TestGateway::start(&cfg, SystemClock::new()).await;
    let mut s = TcpStream::connect(gw.addr).await.expect("connect");
    s.write_all(
        b"POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n",
    )
    .await
    .expect("write");
    // A slow client: four pieces over about 1.6 s, past the response timeout (1 s); the
    // answer then has the whole timeout, a wide margin on a busy machine.
    for piece in ["one", "two", "six", "ten"] {
        s.write_all(format!("3\r\n{piece}\r\n").as_bytes())
            .await
            .expect("write");
        tokio::time::sleep(Duration::from_millis(400)).await;
    }
    s.write_all(b"0\r\n\r\n").await.expect("write");
    let mut out = String::new();
    bounded("answer", s.read_to_string(&mut out)).await.ok();
    assert_eq!(status_of(&out), 200, "{out}");
    assert!(out.ends_with("onetwosixten"), "{out}");
}

#[tokio::test]
async fn a_listener_at_max_connections_leaves_new_ones_waiting_until_one_closes() {
    let (backend, _) = inspect_backend().await;
    let cfg = with_listener(yaml(backend, OPEN), "max_connections: 2");
    let gw = TestGateway::start(&cfg, SystemClock::new()).await;
    let req = b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n";
    let mut first = Vec::new();
    for _ in 0..2 {
        let mut s = TcpStream::connect(gw.addr).await.expect("connect");
        s.write_all(req).await.expect("write");
        let mut buf = [0u8; 12];
        bounded("answer", s.read_exact(&mut buf))
            .await
            .expect("read");
        assert_eq!(&buf[..], b"HTTP/1.1 200");
        first.push(s);
    }
    let mut third = TcpStream::connect(gw.addr)
        .await
        .expect("connect (backlog)");
    third.write_all(req).await.expect("write");
    let mut buf = [0u8; 12];
    let early = tokio::time::timeout(Duration::from_millis(300), third.read_exact(&mut buf)).await;
    assert!(
        early.is_err(),
        "the third connection was served over the cap"
    );
    drop(first.pop());
    bounded("served once room", third.read_exact(&mut buf))
        .await
        .expect("read");
    assert_eq!(&buf[..], b"HTTP/1.1 200");
}

#[tokio::test]
async fn an_upstream_at_max_connections_queues_then_answers_503() {
    let (backend, mut arrived, release) = gated_backend().await;
    let cap = |wait: &str| {
        yaml(backend, OPEN).replace(
            "response_timeout: 2s",
            &format!("response_timeout: 10s\n    max_connections: 1\n    connect_timeout: {wait}"),
        )
    };
    let c = TestClient::default();
    let get = |url: String| {
        let c = c.clone();
        tokio::spawn(async move { c.get(&url).await })
    };

    // The only connection is busy past the wait: 503.
    let gw = TestGateway::start(&cap("300ms"), SystemClock::new()).await;
    let held = get(gw.url("/x"));
    bounded("first request upstream", arrived.recv()).await;
    let a = c.get(&gw.url("/x")).await;
    assert_eq!(a.status.as_u16(), 503, "{}", a.body);
    assert_eq!(a.header("retry-after"), "1");
    release.notify_one();
    assert_eq!(
        bounded("held", held).await.expect("join").status.as_u16(),
        200
    );

    // A request that waits while the connection is busy gets it when it comes back. The
    // wait is long here, so that a slow machine cannot turn the queueing into a 503.
    let gw = TestGateway::start(&cap("20s"), SystemClock::new()).await;
    let held = get(gw.url("/x"));
    bounded("first request upstream", arrived.recv()).await;
    let mut queued = get(gw.url("/x"));
    let early = tokio::time::timeout(Duration::from_millis(200), &mut queued).await;
    assert!(
        early.is_err(),
        "answered while the only connection was busy"
    );
    release.notify_one();
    assert_eq!(
        bounded("held", held).await.expect("join").status.as_u16(),
        200
    );
    bounded("queued request upstream", arrived.recv()).await;
    release.notify_one();
    let q = bounded("queued", queued).await.expect("join");
    assert_eq!(q.status.as_u16(), 200, "{}", q.body);
}

#[tokio::test]
async fn the_admin_listener_has_its_own_token_timeouts_and_cap() {
    let (backend, _) = inspect_backend().await;
    let dir = std::env::temp_dir().join(format!("tollgate-admin-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let token = dir.join("token");
    std::fs::write(&token, "s3cret\n").expect("write");
    let cfg = format!(
        "{}admin: {{address: \"127.0.0.1:1\", token_file: \"{}\", header_timeout: 300ms, max_connections: 1}}\n",
        yaml(backend, OPEN),
        token.display()
    );
    let gw = TestGateway::start(&cfg, SystemClock::new()).await;
    let admin_cfg = gw.gw.snapshot().config.admin.clone().expect("admin");
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let admin = l.local_addr().expect("addr");
    tokio::spawn(tollgate_gateway::admin::serve(gw.gw.clone(), l, admin_cfg));

    let ask = |auth: &'static str| async move {
        raw(
            admin,
            format!("GET /metrics HTTP/1.1\r\nHost: a\r\n{auth}Connection: close\r\n\r\n")
                .as_bytes(),
        )
        .await
    };
    assert_eq!(status_of(&ask("").await), 401);
    assert_eq!(
        status_of(&ask("Authorization: Bearer wrong\r\n").await),
        401
    );
    assert_eq!(
        status_of(&ask("Authorization: Bearer s3cret\r\n").await),
        200
    );
    let health = raw(
        admin,
        b"GET /healthz HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(status_of(&health), 200, "/healthz needs no token");

    // A head that never ends is cut off after header_timeout.
    let half = raw(admin, b"GET /healthz HTTP/1.1\r\nHost: a\r\n").await;
    assert!(!half.contains("200"), "{half}");

    // One admin connection held open: the proxy listener still serves.
    let _held = TcpStream::connect(admin).await.expect("connect");
    let a = TestClient::default().get(&gw.url("/x")).await;
    assert_eq!(a.status.as_u16(), 200);
    let _ = std::fs::remove_dir_all(&dir);
}
