//! The backend only sees callers the gateway authenticated, under the identity the gateway
//! gives them: forged consumer headers, smuggled keys and forwarded headers are removed.

mod common;

use common::*;
use std::net::SocketAddr;
use tollgate_gateway::SystemClock;

const POLICIES: &str = r#"
plans:
  gold: {limits: [{requests: 1000, per: 1s}]}
consumers:
  - {name: alice, keys: [t1], plan: gold}
  - {name: mallory, keys: [t9], plan: gold}
routes:
  - name: keyed
    path_prefix: /test/
    upstream: backend
    auth: {query: [apikey], header: [X-API-Key]}
  - name: kept
    path_prefix: /kept/
    upstream: backend
    preserve_host: true
    auth: {header: [X-API-Key]}
  - name: open
    path_prefix: /open/
    upstream: backend
"#;

type Seen = Heads;

async fn setup() -> (TestGateway, SocketAddr, Seen) {
    let (backend, seen) = recording_backend().await;
    let gw = TestGateway::start(&yaml(backend, POLICIES), SystemClock::new()).await;
    (gw, backend, seen)
}

/// [`exchange`] with the head as the backend got it in lower case.
async fn send(gw: &TestGateway, seen: &Seen, head: &str) -> (String, Option<String>) {
    let (answer, got) = exchange(gw.addr, seen, head).await;
    (answer, got.map(|h| h.to_ascii_lowercase()))
}

fn header_lines<'a>(head: &'a str, name: &str) -> Vec<&'a str> {
    head.lines()
        .filter(|l| {
            l.split_once(':')
                .is_some_and(|(n, _)| n.trim().eq_ignore_ascii_case(name))
        })
        .collect()
}

#[tokio::test]
async fn connection_cannot_remove_the_headers_the_gateway_sets() {
    let (gw, _, seen) = setup().await;
    let (a, got) = send(
        &gw,
        &seen,
        "GET /test/x?apikey=t1 HTTP/1.1\r\nHost: api\r\nConnection: close, x-consumer, x-forwarded-for, x-forwarded-host, x-forwarded-proto\r\n\r\n",
    )
    .await;
    assert_eq!(status_of(&a), 200, "{a}");
    let got = got.expect("forwarded");
    assert_eq!(
        header_lines(&got, "x-consumer"),
        ["x-consumer: alice"],
        "{got}"
    );
    assert_eq!(header_lines(&got, "x-forwarded-for").len(), 1, "{got}");
    assert_eq!(
        header_lines(&got, "x-forwarded-host"),
        ["x-forwarded-host: api"],
        "{got}"
    );
    assert_eq!(header_lines(&got, "x-forwarded-proto").len(), 1, "{got}");
    assert!(header_lines(&got, "connection").is_empty(), "{got}");

    // `Connection: host` on a preserve_host route: Host still reaches the backend.
    let (a, got) = send(
        &gw,
        &seen,
        "GET /kept/x HTTP/1.1\r\nHost: api.example\r\nX-API-Key: t1\r\nConnection: host, close\r\n\r\n",
    )
    .await;
    assert_eq!(status_of(&a), 200, "{a}");
    let got = got.expect("forwarded");
    assert_eq!(header_lines(&got, "host"), ["host: api.example"], "{got}");
}

#[tokio::test]
async fn consumer_header_spelled_with_underscores_never_reaches_the_backend() {
    let (gw, _, seen) = setup().await;
    for path in ["/test/x?apikey=t1", "/open/x"] {
        let (a, got) = send(
            &gw,
            &seen,
            &format!("GET {path} HTTP/1.1\r\nHost: api\r\nX_Consumer: admin\r\nx_forwarded_for: 6.6.6.6\r\nX_API_Key: t9\r\nConnection: close\r\n\r\n"),
        )
        .await;
        assert_eq!(status_of(&a), 200, "{a}");
        let got = got.expect("forwarded");
        assert!(!got.contains("admin"), "{got}");
        assert!(!got.contains("6.6.6.6"), "{got}");
        assert!(!got.contains("t9"), "{got}");
    }
}

