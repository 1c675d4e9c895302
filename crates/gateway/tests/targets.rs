//! Routing and authorization see what the backend will see: paths are normalized before
//! routing and forwarded normalized; hosts match without case, port or trailing dot; a
//! request's Host must be single and agree with its target.

mod common;

use common::*;
use tollgate_gateway::SystemClock;

const ROUTES: &str = r#"
consumers:
  - {name: alice, keys: [t1]}
routes:
  - name: admin
    path_prefix: /admin/
    upstream: backend
    auth: {}
  - name: secret
    host: secret.example.com
    path_prefix: /
    upstream: backend
    auth: {}
  - name: shouting
    path_prefix: /Loud/
    case_insensitive: true
    upstream: backend
    auth: {}
  - name: open
    path_prefix: /
    upstream: backend
"#;

type Seen = Heads;

async fn setup() -> (TestGateway, Seen) {
    let (backend, seen) = recording_backend().await;
    let gw = TestGateway::start(&yaml(backend, ROUTES), SystemClock::new()).await;
    (gw, seen)
}

async fn send(gw: &TestGateway, seen: &Seen, head: &str) -> (u16, Option<String>) {
    let (answer, got) = exchange(gw.addr, seen, head).await;
    (status_of(&answer), got)
}

#[tokio::test]
async fn slashes_and_encoded_letters_do_not_bypass_a_keyed_route() {
    let (gw, seen) = setup().await;
    for path in [
        "//admin/x",
        "/%61dmin/x",
        "/%2561dmin/x",
        "///admin//x",
        "/ADMIN/x",
    ] {
        let (status, got) = send(
            &gw,
            &seen,
            &format!("GET {path} HTTP/1.1\r\nHost: api\r\nConnection: close\r\n\r\n"),
        )
        .await;
        match path {
            // `%25` is an encoded `%`: the backend sees `/%2561dmin/x`, not `/admin/x`.
            "/%2561dmin/x" | "/ADMIN/x" => {
                assert_eq!(status, 200, "{path}");
            }
            _ => {
                assert_eq!(status, 401, "{path} must meet the keyed /admin/ route");
                assert!(got.is_none(), "{path} reached the backend");
            }
        }
    }
    // With a key, the backend gets the normalized path.
    let (status, got) = send(
        &gw,
        &seen,
        "GET //%61dmin//x?apikey=t1 HTTP/1.1\r\nHost: api\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(status, 200);
    let got = got.expect("forwarded");
    assert!(got.starts_with("GET /admin/x HTTP/1.1\r\n"), "{got}");
}

#[tokio::test]
async fn dot_segments_encoded_slashes_and_backslashes_are_refused() {
    let (gw, seen) = setup().await;
    for path in [
        "/open/../admin/x",
        "/open/%2e%2e/admin/x",
        "/open/..;/admin/x",
        "/open%2fadmin",
        "/open%5cadmin",
        "/open/%00",
        "/open/%zz",
    ] {
        let (status, got) = send(
            &gw,
            &seen,
            &format!("GET {path} HTTP/1.1\r\nHost: api\r\nConnection: close\r\n\r\n"),
        )
        .await;
        assert_eq!(status, 400, "{path}");
        assert!(got.is_none(), "{path} reached the backend");
    }
}

#[tokio::test]
async fn a_case_insensitive_route_matches_any_case() {
    let (gw, seen) = setup().await;
    for path in ["/loud/x", "/LOUD/x", "/Loud/x"] {
        let (status, got) = send(
            &gw,
            &seen,
            &format!("GET {path} HTTP/1.1\r\nHost: api\r\nConnection: close\r\n\r\n"),
        )
        .await;
        assert_eq!(status, 401, "{path}");
        assert!(got.is_none());
    }
}

#[tokio::test]
async fn hosts_match_without_case_port_or_trailing_dot() {
    let (gw, seen) = setup().await;
    for host in [
        "secret.example.com",
        "SECRET.example.com",
        "secret.example.com.",
        "secret.example.com.:80",
        "secret.example.com:8080",
    ] {
        let (status, got) = send(
            &gw,
            &seen,
            &format!("GET /x HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"),
        )
        .await;
        assert_eq!(status, 401, "Host: {host} must meet the keyed host route");
        assert!(got.is_none());
    }
}

#[tokio::test]
async fn hosts_a_backend_could_read_otherwise_are_refused() {
    let (gw, seen) = setup().await;
    for host in [
        "user@secret.example.com",
        "secret.example.com:80:80",
        "secret.example.com:x",
        "secret.example.com..",
        ".secret.example.com",
        "secret%2eexample.com",
        "secret.example.com,api",
    ] {
        let (status, got) = send(
            &gw,
            &seen,
            &format!("GET /x HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"),
        )
        .await;
        assert_eq!(status, 400, "Host: {host}");
        assert!(got.is_none(), "Host: {host} reached the backend");
    }
    let (status, got) = send(
        &gw,
        &seen,
        "GET http://user@secret.example.com/x HTTP/1.0\r\n\r\n",
    )
    .await;
    assert_eq!(status, 400, "userinfo in an absolute-form target");
    assert!(got.is_none());
}

#[tokio::test]
async fn host_must_be_single_present_and_agree_with_the_target() {
    let (gw, seen) = setup().await;
    let bad = [
        "GET /x HTTP/1.1\r\nHost: api\r\nHost: secret.example.com\r\n\r\n",
        "GET /x HTTP/1.1\r\nConnection: close\r\n\r\n",
        "GET http://api/x HTTP/1.1\r\nHost: secret.example.com\r\n\r\n",
        "GET http://secret.example.com/x HTTP/1.1\r\nHost: api\r\n\r\n",
        "GET http://secret.example.com/x HTTP/1.1\r\n\r\n",
    ];
    for req in bad {
        let (status, got) = send(&gw, &seen, req).await;
        assert_eq!(status, 400, "{req}");
        assert!(got.is_none(), "{req}");
    }
    // An absolute-form target that agrees with Host is routed by that host.
    let (status, _) = send(
        &gw,
        &seen,
        "GET http://secret.example.com/x HTTP/1.1\r\nHost: secret.example.com\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(status, 401);
    // The target's authority is the request's: a Host naming another port does not go on.
    let (status, got) = send(
        &gw,
        &seen,
        "GET http://api:8080/x HTTP/1.1\r\nHost: api:9999\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(status, 200);
    let got = got.expect("forwarded").to_ascii_lowercase();
    assert!(got.contains("x-forwarded-host: api:8080\r\n"), "{got}");
    assert!(!got.contains("9999"), "{got}");
    // HTTP/1.0 may name its host in the target alone, or leave it out.
    let (status, _) = send(
        &gw,
        &seen,
        "GET http://secret.example.com/x HTTP/1.0\r\n\r\n",
    )
    .await;
    assert_eq!(status, 401, "routed by the target's host");
    let (status, got) = send(&gw, &seen, "GET /x HTTP/1.0\r\n\r\n").await;
    assert_eq!(status, 200);
    let got = got.expect("forwarded");
    assert!(got.starts_with("GET /x HTTP/1.1\r\n"), "{got}");
}

#[tokio::test]
async fn segment_parameters_do_not_bypass_a_keyed_route() {
    // Tomcat, Jetty and Spring drop `;params` from segments before they route. A segment
    // of parameters alone is read two ways behind (an empty segment, or none): refused
    // (400). As the last segment (a session id), it is routed without it: the keyed
    // /admin/ route (401).
    let (gw, seen) = setup().await;
    for (path, want) in [
        ("/;/admin/x", 400),
        ("/;x=1/admin/x", 400),
        ("//;//admin/x", 400),
        ("/admin;x=1/x", 401),
        ("/admin;/x", 401),
        ("/admin/;jsessionid=1", 401),
    ] {
        let (status, got) = send(
            &gw,
            &seen,
            &format!("GET {path} HTTP/1.1\r\nHost: api\r\nConnection: close\r\n\r\n"),
        )
        .await;
        assert_eq!(status, want, "{path}");
        assert!(got.is_none(), "{path} reached the backend");
    }
}
