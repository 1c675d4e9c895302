//! TLS termination over loopback with a CA made by the test: SNI, ALPN (HTTP/1.1 and
//! HTTP/2 behave alike), plain HTTP and stalled handshakes, certificate reloads, and
//! client certificates naming consumers.

mod common;

use bytes::Bytes;
use common::tls::{connect, presented_names, TestCa};
use common::*;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::{TokioExecutor, TokioIo};
use std::net::SocketAddr;
use std::path::Path;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tollgate_gateway::SystemClock;

fn tls_yaml(
    backend: SocketAddr,
    dir: &Path,
    certs: &[&str],
    extra_tls: &str,
    rest: &str,
) -> String {
    let certs: Vec<String> = certs
        .iter()
        .map(|c| {
            format!(
                "{{cert: \"{}\", key: \"{}\"}}",
                dir.join(format!("{c}.pem")).display(),
                dir.join(format!("{c}.key")).display()
            )
        })
        .collect();
    format!(
        "listeners:\n  - address: \"127.0.0.1:0\"\n    header_timeout: 500ms\n    tls:\n      certificates: [{}]\n{extra_tls}upstreams:\n  backend: {{targets: [\"{backend}\"]}}\n{rest}",
        certs.join(", ")
    )
}

const ROUTES: &str = "consumers:\n  - {name: alice, keys: [k-alice]}\nroutes:\n  - {name: open, path_prefix: /open, upstream: backend}\n  - {name: keyed, path_prefix: /keyed, upstream: backend, auth: {header: [x-api-key]}}\n";

