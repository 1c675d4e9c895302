//! WebSocket upgrades through the gateway, upstream health (passive and active), and
//! upstreams over HTTPS and HTTP/2 (trailers kept), over loopback.

mod common;

use bytes::Bytes;
use common::tls::TestCa;
use common::*;
use futures_util::{SinkExt, StreamExt};
use http::{Request, Response};
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tokio::net::{TcpListener, TcpStream};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message;
use tollgate_gateway::SystemClock;

/// A WebSocket backend that echoes each message with `echo: ` in front.
async fn ws_backend() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            tokio::spawn(async move {
                let Ok(mut ws) = tokio_tungstenite::accept_async(s).await else {
                    return;
                };
                while let Some(Ok(m)) = ws.next().await {
                    if let Message::Text(t) = m {
                        if ws.send(Message::text(format!("echo: {t}"))).await.is_err() {
                            return;
                        }
                    }
                }
            });
        }
    });
    addr
}

#[tokio::test]
async fn websocket_upgrades_pass_policies_once_then_join_both_ways() {
    let backend = ws_backend().await;
    let y = yaml(
        backend,
        "consumers:\n  - {name: alice, keys: [k-alice]}\nroutes:\n  - {name: chat, path_prefix: /ws/, upstream: backend, websocket: true, auth: {header: [x-api-key]}, limits: [{requests: 2, per: 1m}]}\n  - {name: plain, path_prefix: /plain/, upstream: backend}\n",
    );
    let g = TestGateway::start(&y, SystemClock::new()).await;
    let url = format!("ws://{}/ws/room", g.addr);

    let mut req = url.as_str().into_client_request().expect("request");
    req.headers_mut()
        .insert("x-api-key", "k-alice".parse().expect("value"));
    let (mut ws, resp) = bounded("ws connect", tokio_tungstenite::connect_async(req))
        .await
        .expect("upgrade through the gateway");
    assert_eq!(resp.status(), 101);
    assert!(
        resp.headers().contains_key("ratelimit"),
        "{:?}",
        resp.headers()
    );
    for i in 0..5 {
        ws.send(Message::text(format!("m{i}"))).await.expect("send");
        let got = bounded("ws echo", ws.next())
            .await
            .expect("open")
            .expect("message");
        assert_eq!(got, Message::text(format!("echo: m{i}")));
    }
    // Five messages on one connection counted once: one more upgrade is allowed, not two.
    let mut req = url.as_str().into_client_request().expect("request");
    req.headers_mut()
        .insert("x-api-key", "k-alice".parse().expect("value"));
    bounded("second ws", tokio_tungstenite::connect_async(req))
        .await
        .expect("second upgrade");
    let mut req = url.as_str().into_client_request().expect("request");
    req.headers_mut()
        .insert("x-api-key", "k-alice".parse().expect("value"));
    match bounded("third ws", tokio_tungstenite::connect_async(req)).await {
        Err(tokio_tungstenite::tungstenite::Error::Http(r)) => assert_eq!(r.status(), 429),
        other => panic!("a third upgrade past the limit: {other:?}"),
    }
    // Without a key, refused before any upstream connection.
    match bounded("keyless ws", tokio_tungstenite::connect_async(url.as_str())).await {
        Err(tokio_tungstenite::tungstenite::Error::Http(r)) => assert_eq!(r.status(), 401),
        other => panic!("an upgrade without a key: {other:?}"),
    }
    // A route without `websocket: true` does not pass the upgrade on.
    let plain = format!("ws://{}/plain/x", g.addr);
    assert!(
        bounded("plain ws", tokio_tungstenite::connect_async(plain.as_str()))
            .await
            .is_err(),
        "an upgrade passed on a route without websocket"
    );
    ws.close(None).await.expect("close");
    let metrics = metrics_with(&g.gw, "tollgate_upgrades_total 2").await;
    assert!(metrics.contains("tollgate_upgrades_total 2"), "{metrics}");
}

/// A backend that answers an upgrade with 101, then sends `n` bytes while it reads (and
/// drops) whatever comes.
async fn raw_stream_upgrade_backend(n: usize) -> SocketAddr {
    use tokio::io::AsyncWriteExt;
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                if read_head(&mut s).await.is_none() {
                    return;
                }
                let answer = "HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\nUpgrade: raw\r\n\r\n";
                if s.write_all(answer.as_bytes()).await.is_err() {
                    return;
                }
                let (mut r, mut w) = s.into_split();
                tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut r, &mut tokio::io::sink()).await;
                });
                let chunk = vec![9u8; 1 << 20];
                for _ in 0..n >> 20 {
                    if w.write_all(&chunk).await.is_err() {
                        return;
                    }
                }
                let _ = w.shutdown().await;
            });
        }
    });
    addr
}

