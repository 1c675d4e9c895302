//! The clients' hosts an HTTP/2 upstream keeps connections apart for (`preserve_host`
//! asks for the client's `Host` as `:authority`, and hyper's pool keys connections by
//! authority). At most [`MAX_HOSTS`] at once, so clients cannot open connections to a
//! target by naming hosts; a host is forgotten when it has no request in flight and no
//! connection open, so a burst of made-up hosts holds the room only as long as their
//! connections live (the upstream's `idle_timeout` once idle). The hosts the routes to the
//! upstream name exactly are let in apart from that room, so such a burst cannot push a
//! route's own host to the target's authority.

use hyper::rt::{Read, ReadBufCursor, Write};
use hyper_util::client::legacy::connect::{Connected, Connection};
use parking_lot::Mutex;
use std::collections::{HashMap, HashSet};
use std::io::IoSlice;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

/// Most client hosts kept apart at once; past them, a request asks for the target's
/// authority, with the client's `Host` as a header.
pub const MAX_HOSTS: usize = 64;

/// Most hosts let in apart from the room (the routes' own, in their spellings): a bound
/// on connections however many routes name hosts.
pub const MAX_RESERVED: usize = 256;

/// What holds a host in the set.
#[derive(Debug, Default)]
struct Use {
    requests: usize,
    connections: usize,
    /// Let in as a route's own host, outside the room of [`MAX_HOSTS`].
    reserved: bool,
}

/// The set of hosts kept apart, with what holds each.
#[derive(Debug, Default)]
pub struct Hosts {
    held: Mutex<HostSet>,
}

/// The hosts held, how many of them take room, and the hosts let in without room.
#[derive(Debug, Default)]
struct HostSet {
    by_host: HashMap<Box<str>, Use>,
    in_room: usize,
    reserved: HashSet<Box<str>>,
}

impl Hosts {
    /// Lets `hosts` (lowercase, as the client writes them in `Host`) in apart from the
    /// room: the routes' own hosts. Replaces the earlier list; hosts held stay held.
    pub fn reserve(&self, hosts: impl IntoIterator<Item = String>) {
        let mut held = self.held.lock();
        let held = &mut *held;
        held.reserved = hosts
            .into_iter()
            .take(MAX_RESERVED)
            .map(Box::from)
            .collect();
        // Hosts held already take room, or not, as the new list says.
        held.in_room = 0;
        for (host, u) in &mut held.by_host {
            u.reserved = held.reserved.contains(host);
            held.in_room += usize::from(!u.reserved);
        }
    }

    /// A hold on `host` for one request, if it is known, reserved, or there is room for it.
    pub fn request(self: &Arc<Self>, host: &str) -> Option<Hold> {
        // hyper's pool tells authorities apart without case: so does the set.
        let host = host.to_ascii_lowercase();
        let host = host.as_str();
        let mut held = self.held.lock();
        let held = &mut *held;
        if let Some(u) = held.by_host.get_mut(host) {
            u.requests += 1;
        } else {
            let reserved = held.reserved.contains(host);
            if !reserved && held.in_room >= MAX_HOSTS {
                return None;
            }
            held.in_room += usize::from(!reserved);
            let first = Use {
                requests: 1,
                connections: 0,
                reserved,
            };
            held.by_host.insert(host.into(), first);
        }
        Some(Hold {
            hosts: self.clone(),
            host: host.into(),
            connection: false,
        })
    }

    /// A hold on `host` for one connection being opened for it, if it is in the set (a
    /// connection for the target's own authority is not).
    pub fn connection(self: &Arc<Self>, host: &str) -> Option<Hold> {
        let host = host.to_ascii_lowercase();
        let host = host.as_str();
        let mut held = self.held.lock();
        let u = held.by_host.get_mut(host)?;
        u.connections += 1;
        Some(Hold {
            hosts: self.clone(),
            host: host.into(),
            connection: true,
        })
    }
}

/// A request's or a connection's hold on its host: the host stays in the set while any
/// is alive.
#[derive(Debug)]
pub struct Hold {
    hosts: Arc<Hosts>,
    host: Box<str>,
    connection: bool,
}

impl Drop for Hold {
    fn drop(&mut self) {
        let mut held = self.hosts.held.lock();
        let held = &mut *held;
        let Some(u) = held.by_host.get_mut(&*self.host) else {
            return;
        };
        if self.connection {
            u.connections = u.connections.saturating_sub(1);
        } else {
            u.requests = u.requests.saturating_sub(1);
        }
        if u.requests == 0 && u.connections == 0 {
            held.in_room -= usize::from(!u.reserved);
            held.by_host.remove(&*self.host);
        }
    }
}

/// A connection with the hold on the host it was opened for, given back when the
/// connection closes.
#[derive(Debug)]
pub struct Held<T> {
    pub(super) io: T,
    pub(super) _hold: Option<Hold>,
}

impl<T: Connection> Connection for Held<T> {
    fn connected(&self) -> Connected {
        self.io.connected()
    }
}

impl<T: Read + Unpin> Read for Held<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: Write + Unpin> Write for Held<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_is_forgotten_when_no_request_and_no_connection_holds_it() {
        let hosts = Arc::new(Hosts::default());
        let holds: Vec<Hold> = (0..MAX_HOSTS)
            .map(|n| hosts.request(&format!("h{n}")).expect("room"))
            .collect();
        assert!(hosts.request("late").is_none(), "past the bound");
        // A known host is always let in, in any case.
        let again = hosts.request("H0").expect("known");
        let conn = hosts.connection("h1").expect("in the set");
        assert!(hosts.connection("late").is_none());
        drop(holds);
        // h0 (a request) and h1 (a connection) are still held.
        assert_eq!(hosts.held.lock().by_host.len(), 2);
        assert!(hosts.request("late").is_some());
        drop(again);
        drop(conn);
        assert!(hosts.held.lock().by_host.is_empty());
        assert_eq!(hosts.held.lock().in_room, 0);
    }

    #[test]
    fn a_routes_own_host_is_let_in_when_made_up_hosts_fill_the_room() {
        let hosts = Arc::new(Hosts::default());
        hosts.reserve([
            "api.example.com".to_string(),
            "api.example.com:8443".to_string(),
        ]);
        let junk: Vec<Hold> = (0..MAX_HOSTS)
            .map(|n| hosts.request(&format!("junk{n}.example")).expect("room"))
            .collect();
        assert!(
            hosts.request("junk-late.example").is_none(),
            "the room is full"
        );
        let own = hosts
            .request("API.example.com")
            .expect("reserved, in any case");
        let own_port = hosts.request("api.example.com:8443").expect("reserved");
        // Another port of the route's host is not reserved: ports would be endless room.
        assert!(hosts.request("api.example.com:1").is_none());
        drop(own);
        drop(own_port);
        // Reserved hosts never took room: the room is still exactly full.
        assert_eq!(hosts.held.lock().in_room, MAX_HOSTS);
        // A reload that stops reserving a held host counts it in the room from then on.
        let own = hosts.request("api.example.com").expect("reserved");
        hosts.reserve(Vec::new());
        assert_eq!(hosts.held.lock().in_room, MAX_HOSTS + 1);
        drop(own);
        assert_eq!(hosts.held.lock().in_room, MAX_HOSTS);
        drop(junk);
        assert_eq!(hosts.held.lock().in_room, 0);
        assert!(hosts.held.lock().by_host.is_empty());
    }
}