/// Sends GET `path` (with headers) over HTTP/1.1 or HTTP/2 on an established TLS stream.
async fn get_on<S>(
    stream: S,
    h2: bool,
    path: &str,
    headers: &[(&str, &str)],
) -> (StatusCode, String)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let io = TokioIo::new(stream);
    let mut req = Request::builder().uri(format!("https://api.test{path}"));
    if !h2 {
        req = req.uri(path).header("host", "api.test");
    }
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req.body(Empty::<Bytes>::new()).expect("request");
    let resp = if h2 {
        let (mut tx, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
            .await
            .expect("h2 handshake");
        tokio::spawn(conn);
        bounded("h2 request", tx.send_request(req))
            .await
            .expect("h2 response")
    } else {
        let (mut tx, conn) = hyper::client::conn::http1::handshake(io)
            .await
            .expect("h1 handshake");
        tokio::spawn(conn);
        bounded("h1 request", tx.send_request(req))
            .await
            .expect("h1 response")
    };
    let status = resp.status();
    let body = resp.into_body().collect().await.expect("body").to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

#[tokio::test]
async fn sni_picks_the_certificate_and_both_protocols_run_the_same_policies() {
    let dir = tempdir("tls-sni");
    let ca = TestCa::new(&dir, "ca");
    ca.server("default", &["default.test"]);
    ca.server("wild", &["*.wild.test"]);
    ca.server("api", &["api.test"]);
    let (backend, _) = inspect_backend().await;
    let g = TestGateway::start(
        &tls_yaml(backend, &dir, &["default", "wild", "api"], "", ROUTES),
        SystemClock::new(),
    )
    .await;

    let h1 = ca.client_config(&[b"http/1.1"], None);
    for (sni, want) in [
        ("api.test", "api.test"),
        ("x.wild.test", "*.wild.test"),
        ("other.test", "default.test"),
    ] {
        let s = connect(g.addr, sni, ca.client_config(&[], None)).await;
        // The default certificate does not name other.test: the client refuses it.
        if sni == "other.test" {
            assert!(s.is_err(), "a certificate for another name was accepted");
            continue;
        }
        let s = s.expect("handshake");
        assert_eq!(presented_names(&s), vec![want.to_string()], "for SNI {sni}");
    }

    for (alpn, h2) in [(&b"http/1.1"[..], false), (&b"h2"[..], true)] {
        let s = connect(g.addr, "api.test", ca.client_config(&[alpn], None))
            .await
            .expect("handshake");
        assert_eq!(s.get_ref().1.alpn_protocol(), Some(alpn));
        let (status, body) = get_on(s, h2, "/open/x", &[]).await;
        assert_eq!(status, 200, "h2={h2}: {body}");
        assert!(
            body.contains("x-forwarded-proto: https"),
            "h2={h2}: the backend was not told the client used https:\n{body}"
        );
        let s = connect(g.addr, "api.test", ca.client_config(&[alpn], None))
            .await
            .expect("handshake");
        let (status, body) = get_on(s, h2, "/keyed/x", &[]).await;
        assert_eq!(status, 401, "h2={h2}: {body}");
        let s = connect(g.addr, "api.test", ca.client_config(&[alpn], None))
            .await
            .expect("handshake");
        let (status, body) = get_on(s, h2, "/keyed/x", &[("x-api-key", "k-alice")]).await;
        assert_eq!(status, 200, "h2={h2}: {body}");
        assert!(body.contains("x-consumer: alice"), "h2={h2}: {body}");
    }
    drop(h1);
}

#[tokio::test]
async fn plain_http_on_a_tls_port_gets_400_and_a_stalled_handshake_is_closed() {
    let dir = tempdir("tls-plain");
    let ca = TestCa::new(&dir, "ca");
    ca.server("api", &["api.test"]);
    let backend = echo_backend().await;
    let g = TestGateway::start(
        &tls_yaml(backend, &dir, &["api"], "", ROUTES),
        SystemClock::new(),
    )
    .await;
    let answer = raw(g.addr, b"GET /open HTTP/1.1\r\nHost: api.test\r\n\r\n").await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(answer.contains("plain HTTP sent to a TLS port"), "{answer}");

    // Connect and send nothing: closed once the header timeout (500ms) has passed.
    let mut s = tokio::net::TcpStream::connect(g.addr)
        .await
        .expect("connect");
    let mut buf = Vec::new();
    let n = bounded("stalled handshake closed", s.read_to_end(&mut buf)).await;
    assert!(matches!(n, Ok(0) | Err(_)), "the gateway sent {buf:?}");
    // Half a ClientHello, then silence: closed as well.
    let mut s = tokio::net::TcpStream::connect(g.addr)
        .await
        .expect("connect");
    s.write_all(&[0x16, 0x03, 0x01, 0x02, 0x00, 0x01])
        .await
        .expect("write");
    let n = bounded("partial handshake closed", s.read_to_end(&mut buf)).await;
    assert!(matches!(n, Ok(0) | Err(_)));
    let metrics = metrics_with(&g.gw, "tollgate_tls_handshake_failures_total 3").await;
    let failures = metrics
        .lines()
        .find(|l| l.starts_with("tollgate_tls_handshake_failures_total "))
        .unwrap_or_default();
    assert_eq!(
        failures, "tollgate_tls_handshake_failures_total 3",
        "{metrics}"
    );
}

#[tokio::test]
async fn a_reload_serves_renewed_certificates_without_dropping_connections() {
    let dir = tempdir("tls-reload");
    let ca = TestCa::new(&dir, "ca");
    let first = ca.server("first", &["api.test"]);
    let backend = echo_backend().await;
    let yaml = |c: &str| tls_yaml(backend, &dir, &[c], "", ROUTES);
    let g = TestGateway::start(&yaml("first"), SystemClock::new()).await;

    let old = connect(g.addr, "api.test", ca.client_config(&[b"http/1.1"], None))
        .await
        .expect("handshake");
    assert_eq!(
        old.get_ref().1.peer_certificates().map(|c| c[0].clone()),
        Some(first.der.clone())
    );
    let io = TokioIo::new(old);
    let (mut tx, conn) = hyper::client::conn::http1::handshake(io).await.expect("h1");
    tokio::spawn(conn);

    let second = ca.server("second", &["api.test"]);
    g.apply(&yaml("second"));
    let new = connect(g.addr, "api.test", ca.client_config(&[b"http/1.1"], None))
        .await
        .expect("handshake");
    assert_eq!(
        new.get_ref().1.peer_certificates().map(|c| c[0].clone()),
        Some(second.der.clone()),
        "a new connection after the reload gets the new certificate"
    );
    // The connection made before the reload still serves requests.
    let req = Request::builder()
        .uri("/open/again")
        .header("host", "api.test")
        .body(Empty::<Bytes>::new())
        .expect("request");
    let resp = bounded("old connection", tx.send_request(req))
        .await
        .expect("response");
    assert_eq!(resp.status(), 200);

    // A key that does not go with its certificate is a config error with its place.
    let wrong = dir.join("wrong.key");
    std::fs::copy(&first.key, &wrong).expect("copy");
    let bad = yaml("second").replace(
        &dir.join("second.key").display().to_string(),
        &wrong.display().to_string(),
    );
    let err = tollgate_config::from_yaml(&bad).expect_err("mismatched key accepted");
    let msg = err.to_string();
    assert!(
        msg.contains("listeners[0].tls.certificates[0]")
            && msg.contains("is not the key of the certificate")
            && !msg.contains("KeyMismatch"),
        "{msg}"
    );
    let err = tollgate_config::from_yaml(&yaml("missing")).expect_err("missing file accepted");
    assert!(err.to_string().contains("cannot read"), "{err}");
}

#[tokio::test]
async fn client_certificates_name_consumers_on_mtls_routes() {
    let dir = tempdir("tls-mtls");
    let ca = TestCa::new(&dir, "ca");
    ca.server("api", &["api.test"]);
    let alice = ca.client("alice", "alice");
    let mallory = ca.client("mallory", "mallory");
    let other_ca = TestCa::new(&dir, "other-ca");
    let forged = other_ca.client("forged", "alice");
    let (backend, _) = inspect_backend().await;
    let extra = format!(
        "      client_ca: \"{}\"\n      client_auth: optional\n",
        ca.pem.display()
    );
    let rest = "consumers:\n  - {name: alice, keys: [k-alice]}\nroutes:\n  - {name: certs, path_prefix: /certs, upstream: backend, auth: {mtls: true}}\n  - {name: open, path_prefix: /open, upstream: backend}\n";
    let g = TestGateway::start(
        &tls_yaml(backend, &dir, &["api"], &extra, rest),
        SystemClock::new(),
    )
    .await;

    let s = connect(g.addr, "api.test", ca.client_config(&[b"h2"], Some(&alice)))
        .await
        .expect("handshake");
    let (status, body) = get_on(s, true, "/certs/x", &[("x-consumer", "mallory")]).await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("x-consumer: alice"), "{body}");
    assert!(!body.contains("mallory"), "{body}");

    let s = connect(
        g.addr,
        "api.test",
        ca.client_config(&[b"http/1.1"], Some(&mallory)),
    )
    .await
    .expect("handshake");
    let (status, body) = get_on(s, false, "/certs/x", &[]).await;
    assert_eq!(status, 401, "{body}");
    assert!(
        body.contains("client certificate names no consumer"),
        "{body}"
    );

    let s = connect(g.addr, "api.test", ca.client_config(&[b"http/1.1"], None))
        .await
        .expect("handshake");
    let (status, body) = get_on(s, false, "/certs/x", &[]).await;
    assert_eq!(status, 401, "{body}");
    assert!(body.contains("client certificate required"), "{body}");
    let s = connect(g.addr, "api.test", ca.client_config(&[b"http/1.1"], None))
        .await
        .expect("handshake");
    assert_eq!(get_on(s, false, "/open/x", &[]).await.0, 200);

    // A certificate from another CA fails the handshake.
    let s = connect(
        g.addr,
        "api.test",
        ca.client_config(&[b"http/1.1"], Some(&forged)),
    )
    .await;
    let refused = match s {
        Err(_) => true,
        // TLS 1.3: the client learns of the refusal on its first read.
        Ok(mut s) => {
            let _ = s
                .write_all(b"GET /certs/x HTTP/1.1\r\nHost: api.test\r\n\r\n")
                .await;
            let mut buf = Vec::new();
            s.read_to_end(&mut buf).await.is_err() || buf.is_empty()
        }
    };
    assert!(refused, "a certificate of another CA was accepted");

    // `client_auth` defaults to required: no certificate, no handshake.
    let extra = format!("      client_ca: \"{}\"\n", ca.pem.display());
    let g2 = TestGateway::start(
        &tls_yaml(backend, &dir, &["api"], &extra, rest),
        SystemClock::new(),
    )
    .await;
    let s = connect(g2.addr, "api.test", ca.client_config(&[b"http/1.1"], None)).await;
    let refused = match s {
        Err(_) => true,
        Ok(mut s) => {
            let _ = s
                .write_all(b"GET /open/x HTTP/1.1\r\nHost: api.test\r\n\r\n")
                .await;
            let mut buf = Vec::new();
            s.read_to_end(&mut buf).await.is_err() || buf.is_empty()
        }
    };
    assert!(refused, "a client without a certificate was served");
}

