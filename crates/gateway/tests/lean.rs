//! The lean client for requests without a body: framing, streaming, reuse, replays.

mod common;

use bytes::Bytes;
use common::*;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tollgate_gateway::SystemClock;

const OPEN: &str = "routes:\n  - {path_prefix: /, upstream: backend}\n";

#[tokio::test]
async fn keeps_one_connection_for_sequential_requests() {
    let (backend, conns) = raw_backend(|h| {
        if h.starts_with("HEAD") {
            Some(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n".to_vec())
        } else {
            Some(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok".to_vec())
        }
    })
    .await;
    let gw = TestGateway::start(&yaml(backend, OPEN), SystemClock::new()).await;
    let c = TestClient::default();
    for _ in 0..10 {
        let a = c.get(&gw.url("/x")).await;
        assert_eq!((a.status, a.body.as_str()), (StatusCode::OK, "ok"));
    }
    for _ in 0..3 {
        let a = c.request(Method::HEAD, &gw.url("/x"), &[], "").await;
        assert_eq!(a.status, StatusCode::OK);
    }
    assert_eq!(conns.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn decodes_chunked_responses_and_keeps_the_connection() {
    let (backend, conns) = raw_backend(|_| {
        Some(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;ext=1\r\nhello\r\n7\r\n, world\r\n0\r\nX-Trailer: t\r\n\r\n".to_vec())
    })
    .await;
    let gw = TestGateway::start(&yaml(backend, OPEN), SystemClock::new()).await;
    let c = TestClient::default();
    for _ in 0..3 {
        let a = c.get(&gw.url("/chunks")).await;
        assert_eq!(
            (a.status, a.body.as_str()),
            (StatusCode::OK, "hello, world")
        );
    }
    assert_eq!(conns.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_chunked_answer_another_reader_could_frame_otherwise_is_cut_off_at_once() {
    // Bytes that end a line for some readers and not for others: a bare LF (in a size
    // line, an extension, a trailer) or a bare CR. The answer is cut off as soon as they
    // come, and its connection is not used again. (Waited past, as before, each would
    // hold its client for the upstream's 60 s read timeout: `raw` gives up at 20 s.)
    let (backend, conns) = raw_backend(|h| {
        let body: &[u8] = if h.starts_with("GET /bare-lf") {
            b"5\nhello\n0\n\n"
        } else if h.starts_with("GET /ext-lf") {
            b"5;a=b\nc\r\nhello\r\n0\r\n\r\n"
        } else if h.starts_with("GET /ext-cr") {
            b"5;a\rb\r\nhello\r\n0\r\n\r\n"
        } else if h.starts_with("GET /cr-only") {
            // Lines ended by a bare CR alone: no LF ever comes.
            b"5\rhello\r0\r\r"
        } else if h.starts_with("GET /trailer") {
            b"5\r\nhello\r\n0\r\nX: a\nHTTP/1.1 200 OK\r\n\r\n"
        } else if h.starts_with("GET /odd-trailer") {
            // Odd but plain: dropped as trailers are, the answer whole.
            b"2\r\nok\r\n0\r\nX-A : b\r\n folded\r\n\r\n"
        } else {
            // Spaces after a size, as the listener takes them from clients.
            b"2 \r\nok\r\n0\r\n\r\n"
        };
        let mut a = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
        a.extend_from_slice(body);
        Some(a)
    })
    .await;
    let gw = TestGateway::start(&yaml(backend, OPEN), SystemClock::new()).await;
    for path in ["/bare-lf", "/ext-lf", "/ext-cr", "/cr-only", "/trailer"] {
        let before = conns.load(Ordering::SeqCst);
        let r = raw(
            gw.addr,
            format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes(),
        )
        .await;
        assert!(
            !r.contains("hello\r\n0\r\n\r\n"),
            "{path}: passed on whole: {r:?}"
        );
        assert!(!r.is_empty(), "{path}: nothing answered");
        assert_eq!(
            conns.load(Ordering::SeqCst),
            before + 1,
            "{path}: a connection of its own, not one left by the last"
        );
    }
    let c = TestClient::default();
    for path in ["/space", "/odd-trailer"] {
        let a = c.get(&gw.url(path)).await;
        assert_eq!(
            (a.status, a.body.as_str()),
            (StatusCode::OK, "ok"),
            "{path}"
        );
    }
}

#[tokio::test]
async fn a_status_without_a_reason_goes_on_with_an_empty_one() {
    let (backend, _) =
        raw_backend(|_| Some(b"HTTP/1.1 599 Odd\r\nContent-Length: 0\r\n\r\n".to_vec())).await;
    let gw = TestGateway::start(&yaml(backend, OPEN), SystemClock::new()).await;
    let r = raw(
        gw.addr,
        b"GET /x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(r.starts_with("HTTP/1.1 599 \r\n"), "{r:?}");
}

#[tokio::test]
async fn a_status_past_599_is_no_answer() {
    let (backend, _) =
        raw_backend(|_| Some(b"HTTP/1.1 600 Odd\r\nContent-Length: 2\r\n\r\nok".to_vec())).await;
    let gw = TestGateway::start(&yaml(backend, OPEN), SystemClock::new()).await;
    let a = TestClient::default().get(&gw.url("/x")).await;
    assert_eq!(a.status, StatusCode::BAD_GATEWAY, "{}", a.body);
}

#[tokio::test]
async fn reads_http_1_0_bodies_until_close() {
    // An HTTP/1.0 body without a length ends only when the backend closes.
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let closing = l.local_addr().expect("addr");
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = l.accept().await else {
                return;
            };
            tokio::spawn(async move {
                if read_head(&mut s).await.is_some() {
                    let _ = s
                        .write_all(b"HTTP/1.0 200 OK\r\nX-Old: yes\r\n\r\nold style body")
                        .await;
                }
            });
        }
    });
    let gw = TestGateway::start(&yaml(closing, OPEN), SystemClock::new()).await;
    let c = TestClient::default();
    for _ in 0..3 {
        let a = c.get(&gw.url("/old")).await;
        assert_eq!(
            (a.status, a.body.as_str()),
            (StatusCode::OK, "old style body")
        );
        assert_eq!(a.header("x-old"), "yes");
    }
}

#[tokio::test]
async fn no_body_for_204_and_head() {
    let (backend, conns) = raw_backend(|h| {
        if h.starts_with("HEAD") {
            Some(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n".to_vec())
        } else {
            Some(b"HTTP/1.1 204 No Content\r\n\r\n".to_vec())
        }
    })
    .await;
    let gw = TestGateway::start(&yaml(backend, OPEN), SystemClock::new()).await;
    let c = TestClient::default();
    let a = c.get(&gw.url("/none")).await;
    assert_eq!((a.status, a.body.as_str()), (StatusCode::NO_CONTENT, ""));
    let a = c.request(Method::HEAD, &gw.url("/big"), &[], "").await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(a.header("content-length"), "1000");
    let a = c.get(&gw.url("/none")).await;
    assert_eq!(a.status, StatusCode::NO_CONTENT);
    assert_eq!(
        conns.load(Ordering::SeqCst),
        1,
        "reused after bodiless answers"
    );
}

#[tokio::test]
async fn skips_100_continue_and_rejects_garbage() {
    let (backend, _) = raw_backend(|h| {
        if h.starts_with("GET /garbage") {
            Some(b"NOT HTTP AT ALL\r\n\r\n".to_vec())
        } else {
            Some(
                b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nreal"
                    .to_vec(),
            )
        }
    })
    .await;
    let gw = TestGateway::start(&yaml(backend, OPEN), SystemClock::new()).await;
    let c = TestClient::default();
    let a = c.get(&gw.url("/continue")).await;
    assert_eq!((a.status, a.body.as_str()), (StatusCode::OK, "real"));
    let a = c.get(&gw.url("/garbage")).await;
    assert_eq!(a.status, StatusCode::BAD_GATEWAY);
    assert!(
        a.body.contains("malformed or truncated response"),
        "{}",
        a.body
    );
}

#[tokio::test]
async fn a_replayed_request_is_rewritten_once() {
    // First request on each connection answered; the next one read and dropped.
    let (backend, seen) = recording_backend_with(true).await;
    // The test client is a trusted proxy here, so its X-Forwarded-For is appended to.
    let cfg = yaml(backend, OPEN).replace(
        "{address: \"127.0.0.1:0\"}",
        "{address: \"127.0.0.1:0\", trusted_proxies: [127.0.0.1]}",
    );
    let gw = TestGateway::start(&cfg, SystemClock::new()).await;
    let c = TestClient::default();
    for _ in 0..4 {
        let a = c
            .request(
                Method::GET,
                &gw.url("/r"),
                &[("X-Forwarded-For", "10.0.0.1")],
                "",
            )
            .await;
        assert_eq!(a.status, StatusCode::OK);
    }
    let seen = seen.lock();
    assert_eq!(seen.len(), 4);
    for h in seen.iter() {
        let lower = h.to_ascii_lowercase();
        assert!(
            lower.contains("x-forwarded-for: 10.0.0.1, 127.0.0.1\r\n"),
            "{h}"
        );
        assert_eq!(lower.matches("\r\nhost: ").count(), 1, "{h}");
    }
}

#[tokio::test]
async fn streams_a_chunked_response_as_it_comes() {
    // The backend sends its first chunk, then waits to be told before the rest.
    let release = Arc::new(Notify::new());
    let r2 = release.clone();
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let backend = l.local_addr().expect("addr");
    tokio::spawn(async move {
        let Ok((mut s, _)) = l.accept().await else {
            return;
        };
        if read_head(&mut s).await.is_some() {
            let _ = s
                .write_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n6\r\nfirst;\r\n")
                .await;
            r2.notified().await;
            let _ = s.write_all(b"6\r\nsecond\r\n0\r\n\r\n").await;
        }
    });
    let gw = TestGateway::start(&yaml(backend, OPEN), SystemClock::new()).await;
    let stream = TcpStream::connect(gw.addr).await.expect("connect");
    let (mut tx, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("handshake");
    tokio::spawn(conn);
    let req = Request::get("/stream")
        .header("host", "x")
        .body(Empty::<Bytes>::new())
        .expect("req");
    let resp = bounded("head", tx.send_request(req)).await.expect("resp");
    let mut body = resp.into_body();
    let first = bounded("first chunk", body.frame()).await;
    let first = first
        .expect("frame")
        .expect("ok")
        .into_data()
        .expect("data");
    assert_eq!(&first[..], b"first;");
    release.notify_one();
    let rest = bounded("rest", body.collect())
        .await
        .expect("rest")
        .to_bytes();
    assert_eq!(&rest[..], b"second");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_restart_leaves_no_error_behind() {
    // Every connection stays open until the backend "restarts" and drops them all.
    let restart = Arc::new(Notify::new());
    let r2 = restart.clone();
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let backend = l.local_addr().expect("addr");
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = l.accept().await else {
                return;
            };
            let restart = r2.clone();
            tokio::spawn(async move {
                let mut restarted = std::pin::pin!(restart.notified());
                loop {
                    tokio::select! {
                        _ = &mut restarted => return,
                        h = read_head(&mut s) => match h {
                            Some(_) => {
                                let ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok";
                                if s.write_all(ok).await.is_err() {
                                    return;
                                }
                            }
                            None => return,
                        },
                    }
                }
            });
        }
    });
    let gw = TestGateway::start(&yaml(backend, OPEN), SystemClock::new()).await;
    // Fill the pool with eight connections.
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let url = gw.url("/warm");
        tasks.push(tokio::spawn(async move {
            TestClient::default().get(&url).await.status
        }));
    }
    for t in tasks {
        assert_eq!(t.await.expect("join"), StatusCode::OK);
    }
    restart.notify_waiters();
    let c = TestClient::default();
    for i in 0..20 {
        let a = c.get(&gw.url(&format!("/after/{i}"))).await;
        assert_eq!(
            a.status,
            StatusCode::OK,
            "request {i} after the restart: {}",
            a.body
        );
    }
}
