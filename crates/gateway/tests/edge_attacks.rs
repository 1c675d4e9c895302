//! What the edge must not pass on: the whole `X-Forwarded-*` family from untrusted clients
//! (and the headers that name another URL or host),
//! credentials in PHP's spellings, a protocol switch nobody asked for, `TRACE` and
//! `CONNECT`, an upgrade asked with a body, an admin port without a token reached from a
//! web page, and any of the headers the gateway removes or sets, written in another case.

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
        "X-Original-URL: /admin",
        "X_Rewrite_URL: /admin",
        "X-Host: evil",
        "X-Original-Host: evil",
        "X-Client-IP: 10.0.0.1",
        "True-Client-IP: 10.0.0.1",
        "CF-Connecting-IP: 10.0.0.1",
        "X-Cluster-Client-IP: 10.0.0.1",
        "Fastly-Client-IP: 10.0.0.1",
        "X-Original-Forwarded-For: 10.0.0.1",
        "X-Forwarded: for=10.0.0.1",
        "Client-IP: 10.0.0.1",
        "Forwarded-For: 10.0.0.1",
        "X-Originating-IP: 10.0.0.1",
        "X-Remote-Addr: 10.0.0.1",
        "WL-Proxy-Client-IP: 10.0.0.1",
        "HTTP_X_FORWARDED_FOR: 10.0.0.1",
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
    // The headers that name another URL or host, which Symfony, Zend and IIS act on.
    for h in [
        "x-original-url",
        "x_rewrite_url",
        "x-host:",
        "x-original-host",
    ] {
        assert!(!seen.contains(h), "{h}: {a}");
    }
    // Nor any header that client-address libraries read the client from.
    assert!(!seen.contains("10.0.0.1"), "{a}");
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
    // A cross-site "simple" POST, as a browser sends it.
    let text = req("POST /cache/purge HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: http://evil.example\r\nContent-Type: text/plain\r\nContent-Length: 13\r\nConnection: close\r\n\r\n{\"all\": true}".into()).await;
    assert_eq!(text, 403);
    // From a browser too old to send `Origin`: the form encoding that can carry JSON.
    let old = req("POST /cache/purge HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: text/plain\r\nContent-Length: 13\r\nConnection: close\r\n\r\n{\"all\": true}".into()).await;
    assert_eq!(old, 403);
    // From a sandboxed frame, or from a browser that sends only the fetch metadata.
    let null = req("POST /reload HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: null\r\nContent-Type: application/json\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".into()).await;
    assert_eq!(null, 403);
    let site = req("POST /reload HTTP/1.1\r\nHost: 127.0.0.1\r\nSec-Fetch-Site: cross-site\r\nContent-Type: application/json\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".into()).await;
    assert_eq!(site, 403);
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
    // A POST of a form's content type, or of none, whatever its Origin says: what a page
    // may send without a preflight.
    for ct in ["Content-Type: application/x-www-form-urlencoded\r\n", ""] {
        let form = req(format!(
            "POST /cache/purge HTTP/1.1\r\nHost: {admin}\r\n{ct}Content-Length: 13\r\nConnection: close\r\n\r\n{{\"all\": true}}"
        ))
        .await;
        assert_eq!(form, 403, "{ct:?}");
    }
    let local =
        req("GET /status HTTP/1.1\r\nHost: localhost:9901\r\nConnection: close\r\n\r\n".into())
            .await;
    assert_eq!(local, 200);
}

/// A gateway whose one route takes upgrades, in front of the inspecting backend, and the
/// backend's count of requests.
async fn websocket_gateway() -> (TestGateway, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    let (backend, hits) = inspect_backend().await;
    let g = TestGateway::start(
        &yaml(
            backend,
            "routes:\n  - {name: ws, path_prefix: /, upstream: backend, websocket: true}\n",
        ),
        SystemClock::new(),
    )
    .await;
    (g, hits)
}

#[tokio::test]
async fn an_upgrade_asked_with_a_body_goes_on_as_an_ordinary_request() {
    // Were it taken, the body would not go upstream: a `Content-Length` sent without it
    // would make the target read the next request on that connection as this one's body.
    let (g, hits) = websocket_gateway().await;
    let a = raw(
        g.addr,
        b"POST /ws HTTP/1.1\r\nHost: a\r\nConnection: Upgrade, close\r\nUpgrade: websocket\r\n\
          Content-Length: 10\r\n\r\n0123456789",
    )
    .await;
    assert!(a.starts_with("HTTP/1.1 200"), "{a}");
    let seen = a.to_ascii_lowercase();
    assert!(seen.contains("post /ws\n"), "{a}");
    assert!(seen.contains("content-length: 10\n"), "{a}");
    assert!(!seen.contains("upgrade: websocket"), "{a}");
    assert!(a.ends_with("\n0123456789"), "the body went upstream: {a}");
    assert_eq!(hits.load(std::sync::atomic::Ordering::SeqCst), 1);
}

