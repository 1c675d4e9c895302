//! A real `redis-server` on a free loopback port, owned by the test.

use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running redis-server; killed (by its pid) when dropped.
pub struct RedisServer {
    pub addr: SocketAddr,
    child: Option<Child>,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

impl RedisServer {
    /// Starts redis-server on a free port and waits until it accepts connections.
    pub fn start() -> RedisServer {
        let addr: SocketAddr = ([127, 0, 0, 1], free_port()).into();
        let mut r = RedisServer { addr, child: None };
        r.restart();
        r
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
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect(self.addr).is_err() {
            assert!(Instant::now() < deadline, "redis-server did not start");
            std::thread::yield_now();
        }
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

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
    }
}
