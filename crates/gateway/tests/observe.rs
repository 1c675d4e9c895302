//! Observability over loopback: request ids, the access log, `/metrics`, the admin API
//! and its token, and the usage history.

mod common;

use common::*;
use http::{Method, StatusCode};
use std::net::SocketAddr;
use tollgate_gateway::ManualClock;

const TOKEN: &str = "s3cret-token";

/// GET or POST on the admin listener with the token.
async fn admin_call(c: &TestClient, addr: SocketAddr, method: Method, path: &str) -> Answer {
    let bearer = format!("Bearer {TOKEN}");
    c.request(
        method,
        &format!("http://{addr}{path}"),
        &[("authorization", &bearer)],
        "",
    )
    .await
}

fn json(a: &Answer) -> serde_json::Value {
    serde_json::from_str(&a.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", a.body))
}

const ROUTES: &str = r#"
plans:
  tiny:
    limits: [{name: two-per-minute, requests: 2, per: 60s}]
consumers:
  - {name: alice, keys: [alice-key], plan: tiny}
  - {name: bob, keys: [bob-key]}
routes:
  - name: api
    path_prefix: /api/
    upstream: backend
    auth: {query: [apikey], header: [X-API-Key]}
  - name: open
    path_prefix: /open/
    upstream: backend
"#;

#[tokio::test]
async fn request_ids_are_made_returned_sent_upstream_and_named_in_refusals() {
    let (backend, seen) = recording_backend().await;
    let gw = TestGateway::start(&yaml(backend, ROUTES), ManualClock::new()).await;
    let c = TestClient::default();

    let a = c.get(&gw.url("/open/x")).await;
    assert_eq!(a.status, StatusCode::OK);
    let id = a.header("x-request-id").to_string();
    assert_eq!(id.len(), 32, "{id}");
    assert!(id.bytes().all(|b| b.is_ascii_hexdigit()));
    let head = seen
        .lock()
        .last()
        .cloned()
        .expect("upstream saw the request");
    assert!(
        head.to_ascii_lowercase()
            .contains(&format!("x-request-id: {id}")),
        "{head}"
    );
    let b = c.get(&gw.url("/open/x")).await;
    assert_ne!(b.header("x-request-id"), id, "ids differ per request");

    // An untrusted client's id is replaced.
    let a = c
        .request(
            Method::GET,
            &gw.url("/open/x"),
            &[("x-request-id", "client-chosen")],
            "",
        )
        .await;
    assert_ne!(a.header("x-request-id"), "client-chosen");
    // Nor does an `_` spelling of the name reach the backend, for backends that read `_`
    // as `-`.
    let a = c
        .request(
            Method::GET,
            &gw.url("/open/x"),
            &[("x_request_id", "forged-id")],
            "",
        )
        .await;
    assert_eq!(a.status, StatusCode::OK);
    let head = seen.lock().last().cloned().expect("seen");
    assert!(!head.contains("forged-id"), "{head}");

    // A refusal names the id in its body.
    let r = c.get(&gw.url("/api/x?apikey=wrong")).await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    let body = json(&r);
    assert_eq!(body["request_id"], r.header("x-request-id"), "{}", r.body);
    assert_eq!(body["error"], "unknown API key");
}

#[tokio::test]
async fn a_listener_that_trusts_request_ids_keeps_them() {
    let (backend, seen) = recording_backend().await;
    let cfg = yaml(backend, ROUTES).replace(
        "listeners: [{address: \"127.0.0.1:0\"}]",
        "listeners: [{address: \"127.0.0.1:0\", trust_request_id: true}]",
    );
    let gw = TestGateway::start(&cfg, ManualClock::new()).await;
    let c = TestClient::default();
    let a = c
        .request(
            Method::GET,
            &gw.url("/open/x"),
            &[("x-request-id", "edge-7f3a")],
            "",
        )
        .await;
    assert_eq!(a.header("x-request-id"), "edge-7f3a");
    let head = seen.lock().last().cloned().expect("seen");
    assert!(
        head.to_ascii_lowercase()
            .contains("x-request-id: edge-7f3a"),
        "{head}"
    );
    // One that would need escaping in JSON is replaced even here.
    let a = c
        .request(
            Method::GET,
            &gw.url("/open/x"),
            &[("x-request-id", "bad\"id")],
            "",
        )
        .await;
    assert_eq!(a.header("x-request-id").len(), 32);
}

/// A gateway on `ROUTES` in front of the echo backend, its listener given `listener`'s
/// settings too, writing its access log to a file of its own; that file, and the backend.
async fn logging_gateway(
    name: &str,
    listener: &str,
) -> (TestGateway, std::path::PathBuf, SocketAddr) {
    let path = tempdir(name).join("access.log");
    let backend = echo_backend().await;
    let cfg = format!(
        "{}access_log: {{path: {}}}\n",
        yaml(backend, ROUTES).replace(
            "{address: \"127.0.0.1:0\"}",
            &format!("{{address: \"127.0.0.1:0\"{listener}}}"),
        ),
        path.display()
    );
    let gw = TestGateway::start(&cfg, ManualClock::new()).await;
    (gw, path, backend)
}

#[tokio::test]
async fn the_access_log_writes_one_json_line_per_request_without_keys() {
    let (gw, path, backend) = logging_gateway("access-log", "").await;
    let dir = path.parent().expect("dir").to_path_buf();
    let c = TestClient::default();

    let ok = c.get(&gw.url("/api/items?apikey=alice-key&page=2")).await;
    assert_eq!(ok.status, StatusCode::OK);
    let _ = c.get(&gw.url("/api/items?apikey=alice-key")).await;
    let limited = c.get(&gw.url("/api/items?page=3&apikey=alice-key")).await;
    assert_eq!(limited.status, StatusCode::TOO_MANY_REQUESTS);
    let unknown = c.get(&gw.url("/api/items?APIKEY=guessed-key")).await;
    assert_eq!(unknown.status, StatusCode::UNAUTHORIZED);
    let nowhere = c.get(&gw.url("/nowhere")).await;
    assert_eq!(nowhere.status, StatusCode::NOT_FOUND);
    // A request refused before its head could be read is named, counted and logged too.
    let bad = raw(
        gw.addr,
        b"POST /api/items?apikey=alice-key HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
    )
    .await;
    assert_eq!(status_of(&bad), 501, "{bad}");
    let bad_id = bad
        .lines()
        .find_map(|l| l.strip_prefix("x-request-id: "))
        .expect("an id")
        .to_string();
    assert!(
        bad.contains(&format!(r#""request_id":"{bad_id}"}}"#)),
        "{bad}"
    );
    let m = gw.gw.metrics_text();
    assert!(
        m.lines()
            .any(|l| l == r#"tollgate_responses_total{code="501"} 1"#),
        "{m}"
    );
    assert!(gw.gw.sync_logs(DEADLINE), "the writer did not catch up");

    let text = std::fs::read_to_string(&path).expect("log file");
    assert!(
        !text.contains("alice-key") && !text.contains("guessed-key"),
        "{text}"
    );
    let lines = log_lines(&path);
    assert_eq!(lines.len(), 6, "{text}");
    let first = &lines[0];
    assert_eq!(first["request_id"], ok.header("x-request-id"));
    assert_eq!(first["method"], "GET");
    assert_eq!(first["path"], "/api/items?page=2");
    assert_eq!(first["route"], "api");
    assert_eq!(first["consumer"], "alice");
    assert_eq!(first["status"], 200);
    assert_eq!(first["client"], "127.0.0.1");
    assert_eq!(first["bytes_out"], ok.body.len());
    assert_eq!(first["upstream_target"], backend.to_string());
    assert!(first["upstream_ms"].as_f64().is_some(), "{first}");
    assert!(first["duration_ms"].as_f64().is_some_and(|d| d >= 0.0));
    assert!(first["time"].as_str().is_some_and(|t| t.ends_with('Z')));
    assert_eq!(lines[2]["status"], 429);
    assert_eq!(lines[2]["limit"], "two-per-minute");
    assert_eq!(lines[2]["refusal"], "rate_limited");
    assert_eq!(lines[2]["path"], "/api/items?page=3");
    assert_eq!(lines[2]["upstream_target"], serde_json::Value::Null);
    assert_eq!(lines[3]["refusal"], "unknown_key");
    assert_eq!(lines[3]["path"], "/api/items");
    assert_eq!(lines[3]["consumer"], serde_json::Value::Null);
    assert_eq!(lines[4]["route"], serde_json::Value::Null);
    assert_eq!(lines[4]["refusal"], "no_route");
    assert_eq!(lines[5]["request_id"], bad_id.as_str());
    assert_eq!(lines[5]["status"], 501);
    assert_eq!(lines[5]["method"], "POST");
    assert_eq!(lines[5]["path"], "/api/items");
    assert_eq!(lines[5]["refusal"], "bad_request");
    let body_len = bad.split_once("\r\n\r\n").map_or(0, |(_, b)| b.len());
    assert!(body_len > 0, "{bad}");
    assert_eq!(lines[5]["bytes_out"], body_len, "{bad}");

    // logrotate: the file is moved away, the gateway reopens on request (SIGUSR1).
    let rotated = dir.join("access.log.1");
    std::fs::rename(&path, &rotated).expect("rotate");
    gw.gw.reopen_logs();
    // Lines queued before the reopen go to the old file; wait until it has happened.
    assert!(gw.gw.sync_logs(DEADLINE));
    let _ = c.get(&gw.url("/open/after-rotation")).await;
    assert!(gw.gw.sync_logs(DEADLINE));
    assert_eq!(log_lines(&rotated).len(), 6);
    let fresh = log_lines(&path);
    assert_eq!(fresh.len(), 1);
    assert_eq!(fresh[0]["path"], "/open/after-rotation");
}

#[tokio::test]
async fn a_body_too_large_is_logged_under_its_consumer_and_not_counted() {
    let (gw, path, _) = logging_gateway("access-log-413", ", max_body_bytes: 1KiB").await;
    let c = TestClient::default();
    let big = "x".repeat(2000);
    for key in ["alice-key", "guessed-key"] {
        let a = c
            .request(
                Method::POST,
                &gw.url(&format!("/api/items?apikey={key}")),
                &[],
                &big,
            )
            .await;
        assert_eq!(a.status, StatusCode::PAYLOAD_TOO_LARGE, "{key}");
    }
    // Not counted: alice's two a minute are both left.
    for _ in 0..2 {
        assert_eq!(
            c.get(&gw.url("/api/items?apikey=alice-key")).await.status,
            StatusCode::OK
        );
    }
    assert!(gw.gw.sync_logs(DEADLINE), "the writer did not catch up");
    let lines = log_lines(&path);
    assert_eq!(lines.len(), 4, "{lines:?}");
    assert_eq!(lines[0]["status"], 413);
    assert_eq!(lines[0]["refusal"], "payload_too_large", "{}", lines[0]);
    assert_eq!(lines[0]["consumer"], "alice", "{}", lines[0]);
    assert_eq!(lines[1]["status"], 413);
    assert_eq!(
        lines[1]["consumer"],
        serde_json::Value::Null,
        "{}",
        lines[1]
    );
}

#[tokio::test]
async fn behind_a_trusted_proxy_the_access_log_names_the_client_it_forwarded_for() {
    let (gw, path, _) = logging_gateway(
        "access-log-proxied",
        ", trusted_proxies: [127.0.0.1, 10.0.0.0/8]",
    )
    .await;
    let c = TestClient::default();
    for xff in [
        // The nearest address that is not a trusted proxy.
        "203.0.113.9, 198.51.100.7",
        // Trusted hops are passed over.
        "198.51.100.8, 10.1.2.3",
        // All trusted: the farthest.
        "10.9.9.9, 127.0.0.1",
        // An entry that is no address: the peer.
        "198.51.100.9, not-an-address",
    ] {
        let a = c
            .request(
                Method::GET,
                &gw.url("/open/x"),
                &[("x-forwarded-for", xff)],
                "",
            )
            .await;
        assert_eq!(a.status, StatusCode::OK);
    }
    let _ = c.get(&gw.url("/open/no-header")).await;
    assert!(gw.gw.sync_logs(DEADLINE), "the writer did not catch up");
    let clients: Vec<String> = log_lines(&path)
        .iter()
        .map(|l| l["client"].as_str().unwrap_or("?").to_string())
        .collect();
    assert_eq!(
        clients,
        [
            "198.51.100.7",
            "198.51.100.8",
            "10.9.9.9",
            "127.0.0.1",
            "127.0.0.1"
        ]
    );
}

#[tokio::test]
async fn the_access_log_counts_a_chunked_body_as_it_is_read() {
    let (gw, path, _) = logging_gateway("access-log-chunked", "").await;
    let sent = raw(
        gw.addr,
        b"POST /open/x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
    )
    .await;
    assert_eq!(status_of(&sent), 200, "{sent}");
    let declared = raw(
        gw.addr,
        b"POST /open/y HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nConnection: close\r\n\r\nabc",
    )
    .await;
    assert_eq!(status_of(&declared), 200, "{declared}");
    assert!(gw.gw.sync_logs(DEADLINE), "the writer did not catch up");
    let lines = log_lines(&path);
    let bytes_in: Vec<_> = lines.iter().map(|l| l["bytes_in"].clone()).collect();
    assert_eq!(bytes_in, [serde_json::json!(11), serde_json::json!(3)]);
}

#[tokio::test]
async fn the_access_log_names_the_target_of_a_cache_miss_and_of_a_failure() {
    let dir = tempdir("access-log-targets");
    let path = dir.join("access.log");
    let backend = echo_backend().await;
    // A port nothing listens on: the connection is refused.
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port");
    let cfg = format!(
        r#"listeners: [{{address: "127.0.0.1:0"}}]
upstreams:
  backend: {{targets: ["{backend}"], response_timeout: 2s}}
  gone: {{targets: ["{dead}"], connect_timeout: 1s, health: {{failures: 1, backoff: 1h}}}}
  down: {{targets: ["{dead}"], connect_timeout: 1s, health: {{path: /health, interval: 50ms, timeout: 1s, unhealthy: 1, failures: 0}}}}
access_log: {{path: {}}}
routes:
  - {{name: cached, path_prefix: /cached/, upstream: backend, cache: {{default_ttl: 10s}}}}
  - {{name: gone, path_prefix: /gone/, upstream: gone}}
  - {{name: down, path_prefix: /down/, upstream: down}}
"#,
        path.display()
    );
    let gw = TestGateway::start(&cfg, ManualClock::new()).await;
    let c = TestClient::default();
    let miss = c.get(&gw.url("/cached/x")).await;
    assert!(
        miss.header("cache-status").contains("fwd=uri-miss"),
        "{:?}",
        miss.headers
    );
    let hit = c.get(&gw.url("/cached/x")).await;
    assert!(
        hit.header("cache-status").contains("hit"),
        "{:?}",
        hit.headers
    );
    assert_eq!(
        c.get(&gw.url("/gone/x")).await.status,
        StatusCode::BAD_GATEWAY
    );
    // An upstream whose one target active checks hold out refuses before any is tried
    // (passive checks alone never leave an upstream without targets).
    let out = format!("tollgate_upstream_target_healthy{{upstream=\"down\",target=\"{dead}\"}} 0");
    bounded("active checks", async {
        let mut tick = tokio::time::interval(std::time::Duration::from_millis(20));
        loop {
            tick.tick().await;
            if gw.gw.metrics_text().lines().any(|l| l == out) {
                return;
            }
        }
    })
    .await;
    assert_eq!(
        c.get(&gw.url("/down/y")).await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert!(gw.gw.sync_logs(DEADLINE), "the writer did not catch up");
    let lines = log_lines(&path);
    assert_eq!(lines.len(), 4, "{lines:?}");
    // The miss went to the backend, the hit nowhere, the failure to the target it tried.
    assert_eq!(lines[0]["upstream_target"], backend.to_string());
    assert!(lines[0]["upstream_ms"].as_f64().is_some(), "{}", lines[0]);
    assert_eq!(lines[1]["upstream_target"], serde_json::Value::Null);
    assert_eq!(lines[2]["status"], 502);
    assert_eq!(lines[2]["upstream_target"], dead.to_string());
    assert!(lines[2]["upstream_ms"].as_f64().is_some(), "{}", lines[2]);
    // No target tried, no time upstream.
    assert_eq!(lines[3]["status"], 503);
    assert_eq!(lines[3]["upstream_target"], serde_json::Value::Null);
    assert_eq!(
        lines[3]["upstream_ms"],
        serde_json::Value::Null,
        "{}",
        lines[3]
    );
    // Nor in the route's upstream histogram: the 502's try is there, the 503 is not.
    let m = gw.gw.metrics_text();
    let count = r#"tollgate_upstream_duration_seconds_count{route="gone"} 1"#;
    assert!(m.lines().any(|l| l == count), "{m}");
    let none = r#"tollgate_upstream_duration_seconds_count{route="down"}"#;
    assert!(
        m.lines()
            .all(|l| !l.starts_with(none) || l.ends_with("} 0")),
        "{m}"
    );
}

#[tokio::test]
async fn an_unwritable_access_log_is_counted_never_blocks_requests_and_comes_back() {
    let backend = echo_backend().await;
    let dir = tempdir("access-log-later");
    let later = dir.join("later");
    let path = later.join("access.log");
    let cfg = format!(
        "{}access_log: {{path: {}}}\n",
        yaml(backend, ROUTES),
        path.display()
    );
    let gw = TestGateway::start(&cfg, ManualClock::new()).await;
    let c = TestClient::default();
    for _ in 0..3 {
        assert_eq!(c.get(&gw.url("/open/x")).await.status, StatusCode::OK);
    }
    assert!(gw.gw.sync_logs(DEADLINE));
    let m = gw.gw.metrics_text();
    assert!(m.contains("tollgate_access_log_dropped_total 3"), "{m}");
    assert!(m.contains("tollgate_access_log_errors_total 1"), "{m}");
    // The directory made, lines reach the file again without a signal (the writer tries
    // the file again about once a second while lines come); the failure was counted once.
    std::fs::create_dir(&later).expect("mkdir");
    let until = std::time::Instant::now() + DEADLINE;
    while log_lines(&path).is_empty() {
        assert!(std::time::Instant::now() < until, "the log never came back");
        assert_eq!(c.get(&gw.url("/open/x")).await.status, StatusCode::OK);
        assert!(gw.gw.sync_logs(DEADLINE));
    }
    let m = gw.gw.metrics_text();
    assert!(m.contains("tollgate_access_log_errors_total 1"), "{m}");
}

/// The value of the sample `line_start` (name and labels as written) in `metrics`.
fn sample(metrics: &str, line_start: &str) -> Option<f64> {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(line_start)?.trim().parse().ok())
}

#[tokio::test]
async fn metrics_count_requests_refusals_limits_latency_and_connections() {
    let backend = echo_backend().await;
    let gw = TestGateway::start(&yaml(backend, ROUTES), ManualClock::new()).await;
    let addr = start_admin(&gw.gw, Some(TOKEN)).await;
    let c = TestClient::default();
    for _ in 0..3 {
        let _ = c.get(&gw.url("/api/x?apikey=alice-key")).await;
    }
    let _ = c.get(&gw.url("/api/x")).await;
    let _ = c
        .request(Method::POST, &gw.url("/open/x"), &[], "hello")
        .await;
    let _ = c.get(&gw.url("/elsewhere")).await;

    // What Prometheus asks for: OpenMetrics.
    let bearer = format!("Bearer {TOKEN}");
    let m = c
        .request(
            Method::GET,
            &format!("http://{addr}/metrics"),
            &[
                ("authorization", &bearer),
                (
                    "accept",
                    "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5",
                ),
            ],
            "",
        )
        .await;
    assert_eq!(m.status, StatusCode::OK);
    assert!(m
        .header("content-type")
        .starts_with("application/openmetrics-text"));
    // Anyone else (curl, text-format scrapers): the text format, counters typed by the
    // names of their samples, the same samples.
    let plain = admin_call(&c, addr, Method::GET, "/metrics").await;
    assert_eq!(
        plain.header("content-type"),
        "text/plain; version=0.0.4; charset=utf-8"
    );
    assert!(
        plain
            .body
            .contains("\n# TYPE tollgate_requests_total counter\n"),
        "{}",
        plain.body
    );
    assert!(!plain.body.contains("# EOF"));
    let samples = |t: &str| -> Vec<String> {
        t.lines()
            .filter(|l| !l.starts_with('#') && !l.starts_with("tollgate_client_connections"))
            .map(str::to_string)
            .collect()
    };
    assert_eq!(samples(&plain.body).len(), samples(&m.body).len());
    let t = &m.body;
    let at = |s: &str| sample(t, s).unwrap_or_else(|| panic!("no {s} in\n{t}"));
    assert_eq!(
        at(r#"tollgate_requests_total{route="api",method="GET",class="2xx"}"#),
        2.0
    );
    assert_eq!(
        at(r#"tollgate_requests_total{route="api",method="GET",class="4xx"}"#),
        2.0
    );
    assert_eq!(
        at(r#"tollgate_requests_total{route="open",method="POST",class="2xx"}"#),
        1.0
    );
    assert_eq!(
        at(r#"tollgate_requests_total{route="",method="GET",class="4xx"}"#),
        1.0
    );
    assert_eq!(at(r#"tollgate_refusals_total{reason="rate_limited"}"#), 1.0);
    assert_eq!(at(r#"tollgate_refusals_total{reason="missing_key"}"#), 1.0);
    assert_eq!(at(r#"tollgate_refusals_total{reason="no_route"}"#), 1.0);
    assert_eq!(
        at(r#"tollgate_limit_refusals_total{limit="two-per-minute"}"#),
        1.0
    );
    assert_eq!(
        at(r#"tollgate_request_duration_seconds_count{route="api"}"#),
        4.0
    );
    assert_eq!(
        at(r#"tollgate_upstream_duration_seconds_count{route="api"}"#),
        2.0
    );
    assert_eq!(at(r#"tollgate_responses_total{code="429"}"#), 1.0);
    assert!(at("tollgate_client_connections") >= 1.0);
    assert!(at("tollgate_client_connections_accepted_total") >= 1.0);
    assert!(
        at(&format!(
            r#"tollgate_upstream_connections{{upstream="backend",target="{backend}"}}"#
        )) >= 1.0
    );
    // No series per consumer unless asked for.
    assert!(!t.contains("tollgate_consumer_requests_total{"), "{t}");
    assert!(t.trim_end().ends_with("# EOF"));
    // Every metric is described by one sentence.
    for help in t.lines().filter(|l| l.starts_with("# HELP ")) {
        assert!(help.ends_with('.') && !help.ends_with(".."), "{help}");
    }
}

#[tokio::test]
async fn per_consumer_metrics_only_when_configured() {
    let backend = echo_backend().await;
    let cfg = format!("{}metrics: {{per_consumer: true}}\n", yaml(backend, ROUTES));
    let gw = TestGateway::start(&cfg, ManualClock::new()).await;
    let c = TestClient::default();
    let _ = c.get(&gw.url("/api/x?apikey=bob-key")).await;
    let t = gw.gw.metrics_text();
    assert_eq!(
        sample(
            &t,
            r#"tollgate_consumer_requests_total{consumer="bob",class="2xx"}"#
        ),
        Some(1.0),
        "{t}"
    );
}

#[tokio::test]
async fn the_admin_api_asks_for_its_token_everywhere_but_health_and_the_page() {
    let backend = echo_backend().await;
    let gw = TestGateway::start(&yaml(backend, ROUTES), ManualClock::new()).await;
    let addr = start_admin(&gw.gw, Some(TOKEN)).await;
    let c = TestClient::default();
    for path in [
        "/metrics",
        "/status",
        "/usage/alice",
        "/analytics",
        "/config",
        "/cache",
        "/top",
    ] {
        let a = c.get(&format!("http://{addr}{path}")).await;
        assert_eq!(a.status, StatusCode::UNAUTHORIZED, "{path}");
        assert_eq!(a.body, r#"{"error":"admin token required","status":401}"#);
        let wrong = c
            .request(
                Method::GET,
                &format!("http://{addr}{path}"),
                &[("authorization", "Bearer s3cret-tokem")],
                "",
            )
            .await;
        assert_eq!(wrong.status, StatusCode::UNAUTHORIZED, "{path}");
    }
    let post = c
        .request(Method::POST, &format!("http://{addr}/reload"), &[], "")
        .await;
    assert_eq!(post.status, StatusCode::UNAUTHORIZED);
    assert_eq!(
        c.get(&format!("http://{addr}/healthz")).await.status,
        StatusCode::OK
    );
    let page = c.get(&format!("http://{addr}/")).await;
    assert_eq!(page.status, StatusCode::OK);
    assert!(page.header("content-type").starts_with("text/html"));
    assert!(!page.body.contains("src=\"http"), "no external scripts");
    let ok = admin_call(&c, addr, Method::GET, "/usage/alice").await;
    assert_eq!(ok.status, StatusCode::OK, "{}", ok.body);
    assert_eq!(json(&ok)["counted"], "requests", "{}", ok.body);
    let bad = admin_call(&c, addr, Method::GET, "/reload").await;
    assert_eq!(bad.status, StatusCode::METHOD_NOT_ALLOWED);
    let bad = admin_call(&c, addr, Method::GET, "/analytics?step=5m").await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    assert!(json(&bad)["error"]
        .as_str()
        .unwrap_or("")
        .contains("1m, 1h or 1d"));
}

#[tokio::test]
async fn status_config_and_reload_over_the_admin_api() {
    let dir = tempdir("admin-reload");
    let backend = echo_backend().await;
    let file = dir.join("tollgate.yaml");
    let first = yaml(backend, ROUTES);
    std::fs::write(&file, &first).expect("write");
    let gw = TestGateway::start(&first, ManualClock::new()).await;
    gw.gw.loaded_from(first.as_bytes());
    gw.gw.set_source(&file);
    let addr = start_admin(&gw.gw, Some(TOKEN)).await;
    let c = TestClient::default();

    let s = json(&admin_call(&c, addr, Method::GET, "/status").await);
    assert_eq!(s["config"]["generation"], 1);
    assert_eq!(s["config"]["last_reload_error"], serde_json::Value::Null);
    assert_eq!(s["version"], env!("CARGO_PKG_VERSION"));
    assert!(s["uptime_seconds"].is_u64());
    // A parameter the endpoint does not take is named in a 400.
    let bad = admin_call(&c, addr, Method::GET, "/status?verbose=1").await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST, "{}", bad.body);
    assert_eq!(
        json(&bad)["error"],
        "unknown query parameter \"verbose\": /status takes none"
    );

    let cfg = admin_call(&c, addr, Method::GET, "/config").await;
    assert_eq!(cfg.status, StatusCode::OK);
    assert!(!cfg.body.contains("alice-key"), "{}", cfg.body);
    let v = json(&cfg);
    assert_eq!(v["config"]["consumers"][0]["name"], "alice");
    assert_eq!(v["config"]["consumers"][0]["keys"][0], "<redacted>");

    // Unchanged file: nothing applied.
    let r = admin_call(&c, addr, Method::POST, "/reload").await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(json(&r)["reloaded"], false);

    // A new route appears after a reload.
    let second = first.replace("path_prefix: /open/", "path_prefix: /public/");
    std::fs::write(&file, &second).expect("write");
    let r = admin_call(&c, addr, Method::POST, "/reload").await;
    assert_eq!(json(&r)["reloaded"], true, "{}", r.body);
    assert_eq!(json(&r)["generation"], 2);
    assert_eq!(c.get(&gw.url("/public/x")).await.status, StatusCode::OK);

    // A bad file is refused with its problems; the running config keeps serving.
    std::fs::write(
        &file,
        second.replace("upstream: backend", "upstream: nowhere"),
    )
    .expect("w");
    let r = admin_call(&c, addr, Method::POST, "/reload").await;
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY);
    let problems = json(&r)["problems"].to_string();
    assert!(
        problems.contains("routes[") && problems.contains("nowhere"),
        "{problems}"
    );
    assert_eq!(c.get(&gw.url("/public/x")).await.status, StatusCode::OK);
    let s = json(&admin_call(&c, addr, Method::GET, "/status").await);
    assert_eq!(s["config"]["generation"], 2);
    assert!(s["config"]["last_reload_error"]
        .as_str()
        .is_some_and(|e| e.contains("nowhere")));
    let m = gw.gw.metrics_text();
    assert_eq!(sample(&m, "tollgate_config_reloads_total"), Some(1.0));
    assert_eq!(sample(&m, "tollgate_config_reload_errors_total"), Some(1.0));

    // The file mended back to what runs: nothing to apply, and the error is gone.
    std::fs::write(&file, &second).expect("w");
    let r = admin_call(&c, addr, Method::POST, "/reload").await;
    assert_eq!(json(&r)["reloaded"], false, "{}", r.body);
    let s = json(&admin_call(&c, addr, Method::GET, "/status").await);
    assert_eq!(s["config"]["last_reload_error"], serde_json::Value::Null);
    assert_eq!(s["config"]["generation"], 2);

    // A file gone is a rejected reload too: answered, counted and shown.
    let away = dir.join("away.yaml");
    std::fs::rename(&file, &away).expect("move");
    let r = admin_call(&c, addr, Method::POST, "/reload").await;
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", r.body);
    let s = json(&admin_call(&c, addr, Method::GET, "/status").await);
    assert!(
        s["config"]["last_reload_error"]
            .as_str()
            .is_some_and(|e| e.contains("cannot read")),
        "{s}"
    );
    let m = gw.gw.metrics_text();
    assert_eq!(sample(&m, "tollgate_config_reload_errors_total"), Some(2.0));
    assert_eq!(c.get(&gw.url("/public/x")).await.status, StatusCode::OK);
    std::fs::rename(&away, &file).expect("back");
}

#[tokio::test]
async fn refusals_after_the_consumer_is_known_count_under_it_and_a_405_under_its_route() {
    let backend = echo_backend().await;
    let routes = ROUTES.replace(
        "    path_prefix: /open/\n    upstream: backend\n",
        "    path_prefix: /open/\n    upstream: backend\n    methods: [GET]\n  - name: bobs\n    path_prefix: /bobs/\n    upstream: backend\n    auth: {query: [apikey]}\n    allow: {consumers: [bob]}\n",
    );
    let dir = tempdir("refusals");
    let cfg = format!(
        "{}metrics: {{per_consumer: true}}\naccess_log: {{path: {}}}\nanalytics: {{path: {}}}\n",
        yaml(backend, &routes),
        dir.join("access.log").display(),
        dir.join("analytics.db").display()
    );
    let gw = TestGateway::start(&cfg, ManualClock::new()).await;
    let c = TestClient::default();
    for _ in 0..3 {
        let _ = c.get(&gw.url("/api/x?apikey=alice-key")).await;
    }
    let forbidden = c.get(&gw.url("/bobs/x?apikey=alice-key")).await;
    assert_eq!(
        forbidden.status,
        StatusCode::FORBIDDEN,
        "{}",
        forbidden.body
    );
    let not_allowed = c.request(Method::POST, &gw.url("/open/x"), &[], "x").await;
    assert_eq!(not_allowed.status, StatusCode::METHOD_NOT_ALLOWED);
    let t = gw.gw.metrics_text();
    let at = |s: &str| sample(&t, s).unwrap_or_else(|| panic!("no {s} in\n{t}"));
    // Alice's 429 and her 403 are hers.
    assert_eq!(
        at(r#"tollgate_consumer_requests_total{consumer="alice",class="4xx"}"#),
        2.0
    );
    assert_eq!(
        at(r#"tollgate_requests_total{route="open",method="POST",class="4xx"}"#),
        1.0
    );
    // The access log names her on the 429 and the 403.
    assert!(gw.gw.sync_logs(DEADLINE), "the writer did not catch up");
    let log = std::fs::read_to_string(dir.join("access.log")).expect("log");
    for status in ["429", "403"] {
        let line = log
            .lines()
            .find(|l| l.contains(&format!("\"status\":{status}")))
            .unwrap_or_else(|| panic!("no {status} in {log}"));
        assert!(line.contains("\"consumer\":\"alice\""), "{line}");
    }
    let line = log
        .lines()
        .find(|l| l.contains("\"status\":405"))
        .unwrap_or_else(|| panic!("no 405 in {log}"));
    assert!(line.contains("\"route\":\"open\""), "{line}");
    // And so does the usage history.
    gw.gw.flush_all().await;
    let admin = start_admin(&gw.gw, Some(TOKEN)).await;
    let h = admin_call(
        &c,
        admin,
        Method::GET,
        "/analytics?consumer=alice&step=1m&from=0",
    )
    .await;
    let v = json(&h);
    let refused: u64 = v["rows"]
        .as_array()
        .expect("rows")
        .iter()
        .filter(|r| r["status"] == "4xx")
        .map(|r| r["count"].as_u64().unwrap_or(0))
        .sum();
    assert_eq!(refused, 2, "{v}");
    // An unknown consumer is named in the answer.
    let u = admin_call(&c, admin, Method::GET, "/usage/nobody").await;
    assert_eq!(u.status, StatusCode::NOT_FOUND);
    assert!(
        u.body.contains(r#"no consumer named \"nobody\""#),
        "{}",
        u.body
    );
    let _ = std::fs::remove_dir_all(&dir);
}
