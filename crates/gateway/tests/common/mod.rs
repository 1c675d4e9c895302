//! Test harness: gateways and backends on loopback, with real sockets.
#![allow(dead_code)]

use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tollgate_gateway::{Clock, Gateway, ManualClock, Server};

pub mod ports;
pub mod redis;
pub mod redis_cluster;
pub mod tls;

/// Upper bound for anything a test waits on; a test that hits it fails instead of hanging.
pub const DEADLINE: Duration = Duration::from_secs(20);

/// Fails the test if `f` takes longer than [`DEADLINE`].
pub async fn bounded<T>(what: &str, f: impl Future<Output = T>) -> T {
    tokio::time::timeout(DEADLINE, f)
        .await
        .unwrap_or_else(|_| panic!("{what}: no result within {DEADLINE:?}"))
}

/// Waits until `node` has finished two more rounds with the shared store, so everything
/// it counted before the call has been settled with Redis (or the attempt failed).
pub async fn synced(node: &TestGateway) {
    let c = node.gw.cluster().expect("cluster");
    let mut rounds = c.rounds();
    let start = *rounds.borrow();
    bounded("sync rounds", rounds.wait_for(|r| *r >= start + 2))
        .await
        .expect("rounds");
}

/// The gateway's metrics once they hold `line`, or at the deadline as they are: figures
/// counted by a connection's task as it ends can trail the client's view of the close.
pub async fn metrics_with(gw: &Gateway, line: &str) -> String {
    let until = tokio::time::Instant::now() + DEADLINE;
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    loop {
        tick.tick().await;
        let m = gw.metrics_text();
        if m.lines().any(|l| l == line) || tokio::time::Instant::now() >= until {
            return m;
        }
    }
}

/// Parses a config, failing the test with every problem.
pub fn config(yaml: &str) -> tollgate_config::Config {
    tollgate_config::from_yaml(yaml).unwrap_or_else(|e| panic!("test config invalid: {e}\n{yaml}"))
}

/// A gateway on an ephemeral loopback port.
pub struct TestGateway {
    pub addr: SocketAddr,
    pub gw: Arc<Gateway>,
    pub server: Option<Server>,
}

impl TestGateway {
    /// Starts a gateway for `yaml` (its listeners are replaced by one on 127.0.0.1:0).
    pub async fn start(yaml: &str, clock: Arc<dyn Clock>) -> TestGateway {
        let mut cfg = config(yaml);
        for l in &mut cfg.listeners {
            l.address = "127.0.0.1:0".parse().expect("addr");
        }
        cfg.listeners.truncate(1);
        let bound = tollgate_gateway::bind(&cfg.listeners).await.expect("bind");
        let gw = Gateway::new(cfg, clock);
        gw.keys_settled(std::time::Duration::from_secs(5)).await;
        let server = Server::start(gw.clone(), bound);
        TestGateway {
            addr: server.local_addrs()[0],
            gw,
            server: Some(server),
        }
    }

    /// Starts with a manual clock, returned for the test to move.
    pub async fn with_manual_clock(yaml: &str) -> (TestGateway, Arc<ManualClock>) {
        let clock = ManualClock::new();
        (TestGateway::start(yaml, clock.clone()).await, clock)
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// Applies a new config (listeners are kept).
    pub fn apply(&self, yaml: &str) {
        self.gw.apply(config(yaml));
    }
}

/// A config with one listener, one upstream `backend` at `backend`, and the given rest.
pub fn yaml(backend: SocketAddr, rest: &str) -> String {
    format!(
        "listeners: [{{address: \"127.0.0.1:0\"}}]\nupstreams:\n  backend:\n    targets: [\"{backend}\"]\n    response_timeout: 2s\n{rest}"
    )
}

/// A response, fully read.
#[derive(Debug)]
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: String,
}

impl Answer {
    /// The body of an answer the gateway gave itself, without its `request_id` member,
    /// after checking that it names the request's `X-Request-Id`.
    pub fn refusal(&self) -> String {
        let tail = format!(r#","request_id":"{}"}}"#, self.header("x-request-id"));
        assert!(
            self.header("x-request-id").len() >= 8 && self.body.ends_with(&tail),
            "the body does not name the request id: {}",
            self.body
        );
        format!("{}}}", &self.body[..self.body.len() - tail.len()])
    }

    pub fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
    }
}