/// A backend that answers every request with `answer`, then echoes what comes.
async fn fixed_answer_backend(answer: &'static str) -> SocketAddr {
    use tokio::io::AsyncWriteExt;
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                if read_head(&mut s).await.is_none() {
                    return;
                }
                if s.write_all(answer.as_bytes()).await.is_err() {
                    return;
                }
                let (mut r, mut w) = s.into_split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    addr
}

/// Asks for a WebSocket upgrade through a gateway whose backend answers `answer`: the
/// gateway (kept alive), the client's connection and the head it got.
async fn upgrade_answered_by(answer: &'static str) -> (TestGateway, TcpStream, String) {
    use tokio::io::AsyncWriteExt;
    let backend = fixed_answer_backend(answer).await;
    let y = yaml(
        backend,
        "routes:\n  - {name: raw, path_prefix: /ws/, upstream: backend, websocket: true}\n",
    );
    let g = TestGateway::start(&y, SystemClock::new()).await;
    let mut c = TcpStream::connect(g.addr).await.expect("connect");
    c.write_all(
        b"GET /ws/x HTTP/1.1\r\nHost: a\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\r\n",
    )
    .await
    .expect("write");
    let head = bounded("answer", read_head(&mut c)).await.expect("read");
    (g, c, head)
}

#[tokio::test]
async fn a_101_that_does_not_name_the_protocol_asked_for_is_not_joined() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    for answer in [
        "HTTP/1.1 101 Switching Protocols\r\n\r\n",
        "HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\nUpgrade: h2c\r\n\r\n",
    ] {
        let (_g, mut c, head) = upgrade_answered_by(answer).await;
        assert!(head.starts_with("HTTP/1.1 502"), "{answer:?}: {head:?}");
        // Not a tunnel: a request sent now is read as HTTP by the gateway, not echoed back by
        // the backend.
        c.write_all(b"GET /nowhere HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
            .await
            .expect("write");
        let mut rest = Vec::new();
        bounded("rest", c.read_to_end(&mut rest))
            .await
            .expect("read");
        let rest = String::from_utf8_lossy(&rest);
        assert!(
            !rest.contains("GET /nowhere"),
            "{answer:?}: tunnelled: {rest}"
        );
    }
    // The same route joins a 101 that names the protocol asked for, in any case.
    let (_g, mut c, head) = upgrade_answered_by(
        "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: WebSocket\r\n\r\n",
    )
    .await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head:?}");
    c.write_all(b"ping").await.expect("write");
    let mut got = [0u8; 4];
    bounded("echo", c.read_exact(&mut got)).await.expect("read");
    assert_eq!(&got, b"ping");
}

#[tokio::test]
async fn a_declined_upgrade_is_held_to_the_same_transfer_codings() {
    // Declined with an ordinary answer whose body is still gzip-coded: taking off its
    // `Transfer-Encoding` would hand the client coded bytes labelled as plain.
    let (_g, _c, head) = upgrade_answered_by(
        "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
    )
    .await;
    assert!(head.starts_with("HTTP/1.1 502"), "{head:?}");
    let (_g, _c, head) = upgrade_answered_by(
        "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
    )
    .await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head:?}");
}

#[tokio::test]
async fn a_joined_connection_carries_both_ways_while_one_side_does_not_read() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // More than the socket buffers on the way hold, each way.
    const N: usize = 64 << 20;
    let backend = raw_stream_upgrade_backend(N).await;
    let y = yaml(
        backend,
        "routes:\n  - {name: raw, path_prefix: /raw/, upstream: backend, websocket: true}\n",
    );
    let g = TestGateway::start(&y, SystemClock::new()).await;
    let mut c = TcpStream::connect(g.addr).await.expect("connect");
    c.write_all(b"GET /raw/x HTTP/1.1\r\nHost: a\r\nConnection: upgrade\r\nUpgrade: raw\r\n\r\n")
        .await
        .expect("write");
    let head = bounded("101", read_head(&mut c)).await.expect("read");
    assert!(head.starts_with("HTTP/1.1 101"), "{head:?}");
    // The client sends all it has before it reads: the backend's stream must wait at the
    // client while the upload goes on.
    let (mut r, mut w) = c.into_split();
    bounded("upload while the download waits", async {
        let chunk = vec![7u8; 1 << 20];
        for _ in 0..N >> 20 {
            w.write_all(&chunk).await.expect("upload");
        }
    })
    .await;
    let mut got = 0;
    let mut buf = vec![0u8; 1 << 20];
    bounded("download read", async {
        loop {
            let n = r.read(&mut buf).await.expect("read");
            if n == 0 {
                break;
            }
            got += n;
        }
    })
    .await;
    assert_eq!(got, N);
}

