//! Rate limits over real sockets, with a manual clock: exact under concurrency, several
//! limits together, counters across reloads.

mod common;

use common::*;
use http::StatusCode;
use std::time::Duration;

fn limited(backend: std::net::SocketAddr, limits: &str, extra_consumer: bool) -> String {
    let extra = if extra_consumer {
        "\n  - {name: carol, keys: [t3], plan: gold}"
    } else {
        ""
    };
    yaml(
        backend,
        &format!(
            r#"
plans:
  gold: {{limits: {limits}}}
consumers:
  - {{name: alice, keys: [t1], plan: gold}}
  - {{name: bob, keys: [t2], plan: gold}}{extra}
routes:
  - {{name: test, path_prefix: /test/, upstream: backend, auth: {{query: [apikey]}}}}
"#
        ),
    )
}

#[tokio::test]
async fn one_per_30s_passes_the_first_and_refuses_the_rest() {
    let backend = echo_backend().await;
    let (gw, clock) =
        TestGateway::with_manual_clock(&limited(backend, "[{requests: 1, per: 30s}]", false)).await;
    let c = TestClient::default();
    assert_eq!(
        c.get(&gw.url("/test/?apikey=t1")).await.status,
        StatusCode::OK
    );
    for _ in 0..5 {
        let a = c.get(&gw.url("/test/?apikey=t1")).await;
        assert_eq!(a.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(
            a.refusal(),
            r#"{"status":429,"error":"rate limit exceeded","limit":"1-per-30s","retry_after":33}"#
        );
        assert_eq!(a.header("retry-after"), "33");
        assert_eq!(a.header("ratelimit-policy"), "\"1-per-30s\";q=1;w=30");
        assert_eq!(a.header("ratelimit"), "\"1-per-30s\";r=0;t=33");
    }
    // Other consumers have their own counters.
    assert_eq!(
        c.get(&gw.url("/test/?apikey=t2")).await.status,
        StatusCode::OK
    );
    // Still refused within the window; admitted once Retry-After has passed.
    clock.advance(Duration::from_secs(32));
    assert_eq!(
        c.get(&gw.url("/test/?apikey=t1")).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    clock.advance(Duration::from_secs(1));
    assert_eq!(
        c.get(&gw.url("/test/?apikey=t1")).await.status,
        StatusCode::OK
    );
    assert_eq!(
        c.get(&gw.url("/test/?apikey=t1")).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
}

/// How many of the tasks' answers were 200 and how many 429 (anything else fails).
async fn admitted_and_refused(
    tasks: Vec<tokio::task::JoinHandle<Vec<StatusCode>>>,
) -> (usize, usize) {
    let mut ok = 0;
    let mut refused = 0;
    for t in tasks {
        for code in t.await.expect("task") {
            match code {
                StatusCode::OK => ok += 1,
                StatusCode::TOO_MANY_REQUESTS => refused += 1,
                other => panic!("unexpected {other}"),
            }
        }
    }
    (ok, refused)
}

#[tokio::test]
async fn exact_under_concurrency() {
    let backend = echo_backend().await;
    let (gw, _clock) =
        TestGateway::with_manual_clock(&limited(backend, "[{requests: 50, per: 10s}]", false))
            .await;
    let url = gw.url("/test/?apikey=t1");
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let url = url.clone();
        // A client per task: 16 connections at once.
        tasks.push(tokio::spawn(async move {
            let c = TestClient::default();
            let mut codes = Vec::new();
            for _ in 0..25 {
                codes.push(c.get(&url).await.status);
            }
            codes
        }));
    }
    assert_eq!(admitted_and_refused(tasks).await, (50, 350));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn exact_under_concurrency_across_reloads_and_sub_windows() {
    let backend = echo_backend().await;
    let configs = [
        limited(backend, "[{requests: 50, per: 10s}]", false),
        limited(backend, "[{requests: 50, per: 10s}]", true),
    ];
    let (gw, clock) = TestGateway::with_manual_clock(&configs[0]).await;
    let url = gw.url("/test/?apikey=t1");
    let mut tasks = Vec::new();
    for task in 0..16 {
        let url = url.clone();
        let (gw, clock, configs) = (gw.gw.clone(), clock.clone(), configs.clone());
        tasks.push(tokio::spawn(async move {
            let c = TestClient::default();
            let mut codes = Vec::new();
            for i in 0..25 {
                codes.push(c.get(&url).await.status);
                // One client also reloads after each answer and moves the clock 40 ms
                // (1 s in all, well inside the window): counts kept in the consumer's slot,
                // moved to cells at a reload or at a second sub-window, must all hold.
                if task == 0 {
                    gw.apply(config(&configs[(i + 1) % 2]));
                    clock.advance(Duration::from_millis(40));
                }
            }
            codes
        }));
    }
    assert_eq!(admitted_and_refused(tasks).await, (50, 350));
}

#[tokio::test]
async fn a_request_refused_by_one_limit_uses_up_none() {
    let backend = echo_backend().await;
    let limits = "[{requests: 3, per: 1s, name: fast}, {requests: 5, per: 100s, name: slow}]";
    let (gw, clock) = TestGateway::with_manual_clock(&limited(backend, limits, false)).await;
    let c = TestClient::default();
    let mut codes = Vec::new();
    for _ in 0..5 {
        codes.push(c.get(&gw.url("/test/?apikey=t1")).await.status.as_u16());
    }
    assert_eq!(codes, [200, 200, 200, 429, 429]);
    let a = c.get(&gw.url("/test/?apikey=t1")).await;
    assert!(
        a.header("ratelimit").starts_with("\"fast\";r=0"),
        "{:?}",
        a.headers
    );
    // The refused calls did not count against `slow`: two more fit after `fast` frees up.
    clock.advance(Duration::from_secs(2));
    let a = c.get(&gw.url("/test/?apikey=t1")).await;
    assert_eq!(a.status, StatusCode::OK);
    assert!(
        a.header("ratelimit").starts_with("\"slow\";r=1;"),
        "{:?}",
        a.headers
    );
    assert_eq!(
        c.get(&gw.url("/test/?apikey=t1")).await.status,
        StatusCode::OK
    );
    let a = c.get(&gw.url("/test/?apikey=t1")).await;
    assert_eq!(a.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(a.body.contains("\"limit\":\"slow\""), "{}", a.body);
}

#[tokio::test]
async fn counters_survive_a_reload_that_keeps_the_limits_window() {
    let backend = echo_backend().await;
    let five = limited(backend, "[{requests: 5, per: 10s}]", false);
    let (gw, _clock) = TestGateway::with_manual_clock(&five).await;
    let c = TestClient::default();
    let codes = |n| {
        let c = c.clone();
        let url = gw.url("/test/?apikey=t1");
        async move {
            let mut codes = Vec::new();
            for _ in 0..n {
                codes.push(c.get(&url).await.status.as_u16());
            }
            codes
        }
    };
    assert_eq!(codes(3).await, [200, 200, 200]);
    // Another consumer added: alice's limit is the same, so her count carries over.
    gw.apply(&limited(backend, "[{requests: 5, per: 10s}]", true));
    assert_eq!(codes(3).await, [200, 200, 429]);
    assert_eq!(
        c.get(&gw.url("/test/?apikey=t3")).await.status,
        StatusCode::OK
    );
    // The limit raised: the five calls made still count, against seven.
    gw.apply(&limited(backend, "[{requests: 7, per: 10s}]", true));
    assert_eq!(codes(3).await, [200, 200, 429]);
    // Lowered: refused until the window holds fewer than three.
    gw.apply(&limited(backend, "[{requests: 3, per: 10s}]", true));
    assert_eq!(codes(1).await, [429]);
    // A new window is a new limit: new counters.
    gw.apply(&limited(backend, "[{requests: 3, per: 20s}]", true));
    assert_eq!(codes(4).await, [200, 200, 200, 429]);
}

#[tokio::test]
async fn route_limits_add_to_the_plan() {
    let backend = echo_backend().await;
    let cfg = yaml(
        backend,
        r#"
plans:
  gold: {limits: [{requests: 100, per: 1m}]}
consumers:
  - {name: alice, keys: [t1], plan: gold}
routes:
  - {name: cheap, path_prefix: /cheap/, upstream: backend, auth: {}}
  - {name: costly, path_prefix: /costly/, upstream: backend, auth: {}, limits: [{requests: 2, per: 1h, name: costly-hourly}]}
"#,
    );
    let (gw, _clock) = TestGateway::with_manual_clock(&cfg).await;
    let c = TestClient::default();
    let codes: Vec<u16> = {
        let mut v = Vec::new();
        for _ in 0..3 {
            v.push(c.get(&gw.url("/costly/?apikey=t1")).await.status.as_u16());
        }
        v
    };
    assert_eq!(codes, [200, 200, 429]);
    let a = c.get(&gw.url("/cheap/?apikey=t1")).await;
    assert_eq!(a.status, StatusCode::OK);
    // The plan's limit counted all four admitted calls across both routes.
    assert!(
        a.header("ratelimit").starts_with("\"100-per-1m\";r=97;"),
        "{:?}",
        a.headers
    );
}
