//! Forwarding: keep-alive pools, backends that close or reset, timeouts, streaming.

mod common;

use bytes::Bytes;
use common::*;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::{Frame, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tollgate_gateway::SystemClock;

const OPEN: &str = "routes:\n  - {path_prefix: /, upstream: backend}\n";

/// Answers the first request on each connection with keep-alive, then, when the next
/// request arrives, closes the connection without answering: the race where a backend
/// closes an idle connection just as the gateway reuses it.
async fn closes_on_reuse() -> (SocketAddr, Arc<AtomicUsize>, Arc<AtomicUsize>) {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    let answered = Arc::new(AtomicUsize::new(0));
    let dropped = Arc::new(AtomicUsize::new(0));
    let (a, d) = (answered.clone(), dropped.clone());
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = l.accept().await else {
                return;
            };
            let (a, d) = (a.clone(), d.clone());
            tokio::spawn(async move {
                if !read_request(&mut s).await {
                    return;
                }
                a.fetch_add(1, Ordering::SeqCst);
                let _ = s
                    .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                    .await;
                let mut byte = [0u8; 1];
                if tokio::io::AsyncReadExt::read(&mut s, &mut byte)
                    .await
                    .unwrap_or(0)
                    > 0
                {
                    d.fetch_add(1, Ordering::SeqCst);
                }
                // Dropping the socket closes it without an answer.
            });
        }
    });
    (addr, answered, dropped)
}

#[tokio::test]
async fn a_reused_connection_closed_by_the_backend_is_retried_for_idempotent_requests() {
    let (backend, answered, dropped) = closes_on_reuse().await;
    let gw = TestGateway::start(&yaml(backend, OPEN), SystemClock::new()).await;
    let c = TestClient::default();
    for i in 0..10 {
        let a = c.get(&gw.url(&format!("/item/{i}"))).await;
        assert_eq!(a.status, StatusCode::OK, "request {i}: {}", a.body);
        assert_eq!(a.body, "ok");
    }
    assert_eq!(answered.load(Ordering::SeqCst), 10);
    assert!(
        dropped.load(Ordering::SeqCst) >= 1,
        "the race was exercised"
    );
}

#[tokio::test]
async fn an_idempotent_request_with_a_body_read_whole_is_replayed_after_the_race() {
    let (backend, answered, dropped) = closes_on_reuse().await;
    let gw = TestGateway::start(&yaml(backend, OPEN), SystemClock::new()).await;
    let c = TestClient::default();
    for i in 0..4 {
        let a = c
            .request(Method::PUT, &gw.url(&format!("/doc/{i}")), &[], "body")
            .await;
        assert_eq!(a.status, StatusCode::OK, "request {i}: {}", a.body);
    }
    assert_eq!(answered.load(Ordering::SeqCst), 4, "each PUT answered once");
    assert!(
        dropped.load(Ordering::SeqCst) >= 1,
        "the race was exercised: a PUT went out on a connection the backend dropped"
    );
}

#[tokio::test]
async fn a_non_idempotent_request_is_never_replayed() {
    let (backend, answered, dropped) = closes_on_reuse().await;
    let gw = TestGateway::start(&yaml(backend, OPEN), SystemClock::new()).await;
    let c = TestClient::default();
    let a = c
        .request(Method::POST, &gw.url("/orders"), &[], "one")
        .await;
    assert_eq!(a.status, StatusCode::OK);
    // Goes out on the pooled connection, which the backend drops after reading it.
    let a = c
        .request(Method::POST, &gw.url("/orders"), &[], "two")
        .await;
    assert_eq!(a.status, StatusCode::BAD_GATEWAY, "{}", a.body);
    assert_eq!(
        a.refusal(),
        r#"{"status":502,"error":"bad gateway","detail":"connection reset or closed"}"#
    );
    assert_eq!(answered.load(Ordering::SeqCst), 1);
    assert_eq!(
        dropped.load(Ordering::SeqCst),
        1,
        "sent once, never replayed"
    );
}

#[tokio::test]
async fn a_backend_that_closes_after_each_answer_never_shows_as_an_error() {
    // Answers with keep-alive but closes right after: the pool sees the close.
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let backend = l.local_addr().expect("addr");
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = l.accept().await else {
                return;
            };
            tokio::spawn(async move {
                if read_request(&mut s).await {
                    let _ = s
                        .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                        .await;
                }
            });
        }
    });
    let gw = TestGateway::start(&yaml(backend, OPEN), SystemClock::new()).await;
    let c = TestClient::default();
    for i in 0..20 {
        let a = c.get(&gw.url(&format!("/x/{i}"))).await;
        assert_eq!(a.status, StatusCode::OK, "request {i}: {}", a.body);
    }
}

