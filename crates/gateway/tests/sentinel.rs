//! Limits shared through the master Redis Sentinel names: a master, its replica and three
//! sentinels on loopback. The master is killed and the gateway follows the one the
//! sentinels promote, without a restart; a planned failover (`SENTINEL FAILOVER`) is
//! followed before the sentinels demote the old master, through sentinels that ask for a
//! password, and does not loosen a limit. A replica named as the server is retried with
//! backoff, not at every sync interval.

mod common;

use common::ports::free_port;
use common::*;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tollgate_gateway::SystemClock;

/// A redis-server (or sentinel) process, killed by its pid when dropped.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn(args: &[String]) -> Proc {
    Proc(
        Command::new("redis-server")
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server must be installed (the test script installs it)"),
    )
}

fn conn(port: u16) -> Option<::redis::Connection> {
    conn_as(port, "")
}

/// A connection to `port` with `auth` (`:password@`, or empty).
fn conn_as(port: u16, auth: &str) -> Option<::redis::Connection> {
    let client = ::redis::Client::open(format!("redis://{auth}127.0.0.1:{port}/0")).ok()?;
    client
        .get_connection_with_timeout(Duration::from_secs(1))
        .ok()
}

/// Waits (bounded) until `ok` holds.
fn wait(what: &str, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + DEADLINE;
    while !ok() {
        assert!(Instant::now() < deadline, "{what}: not within {DEADLINE:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The latest heartbeat (milliseconds since the epoch) a gateway wrote to `nodes` on the
/// server at `port`; 0 when there is none.
fn heartbeat_at(port: u16, nodes: &str) -> f64 {
    conn(port)
        .and_then(|mut c| {
            ::redis::cmd("ZRANGE")
                .arg(nodes)
                .arg(-1)
                .arg(-1)
                .arg("WITHSCORES")
                .query::<Vec<(String, f64)>>(&mut c)
                .ok()
        })
        .and_then(|v| v.first().map(|(_, score)| *score))
        .unwrap_or(0.0)
}

fn role(port: u16) -> Option<String> {
    let mut c = conn(port)?;
    let v: Vec<::redis::Value> = ::redis::cmd("ROLE").query(&mut c).ok()?;
    match v.first()? {
        ::redis::Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        ::redis::Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}

/// Milliseconds since the epoch now, as the gateway's heartbeats are scored.
fn now_ms() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_millis() as f64
}

/// The sentinels at `ports`, as a YAML list.
fn sentinel_list(ports: &[u16]) -> String {
    let list: Vec<String> = ports.iter().map(|p| format!("\"127.0.0.1:{p}\"")).collect();
    format!("[{}]", list.join(", "))
}

/// Waits until the sentinel on `s` has heard from the replica in sync: it promotes no other.
fn wait_replica_known(s: &mut ::redis::Connection) {
    wait("the sentinel knows the replica", || {
        ::redis::cmd("SENTINEL")
            .arg("REPLICAS")
            .arg("tg")
            .query::<Vec<std::collections::HashMap<String, String>>>(s)
            .is_ok_and(|list| {
                list.iter().any(|i| {
                    i.get("flags").map(String::as_str) == Some("slave")
                        && i.get("master-link-status").map(String::as_str) == Some("ok")
                })
            })
    });
}

/// A master, its replica in sync, and three sentinels watching the master as `tg` (with
/// `password`, the sentinels ask for it, of clients and of each other).
struct Sentinels {
    dir: std::path::PathBuf,
    m: u16,
    r: u16,
    master: Option<Proc>,
    _replica: Proc,
    ports: Vec<u16>,
    _sentinels: Vec<Proc>,
}

/// A master and its replica on free ports, the replica in sync: their ports and processes.
fn master_and_replica(dir: &std::path::Path) -> (u16, u16, Proc, Proc) {
    let (m, r) = (free_port(), free_port());
    let base = |port: u16| {
        vec![
            "--port".to_string(),
            port.to_string(),
            "--bind".into(),
            "127.0.0.1".into(),
            "--save".into(),
            String::new(),
            "--appendonly".into(),
            "no".into(),
            // The replica's full sync streams, and nothing is written where the test runs.
            "--repl-diskless-sync".into(),
            "yes".into(),
            "--dir".into(),
            dir.display().to_string(),
        ]
    };
    let master = spawn(&base(m));
    let mut replica_args = base(r);
    replica_args.extend(["--replicaof".into(), "127.0.0.1".into(), m.to_string()]);
    let replica = spawn(&replica_args);
    wait("the replica in sync", || {
        conn(r).is_some_and(|mut c| {
            ::redis::cmd("INFO")
                .arg("replication")
                .query::<String>(&mut c)
                .is_ok_and(|i| i.contains("master_link_status:up"))
        })
    });
    (m, r, master, replica)
}

fn sentinels(name: &str, password: Option<&str>) -> Sentinels {
    let dir = tempdir(name);
    let (m, r, master, replica) = master_and_replica(&dir);
    let master = Some(master);
    let auth = password.map_or_else(String::new, |pw| {
        format!("requirepass {pw}\nsentinel sentinel-pass {pw}\n")
    });
    let ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
    let procs: Vec<Proc> = ports
        .iter()
        .map(|&p| {
            let conf = dir.join(format!("sentinel-{p}.conf"));
            std::fs::write(
                &conf,
                format!(
                    "port {p}\nbind 127.0.0.1\n{auth}sentinel monitor tg 127.0.0.1 {m} 2\nsentinel down-after-milliseconds tg 500\nsentinel failover-timeout tg 2000\nsentinel parallel-syncs tg 1\n"
                ),
            )
            .expect("sentinel config");
            spawn(&[conf.display().to_string(), "--sentinel".into()])
        })
        .collect();
    let auth = password.map_or_else(String::new, |pw| format!(":{pw}@"));
    for &p in &ports {
        wait("a sentinel up", || {
            conn_as(p, &auth)
                .is_some_and(|mut c| ::redis::cmd("PING").query::<String>(&mut c).is_ok())
        });
    }
    Sentinels {
        dir,
        m,
        r,
        master,
        _replica: replica,
        ports,
        _sentinels: procs,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_is_followed_without_a_restart() {
    let mut set = sentinels("sentinel", None);
    let (dir, m, r, sentinel_ports) = (set.dir.clone(), set.m, set.r, set.ports.clone());
    let (backend, _) = inspect_backend().await;
    let sentinels = sentinel_list(&sentinel_ports);
    let yaml = yaml(
        backend,
        &format!(
            r#"consumers: [{{name: alice, keys: [ka]}}]
routes:
  - {{name: api, path_prefix: /api/, upstream: backend, auth: {{}}, limits: [{{requests: 1000, per: 1h}}]}}
cluster:
  redis: {{sentinels: {sentinels}, master_name: tg}}
  key_prefix: sentinel{pid}
"#,
            pid = std::process::id()
        ),
    );
    let gw = TestGateway::start(&yaml, SystemClock::new()).await;
    let client = TestClient::default();
    let admin = start_admin(&gw.gw, None).await;
    let server = |status: &serde_json::Value| status["cluster"]["server"].clone();
    let status = || async {
        let a = TestClient::default()
            .get(&format!("http://{admin}/status"))
            .await;
        serde_json::from_str::<serde_json::Value>(&a.body).unwrap_or_default()
    };
    let up = "tollgate_cluster_redis_up 1";
    assert!(
        metrics_with(&gw.gw, up).await.contains(up),
        "never reached the master"
    );
    for _ in 0..5 {
        assert_eq!(client.get(&gw.url("/api/x?apikey=ka")).await.status, 200);
    }
    // The gateway writes to the master it was given.
    let counted = |port: u16| {
        conn(port).is_some_and(|mut c| {
            ::redis::cmd("KEYS")
                .arg(format!("sentinel{}*", std::process::id()))
                .query::<Vec<String>>(&mut c)
                .is_ok_and(|k| !k.is_empty())
        })
    };
    wait("counts in the master", || counted(m));
    let before = status().await;
    assert_eq!(
        server(&before)["address"],
        format!("127.0.0.1:{m}"),
        "{before}"
    );
    assert!(server(&before)["switched_at"].is_null(), "{before}");

    // The master dies; the sentinels promote the replica; the gateway follows it.
    drop(set.master.take());
    let start = Instant::now();
    wait("the replica promoted", || {
        role(r).as_deref() == Some("master")
    });
    let promoted = start.elapsed();
    // The gateway's heartbeat (a score of milliseconds in `PREFIX:nodes`) written to the
    // promoted server after its promotion: the gateway follows it.
    let promoted_ms = now_ms();
    let nodes = format!("sentinel{}:nodes", std::process::id());
    let heartbeat = || heartbeat_at(r, &nodes);
    let mut followed = None;
    let deadline = Instant::now() + DEADLINE;
    while followed.is_none() && Instant::now() < deadline {
        let _ = client.get(&gw.url("/api/x?apikey=ka")).await;
        if heartbeat() > promoted_ms && metrics_has(&gw, up) {
            followed = Some(start.elapsed());
        } else {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let followed = followed.expect("the gateway never followed the new master");
    eprintln!("promoted after {promoted:?}; the gateway followed after {followed:?}");
    assert_eq!(client.get(&gw.url("/api/x?apikey=ka")).await.status, 200);
    // `/status` names the server the node moved to, and when.
    let after = status().await;
    assert_eq!(
        server(&after)["address"],
        format!("127.0.0.1:{r}"),
        "{after}"
    );
    assert!(server(&after)["switched_at"].is_u64(), "{after}");
    let _ = std::fs::remove_dir_all(&dir);
}

fn metrics_has(gw: &TestGateway, line: &str) -> bool {
    gw.gw.metrics_text().lines().any(|l| l == line)
}

/// `SENTINEL FAILOVER` promotes the replica while the old master still takes writes until
/// the sentinels demote it (seconds later): the gateway moves to the new master as the
/// sentinels promote it, not when the old one starts refusing writes. The sentinels ask for a
/// password here, given as `sentinel_password_file`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_planned_failover_is_followed_before_the_old_master_is_demoted() {
    let set = sentinels("sentinel-planned", Some("s3ntinel"));
    let (m, r) = (set.m, set.r);
    let pass = set.dir.join("sentinel.pass");
    std::fs::write(&pass, "s3ntinel\n").expect("password file");
    let (backend, _) = inspect_backend().await;
    let list = sentinel_list(&set.ports);
    let prefix = format!("planned{}", std::process::id());
    let yaml = yaml(
        backend,
        &format!(
            r#"consumers: [{{name: alice, keys: [ka]}}]
routes:
  - {{name: api, path_prefix: /api/, upstream: backend, auth: {{}}, limits: [{{requests: 1000, per: 1h}}]}}
cluster:
  redis: {{sentinels: {list}, master_name: tg, sentinel_password_file: "{pass}"}}
  key_prefix: {prefix}
"#,
            pass = pass.display()
        ),
    );
    let gw = TestGateway::start(&yaml, SystemClock::new()).await;
    let client = TestClient::default();
    let up = "tollgate_cluster_redis_up 1";
    assert!(
        metrics_with(&gw.gw, up).await.contains(up),
        "never reached the master through sentinels that ask for a password"
    );
    assert_eq!(client.get(&gw.url("/api/x?apikey=ka")).await.status, 200);
    let nodes = format!("{prefix}:nodes");
    let heartbeat = |port: u16| heartbeat_at(port, &nodes);
    wait("the heartbeat in the master", || heartbeat(m) > 0.0);

    let mut s = conn_as(set.ports[0], ":s3ntinel@").expect("a sentinel");
    wait_replica_known(&mut s);
    let asked: String = ::redis::cmd("SENTINEL")
        .arg("FAILOVER")
        .arg("tg")
        .query(&mut s)
        .expect("SENTINEL FAILOVER");
    assert_eq!(asked, "OK");
    wait("the replica promoted", || {
        role(r).as_deref() == Some("master")
    });
    let promoted_ms = now_ms();
    let deadline = Instant::now() + DEADLINE;
    while heartbeat(r) <= promoted_ms {
        assert!(
            Instant::now() < deadline,
            "the gateway never moved to the promoted master"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Moved while the old master still took writes: the sentinels had named the new one.
    assert_eq!(
        role(m).as_deref(),
        Some("master"),
        "the gateway moved only once the old master was demoted"
    );
    assert_eq!(client.get(&gw.url("/api/x?apikey=ka")).await.status, 200);
    let _ = std::fs::remove_dir_all(&set.dir);
}

/// A planned failover does not loosen a limit: the sentinels announce the replica they
/// promote before they promote it, and the gateway stops leasing from the old master then
/// (what the old master granted after the promotion would be lost with its demotion, and
/// admitted again by the new one). A limit of 300 an hour, called about 100 times a second
/// across the failover until the new master refuses, admits no more than 300, and nothing
/// is written to the old master after the replica's promotion. The failover is asked of
/// another sentinel than the one the gateway asks first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_planned_failover_does_not_loosen_a_limit() {
    let set = sentinels("sentinel-exact", None);
    let (m, r) = (set.m, set.r);
    let (backend, _) = inspect_backend().await;
    let list = sentinel_list(&set.ports);
    let prefix = format!("exact{}", std::process::id());
    let yaml = yaml(
        backend,
        &format!(
            r#"consumers: [{{name: alice, keys: [ka]}}]
routes:
  - {{name: api, path_prefix: /api/, upstream: backend, auth: {{}}, limits: [{{requests: 300, per: 1h}}]}}
cluster:
  redis: {{sentinels: {list}, master_name: tg}}
  key_prefix: {prefix}
  max_overadmission: 0%
"#
        ),
    );
    let gw = TestGateway::start(&yaml, SystemClock::new()).await;
    let client = TestClient::default();
    let up = "tollgate_cluster_redis_up 1";
    assert!(metrics_with(&gw.gw, up).await.contains(up));
    // Asked of the last sentinel: the gateway asks the first one which master they name.
    let mut s = conn(set.ports[2]).expect("a sentinel");
    wait_replica_known(&mut s);
    let nodes = format!("{prefix}:nodes");
    let (mut admitted, mut asked_failover, mut promoted_ms) = (0u32, false, None);
    let mut refused_since: Option<Instant> = None;
    // The latest the gateway wrote to the old master while it was still a master.
    let mut last_on_old = 0.0f64;
    let deadline = Instant::now() + DEADLINE;
    // Paced calls (the load, not a wait for anything): about 100 a second, so that the
    // failover falls while the limit still has room.
    let mut pace = tokio::time::interval(Duration::from_millis(10));
    loop {
        assert!(Instant::now() < deadline, "never refused for good");
        pace.tick().await;
        match client
            .get(&gw.url("/api/x?apikey=ka"))
            .await
            .status
            .as_u16()
        {
            200 => {
                admitted += 1;
                refused_since = None;
            }
            429 | 503 => {
                refused_since.get_or_insert_with(Instant::now);
            }
            other => panic!("unexpected status {other}"),
        }
        if !asked_failover && admitted >= 60 {
            let ok: String = ::redis::cmd("SENTINEL")
                .arg("FAILOVER")
                .arg("tg")
                .query(&mut s)
                .expect("SENTINEL FAILOVER");
            assert_eq!(ok, "OK");
            asked_failover = true;
        }
        if asked_failover && promoted_ms.is_none() && role(r).as_deref() == Some("master") {
            promoted_ms = Some(now_ms());
        }
        if promoted_ms.is_some() && role(m).as_deref() == Some("master") {
            last_on_old = last_on_old.max(heartbeat_at(m, &nodes));
        }
        // Done once the node writes to the promoted master and has refused for a second.
        let on_new = promoted_ms.is_some_and(|p| heartbeat_at(r, &nodes) > p);
        if on_new && refused_since.is_some_and(|t| t.elapsed() > Duration::from_secs(1)) {
            break;
        }
    }
    // Nothing written to the old master once the replica was a master: what it took then
    // would be lost with its demotion.
    let promoted_ms = promoted_ms.unwrap_or(0.0);
    assert!(
        last_on_old <= promoted_ms,
        "the gateway wrote to the old master {:.0} ms after the replica's promotion",
        last_on_old - promoted_ms
    );
    assert!(
        admitted <= 300,
        "{admitted} admitted for a limit of 300 across a planned failover"
    );
    // Tokens still held from the old master are dropped when the new one grants: a few
    // may go unused, never more admitted.
    assert!(admitted >= 240, "only {admitted} of 300 admitted");
    let _ = std::fs::remove_dir_all(&set.dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_named_as_the_server_is_retried_with_backoff() {
    // A master and its replica; the node is given the replica, which refuses writes
    // (READONLY) on every connection the node makes.
    let dir = tempdir("replica-named");
    let (_, r, _master, _replica) = master_and_replica(&dir);
    let mut watch = conn(r).expect("a connection to the replica");
    let before = common::redis::connections_taken(&mut watch);
    let (backend, _) = inspect_backend().await;
    let yaml = yaml(
        backend,
        &format!(
            r#"consumers: [{{name: alice, keys: [ka]}}]
routes:
  - {{name: api, path_prefix: /api/, upstream: backend, auth: {{}}, limits: [{{requests: 1000, per: 1h}}]}}
cluster:
  redis: redis://127.0.0.1:{r}/0
  sync_interval: 10ms
"#
        ),
    );
    let started = Instant::now();
    let gw = TestGateway::start(&yaml, SystemClock::new()).await;
    // Each connection of the syncer fails its first round. Made again at once, it took
    // about one a sync interval (a hundred a second); with the backoff (100, 200,
    // 400 ms…) its fourth comes 700 ms after its first at the soonest. (One more
    // connection is the managed consumers' reader, which a replica serves.)
    wait("five connections from the node", || {
        common::redis::connections_taken(&mut watch) >= before + 5
    });
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(600),
        "five connections within {took:?}: no backoff"
    );
    let down = "tollgate_cluster_redis_up 0";
    assert!(metrics_with(&gw.gw, down).await.contains(down));
    let _ = std::fs::remove_dir_all(&dir);
}
