//! Limits shared by several nodes through a real Redis.

mod common;

use common::redis::RedisServer;
use common::*;
use http::StatusCode;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tollgate_gateway::ManualClock;

const WINDOW: u64 = 10_000_000_000;

fn config(backend: SocketAddr, redis: &str, limit: &str, down: &str) -> String {
    yaml(
        backend,
        &format!(
            r#"
cluster: {{redis: "{redis}", sync_interval: 5ms, on_redis_down: {down}, key_prefix: tgtest}}
plans:
  standard: {{limits: [{limit}]}}
consumers:
  - {{name: alice, keys: [k1], plan: standard}}
routes:
  - {{name: test, path_prefix: /test/, upstream: backend, auth: {{}}}}
"#
        ),
    )
}

async fn until(what: &str, nodes: &[TestGateway], f: impl Fn(&TestGateway) -> bool) {
    bounded(what, async {
        for n in nodes {
            while !f(n) {
                synced(n).await;
            }
        }
    })
    .await;
}

async fn nodes(n: usize, yaml: &str, clock: &Arc<ManualClock>) -> Vec<TestGateway> {
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(TestGateway::start(yaml, clock.clone()).await);
    }
    until("nodes see each other", &out, |g| {
        g.gw.cluster()
            .is_some_and(|c| c.is_up() && c.nodes() == n as u64)
    })
    .await;
    out
}

/// A manual clock at the start of a window, far from the Unix epoch's first windows.
fn clock() -> Arc<ManualClock> {
    let c = ManualClock::new();
    c.advance(Duration::from_nanos(1_700_000_000 * 1_000_000_000));
    c
}

/// The hash holding alice's counts of `limit` per sub-window.
fn limit_key(limit: &str) -> String {
    format!("tgtest:consumer:{{alice}}:{limit}")
}