#[tokio::test]
async fn renewed_certificate_files_reload_on_sighup_and_when_watched() {
    let dir = tempdir("tls-renew");
    let ca = TestCa::new(&dir, "ca");
    let first = ca.server("api", &["api.test"]);
    let backend = echo_backend().await;
    let path = dir.join("tollgate.yaml");
    std::fs::write(&path, tls_yaml(backend, &dir, &["api"], "", ROUTES)).expect("write config");
    let g = TestGateway::start(
        &tls_yaml(backend, &dir, &["api"], "", ROUTES),
        SystemClock::new(),
    )
    .await;
    g.gw.reload_file(&path).expect("first reload");
    let served = || async {
        let s = connect(g.addr, "api.test", ca.client_config(&[b"http/1.1"], None))
            .await
            .expect("handshake");
        s.get_ref().1.peer_certificates().map(|c| c[0].clone())
    };
    assert_eq!(served().await, Some(first.der.clone()));
    let generation = g.gw.reload_status().generation;
    g.gw.reload_file(&path).expect("unchanged reload");
    assert_eq!(
        g.gw.reload_status().generation,
        generation,
        "nothing changed, nothing applied"
    );

    // Renewed in place (same file names, config untouched): SIGHUP picks it up.
    let second = ca.server("api", &["api.test"]);
    assert!(g.gw.tls_files_changed());
    g.gw.reload_file(&path).expect("reload");
    assert_eq!(served().await, Some(second.der.clone()));

    // And the file watcher, without a signal.
    let watcher = tollgate_gateway::watch::watch_file(
        g.gw.clone(),
        path.clone(),
        std::time::Duration::from_millis(20),
        std::time::Duration::from_millis(20),
    );
    let third = ca.server("api", &["api.test"]);
    bounded("renewed certificate served", async {
        let mut tick = tokio::time::interval(std::time::Duration::from_millis(20));
        loop {
            tick.tick().await;
            if served().await == Some(third.der.clone()) {
                return;
            }
        }
    })
    .await;
    watcher.abort();
}
