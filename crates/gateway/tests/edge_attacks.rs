//! What the edge must not pass on: the whole `X-Forwarded-*` family from untrusted clients,
//! credentials in PHP's spellings, a protocol switch nobody asked for, `TRACE`, the length
//! of an upgrade's body (which does not go upstream), and an admin port without a token
//! reached from a web page.

mod common;

use common::*;
use http::Method;
use tollgate_gateway::SystemClock;

#[tokio::test]
async fn untrusted_clients_send_no_forwarding_header_upstream() {
    let (backend, _) = inspect_backend().await;
    let g = TestGateway::start(
        &yaml(
            backend,
            "routes:\n  - {name: open, path_prefix: /, upstream: backend}\n",
        ),
        SystemClock::new(),
    )
    .await;
    let sent = [
        "X-Forwarded-Port: 1",
        "X-Forwarded-Prefix: /admin",
        "X-Forwarded-Scheme: https",
        "X-Forwarded-Ssl: on",
        "X-Forwarded-Server: evil",
        "X-Forwarded-Uri: /admin",
        "X-Forwarded-Path: /admin",
        "X_Forwarded_Port: 2",
        "X-Forwarded_Prefix: /x",
    ];
    let head = format!(
        "GET /x HTTP/1.1\r\nHost: a\r\n{}\r\nConnection: close\r\n\r\n",
        sent.join("\r\n")
    );
    let a = raw(g.addr, head.as_bytes()).await;
    assert!(a.starts_with("HTTP/1.1 200"), "{a}");
    let seen = a.to_ascii_lowercase();
    for h in ["port", "prefix", "scheme", "ssl", "server", "uri", "path"] {
        assert!(!seen.contains(&format!("x-forwarded-{h}")), "{h}: {a}");
        assert!(!seen.contains(&format!("x_forwarded_{h}")), "{h}: {a}");
    }
    assert!(seen.contains("x-forwarded-for: 127.0.0.1"), "{a}");
}

#[tokio::test]
async fn credential_names_count_in_the_spellings_php_reads() {
    let (backend, _) = inspect_backend().await;
    let rest = "consumers:\n  - {name: alice, keys: [ka]}\n  - {name: bob, keys: [kb]}\nroutes:\n  - {name: keyed, path_prefix: /, upstream: backend, auth: {query: [user_key]}}\n";
    let g = TestGateway::start(&yaml(backend, rest), SystemClock::new()).await;
    let c = TestClient::default();
    for spelling in [
        "user.key",
        "user+key",
        "user%20key",
        "user[key",
        "%20user_key",
    ] {
        let a = c
            .get(&g.url(&format!("/x?user_key=ka&{spelling}=kb")))
            .await;
        assert_eq!(a.status.as_u16(), 400, "{spelling}: {}", a.body);
        // The same key in two spellings is fine, and neither reaches the backend.
        let a = c
            .get(&g.url(&format!("/x?user_key=ka&{spelling}=ka")))
            .await;
        assert_eq!(a.status.as_u16(), 200, "{spelling}: {}", a.body);
        assert!(!a.body.contains("ka"), "{spelling}: {}", a.body);
    }
}

