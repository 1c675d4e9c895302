//! Limits shared through a real Redis Cluster on loopback: each consumer's counts in the
//! slot of its name, spread over the masters; a slot moved to another master (MOVED) and
//! a master killed and replaced by its replica, followed without a restart. One node of it
//! named as the server is retried with backoff.

mod common;

use common::redis_cluster::{wait, RedisCluster};
use common::*;
use http::StatusCode;
use std::sync::Arc;
use std::time::Duration;
use tollgate_gateway::ManualClock;

const CONSUMERS: [&str; 6] = ["c0", "c1", "c2", "c3", "c4", "c5"];

fn cfg(backend: std::net::SocketAddr, cluster: &RedisCluster) -> String {
    let consumers: String = CONSUMERS
        .iter()
        .map(|c| format!("  - {{name: {c}, keys: [k{c}], plan: standard}}\n"))
        .collect();
    yaml(
        backend,
        &format!(
            r#"
cluster:
  redis: {{cluster_nodes: [{seeds}]}}
  sync_interval: 5ms
  key_prefix: tgc
plans:
  standard: {{limits: [{{requests: 100, per: 10s}}]}}
consumers:
{consumers}routes:
  - {{name: test, path_prefix: /test/, upstream: backend, auth: {{}}}}
"#,
            seeds = cluster.seeds()
        ),
    )
}

fn key(consumer: &str) -> String {
    format!("tgc:consumer:{{{consumer}}}:per-10s:10")
}

/// A manual clock at the start of a window.
fn clock() -> Arc<ManualClock> {
    let c = ManualClock::new();
    c.advance(Duration::from_secs(1_700_000_000));
    c
}

/// Two nodes on `yaml`, once each sees the other through the cluster.
async fn two_nodes(yaml: &str, clock: &Arc<ManualClock>) -> Vec<TestGateway> {
    let nodes = vec![
        TestGateway::start(yaml, clock.clone()).await,
        TestGateway::start(yaml, clock.clone()).await,
    ];
    up(&nodes).await;
    nodes
}

async fn up(nodes: &[TestGateway]) {
    bounded("nodes share through the cluster", async {
        for n in nodes {
            while !n
                .gw
                .cluster()
                .is_some_and(|c| c.is_up() && c.nodes() == nodes.len() as u64)
            {
                synced(n).await;
            }
        }
    })
    .await;
}

