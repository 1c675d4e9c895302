//! Loopback ports for servers a test starts as processes (redis-server, the echo backend).
//! Also used by the cli crate's tests (`#[path]`), so that both pick ports the same way.

use std::hash::{BuildHasher, RandomState};
use std::sync::Mutex;

/// A free loopback port below the kernel's ephemeral range (32768 and up on Linux).
///
/// A port from `bind(…:0)` is in that range: before the process the test starts binds it,
/// another test's connection can take it as its local port, or a readiness check's
/// `connect` can pick it and connect to itself (TCP simultaneous open). Below the range
/// only listeners bound on purpose compete, and ports are handed out once per process.
pub fn free_port() -> u16 {
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
