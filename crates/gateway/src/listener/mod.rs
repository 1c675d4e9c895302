//! Listeners: accept under the connection cap, serve HTTP/1.1 ([`h1`]) with keep-alive and
//! limits on the request head (HTTP/2 and TLS where configured, see [`conn`]), and drain
//! in-flight requests on shutdown.

pub mod body;
pub mod body_error;
pub mod conn;
pub mod h1;
pub mod h1_only;
pub mod h2;
pub mod handler;
pub mod send_timeout;
pub mod stop;
pub mod tls;

pub use body::RequestBody;
pub use handler::Handler;

use crate::exchange::{ConnInfo, Place};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio_util::task::TaskTracker;
use tollgate_config::ListenerConfig;

/// Why the gateway could not start listening.
#[derive(Debug, thiserror::Error)]
#[error("cannot listen on {address}: {source} (is another process using it? change listeners[].address)")]
pub struct BindError {
    /// The address asked for.
    pub address: SocketAddr,
    /// The OS error.
    pub source: std::io::Error,
}

/// Binds every listener, failing on the first address that cannot be bound.
pub async fn bind(
    listeners: &[ListenerConfig],
) -> Result<Vec<(TcpListener, ListenerConfig)>, BindError> {
    let mut out = Vec::with_capacity(listeners.len());
    for l in listeners {
        let sock = TcpListener::bind(l.address)
            .await
            .map_err(|source| BindError {
                address: l.address,
                source,
            })?;
        out.push((sock, l.clone()));
    }
    Ok(out)
}

/// A running set of listeners.
pub struct Server {
    addrs: Vec<SocketAddr>,
    stop: watch::Sender<bool>,
    stopping: Arc<std::sync::atomic::AtomicBool>,
    notify: Arc<tokio::sync::Notify>,
    /// Each listener's accept loop; it ends with the connections it started.
    accept_loops: JoinSet<JoinSet<()>>,
    connections: TaskTracker,
}

impl Server {
    /// Starts accepting on every bound listener.
    pub fn start<H: Handler>(gw: Arc<H>, bound: Vec<(TcpListener, ListenerConfig)>) -> Server {
        let (stop, _) = watch::channel(false);
        let stopping = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let notify = Arc::new(tokio::sync::Notify::new());
        let connections = TaskTracker::new();
        let mut accept_loops = JoinSet::new();
        let mut addrs = Vec::new();
        for (sock, cfg) in bound {
            addrs.push(sock.local_addr().unwrap_or(cfg.address));
            accept_loops.spawn(accept_loop(
                gw.clone(),
                sock,
                Arc::new(cfg),
                stop.subscribe(),
                conn::Stop {
                    flag: stopping.clone(),
                    notify: notify.clone(),
                },
                connections.clone(),
            ));
        }
        Server {
            addrs,
            stop,
            stopping,
            notify,
            accept_loops,
            connections,
        }
    }

    /// The addresses actually bound (useful with port 0).
    pub fn local_addrs(&self) -> &[SocketAddr] {
        &self.addrs
    }

    /// Stops accepting, lets in-flight requests finish for at most `drain`, and closes idle
    /// keep-alive connections. Returns whether every connection finished in time; those
    /// that did not are cut, their requests dropped (and so counted and logged) before this
    /// returns.
    pub async fn shutdown(mut self, drain: Duration) -> bool {
        self.stopping
            .store(true, std::sync::atomic::Ordering::Release);
        self.notify.notify_waiters();
        let _ = self.stop.send(true);
        let mut connections = Vec::new();
        while let Some(ended) = self.accept_loops.join_next().await {
            connections.extend(ended.ok());
        }
        self.connections.close();
        let drained = tokio::time::timeout(drain, self.connections.wait())
            .await
            .is_ok();
        if !drained {
            for set in &mut connections {
                set.abort_all();
            }
            // Aborted tasks are dropped at their next turn on the runtime: at once.
            let cut = async {
                for mut set in connections {
                    while set.join_next().await.is_some() {}
                }
            };
            let _ = tokio::time::timeout(CUT_WAIT, cut).await;
        }
        drained
    }
}

/// The most a shutdown waits for the connections it cut to be dropped.
const CUT_WAIT: Duration = Duration::from_secs(1);

/// Accept errors of one listener: out of file descriptors and the like. Accepting backs
/// off (10 ms doubling to 1 s) while they last, and they are logged at most once a second,
/// with the number left unlogged.
#[derive(Debug, Default)]
pub struct AcceptErrors {
    backoff: Option<Duration>,
    last_log: Option<Instant>,
    unlogged: u64,
}