/// A keep-alive HTTP/1.1 client.
#[derive(Clone)]
pub struct TestClient {
    client: Client<HttpConnector, Full<Bytes>>,
}

impl Default for TestClient {
    fn default() -> Self {
        TestClient {
            client: Client::builder(TokioExecutor::new()).build_http(),
        }
    }
}

impl TestClient {
    pub async fn send(&self, req: Request<Full<Bytes>>) -> Answer {
        let resp = bounded("request", self.client.request(req))
            .await
            .expect("request failed at the transport level");
        let (parts, body) = resp.into_parts();
        let body = bounded("body", body.collect())
            .await
            .expect("body")
            .to_bytes();
        Answer {
            status: parts.status,
            headers: parts.headers,
            body: String::from_utf8_lossy(&body).into_owned(),
        }
    }

    pub async fn get(&self, url: &str) -> Answer {
        self.request(Method::GET, url, &[], "").await
    }

    pub async fn request(
        &self,
        method: Method,
        url: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> Answer {
        let mut b = Request::builder().method(method).uri(url);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        self.send(
            b.body(Full::new(Bytes::from(body.to_string())))
                .expect("request"),
        )
        .await
    }
}

/// Sends raw bytes on a new connection and reads until the server closes it.
pub async fn raw(addr: SocketAddr, bytes: &[u8]) -> String {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    s.write_all(bytes).await.expect("write");
    let mut out = Vec::new();
    bounded("raw read", s.read_to_end(&mut out)).await.ok();
    String::from_utf8_lossy(&out).into_owned()
}

/// The built-in echo backend on an ephemeral port.
pub async fn echo_backend() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    tokio::spawn(tollgate_gateway::echo::serve(l));
    addr
}

/// A backend that answers with what it received: `METHOD URI`, then `name: value` lines,
/// then a blank line and the body. Counts requests.
pub async fn inspect_backend() -> (SocketAddr, Arc<AtomicUsize>) {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    let hits = Arc::new(AtomicUsize::new(0));
    let h = hits.clone();
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else { return };
            let h = h.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |req: Request<Incoming>| {
                    let h = h.clone();
                    async move {
                        h.fetch_add(1, Ordering::SeqCst);
                        let mut text = format!("{} {}\n", req.method(), req.uri());
                        for (k, v) in req.headers() {
                            text.push_str(&format!("{}: {}\n", k, v.to_str().unwrap_or("?")));
                        }
                        let body = req
                            .into_body()
                            .collect()
                            .await
                            .map(|b| b.to_bytes())
                            .unwrap_or_default();
                        text.push('\n');
                        text.push_str(&String::from_utf8_lossy(&body));
                        let mut r = hyper::Response::new(Full::new(Bytes::from(text)));
                        r.headers_mut()
                            .insert("keep-alive", "timeout=5".parse().expect("v"));
                        r.headers_mut()
                            .insert("x-backend", "inspect".parse().expect("v"));
                        Ok::<_, Infallible>(r)
                    }
                });
                let _ = http1::Builder::new()
                    .serve_connection(TokioIo::new(s), svc)
                    .await;
            });
        }
    });
    (addr, hits)
}

/// Reads one request head from a raw socket; None on EOF before a full head.
pub async fn read_head(s: &mut TcpStream) -> Option<String> {
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        match s.read(&mut byte).await {
            Ok(1) => buf.push(byte[0]),
            _ => return None,
        }
    }
    Some(String::from_utf8_lossy(&buf).into_owned())
}

/// Reads one request head and (drops) its `Content-Length` body from a raw socket; the
/// head, or None on EOF before a full request.
pub async fn read_request_head(s: &mut TcpStream) -> Option<String> {
    let head = read_head(s).await?;
    let len = head
        .to_ascii_lowercase()
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse::<usize>().ok())
        .unwrap_or(0);
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).await.ok()?;
    Some(head)
}

