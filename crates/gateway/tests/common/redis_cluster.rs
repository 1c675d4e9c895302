//! A real Redis Cluster on loopback, owned by the test: three masters, each with a replica
//! when asked, made with `redis-cli --cluster create`. Processes are killed by their pid
//! when dropped.

use super::ports::free_port;
use super::DEADLINE;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// One redis-server of the cluster.
pub struct Node {
    pub port: u16,
    child: Option<Child>,
}

impl Node {
    /// Kills it (SIGKILL, like a crash).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Stops (`SIGSTOP`, a hung server: connections open, nothing answered) or resumes it.
    pub fn pause(&self, stop: bool) {
        if let Some(c) = &self.child {
            let sig = if stop { "-STOP" } else { "-CONT" };
            let done = Command::new("kill")
                .args([sig, &c.id().to_string()])
                .status()
                .expect("kill runs");
            assert!(done.success(), "kill {sig}");
        }
    }

    /// A connection to it alone (no redirections followed).
    pub fn conn(&self) -> Option<redis::Connection> {
        let client = redis::Client::open(format!("redis://127.0.0.1:{}/0", self.port)).ok()?;
        client
            .get_connection_with_timeout(Duration::from_secs(1))
            .ok()
    }

    /// `CLUSTER MYID`.
    pub fn id(&self) -> String {
        let mut c = self.conn().expect("node answers");
        redis::cmd("CLUSTER")
            .arg("MYID")
            .query(&mut c)
            .expect("CLUSTER MYID")
    }

    /// Whether it is a master now.
    pub fn is_master(&self) -> bool {
        self.conn().is_some_and(|mut c| {
            redis::cmd("ROLE")
                .query::<Vec<redis::Value>>(&mut c)
                .ok()
                .and_then(|v| v.into_iter().next())
                .is_some_and(|r| matches!(r, redis::Value::BulkString(b) if b == b"master"))
        })
    }

    /// Whether it is alive and the master serving `key`'s slot, by its own view.
    pub fn owns(&self, key: &str) -> bool {
        if self.child.is_none() {
            return false;
        }
        let Some(mut c) = self.conn() else {
            return false;
        };
        redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(key)
            .query::<i64>(&mut c)
            .is_ok_and(|slot| serves(&mut c, slot))
    }