#[tokio::test]
async fn a_protocol_switch_nobody_asked_for_is_a_502_at_once_and_trace_is_refused() {
    let (backend, _) = raw_backend(|_| {
        Some(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n".to_vec())
    })
    .await;
    let rest = "routes:\n  - {name: open, path_prefix: /, upstream: backend}\n  - {name: traced, path_prefix: /traced, upstream: backend, methods: [GET, TRACE]}\n";
    let g = TestGateway::start(
        &yaml(backend, rest).replace("response_timeout: 2s", "response_timeout: 60s"),
        SystemClock::new(),
    )
    .await;
    let c = TestClient::default();
    for method in [Method::GET, Method::POST] {
        let a = bounded("an answer well before response_timeout", async {
            c.request(method.clone(), &g.url("/x"), &[], "b").await
        })
        .await;
        assert_eq!(a.status.as_u16(), 502, "{method}: {}", a.body);
    }
    let t = c.request(Method::TRACE, &g.url("/x"), &[], "").await;
    assert_eq!(t.status.as_u16(), 405);
    assert!(!t.header("allow").contains("TRACE"), "{:?}", t.headers);
    assert!(t.header("allow").contains("GET"), "{:?}", t.headers);
    // A route that lists TRACE takes it.
    let t = c.request(Method::TRACE, &g.url("/traced"), &[], "").await;
    assert_ne!(t.status.as_u16(), 405);
}

#[tokio::test]
async fn an_admin_port_without_a_token_answers_no_web_page() {
    let backend = echo_backend().await;
    let g = TestGateway::start(
        &yaml(
            backend,
            "routes:\n  - {name: open, path_prefix: /, upstream: backend}\n",
        ),
        SystemClock::new(),
    )
    .await;
    let admin = start_admin(&g.gw, None).await;
    let req = |head: String| async move { status_of(&raw(admin, head.as_bytes()).await) };
    // A cross-site "simple" POST.
    let text = req("POST /cache/purge HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: text/plain\r\nContent-Length: 13\r\nConnection: close\r\n\r\n{\"all\": true}".into()).await;
    assert_eq!(text, 403);
    // A JSON POST from another origin.
    let foreign = req("POST /cache/purge HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: http://evil.example\r\nContent-Type: application/json\r\nContent-Length: 13\r\nConnection: close\r\n\r\n{\"all\": true}".into()).await;
    assert_eq!(foreign, 403);
    // A DNS-rebound name.
    let rebound =
        req("GET /config HTTP/1.1\r\nHost: evil.example\r\nConnection: close\r\n\r\n".into()).await;
    assert_eq!(rebound, 403);
    let elsewhere =
        req("GET /config HTTP/1.1\r\nHost: 10.1.2.3\r\nConnection: close\r\n\r\n".into()).await;
    assert_eq!(elsewhere, 403, "an address that is not the admin's");
    // What an operator does still works.
    let ok = req(format!(
        "POST /cache/purge HTTP/1.1\r\nHost: {admin}\r\nContent-Type: application/json\r\nContent-Length: 13\r\nConnection: close\r\n\r\n{{\"all\": true}}"
    ))
    .await;
    assert_eq!(ok, 200);
    let local =
        req("GET /status HTTP/1.1\r\nHost: localhost:9901\r\nConnection: close\r\n\r\n".into())
            .await;
    assert_eq!(local, 200);
}

/// A backend that refuses every request with a kept-alive 403 and hands each head it read
/// to the test.
async fn refusing_backend() -> (std::net::SocketAddr, tokio::sync::mpsc::Receiver<String>) {
    use tokio::io::AsyncWriteExt;
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = l.local_addr().expect("addr");
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let tx = tx.clone();
            tokio::spawn(async move {
                while let Some(head) = read_head(&mut s).await {
                    let _ = tx.send(head).await;
                    let answer = b"HTTP/1.1 403 Forbidden\r\ncontent-length: 0\r\n\r\n";
                    if s.write_all(answer).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (addr, rx)
}

#[tokio::test]
async fn an_upgrade_goes_upstream_without_the_length_of_a_body_it_does_not_carry() {
    // The body of an upgrade request is not sent upstream; a `Content-Length` sent with no
    // body would make the target read the next request on that connection as this one's.
    let (backend, mut heads) = refusing_backend().await;
    let g = TestGateway::start(
        &yaml(
            backend,
            "routes:\n  - {name: ws, path_prefix: /, upstream: backend, websocket: true}\n",
        ),
        SystemClock::new(),
    )
    .await;
    let a = raw(
        g.addr,
        b"GET /ws HTTP/1.1\r\nHost: a\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\
          Content-Length: 5\r\n\r\nhelloGET /next HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(a.starts_with("HTTP/1.1 403"), "{a}");
    let head = bounded("the upgrade's head", heads.recv())
        .await
        .expect("a head")
        .to_ascii_lowercase();
    assert!(head.starts_with("get /ws "), "{head}");
    assert!(head.contains("upgrade: websocket"), "{head}");
    assert!(!head.contains("content-length"), "{head}");
    assert!(!head.contains("transfer-encoding"), "{head}");
}