/// A backend answering `status` to every request (and to `/health`), counting requests.
async fn status_backend(status: Arc<AtomicUsize>) -> (SocketAddr, Arc<AtomicUsize>) {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    let hits = Arc::new(AtomicUsize::new(0));
    let h = hits.clone();
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            let (status, h) = (status.clone(), h.clone());
            tokio::spawn(async move {
                let svc = service_fn(move |req: Request<Incoming>| {
                    if req.uri().path() != "/health" {
                        h.fetch_add(1, Ordering::Relaxed);
                    }
                    let code = status.load(Ordering::Relaxed) as u16;
                    async move {
                        let mut r = Response::new(Full::new(Bytes::from_static(b"ok")));
                        *r.status_mut() = http::StatusCode::from_u16(code).expect("status");
                        Ok::<_, Infallible>(r)
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(s), svc)
                    .await;
            });
        }
    });
    (addr, hits)
}

/// The `upstream_target_healthy` gauge of `target` in the upstream `backend`.
fn healthy_gauge(metrics: &str, target: SocketAddr) -> Option<i64> {
    metrics
        .lines()
        .find(|l| {
            l.starts_with("tollgate_upstream_target_healthy{")
                && l.contains("upstream=\"backend\"")
                && l.contains(&format!("target=\"{target}\""))
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[tokio::test]
async fn passive_checks_take_failing_targets_out_but_never_the_last() {
    let good_status = Arc::new(AtomicUsize::new(200));
    let bad_status = Arc::new(AtomicUsize::new(500));
    let (good, good_hits) = status_backend(good_status.clone()).await;
    let (bad, bad_hits) = status_backend(bad_status.clone()).await;
    let dead = closed_port().await;
    let (failing, failing_hits) = status_backend(Arc::new(AtomicUsize::new(503))).await;
    let y = format!(
        "listeners: [{{address: \"127.0.0.1:0\"}}]\nupstreams:\n  backend: {{targets: [\"{good}\", \"{bad}\", \"{dead}\"], health: {{failures: 2, backoff: 1h}}}}\n  gone: {{targets: [\"{dead}\"], health: {{failures: 1, backoff: 1h}}}}\n  pair: {{targets: [\"{dead}\", \"{failing}\"], health: {{failures: 1, backoff: 1h}}}}\nroutes:\n  - {{path_prefix: /gone, upstream: gone}}\n  - {{path_prefix: /pair, upstream: pair}}\n  - {{path_prefix: /, upstream: backend}}\n"
    );
    let g = TestGateway::start(&y, SystemClock::new()).await;
    let c = TestClient::default();
    for _ in 0..12 {
        c.get(&g.url("/x")).await;
    }
    let bad_before = bad_hits.load(Ordering::Relaxed);
    assert_eq!(
        bad_before, 2,
        "the 5xx target kept getting requests after 2 failures"
    );
    let good_before = good_hits.load(Ordering::Relaxed);
    for _ in 0..10 {
        assert_eq!(c.get(&g.url("/x")).await.status, 200);
    }
    assert_eq!(bad_hits.load(Ordering::Relaxed), bad_before);
    assert_eq!(good_hits.load(Ordering::Relaxed), good_before + 10);
    let m = g.gw.metrics_text();
    assert_eq!(healthy_gauge(&m, good), Some(1), "{m}");
    assert_eq!(healthy_gauge(&m, bad), Some(0), "{m}");
    assert_eq!(healthy_gauge(&m, dead), Some(0), "{m}");
    let admin = start_admin(&g.gw, None).await;
    let status = c.get(&format!("http://{admin}/status")).await;
    let v: serde_json::Value = serde_json::from_str(&status.body).expect("status JSON");
    let states: Vec<(String, bool)> = v["upstreams"]["backend"]
        .as_array()
        .expect("backend's targets")
        .iter()
        .map(|t| {
            (
                t["target"].as_str().unwrap_or("").to_string(),
                t["healthy"] == true,
            )
        })
        .collect();
    assert_eq!(
        states,
        [
            (good.to_string(), true),
            (bad.to_string(), false),
            (dead.to_string(), false)
        ]
    );

    // Passive checks alone never leave an upstream without targets: its lone target,
    // taken out, is tried all the same (as nginx never takes a lone server out).
    for _ in 0..3 {
        let a = c.get(&g.url("/gone")).await;
        assert_eq!(a.status, 502, "{}", a.body);
    }
    // Nor the 5xx target of an upstream whose every target is out: brought back by its
    // first success.
    bad_status.store(200, Ordering::Relaxed);
    good_status.store(500, Ordering::Relaxed);
    for _ in 0..4 {
        c.get(&g.url("/x")).await;
    }
    assert_eq!(healthy_gauge(&g.gw.metrics_text(), good), Some(0));
    assert_eq!(c.get(&g.url("/x")).await.status, 200);
    let m = g.gw.metrics_text();
    assert_eq!(healthy_gauge(&m, bad), Some(1), "{m}");

    // With every target out, a request whose target refuses its connection moves on to
    // the next, as any retry does (nginx's `proxy_next_upstream`): each answer is the
    // failing target's own 503, never the refused connection's 502.
    for i in 0..6 {
        let a = c.get(&g.url("/pair")).await;
        assert_eq!(
            (a.status.as_u16(), a.body.as_str()),
            (503, "ok"),
            "request {i}"
        );
    }
    assert_eq!(failing_hits.load(Ordering::Relaxed), 6);
}

#[tokio::test]
async fn active_checks_take_a_target_out_and_bring_it_back() {
    let a_status = Arc::new(AtomicUsize::new(200));
    let b_status = Arc::new(AtomicUsize::new(200));
    let (a, a_hits) = status_backend(a_status).await;
    let (b, b_hits) = status_backend(b_status.clone()).await;
    let y = format!(
        "listeners: [{{address: \"127.0.0.1:0\"}}]\nupstreams:\n  backend: {{targets: [\"{a}\", \"{b}\"], health: {{path: /health, interval: 50ms, timeout: 1s, healthy: 2, unhealthy: 2, failures: 0}}}}\nroutes:\n  - {{path_prefix: /, upstream: backend}}\n"
    );
    let g = TestGateway::start(&y, SystemClock::new()).await;
    let wait_for = |want: i64| {
        let gw = g.gw.clone();
        async move {
            bounded("health gauge", async {
                let mut tick = tokio::time::interval(std::time::Duration::from_millis(20));
                loop {
                    tick.tick().await;
                    if healthy_gauge(&gw.metrics_text(), b) == Some(want) {
                        return;
                    }
                }
            })
            .await
        }
    };
    b_status.store(503, Ordering::Relaxed);
    wait_for(0).await;
    let (a0, b0) = (
        a_hits.load(Ordering::Relaxed),
        b_hits.load(Ordering::Relaxed),
    );
    let c = TestClient::default();
    for _ in 0..6 {
        assert_eq!(c.get(&g.url("/x")).await.status, 200);
    }
    assert_eq!(
        b_hits.load(Ordering::Relaxed),
        b0,
        "a target failing its checks got requests"
    );
    assert_eq!(a_hits.load(Ordering::Relaxed), a0 + 6);
    b_status.store(200, Ordering::Relaxed);
    wait_for(1).await;
    for _ in 0..6 {
        c.get(&g.url("/x")).await;
    }
    assert!(
        b_hits.load(Ordering::Relaxed) > b0,
        "a target back in health got no requests"
    );
}

/// An HTTPS backend with `leaf`'s certificate, HTTP/1.1 and h2 by ALPN, answering with its
/// protocol version and the Host it saw; on `/coded`, under `Transfer-Encoding: gzip`
/// (which its HTTP/1.1 server sends as `gzip, chunked`).
async fn https_backend(leaf: &common::tls::Leaf) -> SocketAddr {
    https_backend_counted(leaf).await.0
}

/// [`https_backend`], with the count of connections it accepted.
async fn https_backend_counted(leaf: &common::tls::Leaf) -> (SocketAddr, Arc<AtomicUsize>) {
    let accepted = Arc::new(AtomicUsize::new(0));
    let counter = accepted.clone();
    let mut cfg = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("versions")
    .with_no_client_auth()
    .with_single_cert(vec![leaf.der.clone()], leaf.key_der.clone_key())
    .expect("cert");
    cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(cfg));
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            counter.fetch_add(1, Ordering::SeqCst);
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(s) = acceptor.accept(s).await else {
                    return;
                };
                let svc = service_fn(|req: Request<Incoming>| async move {
                    let host = req
                        .headers()
                        .get("host")
                        .map(|h| h.to_str().unwrap_or("").to_string())
                        .or_else(|| req.uri().authority().map(|a| a.to_string()))
                        .unwrap_or_default();
                    let body = format!("{:?} {host}", req.version());
                    let mut resp = Response::new(Full::new(Bytes::from(body)));
                    // What HTTP/2's `:authority` asked for, when it did.
                    if let Some(a) = req.uri().authority() {
                        if let Ok(v) = http::HeaderValue::from_str(a.as_str()) {
                            resp.headers_mut().insert("x-authority", v);
                        }
                    }
                    if req.uri().path() == "/coded" && req.version() == http::Version::HTTP_11 {
                        resp.headers_mut()
                            .insert("transfer-encoding", http::HeaderValue::from_static("gzip"));
                    }
                    Ok::<_, Infallible>(resp)
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(s), svc)
                    .await;
            });
        }
    });
    (addr, accepted)
}