/// A window and its tenth: a count leaves the sliding window that long after its
/// sub-window began.
const SLIDE: Duration = Duration::from_nanos(WINDOW + WINDOW / 10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_hold_1000_per_10s_within_2_percent_at_5x_split_70_20_10() {
    let redis = RedisServer::start();
    let backend = echo_backend().await;
    let clock = clock();
    let cfg = config(backend, &redis.url(), "{requests: 1000, per: 10s}", "open");
    let nodes = nodes(3, &cfg, &clock).await;
    let clients: Vec<TestClient> = (0..3).map(|_| TestClient::default()).collect();
    let split = [35, 10, 5];
    for window in 0..3 {
        let mut admitted = 0;
        // 5,000 requests (5× the limit) in 100 rounds of 50, split 70/20/10.
        for _ in 0..100 {
            for (i, share) in split.iter().enumerate() {
                for _ in 0..*share {
                    let a = clients[i].get(&nodes[i].url("/test/?apikey=k1")).await;
                    match a.status {
                        StatusCode::OK => admitted += 1,
                        StatusCode::TOO_MANY_REQUESTS => {}
                        s => panic!("unexpected {s}: {}", a.body),
                    }
                }
            }
            for n in &nodes {
                synced(n).await;
            }
        }
        assert!(
            (980..=1020).contains(&admitted),
            "window {window}: {admitted} admitted cluster-wide for a limit of 1000"
        );
        // Redis counts every admitted request (granted, or on credit: at most 3 per node).
        let counted = redis.hsum(&limit_key("per-10s:10"));
        assert!(
            (admitted..=1009).contains(&counted),
            "window {window}: {counted} counted, {admitted} admitted"
        );
        clock.advance(SLIDE);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_per_30s_admits_exactly_one_request_per_window_cluster_wide() {
    let redis = RedisServer::start();
    let backend = echo_backend().await;
    let clock = clock();
    let cfg = config(backend, &redis.url(), "{requests: 1, per: 30s}", "open");
    let nodes = nodes(3, &cfg, &clock).await;
    let c = TestClient::default();
    for window in 0..3 {
        let mut admitted = 0;
        for i in 0..30 {
            let node = &nodes[i % 3];
            if c.get(&node.url("/test/?apikey=k1")).await.status == StatusCode::OK {
                admitted += 1;
            }
            synced(node).await;
        }
        assert_eq!(admitted, 1, "window {window}");
        // The call counts until its sub-window (3 s) has left the window: 33 s.
        clock.advance(Duration::from_secs(33));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_calling_slowly_on_every_node_is_never_refused_below_its_limit() {
    // 100 per 10 s on 3 nodes: no credit (1% of 100 is less than one a node), and one call
    // a second on each node meets a new sub-window each time, with no token in hand. The
    // call waits for its lease instead of being refused.
    let redis = RedisServer::start();
    let backend = echo_backend().await;
    let clock = clock();
    let cfg = config(backend, &redis.url(), "{requests: 100, per: 10s}", "open");
    let nodes = nodes(3, &cfg, &clock).await;
    let c = TestClient::default();
    for second in 0..8 {
        for (i, node) in nodes.iter().enumerate() {
            let a = c.get(&node.url("/test/?apikey=k1")).await;
            assert_eq!(
                a.status,
                StatusCode::OK,
                "second {second}, node {i}: {}",
                a.body
            );
        }
        clock.advance(Duration::from_secs(1));
    }
    // All 24 counted in Redis (tokens leased; unused ones given back later), and usage
    // says what it reads there is tokens granted.
    let counted = redis.hsum(&limit_key("per-10s:10"));
    assert!(counted >= 24, "{counted} counted");
    let g = &nodes[0].gw;
    let u = tollgate_gateway::usage::usage(
        &g.snapshot(),
        g.cluster().map(|c| c.as_ref()),
        "alice",
        g.now(),
    )
    .await
    .expect("usage");
    assert_eq!((u.shared, u.counted), (true, "granted"));
    assert!(u.limits[0].used >= 24, "{u:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_limit_on_one_node_admits_every_call_below_it() {
    // 20 per 10 s, one call a second: the node must not lease the whole limit at once and
    // then take itself for full after giving the unused tokens back.
    let redis = RedisServer::start();
    let backend = echo_backend().await;
    let clock = clock();
    let cfg = config(backend, &redis.url(), "{requests: 20, per: 10s}", "open");
    let nodes = nodes(1, &cfg, &clock).await;
    let c = TestClient::default();
    for second in 0..15 {
        for i in 0..(1 + second % 2) {
            let a = c.get(&nodes[0].url("/test/?apikey=k1")).await;
            assert_eq!(
                a.status,
                StatusCode::OK,
                "second {second}, call {i}: {}",
                a.body
            );
        }
        clock.advance(Duration::from_secs(1));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limit_lowered_by_a_reload_holds_against_tokens_leased_before() {
    // Tokens leased under 1000 per 10 s are not spent under 53: 50 calls made, 3 more.
    let redis = RedisServer::start();
    let backend = echo_backend().await;
    let clock = clock();
    let cfg = |n: u64| {
        config(
            backend,
            &redis.url(),
            &format!("{{requests: {n}, per: 10s}}"),
            "open",
        )
    };
    let nodes = nodes(1, &cfg(1000), &clock).await;
    let c = TestClient::default();
    let url = nodes[0].url("/test/?apikey=k1");
    for i in 0..50 {
        assert_eq!(c.get(&url).await.status, StatusCode::OK, "call {i}");
    }
    synced(&nodes[0]).await;
    let counted = redis.hsum(&limit_key("per-10s:10"));
    assert!(
        counted > 53,
        "the node holds tokens leased ahead: {counted}"
    );
    nodes[0].apply(&cfg(53));
    let mut codes = Vec::new();
    for _ in 0..5 {
        codes.push(c.get(&url).await.status.as_u16());
    }
    assert_eq!(codes, [200, 200, 200, 429, 429]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_told_the_limit_is_full_asks_again_after_tokens_go_back() {
    let redis = RedisServer::start();
    let backend = echo_backend().await;
    let clock = clock();
    let cfg = config(backend, &redis.url(), "{requests: 10, per: 10s}", "open");
    let nodes = nodes(1, &cfg, &clock).await;
    let c = TestClient::default();
    let url = nodes[0].url("/test/?apikey=k1");
    let key = limit_key("per-10s:10");
    // Another node's lease takes the whole limit in this sub-window (1 s of the 10 s).
    let sub = 1_700_000_000;
    redis.hincr(&key, sub, 10);
    assert_eq!(c.get(&url).await.status, StatusCode::TOO_MANY_REQUESTS);
    // Still full in the next sub-window: asked once, then refused without asking.
    clock.advance(Duration::from_secs(1));
    assert_eq!(c.get(&url).await.status, StatusCode::TOO_MANY_REQUESTS);
    let asked = asks_sent(&redis, &key);
    for _ in 0..20 {
        assert_eq!(c.get(&url).await.status, StatusCode::TOO_MANY_REQUESTS);
    }
    synced(&nodes[0]).await;
    assert_eq!(asks_sent(&redis, &key), asked, "one ask a sub-window");
    // It gives its tokens back unused when the sub-window ends: the store has room
    // again long before the window the store named, and the next sub-window's first
    // call finds it.
    redis.hincr(&key, sub, -10);
    clock.advance(Duration::from_secs(1));
    assert_eq!(c.get(&url).await.status, StatusCode::OK);
    assert_eq!(c.get(&url).await.status, StatusCode::OK);
}

/// How many asks for the limit at `key` the one node has sent (the number its last ask
/// carried, kept by the lease script beside the counts).
fn asks_sent(redis: &RedisServer, key: &str) -> u64 {
    let seen = redis.hvals(&format!("{key}:asks"));
    assert_eq!(seen.len(), 1, "one node: {seen:?}");
    seen[0]
        .split(':')
        .next()
        .and_then(|n| n.parse().ok())
        .expect("seq:ms")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_stopped_and_restarted_mid_run_fails_open_then_resumes() {
    let mut redis = RedisServer::start();
    let backend = echo_backend().await;
    let clock = clock();
    let cfg = config(backend, &redis.url(), "{requests: 1000, per: 10s}", "open");
    let nodes = nodes(2, &cfg, &clock).await;
    let c = TestClient::default();
    // Under the limit, each request settled before the next: all pass.
    for n in &nodes {
        for _ in 0..50 {
            let a = c.get(&n.url("/test/?apikey=k1")).await;
            assert_eq!(a.status, StatusCode::OK);
            synced(n).await;
        }
    }
    let key = limit_key("per-10s:10");
    assert!(redis.hsum(&key) >= 100);

    redis.stop();
    until("nodes see Redis down", &nodes, |g| {
        !g.gw.cluster().is_some_and(|c| c.is_up())
    })
    .await;
    // Each node keeps answering from its share (no history: 1000 / 2 nodes).
    for n in &nodes {
        for _ in 0..100 {
            let a = c.get(&n.url("/test/?apikey=k1")).await;
            assert_eq!(a.status, StatusCode::OK, "{}", a.body);
        }
        let m = &n.gw.cluster().expect("cluster").metrics;
        // Tokens leased before the outage are spent first; the rest pass on the share.
        assert!(m.fail_open_admitted.load(Ordering::Relaxed) > 0);
    }
    let metrics = nodes[0].gw.metrics_text();
    assert!(metrics.contains("tollgate_cluster_redis_up 0"), "{metrics}");
    let sum = |f: fn(&tollgate_gateway::ClusterMetrics) -> &std::sync::atomic::AtomicU64| {
        nodes
            .iter()
            .map(|n| f(&n.gw.cluster().expect("cluster").metrics).load(Ordering::Relaxed))
            .sum::<u64>()
    };
    // Nothing can be granted while Redis is down.
    let granted_before = sum(|m| &m.granted);
    let fail_open = sum(|m| &m.fail_open_admitted);

    redis.restart();
    until("nodes reconnect", &nodes, |g| {
        g.gw.cluster().is_some_and(|c| c.is_up())
    })
    .await;
    for n in &nodes {
        for _ in 0..20 {
            let a = c.get(&n.url("/test/?apikey=k1")).await;
            assert_eq!(a.status, StatusCode::OK);
            synced(n).await;
        }
    }
    // Shared counting resumed on the fresh (empty) Redis: on re-joining, each node counted
    // into it every request it admitted alone while Redis was down, and Redis holds
    // exactly those and what it granted since. Requests served from tokens leased before
    // the outage were counted by the Redis that was lost, so they are not part of this.
    let granted_since = sum(|m| &m.granted) - granted_before;
    let counted = redis.hsum(&key);
    assert!(
        counted >= granted_since + fail_open,
        "{counted} < {granted_since} + {fail_open}"
    );
    // At most the 40 requests since (on credit) besides.
    assert!(counted <= granted_since + fail_open + 40, "{counted}");
    assert_eq!(sum(|m| &m.overadmitted), 0, "within the limit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_node_back_after_an_outage_does_not_count_the_others_gone() {
    let mut redis = RedisServer::start();
    let backend = echo_backend().await;
    let clock = clock();
    let cfg = config(backend, &redis.url(), "{requests: 1000, per: 10s}", "open");
    let nodes = nodes(2, &cfg, &clock).await;
    // Down for longer than a node's mark lives: the first heartbeat after it trims the
    // other node's mark before that node has renewed it.
    redis.stop();
    until("nodes see Redis down", &nodes, |g| {
        !g.gw.cluster().is_some_and(|c| c.is_up())
    })
    .await;
    clock.advance(Duration::from_secs(4));
    redis.restart();
    for n in &nodes {
        bounded("a node back on Redis", async {
            while !n.gw.cluster().is_some_and(|c| c.is_up()) {
                synced(n).await;
            }
        })
        .await;
        synced(n).await;
        assert_eq!(n.gw.cluster().map(|c| c.nodes()), Some(2));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_closed_answers_503_while_redis_is_down() {
    let mut redis = RedisServer::start();
    let backend = echo_backend().await;
    let clock = clock();
    let cfg = config(
        backend,
        &redis.url(),
        "{requests: 1000, per: 10s}",
        "closed",
    );
    let nodes = nodes(1, &cfg, &clock).await;
    let c = TestClient::default();
    assert_eq!(
        c.get(&nodes[0].url("/test/?apikey=k1")).await.status,
        StatusCode::OK
    );
    redis.stop();
    until("node sees Redis down", &nodes, |g| {
        !g.gw.cluster().is_some_and(|c| c.is_up())
    })
    .await;
    // Leased tokens are still good; once used up, the answer is 503.
    let mut last = None;
    for _ in 0..200 {
        let a = c.get(&nodes[0].url("/test/?apikey=k1")).await;
        if a.status == StatusCode::SERVICE_UNAVAILABLE {
            last = Some(a);
            break;
        }
        assert_eq!(a.status, StatusCode::OK);
    }
    let a = last.expect("503 once the leased tokens are used");
    assert_eq!(
        a.refusal(),
        r#"{"status":503,"error":"rate limit store unavailable"}"#
    );
    assert_eq!(a.header("retry-after"), "1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_that_never_answers_does_not_hold_requests() {
    // Accepts connections and reads, never answers: the extreme of a slow Redis.
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = l.local_addr().expect("addr");
    tokio::spawn(async move {
        let mut held = Vec::new();
        loop {
            let Ok((s, _)) = l.accept().await else { return };
            held.push(s);
        }
    });
    let backend = echo_backend().await;
    let clock = clock();
    let cfg = config(
        backend,
        &format!("redis://{addr}/0"),
        "{requests: 1000, per: 10s}",
        "open",
    );
    let node = TestGateway::start(&cfg, clock.clone()).await;
    let c = TestClient::default();
    // Every request is answered (each within the test's deadline), from the node's share.
    for _ in 0..200 {
        assert_eq!(
            c.get(&node.url("/test/?apikey=k1")).await.status,
            StatusCode::OK
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_redis_does_not_slow_requests_and_still_counts() {
    // A proxy that delays every command by 200 ms on its way to a real Redis.
    let redis = RedisServer::start();
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = l.local_addr().expect("addr");
    let target = redis.addr;
    tokio::spawn(async move {
        loop {
            let Ok((client, _)) = l.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let Ok(server) = tokio::net::TcpStream::connect(target).await else {
                    return;
                };
                let (mut cr, mut cw) = client.into_split();
                let (mut sr, mut sw) = server.into_split();
                let up = async move {
                    let mut buf = vec![0u8; 65536];
                    loop {
                        let n = match tokio::io::AsyncReadExt::read(&mut cr, &mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        if tokio::io::AsyncWriteExt::write_all(&mut sw, &buf[..n])
                            .await
                            .is_err()
                        {
                            return;
                        }
                    }
                };
                let down = tokio::io::copy(&mut sr, &mut cw);
                let _ = tokio::join!(up, down);
            });
        }
    });
    let backend = echo_backend().await;
    let clock = clock();
    let cfg = config(
        backend,
        &format!("redis://{addr}/0"),
        "{requests: 1000, per: 10s}",
        "open",
    );
    let nodes = nodes(1, &cfg, &clock).await;
    let c = TestClient::default();
    let mut ok = 0;
    for _ in 0..300 {
        match c.get(&nodes[0].url("/test/?apikey=k1")).await.status {
            StatusCode::OK => ok += 1,
            StatusCode::TOO_MANY_REQUESTS => {}
            s => panic!("unexpected {s}"),
        }
    }
    assert!(ok > 0);
    synced(&nodes[0]).await;
    synced(&nodes[0]).await;
    // Everything admitted was granted by Redis (tokens) or settled since (credit).
    let key = limit_key("per-10s:10");
    assert!(redis.hsum(&key) >= ok, "{} < {ok}", redis.hsum(&key));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counters_survive_a_node_restart() {
    let redis = RedisServer::start();
    let backend = echo_backend().await;
    let clock = clock();
    let cfg = config(backend, &redis.url(), "{requests: 1000, per: 10s}", "open");
    let mut nodes = nodes(2, &cfg, &clock).await;
    let c = TestClient::default();
    let mut admitted = 0;
    for _ in 0..600 {
        if c.get(&nodes[0].url("/test/?apikey=k1")).await.status == StatusCode::OK {
            admitted += 1;
        }
        if admitted % 50 == 0 {
            synced(&nodes[0]).await;
        }
    }
    synced(&nodes[0]).await;
    // Node 0 goes away and comes back as a new process would.
    let old = nodes.remove(0);
    let server = {
        let mut old = old;
        old.server
            .take()
            .expect("server")
            .shutdown(Duration::from_secs(1))
            .await;
        old
    };
    drop(server);
    nodes.insert(0, TestGateway::start(&cfg, clock.clone()).await);
    until("restarted node is up", &nodes, |g| {
        g.gw.cluster().is_some_and(|c| c.is_up())
    })
    .await;
    for _ in 0..1000 {
        for n in &nodes {
            if c.get(&n.url("/test/?apikey=k1")).await.status == StatusCode::OK {
                admitted += 1;
            }
        }
        if admitted >= 1000 {
            break;
        }
        for n in &nodes {
            synced(n).await;
        }
    }
    for n in &nodes {
        synced(n).await;
    }
    // The restarted node resumed from the shared count: the window's total stays the limit.
    assert!(
        admitted <= 1010,
        "{admitted} admitted in one window for a limit of 1000"
    );
    let counted = redis.hsum(&limit_key("per-10s:10"));
    assert!(counted <= 1010, "{counted} counted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_per_30s_driven_from_three_nodes_never_admits_twice_within_30s() {
    let redis = RedisServer::start();
    let backend = echo_backend().await;
    let clock = clock();
    // Start at an odd moment: 1.7 s into a 3 s sub-window.
    clock.advance(Duration::from_millis(1_700));
    let cfg = config(backend, &redis.url(), "{requests: 1, per: 30s}", "open");
    let nodes = nodes(3, &cfg, &clock).await;
    let c = TestClient::default();
    let mut admitted_at = Vec::new();
    // 70 s in steps of 0.5 s, each step a call on the next node.
    for step in 0..140u64 {
        let node = &nodes[(step % 3) as usize];
        let a = c.get(&node.url("/test/?apikey=k1")).await;
        match a.status {
            StatusCode::OK => admitted_at.push(step * 500),
            StatusCode::TOO_MANY_REQUESTS => {}
            s => panic!("unexpected {s}: {}", a.body),
        }
        synced(node).await;
        clock.advance(Duration::from_millis(500));
    }
    assert!(admitted_at.len() >= 2, "{admitted_at:?}");
    for pair in admitted_at.windows(2) {
        assert!(
            pair[1] - pair[0] >= 30_000,
            "two calls {} ms apart: {admitted_at:?}",
            pair[1] - pair[0]
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_left_unused_go_back_when_the_calls_stop() {
    let redis = RedisServer::start();
    let backend = echo_backend().await;
    let clock = clock();
    let cfg = config(backend, &redis.url(), "{requests: 1000, per: 10s}", "open");
    let nodes = nodes(1, &cfg, &clock).await;
    let c = TestClient::default();
    for i in 0..50 {
        let a = c.get(&nodes[0].url("/test/?apikey=k1")).await;
        assert_eq!(a.status, StatusCode::OK, "call {i}: {}", a.body);
    }
    synced(&nodes[0]).await;
    let key = limit_key("per-10s:10");
    let counted = redis.hsum(&key);
    assert!(
        counted > 50,
        "the node leases ahead of its calls: {counted} counted for 50"
    );
    // The calls stop and their sub-window (a tenth of the window) ends: the tokens the
    // node holds go back without another call, and the store counts the calls alone.
    clock.advance(Duration::from_secs(1));
    until("the unused tokens given back", &nodes, |_| {
        redis.hsum(&key) == 50
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_at_a_window_boundary_does_not_double_the_limit() {
    let redis = RedisServer::start();
    let backend = echo_backend().await;
    let clock = clock();
    let cfg = config(backend, &redis.url(), "{requests: 10, per: 10s}", "open");
    let nodes = nodes(3, &cfg, &clock).await;
    let c = TestClient::default();
    let burst = |label: &'static str, tries: usize| {
        let (nodes, c) = (&nodes, &c);
        async move {
            let mut admitted = 0;
            for i in 0..tries {
                let node = &nodes[i % 3];
                if c.get(&node.url("/test/?apikey=k1")).await.status == StatusCode::OK {
                    admitted += 1;
                }
                synced(node).await;
            }
            eprintln!("{label}: {admitted}");
            admitted
        }
    };
    // 9.5 s into a fixed 10 s window: the whole limit is used.
    clock.advance(Duration::from_millis(9_500));
    assert_eq!(burst("before the boundary", 40).await, 10);
    // 1 s later a fixed window would start afresh; the sliding one still holds the ten.
    clock.advance(Duration::from_secs(1));
    assert_eq!(burst("after the boundary", 40).await, 0);
    // Once their sub-window has left the window (11 sub-windows of 1 s), they are free.
    clock.advance(Duration::from_secs(10));
    assert_eq!(burst("a window later", 40).await, 10);
}

/// The lease script as a node calls it: limit `key` of 100, sub-windows of 1 s (on this
/// host's clock, which Redis shares), `want` tokens for the current sub-window and `change`
/// applied to it, as ask `seq` of `node`. Returns (granted, counted, whether it ran).
fn lease(redis: &RedisServer, node: &str, seq: u64, want: u64, change: i64) -> (u64, u64, bool) {
    let sub = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock after 1970")
        .as_secs();
    let mut c = redis.connection();
    let key = "tollgate:consumer:{k}:l:100:10";
    let mut cmd = ::redis::cmd("EVAL");
    cmd.arg(tollgate_gateway::LEASE)
        .arg(2)
        .arg(key)
        .arg(format!("{key}:asks"))
        .arg(100)
        .arg(10)
        .arg(60_000)
        .arg(sub)
        .arg(sub)
        .arg(want)
        .arg(1_000)
        .arg(node)
        .arg(seq);
    if change != 0 {
        cmd.arg(sub).arg(change);
    }
    let (granted, counted, _, _, ran): (u64, u64, u64, u64, u64) = cmd.query(&mut c).expect("EVAL");
    (granted, counted, ran == 1)
}

#[test]
fn the_lease_script_runs_each_ask_once_however_often_it_arrives() {
    let redis = RedisServer::start();
    let key = "tollgate:consumer:{k}:l:100:10";
    // 5 tokens granted and 3 requests admitted on credit counted.
    assert_eq!(lease(&redis, "n1", 1, 5, 3), (5, 8, true));
    // The same ask again (a client's retry after a timeout): nothing granted or counted,
    // and the answer says so.
    assert_eq!(lease(&redis, "n1", 1, 5, 3), (0, 8, false));
    // 2 tokens given back, once however often the ask arrives.
    assert_eq!(lease(&redis, "n1", 2, 0, -2), (0, 6, true));
    assert_eq!(lease(&redis, "n1", 2, 0, -2), (0, 6, false));
    // An older ask arriving after a newer one changes nothing either.
    assert_eq!(lease(&redis, "n1", 1, 5, 3), (0, 6, false));
    assert_eq!(redis.hsum(key), 6);
    // Each node numbers its own asks.
    assert_eq!(lease(&redis, "n2", 1, 4, 0), (4, 10, true));
    assert_eq!(lease(&redis, "n1", 3, 1, 0), (1, 11, true));
    assert_eq!(redis.hsum(key), 11);
}

/// A redis-server speaking TLS only, with a certificate of `ca`, asking clients for one
/// of `ca` too; killed by its pid when dropped.
struct TlsRedis(std::process::Child, u16);

impl Drop for TlsRedis {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn tls_redis(ca: &common::tls::TestCa, dir: &std::path::Path) -> TlsRedis {
    let server = ca.server("redis", &["127.0.0.1"]);
    let port = common::ports::free_port();
    let child = std::process::Command::new("redis-server")
        .args([
            "--port",
            "0",
            "--bind",
            "127.0.0.1",
            "--tls-port",
            &port.to_string(),
        ])
        .arg("--tls-cert-file")
        .arg(&server.cert)
        .arg("--tls-key-file")
        .arg(&server.key)
        .arg("--tls-ca-cert-file")
        .arg(&ca.pem)
        .args([
            "--tls-auth-clients",
            "yes",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .arg("--dir")
        .arg(dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("redis-server must be installed (the test script installs it)");
    let tls = TlsRedis(child, port);
    let deadline = std::time::Instant::now() + DEADLINE;
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "redis-server did not listen"
        );
        std::thread::yield_now();
    }
    tls
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_are_shared_over_tls_with_a_private_ca_and_a_client_certificate() {
    let dir = tempdir("redis-tls");
    let ca = common::tls::TestCa::new(&dir, "redis-ca");
    let redis = tls_redis(&ca, &dir);
    let client = ca.client("gateway", "tollgate");
    let backend = echo_backend().await;
    let node = |tls: String| {
        yaml(
            backend,
            &format!(
                r#"
cluster:
  redis: {{url: "rediss://127.0.0.1:{port}/0", tls: {tls}}}
  sync_interval: 5ms
  key_prefix: tgtls
plans:
  standard: {{limits: [{{requests: 3, per: 1m}}]}}
consumers:
  - {{name: alice, keys: [k1], plan: standard}}
routes:
  - {{name: test, path_prefix: /test/, upstream: backend, auth: {{}}}}
"#,
                port = redis.1
            ),
        )
    };
    let clock = clock();
    // The CA and the client certificate from the config: the node reaches Redis and
    // shares the limit through it.
    let full = format!(
        "{{ca_file: {}, cert_file: {}, key_file: {}}}",
        ca.pem.display(),
        client.cert.display(),
        client.key.display()
    );
    let nodes = nodes(2, &node(full), &clock).await;
    let c = TestClient::default();
    let mut codes = Vec::new();
    for n in [0, 1, 0, 1] {
        codes.push(
            c.get(&nodes[n].url("/test/x?apikey=k1"))
                .await
                .status
                .as_u16(),
        );
    }
    assert_eq!(
        codes,
        [200, 200, 200, 429],
        "3 per minute across both nodes"
    );
    // Without a client certificate the server refuses the handshake: never up.
    let anonymous = TestGateway::start(
        &node(format!("{{ca_file: {}}}", ca.pem.display())),
        clock.clone(),
    )
    .await;
    let cluster = anonymous.gw.cluster().expect("cluster");
    bounded("a refused handshake counted", async {
        while cluster.metrics.errors.load(Ordering::Relaxed) < 2 {
            synced(&anonymous).await;
        }
    })
    .await;
    assert!(!cluster.is_up());
    let _ = std::fs::remove_dir_all(&dir);
}
