//! Framing in both directions: a client's broken body is the client's error, an upstream
//! response with two framings is framed by chunks, and a response cut short is never
//! passed on as complete.

mod common;

use common::*;
use std::sync::atomic::Ordering;
use tollgate_gateway::SystemClock;

const OPEN: &str = "routes:\n  - {path_prefix: /, upstream: backend}\n";

#[tokio::test]
async fn a_malformed_chunked_body_gets_400_and_counts_as_the_clients() {
    for buffering in ["true", "false"] {
        let (backend, _) = inspect_backend().await;
        let cfg = yaml(backend, OPEN).replace(
            "upstream: backend}",
            &format!("upstream: backend, request_buffering: {buffering}}}"),
        );
        let gw = TestGateway::start(&cfg, SystemClock::new()).await;
        let a = raw(
            gw.addr,
            b"POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nabcd\r\nzz\r\nnope\r\n0\r\n\r\n",
        )
        .await;
        assert_eq!(status_of(&a), 400, "buffering {buffering}: {a}");
        assert!(a.contains("malformed request body"), "{a}");
        let metrics = gw.gw.metrics_text();
        assert!(
            metrics.contains("tollgate_responses_total{code=\"400\"} 1"),
            "{metrics}"
        );
        assert!(!metrics.contains("code=\"502\""), "{metrics}");
    }
}

/// A backend that answers with both framings: a stale length and a chunked body.
const BOTH: &[u8] =
    b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n";

#[tokio::test]
async fn a_response_with_length_and_chunks_is_framed_by_chunks_and_its_connection_closed() {
    let (backend, conns) = raw_backend(|_| Some(BOTH.to_vec())).await;
    let gw = TestGateway::start(&yaml(backend, OPEN), SystemClock::new()).await;
    let c = TestClient::default();
    for (i, method) in [http::Method::GET, http::Method::POST, http::Method::GET]
        .into_iter()
        .enumerate()
    {
        let a = c.request(method.clone(), &gw.url("/x"), &[], "body").await;
        assert_eq!(
            (a.status.as_u16(), a.body.as_str()),
            (200, "hello"),
            "{method}"
        );
        assert_ne!(a.header("content-length"), "100", "{:?}", a.headers);
        // Never reused: each request had a connection of its own.
        assert_eq!(conns.load(Ordering::SeqCst), i + 1, "{method}");
    }
}

#[tokio::test]
async fn a_coding_other_than_chunked_alone_gets_502_at_once() {
    // Each answer's body would reach the client still coded, with its coding taken off as
    // hop-by-hop; beside a length, neither framing can be trusted. In any field order.
    let (backend, _) = raw_backend(|head| {
        let te = match head.split_whitespace().nth(1) {
            Some("/identity") => "Content-Length: 2\r\nTransfer-Encoding: identity",
            Some("/gzip") => "Transfer-Encoding: gzip\r\nContent-Length: 2",
            Some("/gzip-chunked") => "Transfer-Encoding: gzip, chunked",
            Some("/twice") => "Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked",
            _ => "Transfer-Encoding: chunked",
        };
        let body = if head.starts_with("HEAD") {
            ""
        } else {
            "2\r\nok\r\n0\r\n\r\n"
        };
        Some(format!("HTTP/1.1 200 OK\r\n{te}\r\n\r\n{body}").into_bytes())
    })
    .await;
    // The target answered well-formed heads: none of these refusals charges its health, so
    // one failure that did would take it out and leave the last request a 503.
    let health = format!("    health: {{failures: 1, backoff: 1h}}\n{OPEN}");
    let gw = TestGateway::start(&yaml(backend, &health), SystemClock::new()).await;
    for path in ["/identity", "/gzip", "/gzip-chunked", "/twice"] {
        // The backend keeps its connection open: read until close would wait for read_timeout.
        let head = format!("GET {path} HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n");
        let a = bounded("answer", raw(gw.addr, head.as_bytes())).await;
        assert_eq!(status_of(&a), 502, "{path}: {a}");
        assert!(!a.contains("ok\r\n"), "{path}: {a}");
        // A HEAD answer has no body to decode: its head is passed on.
        let head = head.replacen("GET", "HEAD", 1);
        let a = bounded("answer", raw(gw.addr, head.as_bytes())).await;
        assert_eq!(status_of(&a), 200, "HEAD {path}: {a}");
    }
    let a = bounded(
        "answer",
        raw(
            gw.addr,
            b"GET /chunked HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
        ),
    )
    .await;
    assert_eq!(status_of(&a), 200, "{a}");
    assert!(a.ends_with("ok") || a.contains("\r\nok\r\n"), "{a}");
}

#[tokio::test]
async fn a_chunk_size_with_junk_breaks_the_response_off() {
    let (backend, _) = raw_backend(|_| {
        Some(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n+5\r\nhello\r\n0\r\n\r\n"
                .to_vec(),
        )
    })
    .await;
    let gw = TestGateway::start(&yaml(backend, OPEN), SystemClock::new()).await;
    let a = raw(gw.addr, b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n").await;
    assert!(!a.contains("hello"), "{a}");
    assert!(
        !a.ends_with("0\r\n\r\n"),
        "a broken body must not end as complete: {a:?}"
    );
}

#[tokio::test]
async fn a_response_cut_short_closes_the_clients_connection() {
    for (name, answer) in [
        (
            "length",
            &b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhello"[..],
        ),
        (
            "chunked",
            &b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n"[..],
        ),
    ] {
        // The backend writes part of the answer, then closes.
        let (backend, _, _) = scripted_backend(move |_, _| (answer.to_vec(), true)).await;
        let gw = TestGateway::start(&yaml(backend, OPEN), SystemClock::new()).await;
        // A keep-alive request: the gateway must close, or the read below would not end.
        let a = raw(gw.addr, b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n").await;
        // Closed before the end: nothing at all, or a head and part of the body.
        assert!(a.is_empty() || status_of(&a) == 200, "{name}: {a}");
        let body = a.split_once("\r\n\r\n").map_or("", |(_, b)| b);
        match name {
            "length" => assert!(body.len() < 10, "{a:?}"),
            _ => assert!(!body.ends_with("0\r\n\r\n"), "{a:?}"),
        }
    }
}

#[tokio::test]
async fn a_request_is_replayed_only_when_no_response_byte_came() {
    // The first request is answered with keep-alive; the next gets half a head, then a close.
    let (backend, _, seen) = scripted_backend(|h, _| {
        if h.starts_with("GET /a ") {
            (
                b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok".to_vec(),
                false,
            )
        } else {
            (b"HTTP/1.1 200 OK\r\nConte".to_vec(), true)
        }
    })
    .await;
    let gw = TestGateway::start(&yaml(backend, OPEN), SystemClock::new()).await;
    let c = TestClient::default();
    assert_eq!(c.get(&gw.url("/a")).await.status.as_u16(), 200);
    let a = c.get(&gw.url("/b")).await;
    assert_eq!(a.status.as_u16(), 502, "{}", a.body);
    assert_eq!(seen.load(Ordering::SeqCst), 2, "sent once, never replayed");
}