#[tokio::test]
async fn https_upstreams_are_verified_against_their_ca() {
    let dir = tempdir("https-up");
    let ca = TestCa::new(&dir, "ca");
    let leaf = ca.server("backend", &["localhost"]);
    let backend = https_backend(&leaf).await;
    let target = format!("https://localhost:{}", backend.port());
    let y = |extra: &str| {
        format!(
            "listeners: [{{address: \"127.0.0.1:0\"}}]\nupstreams:\n  secure: {{targets: [\"{target}\"]{extra}}}\nroutes:\n  - {{path_prefix: /, upstream: secure}}\n"
        )
    };
    let g = TestGateway::start(
        &y(&format!(", ca_file: \"{}\"", ca.pem.display())),
        SystemClock::new(),
    )
    .await;
    let c = TestClient::default();
    let a = c.get(&g.url("/x")).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(a.body, format!("HTTP/1.1 localhost:{}", backend.port()));
    let g2 = TestGateway::start(
        &y(&format!(
            ", ca_file: \"{}\", protocol: h2",
            ca.pem.display()
        )),
        SystemClock::new(),
    )
    .await;
    let a = c.get(&g2.url("/x")).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert!(a.body.starts_with("HTTP/2.0 localhost:"), "{}", a.body);
    // A body under a coding the gateway would take off unsaid is not passed on.
    let a = c.get(&g.url("/coded")).await;
    assert_eq!(a.status, 502, "{:?} {}", a.headers, a.body);
    assert_eq!(c.get(&g.url("/x")).await.status, 200);
    // Without the CA, the system's roots do not know the backend's certificate: the
    // answer says it was the TLS handshake, not a refused connection.
    let g3 = TestGateway::start(&y(""), SystemClock::new()).await;
    let a = c.get(&g3.url("/x")).await;
    assert_eq!(
        a.refusal(),
        r#"{"status":502,"error":"bad gateway","detail":"TLS handshake with the target failed"}"#
    );
}

