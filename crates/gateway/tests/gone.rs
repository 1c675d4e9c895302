//! A client that goes away before its answer (an HTTP/1.1 connection closed, with or
//! without a request body, or right after the request; an HTTP/2 stream reset) while the
//! upstream works: the request is counted and logged with status
//! 499 under its route, consumer and the target it went to, as nginx logs it, and the
//! connection's other streams go on. A request cut because a shutdown's drain time ran out
//! is counted and logged the same way before the shutdown returns.

mod common;

use bytes::Bytes;
use common::*;
use http::Request;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::{TokioExecutor, TokioIo};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tollgate_gateway::SystemClock;

/// Sends `request` on a connection of its own and waits until the backend has it: the
/// connection, for the client to leave while the upstream works.
async fn sent_upstream(
    addr: std::net::SocketAddr,
    arrived: &mut tokio::sync::mpsc::UnboundedReceiver<()>,
    request: &[u8],
) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    s.write_all(request).await.expect("write");
    bounded("the request upstream", arrived.recv())
        .await
        .expect("arrived");
    s
}

/// The gateway's metrics once they count `n` answers of 499 (the count checked).
async fn counted_499(gw: &TestGateway, n: usize) -> String {
    let line = format!(r#"tollgate_responses_total{{code="499"}} {n}"#);
    let m = metrics_with(&gw.gw, &line).await;
    assert!(m.lines().any(|l| l == line), "{m}");
    m
}

#[tokio::test]
async fn a_client_that_leaves_before_its_answer_is_counted_and_logged_as_499() {
    let dir = tempdir("gone");
    let path = dir.join("access.log");
    // Every request but `/api/fast` waits until released: the client leaves meanwhile.
    let (backend, mut arrived, release) = gated_backend_with(|req, _| {
        let gated = req.uri().path() != "/api/fast";
        (hyper::Response::new("late".to_string()), gated)
    })
    .await;
    let yaml = format!(
        r#"listeners: [{{address: "127.0.0.1:0", h2c: true}}]
upstreams:
  backend: {{targets: ["{backend}"], response_timeout: 30s}}
consumers: [{{name: alice, keys: [ka]}}]
routes:
  - {{name: api, path_prefix: /api/, upstream: backend, auth: {{}}}}
access_log: {{path: {}}}
metrics: {{per_consumer: true}}
"#,
        path.display()
    );
    let gw = TestGateway::start(&yaml, SystemClock::new()).await;

    // HTTP/1.1: the connection closed while the upstream works on the request.
    let get = b"GET /api/slow?apikey=ka HTTP/1.1\r\nHost: api.test\r\n\r\n";
    drop(sent_upstream(gw.addr, &mut arrived, get).await);
    counted_499(&gw, 1).await;
    // A request with a body, the client gone once it has sent all of it.
    let post =
        b"POST /api/upload?apikey=ka HTTP/1.1\r\nHost: api.test\r\nContent-Length: 5\r\n\r\nhello";
    drop(sent_upstream(gw.addr, &mut arrived, post).await);
    counted_499(&gw, 2).await;

    // HTTP/2: the stream reset while the upstream works; the connection goes on.
    let io = TokioIo::new(TcpStream::connect(gw.addr).await.expect("connect"));
    let (mut tx, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
        .await
        .expect("h2 handshake");
    tokio::spawn(conn);
    let get = |path: &str| {
        Request::builder()
            .uri(format!("http://api.test{path}"))
            .body(Empty::<Bytes>::new())
            .expect("request")
    };
    let answer = tx.send_request(get("/api/reset?apikey=ka"));
    // Dropping the answer's future resets the stream (CANCEL) once the request is upstream.
    bounded("the request upstream", async {
        tokio::select! {
            r = answer => panic!("answered before the backend was released: {r:?}"),
            _ = arrived.recv() => {}
        }
    })
    .await;
    let m = counted_499(&gw, 3).await;
    assert!(
        m.lines()
            .any(|l| l == r#"tollgate_consumer_requests_total{consumer="alice",class="4xx"} 3"#),
        "{m}"
    );
    let fast = bounded(
        "a request after the reset",
        tx.send_request(get("/api/fast?apikey=ka")),
    )
    .await
    .expect("answer");
    assert_eq!(fast.status(), 200);
    let body = fast.into_body().collect().await.expect("body").to_bytes();
    assert_eq!(&body[..], b"late");
    // A client that closes right after its request: gone before the request's first turn.
    let mut s = TcpStream::connect(gw.addr).await.expect("connect");
    s.write_all(b"GET /api/at-once?apikey=ka HTTP/1.1\r\nHost: api.test\r\n\r\n")
        .await
        .expect("write");
    drop(s);
    counted_499(&gw, 4).await;
    release.notify_waiters();

    assert!(gw.gw.sync_logs(DEADLINE), "the writer did not catch up");
    let lines = log_lines(&path);
    assert_eq!(lines.len(), 5, "{lines:?}");
    let gone = [
        (&lines[0], "GET", "/api/slow"),
        (&lines[1], "POST", "/api/upload"),
        (&lines[2], "GET", "/api/reset"),
    ];
    for (line, method, path) in gone {
        assert_eq!(line["status"], 499, "{line}");
        assert_eq!(line["path"], path, "{line}");
        assert_eq!(line["method"], method, "{line}");
        assert_eq!(line["route"], "api", "{line}");
        assert_eq!(line["consumer"], "alice", "{line}");
        assert_eq!(line["bytes_out"], 0, "{line}");
        assert_eq!(line["upstream_target"], backend.to_string(), "{line}");
        assert!(
            line["duration_ms"].as_f64().is_some_and(|d| d > 0.0),
            "{line}"
        );
    }
    assert_eq!(lines[3]["status"], 200);
    assert_eq!(lines[4]["status"], 499);
    assert_eq!(lines[4]["path"], "/api/at-once");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_request_cut_when_the_drain_time_is_over_is_logged_before_shutdown_returns() {
    let dir = tempdir("gone-drain");
    let path = dir.join("access.log");
    let (backend, mut arrived, _release) = gated_backend().await;
    let yaml = yaml(
        backend,
        &format!(
            "routes:\n  - {{name: stuck, path_prefix: /, upstream: backend}}\naccess_log: {{path: {}}}\n",
            path.display()
        ),
    );
    let mut gw = TestGateway::start(&yaml, SystemClock::new()).await;
    let get = b"GET /stuck HTTP/1.1\r\nHost: api.test\r\n\r\n";
    let mut s = sent_upstream(gw.addr, &mut arrived, get).await;
    let server = gw.server.take().expect("server");
    let drained = bounded("shutdown", server.shutdown(Duration::from_millis(100))).await;
    assert!(
        !drained,
        "a stuck request cannot hold shutdown past the drain time"
    );
    // Cut: the client's connection is closed without an answer, and the request is
    // counted and queued to the log by the time the shutdown returns.
    let mut rest = Vec::new();
    let read = bounded("the cut connection", s.read_to_end(&mut rest)).await;
    assert!(read.is_err() || rest.is_empty(), "{read:?} {rest:?}");
    let m = gw.gw.metrics_text();
    assert!(
        m.lines()
            .any(|l| l == r#"tollgate_responses_total{code="499"} 1"#),
        "{m}"
    );
    assert!(gw.gw.sync_logs(DEADLINE), "the writer did not catch up");
    let lines = log_lines(&path);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["status"], 499);
    assert_eq!(lines[0]["path"], "/stuck");
    assert_eq!(lines[0]["route"], "stuck");
    let _ = std::fs::remove_dir_all(&dir);
}
