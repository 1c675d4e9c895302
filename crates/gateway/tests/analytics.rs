//! The usage history: counts per consumer, route and status class in minute buckets,
//! rolled up, kept in SQLite across restarts, and shared through Redis in a cluster.

mod common;

use common::redis::RedisServer;
use common::*;
use http::{Method, StatusCode};
use std::net::SocketAddr;
use std::time::Duration;
use tollgate_gateway::{Clock, ManualClock};

async fn analytics(c: &TestClient, addr: SocketAddr, query: &str) -> serde_json::Value {
    let a = c
        .request(
            Method::GET,
            &format!("http://{addr}/analytics?{query}"),
            &[],
            "",
        )
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    serde_json::from_str(&a.body).expect("json")
}

/// `(ts, consumer, route, status, count)` of every row.
fn rows(v: &serde_json::Value) -> Vec<(u64, String, String, String, u64)> {
    v["rows"]
        .as_array()
        .expect("rows")
        .iter()
        .map(|r| {
            (
                r["ts"].as_u64().expect("ts"),
                r["consumer"].as_str().expect("consumer").to_string(),
                r["route"].as_str().expect("route").to_string(),
                r["status"].as_str().expect("status").to_string(),
                r["count"].as_u64().expect("count"),
            )
        })
        .collect()
}

fn routes(extra: &str) -> String {
    format!(
        r#"{extra}
consumers:
  - {{name: alice, keys: [alice-key]}}
  - {{name: bob, keys: [bob-key]}}
routes:
  - name: api
    path_prefix: /api/
    upstream: backend
    auth: {{query: [apikey]}}
  - name: open
    path_prefix: /open/
    upstream: backend
"#
    )
}

#[tokio::test]
async fn counts_land_in_minute_buckets_roll_up_and_survive_a_restart() {
    let dir = tempdir("analytics");
    let db = dir.join("analytics.db");
    let backend = echo_backend().await;
    let cfg = yaml(
        backend,
        &routes(&format!("analytics: {{path: {}}}", db.display())),
    );
    let clock = ManualClock::new();
    // 2027-01-15, 08:00:30 UTC
    clock.advance(Duration::from_secs(1_800_000_030));
    let start = clock.wall_nanos() / 1_000_000_000;
    let minute = start / 60 * 60;
    let gw = TestGateway::start(&cfg, clock.clone()).await;
    let addr = start_admin(&gw.gw, None).await;
    let c = TestClient::default();

    for _ in 0..3 {
        let _ = c.get(&gw.url("/api/x?apikey=alice-key")).await;
    }
    let _ = c.get(&gw.url("/api/x?apikey=bob-key")).await;
    let _ = c.get(&gw.url("/api/x?apikey=wrong")).await;
    let _ = c.get(&gw.url("/open/x")).await;
    clock.advance(Duration::from_secs(60));
    let _ = c.get(&gw.url("/api/x?apikey=alice-key")).await;

    let v = analytics(&c, addr, &format!("step=1m&from={}", minute - 60)).await;
    assert_eq!(v["source"], "node");
    let got = rows(&v);
    let want = vec![
        (minute, "-".into(), "api".into(), "4xx".into(), 1),
        (minute, "-".into(), "open".into(), "2xx".into(), 1),
        (minute, "alice".into(), "api".into(), "2xx".into(), 3),
        (minute, "bob".into(), "api".into(), "2xx".into(), 1),
        (minute + 60, "alice".into(), "api".into(), "2xx".into(), 1),
    ];
    assert_eq!(got, want);
    assert_eq!(v["totals"]["2xx"], 6);

    // One consumer, rolled up to the hour.
    let v = analytics(
        &c,
        addr,
        &format!("consumer=alice&step=1h&from={}", minute - 3600),
    )
    .await;
    let hour = minute / 3600 * 3600;
    assert_eq!(
        rows(&v),
        vec![(hour, "alice".into(), "api".into(), "2xx".into(), 4)]
    );
    let v = analytics(
        &c,
        addr,
        &format!("route=open&step=1d&from={}", minute - 86_400),
    )
    .await;
    assert_eq!(rows(&v).len(), 1);
    assert_eq!(rows(&v)[0].4, 1);

    // A new node on the same file answers with the history so far.
    drop(gw);
    let gw = TestGateway::start(&cfg, clock.clone()).await;
    let addr = start_admin(&gw.gw, None).await;
    let _ = c.get(&gw.url("/api/x?apikey=alice-key")).await;
    let v = analytics(
        &c,
        addr,
        &format!("consumer=alice&step=1h&from={}", minute - 3600),
    )
    .await;
    assert_eq!(rows(&v)[0].4, 5, "{v}");
}