/// A route that keeps the client's `Host` still connects to its own target, over HTTPS
/// and HTTP/2 alike: the `Host` (HTTP/2's `:authority`) is what the target is asked for,
/// never where the gateway connects, so a client cannot point it at another address.
#[tokio::test]
async fn a_preserved_host_is_what_the_target_is_asked_for_never_where_the_gateway_connects() {
    let dir = tempdir("preserve-up");
    let ca = TestCa::new(&dir, "ca");
    let leaf = ca.server("backend", &["localhost"]);
    let backend = https_backend(&leaf).await;
    // Where a `Host` would lead a gateway that connected to it: it answers anything.
    let (elsewhere, _) =
        raw_backend(|_| Some(b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\nelsewhere".to_vec()))
            .await;
    // The gateway's config for `protocol` to the backend on `port`, with `more` settings.
    let config = |port: u16, protocol: &str, more: &str| {
        format!(
            "listeners: [{{address: \"127.0.0.1:0\"}}]\nupstreams:\n  secure: {{targets: [\"https://localhost:{port}\"], ca_file: \"{}\", protocol: {protocol}{more}}}\nroutes:\n  - {{path_prefix: /, upstream: secure, preserve_host: true}}\n",
            ca.pem.display()
        )
    };
    let ask = |addr, host: &str| {
        let head = format!("GET /x HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
        async move { raw(addr, head.as_bytes()).await }
    };
    for (protocol, version) in [("http1", "HTTP/1.1"), ("h2", "HTTP/2.0")] {
        let g = TestGateway::start(&config(backend.port(), protocol, ""), SystemClock::new()).await;
        let a = ask(g.addr, &elsewhere.to_string()).await;
        assert_eq!(status_of(&a), 200, "{protocol}: {a}");
        assert!(
            a.ends_with(&format!("\r\n\r\n{version} {elsewhere}")),
            "{protocol}: the target was not asked for the client's Host: {a}"
        );
    }
    // Over HTTP/2 each host asked for has connections of its own, up to 64 hosts; past
    // them, a request asks for the target's authority and keeps its `Host` as a header
    // (this backend reads `Host` first), so naming hosts opens no more connections.
    let (backend, accepted) = https_backend_counted(&leaf).await;
    let g = TestGateway::start(&config(backend.port(), "h2", ""), SystemClock::new()).await;
    for n in 0..70 {
        let host = format!("h{n}.example");
        let a = ask(g.addr, &host).await;
        assert_eq!(status_of(&a), 200, "{n}: {a}");
        assert!(a.ends_with(&format!("HTTP/2.0 {host}")), "{n}: {a}");
        let own = a.contains(&format!("x-authority: {host}\r\n"));
        assert_eq!(own, n < 64, "{n}: {a}");
    }
    // 64 hosts' connections, and one for the target's authority.
    assert_eq!(accepted.load(Ordering::SeqCst), 65);
    // A host a route names exactly keeps its own connections however many hosts clients
    // made up first: they cannot push it to the target's authority.
    let named = format!(
        "{}  - {{host: api.test, path_prefix: /, upstream: secure, preserve_host: true}}\n",
        config(backend.port(), "h2", "")
    );
    let g = TestGateway::start(&named, SystemClock::new()).await;
    for n in 0..64 {
        assert_eq!(status_of(&ask(g.addr, &format!("m{n}.example")).await), 200);
    }
    let late = ask(g.addr, "late.example").await;
    assert!(
        !late.contains("x-authority: late.example\r\n"),
        "full: {late}"
    );
    let a = ask(g.addr, "api.test").await;
    assert!(a.contains("x-authority: api.test\r\n"), "{a}");
    // A host is kept apart only while its connections live: once they have been idle
    // for `idle_timeout` and closed, a new host has room again, so a burst of made-up
    // hosts does not decide for good how later clients are asked for.
    let g = TestGateway::start(
        &config(backend.port(), "h2", ", idle_timeout: 100ms"),
        SystemClock::new(),
    )
    .await;
    for n in 0..64 {
        assert_eq!(status_of(&ask(g.addr, &format!("b{n}.example")).await), 200);
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let mut n = 0;
    loop {
        let host = format!("later{n}.example");
        let a = ask(g.addr, &host).await;
        assert_eq!(status_of(&a), 200, "{a}");
        if a.contains(&format!("x-authority: {host}\r\n")) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no room for a new host after the first 64 went idle: {a}"
        );
        n += 1;
    }
}

/// A cleartext HTTP/2 backend on loopback answering every request with `answer`.
async fn h2c_backend<F, Fut, B>(answer: F) -> SocketAddr
where
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<Response<B>, Infallible>> + Send + 'static,
    B: hyper::body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    h2c_backend_of(answer, None).await
}

/// [`h2c_backend`], allowing each connection `max_streams` streams at once when given.
async fn h2c_backend_of<F, Fut, B>(answer: F, max_streams: Option<u32>) -> SocketAddr
where
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<Response<B>, Infallible>> + Send + 'static,
    B: hyper::body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            let svc = service_fn(answer.clone());
            tokio::spawn(async move {
                let mut b = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
                if let Some(n) = max_streams {
                    b.max_concurrent_streams(n);
                }
                let _ = b.serve_connection(TokioIo::new(s), svc).await;
            });
        }
    });
    addr
}

