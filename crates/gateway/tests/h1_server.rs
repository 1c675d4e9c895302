//! The HTTP/1.1 server as a client meets it on the wire: pipelining, HTTP/1.0 keep-alive,
//! `100-continue`, `HEAD`, framing it refuses, an answer that comes before its request's
//! body ends (the rest dropped within bounds, or the connection closed), and the head
//! deadline.

mod common;

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tollgate_gateway::SystemClock;

const OPEN: &str = r#"
routes:
  - name: open
    path_prefix: /
    upstream: backend
"#;

async fn setup(listener_extra: &str) -> TestGateway {
    let (backend, _) = inspect_backend().await;
    let cfg = yaml(backend, OPEN).replace(
        "listeners: [{address: \"127.0.0.1:0\"}]",
        &format!("listeners: [{{address: \"127.0.0.1:0\"{listener_extra}}}]"),
    );
    TestGateway::start(&cfg, SystemClock::new()).await
}

/// Reads from `s` until `text` has been seen `times` times; returns all read.
async fn read_until(s: &mut TcpStream, text: &str, times: usize) -> String {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while String::from_utf8_lossy(&got).matches(text).count() < times {
        let n = bounded("read", s.read(&mut buf)).await.expect("read");
        assert!(n > 0, "closed early: {}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
    }
    String::from_utf8_lossy(&got).into_owned()
}

#[tokio::test]
async fn pipelined_requests_are_answered_in_order() {
    let gw = setup("").await;
    let r = raw(
        gw.addr,
        b"GET /first HTTP/1.1\r\nHost: x\r\n\r\nPOST /second HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\nbodyGET /third HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .await;
    let first = r.find("GET /first").expect("first answered");
    let second = r.find("POST /second").expect("second answered");
    let third = r.find("GET /third").expect("third answered");
    assert!(first < second && second < third, "{r}");
    assert!(r.contains("\n\nbody"), "{r}");
    assert_eq!(r.matches("HTTP/1.1 200 OK").count(), 3, "{r}");
}

#[tokio::test]
async fn an_http10_client_that_asks_keeps_its_connection() {
    let gw = setup("").await;
    let mut s = TcpStream::connect(gw.addr).await.expect("connect");
    for i in 0..2 {
        s.write_all(b"GET /old HTTP/1.0\r\nHost: x\r\nConnection: keep-alive\r\n\r\n")
            .await
            .expect("write");
        let got = read_until(&mut s, "GET /old", 1).await;
        assert!(got.starts_with("HTTP/1.1 200"), "{i}: {got}");
        assert!(got.contains("connection: keep-alive\r\n"), "{i}: {got}");
        assert!(got.contains("content-length: "), "{i}: {got}");
    }
    // Without asking, an HTTP/1.0 connection ends after its answer.
    let r = raw(gw.addr, b"GET /old HTTP/1.0\r\nHost: x\r\n\r\n").await;
    assert!(r.contains("connection: close\r\n"), "{r}");
    assert_eq!(r.matches("HTTP/1.1").count(), 1, "{r}");
}

#[tokio::test]
async fn a_client_that_expects_100_continue_gets_it_before_sending_its_body() {
    let gw = setup("").await;
    let mut s = TcpStream::connect(gw.addr).await.expect("connect");
    s.write_all(
        b"PUT /up HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n",
    )
    .await
    .expect("write");
    let got = read_until(&mut s, "\r\n\r\n", 1).await;
    assert_eq!(got, "HTTP/1.1 100 Continue\r\n\r\n");
    s.write_all(b"hello").await.expect("write");
    let got = read_until(&mut s, "hello", 1).await;
    assert!(got.starts_with("HTTP/1.1 200 OK"), "{got}");
    // The Expect header is the gateway's to answer: it does not go upstream.
    assert!(!got.to_ascii_lowercase().contains("expect:"), "{got}");
}

#[tokio::test]
async fn head_answers_carry_no_body_and_keep_the_connection() {
    let gw = setup("").await;
    let r = raw(
        gw.addr,
        b"HEAD /h HTTP/1.1\r\nHost: x\r\n\r\nGET /g HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .await;
    let second = r.find("HTTP/1.1 200 OK").and_then(|first| {
        let after = first + 1;
        r[after..].find("HTTP/1.1 200 OK").map(|k| k + after)
    });
    let second = second.expect("two answers");
    // The first answer is a head alone: the second starts right after its blank line.
    assert!(r[..second].ends_with("\r\n\r\n"), "{r}");
    assert!(!r[..second].contains("HEAD /h"), "{r}");
    assert!(r[second..].contains("GET /g"), "{r}");
}

#[tokio::test]
async fn framing_in_doubt_is_refused_with_the_reason_and_a_close() {
    let gw = setup("").await;
    for (req, status, reason) in [
        (
            &b"POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n"[..],
            501,
            "transfer coding not supported",
        ),
        (
            b"POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            400,
            "Transfer-Encoding given twice",
        ),
        // RFC 9112 §6.3: chunked not last leaves the length unknown: 400, not 501.
        (
            b"POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked, gzip\r\n\r\n0\r\n\r\n",
            400,
            "chunked is not the last transfer coding",
        ),
        (
            b"POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n0\r\n\r\n",
            400,
            "chunked is not the last transfer coding",
        ),
        (
            b"POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked, chunked\r\n\r\n0\r\n\r\n",
            400,
            "chunked given twice",
        ),
        (
            b"POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked,\r\n\r\n0\r\n\r\n",
            400,
            "empty element in Transfer-Encoding",
        ),
        (
            b"POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked;q=1\r\n\r\n0\r\n\r\n",
            400,
            "transfer coding with parameters",
        ),
        (
            b"POST /x HTTP/1.0\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            400,
            "Transfer-Encoding in an HTTP/1.0 request",
        ),
        (
            b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd",
            400,
            "two different Content-Length values",
        ),
        (
            b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: +3\r\n\r\nabc",
            400,
            "invalid Content-Length",
        ),
        (
            b"GET /x HTTP/1.1\r\nHost: x\r\nBad Name: y\r\n\r\n",
            400,
            "invalid header name",
        ),
        (
            b"GET /x HTTP/1.1\r\nHost: x\r\n folded: y\r\n\r\n",
            400,
            "invalid header name",
        ),
    ] {
        let r = raw(gw.addr, req).await;
        assert_eq!(status_of(&r), status, "{r}");
        assert!(r.contains(reason), "{reason}: {r}");
        assert!(r.contains("connection: close\r\n"), "{r}");
        assert!(r.contains("content-type: application/json"), "{r}");
        assert_eq!(r.matches("HTTP/1.1").count(), 1, "{r}");
    }
}

#[tokio::test]
async fn a_chunked_body_with_trailers_and_extensions_goes_up_whole() {
    let gw = setup("").await;
    let r = raw(
        gw.addr,
        b"POST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n",
    )
    .await;
    assert!(r.starts_with("HTTP/1.1 200 OK"), "{r}");
    assert!(r.ends_with("\n\nhello world"), "{r}");
}

#[tokio::test]
async fn an_idle_keep_alive_connection_is_closed_at_the_header_timeout() {
    let gw = setup(", header_timeout: 1s").await;
    let mut s = TcpStream::connect(gw.addr).await.expect("connect");
    s.write_all(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .expect("write");
    read_until(&mut s, "GET /a", 1).await;
    // Then nothing: the server closes the connection, without an answer.
    let mut rest = Vec::new();
    bounded("close", s.read_to_end(&mut rest))
        .await
        .expect("read");
    assert!(rest.is_empty(), "{}", String::from_utf8_lossy(&rest));
    // A head that never ends is closed the same way.
    let mut s = TcpStream::connect(gw.addr).await.expect("connect");
    s.write_all(b"GET /a HTTP/1.1\r\nHost:")
        .await
        .expect("write");
    let mut rest = Vec::new();
    bounded("close", s.read_to_end(&mut rest))
        .await
        .expect("read");
    assert!(rest.is_empty(), "{}", String::from_utf8_lossy(&rest));
}

#[tokio::test]
async fn a_client_that_leaves_takes_its_request_with_it() {
    // A backend that never answers, and tells when the gateway closes its connection.
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let backend = l.local_addr().expect("addr");
    let (got_tx, got_rx) = tokio::sync::oneshot::channel::<()>();
    let (ended_tx, ended_rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        let Ok((mut s, _)) = l.accept().await else {
            return;
        };
        // Read the request, then wait for the gateway to close the connection.
        let got = read_head(&mut s).await;
        let _ = got_tx.send(());
        if got.is_some() {
            let mut buf = [0u8; 4096];
            while let Ok(n) = s.read(&mut buf).await {
                if n == 0 {
                    break;
                }
            }
        }
        let _ = ended_tx.send(());
    });
    let cfg = yaml(backend, OPEN).replace("response_timeout: 2s", "response_timeout: 60s");
    let gw = TestGateway::start(&cfg, SystemClock::new()).await;
    let mut s = TcpStream::connect(gw.addr).await.expect("connect");
    s.write_all(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .expect("write");
    // The request reaches the backend before the client goes.
    bounded("the request upstream", got_rx)
        .await
        .expect("the backend got the request");
    drop(s);
    bounded("the upstream exchange dropped", ended_rx)
        .await
        .expect("the backend saw its connection end");
}

#[tokio::test]
async fn a_head_that_comes_a_byte_at_a_time_is_served() {
    let gw = setup("").await;
    let mut s = TcpStream::connect(gw.addr).await.expect("connect");
    s.set_nodelay(true).expect("nodelay");
    for b in b"GET /slowly HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" {
        s.write_all(&[*b]).await.expect("write");
    }
    let mut out = Vec::new();
    bounded("answer", s.read_to_end(&mut out))
        .await
        .expect("read");
    let r = String::from_utf8_lossy(&out);
    assert!(r.starts_with("HTTP/1.1 200 OK"), "{r}");
    assert!(r.contains("GET /slowly"), "{r}");
}

/// A client that closes its side has left (as nginx and hyper take it): the request in
/// hand when the close is read is dropped. Requests read before it are still answered.
#[tokio::test]
async fn a_request_read_before_the_client_closes_its_side_is_answered() {
    let gw = setup("").await;
    let mut s = TcpStream::connect(gw.addr).await.expect("connect");
    s.write_all(
        b"GET /a HTTP/1.1\r\nHost: x\r\n\r\nGET /b HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .await
    .expect("write");
    s.shutdown().await.expect("half-close");
    let mut out = Vec::new();
    bounded("answers", s.read_to_end(&mut out))
        .await
        .expect("read");
    let r = String::from_utf8_lossy(&out);
    assert!(r.starts_with("HTTP/1.1 200 OK"), "{r}");
    assert!(r.contains("GET /a"), "{r}");
}

/// A backend that answers `/early` as soon as it has the head, without reading the body,
/// and closes; anything else gets `200` with the path, its `Content-Length` body read.
async fn early_backend() -> std::net::SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = l.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let Some(head) = read_head(&mut s).await else {
                    return;
                };
                if head.starts_with("POST /early ") {
                    let _ = s
                        .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nearly")
                        .await;
                    return;
                }
                let mut head = Some(head);
                while let Some(h) = head.take() {
                    let path = h.split(' ').nth(1).unwrap_or("").to_string();
                    let answer = format!(
                        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{path}",
                        path.len()
                    );
                    if s.write_all(answer.as_bytes()).await.is_err() {
                        return;
                    }
                    head = read_request_head(&mut s).await;
                }
            });
        }
    });
    addr
}