#[tokio::test]
async fn consumer_header_is_removed_on_routes_without_auth() {
    let (gw, _, seen) = setup().await;
    let (a, got) = send(
        &gw,
        &seen,
        "GET /open/x HTTP/1.1\r\nHost: api\r\nX-Consumer: consumer-1\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(status_of(&a), 200, "{a}");
    let got = got.expect("forwarded");
    assert!(header_lines(&got, "x-consumer").is_empty(), "{got}");
}

#[tokio::test]
async fn a_second_key_is_never_forwarded_and_two_different_keys_are_refused() {
    let (gw, _, seen) = setup().await;
    let refused = [
        "GET /test/x?apikey=t9 HTTP/1.1\r\nHost: api\r\nX-API-Key: t1\r\nConnection: close\r\n\r\n",
        "GET /test/x?apikey=t1&%61pikey=t9 HTTP/1.1\r\nHost: api\r\nConnection: close\r\n\r\n",
        "GET /test/x?apikey=t1;apikey=t9 HTTP/1.1\r\nHost: api\r\nConnection: close\r\n\r\n",
        "GET /test/x?APIKEY=t9&apikey=t1 HTTP/1.1\r\nHost: api\r\nConnection: close\r\n\r\n",
        "GET /test/x HTTP/1.1\r\nHost: api\r\nX-API-Key: t1\r\nX-API-Key: t9\r\nConnection: close\r\n\r\n",
    ];
    for req in refused {
        let (a, got) = send(&gw, &seen, req).await;
        assert_eq!(status_of(&a), 400, "{req}\n{a}");
        assert!(a.contains("more than one API key"), "{a}");
        assert!(got.is_none(), "{req} reached the backend");
    }
    // The same key in every place it may be: authenticated, and removed from all of them.
    let (a, got) = send(
        &gw,
        &seen,
        "GET /test/x?a=1&apikey=t1&%61pikey=t1&b=2 HTTP/1.1\r\nHost: api\r\nX-API-Key: t1\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(status_of(&a), 200, "{a}");
    let got = got.expect("forwarded");
    assert!(got.starts_with("get /test/x?a=1&b=2 http/1.1\r\n"), "{got}");
    assert!(!got.contains("t1"), "{got}");
}

#[tokio::test]
async fn forwarded_headers_from_an_untrusted_client_are_replaced() {
    let (gw, _, seen) = setup().await;
    let (a, got) = send(
        &gw,
        &seen,
        "GET /open/x HTTP/1.1\r\nHost: api\r\nX-Forwarded-For: 6.6.6.6\r\nX-Forwarded-Host: evil\r\nX-Forwarded-Proto: https\r\nForwarded: for=6.6.6.6\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(status_of(&a), 200, "{a}");
    let got = got.expect("forwarded");
    assert_eq!(
        header_lines(&got, "x-forwarded-for"),
        ["x-forwarded-for: 127.0.0.1"],
        "{got}"
    );
    assert_eq!(
        header_lines(&got, "x-forwarded-host"),
        ["x-forwarded-host: api"],
        "{got}"
    );
    assert_eq!(
        header_lines(&got, "x-forwarded-proto"),
        ["x-forwarded-proto: http"],
        "{got}"
    );
    assert!(header_lines(&got, "forwarded").is_empty(), "{got}");
}

#[tokio::test]
async fn forwarded_headers_from_a_trusted_proxy_are_kept_and_appended_to() {
    let (backend, seen) = recording_backend().await;
    let cfg = yaml(backend, POLICIES).replace(
        "{address: \"127.0.0.1:0\"}",
        "{address: \"127.0.0.1:0\", trusted_proxies: [127.0.0.0/8]}",
    );
    let gw = TestGateway::start(&cfg, SystemClock::new()).await;
    let (a, got) = send(
        &gw,
        &seen,
        "GET /open/x HTTP/1.1\r\nHost: api\r\nX-Forwarded-For: 203.0.113.7\r\nX-Forwarded-Host: shop.example\r\nX-Forwarded-Proto: https\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(status_of(&a), 200, "{a}");
    let got = got.expect("forwarded");
    assert_eq!(
        header_lines(&got, "x-forwarded-for"),
        ["x-forwarded-for: 203.0.113.7, 127.0.0.1"],
        "{got}"
    );
    assert_eq!(
        header_lines(&got, "x-forwarded-host"),
        ["x-forwarded-host: shop.example"]
    );
    assert_eq!(
        header_lines(&got, "x-forwarded-proto"),
        ["x-forwarded-proto: https"]
    );
}

#[tokio::test]
async fn a_second_key_in_bracket_form_is_a_second_key() {
    // PHP and Rails read `apikey[]` and `apikey[0]` as the parameter `apikey`.
    let (gw, _, seen) = setup().await;
    for q in ["apikey=t1&apikey[]=t9", "apikey=t1&apikey%5B0%5D=t9"] {
        let req = format!("GET /test/x?{q} HTTP/1.1\r\nHost: api\r\nConnection: close\r\n\r\n");
        let (a, got) = send(&gw, &seen, &req).await;
        assert_eq!(status_of(&a), 400, "{q}\n{a}");
        assert!(got.is_none(), "{q} reached the backend");
    }
}