/// An HTTP/2 (prior knowledge) client connection to `addr`.
async fn h2c_client<B>(addr: SocketAddr) -> hyper::client::conn::http2::SendRequest<B>
where
    B: hyper::body::Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let io = TokioIo::new(TcpStream::connect(addr).await.expect("connect"));
    let (tx, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
        .await
        .expect("h2");
    tokio::spawn(conn);
    tx
}

#[tokio::test]
async fn h2_upstreams_pass_grpc_trailers_through() {
    // A cleartext HTTP/2 backend that answers with a body and gRPC trailers.
    let backend = h2c_backend(|req: Request<Incoming>| async move {
        let te = req.headers().get("te").cloned();
        let (tx, body) = http_body_util::channel::Channel::<Bytes, Infallible>::new(4);
        let mut tx = tx;
        tokio::spawn(async move {
            let _ = tx.send_data(Bytes::from_static(b"\0\0\0\0\x02hi")).await;
            let mut t = http::HeaderMap::new();
            t.insert("grpc-status", "0".parse().expect("v"));
            t.insert("grpc-message", "fine".parse().expect("v"));
            let _ = tx.send_trailers(t).await;
        });
        let mut r = Response::new(body);
        r.headers_mut()
            .insert("content-type", "application/grpc".parse().expect("v"));
        if let Some(te) = te {
            r.headers_mut().insert("x-saw-te", te);
        }
        Ok::<_, Infallible>(r)
    })
    .await;
    let y = format!(
        "listeners: [{{address: \"127.0.0.1:0\", h2c: true}}]\nupstreams:\n  grpc: {{targets: [\"{backend}\"], protocol: h2}}\nroutes:\n  - {{path_prefix: /, upstream: grpc}}\n"
    );
    let g = TestGateway::start(&y, SystemClock::new()).await;
    let mut tx = h2c_client(g.addr).await;
    let req = Request::builder()
        .method("POST")
        .uri("http://api.test/pkg.Service/Call")
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(Empty::<Bytes>::new())
        .expect("req");
    let resp = bounded("grpc call", tx.send_request(req))
        .await
        .expect("response");
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.headers().get("x-saw-te").map(|v| v.as_bytes()),
        Some(&b"trailers"[..])
    );
    let collected = resp.into_body().collect().await.expect("body");
    let trailers = collected
        .trailers()
        .cloned()
        .expect("trailers reached the client");
    assert_eq!(
        trailers.get("grpc-status").map(|v| v.as_bytes()),
        Some(&b"0"[..])
    );
    assert_eq!(
        trailers.get("grpc-message").map(|v| v.as_bytes()),
        Some(&b"fine"[..])
    );
    assert_eq!(&collected.to_bytes()[..], b"\0\0\0\0\x02hi");
}