#[tokio::test]
async fn an_answer_before_the_body_ends_keeps_the_connection_for_the_next_request() {
    let backend = early_backend().await;
    let gw = TestGateway::start(&yaml(backend, OPEN), SystemClock::new()).await;
    let body = vec![b'z'; 200_000];
    let mut s = TcpStream::connect(gw.addr).await.expect("connect");
    s.write_all(b"POST /early HTTP/1.1\r\nHost: x\r\nContent-Length: 200000\r\n\r\n")
        .await
        .expect("write");
    s.write_all(&body[..100_000]).await.expect("write");
    // The answer comes while half of the body is still to be sent, and says the
    // connection stays.
    let got = read_until(&mut s, "early", 1).await;
    assert!(got.starts_with("HTTP/1.1 200 OK"), "{got}");
    assert!(
        !got.to_ascii_lowercase().contains("connection: close"),
        "{got}"
    );
    // The rest of the body is read and dropped; the request after it is served.
    s.write_all(&body[100_000..]).await.expect("write");
    s.write_all(b"GET /next HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .expect("write");
    let got = read_until(&mut s, "/next", 1).await;
    assert!(got.starts_with("HTTP/1.1 200 OK"), "{got}");
}

#[tokio::test]
async fn a_head_request_refused_before_its_head_parses_gets_the_answer_head_alone() {
    let gw = setup("").await;
    for bad in [
        &b"HEAD /a HTTP/1.1\r\nHost: x\r\nBad Header: x\r\n\r\n"[..],
        b"\r\nHEAD /a HTTP/1.1\r\nHost: x\r\nX: \x01\r\n\r\n",
    ] {
        let r = raw(gw.addr, bad).await;
        assert_eq!(status_of(&r), 400, "{r}");
        assert!(r.contains("connection: close\r\n"), "{r}");
        assert!(r.ends_with("\r\n\r\n"), "a body after the head: {r}");
    }
    // Refused for a field once the head has parsed: the same.
    let r = raw(
        gw.addr,
        b"HEAD /a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
    )
    .await;
    assert_eq!(status_of(&r), 501, "{r}");
    assert!(r.ends_with("\r\n\r\n"), "a body after the head: {r}");
    // The same refusal to a GET carries its JSON body.
    let r = raw(
        gw.addr,
        b"GET /a HTTP/1.1\r\nHost: x\r\nBad Header: x\r\n\r\n",
    )
    .await;
    assert!(r.ends_with("}\n"), "{r}");
}

#[tokio::test]
async fn an_early_answer_with_over_a_mebibyte_of_body_to_come_says_close_and_closes() {
    let backend = early_backend().await;
    let gw = TestGateway::start(&yaml(backend, OPEN), SystemClock::new()).await;
    let mut s = TcpStream::connect(gw.addr).await.expect("connect");
    s.write_all(b"POST /early HTTP/1.1\r\nHost: x\r\nContent-Length: 3000000\r\n\r\n")
        .await
        .expect("write");
    s.write_all(&[b'z'; 100_000]).await.expect("write");
    // More than the gateway drops after an answer is still to come: the answer says the
    // connection closes, and it does, without the client sending more.
    let got = read_until(&mut s, "early", 1).await;
    assert!(got.starts_with("HTTP/1.1 200 OK"), "{got}");
    assert!(
        got.to_ascii_lowercase().contains("connection: close\r\n"),
        "{got}"
    );
    let mut rest = Vec::new();
    // The end may come as a reset: the gateway closes with the body's rest unread.
    let _ = bounded("close", s.read_to_end(&mut rest)).await;
    assert!(
        !String::from_utf8_lossy(&rest).contains("HTTP/1.1"),
        "a second answer"
    );
}

#[tokio::test]
async fn a_body_trickled_after_an_early_answer_is_dropped_within_one_body_timeout() {
    let backend = early_backend().await;
    let cfg = yaml(backend, OPEN).replace(
        "listeners: [{address: \"127.0.0.1:0\"}]",
        "listeners: [{address: \"127.0.0.1:0\", body_timeout: 1s}]",
    );
    let gw = TestGateway::start(&cfg, SystemClock::new()).await;
    let s = TcpStream::connect(gw.addr).await.expect("connect");
    s.set_nodelay(true).expect("nodelay");
    let (mut rd, mut wr) = s.into_split();
    // More than the gateway reads before it goes upstream, so that the answer comes while
    // the body is under way.
    wr.write_all(b"POST /early HTTP/1.1\r\nHost: x\r\nContent-Length: 200000\r\n\r\n")
        .await
        .expect("write");
    wr.write_all(&[b'z'; 100_000]).await.expect("write");
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&got).contains("early") {
        let n = bounded("answer", rd.read(&mut buf)).await.expect("read");
        assert!(n > 0, "closed early: {}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
    }
    // The rest comes a byte every 100 ms: each read is well within `body_timeout`, the
    // whole rest is not. The gateway closes while the trickle goes on.
    let sent = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = sent.clone();
    let trickle = tokio::spawn(async move {
        for _ in 0..100 {
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            if wr.write_all(b"z").await.is_err() {
                return;
            }
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    });
    let mut rest = Vec::new();
    let _ = bounded("close", rd.read_to_end(&mut rest)).await;
    let at_close = sent.load(std::sync::atomic::Ordering::SeqCst);
    trickle.abort();
    assert!(rest.is_empty(), "{}", String::from_utf8_lossy(&rest));
    assert!(
        at_close < 100,
        "still open after the whole trickle ({at_close} bytes)"
    );
}

#[tokio::test]
async fn a_refusal_to_a_body_held_back_for_100_continue_says_close() {
    let (backend, _) = inspect_backend().await;
    let routes = "routes:\n  - {name: get, path_prefix: /, upstream: backend, methods: [GET]}\n";
    let gw = TestGateway::start(&yaml(backend, routes), SystemClock::new()).await;
    let mut s = TcpStream::connect(gw.addr).await.expect("connect");
    s.write_all(
        b"POST /a HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 1000\r\n\r\n",
    )
    .await
    .expect("write");
    // The body may never come: no `100 Continue`, and the answer says the connection ends.
    let mut out = Vec::new();
    let _ = bounded("answer and close", s.read_to_end(&mut out)).await;
    let r = String::from_utf8_lossy(&out);
    assert_eq!(status_of(&r), 405, "{r}");
    assert!(!r.contains("100 Continue"), "{r}");
    assert!(
        r.to_ascii_lowercase().contains("connection: close\r\n"),
        "{r}"
    );
    // A client that sent its body without waiting (RFC 9110, section 10.1.1) keeps its
    // connection: the body is here whole, and the request behind it is served.
    let r = raw(
        gw.addr,
        b"POST /a HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\nhelloGET /b HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(status_of(&r), 405, "{r}");
    assert!(!r.contains("100 Continue"), "{r}");
    let (first, second) = r.split_at(r.find("HTTP/1.1 200").expect("the GET's answer"));
    assert!(
        !first.to_ascii_lowercase().contains("connection: close"),
        "{r}"
    );
    assert!(second.contains("GET /b"), "{r}");
}