impl AcceptErrors {
    async fn failed(&mut self, sock: &TcpListener, e: &std::io::Error) {
        let now = Instant::now();
        if self
            .last_log
            .is_none_or(|t| now.duration_since(t) >= Duration::from_secs(1))
        {
            let address = sock.local_addr().map(|a| a.to_string()).unwrap_or_default();
            let more = std::mem::take(&mut self.unlogged);
            tracing::warn!(%address, also_failed = more, "accept failed: {e}; backing off");
            self.last_log = Some(now);
        } else {
            self.unlogged += 1;
        }
        let wait = self.backoff.map_or(Duration::from_millis(10), |b| {
            (b * 2).min(Duration::from_secs(1))
        });
        self.backoff = Some(wait);
        tokio::time::sleep(wait).await;
    }
}

/// The next connection, with `TCP_NODELAY`. Accept errors back off instead of spinning.
pub async fn accept(
    sock: &TcpListener,
    errors: &mut AcceptErrors,
) -> (tokio::net::TcpStream, SocketAddr) {
    loop {
        match sock.accept().await {
            Ok((stream, peer)) => {
                let _ = stream.set_nodelay(true);
                errors.backoff = None;
                return (stream, peer);
            }
            Err(e) => errors.failed(sock, &e).await,
        }
    }
}

/// The next connection once fewer than the cap are open: beyond it, new connections wait
/// in the kernel's listen backlog. The permit is held for the connection's life.
pub async fn accept_capped(
    sock: &TcpListener,
    cap: &Arc<Semaphore>,
    errors: &mut AcceptErrors,
) -> (tokio::net::TcpStream, SocketAddr, OwnedSemaphorePermit) {
    let permit = match cap.clone().acquire_owned().await {
        Ok(p) => p,
        // The semaphore is never closed; should it be, wait for nothing rather than spin.
        Err(_) => std::future::pending().await,
    };
    let (stream, peer) = accept(sock, errors).await;
    (stream, peer, permit)
}

async fn accept_loop<H: Handler>(
    gw: Arc<H>,
    sock: TcpListener,
    cfg: Arc<ListenerConfig>,
    mut stop_accepting: watch::Receiver<bool>,
    stop: conn::Stop,
    connections: TaskTracker,
) -> JoinSet<()> {
    let builders = Arc::new(conn::Builders::new(&cfg));
    let cap = Arc::new(Semaphore::new(cfg.max_connections));
    let mut errors = AcceptErrors::default();
    // The connections this loop started, handed to the shutdown to be cut if its drain
    // runs out (dropping the set would cut them at once); those that ended are let go as
    // they end, so that a quiet listener holds no finished task.
    let mut conns = JoinSet::new();
    loop {
        let (stream, peer, permit) = tokio::select! {
            _ = stop_accepting.changed() => return conns,
            Some(_) = conns.join_next(), if !conns.is_empty() => continue,
            conn = accept_capped(&sock, &cap, &mut errors) => conn,
        };
        gw.opened();
        let (gw, cfg, b, stop) = (gw.clone(), cfg.clone(), builders.clone(), stop.clone());
        if cfg.tls.is_none() && !b.h2c() {
            // The common case: the task is the connection itself, nothing wrapped around it.
            let mut info = ConnInfo::new(peer, cfg);
            info.place = Some(Place {
                permit,
                drain: connections.token(),
            });
            let closer = gw.clone();
            let done = move || closer.closed();
            conns.spawn(connections.track_future(conn::serve_h1(
                gw,
                stream,
                Arc::new(info),
                stop,
                done,
            )));
            continue;
        }
        let events = gw.clone();
        let place = Place {
            permit,
            drain: connections.token(),
        };
        conns.spawn(connections.track_future(async move {
            // Boxed: a task's future is as large as its largest branch.
            if cfg.tls.is_some() {
                let served = conn::serve_tls(gw, stream, peer, place, cfg, &b, stop);
                if let Err(e) = Box::pin(served).await {
                    events.tls_failed();
                    tracing::debug!(%peer, "{e}");
                }
            } else {
                let mut info = ConnInfo::new(peer, cfg);
                info.place = Some(place);
                Box::pin(conn::serve_h2c(gw, stream, Arc::new(info), &b, stop)).await;
            }
            events.closed();
        }));
    }
}
