//! A real `redis-server` on a free loopback port, owned by the test.

use super::ports::free_port;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running redis-server; killed (by its pid) when dropped.
pub struct RedisServer {
    pub addr: SocketAddr,
    child: Option<Child>,
}

impl RedisServer {
    /// Starts redis-server on a free port and waits until it answers `PING`.
    pub fn start() -> RedisServer {
        for _ in 0..5 {
            let addr: SocketAddr = ([127, 0, 0, 1], free_port()).into();
            let mut r = RedisServer { addr, child: None };
            if r.try_start() {
                return r;
            }
        }
        panic!("redis-server did not start on any of 5 ports");
    }

    /// The URL for configs.
    pub fn url(&self) -> String {
        format!("redis://{}/0", self.addr)
    }

    /// Stops the server (SIGKILL, like a crash).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again on the same port.
    pub fn restart(&mut self) {
        assert!(
            self.try_start(),
            "redis-server did not start again on {}",
            self.addr
        );
    }

    /// Starts redis-server on `addr`; true once it answers `PING`, false if it exited
    /// (its port was taken).
    fn try_start(&mut self) -> bool {
        self.stop();
        let child = Command::new("redis-server")
            .args([
                "--port",
                &self.addr.port().to_string(),
                "--bind",
                "127.0.0.1",
            ])
            .args(["--save", "", "--appendonly", "no", "--protected-mode", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server must be installed (the test script installs it)");
        let child = self.child.insert(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        // An answer to PING, not just an accepted connection: only redis-server gives it.
        while !pong(self.addr) {
            if child.try_wait().ok().flatten().is_some() {
                self.child = None;
                return false;
            }
            assert!(Instant::now() < deadline, "redis-server did not start");
            std::thread::yield_now();
        }
        true
    }

    /// A new connection to the server.
    pub fn connection(&self) -> redis::Connection {
        redis::Client::open(self.url())
            .expect("url")
            .get_connection()
            .expect("connect")
    }

    /// The sum of a hash's values (a shared limit's counts over its sub-windows; 0 when
    /// missing).
    pub fn hsum(&self, key: &str) -> u64 {
        let mut c = self.connection();
        redis::cmd("HVALS")
            .arg(key)
            .query::<Vec<u64>>(&mut c)
            .expect("HVALS")
            .iter()
            .sum()
    }

    /// A hash's values, as text.
    pub fn hvals(&self, key: &str) -> Vec<String> {
        let mut c = self.connection();
        redis::cmd("HVALS")
            .arg(key)
            .query::<Vec<String>>(&mut c)
            .expect("HVALS")
    }

    /// Adds `by` to `field` of hash `key` (a shared limit's count of one sub-window).
    pub fn hincr(&self, key: &str, field: u64, by: i64) {
        let mut c = self.connection();
        redis::cmd("HINCRBY")
            .arg(key)
            .arg(field)
            .arg(by)
            .query::<i64>(&mut c)
            .expect("HINCRBY");
    }
}

/// Whether a Redis server at `addr` answers `PING` with `+PONG`.
fn pong(addr: SocketAddr) -> bool {
    let Ok(mut s) = TcpStream::connect(addr) else {
        return false;
    };
    let mut buf = [0u8; 7];
    s.set_read_timeout(Some(Duration::from_secs(5))).is_ok()
        && s.write_all(b"PING\r\n").is_ok()
        && s.read_exact(&mut buf).is_ok()
        && &buf == b"+PONG\r\n"
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Connections the server behind `c` has taken since it started (`INFO stats`): how often
/// a gateway connected, for the tests of its backoff.
pub fn connections_taken(c: &mut redis::Connection) -> u64 {
    redis::cmd("INFO")
        .arg("stats")
        .query::<String>(c)
        .ok()
        .and_then(|i| {
            i.lines()
                .find_map(|l| l.strip_prefix("total_connections_received:"))
                .and_then(|n| n.trim().parse().ok())
        })
        .unwrap_or(0)
}