#[tokio::test]
async fn a_corrupt_database_is_reported_and_the_gateway_still_serves() {
    let dir = tempdir("analytics-corrupt");
    let db = dir.join("analytics.db");
    std::fs::write(&db, vec![0x5au8; 8192]).expect("write garbage");
    let backend = echo_backend().await;
    let cfg = yaml(
        backend,
        &routes(&format!("analytics: {{path: {}}}", db.display())),
    );
    let gw = TestGateway::start(&cfg, ManualClock::new()).await;
    let err = gw.gw.analytics_error().expect("reported").to_string();
    assert!(err.contains(&db.display().to_string()), "{err}");
    let c = TestClient::default();
    assert_eq!(c.get(&gw.url("/open/x")).await.status, StatusCode::OK);
    let addr = start_admin(&gw.gw, None).await;
    let a = c.get(&format!("http://{addr}/analytics")).await;
    assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(a.body.contains("usage history is off"), "{}", a.body);
}

#[tokio::test]
async fn without_analytics_the_endpoint_says_how_to_turn_it_on() {
    let backend = echo_backend().await;
    let gw = TestGateway::start(&yaml(backend, &routes("")), ManualClock::new()).await;
    let addr = start_admin(&gw.gw, None).await;
    let a = TestClient::default()
        .get(&format!("http://{addr}/analytics"))
        .await;
    assert_eq!(a.status, StatusCode::NOT_FOUND);
    assert!(a.body.contains("analytics:"), "{}", a.body);
}

#[tokio::test]
async fn in_a_cluster_any_node_answers_for_all_of_them() {
    let redis = RedisServer::start();
    let dir = tempdir("analytics-cluster");
    let backend = echo_backend().await;
    let clock = ManualClock::new();
    clock.advance(Duration::from_secs(1_800_000_030));
    let minute = clock.wall_nanos() / 1_000_000_000 / 60 * 60;
    let node = |i: usize| {
        yaml(
            backend,
            &routes(&format!(
                "cluster: {{redis: \"{}\", key_prefix: tgan}}\nanalytics: {{path: {}}}",
                redis.url(),
                dir.join(format!("node{i}.db")).display()
            )),
        )
    };
    let a = TestGateway::start(&node(0), clock.clone()).await;
    let b = TestGateway::start(&node(1), clock.clone()).await;
    let c = TestClient::default();
    for _ in 0..2 {
        let _ = c.get(&a.url("/api/x?apikey=alice-key")).await;
    }
    for _ in 0..3 {
        let _ = c.get(&b.url("/api/x?apikey=alice-key")).await;
    }
    let a_admin = start_admin(&a.gw, None).await;
    let b_admin = start_admin(&b.gw, None).await;
    // Each node flushes its own batch when asked; the answer comes from Redis.
    let _ = analytics(&c, b_admin, "consumer=alice&step=1m").await;
    let v = analytics(&c, a_admin, "consumer=alice&step=1m").await;
    assert_eq!(v["source"], "cluster");
    assert_eq!(v["cluster_error"], serde_json::Value::Null);
    assert_eq!(
        rows(&v),
        vec![(minute, "alice".into(), "api".into(), "2xx".into(), 5)]
    );
    // Each bucket is spread over hashes by consumer: alice's counts are all in one of
    // the minute's sixteen, and none in a hash of every consumer.
    let held: Vec<u64> = (0..16)
        .map(|n| redis.hsum(&format!("tgan:usage:1m:{minute}:{n}")))
        .collect();
    assert_eq!(held.iter().sum::<u64>(), 5, "{held:?}");
    assert_eq!(held.iter().filter(|n| **n > 0).count(), 1, "{held:?}");
    assert_eq!(redis.hsum(&format!("tgan:usage:1m:{minute}")), 0);
    // A bucket's one hash of every consumer, as earlier versions wrote it, still counts.
    {
        let mut raw = redis.connection();
        ::redis::cmd("HINCRBY")
            .arg(format!("tgan:usage:1m:{minute}"))
            .arg("bob\tapi\t2")
            .arg(7)
            .query::<u64>(&mut raw)
            .expect("HINCRBY");
    }
    let _ = c.get(&a.url("/api/x?apikey=bob-key")).await;
    let everyone = analytics(&c, a_admin, "step=1m").await;
    assert_eq!(
        rows(&everyone),
        vec![
            (minute, "alice".into(), "api".into(), "2xx".into(), 5),
            (minute, "bob".into(), "api".into(), "2xx".into(), 8),
        ],
        "{everyone}"
    );

    // Counts Redis could not take are added with the next batch, not lost. (The server
    // comes back empty: what it held before is gone with it.)
    let mut redis = redis;
    redis.stop();
    for _ in 0..4 {
        let _ = c.get(&a.url("/api/x?apikey=alice-key")).await;
    }
    // Asked while Redis is down: the node flushes, and answers from its own history (its
    // 2 requests before and 4 since), saying why Redis did not.
    let down = analytics(&c, a_admin, "consumer=alice&step=1m").await;
    assert_eq!(down["source"], "node", "{down}");
    assert!(down["cluster_error"].is_string(), "{down}");
    assert_eq!(
        rows(&down),
        vec![(minute, "alice".into(), "api".into(), "2xx".into(), 6)],
        "{down}"
    );
    redis.restart();
    let v = analytics(&c, a_admin, "consumer=alice&step=1m").await;
    assert_eq!(
        rows(&v),
        vec![(minute, "alice".into(), "api".into(), "2xx".into(), 4)],
        "{v}"
    );
}
