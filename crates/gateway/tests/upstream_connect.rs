//! What bounds a new upstream connection: one try per target, as nginx makes; to an
//! `https://` target, `connect_timeout` covers the TLS handshake as well as the TCP
//! connect, and a target that takes the connection but never answers the ClientHello is a
//! connect failure that moves the request on; a retry never goes back to a target the
//! request failed on.

mod common;

use common::ports::free_port;
use common::*;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tokio::net::TcpListener;
use tollgate_gateway::SystemClock;

/// A listener that accepts connections and never answers on them; counts them.
async fn silent_target() -> (std::net::SocketAddr, Arc<AtomicUsize>) {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = l.accept().await {
            count.fetch_add(1, Ordering::SeqCst);
            held.push(s);
        }
    });
    (addr, accepted)
}

/// A gateway whose one route sends everything to the one upstream `upstream` names and
/// sets (`NAME: {targets: …}`).
async fn gateway(upstream: &str) -> TestGateway {
    let name = upstream.split(':').next().unwrap_or_default();
    TestGateway::start(
        &format!(
            "listeners: [{{address: \"127.0.0.1:0\"}}]\nupstreams:\n  {upstream}\nroutes:\n  - {{path_prefix: /, upstream: {name}}}\n"
        ),
        SystemClock::new(),
    )
    .await
}

#[tokio::test]
async fn a_tls_handshake_that_never_ends_is_a_connect_failure_within_connect_timeout() {
    let (a, first) = silent_target().await;
    let (b, second) = silent_target().await;
    let g = gateway(&format!(
        "secure: {{targets: [\"https://{a}\", \"https://{b}\"], connect_timeout: 200ms, response_timeout: 60s}}"
    ))
    .await;
    let c = TestClient::default();
    // Each target takes the connection and stalls the handshake: the request moves from one
    // to the other at `connect_timeout`, then gets 504 (as a plain target's connect
    // timeout does), long before `response_timeout`.
    let answer = bounded("the answer", c.get(&g.url("/x"))).await;
    assert_eq!(
        answer.refusal(),
        r#"{"status":504,"error":"upstream timeout"}"#
    );
    assert_eq!(
        (first.load(Ordering::SeqCst), second.load(Ordering::SeqCst)),
        (1, 1),
        "both targets tried"
    );
}

#[tokio::test]
async fn a_lone_target_that_cannot_be_reached_is_tried_once() {
    // A port nothing listens on: every connect is refused at once.
    let port = free_port();
    let g = gateway(&format!("gone: {{targets: [\"127.0.0.1:{port}\"]}}")).await;
    let c = TestClient::default();
    let a = c.get(&g.url("/x")).await;
    assert_eq!(a.status, 502, "{}", a.body);
    let metrics = g.gw.metrics_text();
    let line = |name: &str| {
        metrics
            .lines()
            .find(|l| l.starts_with(name) && l.contains("upstream=\"gone\""))
            .map(str::to_string)
    };
    assert_eq!(
        line("tollgate_upstream_connect_errors_total").as_deref(),
        Some("tollgate_upstream_connect_errors_total{upstream=\"gone\"} 1"),
        "{metrics}"
    );
}

/// A retry goes to a target the request has not failed on, whatever other requests took
/// from the round-robin meanwhile: a target that drops its connections is tried once.
#[tokio::test]
async fn a_retry_skips_the_targets_the_request_failed_on() {
    // Holds its first connection, read, until told; drops it and every later one.
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let dropping = l.local_addr().expect("addr");
    let accepted = Arc::new(AtomicUsize::new(0));
    let (release, released) = tokio::sync::oneshot::channel::<()>();
    let (read, was_read) = tokio::sync::oneshot::channel::<()>();
    let count = accepted.clone();
    tokio::spawn(async move {
        let mut signals = Some((released, read));
        while let Ok((mut s, _)) = l.accept().await {
            count.fetch_add(1, Ordering::SeqCst);
            if let Some((released, read)) = signals.take() {
                let mut buf = vec![0u8; 4096];
                let mut got = Vec::new();
                while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                    match tokio::io::AsyncReadExt::read(&mut s, &mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    }
                }
                let _ = read.send(());
                let _ = released.await;
            }
        }
    });
    let (good, _) = recording_backend().await;
    let g = gateway(&format!("two: {{targets: [\"{dropping}\", \"{good}\"]}}")).await;
    let c = TestClient::default();
    // The first request takes the first target, which holds it; a second request takes
    // the second target meanwhile, so the round-robin would give the first's retry the
    // first target again.
    let first = tokio::spawn({
        let c = c.clone();
        let url = g.url("/one");
        async move { c.get(&url).await }
    });
    bounded("the first target reads", was_read)
        .await
        .expect("read");
    assert_eq!(c.get(&g.url("/two")).await.status, 200);
    let _ = release.send(());
    let a = bounded("the first answer", first).await.expect("first");
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        1,
        "the failed target tried once"
    );
}