#[tokio::test]
async fn a_streamed_bodys_trailers_do_not_reach_an_h2_upstream() {
    // An HTTP/2 backend that says whether the request's body came with trailers.
    let backend = h2c_backend(|req: Request<Incoming>| async move {
        let got = req.into_body().collect().await;
        let (trailers, bytes) = match got {
            Ok(c) => (c.trailers().cloned(), c.to_bytes()),
            Err(_) => (None, Bytes::new()),
        };
        let mut r = Response::new(Full::new(bytes));
        let saw = if trailers.is_some() { "yes" } else { "no" };
        r.headers_mut()
            .insert("x-saw-trailers", saw.parse().expect("v"));
        Ok::<_, Infallible>(r)
    })
    .await;
    let y = format!(
        "listeners: [{{address: \"127.0.0.1:0\", h2c: true}}]\nupstreams:\n  up: {{targets: [\"{backend}\"], protocol: h2}}\nroutes:\n  - {{path_prefix: /, upstream: up, request_buffering: false}}\n"
    );
    let g = TestGateway::start(&y, SystemClock::new()).await;
    let mut tx = h2c_client(g.addr).await;
    let (mut body_tx, body) = http_body_util::channel::Channel::<Bytes, Infallible>::new(4);
    tokio::spawn(async move {
        let _ = body_tx.send_data(Bytes::from_static(b"payload")).await;
        let mut t = http::HeaderMap::new();
        t.insert("x-consumer-id", "forged".parse().expect("v"));
        t.insert(
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
                .parse()
                .expect("v"),
        );
        let _ = body_tx.send_trailers(t).await;
    });
    let req = Request::builder()
        .method("POST")
        .uri("http://api.test/upload")
        .body(body)
        .expect("req");
    let resp = bounded("upload", tx.send_request(req))
        .await
        .expect("response");
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.headers().get("x-saw-trailers").map(|v| v.as_bytes()),
        Some(&b"no"[..]),
        "the client's trailers stay at the edge"
    );
    let got = resp.into_body().collect().await.expect("body").to_bytes();
    assert_eq!(&got[..], b"payload", "the body itself goes whole");
}

