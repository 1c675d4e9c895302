//! Every answer the gateway gives, and what a proxied request looks like upstream.

mod common;

use common::*;
use http::{Method, StatusCode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tollgate_gateway::SystemClock;

const POLICIES: &str = r#"
plans:
  gold: {limits: [{requests: 1000, per: 1s}, {requests: 5000, per: 100s, name: slow}]}
  none: {}
consumers:
  - {name: alice, keys: [t1], plan: gold}
  - {name: bob, keys: ["b+2"], plan: gold}
  - {name: mallory, keys: [t9], plan: none}
routes:
  - name: test
    path_prefix: /test/
    upstream: backend
    methods: [GET, HEAD, POST]
    auth: {query: [apikey, user_key], header: [X-API-Key]}
    allow: {plans: [gold]}
    cors: {origins: ["https://app.example"], max_age: 10m, expose_headers: [X-Backend]}
  - name: open
    path: /open
    upstream: backend
  - name: reads
    path_prefix: /reads/
    upstream: backend
    methods: [GET]
  - name: stripped
    path_prefix: /v1/
    strip_prefix: true
    upstream: backend
  - name: stripped-any-case
    path_prefix: /V2/
    strip_prefix: true
    case_insensitive: true
    upstream: backend
  - name: credentialed
    path_prefix: /cred/
    upstream: backend
    cors: {origins: ["https://app.example"], credentials: true, headers: ["*"]}
  - name: kept
    path_prefix: /kept/
    upstream: backend
    preserve_host: true
    auth: {header: [X-API-Key], keep_credential: true, consumer_header: X-Who}
"#;

async fn setup() -> (TestGateway, TestClient) {
    let (backend, _) = inspect_backend().await;
    let gw = TestGateway::start(&yaml(backend, POLICIES), SystemClock::new()).await;
    (gw, TestClient::default())
}

#[tokio::test]
async fn passes_a_known_consumer_and_removes_the_credential() {
    let (gw, c) = setup().await;
    let a = c.get(&gw.url("/test/?max-age=0&apikey=t1")).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    let first = a.body.lines().next().unwrap_or("");
    assert_eq!(
        first, "GET /test/?max-age=0",
        "credential must not reach the backend"
    );
    assert!(a.body.contains("\nx-consumer: alice\n"), "{}", a.body);
    assert!(
        a.body.contains("\nx-forwarded-for: 127.0.0.1\n"),
        "{}",
        a.body
    );
    assert!(a.body.contains("\nx-forwarded-proto: http\n"), "{}", a.body);
    // Successful responses carry the RateLimit headers of the tightest limit.
    assert_eq!(
        a.header("ratelimit-policy"),
        "\"1000-per-1s\";q=1000;w=1, \"slow\";q=5000;w=100"
    );
    assert!(
        a.header("ratelimit")
            .starts_with("\"1000-per-1s\";r=999;t="),
        "{:?}",
        a.headers
    );
    // Hop-by-hop headers from the backend do not reach the client.
    assert!(a.headers.get("keep-alive").is_none());
}

#[tokio::test]
async fn takes_the_key_from_a_header_or_a_second_query_name() {
    let (gw, c) = setup().await;
    let a = c
        .request(
            Method::GET,
            &gw.url("/test/x?a=1"),
            &[("X-API-Key", "t1")],
            "",
        )
        .await;
    assert_eq!(a.status, StatusCode::OK);
    assert!(
        !a.body.to_ascii_lowercase().contains("x-api-key"),
        "{}",
        a.body
    );
    let a = c.get(&gw.url("/test/x?user_key=b%2B2&z=9")).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    assert!(a.body.starts_with("GET /test/x?z=9\n"), "{}", a.body);
    assert!(a.body.contains("\nx-consumer: bob\n"));
}

#[tokio::test]
async fn a_forged_consumer_header_is_replaced() {
    let (gw, c) = setup().await;
    let a = c
        .request(
            Method::GET,
            &gw.url("/test/?apikey=t1"),
            &[("X-Consumer", "root")],
            "",
        )
        .await;
    assert!(a.body.contains("\nx-consumer: alice\n"), "{}", a.body);
    assert!(!a.body.contains("root"), "{}", a.body);
}

#[tokio::test]
async fn refuses_missing_unknown_and_forbidden_keys() {
    let (gw, c) = setup().await;
    let a = c.get(&gw.url("/test/")).await;
    assert_eq!(a.status, StatusCode::UNAUTHORIZED);
    assert_eq!(a.refusal(), r#"{"status":401,"error":"missing API key"}"#);
    assert_eq!(a.header("content-type"), "application/json");
    // A key left blank is no key; another place's key still counts.
    let a = c.get(&gw.url("/test/?apikey=")).await;
    assert_eq!(a.refusal(), r#"{"status":401,"error":"missing API key"}"#);
    let a = c
        .request(
            Method::GET,
            &gw.url("/test/?apikey=t1"),
            &[("x-api-key", "")],
            "",
        )
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    let a = c.get(&gw.url("/test/?apikey=nope")).await;
    assert_eq!(a.status, StatusCode::UNAUTHORIZED);
    assert_eq!(a.refusal(), r#"{"status":401,"error":"unknown API key"}"#);
    let a = c.get(&gw.url("/test/?apikey=t9")).await;
    assert_eq!(a.status, StatusCode::FORBIDDEN);
    assert_eq!(
        a.refusal(),
        r#"{"status":403,"error":"consumer not allowed on this route"}"#
    );
}

#[tokio::test]
async fn answers_404_and_405_with_allow() {
    let (gw, c) = setup().await;
    let a = c.get(&gw.url("/nowhere")).await;
    assert_eq!(a.status, StatusCode::NOT_FOUND);
    assert_eq!(
        a.refusal(),
        r#"{"status":404,"error":"no route matches this request"}"#
    );
    let a = c
        .request(Method::DELETE, &gw.url("/test/?apikey=t1"), &[], "")
        .await;
    assert_eq!(a.status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(a.header("allow"), "GET, HEAD, POST");
    assert_eq!(
        a.refusal(),
        r#"{"status":405,"error":"method not allowed"}"#
    );
    // `GET` brings `HEAD` with it.
    let a = c.request(Method::HEAD, &gw.url("/reads/x"), &[], "").await;
    assert_eq!(a.status, StatusCode::OK);
    let a = c
        .request(Method::DELETE, &gw.url("/reads/x"), &[], "")
        .await;
    assert_eq!(a.status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(a.header("allow"), "GET, HEAD");
}

#[tokio::test]
async fn open_routes_strip_prefix_and_preserve_host() {
    let (gw, c) = setup().await;
    let a = c.get(&gw.url("/open")).await;
    assert_eq!(a.status, StatusCode::OK);
    assert!(!a.body.contains("x-consumer"));
    let a = c.get(&gw.url("/open/more")).await;
    assert_eq!(a.status, StatusCode::NOT_FOUND, "exact path only");

    let a = c.get(&gw.url("/v1/users/7?q=1")).await;
    assert!(a.body.starts_with("GET /users/7?q=1\n"), "{}", a.body);
    // What was taken off is said, for the backend's links; a route that strips nothing
    // says nothing, and a client's own is not passed on.
    assert!(a.body.contains("\nx-forwarded-prefix: /v1\n"), "{}", a.body);
    let a = c
        .request(
            Method::GET,
            &gw.url("/v2/users"),
            &[("x-forwarded-prefix", "/evil")],
            "",
        )
        .await;
    assert!(a.body.contains("\nx-forwarded-prefix: /v2\n"), "{}", a.body);
    assert!(!a.body.contains("/evil"), "{}", a.body);
    let a = c.get(&gw.url("/open")).await;
    assert!(!a.body.contains("x-forwarded-prefix"), "{}", a.body);
    // The prefix is removed as routing matched it: with the stripped segment's `;`
    // parameters, and in any case on a case-insensitive route.
    for (path, upstream) in [
        ("/v1;v=3/users/7", "GET /users/7\n"),
        ("/v1/users;v=3/7", "GET /users;v=3/7\n"),
        ("/v1/;jsessionid=1", "GET /;jsessionid=1\n"),
        ("/v2/users/7", "GET /users/7\n"),
        ("/V2/users/7", "GET /users/7\n"),
        ("/v2;x=1/users", "GET /users\n"),
    ] {
        let a = c.get(&gw.url(path)).await;
        assert_eq!(a.status, StatusCode::OK, "{path}: {}", a.body);
        assert!(a.body.starts_with(upstream), "{path}: {}", a.body);
    }
    assert!(
        !a.body.contains(&format!("\nhost: {}", gw.addr)),
        "Host goes to the target by default"
    );
    assert!(
        a.body.contains(&format!("x-forwarded-host: {}", gw.addr)),
        "{}",
        a.body
    );

    let a = c
        .request(
            Method::GET,
            &gw.url("/kept/"),
            &[("X-API-Key", "t1"), ("Host", "api.example")],
            "",
        )
        .await;
    assert!(a.body.contains("\nhost: api.example\n"), "{}", a.body);
    assert!(
        a.body.contains("\nx-api-key: t1\n"),
        "keep_credential: {}",
        a.body
    );
    assert!(a.body.contains("\nx-who: alice\n"), "{}", a.body);
    // An HTTP/1.0 client may send no `Host`: there is none to keep, and the backend gets
    // the target's, as HTTP/1.1 requires one.
    let r = raw(gw.addr, b"GET /kept/ HTTP/1.0\r\nX-API-Key: t1\r\n\r\n").await;
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    assert!(r.contains("\nhost: 127.0.0.1:"), "{r}");
}

#[tokio::test]
async fn hop_by_hop_request_headers_are_removed() {
    let (gw, c) = setup().await;
    let a = c
        .request(
            Method::GET,
            &gw.url("/open"),
            &[
                ("Connection", "keep-alive, X-Secret"),
                ("X-Secret", "s"),
                ("TE", "trailers"),
                ("Proxy-Connection", "x"),
            ],
            "",
        )
        .await;
    assert_eq!(a.status, StatusCode::OK);
    let lower = a.body.to_ascii_lowercase();
    for h in ["x-secret", "\nte:", "proxy-connection"] {
        assert!(!lower.contains(h), "{h} reached the backend: {}", a.body);
    }
}

#[tokio::test]
async fn cors_preflight_is_answered_at_the_edge() {
    let (backend, hits) = inspect_backend().await;
    let gw = TestGateway::start(&yaml(backend, POLICIES), SystemClock::new()).await;
    let c = TestClient::default();
    let preflight = |path: &str, headers: &'static [(&'static str, &'static str)]| {
        let (c, url) = (c.clone(), gw.url(path));
        async move { c.request(Method::OPTIONS, &url, headers, "").await }
    };
    let pre = &[
        ("Origin", "https://app.example"),
        ("Access-Control-Request-Method", "POST"),
        ("Access-Control-Request-Headers", "content-type, x-api-key"),
    ];
    let a = preflight("/test/thing", pre).await;
    assert_eq!(a.status, StatusCode::NO_CONTENT);
    assert_eq!(
        a.header("access-control-allow-origin"),
        "https://app.example"
    );
    assert_eq!(a.header("access-control-allow-methods"), "GET, HEAD, POST");
    assert_eq!(
        a.header("access-control-allow-headers"),
        "content-type, x-api-key"
    );
    assert_eq!(a.header("access-control-max-age"), "600");
    // The headers allowed are the ones asked for: the answer varies with them too.
    let vary: Vec<_> = a.headers.get_all("vary").iter().collect();
    assert_eq!(vary, ["Access-Control-Request-Headers", "Origin"]);
    assert_eq!(
        hits.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "never forwarded"
    );

    let evil = &[
        ("Origin", "https://evil.example"),
        ("Access-Control-Request-Method", "GET"),
    ];
    let a = preflight("/test/thing", evil).await;
    assert_eq!(a.status, StatusCode::FORBIDDEN);
    assert!(a.headers.get("access-control-allow-origin").is_none());

    // With credentials, `*` would be read as a header named `*`: what the preflight asks
    // for is allowed instead.
    let a = preflight("/cred/x", pre).await;
    assert_eq!(a.status, StatusCode::NO_CONTENT);
    assert_eq!(
        a.header("access-control-allow-headers"),
        "content-type, x-api-key"
    );
    assert_eq!(a.header("access-control-allow-credentials"), "true");
    let vary: Vec<_> = a.headers.get_all("vary").iter().collect();
    assert!(
        vary.iter().any(|v| *v == "Access-Control-Request-Headers"),
        "{vary:?}"
    );
    // But for `Authorization`, which the Fetch standard's `*` never covers: it is
    // allowed only where it is named.
    let asks_auth = &[
        ("Origin", "https://app.example"),
        ("Access-Control-Request-Method", "GET"),
        ("Access-Control-Request-Headers", "authorization, x-trace"),
    ];
    let a = preflight("/cred/x", asks_auth).await;
    assert_eq!(a.status, StatusCode::NO_CONTENT);
    assert_eq!(a.header("access-control-allow-headers"), "x-trace");

    // Actual requests (and refusals) from an allowed origin carry the CORS headers.
    let a = c
        .request(
            Method::GET,
            &gw.url("/test/?apikey=t1"),
            &[("Origin", "https://app.example")],
            "",
        )
        .await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(
        a.header("access-control-allow-origin"),
        "https://app.example"
    );
    assert_eq!(
        a.header("access-control-expose-headers"),
        "RateLimit, RateLimit-Policy, Retry-After, x-backend"
    );
    let a = c
        .request(
            Method::GET,
            &gw.url("/test/"),
            &[("Origin", "https://app.example")],
            "",
        )
        .await;
    assert_eq!(a.status, StatusCode::UNAUTHORIZED);
    assert_eq!(
        a.header("access-control-allow-origin"),
        "https://app.example"
    );
    // A plain OPTIONS (not a preflight) is subject to the method filter; its 405 carries
    // the CORS headers too, so a script can read it.
    let a = c
        .request(Method::OPTIONS, &gw.url("/test/?apikey=t1"), &[], "")
        .await;
    assert_eq!(a.status, StatusCode::METHOD_NOT_ALLOWED);
    let a = c
        .request(
            Method::DELETE,
            &gw.url("/test/?apikey=t1"),
            &[("Origin", "https://app.example")],
            "",
        )
        .await;
    assert_eq!(a.status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(
        a.header("access-control-allow-origin"),
        "https://app.example"
    );
    // Answers without CORS headers (no Origin, one not allowed) still vary on it: a cache
    // must not give them to an allowed origin.
    for origin in [None, Some("https://evil.example")] {
        let h: Vec<(&str, &str)> = origin.map(|o| ("Origin", o)).into_iter().collect();
        let a = c
            .request(Method::GET, &gw.url("/test/?apikey=t1"), &h, "")
            .await;
        assert_eq!(a.status, StatusCode::OK);
        assert!(a.headers.get("access-control-allow-origin").is_none());
        assert_eq!(a.header("vary"), "Origin", "{origin:?}");
    }
}

#[tokio::test]
async fn malformed_requests_get_a_precise_4xx_and_a_closed_connection() {
    let (gw, _) = setup().await;
    let r = raw(gw.addr, b"GARBAGE\r\n\r\n").await;
    assert!(r.starts_with("HTTP/1.1 400"), "{r}");
    // A line without its version is the line's fault, a bad byte in the target the
    // target's.
    let r = raw(gw.addr, b"GET /open\r\nHost: x\r\n\r\n").await;
    assert!(r.starts_with("HTTP/1.1 400"), "{r}");
    assert!(r.contains("malformed request line"), "{r}");
    let r = raw(gw.addr, b"GET /op\x01en HTTP/1.1\r\nHost: x\r\n\r\n").await;
    assert!(r.starts_with("HTTP/1.1 400"), "{r}");
    assert!(r.contains("invalid request target"), "{r}");
    // Another major version is one not spoken here (505, as nginx); a broken one, 400.
    for v in ["HTTP/2.0", "HTTP/3.0", "HTTP/0.9"] {
        let r = raw(
            gw.addr,
            format!("GET /open {v}\r\nHost: x\r\n\r\n").as_bytes(),
        )
        .await;
        assert!(r.starts_with("HTTP/1.1 505"), "{v}: {r}");
        assert!(r.to_ascii_lowercase().contains("connection: close"), "{r}");
    }
    // After an empty line first (which a server may skip), the same.
    let r = raw(gw.addr, b"\r\nGET /open HTTP/2.0\r\nHost: x\r\n\r\n").await;
    assert!(r.starts_with("HTTP/1.1 505"), "{r}");
    let r = raw(gw.addr, b"\r\nGET /op\x01en HTTP/1.1\r\nHost: x\r\n\r\n").await;
    assert!(r.contains("invalid request target"), "{r}");
    // A target with a space in it breaks the line, whatever version follows.
    let r = raw(gw.addr, b"GET /a b HTTP/2.0\r\nHost: x\r\n\r\n").await;
    assert!(r.starts_with("HTTP/1.1 400"), "{r}");
    for v in ["HTTP/1.x", "HTTP/2", "HTTP/22.0", "HTTX/2.0"] {
        let r = raw(
            gw.addr,
            format!("GET /open {v}\r\nHost: x\r\n\r\n").as_bytes(),
        )
        .await;
        assert!(r.starts_with("HTTP/1.1 400"), "{v}: {r}");
    }

    let r = raw(gw.addr, b"GET /test/../admin HTTP/1.1\r\nHost: x\r\n\r\n").await;
    assert!(r.starts_with("HTTP/1.1 400"), "{r}");
    assert!(r.contains("dot-segments"), "{r}");
    assert!(r.to_ascii_lowercase().contains("connection: close"), "{r}");

    let big = format!(
        "GET /open HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\n\r\n",
        "a".repeat(40 * 1024)
    );
    let r = raw(gw.addr, big.as_bytes()).await;
    assert!(r.starts_with("HTTP/1.1 431"), "{r}");

    // Conflicting framing (a smuggling vector): Transfer-Encoding wins, Content-Length is
    // not forwarded, and the connection is closed after the answer (RFC 9112 §6.3).
    let r = raw(
        gw.addr,
        b"POST /open HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\nGET /open HTTP/1.1\r\nHost: x\r\n\r\n",
    )
    .await;
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    assert!(!r.contains("content-length: 3"), "{r}");
    assert!(
        r.ends_with("\n\nhi"),
        "body forwarded by chunked framing: {r}"
    );
    assert_eq!(
        r.matches("HTTP/1.1").count(),
        1,
        "closed after one answer: {r}"
    );
}

#[tokio::test]
async fn too_many_headers_get_431() {
    let (backend, _) = inspect_backend().await;
    let cfg = yaml(backend, POLICIES).replace(
        "listeners: [{address: \"127.0.0.1:0\"}]",
        "listeners: [{address: \"127.0.0.1:0\", max_headers: 10, max_header_bytes: 2KiB}]",
    );
    let gw = TestGateway::start(&cfg, SystemClock::new()).await;
    let mut req = String::from("GET /open HTTP/1.1\r\nHost: x\r\n");
    for i in 0..20 {
        req.push_str(&format!("X-H{i}: v\r\n"));
    }
    req.push_str("\r\n");
    let r = raw(gw.addr, req.as_bytes()).await;
    assert!(r.starts_with("HTTP/1.1 431"), "{r}");
    let big = format!(
        "GET /open HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\n\r\n",
        "a".repeat(3000)
    );
    let r = raw(gw.addr, big.as_bytes()).await;
    assert!(r.starts_with("HTTP/1.1 431"), "{r}");
}

#[tokio::test]
async fn oversized_bodies_get_413() {
    let (backend, hits) = inspect_backend().await;
    let cfg = yaml(backend, POLICIES).replace(
        "listeners: [{address: \"127.0.0.1:0\"}]",
        "listeners: [{address: \"127.0.0.1:0\", max_body_bytes: 1KiB, body_timeout: 60s}]",
    )
        + "  - {name: streamed, path: /streamed, upstream: backend, request_buffering: false}\n";
    let gw = TestGateway::start(&cfg, SystemClock::new()).await;
    let c = TestClient::default();
    let a = c
        .request(Method::POST, &gw.url("/open"), &[], &"x".repeat(2000))
        .await;
    assert_eq!(a.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(
        a.refusal(),
        r#"{"status":413,"error":"request body too large"}"#
    );
    assert_eq!(hits.load(std::sync::atomic::Ordering::SeqCst), 0);
    let a = c
        .request(Method::POST, &gw.url("/open"), &[], &"x".repeat(1000))
        .await;
    assert_eq!(a.status, StatusCode::OK);
    assert!(a.body.ends_with(&"x".repeat(1000)));

    // Chunked, so the size is only known while streaming.
    let mut req =
        String::from("POST /open HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n");
    for _ in 0..3 {
        req.push_str(&format!("200\r\n{}\r\n", "y".repeat(512)));
    }
    req.push_str("0\r\n\r\n");
    let r = raw(gw.addr, req.as_bytes()).await;
    assert!(r.starts_with("HTTP/1.1 413"), "{r}");

    // A chunk that announces more than the limit is refused at its size line, whether or
    // not its first bytes came, not after waiting for the rest (a 408 at `body_timeout`,
    // which is a minute here).
    // The same on a route that streams the body upstream as it comes.
    let cases = [
        ("/open", &b"5\r\nhello\r\nffffffff\r\nabc"[..]),
        ("/open", b"5\r\nhello\r\nffffffff\r\n"),
        ("/open", b"401\r\n"),
        ("/streamed", b"5\r\nhello\r\nffffffff\r\n"),
    ];
    for (path, body) in cases {
        let mut s = TcpStream::connect(gw.addr).await.expect("connect");
        let head = format!("POST {path} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n");
        s.write_all(head.as_bytes()).await.expect("write");
        s.write_all(body).await.expect("write");
        let mut got = Vec::new();
        let _ = bounded("the 413", s.read_to_end(&mut got)).await;
        let r = String::from_utf8_lossy(&got);
        assert!(r.starts_with("HTTP/1.1 413"), "{r}");
    }
    // Within the limit, a chunk is taken whatever its size line's spelling.
    let r = raw(
        gw.addr,
        b"POST /open HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n00000003\r\nabc\r\n0\r\n\r\n",
    )
    .await;
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");

    // A body declared too large is refused before the consumer's limits count it.
    let a = c
        .request(
            Method::POST,
            &gw.url("/test/x?apikey=t1"),
            &[],
            &"x".repeat(2000),
        )
        .await;
    assert_eq!(a.status, StatusCode::PAYLOAD_TOO_LARGE);
    let u = tollgate_gateway::usage::usage(&gw.gw.snapshot(), None, "alice", gw.gw.now())
        .await
        .expect("alice's usage");
    assert!(u.limits.iter().all(|l| l.used == 0), "{u:?}");
}