#[tokio::test]
async fn connect_is_refused_whatever_a_route_lists() {
    let (backend, hits) = inspect_backend().await;
    let g = TestGateway::start(
        &yaml(
            backend,
            "routes:\n  - {name: open, path_prefix: /open/, upstream: backend}\n  - {name: listed, path_prefix: /listed/, upstream: backend, methods: [GET, CONNECT]}\n",
        ),
        SystemClock::new(),
    )
    .await;
    for (target, allow) in [
        ("/open/x", "GET, HEAD, POST, PUT, DELETE, PATCH, OPTIONS"),
        ("/listed/x", "GET, HEAD"),
    ] {
        // What follows a CONNECT is not read as a request, even on a refusal.
        let req = format!(
            "CONNECT {target} HTTP/1.1\r\nHost: a\r\n\r\nGET {target} HTTP/1.1\r\nHost: a\r\n\r\n"
        );
        let a = raw(g.addr, req.as_bytes()).await;
        assert!(a.starts_with("HTTP/1.1 405"), "{target}: {a}");
        let head = a
            .split("\r\n\r\n")
            .next()
            .unwrap_or("")
            .to_ascii_lowercase();
        assert!(
            head.lines()
                .any(|l| l == format!("allow: {}", allow.to_ascii_lowercase())),
            "{target}: {a}"
        );
        assert_eq!(a.matches("HTTP/1.1 ").count(), 1, "{target}: {a}");
    }
    // A method with a lower-case letter is refused before any route is looked at: a
    // backend reading methods in any case would act on `connect` or `move` as on its
    // upper-case name, and routes list methods in upper case.
    for method in [
        "connect", "trace", "Trace", "post", "Get", "dElEtE", "move", "purge",
    ] {
        let req = format!("{method} /listed/x HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n");
        let a = raw(g.addr, req.as_bytes()).await;
        assert!(a.starts_with("HTTP/1.1 400"), "{method}: {a}");
        assert!(a.contains("upper case"), "{method}: {a}");
    }
    assert_eq!(hits.load(std::sync::atomic::Ordering::SeqCst), 0);
    // An extension method in upper case goes on as written.
    let a = raw(
        g.addr,
        b"REPORT /open/x HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(a.starts_with("HTTP/1.1 200"), "{a}");
    assert_eq!(hits.load(std::sync::atomic::Ordering::SeqCst), 1);
}

#[tokio::test]
async fn an_upgrade_goes_upstream_without_a_length() {
    // A body-less upgrade may still say `Content-Length: 00`; the upgrade request goes
    // without one (no body follows it upstream).
    let (g, _) = websocket_gateway().await;
    let a = raw(
        g.addr,
        b"GET /ws HTTP/1.1\r\nHost: a\r\nConnection: Upgrade, close\r\nUpgrade: websocket\r\n\
          Content-Length: 00\r\n\r\n",
    )
    .await;
    assert!(a.starts_with("HTTP/1.1 200"), "{a}");
    let seen = a
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_ascii_lowercase();
    assert!(
        seen.contains("upgrade: websocket\n"),
        "the upgrade went upstream: {a}"
    );
    assert!(!seen.contains("content-length"), "{a}");
}

#[tokio::test]
async fn header_names_are_judged_in_any_case_and_passed_on_as_written() {
    let (backend, seen) = recording_backend().await;
    let rest = "consumers:\n  - {name: alice, keys: [ka]}\nroutes:\n  - {name: keyed, path_prefix: /, upstream: backend, auth: {header: [X-API-Key]}}\n";
    let g = TestGateway::start(&yaml(backend, rest), SystemClock::new()).await;
    let names: Vec<String> = (0..300).map(|i| format!("x-n{i}")).collect();
    let head = format!(
        "GET /x HTTP/1.1\r\nHOST: a\r\nx-API-key: ka\r\nContent-Length: 0\r\nCONTENT-LENGTH: 0\r\n\
         Connection: X-Drop-Me, {}, x-ALSO, close\r\nx-drop-me: 1\r\nX-Also: 2\r\nX-CONSUMER: bob\r\n\
         X_Consumer: bob\r\nX-FORWARDED-FOR: 6.6.6.6\r\nX-Forwarded-HOST: evil\r\nEXPECT: 100-continue\r\n\
         X-REQUEST-ID: forged\r\nX-Keep-Case: yes\r\n\r\n",
        names.join(",")
    );
    let (answer, got) = exchange(g.addr, &seen, &head).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let got = got.expect("the backend saw the request");
    let lower = got.to_ascii_lowercase();
    for gone in [
        "x-drop-me",
        "x-also",
        "x_consumer",
        "6.6.6.6",
        "evil",
        "expect",
        "forged",
        "x-api-key",
    ] {
        assert!(!lower.contains(gone), "{gone} went upstream: {got}");
    }
    assert_eq!(lower.matches("content-length").count(), 1, "{got}");
    assert_eq!(lower.matches("x-consumer: ").count(), 1, "{got}");
    assert!(lower.contains("x-consumer: alice"), "{got}");
    assert!(lower.contains("x-forwarded-for: 127.0.0.1"), "{got}");
    assert_eq!(lower.matches("x-request-id: ").count(), 1, "{got}");
    assert!(got.contains("X-Keep-Case: yes"), "{got}");
}

#[tokio::test]
async fn framing_names_spelled_with_underscores_never_reach_the_backend() {
    // A backend behind CGI or WSGI reads `Transfer_Encoding` as `HTTP_TRANSFER_ENCODING`,
    // the same name as the framing the gateway chose; nginx drops every such name.
    let (backend, seen) = recording_backend().await;
    let g = TestGateway::start(
        &yaml(
            backend,
            "routes:\n  - {path_prefix: /, upstream: backend}\n",
        ),
        SystemClock::new(),
    )
    .await;
    let head = "POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\nTransfer_Encoding: chunked\r\n\
                CONTENT_length: 99\r\nX_Other_Name: kept\r\nConnection: close\r\n\r\n";
    let (answer, got) = exchange(g.addr, &seen, head).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let got = got.expect("the backend saw the request");
    let lower = got.to_ascii_lowercase();
    assert!(!lower.contains("transfer_encoding"), "{got}");
    assert!(!lower.contains("content_length"), "{got}");
    assert!(got.contains("X_Other_Name: kept"), "{got}");
}