#[tokio::test]
async fn an_upgraded_connection_keeps_its_place_under_max_connections() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let backend = ws_backend().await;
    let y = yaml(
        backend,
        "routes:\n  - {path_prefix: /ws/, upstream: backend, websocket: true}\n",
    )
    .replace(
        "listeners: [{address: \"127.0.0.1:0\"}]",
        "listeners: [{address: \"127.0.0.1:0\", max_connections: 1}]",
    );
    let g = TestGateway::start(&y, SystemClock::new()).await;
    let url = format!("ws://{}/ws/room", g.addr);
    let (mut ws, _) = bounded("ws connect", tokio_tungstenite::connect_async(url.as_str()))
        .await
        .expect("upgrade");
    ws.send(Message::text("hi")).await.expect("send");
    assert_eq!(
        bounded("echo", ws.next())
            .await
            .expect("open")
            .expect("message"),
        Message::text("echo: hi")
    );
    // The joined connection is the one the listener allows: another waits in the backlog.
    let mut other = TcpStream::connect(g.addr).await.expect("connect (backlog)");
    other
        .write_all(b"GET /ws/x HTTP/1.1\r\nHost: a\r\n\r\n")
        .await
        .expect("write");
    let mut buf = [0u8; 12];
    let early = tokio::time::timeout(
        std::time::Duration::from_millis(300),
        other.read_exact(&mut buf),
    )
    .await;
    assert!(
        early.is_err(),
        "a connection was served over the cap while an upgrade was open"
    );
    ws.close(None).await.expect("close");
    drop(ws);
    bounded("served once the upgrade closed", other.read_exact(&mut buf))
        .await
        .expect("answer");
    assert!(buf.starts_with(b"HTTP/1.1 "), "{buf:?}");
}

#[tokio::test]
async fn clients_that_do_not_read_cannot_stall_an_h2_upstream_connection_for_the_others() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // Large answers on `/big`, a small one elsewhere, all over one HTTP/2 connection.
    let backend = h2c_backend(|req: Request<Incoming>| async move {
        let body = if req.uri().path() == "/big" {
            Bytes::from(vec![b'x'; 8 << 20])
        } else {
            Bytes::from_static(b"ok")
        };
        Ok::<_, Infallible>(Response::new(Full::new(body)))
    })
    .await;
    let y = format!(
        "listeners: [{{address: \"127.0.0.1:0\"}}]\nupstreams:\n  up: {{targets: [\"{backend}\"], protocol: h2}}\nroutes:\n  - {{path_prefix: /, upstream: up}}\n"
    );
    let g = TestGateway::start(&y, SystemClock::new()).await;
    // Four clients ask for 8 MiB each and read no more than the head: each holds what its
    // stream's window let through, and no more.
    let mut stalled = Vec::new();
    for _ in 0..4 {
        let mut s = TcpStream::connect(g.addr).await.expect("connect");
        s.write_all(b"GET /big HTTP/1.1\r\nHost: t\r\n\r\n")
            .await
            .expect("write");
        let mut head = [0u8; 12];
        bounded("the head of a large answer", s.read_exact(&mut head))
            .await
            .expect("head");
        assert_eq!(&head, b"HTTP/1.1 200");
        stalled.push(s);
    }
    // Another client's request on the same upstream connection is answered meanwhile.
    let c = TestClient::default();
    let r = bounded(
        "a small answer beside stalled streams",
        c.get(&g.url("/small")),
    )
    .await;
    assert_eq!((r.status.as_u16(), r.body.as_str()), (200, "ok"));
    drop(stalled);
}

#[tokio::test]
async fn streams_past_what_one_h2_upstream_connection_takes_go_on_another() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // An upstream that takes 4 streams a connection; `/big` is larger than what the
    // client sockets and the streams' windows hold.
    let big = Bytes::from(vec![b'x'; 8 << 20]);
    let backend = h2c_backend_of(
        move |req: Request<Incoming>| {
            let body = if req.uri().path() == "/big" {
                big.clone()
            } else {
                Bytes::from_static(b"ok")
            };
            async move { Ok::<_, Infallible>(Response::new(Full::new(body))) }
        },
        Some(4),
    )
    .await;
    let y = format!(
        "listeners: [{{address: \"127.0.0.1:0\"}}]\nupstreams:\n  up: {{targets: [\"{backend}\"], protocol: h2, max_concurrent_streams: 4}}\nroutes:\n  - {{path_prefix: /, upstream: up}}\n"
    );
    let g = TestGateway::start(&y, SystemClock::new()).await;
    // Four clients that read no more than the head take every stream of a connection.
    let mut stalled = Vec::new();
    for _ in 0..4 {
        let mut s = TcpStream::connect(g.addr).await.expect("connect");
        s.write_all(b"GET /big HTTP/1.1\r\nHost: t\r\n\r\n")
            .await
            .expect("write");
        let mut head = [0u8; 12];
        bounded("the head of a large answer", s.read_exact(&mut head))
            .await
            .expect("head");
        assert_eq!(&head, b"HTTP/1.1 200");
        stalled.push(s);
    }
    // The next request goes on another connection instead of waiting for theirs.
    let c = TestClient::default();
    for _ in 0..3 {
        let r = bounded(
            "an answer beside a full connection",
            c.get(&g.url("/small")),
        )
        .await;
        assert_eq!((r.status.as_u16(), r.body.as_str()), (200, "ok"));
    }
    drop(stalled);
}