/// Reads one request head and its `Content-Length` body from a raw socket.
/// Returns false on EOF before a full request.
pub async fn read_request(s: &mut TcpStream) -> bool {
    read_request_head(s).await.is_some()
}

/// A free loopback port with nothing listening on it.
pub async fn closed_port() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    l.local_addr().expect("addr")
}

/// The status code of a raw HTTP/1.1 answer (0 when there is none).
pub fn status_of(answer: &str) -> u16 {
    answer
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

/// A backend that reports each request and answers only when released.
pub async fn gated_backend() -> (
    SocketAddr,
    tokio::sync::mpsc::UnboundedReceiver<()>,
    Arc<tokio::sync::Notify>,
) {
    gated_backend_with(|_, _| (hyper::Response::new("late".to_string()), true)).await
}

/// A backend that answers `answer(request, n)` (n counts requests from 1), after a release
/// when it says so. Each gated request is reported when it arrives.
pub async fn gated_backend_with<F>(
    answer: F,
) -> (
    SocketAddr,
    tokio::sync::mpsc::UnboundedReceiver<()>,
    Arc<tokio::sync::Notify>,
)
where
    F: Fn(&Request<Incoming>, usize) -> (hyper::Response<String>, bool) + Send + Sync + 'static,
{
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let release = Arc::new(tokio::sync::Notify::new());
    let r2 = release.clone();
    let answer = Arc::new(answer);
    let count = Arc::new(AtomicUsize::new(0));
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else { return };
            let (tx, release) = (tx.clone(), r2.clone());
            let (answer, count) = (answer.clone(), count.clone());
            tokio::spawn(async move {
                let svc = service_fn(move |req: Request<Incoming>| {
                    let (tx, release) = (tx.clone(), release.clone());
                    let n = count.fetch_add(1, Ordering::SeqCst) + 1;
                    let (resp, gated) = answer(&req, n);
                    async move {
                        if gated {
                            let _ = tx.send(());
                            release.notified().await;
                        }
                        Ok::<_, Infallible>(resp.map(|b| Full::new(Bytes::from(b))))
                    }
                });
                let _ = http1::Builder::new()
                    .serve_connection(TokioIo::new(s), svc)
                    .await;
            });
        }
    });
    (addr, rx, release)
}

/// A raw backend: `answer(request_head, index_on_its_connection)` gives the bytes to write
/// and whether to close the connection after them. Counts connections and requests.
pub async fn scripted_backend<F>(answer: F) -> (SocketAddr, Arc<AtomicUsize>, Arc<AtomicUsize>)
where
    F: Fn(&str, usize) -> (Vec<u8>, bool) + Send + Sync + 'static,
{
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    let conns = Arc::new(AtomicUsize::new(0));
    let requests = Arc::new(AtomicUsize::new(0));
    let (c2, r2, answer) = (conns.clone(), requests.clone(), Arc::new(answer));
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = l.accept().await else {
                return;
            };
            c2.fetch_add(1, Ordering::SeqCst);
            let (answer, r2) = (answer.clone(), r2.clone());
            tokio::spawn(async move {
                let mut index = 0;
                // Bodies are read (and dropped), so the next head starts clean.
                while let Some(h) = read_request_head(&mut s).await {
                    r2.fetch_add(1, Ordering::SeqCst);
                    let (bytes, close) = answer(&h, index);
                    index += 1;
                    if s.write_all(&bytes).await.is_err() || close {
                        return;
                    }
                }
            });
        }
    });
    (addr, conns, requests)
}

/// A raw backend: for each request on each connection, `answer(request_head)` gives the
/// bytes to write back (None closes the connection). Counts connections.
pub async fn raw_backend<F>(answer: F) -> (SocketAddr, Arc<AtomicUsize>)
where
    F: Fn(&str) -> Option<Vec<u8>> + Send + Sync + 'static,
{
    let (addr, conns, _) = scripted_backend(move |h, _| match answer(h) {
        Some(bytes) => (bytes, false),
        None => (Vec::new(), true),
    })
    .await;
    (addr, conns)
}