#[tokio::test]
async fn a_backend_that_resets_gets_502() {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let backend = l.local_addr().expect("addr");
    let seen = Arc::new(AtomicUsize::new(0));
    let s2 = seen.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = l.accept().await else {
                return;
            };
            let seen = s2.clone();
            tokio::spawn(async move {
                if read_request(&mut s).await {
                    seen.fetch_add(1, Ordering::SeqCst);
                    // SO_LINGER 0: the close sends RST instead of FIN.
                    let _ = socket_reset(s);
                }
            });
        }
    });
    let gw = TestGateway::start(&yaml(backend, OPEN), SystemClock::new()).await;
    let c = TestClient::default();
    let a = c.request(Method::POST, &gw.url("/pay"), &[], "x").await;
    assert_eq!(a.status, StatusCode::BAD_GATEWAY, "{}", a.body);
    assert_eq!(seen.load(Ordering::SeqCst), 1);
    let a = c.get(&gw.url("/pay")).await;
    assert_eq!(a.status, StatusCode::BAD_GATEWAY, "{}", a.body);
    // A new connection that resets is not hammered again: one target, one try.
    assert_eq!(seen.load(Ordering::SeqCst), 2);
    // The gateway itself is fine afterwards.
    assert!(a.body.starts_with(r#"{"status":502"#));
}

fn socket_reset(s: tokio::net::TcpStream) -> std::io::Result<()> {
    let std = s.into_std()?;
    let sock = socket2::SockRef::from(&std);
    sock.set_linger(Some(std::time::Duration::ZERO))?;
    drop(std);
    Ok(())
}

#[tokio::test]
async fn a_backend_that_does_not_answer_gets_504() {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let backend = l.local_addr().expect("addr");
    tokio::spawn(async move {
        let mut held = Vec::new();
        loop {
            let Ok((s, _)) = l.accept().await else { return };
            held.push(s);
        }
    });
    let cfg = yaml(backend, OPEN).replace("response_timeout: 2s", "response_timeout: 200ms");
    let gw = TestGateway::start(&cfg, SystemClock::new()).await;
    let a = TestClient::default().get(&gw.url("/slow")).await;
    assert_eq!(a.status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(a.refusal(), r#"{"status":504,"error":"upstream timeout"}"#);
}

/// The response timeout is the upstream connection's own timer, moved for each exchange:
/// every request on a kept-alive connection gets the whole wait from when it was sent, and
/// one never answered still ends in 504.
#[tokio::test]
async fn each_request_on_a_kept_connection_gets_the_whole_response_timeout() {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let backend = l.local_addr().expect("addr");
    let conns = Arc::new(AtomicUsize::new(0));
    let counted = conns.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = l.accept().await else {
                return;
            };
            counted.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                while let Some(head) = read_request_head(&mut s).await {
                    if head.starts_with("GET /hang ") {
                        // Never answered; held until the gateway gives up on it.
                        let _ = read_request_head(&mut s).await;
                        return;
                    }
                    // 0.6 of the wait: two answers in a row outlast the first
                    // request's deadline, each within its own.
                    tokio::time::sleep(Duration::from_millis(1200)).await;
                    let ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok";
                    if s.write_all(ok).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    // `yaml` sets a response timeout of 2 s.
    let gw = TestGateway::start(&yaml(backend, OPEN), SystemClock::new()).await;
    let c = TestClient::default();
    for i in 0..2 {
        let a = bounded("a slow answer", c.get(&gw.url("/slow"))).await;
        assert_eq!(a.status, StatusCode::OK, "request {i}: {}", a.body);
    }
    let sent = Instant::now();
    let a = bounded("an answer that never comes", c.get(&gw.url("/hang"))).await;
    assert_eq!(a.status, StatusCode::GATEWAY_TIMEOUT);
    assert!(
        sent.elapsed() >= Duration::from_secs(2),
        "refused after {:?}, before its wait was up",
        sent.elapsed()
    );
    assert_eq!(
        conns.load(Ordering::SeqCst),
        1,
        "all three went over one kept connection"
    );
}

/// A connection that waited in the pool past its last deadline (its timer fired there)
/// serves the next request with a whole new wait.
#[tokio::test]
async fn a_connection_idle_past_its_last_deadline_serves_the_next_request() {
    let (backend, conns) =
        raw_backend(|_| Some(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok".to_vec())).await;
    let cfg = yaml(backend, OPEN).replace("response_timeout: 2s", "response_timeout: 500ms");
    let gw = TestGateway::start(&cfg, SystemClock::new()).await;
    let c = TestClient::default();
    assert_eq!(c.get(&gw.url("/a")).await.status, StatusCode::OK);
    // Not a wait for the gateway: the condition under test is time passing while the
    // connection is idle, so that its timer fires with no exchange under way.
    tokio::time::sleep(Duration::from_secs(1)).await;
    for i in 0..3 {
        let a = bounded("an answer on the idle connection", c.get(&gw.url("/b"))).await;
        assert_eq!(a.status, StatusCode::OK, "request {i}: {}", a.body);
    }
    assert_eq!(conns.load(Ordering::SeqCst), 1, "one kept connection");
}

#[tokio::test]
async fn a_refused_connection_gets_502_and_the_next_target_is_tried() {
    let dead = closed_port().await;
    let gw = TestGateway::start(&yaml(dead, OPEN), SystemClock::new()).await;
    let a = TestClient::default().get(&gw.url("/")).await;
    assert_eq!(a.status, StatusCode::BAD_GATEWAY);
    assert!(a.body.contains("connection refused"), "{}", a.body);

    // Two targets, one dead: every idempotent request still succeeds.
    let live = echo_backend().await;
    let cfg = yaml(dead, OPEN).replace(
        &format!("[\"{dead}\"]"),
        &format!("[\"{dead}\", \"{live}\"]"),
    );
    let gw = TestGateway::start(&cfg, SystemClock::new()).await;
    let c = TestClient::default();
    for _ in 0..6 {
        assert_eq!(c.get(&gw.url("/")).await.status, StatusCode::OK);
    }
}

#[tokio::test]
async fn round_robin_over_targets() {
    let (a, hits_a) = inspect_backend().await;
    let (b, hits_b) = inspect_backend().await;
    let cfg = yaml(a, OPEN).replace(&format!("[\"{a}\"]"), &format!("[\"{a}\", \"{b}\"]"));
    let gw = TestGateway::start(&cfg, SystemClock::new()).await;
    let c = TestClient::default();
    for _ in 0..10 {
        assert_eq!(c.get(&gw.url("/")).await.status, StatusCode::OK);
    }
    assert_eq!(
        (hits_a.load(Ordering::SeqCst), hits_b.load(Ordering::SeqCst)),
        (5, 5)
    );
}

#[tokio::test]
async fn bodies_stream_both_ways() {
    // The backend reports each request chunk as it arrives, and sends its response in two
    // parts, the second only when told: both directions must flow before either body ends.
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let backend = l.local_addr().expect("addr");
    let (got_tx, mut got_rx) = mpsc::unbounded_channel::<Bytes>();
    let (release_tx, release_rx) = oneshot::channel::<()>();
    let release = Arc::new(parking_lot::Mutex::new(Some(release_rx)));
    tokio::spawn(async move {
        let (s, _) = l.accept().await.expect("accept");
        let svc = service_fn(move |req: Request<Incoming>| {
            let got_tx = got_tx.clone();
            let release = release.lock().take();
            async move {
                let (mut tx, body) = http_body_util::channel::Channel::<Bytes, Infallible>::new(4);
                tokio::spawn(async move {
                    let mut incoming = req.into_body();
                    while let Some(Ok(frame)) = incoming.frame().await {
                        if let Ok(data) = frame.into_data() {
                            let _ = got_tx.send(data);
                        }
                    }
                });
                tokio::spawn(async move {
                    let _ = tx.send(Frame::data(Bytes::from_static(b"first;"))).await;
                    if let Some(r) = release {
                        let _ = r.await;
                    }
                    let _ = tx.send(Frame::data(Bytes::from_static(b"second"))).await;
                });
                Ok::<_, Infallible>(hyper::Response::new(body))
            }
        });
        let _ = http1::Builder::new()
            .serve_connection(TokioIo::new(s), svc)
            .await;
    });
    // Full duplex needs the body streamed at once, not read first.
    let cfg = yaml(backend, OPEN).replace(
        "upstream: backend",
        "upstream: backend, request_buffering: false",
    );
    let gw = TestGateway::start(&cfg, SystemClock::new()).await;

    // A raw chunked upload through hyper's client connection.
    let stream = tokio::net::TcpStream::connect(gw.addr)
        .await
        .expect("connect");
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("handshake");
    tokio::spawn(conn);
    let (mut up_tx, up_body) = http_body_util::channel::Channel::<Bytes, Infallible>::new(4);
    let req = Request::builder()
        .method(Method::POST)
        .uri("/upload")
        .header("host", "x")
        .body(up_body)
        .expect("req");
    let resp_fut = tokio::spawn(sender.send_request(req));
    up_tx
        .send(Frame::data(Bytes::from_static(b"part-1")))
        .await
        .expect("send");
    let got = bounded("first request chunk upstream", got_rx.recv()).await;
    assert_eq!(got.as_deref(), Some(&b"part-1"[..]), "request body streams");

    let resp = bounded("response head", resp_fut)
        .await
        .expect("join")
        .expect("response");
    assert_eq!(resp.status(), StatusCode::OK);
    let mut body = resp.into_body();
    let first = bounded("first response chunk", body.frame()).await;
    let first = first
        .expect("frame")
        .expect("ok")
        .into_data()
        .expect("data");
    assert_eq!(&first[..], b"first;", "response body streams");

    up_tx
        .send(Frame::data(Bytes::from_static(b"part-2")))
        .await
        .expect("send");
    drop(up_tx);
    let got = bounded("second request chunk", got_rx.recv()).await;
    assert_eq!(got.as_deref(), Some(&b"part-2"[..]));
    release_tx.send(()).expect("release");
    let rest = bounded("rest", body.collect())
        .await
        .expect("rest")
        .to_bytes();
    assert_eq!(&rest[..], b"second");
}

#[tokio::test]
async fn large_bodies_pass_intact() {
    let (backend, _) = inspect_backend().await;
    let cfg = yaml(backend, OPEN).replace(
        "listeners: [{address: \"127.0.0.1:0\"}]",
        "listeners: [{address: \"127.0.0.1:0\", max_body_bytes: 64MiB}]",
    );
    let gw = TestGateway::start(&cfg, SystemClock::new()).await;
    let big: String = (0..4_000_000)
        .map(|i| char::from(b'a' + (i % 26) as u8))
        .collect();
    let req = Request::builder()
        .method(Method::PUT)
        .uri(gw.url("/blob"))
        .body(Full::new(Bytes::from(big.clone())))
        .expect("req");
    let a = TestClient::default().send(req).await;
    assert_eq!(a.status, StatusCode::OK);
    assert!(a.body.ends_with(&big), "body intact");
}

#[tokio::test]
async fn a_streamed_body_goes_up_without_the_clients_trailers_or_expect() {
    // A backend that keeps the raw bytes of the request, up to the last chunk and the
    // trailer section's end.
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let backend = l.local_addr().expect("addr");
    let (got_tx, got_rx) = oneshot::channel::<Vec<u8>>();
    tokio::spawn(async move {
        let (mut s, _) = l.accept().await.expect("accept");
        let seen = read_until(&mut s, b"\r\n0\r\n\r\n").await;
        let _ = s
            .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            .await;
        let _ = got_tx.send(seen);
    });
    let cfg = yaml(backend, OPEN).replace(
        "upstream: backend",
        "upstream: backend, request_buffering: false",
    );
    let gw = TestGateway::start(&cfg, SystemClock::new()).await;
    let mut c = tokio::net::TcpStream::connect(gw.addr)
        .await
        .expect("connect");
    c.write_all(
        b"POST /up HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nExpect: 100-continue\r\n\r\n\
          5\r\nhello\r\n0\r\nX-Consumer-Name: evil\r\nAuthorization: forged\r\n\r\n",
    )
    .await
    .expect("send");
    let seen = bounded("the request upstream", got_rx).await.expect("seen");
    let text = String::from_utf8_lossy(&seen).to_ascii_lowercase();
    let (head, body) = text.split_once("\r\n\r\n").expect("a head");
    assert!(head.contains("transfer-encoding: chunked"), "{head}");
    assert!(
        !head.contains("expect:"),
        "the client's Expect stays at the edge: {head}"
    );
    assert_eq!(body, "5\r\nhello\r\n0\r\n\r\n", "no trailers go up");
    let answer = bounded("the answer", read_until(&mut c, b"ok")).await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        answer.contains("200 OK") && answer.ends_with("ok"),
        "{answer}"
    );
}

/// What `s` sends until it ends with `end`, or closes.
async fn read_until(s: &mut tokio::net::TcpStream, end: &[u8]) -> Vec<u8> {
    use tokio::io::AsyncReadExt;
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !seen.ends_with(end) {
        match s.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => seen.extend_from_slice(&buf[..n]),
        }
    }
    seen
}