    /// The sum of hash `key`'s values as this node holds them (0 if it holds no such key).
    pub fn hsum(&self, key: &str) -> u64 {
        let Some(mut c) = self.conn() else { return 0 };
        redis::cmd("HVALS")
            .arg(key)
            .query::<Vec<u64>>(&mut c)
            .map(|v| v.iter().sum())
            .unwrap_or(0)
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A running Redis Cluster.
pub struct RedisCluster {
    /// Masters first (as created), then replicas.
    pub nodes: Vec<Node>,
    _dir: PathBuf,
}

impl RedisCluster {
    /// Starts three masters (each with a replica if `replicas`) and waits until every node
    /// says the cluster is ok.
    pub fn start(name: &str, replicas: bool) -> RedisCluster {
        RedisCluster::start_with(name, replicas, &[])
    }

    /// [`RedisCluster::start`], each server also given `args`.
    pub fn start_with(name: &str, replicas: bool, args: &[&str]) -> RedisCluster {
        let dir = super::tempdir(name);
        let count = if replicas { 6 } else { 3 };
        let mut nodes = Vec::new();
        for _ in 0..count {
            let (port, bus) = (free_port(), free_port());
            let child = Command::new("redis-server")
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                .args([
                    "--cluster-enabled",
                    "yes",
                    "--cluster-port",
                    &bus.to_string(),
                ])
                .args(["--cluster-config-file", &format!("nodes-{port}.conf")])
                .args(["--cluster-node-timeout", "1000"])
                .args(["--save", "", "--appendonly", "no", "--protected-mode", "no"])
                // Replicas sync over the socket, so nothing is written where the test runs.
                .args([
                    "--repl-diskless-sync",
                    "yes",
                    "--repl-diskless-sync-delay",
                    "0",
                ])
                .args(["--dir", &dir.display().to_string()])
                .args(args)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("redis-server must be installed (the test script installs it)");
            nodes.push(Node {
                port,
                child: Some(child),
            });
        }
        for n in &nodes {
            wait("a cluster node up", || n.conn().is_some());
        }
        let mut create = Command::new("redis-cli");
        create.arg("--cluster").arg("create");
        for n in &nodes {
            create.arg(format!("127.0.0.1:{}", n.port));
        }
        let out = create
            .args(["--cluster-replicas", if replicas { "1" } else { "0" }])
            .arg("--cluster-yes")
            .stdin(Stdio::null())
            .output()
            .expect("redis-cli must be installed (it comes with redis-server)");
        assert!(
            out.status.success(),
            "redis-cli --cluster create: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let c = RedisCluster { nodes, _dir: dir };
        c.wait_ok();
        // A replica that never synced may not take over (its data is too old).
        for n in c.nodes.iter().filter(|n| !n.is_master()) {
            wait("a replica in sync", || {
                n.conn().is_some_and(|mut c| {
                    redis::cmd("INFO")
                        .arg("replication")
                        .query::<String>(&mut c)
                        .is_ok_and(|i| i.contains("master_link_status:up"))
                })
            });
        }
        c
    }

    /// Waits until every live node says `cluster_state:ok` (after a kill, call it once
    /// the cluster has noticed: it says ok until then).
    pub fn wait_ok(&self) {
        wait("the cluster ok on every node", || {
            self.nodes.iter().filter(|n| n.child.is_some()).all(|n| {
                n.conn().is_some_and(|mut c| {
                    redis::cmd("CLUSTER")
                        .arg("INFO")
                        .query::<String>(&mut c)
                        .is_ok_and(|i| i.contains("cluster_state:ok"))
                })
            })
        });
    }

    /// The config's `cluster_nodes`: the masters as created.
    pub fn seeds(&self) -> String {
        self.nodes[..3]
            .iter()
            .map(|n| format!("\"127.0.0.1:{}\"", n.port))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The live master that serves `key`'s slot, by index in `nodes`.
    pub fn owner(&self, key: &str) -> usize {
        let mut found = None;
        wait("the slot's owner known", || {
            found = self.nodes.iter().position(|n| n.owns(key));
            found.is_some()
        });
        found.expect("owner")
    }

    /// Moves `key`'s slot, with its keys, from master `from` to master `to`, the way
    /// `redis-cli --cluster reshard` does: clients that ask `from` are answered MOVED.
    pub fn migrate(&self, key: &str, from: usize, to: usize) {
        let (src, dst) = (&self.nodes[from], &self.nodes[to]);
        let (src_id, dst_id) = (src.id(), dst.id());
        let mut s = src.conn().expect("source");
        let mut d = dst.conn().expect("target");
        let slot: i64 = redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(key)
            .query(&mut s)
            .expect("KEYSLOT");
        let set = |c: &mut redis::Connection, how: &str, id: &str| {
            redis::cmd("CLUSTER")
                .arg("SETSLOT")
                .arg(slot)
                .arg(how)
                .arg(id)
                .query::<()>(c)
                .expect("SETSLOT");
        };
        set(&mut d, "IMPORTING", &src_id);
        set(&mut s, "MIGRATING", &dst_id);
        let keys: Vec<String> = redis::cmd("CLUSTER")
            .arg("GETKEYSINSLOT")
            .arg(slot)
            .arg(1000)
            .query(&mut s)
            .expect("GETKEYSINSLOT");
        if !keys.is_empty() {
            redis::cmd("MIGRATE")
                .arg("127.0.0.1")
                .arg(dst.port)
                .arg("")
                .arg(0)
                .arg(5000)
                .arg("KEYS")
                .arg(&keys)
                .query::<()>(&mut s)
                .expect("MIGRATE");
        }
        for n in self
            .nodes
            .iter()
            .filter(|n| n.child.is_some() && n.is_master())
        {
            let mut c = n.conn().expect("master");
            set(&mut c, "NODE", &dst_id);
        }
    }
}

/// Whether the node on `c` serves `slot` itself (its `CLUSTER SLOTS` view and its own id).
fn serves(c: &mut redis::Connection, slot: i64) -> bool {
    let me: String = match redis::cmd("CLUSTER").arg("MYID").query(c) {
        Ok(id) => id,
        Err(_) => return false,
    };
    let ranges: Vec<redis::Value> = redis::cmd("CLUSTER")
        .arg("SLOTS")
        .query(c)
        .unwrap_or_default();
    ranges.iter().any(|r| {
        let redis::Value::Array(p) = r else {
            return false;
        };
        let int = |i: usize| match p.get(i) {
            Some(redis::Value::Int(n)) => *n,
            _ => -1,
        };
        let id = match p.get(2) {
            Some(redis::Value::Array(m)) => match m.get(2) {
                Some(redis::Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
                _ => String::new(),
            },
            _ => String::new(),
        };
        (int(0)..=int(1)).contains(&slot) && id == me
    })
}

/// Waits (bounded by [`DEADLINE`]) until `ok` holds, polling.
pub fn wait(what: &str, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + DEADLINE;
    while !ok() {
        assert!(Instant::now() < deadline, "{what}: not within {DEADLINE:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}