/// `tries` calls of `consumer`, alternating nodes, each settled before the next; the
/// number admitted.
async fn drive(nodes: &[TestGateway], c: &TestClient, consumer: &str, tries: usize) -> u64 {
    let mut admitted = 0;
    for i in 0..tries {
        let node = &nodes[i % nodes.len()];
        let a = c
            .get(&node.url(&format!("/test/?apikey=k{consumer}")))
            .await;
        match a.status {
            StatusCode::OK => admitted += 1,
            StatusCode::TOO_MANY_REQUESTS => {}
            s => panic!("unexpected {s} for {consumer}: {}", a.body),
        }
        synced(node).await;
    }
    admitted
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumers_spread_over_the_masters_and_a_moved_slot_is_followed() {
    let cluster = RedisCluster::start("redis-cluster-moved", false);
    let backend = echo_backend().await;
    let clock = clock();
    let yaml = cfg(backend, &cluster);
    let nodes = two_nodes(&yaml, &clock).await;
    let c = TestClient::default();
    let mut owners = Vec::new();
    for consumer in CONSUMERS {
        // 130 calls for a limit of 100 (credit 0: 100 × 1% < 2 nodes): exactly 100 pass.
        assert_eq!(drive(&nodes, &c, consumer, 130).await, 100, "{consumer}");
        let owner = cluster.owner(&key(consumer));
        assert_eq!(cluster.nodes[owner].hsum(&key(consumer)), 100, "{consumer}");
        owners.push(owner);
    }
    owners.sort_unstable();
    owners.dedup();
    assert!(
        owners.len() >= 2,
        "every consumer on one master: {owners:?}"
    );

    // c0's slot moves, with its counts, to another master: the nodes are answered MOVED
    // and follow it; the counts moved with it, so c0 is still used up.
    let from = cluster.owner(&key("c0"));
    let to = (from + 1) % 3;
    cluster.migrate(&key("c0"), from, to);
    wait("the slot moved", || cluster.owner(&key("c0")) == to);
    assert_eq!(drive(&nodes, &c, "c0", 20).await, 0);
    // A window later the limit is free again, and counted where the slot now lives.
    clock.advance(Duration::from_secs(11));
    assert_eq!(drive(&nodes, &c, "c0", 130).await, 100);
    assert_eq!(cluster.nodes[to].hsum(&key("c0")), 100);
    assert_eq!(cluster.nodes[from].hsum(&key("c0")), 0);
    for n in &nodes {
        assert!(n.gw.cluster().is_some_and(|c| c.is_up()));
    }

    // /status names the masters and the slots they serve.
    let admin = start_admin(&nodes[0].gw, None).await;
    let a = TestClient::default()
        .get(&format!("http://{admin}/status"))
        .await;
    let status: serde_json::Value = serde_json::from_str(&a.body).expect("json");
    let server = &status["cluster"]["server"];
    assert_eq!(server["slots_known"], 16384, "{status}");
    assert_eq!(
        server["masters"].as_array().map(Vec::len),
        Some(3),
        "{status}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_master_is_replaced_by_its_replica_without_a_restart() {
    let mut cluster = RedisCluster::start("redis-cluster-failover", true);
    let backend = echo_backend().await;
    let clock = clock();
    let yaml = cfg(backend, &cluster);
    let nodes = two_nodes(&yaml, &clock).await;
    let c = TestClient::default();
    // Each node's first call waits for its lease (no credit for so small a limit).
    let first = drive(&nodes, &c, "c0", 50).await;
    assert!((48..=50).contains(&first), "{first}");
    let old = cluster.owner(&key("c0"));
    let before = nodes[0].gw.cluster().expect("cluster").server();
    assert_eq!(before.masters.len(), 3);

    // The master of c0's slot dies; the cluster promotes its replica.
    cluster.nodes[old].kill();
    wait("a replica promoted", || {
        cluster
            .nodes
            .iter()
            .enumerate()
            .any(|(i, n)| i != old && n.owns(&key("c0")))
    });
    cluster.wait_ok();
    let new = cluster.owner(&key("c0"));
    assert_ne!(new, old);
    // The nodes follow the promoted master: c0 is counted there again. What the old master
    // had not replicated may be lost (asynchronous replication), so the count there is at
    // most the 50 and the calls since.
    let admitted = drive(&nodes, &c, "c0", 80).await;
    assert!(admitted > 0, "nothing admitted after the failover");
    let counted = cluster.nodes[new].hsum(&key("c0"));
    assert!(
        counted >= admitted && counted <= 100,
        "{counted} counted on the promoted master, {admitted} admitted since"
    );
    let after = bounded("the node sees the new master", async {
        loop {
            let s = nodes[0].gw.cluster().expect("cluster").server();
            if s.masters
                .contains(&format!("127.0.0.1:{}", cluster.nodes[new].port))
            {
                return s;
            }
            synced(&nodes[0]).await;
        }
    })
    .await;
    assert!(after.switched_at.is_some(), "{after:?}");
}

/// A Redis Cluster of three masters without replicas whose masters serve the slots they
/// keep when one fails (`cluster-require-full-coverage no`), and one node on it with
/// `on_redis_down: closed`.
struct Apart {
    cluster: RedisCluster,
    nodes: [TestGateway; 1],
    /// A master that keeps neither the live nodes' set nor `alive`'s limit.
    master: usize,
    /// A consumer whose limit `master` keeps.
    gone: &'static str,
    /// A consumer whose limit another master keeps.
    alive: &'static str,
}

/// One call of `who` on `node`.
async fn call(node: &TestGateway, c: &TestClient, who: &str) -> Answer {
    c.get(&node.url(&format!("/test/?apikey=k{who}"))).await
}

async fn one_master_apart(name: &str) -> Apart {
    let cluster = RedisCluster::start_with(name, false, &["--cluster-require-full-coverage", "no"]);
    let backend = echo_backend().await;
    let yaml = cfg(backend, &cluster).replace(
        "  sync_interval: 5ms\n",
        "  sync_interval: 5ms\n  on_redis_down: closed\n",
    );
    assert!(yaml.contains("on_redis_down: closed"), "{yaml}");
    let nodes = [TestGateway::start(&yaml, clock()).await];
    up(&nodes).await;
    // The heartbeat stays answered, so the node's rounds end as they would.
    let heartbeat = cluster.owner("tgc:nodes");
    let gone = CONSUMERS
        .into_iter()
        .find(|c| cluster.owner(&key(c)) != heartbeat)
        .expect("a consumer on another master than the heartbeat's");
    let master = cluster.owner(&key(gone));
    let alive = CONSUMERS
        .into_iter()
        .find(|c| cluster.owner(&key(c)) != master)
        .expect("a consumer on another master");
    Apart {
        cluster,
        nodes,
        master,
        gone,
        alive,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_master_sends_only_the_consumers_it_keeps_to_on_redis_down() {
    let Apart {
        mut cluster,
        nodes,
        master,
        gone,
        alive,
    } = one_master_apart("redis-cluster-dead-master").await;
    let c = TestClient::default();
    assert_eq!(drive(&nodes, &c, gone, 10).await, 10);

    cluster.nodes[master].kill();
    // `gone`'s limit is kept by the dead master: its calls get 503 (`closed`) once the
    // tokens in hand are spent.
    bounded("refused while its master is down", async {
        loop {
            let a = call(&nodes[0], &c, gone).await;
            match a.status {
                StatusCode::SERVICE_UNAVAILABLE => break,
                StatusCode::OK => synced(&nodes[0]).await,
                s => panic!("unexpected {s} for {gone}: {}", a.body),
            }
        }
    })
    .await;
    // Another consumer's limit is still shared through its own master, exactly: 100 of
    // 130 admitted, the rest 429, none 503.
    assert_eq!(drive(&nodes, &c, alive, 130).await, 100, "{alive}");
    let owner = cluster.owner(&key(alive));
    assert_eq!(cluster.nodes[owner].hsum(&key(alive)), 100, "{alive}");
    assert!(nodes[0].gw.cluster().is_some_and(|c| c.is_up()));
    // `gone` is still refused: the dead master's slots have no other home.
    let a = call(&nodes[0], &c, gone).await;
    assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE, "{}", a.body);
    // Its round failed in part, and the node says so beside `redis_up`.
    synced(&nodes[0]).await;
    assert!(nodes[0].gw.cluster().is_some_and(|c| c.is_partly_down()));
    let m = nodes[0].gw.metrics_text();
    assert!(m.contains("tollgate_cluster_redis_partly_down 1"), "{m}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_master_holds_back_only_the_consumers_it_keeps() {
    let Apart {
        cluster,
        nodes,
        master,
        gone,
        alive,
    } = one_master_apart("redis-cluster-hung-master").await;
    let c = TestClient::default();
    let owner = cluster.owner(&key(alive));
    assert_eq!(drive(&nodes, &c, gone, 10).await, 10);

    // The master stops answering, its connections open: `gone`'s asks stay in flight
    // until they time out, then it gets 503 (`closed`).
    cluster.nodes[master].pause(true);
    bounded("refused while its master hangs", async {
        loop {
            // Tokens in hand first, then a wait for a lease that ends in 429 or, once the
            // ask has timed out, 503.
            let a = call(&nodes[0], &c, gone).await;
            match a.status {
                StatusCode::SERVICE_UNAVAILABLE => break,
                StatusCode::OK | StatusCode::TOO_MANY_REQUESTS => {}
                s => panic!("unexpected {s} for {gone}: {}", a.body),
            }
        }
    })
    .await;
    // Each call of `gone` sends a probe of its limit to the hung master (each stays in
    // flight for its timeout), and none of them holds back the rounds that lease for the
    // other consumer: its 100 calls, each waiting for its lease, pass well within the
    // deadline (rounds held back by the hung part would take a second or more each).
    bounded("the other consumer's calls", async {
        for admitted in 0..100 {
            let a = call(&nodes[0], &c, gone).await;
            assert_eq!(
                a.status,
                StatusCode::SERVICE_UNAVAILABLE,
                "{gone}: {}",
                a.body
            );
            let a = call(&nodes[0], &c, alive).await;
            assert_eq!(
                a.status,
                StatusCode::OK,
                "{alive} after {admitted}: {}",
                a.body
            );
        }
    })
    .await;
    let a = call(&nodes[0], &c, alive).await;
    assert_eq!(a.status, StatusCode::TOO_MANY_REQUESTS, "{}", a.body);
    assert_eq!(cluster.nodes[owner].hsum(&key(alive)), 100, "{alive}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_made_on_one_node_reaches_the_other_through_the_cluster() {
    let cluster = RedisCluster::start("redis-cluster-managed", false);
    let backend = echo_backend().await;
    let dir = tempdir("redis-cluster-managed");
    let node = |n: usize| {
        format!(
            "{}consumers_log: \"{}\"\n",
            cfg(backend, &cluster),
            dir.join(format!("node{n}.changes")).display()
        )
    };
    let clock = clock();
    let a = TestGateway::start(&node(0), clock.clone()).await;
    let b = TestGateway::start(&node(1), clock.clone()).await;
    let ad = start_admin(&a.gw, Some("t0ken")).await;
    let admin = |method: http::Method, path: &'static str, body: &'static str| {
        let c = TestClient::default();
        async move {
            let a = c
                .request(
                    method,
                    &format!("http://{ad}{path}"),
                    &[("authorization", "Bearer t0ken")],
                    body,
                )
                .await;
            (a.status, a.body)
        }
    };
    let (s, _) = admin(
        http::Method::PUT,
        "/consumers/zed",
        r#"{"plan": "standard"}"#,
    )
    .await;
    assert_eq!(s, StatusCode::CREATED);
    let (s, made) = admin(http::Method::POST, "/consumers/zed/keys", "").await;
    assert_eq!(s, StatusCode::CREATED, "{made}");
    let made: serde_json::Value = serde_json::from_str(&made).expect("json");
    let key = made["key"].as_str().expect("key").to_string();
    // The record and its change go through the one slot of `{tgc:consumers}`; the other
    // node takes the key from there.
    let c = TestClient::default();
    bounded("the other node takes zed's key", async {
        while c.get(&b.url(&format!("/test/?apikey={key}"))).await.status != StatusCode::OK {
            synced(&b).await;
        }
    })
    .await;
    let holder = cluster.owner("{tgc:consumers}");
    assert!(cluster.nodes[holder].conn().is_some_and(|mut c| {
        ::redis::cmd("HEXISTS")
            .arg("{tgc:consumers}")
            .arg("zed")
            .query::<bool>(&mut c)
            .unwrap_or(false)
    }));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_node_of_a_cluster_named_as_the_server_is_retried_with_backoff() {
    // One node of a Redis Cluster given as `url`: the managed consumers' reads and the
    // limits' rounds get MOVED for the slots it does not keep, on every connection.
    let cluster = RedisCluster::start("cluster-as-url", false);
    let node = &cluster.nodes[0];
    let prefix = (0..100)
        .map(|i| format!("tgu{i}"))
        .find(|p| !node.owns(&format!("{{{p}:consumers}}")) && !node.owns(&format!("{p}:nodes")))
        .expect("a prefix whose consumers and nodes live on other masters");
    let mut watch = node.conn().expect("a connection to the node");
    let before = common::redis::connections_taken(&mut watch);
    let backend = echo_backend().await;
    let yaml = yaml(
        backend,
        &format!(
            r#"
cluster:
  redis: redis://127.0.0.1:{port}/0
  sync_interval: 10ms
  key_prefix: {prefix}
consumers: [{{name: alice, keys: [ka]}}]
routes:
  - {{name: test, path_prefix: /test/, upstream: backend, auth: {{}}}}
"#,
            port = node.port
        ),
    );
    let started = std::time::Instant::now();
    let _gw = TestGateway::start(&yaml, clock()).await;
    // The limits' syncer and the managed consumers' link each back off (100, 200, 400,
    // 800 ms, …): fourteen connections between them take over two and a half seconds.
    // Reconnected from each connect, the consumers' link alone made ten a second.
    wait("fourteen connections from the node", || {
        common::redis::connections_taken(&mut watch) >= before + 14
    });
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(2500),
        "fourteen connections within {took:?}: no backoff"
    );
}