/// Request heads exactly as a backend received them (bytes on the wire).
pub type Heads = Arc<parking_lot::Mutex<Vec<String>>>;

/// A backend that records each request head and answers 200 `ok` with keep-alive; with
/// `once`, only the first request on each connection is answered and the next closes it.
/// Bodies are not expected.
pub async fn recording_backend_with(once: bool) -> (SocketAddr, Heads) {
    let seen: Heads = Arc::default();
    let s2 = seen.clone();
    let (addr, _, _) = scripted_backend(move |h, index| {
        if once && index > 0 {
            return (Vec::new(), true);
        }
        s2.lock().push(h.to_string());
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok".to_vec(),
            false,
        )
    })
    .await;
    (addr, seen)
}

/// [`recording_backend_with`], answering every request.
pub async fn recording_backend() -> (SocketAddr, Heads) {
    recording_backend_with(false).await
}

/// Sends one raw request (the answer ends when the gateway closes the connection) and
/// returns the raw answer and the head the recording backend received for it, if any.
pub async fn exchange(addr: SocketAddr, seen: &Heads, head: &str) -> (String, Option<String>) {
    let before = seen.lock().len();
    let answer = raw(addr, head.as_bytes()).await;
    let got = seen.lock().get(before).cloned();
    (answer, got)
}

/// Serves the admin endpoints of `gw` on an ephemeral loopback port, with `token` if given.
pub async fn start_admin(gw: &Arc<Gateway>, token: Option<&str>) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    let cfg = tollgate_config::AdminConfig {
        address: addr,
        token: token.map(str::to_string),
        max_connections: 16,
        header_timeout: Duration::from_secs(10),
    };
    tokio::spawn(tollgate_gateway::admin::serve(gw.clone(), l, cfg));
    addr
}

/// A fresh directory under the system's temp dir for one test.
pub fn tempdir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("tollgate-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

/// A backend that answers each request with a 64 MiB body, and says when a write of it
/// failed (its connection was closed before the body was taken).
pub async fn huge_answer_backend() -> (std::net::SocketAddr, tokio::sync::mpsc::Receiver<()>) {
    use tokio::io::AsyncWriteExt;
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = l.local_addr().expect("addr");
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let tx = tx.clone();
            tokio::spawn(async move {
                if read_head(&mut s).await.is_none() {
                    return;
                }
                let head = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", 64 << 20);
                let chunk = vec![b'x'; 1 << 20];
                let mut ok = s.write_all(head.as_bytes()).await.is_ok();
                for _ in 0..64 {
                    ok = ok && s.write_all(&chunk).await.is_ok();
                }
                if !ok {
                    let _ = tx.send(()).await;
                }
            });
        }
    });
    (addr, rx)
}

/// HTTP/2 frames read off a raw socket, whole, one at a time; what a read brings past a
/// frame waits for the next call.
#[derive(Default)]
pub struct Frames {
    buf: Vec<u8>,
}

impl Frames {
    /// The next whole frame: its type, flags, stream and payload; `None` once the peer
    /// closes (or the read fails).
    pub async fn next(
        &mut self,
        s: &mut (impl tokio::io::AsyncRead + Unpin),
    ) -> Option<(u8, u8, u32, Vec<u8>)> {
        loop {
            if self.buf.len() >= 9 {
                let len = (usize::from(self.buf[0]) << 16)
                    | (usize::from(self.buf[1]) << 8)
                    | usize::from(self.buf[2]);
                if self.buf.len() >= 9 + len {
                    let f: Vec<u8> = self.buf.drain(..9 + len).collect();
                    let id = u32::from_be_bytes([f[5], f[6], f[7], f[8]]) & 0x7fff_ffff;
                    return Some((f[3], f[4], id, f[9..].to_vec()));
                }
            }
            let mut chunk = [0u8; 16384];
            let n = s.read(&mut chunk).await.ok()?;
            if n == 0 {
                return None;
            }
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }
}

/// The lines of a JSON access log written at `path` (none while it is not there).
pub fn log_lines(path: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad line ({e}): {l}")))
        .collect()
}
