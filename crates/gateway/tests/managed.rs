//! Consumers managed at runtime through the admin API: made, given a plan and keys, keys
//! revoked, listed consumers deleted; each change applies to the next request and
//! survives a restart (the change log).

mod common;

use common::*;
use http::Method;
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::path::Path;
use tollgate_gateway::SystemClock;

const TOKEN: &str = "admin-secret";

fn config(backend: SocketAddr, log: &Path) -> String {
    yaml(
        backend,
        &format!(
            r#"consumers_log: "{}"
plans:
  free: {{limits: [{{requests: 1, per: 1m}}]}}
  gold: {{limits: [{{requests: 100, per: 1m}}]}}
consumers:
  - {{name: alice, keys: [ka], plan: free}}
routes:
  - {{name: api, path_prefix: /api/, upstream: backend, auth: {{header: [x-api-key]}}}}
  - {{name: gold-only, path_prefix: /gold/, upstream: backend, auth: {{header: [x-api-key]}}, allow: {{plans: [gold]}}}}
"#,
            log.display()
        ),
    )
}

/// An admin call with the token: status and JSON answer.
async fn admin(addr: SocketAddr, method: Method, path: &str, body: Option<Value>) -> (u16, Value) {
    let a = TestClient::default()
        .request(
            method,
            &format!("http://{addr}{path}"),
            &[("authorization", &format!("Bearer {TOKEN}"))],
            &body.map_or(String::new(), |b| b.to_string()),
        )
        .await;
    let v = serde_json::from_str(&a.body).unwrap_or(Value::Null);
    (a.status.as_u16(), v)
}

/// A gateway of [`config`] keeping its change log in a folder of its own (`dir`, removed
/// by the test), and its admin API with the token.
async fn managed_gateway(name: &str) -> (std::path::PathBuf, TestGateway, SocketAddr) {
    let dir = tempdir(name);
    let (backend, _) = inspect_backend().await;
    let gw = TestGateway::start(
        &config(backend, &dir.join("consumers.changes")),
        SystemClock::new(),
    )
    .await;
    let ad = start_admin(&gw.gw, Some(TOKEN)).await;
    (dir, gw, ad)
}

async fn call(gw: &TestGateway, path: &str, key: &str) -> Answer {
    TestClient::default()
        .request(Method::GET, &gw.url(path), &[("x-api-key", key)], "")
        .await
}

