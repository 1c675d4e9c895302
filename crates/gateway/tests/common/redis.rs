//! A real `redis-server` on a free loopback port, owned by the test.

use std::hash::BuildHasher;
use std::hash::RandomState;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A running redis-server; killed (by its pid) when dropped.
pub struct RedisServer {
    pub addr: SocketAddr,
    child: Option<Child>,
}

/// A free loopback port below the kernel's ephemeral range (32768 and up on Linux).
///
/// A port from `bind(…:0)` is in that range: between the probe and redis-server's own
/// bind, another test's connection can take it as its local port, or the readiness
/// check's `connect` can pick it and connect to itself (TCP simultaneous open), and
/// redis-server then fails to bind. Below the range only listeners bound on purpose
/// compete, and ports are handed out once per test process.
fn free_port() -> u16 {
    static TAKEN: Mutex<Vec<u16>> = Mutex::new(Vec::new());
    let mut taken = TAKEN.lock().unwrap_or_else(|e| e.into_inner());
    for _ in 0..1000 {
        let port = 20_000 + (RandomState::new().hash_one(taken.len()) % 12_000) as u16;
        if !taken.contains(&port) && std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            taken.push(port);
            return port;
        }
    }
    panic!("no free port in 20000..32000");
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

    /// `GET key` as a number (0 when missing).
    pub fn get(&self, key: &str) -> u64 {
        let client = redis::Client::open(self.url()).expect("url");
        let mut c = client.get_connection().expect("connect");
        redis::cmd("GET")
            .arg(key)
            .query::<Option<u64>>(&mut c)
            .expect("GET")
            .unwrap_or(0)
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