#[tokio::test]
async fn changes_apply_to_the_next_request_and_survive_a_restart() {
    let dir = tempdir("managed");
    let log = dir.join("consumers.changes");
    let (backend, _) = inspect_backend().await;
    let yaml = config(backend, &log);
    let gw = TestGateway::start(&yaml, SystemClock::new()).await;
    let ad = start_admin(&gw.gw, Some(TOKEN)).await;

    // A new consumer on gold, and a key made for it: answered once, kept as a digest.
    let (s, v) = admin(
        ad,
        Method::PUT,
        "/consumers/bob",
        Some(json!({"plan": "gold", "metadata": {"team": "b"}})),
    )
    .await;
    assert_eq!((s, &v["source"]), (201, &json!("api")), "{v}");
    let (s, made) = admin(ad, Method::POST, "/consumers/bob/keys", None).await;
    assert_eq!(s, 201, "{made}");
    let key = made["key"].as_str().expect("key").to_string();
    let id = made["id"].as_str().expect("id").to_string();
    assert!(key.starts_with("tg_") && key.len() > 40, "{key}");
    let a = call(&gw, "/gold/x", &key).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert!(a.body.contains("x-consumer: bob\n"), "{}", a.body);
    let (_, shown) = admin(ad, Method::GET, "/consumers/bob", None).await;
    assert_eq!(shown["keys"][0]["id"], json!(id));
    assert!(
        !shown.to_string().contains(&key),
        "the key itself is never shown again"
    );
    assert_eq!(shown["metadata"]["team"], "b");
    // Its usage, as for a listed consumer: gold's limit, the one request counted.
    let (s, u) = admin(ad, Method::GET, "/usage/bob", None).await;
    assert_eq!(s, 200, "{u}");
    let limit = &u["limits"][0];
    assert_eq!(
        (&limit["requests"], &limit["used"]),
        (&json!(100), &json!(1)),
        "{u}"
    );
    // A name holding `?`, `%` or `+` is read back percent-encoded, as `/consumers/NAME` is.
    let (s, v) = admin(
        ad,
        Method::PUT,
        "/consumers/q%3Fx%25+1",
        Some(json!({"plan": "gold"})),
    )
    .await;
    assert_eq!(s, 201, "{v}");
    let (s, u) = admin(ad, Method::GET, "/usage/q%3Fx%25+1", None).await;
    assert_eq!((s, &u["consumer"]), (200, &json!("q?x%+1")), "{u}");

    // A listed consumer moved to gold: its listed key now meets gold's limits and `allow`.
    assert_eq!(call(&gw, "/gold/x", "ka").await.status, 403);
    let (s, v) = admin(
        ad,
        Method::PUT,
        "/consumers/alice",
        Some(json!({"plan": "gold"})),
    )
    .await;
    assert_eq!((s, &v["source"]), (200, &json!("config+api")), "{v}");
    for _ in 0..3 {
        assert_eq!(call(&gw, "/gold/x", "ka").await.status, 200);
    }

    // A revoked key and a deleted consumer are refused at once.
    let (s, _) = admin(
        ad,
        Method::DELETE,
        &format!("/consumers/bob/keys/{id}"),
        None,
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(call(&gw, "/api/x", &key).await.status, 401);
    let (_, second) = admin(ad, Method::POST, "/consumers/bob/keys", None).await;
    let second = second["key"].as_str().expect("key").to_string();
    let (s, _) = admin(ad, Method::DELETE, "/consumers/alice", None).await;
    assert_eq!(s, 200);
    assert_eq!(call(&gw, "/api/x", "ka").await.status, 401);
    assert_eq!(
        admin(ad, Method::GET, "/consumers/alice", None).await.0,
        404
    );
    assert_eq!(admin(ad, Method::GET, "/usage/alice", None).await.0, 404);

    // What the API refuses, with the reason.
    let (s, v) = admin(
        ad,
        Method::PUT,
        "/consumers/carol",
        Some(json!({"plan": "platinum"})),
    )
    .await;
    assert_eq!(s, 400, "{v}");
    let (s, v) = admin(
        ad,
        Method::PUT,
        "/consumers/carol",
        Some(json!({"key_sha256": ["cd".repeat(32), "CD".repeat(32)]})),
    )
    .await;
    assert_eq!(
        (s, v["error"].as_str().unwrap_or("")),
        (400, "key_sha256[1] repeats key_sha256[0]")
    );
    let digest = "ab".repeat(32);
    let (s, _) = admin(
        ad,
        Method::PUT,
        "/consumers/carol",
        Some(json!({"key_sha256": [digest]})),
    )
    .await;
    assert_eq!(s, 201);
    let (s, v) = admin(
        ad,
        Method::PUT,
        "/consumers/dave",
        Some(json!({"key_sha256": ["ab".repeat(32)]})),
    )
    .await;
    assert_eq!(
        (s, v["error"].as_str().unwrap_or("")),
        (409, "a key is taken by consumer \"carol\"")
    );
    assert_eq!(
        admin(ad, Method::PUT, "/consumers/x%2Fy", Some(json!({})))
            .await
            .0,
        400
    );
    let (_, page) = admin(ad, Method::GET, "/consumers?limit=2", None).await;
    assert_eq!(
        page["consumers"].as_array().map(Vec::len),
        Some(2),
        "{page}"
    );
    // alice, deleted, is left out unless asked for.
    assert_eq!(page["next"], "carol", "{page}");
    let (_, page) = admin(ad, Method::GET, "/consumers?limit=2&deleted=true", None).await;
    assert_eq!(page["next"], "bob", "{page}");

    let (_, status) = admin(ad, Method::GET, "/status", None).await;
    assert_eq!(status["managed_consumers"]["records"], 4, "{status}");
    assert_eq!(
        status["managed_consumers"]["changes_applied"], 8,
        "{status}"
    );
    // One line per change in the log, whatever the number of consumers.
    let changes = std::fs::read_to_string(&log).expect("log");
    assert_eq!(changes.lines().count(), 8, "{changes}");

    // A restart replays the log.
    drop(gw);
    let gw = TestGateway::start(&yaml, SystemClock::new()).await;
    assert_eq!(call(&gw, "/api/x", "ka").await.status, 401);
    assert_eq!(call(&gw, "/api/x", &key).await.status, 401);
    let a = call(&gw, "/gold/x", &second).await;
    assert_eq!(a.status, 200, "{}", a.body);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn managing_consumers_needs_an_admin_token() {
    let dir = tempdir("managed-token");
    let (backend, _) = inspect_backend().await;
    let gw = TestGateway::start(&config(backend, &dir.join("c.changes")), SystemClock::new()).await;
    let ad = start_admin(&gw.gw, None).await;
    let a = TestClient::default()
        .request(
            Method::PUT,
            &format!("http://{ad}/consumers/eve"),
            &[],
            "{}",
        )
        .await;
    assert_eq!(a.status, 403, "{}", a.body);
    assert!(!dir.join("c.changes").exists());
    let _ = std::fs::remove_dir_all(&dir);
}

/// Waits until `ok` holds, at most `within`; how long it took, or `None`.
async fn until<F, Fut>(within: std::time::Duration, mut ok: F) -> Option<std::time::Duration>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = std::time::Instant::now();
    while start.elapsed() <= within {
        if ok().await {
            return Some(start.elapsed());
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    None
}

#[tokio::test]
async fn a_change_on_one_node_reaches_every_node_within_a_second() {
    let redis = common::redis::RedisServer::start();
    let dir = tempdir("managed-cluster");
    let (backend, _) = inspect_backend().await;
    let node = |n: usize| {
        format!(
            "{}cluster: {{redis: \"{}\", key_prefix: managed{}}}\n",
            config(backend, &dir.join(format!("node{n}.changes"))),
            redis.url(),
            std::process::id()
        )
    };
    let a = TestGateway::start(&node(0), SystemClock::new()).await;
    let b = TestGateway::start(&node(1), SystemClock::new()).await;
    let c = TestGateway::start(&node(2), SystemClock::new()).await;
    let ad = start_admin(&a.gw, Some(TOKEN)).await;
    let second = std::time::Duration::from_secs(1);
    let (s, _) = admin(
        ad,
        Method::PUT,
        "/consumers/bob",
        Some(json!({"plan": "gold"})),
    )
    .await;
    assert_eq!(s, 201);
    let (_, made) = admin(ad, Method::POST, "/consumers/bob/keys", None).await;
    let key = made["key"].as_str().expect("key").to_string();
    let id = made["id"].as_str().expect("id").to_string();
    // Every node takes the new key within a second of the change, and refuses it within
    // a second of its revocation (one deadline for the three).
    let start = std::time::Instant::now();
    for (n, gw) in [&a, &b, &c].into_iter().enumerate() {
        let left = second.saturating_sub(start.elapsed());
        let took = until(left, || async {
            call(gw, "/gold/x", &key).await.status == 200
        })
        .await;
        assert!(took.is_some(), "node {n} did not take bob's key within 1 s");
        eprintln!(
            "node {n} took the new key {:?} after the change",
            start.elapsed()
        );
    }
    let (s, _) = admin(
        ad,
        Method::DELETE,
        &format!("/consumers/bob/keys/{id}"),
        None,
    )
    .await;
    assert_eq!(s, 200);
    let start = std::time::Instant::now();
    for (n, gw) in [&a, &b, &c].into_iter().enumerate() {
        let left = second.saturating_sub(start.elapsed());
        let took = until(left, || async {
            call(gw, "/gold/x", &key).await.status == 401
        })
        .await;
        assert!(
            took.is_some(),
            "node {n} still took the revoked key after 1 s"
        );
        eprintln!(
            "node {n} refused the revoked key {:?} after the revocation",
            start.elapsed()
        );
    }
    // A node away while changes are made (a key made, one revoked) catches up from Redis
    // when it returns; here with an empty disk, so that all it knows comes from Redis.
    let (_, made) = admin(ad, Method::POST, "/consumers/bob/keys", None).await;
    let kept = made["key"].as_str().expect("key").to_string();
    let kept_id = made["id"].as_str().expect("id").to_string();
    let took = until(second, || async {
        call(&c, "/gold/x", &kept).await.status == 200
    })
    .await;
    assert!(took.is_some());
    drop(c);
    let (_, made) = admin(ad, Method::POST, "/consumers/bob/keys", None).await;
    let later = made["key"].as_str().expect("key").to_string();
    let (s, _) = admin(
        ad,
        Method::DELETE,
        &format!("/consumers/bob/keys/{kept_id}"),
        None,
    )
    .await;
    assert_eq!(s, 200);
    let c = TestGateway::start(&node(3), SystemClock::new()).await;
    let took = until(DEADLINE, || async {
        call(&c, "/gold/x", &later).await.status == 200
    })
    .await;
    assert!(
        took.is_some(),
        "the returning node never took the key made while it was away"
    );
    assert_eq!(call(&c, "/gold/x", &kept).await.status, 401);
    assert_eq!(call(&c, "/gold/x", &key).await.status, 401);
    drop((a, b, c));
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_node_without_the_consumers_plan_does_not_serve_it_unlimited() {
    let redis = common::redis::RedisServer::start();
    let dir = tempdir("managed-plan");
    let (backend, _) = inspect_backend().await;
    let node = |n: usize, more_plans: &str| {
        let cfg = config(backend, &dir.join(format!("node{n}.changes")));
        format!(
            "{}cluster: {{redis: \"{}\", key_prefix: plans{}}}\n",
            cfg.replace("plans:\n", &format!("plans:\n{more_plans}")),
            redis.url(),
            std::process::id()
        )
    };
    let a = TestGateway::start(
        &node(0, "  platinum: {limits: [{requests: 2, per: 1m}]}\n"),
        SystemClock::new(),
    )
    .await;
    let b = TestGateway::start(&node(1, ""), SystemClock::new()).await;
    let ad = start_admin(&a.gw, Some(TOKEN)).await;
    let (s, _) = admin(
        ad,
        Method::PUT,
        "/consumers/pl",
        Some(json!({"plan": "platinum"})),
    )
    .await;
    assert_eq!(s, 201);
    let (_, made) = admin(ad, Method::POST, "/consumers/pl/keys", None).await;
    let key = made["key"].as_str().expect("key").to_string();
    assert_eq!(call(&a, "/api/x", &key).await.status, 200);
    // Limits shared through Redis count on the dashboard too: one call of two.
    let (s, top) = admin(ad, Method::GET, "/top", None).await;
    assert_eq!(s, 200, "{top}");
    let closest = &top["closest_to_quota"][0];
    assert_eq!(closest["consumer"], "pl", "{top}");
    assert_eq!(closest["requests"], 2, "{top}");
    // The change reaches the node whose config lacks the plan: it refuses the consumer
    // rather than serve it without the plan's limits.
    let reached = until(DEADLINE, || async {
        call(&b, "/api/x", &key).await.status != 401
    })
    .await;
    assert!(reached.is_some(), "the change never reached the other node");
    for _ in 0..3 {
        let answer = call(&b, "/api/x", &key).await;
        assert_eq!(answer.status, 503, "{}", answer.body);
        assert!(answer.body.contains("plan"), "{}", answer.body);
        assert_eq!(answer.header("retry-after"), "60");
    }
    drop((a, b));
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_key_names_one_consumer_whether_the_config_or_the_api_gives_it() {
    let dir = tempdir("managed-clash");
    let log = dir.join("consumers.changes");
    let (backend, _) = inspect_backend().await;
    let hashed = tollgate_config::consumers::key_digest(b"kc");
    let hex = |d: [u8; 32]| d.iter().map(|b| format!("{b:02x}")).collect::<String>();
    // alice has `ka` as written, carol `kc` as its digest.
    let yaml = config(backend, &log).replace(
        "  - {name: alice, keys: [ka], plan: free}\n",
        &format!(
            "  - {{name: alice, keys: [ka], plan: free}}\n  - {{name: carol, key_sha256: [\"{}\"]}}\n",
            hex(hashed)
        ),
    );
    assert!(yaml.contains("carol"), "{yaml}");
    let yaml = yaml.replace(
        "plans:\n",
        "plans:\n  silver: {limits: [{requests: 5, per: 1m}]}\n",
    );
    // With `admin:` on, the config's plain keys are indexed by digest (this test serves
    // the admin API itself, on a port of its own).
    std::fs::write(dir.join("admin.token"), TOKEN).expect("token");
    let yaml = format!(
        "{yaml}admin: {{address: \"127.0.0.1:9\", token_file: \"{}\"}}\n",
        dir.join("admin.token").display()
    );
    let path = dir.join("tollgate.yaml");
    std::fs::write(&path, &yaml).expect("write");
    let gw = TestGateway::start(&yaml, SystemClock::new()).await;
    let ad = start_admin(&gw.gw, Some(TOKEN)).await;
    let digest = |k: &[u8]| hex(tollgate_config::consumers::key_digest(k));

    // A reload that drops `admin:` (which takes effect at the next restart: the API goes
    // on) still has the config's plain keys checked, though no change is logged yet.
    let without_admin = yaml[..yaml.find("admin:").expect("admin")].replace(
        "  - {name: alice, keys: [ka], plan: free}\n",
        "  - {name: alice, keys: [ka], plan: free}\n  - {name: erin, keys: [ke]}\n",
    );
    std::fs::write(&path, &without_admin).expect("write");
    gw.gw.reload_file(&path).expect("reload");
    let (s, v) = admin(
        ad,
        Method::PUT,
        "/consumers/bob",
        Some(json!({"key_sha256": [digest(b"ke")]})),
    )
    .await;
    assert_eq!(s, 409, "{v}");
    assert_eq!(
        v["error"],
        json!("key_sha256[0]: the config gives this key to consumer \"erin\""),
        "{v}"
    );
    std::fs::write(&path, &yaml).expect("write");
    gw.gw.reload_file(&path).expect("reload");

    // The API may not give bob a key the config gives to alice or carol.
    for (key, owner) in [(&b"ka"[..], "alice"), (b"kc", "carol")] {
        let (s, v) = admin(
            ad,
            Method::PUT,
            "/consumers/bob",
            Some(json!({"key_sha256": [digest(b"kb"), digest(key)]})),
        )
        .await;
        assert_eq!(s, 409, "{v}");
        assert_eq!(
            v["error"],
            json!(format!(
                "key_sha256[1]: the config gives this key to consumer \"{owner}\""
            )),
            "{v}"
        );
    }
    // A plain key is named where it was given.
    let (s, v) = admin(
        ad,
        Method::PUT,
        "/consumers/bob",
        Some(json!({"key_sha256": [digest(b"kb")], "keys": ["kx", "ka"]})),
    )
    .await;
    assert_eq!(s, 409, "{v}");
    assert_eq!(
        v["error"],
        json!("keys[1]: the config gives this key to consumer \"alice\""),
        "{v}"
    );
    assert_eq!(call(&gw, "/api/x", "ka").await.status, 200);
    // Its own config key, given to alice through the API too, names alice still.
    let (s, v) = admin(
        ad,
        Method::PUT,
        "/consumers/alice",
        Some(json!({"key_sha256": [digest(b"ka")]})),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    let (s, v) = admin(
        ad,
        Method::PUT,
        "/consumers/bob",
        Some(json!({"plan": "gold", "key_sha256": [digest(b"kb")]})),
    )
    .await;
    assert_eq!(s, 201, "{v}");

    // A reload giving bob's key to a consumer of the config is refused, and the old
    // config keeps serving: `kb` is bob's.
    std::fs::write(
        &path,
        yaml.replace(
            "  - {name: alice, keys: [ka], plan: free}\n",
            "  - {name: alice, keys: [ka], plan: free}\n  - {name: dave, keys: [kb]}\n",
        ),
    )
    .expect("write");
    let err = gw.gw.reload_file(&path).expect_err("refused").to_string();
    assert!(
        err.contains("consumers: consumer \"dave\" is given a key that consumer \"bob\" holds through the admin API"),
        "{err}"
    );
    let a = call(&gw, "/api/x", "kb").await;
    assert!(a.body.contains("x-consumer: bob\n"), "{}", a.body);

    // A reload dropping a plan a managed consumer is on is refused too: the consumer
    // would go unlimited.
    let (s, v) = admin(
        ad,
        Method::PUT,
        "/consumers/fay",
        Some(json!({"plan": "silver"})),
    )
    .await;
    assert_eq!(s, 201, "{v}");
    std::fs::write(
        &path,
        yaml.replace("  silver: {limits: [{requests: 5, per: 1m}]}\n", ""),
    )
    .expect("write");
    let err = gw.gw.reload_file(&path).expect_err("refused").to_string();
    assert!(
        err.contains(
            "plans: consumer \"fay\", managed through the admin API, is on plan \"silver\""
        ),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_plan_given_through_the_api_keeps_the_counts_of_the_limits_it_shares() {
    let dir = tempdir("managed-plan-counts");
    let (backend, _) = inspect_backend().await;
    let yaml = yaml(
        backend,
        &format!(
            r#"consumers_log: "{}"
plans:
  a: {{limits: [{{requests: 4, per: 1m, name: q}}]}}
  b: {{limits: [{{requests: 4, per: 1m, name: q}}, {{requests: 100, per: 1h}}]}}
consumers:
  - {{name: alice, keys: [ka], plan: a}}
routes:
  - {{name: api, path_prefix: /api/, upstream: backend, auth: {{header: [x-api-key]}}, limits: [{{requests: 2, per: 1m, name: route-q}}]}}
  - {{name: other, path_prefix: /other/, upstream: backend, auth: {{header: [x-api-key]}}}}
"#,
            dir.join("consumers.changes").display()
        ),
    );
    let gw = TestGateway::start(&yaml, SystemClock::new()).await;
    let ad = start_admin(&gw.gw, Some(TOKEN)).await;
    let refused_by = |a: &Answer| {
        assert_eq!(a.status, 429, "{}", a.body);
        let v: Value = serde_json::from_str(&a.body).expect("json");
        v["limit"].as_str().unwrap_or_default().to_string()
    };
    // The route's own limit used up, half of the plan's; both calls in one sub-window
    // of 6 s, so the counts are kept in the consumer's line, not in cells.
    for path in ["/api/1", "/api/2"] {
        assert_eq!(call(&gw, path, "ka").await.status, 200, "{path}");
    }
    // Moved to plan b, which holds q as well: the route's limit is still used up, and
    // q has two calls left, not four.
    let (s, v) = admin(
        ad,
        Method::PUT,
        "/consumers/alice",
        Some(json!({"plan": "b"})),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(refused_by(&call(&gw, "/api/3", "ka").await), "route-q");
    for path in ["/other/4", "/other/5"] {
        assert_eq!(call(&gw, path, "ka").await.status, 200, "{path}");
    }
    assert_eq!(refused_by(&call(&gw, "/other/6", "ka").await), "q");
    // The dashboard names it once among those closest to their quota.
    let (s, top) = admin(ad, Method::GET, "/top", None).await;
    assert_eq!(s, 200, "{top}");
    let names: Vec<&str> = top["closest_to_quota"]
        .as_array()
        .expect("list")
        .iter()
        .filter_map(|q| q["consumer"].as_str())
        .collect();
    assert_eq!(names, ["alice"], "{top}");
    // And back to a: q is used up there too.
    let (s, v) = admin(
        ad,
        Method::PUT,
        "/consumers/alice",
        Some(json!({"plan": "a"})),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(refused_by(&call(&gw, "/other/7", "ka").await), "q");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_consumer_may_be_put_with_its_name_and_plain_keys_and_leaves_the_list_when_deleted() {
    let (dir, gw, ad) = managed_gateway("managed-kong-style").await;
    // The name again in the body, and a key as the caller will send it.
    let (s, v) = admin(
        ad,
        Method::PUT,
        "/consumers/carol",
        Some(json!({"name": "carol", "plan": "gold", "keys": ["carol-key-1"]})),
    )
    .await;
    assert_eq!(s, 201, "{v}");
    assert!(
        !v.to_string().contains("carol-key-1"),
        "kept as a digest: {v}"
    );
    let a = call(&gw, "/gold/x", "carol-key-1").await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert!(a.body.contains("x-consumer: carol\n"), "{}", a.body);
    // A body naming another consumer is refused, as is a key that is no key.
    let (s, v) = admin(
        ad,
        Method::PUT,
        "/consumers/carol",
        Some(json!({"name": "dave"})),
    )
    .await;
    assert_eq!(s, 400, "{v}");
    let (s, v) = admin(
        ad,
        Method::PUT,
        "/consumers/carol",
        Some(json!({"keys": ["has space"]})),
    )
    .await;
    assert_eq!(s, 400, "{v}");
    // A new name a backend would split as a list is refused.
    for bad in ["x,y", "admin;role=root"] {
        let (s, v) = admin(
            ad,
            Method::PUT,
            &format!("/consumers/{bad}"),
            Some(json!({"keys": ["k-list"]})),
        )
        .await;
        assert_eq!(s, 400, "{bad}: {v}");
        assert!(
            v["error"].as_str().is_some_and(|e| e.contains("no , or ;")),
            "{v}"
        );
    }
    // Parameters: the list reads its own and refuses others; a consumer takes none, and
    // a DELETE given one is refused, not carried out.
    for path in [
        "/consumers?foo=1",
        "/consumers?Limit=2",
        "/consumers/carol?foo=1",
    ] {
        let (s, v) = admin(ad, Method::GET, path, None).await;
        assert_eq!(s, 400, "{path}: {v}");
        assert!(
            v["error"]
                .as_str()
                .is_some_and(|e| e.contains("unknown query parameter")),
            "{v}"
        );
    }
    let (s, v) = admin(ad, Method::DELETE, "/consumers/carol?dry_run=true", None).await;
    assert_eq!(s, 400, "{v}");
    assert_eq!(call(&gw, "/gold/x", "carol-key-1").await.status, 200);

    // Deleted, a consumer leaves the list; `?deleted=true` shows it still.
    let names = |v: &Value| -> Vec<String> {
        v["consumers"]
            .as_array()
            .expect("consumers")
            .iter()
            .map(|c| c["name"].as_str().expect("name").to_string())
            .collect()
    };
    let (_, v) = admin(ad, Method::GET, "/consumers", None).await;
    assert_eq!(names(&v), ["carol"], "{v}");
    let (s, _) = admin(ad, Method::DELETE, "/consumers/carol", None).await;
    assert_eq!(s, 200);
    assert_eq!(call(&gw, "/gold/x", "carol-key-1").await.status, 401);
    let (_, v) = admin(ad, Method::GET, "/consumers", None).await;
    assert!(names(&v).is_empty(), "{v}");
    let (_, v) = admin(ad, Method::GET, "/consumers?deleted=true", None).await;
    assert_eq!(names(&v), ["carol"], "{v}");
    assert_eq!(v["consumers"][0]["deleted"], true, "{v}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_listed_consumer_put_again_after_its_deletion_has_none_of_the_configs_keys() {
    let (dir, gw, ad) = managed_gateway("managed-again").await;
    assert_eq!(call(&gw, "/api/x", "ka").await.status, 200);
    let (s, _) = admin(ad, Method::DELETE, "/consumers/alice", None).await;
    assert_eq!(s, 200);
    assert_eq!(call(&gw, "/api/x", "ka").await.status, 401);
    // Made again (a plan sync, `tollgate consumers add`): the leaked key stays revoked.
    let (s, v) = admin(
        ad,
        Method::PUT,
        "/consumers/alice",
        Some(json!({"plan": "gold"})),
    )
    .await;
    assert_eq!(s, 201, "{v}");
    assert_eq!(v["config_keys"], false, "{v}");
    assert_eq!(call(&gw, "/api/x", "ka").await.status, 401);
    let (s, v) = admin(
        ad,
        Method::PUT,
        "/consumers/alice",
        Some(json!({"metadata": {"tier": "2"}})),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        call(&gw, "/api/x", "ka").await.status,
        401,
        "a later change keeps it revoked"
    );
    // A key given through the API names it, the config's own among them.
    let (s, v) = admin(
        ad,
        Method::PUT,
        "/consumers/alice",
        Some(json!({"keys": ["ka"]})),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    let a = call(&gw, "/api/x", "ka").await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert!(a.body.contains("x-consumer: alice\n"), "{}", a.body);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn the_change_log_does_not_move_under_a_running_gateway_nor_get_left_behind() {
    let dir = tempdir("managed-log-moves");
    let log = dir.join("consumers.changes");
    let (backend, _) = inspect_backend().await;
    let yaml = config(backend, &log);
    let path = dir.join("tollgate.yaml");
    std::fs::write(&path, &yaml).expect("write");
    let gw = TestGateway::start(&yaml, SystemClock::new()).await;
    let ad = start_admin(&gw.gw, Some(TOKEN)).await;
    let (s, v) = admin(ad, Method::DELETE, "/consumers/alice", None).await;
    assert_eq!(s, 200, "{v}");
    // A reload naming another log (or a consumers file, whose log is beside it) would
    // leave the deletion behind at the next start: refused, the old config serving on.
    let elsewhere = yaml.replace("consumers.changes", "moved.changes");
    std::fs::write(&path, &elsewhere).expect("write");
    let err = gw.gw.reload_file(&path).expect_err("refused").to_string();
    assert!(
        err.contains("consumers_log: this config keeps the consumers' changes in")
            && err.contains("the log moves only at a restart"),
        "{err}"
    );
    let (_, status) = admin(ad, Method::GET, "/status", None).await;
    assert_eq!(
        status["managed_consumers"]["log"],
        json!(log.display().to_string()),
        "{status}"
    );
    assert_eq!(call(&gw, "/api/x", "ka").await.status, 401, "still deleted");

    // At a start, a log with records beside the config file that the config does not
    // keep is a problem in its place, not a silent loss.
    let implied = tollgate_config::implied_consumers_log(&path);
    std::fs::copy(&log, &implied).expect("copy");
    let err = tollgate_config::from_text_of(&elsewhere, &path)
        .expect_err("refused")
        .to_string();
    assert!(
        err.contains("consumers_log")
            && err.contains("holds changes made through the admin API")
            && err.contains(&implied.display().to_string()),
        "{err}"
    );
    // Named in consumers_log, it is taken.
    let named = yaml.replace(&log.display().to_string(), &implied.display().to_string());
    tollgate_config::from_text_of(&named, &path).expect("its own log");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_body_past_the_limit_gets_413() {
    let (dir, _gw, ad) = managed_gateway("managed-large-body").await;
    let big = json!({"plan": "gold", "metadata": {"pad": "x".repeat(300 * 1024)}});
    let (s, v) = admin(ad, Method::PUT, "/consumers/bob", Some(big)).await;
    assert_eq!(s, 413, "{v}");
    assert_eq!(v["error"], "the body must be JSON of at most 256KiB", "{v}");
    let _ = std::fs::remove_dir_all(&dir);
}
