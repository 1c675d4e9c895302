//! The `tollgate` binary as a user runs it: `check`, and `run` with SIGHUP and SIGTERM.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

#[path = "../../gateway/tests/common/ports.rs"]
mod ports;
use ports::free_port;

const BIN: &str = env!("CARGO_BIN_EXE_tollgate");
const WAIT: Duration = Duration::from_secs(20);

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tollgate-cli-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

#[test]
fn check_accepts_every_shipped_example() {
    // The package's config, with the admin token file its install makes.
    let dir = temp_dir("shipped");
    let token = dir.join("admin.token");
    std::fs::write(&token, "a-token-as-installed\n").expect("token");
    let packaged = std::fs::read_to_string(repo_root().join("packaging/tollgate.yaml"))
        .expect("packaged config");
    assert!(packaged.contains("token_file: /etc/tollgate/admin.token"));
    let installed = dir.join("tollgate.yaml");
    std::fs::write(
        &installed,
        packaged.replace("/etc/tollgate/admin.token", &token.display().to_string()),
    )
    .expect("write");
    let mut files = vec![
        repo_root().join("examples/demo.yaml"),
        repo_root().join("examples/jwt.yaml"),
        installed,
    ];
    for dir in ["examples/seed", "examples/cluster"] {
        for entry in std::fs::read_dir(repo_root().join(dir)).expect(dir) {
            files.push(entry.expect("entry").path());
        }
    }
    assert!(files.len() >= 13, "{files:?}");
    for f in files {
        let out = check_config(&f);
        assert!(
            out.status.success(),
            "{}: {}",
            f.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(String::from_utf8_lossy(&out.stdout).contains("valid"));
    }
}

/// `tollgate run --config FILE` that must not start: its exit is 1 (within 30 s; one that
/// serves instead is stopped and fails the test); what it said.
fn refused_start(file: &Path) -> String {
    let child = Command::new(BIN)
        .args(["run", "--config"])
        .arg(file)
        .env("NO_COLOR", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run");
    let pid = child.id();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    let Ok(out) = rx.recv_timeout(Duration::from_secs(30)) else {
        let _ = Command::new("kill").arg(pid.to_string()).status();
        panic!(
            "`tollgate run --config {}` started instead of being refused",
            file.display()
        );
    };
    let out = out.expect("run");
    assert_eq!(out.status.code(), Some(1));
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// `tollgate check --config FILE`, run to its end.
fn check_config(file: impl AsRef<std::ffi::OsStr>) -> std::process::Output {
    Command::new(BIN)
        .args(["check", "--config"])
        .arg(file)
        .output()
        .expect("run")
}

#[test]
fn check_reads_the_change_log_and_key_files_as_a_start_does() {
    let dir = temp_dir("check-beside");
    let log = dir.join("consumers.changes");
    let f = dir.join("tollgate.yaml");
    // carol2 holds `shared-key` through the admin API (its digest in the log).
    let carol2 = r#"{"name":"carol2","plan":"gold","keys":[{"id":"e6600d79142a","sha256":"e6600d79142aedd819d29b51cf363540e79c7b54e3f42c0d38cd8807b0cfa1d1","created":0}],"version":1024}"#;
    let config = |consumers: &str, plans: &str| {
        format!(
            "listeners: [{{address: 127.0.0.1:8080}}]\nupstreams: {{backend: {{targets: [127.0.0.1:1337]}}}}\nconsumers_log: {}\nplans: {{{plans}}}\nconsumers: [{consumers}]\nroutes:\n  - {{path_prefix: /a/, upstream: backend, auth: {{}}}}\n",
            log.display()
        )
    };
    let check = |text: String| {
        std::fs::write(&f, text).expect("write");
        let out = check_config(&f);
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    std::fs::write(&log, format!("{carol2}\n")).expect("log");
    let (ok, err) = check(config("{name: alice, keys: [a-key]}", "gold: {}"));
    assert!(ok, "{err}");
    // A key the log gives another consumer.
    let (ok, err) = check(config("{name: zed, keys: [shared-key]}", "gold: {}"));
    assert!(!ok, "{err}");
    assert!(
        err.contains("consumers: consumer \"zed\" is given a key that consumer \"carol2\" holds"),
        "{err}"
    );
    // A plan a managed consumer is on, gone from the config: a start serves, refusing it.
    let (ok, err) = check(config("{name: alice, keys: [a-key]}", "silver: {}"));
    assert!(ok, "{err}");
    assert!(
        err.contains("warning: plans: consumer \"carol2\", managed through the admin API, is on plan \"gold\""),
        "{err}"
    );
    // A damaged line.
    std::fs::write(&log, format!("{carol2}\n{{\"name\": \"x\"\n{carol2}\n")).expect("log");
    let (ok, err) = check(config("{name: alice, keys: [a-key]}", "gold: {}"));
    assert!(!ok, "{err}");
    assert!(
        err.contains("consumers_log: cannot keep the consumer change log"),
        "{err}"
    );
    assert!(err.contains("line 2 is not a consumer change"), "{err}");
    let _ = std::fs::remove_file(&log);

    // A key file that leaves nothing to verify with: valid (a start serves, refusing the
    // route's tokens), and said.
    std::fs::write(
        dir.join("keys.json"),
        r#"{"keys":[{"kty":"RSA","n":"abc","e":"AQAB","kid":"x"}]}"#,
    )
    .expect("keys");
    std::fs::write(
        &f,
        "listeners: [{address: 127.0.0.1:8080}]\nupstreams: {backend: {targets: [127.0.0.1:1337]}}\nroutes:\n  - {path_prefix: /a/, upstream: backend, auth: {jwt: {jwks_file: keys.json}}}\n",
    )
    .expect("write");
    let out = check_config(&f);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("warning: routes[0].auth.jwt.jwks_file: 1 RSA key(s) shorter than 2048 bits")
            && err.contains("no key the gateway can verify with"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn check_prints_every_problem_with_its_place() {
    let dir = temp_dir("check");
    let f = dir.join("bad.yaml");
    std::fs::write(
        &f,
        "listeners: [{address: 127.0.0.1:8080}]\nupstreams: {backend: {targets: [127.0.0.1:1337]}}\nroutes:\n  - {path_prefix: /a/, upstream: backend}\n  - {path_prefix: /b/, upstream: backend}\n  - {path_prefix: /c/, upstream: orders}\nconsumers:\n  - {name: x, keys: [k], plan: gold}\n",
    )
    .expect("write");
    let out = check_config(&f);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("routes[2].upstream: unknown upstream \"orders\""),
        "{err}"
    );
    assert!(
        err.contains("consumers[0].plan: unknown plan \"gold\""),
        "{err}"
    );
    assert!(err.contains("2 problem(s); not valid"), "{err}");

    let out = Command::new(BIN)
        .args(["check", "--config"])
        .arg(dir.join("missing.yaml"))
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot read"));

    // A method outside the registry is taken, with a word and its place.
    let f = dir.join("fetch.yaml");
    std::fs::write(
        &f,
        "listeners: [{address: 127.0.0.1:8080}]\nupstreams: {backend: {targets: [127.0.0.1:1337]}}\nroutes:\n  - {path_prefix: /a/, upstream: backend, methods: [GET, FETCH, PURGE, CONNECT]}\n",
    )
    .expect("write");
    let out = check_config(&f);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(
        err.contains("warning: routes[0].methods[1]: \"FETCH\" is not a registered HTTP method")
            && err.contains("(line 4"),
        "{err}"
    );
    assert!(err.contains("routes[0].methods[2]: \"PURGE\""), "{err}");
    assert!(
        err.contains("routes[0].methods[3]: CONNECT is never forwarded"),
        "{err}"
    );
    assert!(!err.contains("methods[0]"), "{err}");

    // The change log needs a file of its own: not the consumers file, not the config.
    std::fs::write(
        dir.join("people.jsonl"),
        "{\"name\": \"c1\", \"keys\": [\"k1\"]}\n",
    )
    .expect("write");
    let head = "listeners: [{address: 127.0.0.1:8080}]\nupstreams: {backend: {targets: [127.0.0.1:1337]}}\nroutes:\n  - {path_prefix: /a/, upstream: backend}\nconsumers_file: people.jsonl\n";
    let absolute = dir.join("people.jsonl").display().to_string();
    // A hard link is the consumers file under another name.
    let _ = std::fs::remove_file(dir.join("people.link"));
    std::fs::hard_link(dir.join("people.jsonl"), dir.join("people.link")).expect("link");
    for (name, log, says) in [
        (
            "log-people.yaml",
            "people.jsonl",
            "names the consumers file",
        ),
        ("log-link.yaml", "people.link", "names the consumers file"),
        (
            "log-abs.yaml",
            absolute.as_str(),
            "names the consumers file",
        ),
        ("log-self.yaml", "log-self.yaml", "names this config file"),
    ] {
        let f = dir.join(name);
        std::fs::write(&f, format!("{head}consumers_log: {log}\n")).expect("write");
        let out = check_config(&f);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{name}: {err}");
        assert!(
            err.contains(&format!("consumers_log: {says}")),
            "{name}: {err}"
        );
        // Each with its place in the file: `consumers_log`'s value, on line 6.
        assert!(err.contains("(line 6, column 16)"), "{name}: {err}");
    }

    // Warnings are printed beside the errors of a file that is not valid.
    let f = dir.join("both.yaml");
    std::fs::write(
        &f,
        "listeners: [{address: 127.0.0.1:8080}]\nupstreams: {backend: {targets: [127.0.0.1:1337]}}\nroutes:\n  - {path_prefix: /a/, upstream: backend, methods: [GET, FETCH]}\n  - {path_prefix: /b/, upstream: orders}\n",
    )
    .expect("write");
    let out = check_config(&f);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("routes[1].upstream: unknown upstream \"orders\""),
        "{err}"
    );
    assert!(
        err.contains("warning: routes[0].methods[1]: \"FETCH\" is not a registered HTTP method")
            && err.contains("(line 4"),
        "{err}"
    );
    assert!(err.contains("1 problem(s); not valid"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A child `tollgate run` whose log lines arrive on a channel.
struct Gateway {
    child: Child,
    lines: mpsc::Receiver<String>,
    addr: SocketAddr,
    /// The log line that said where the first listener listens.
    listening: String,
}

impl Gateway {
    fn start(config: &Path) -> Gateway {
        let mut cmd = Command::new(BIN);
        cmd.args(["run", "--config"]).arg(config);
        Gateway::spawn(cmd)
    }

    /// Runs `cmd` (which must exec `tollgate run`) and waits until it listens.
    fn spawn(mut cmd: Command) -> Gateway {
        let mut child = cmd
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn tollgate");
        let stderr = child.stderr.take().expect("stderr");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let mut g = Gateway {
            child,
            lines,
            addr: "0.0.0.0:0".parse().expect("addr"),
            listening: String::new(),
        };
        let line = g.wait_for("listening on http://");
        let addr = line
            .rsplit("http://")
            .next()
            .and_then(|a| a.split_whitespace().next())
            .expect("addr");
        g.addr = addr.parse().expect("listen address");
        g.listening = line;
        g
    }

    fn wait_for(&mut self, needle: &str) -> String {
        let deadline = std::time::Instant::now() + WAIT;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) if l.contains(needle) => return l,
                Ok(_) => continue,
                Err(_) => panic!("no log line containing {needle:?} within {WAIT:?}"),
            }
        }
    }

    fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([sig, &self.child.id().to_string()])
            .status()
            .expect("kill")
            .success();
        assert!(ok, "kill {sig}");
    }

    /// Status code of `GET path` on a new connection.
    fn get(&self, path: &str) -> u16 {
        self.try_get(path)
            .unwrap_or_else(|e| panic!("GET {path}: {e}"))
    }

    /// [`Gateway::get`], with transport errors returned instead of failing the test.
    fn try_get(&self, path: &str) -> std::io::Result<u16> {
        try_get(self.addr, path)
    }
}

/// Status code of `GET path` on a new connection to `addr`.
fn try_get(addr: SocketAddr, path: &str) -> std::io::Result<u16> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(WAIT))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
    )?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    Ok(out.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0))
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn config(backend: SocketAddr, route: &str) -> String {
    format!(
        "server: {{watch_config: false, drain_timeout: 5s}}\nlisteners: [{{address: \"127.0.0.1:0\"}}]\nupstreams: {{backend: {{targets: [\"{backend}\"]}}}}\nconsumers: [{{name: alice, keys: [t1]}}]\nroutes:\n  - {{path_prefix: /{route}/, upstream: backend, auth: {{}}}}\n"
    )
}

/// The echo backend's process, ended when dropped (also when a test fails).
struct Echo(Child);

impl Echo {
    fn kill(&mut self) -> std::io::Result<()> {
        self.0.kill()
    }

    fn wait(&mut self) -> std::io::Result<std::process::ExitStatus> {
        self.0.wait()
    }
}

impl Drop for Echo {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn echo_backend() -> (SocketAddr, Echo) {
    for _ in 0..5 {
        let addr: SocketAddr = ([127, 0, 0, 1], free_port()).into();
        let mut child = Command::new(BIN)
            .args(["echo", "--listen", &addr.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn echo");
        let deadline = std::time::Instant::now() + WAIT;
        // An HTTP answer, not just an accepted connection: only the echo backend gives it.
        while !answers_http(addr) {
            if child.try_wait().ok().flatten().is_some() {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "echo backend did not start"
            );
            std::thread::yield_now();
        }
        if child.try_wait().ok().flatten().is_none() {
            return (addr, Echo(child));
        }
    }
    panic!("echo backend did not start on any of 5 ports");
}

/// Whether something at `addr` answers a request with an HTTP/1.1 status line.
fn answers_http(addr: SocketAddr) -> bool {
    let Ok(mut s) = TcpStream::connect(addr) else {
        return false;
    };
    let mut buf = [0u8; 8];
    s.set_read_timeout(Some(WAIT)).is_ok()
        && s.write_all(b"GET / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
            .is_ok()
        && s.read_exact(&mut buf).is_ok()
        && &buf == b"HTTP/1.1"
}

#[test]
fn run_reloads_on_sighup_keeps_serving_on_a_bad_file_and_drains_on_sigterm() {
    let (backend, mut echo) = echo_backend();
    let dir = temp_dir("run");
    let file = dir.join("tollgate.yaml");
    std::fs::write(&file, config(backend, "a")).expect("write");
    let mut gw = Gateway::start(&file);
    assert_eq!(gw.get("/a/?apikey=t1"), 200);
    assert_eq!(gw.get("/a/?apikey=nope"), 401);
    assert_eq!(gw.get("/b/?apikey=t1"), 404);

    // A drain timeout changed by the reload is the one the shutdown waits.
    std::fs::write(
        &file,
        config(backend, "b").replace("drain_timeout: 5s", "drain_timeout: 3s"),
    )
    .expect("write");
    gw.signal("-HUP");
    gw.wait_for("config reloaded");
    assert_eq!(gw.get("/b/?apikey=t1"), 200);
    assert_eq!(gw.get("/a/?apikey=t1"), 404);

    std::fs::write(
        &file,
        config(backend, "c").replace("upstream: backend", "upstream: gone"),
    )
    .expect("write");
    gw.signal("-HUP");
    let line = gw.wait_for("config rejected");
    assert!(line.contains("unknown upstream \"gone\""), "{line}");
    assert_eq!(gw.get("/b/?apikey=t1"), 200, "old config keeps serving");

    // A file that cannot be read is a rejected reload too, and said so.
    std::fs::remove_file(&file).expect("remove");
    gw.signal("-HUP");
    let line = gw.wait_for("config rejected");
    assert!(line.contains("cannot read"), "{line}");
    assert_eq!(gw.get("/b/?apikey=t1"), 200, "old config keeps serving");

    gw.signal("-TERM");
    gw.wait_for("draining for at most 3s");
    gw.wait_for("all connections drained");
    let status = gw.child.wait().expect("wait");
    assert!(status.success(), "{status}");
    let _ = echo.kill();
    let _ = echo.wait();
    let _ = std::fs::remove_dir_all(&dir);
}

/// A backend that switches every connection to a raw echo: `101`, then what comes in goes
/// back out, until the client closes.
fn upgrade_echo_backend() -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    std::thread::spawn(move || {
        for mut s in l.incoming().map_while(Result::ok) {
            std::thread::spawn(move || {
                let mut head = Vec::new();
                let mut b = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") {
                    if s.read_exact(&mut b).is_err() {
                        return;
                    }
                    head.push(b[0]);
                }
                let _ = s.write_all(
                    b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n",
                );
                let mut buf = [0u8; 512];
                while let Ok(n) = s.read(&mut buf) {
                    if n == 0 || s.write_all(&buf[..n]).is_err() {
                        return;
                    }
                }
            });
        }
    });
    addr
}

/// Sends `text` through the tunnel `s` and reads it back.
fn echoed(s: &mut TcpStream, text: &[u8]) -> std::io::Result<Vec<u8>> {
    s.write_all(text)?;
    let mut back = vec![0u8; text.len()];
    s.read_exact(&mut back)?;
    Ok(back)
}

#[test]
fn sigterm_drains_an_open_websocket_tunnel_until_it_closes() {
    let backend = upgrade_echo_backend();
    let dir = temp_dir("drain-tunnel");
    let file = dir.join("tollgate.yaml");
    std::fs::write(
        &file,
        format!(
            "server: {{watch_config: false, drain_timeout: 20s}}\nlisteners: [{{address: \"127.0.0.1:0\"}}]\nupstreams: {{chat: {{targets: [\"{backend}\"]}}}}\nroutes:\n  - {{path_prefix: /ws/, upstream: chat, websocket: true}}\n"
        ),
    )
    .expect("write");
    let mut gw = Gateway::start(&file);
    let mut s = TcpStream::connect(gw.addr).expect("connect");
    s.set_read_timeout(Some(WAIT)).expect("timeout");
    s.write_all(b"GET /ws/a HTTP/1.1\r\nHost: t\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")
        .expect("ask");
    let mut head = Vec::new();
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        s.read_exact(&mut b).expect("the answer's head");
        head.push(b[0]);
    }
    assert!(
        head.starts_with(b"HTTP/1.1 101"),
        "{}",
        String::from_utf8_lossy(&head)
    );
    assert_eq!(echoed(&mut s, b"before").expect("tunnel"), b"before");

    gw.signal("-TERM");
    gw.wait_for("shutting down");
    // The tunnel is drained as the connection it came from: it still carries traffic, and
    // the drain is not over while it is open.
    assert_eq!(
        echoed(&mut s, b"after the signal").expect("the tunnel open after SIGTERM"),
        b"after the signal"
    );
    let said: Vec<String> = gw.lines.try_iter().collect();
    assert!(
        !said.iter().any(|l| l.contains("all connections drained")),
        "drained with a tunnel open: {said:?}"
    );
    drop(s);
    gw.wait_for("all connections drained");
    let status = gw.child.wait().expect("wait");
    assert!(status.success(), "{status}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn out_of_file_descriptors_backs_off_logs_at_most_once_a_second_and_recovers() {
    let (backend, mut echo) = echo_backend();
    let dir = temp_dir("fds");
    let file = dir.join("tollgate.yaml");
    std::fs::write(&file, config(backend, "a")).expect("write");
    let mut cmd = Command::new("bash");
    cmd.arg("-c").arg(format!(
        "ulimit -n 48 && exec {BIN} run --config {}",
        file.display()
    ));
    let mut gw = Gateway::spawn(cmd);
    // More connections than descriptors: the gateway runs out and must not spin or flood.
    let held: Vec<TcpStream> = (0..80)
        .filter_map(|_| TcpStream::connect(gw.addr).ok())
        .collect();
    assert!(held.len() > 48, "only {} connections opened", held.len());
    gw.wait_for("accept failed");
    let watch = Duration::from_millis(2500);
    let deadline = std::time::Instant::now() + watch;
    let mut logged = 1;
    while let Some(left) = deadline.checked_duration_since(std::time::Instant::now()) {
        match gw.lines.recv_timeout(left) {
            Ok(l) if l.contains("accept failed") => logged += 1,
            Ok(_) => {}
            Err(_) => break,
        }
    }
    assert!(logged <= 4, "{logged} accept-failure lines in {watch:?}");
    drop(held);
    // The gateway frees the descriptors as it sees the held connections close; until it has,
    // a request may still find none left for its upstream connection: 503, its own lack,
    // never a 502 that blames the target. It must serve again once they are free: within
    // the test's deadline, however busy the machine.
    let deadline = std::time::Instant::now() + WAIT;
    let mut status = gw.try_get("/a/?apikey=t1");
    while status.as_ref().ok() != Some(&200) && std::time::Instant::now() < deadline {
        assert_ne!(status.as_ref().ok(), Some(&502), "the target blamed");
        std::thread::yield_now();
        status = gw.try_get("/a/?apikey=t1");
    }
    assert_eq!(
        status.ok(),
        Some(200),
        "serves again once descriptors are free"
    );
    let _ = echo.kill();
    let _ = echo.wait();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn demo_says_nothing_of_itself_when_it_cannot_listen() {
    // Hold the demo's gateway port (or find it held already: the same condition).
    let _held = std::net::TcpListener::bind("127.0.0.1:8080");
    let out = Command::new(BIN)
        .arg("demo")
        .env("NO_COLOR", "1")
        .output()
        .expect("run demo");
    assert!(!out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!stdout.contains("Try:"), "banner printed: {stdout}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("cannot"), "{stderr}");
    if stderr.contains("cannot listen") {
        assert!(stderr.contains("--listen"), "{stderr}");
    }
    // A busy admin port says which flag moves it.
    let held = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let busy = held.local_addr().expect("addr");
    let out = Command::new(BIN)
        .arg("demo")
        .args(["--listen", &format!("127.0.0.1:{}", free_port())])
        .args(["--backend", &format!("127.0.0.1:{}", free_port())])
        .args(["--admin", &busy.to_string()])
        .env("NO_COLOR", "1")
        .output()
        .expect("run demo");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!("cannot listen on the admin address {busy}"))
            && stderr.contains("--admin"),
        "{stderr}"
    );
}

#[test]
fn run_says_what_each_listener_speaks() {
    let dir = temp_dir("schemes");
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).expect("cert");
    std::fs::write(dir.join("c.pem"), cert.cert.pem()).expect("write cert");
    std::fs::write(dir.join("c.key"), cert.signing_key.serialize_pem()).expect("write key");
    let (backend, _echo) = echo_backend();
    let file = dir.join("tollgate.yaml");
    let tls_port = free_port();
    std::fs::write(
        &file,
        format!(
            "listeners:\n  - {{address: \"127.0.0.1:0\", h2c: true}}\n  - {{address: \"127.0.0.1:{tls_port}\", tls: {{certificates: [{{cert: c.pem, key: c.key}}]}}}}\nupstreams: {{backend: {{targets: [\"{backend}\"]}}}}\nroutes: [{{path_prefix: /, upstream: backend}}]\n"
        ),
    )
    .expect("write config");
    let mut g = Gateway::start(&file);
    let h2c = format!("listening on http://{} (HTTP/1.1 and h2c)", g.addr);
    assert!(g.listening.ends_with(&h2c), "{}", g.listening);
    let tls = g.wait_for("listening on https://");
    let expected = format!("listening on https://127.0.0.1:{tls_port} (HTTP/1.1 and HTTP/2)");
    assert!(tls.ends_with(&expected), "{tls}");
    drop(g);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn run_refuses_to_start_on_a_bad_config() {
    let dir = temp_dir("bad");
    let file = dir.join("tollgate.yaml");
    std::fs::write(&file, "listeners: []\nroutes: []\n").expect("write");
    let out = Command::new(BIN)
        .args(["run", "--config"])
        .arg(&file)
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("listeners: at least one listener is required"),
        "{err}"
    );
    assert!(err.contains("tollgate check --config"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

fn bench_json(args: &[&str]) -> (Option<i32>, serde_json::Value) {
    let out = Command::new(BIN)
        .arg("bench")
        .args(args)
        .arg("--json")
        .output()
        .expect("bench");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("bad JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)));
    (out.status.code(), v)
}

#[test]
fn bench_counts_requests_statuses_and_latency() {
    let (backend, mut echo) = echo_backend();
    let url = format!("http://{backend}/x");
    let (code, v) = bench_json(&["-n", "300", "-c", "4", &url]);
    assert_eq!(code, Some(0), "{v}");
    assert_eq!(v["requests"], 300);
    assert_eq!(v["successful"], 300);
    assert_eq!(v["failed"], 0);
    assert_eq!(v["statuses"]["200"], 300);
    assert_eq!(v["mode"], "closed");
    let l = &v["latency_ms"];
    for k in [
        "fastest", "average", "slowest", "p50", "p90", "p99", "p99_9",
    ] {
        assert!(l[k].as_f64().is_some_and(|x| x > 0.0), "{k}: {v}");
    }
    assert!(
        l["fastest"].as_f64() <= l["p50"].as_f64() && l["p50"].as_f64() <= l["slowest"].as_f64()
    );

    // Success is what --expect says.
    let (code, v) = bench_json(&["-n", "50", "-c", "2", "--expect", "404", &url]);
    assert_eq!(code, Some(1));
    assert_eq!(
        (v["successful"].as_u64(), v["failed"].as_u64()),
        (Some(0), Some(50))
    );

    // Open loop: the schedule decides how many are sent.
    let (code, v) = bench_json(&["-n", "100", "-c", "2", "--rate", "2000", "-m", "HEAD", &url]);
    assert_eq!(code, Some(0), "{v}");
    assert_eq!(
        (v["requests"].as_u64(), v["mode"].as_str()),
        (Some(100), Some("open"))
    );
    assert!(v["send_lag_ms"]["p50"].as_f64().is_some(), "{v}");

    // A URL without a scheme, as the README writes them; piped, the run says what it does.
    let out = Command::new(BIN)
        .args(["bench", "-n", "20", "-c", "1", &format!("{backend}/x")])
        .output()
        .expect("bench");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(
        err.starts_with(&format!(
            "tollgate bench: http://{backend}/x, 1 connection\n"
        )),
        "{err}"
    );
    let _ = echo.kill();
    let _ = echo.wait();
}

#[test]
fn bench_reports_errors_by_kind() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port();
    let url = format!("http://127.0.0.1:{port}/");
    let (code, v) = bench_json(&["-n", "5", "-c", "1", &url]);
    assert_eq!(code, Some(1));
    assert_eq!(v["errors"]["connect"], 5, "{v}");
    assert_eq!(v["failed"], 5);
    // Failures are not a request rate: nothing was answered.
    assert_eq!(v["requests_per_second"], 0.0, "{v}");
    assert!(
        v["errors_per_second"].as_f64().is_some_and(|e| e > 0.0),
        "{v}"
    );
}

#[test]
fn an_open_loop_run_stops_at_its_duration_and_counts_what_it_could_not_send() {
    // A server that takes connections and never answers.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = silent.local_addr().expect("addr");
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for c in silent.incoming().take(8) {
            held.push(c);
        }
    });
    let url = format!("http://{addr}/");
    // 20 requests are due within the second; the one connection's first waits out its
    // 1 s timeout, and the run ends there instead of sending the other 19 one by one.
    let (code, v) = bench_json(&[
        "--rate",
        "20",
        "-d",
        "1s",
        "-c",
        "1",
        "--timeout",
        "1s",
        &url,
    ]);
    assert_eq!(code, Some(1), "{v}");
    assert_eq!(v["errors"]["timeout"], 1, "{v}");
    assert_eq!(v["requests"], 1, "{v}");
    assert_eq!(v["unsent"], 19, "{v}");
    // A timeout says something listens: no "is anything listening" question.
    let out = Command::new(BIN)
        .args(["bench", "-n", "1", "-c", "1", "--timeout", "200ms", &url])
        .output()
        .expect("bench");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("timeout: 1"), "{text}");
    assert!(!text.contains("listening"), "{text}");
}

/// `tollgate usage --config FILE ARGS…`: whether it succeeded, and its stderr.
fn usage_failing(file: &Path, args: &[&str]) -> (bool, String) {
    let out = Command::new(BIN)
        .args(["usage", "--config"])
        .arg(file)
        .args(args)
        .output()
        .expect("run usage");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `tollgate usage … --history 1h`, its stdout.
fn history(file: &Path, json: bool) -> String {
    let mut cmd = Command::new(BIN);
    cmd.args(["usage", "--config"])
        .arg(file)
        .args(["alice", "--history", "1h"]);
    if json {
        cmd.arg("--json");
    }
    let out = cmd.output().expect("run usage");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn access_log_reopens_on_sigusr1_and_history_survives_shutdown() {
    let (backend, _echo) = echo_backend();
    let dir = temp_dir("observe");
    let _ = std::fs::remove_file(dir.join("analytics.db"));
    let log = dir.join("access.log");
    let _ = std::fs::remove_file(&log);
    let file = dir.join("tollgate.yaml");
    std::fs::write(
        &file,
        format!(
            "server: {{watch_config: false, drain_timeout: 5s}}\nlisteners: [{{address: \"127.0.0.1:0\"}}]\nupstreams: {{backend: {{targets: [\"{backend}\"]}}}}\nconsumers: [{{name: alice, keys: [t1]}}]\nroutes:\n  - {{name: a, path_prefix: /a/, upstream: backend, auth: {{}}}}\nadmin: {{address: \"127.0.0.1:{}\"}}\naccess_log: {{path: access.log}}\nanalytics: {{path: analytics.db}}\n",
            free_port()
        ),
    )
    .expect("write");
    let mut gw = Gateway::start(&file);
    for _ in 0..3 {
        assert_eq!(gw.get("/a/?apikey=t1"), 200);
    }
    assert_eq!(gw.get("/a/?apikey=bad"), 401);

    // From the running node's admin endpoint.
    let table = history(&file, false);
    assert!(table.contains("alice: requests per 1m"), "{table}");
    assert!(table.contains("from the running node"), "{table}");
    let total = table
        .lines()
        .find(|l| l.trim_start().starts_with("total"))
        .unwrap_or_else(|| panic!("no total line: {table}"));
    let cells: Vec<&str> = total.split_whitespace().collect();
    assert_eq!(cells, ["total", "3", "0", "0", "0", "3"], "{table}");
    // A name no one has: said, and a failure for scripts.
    let (ok, err) = usage_failing(&file, &["alicee", "--history", "1h"]);
    assert!(!ok, "{err}");
    assert!(
        err.contains("no consumer named \"alicee\"") && err.contains("nor on the running node"),
        "{err}"
    );

    // logrotate moves the file and sends SIGUSR1.
    let rotated = dir.join("access.log.1");
    std::fs::rename(&log, &rotated).expect("rotate");
    gw.signal("-USR1");
    gw.wait_for("access log reopened");
    assert_eq!(gw.get("/a/?apikey=t1"), 200);
    gw.signal("-TERM");
    gw.wait_for("all connections drained");
    assert!(gw.child.wait().expect("wait").success());

    let old = std::fs::read_to_string(&rotated).expect("rotated log");
    assert_eq!(old.lines().count(), 4, "{old}");
    assert!(
        !old.contains("apikey=t1") && !old.contains("apikey=bad"),
        "{old}"
    );
    let new = std::fs::read_to_string(&log).expect("reopened log");
    assert_eq!(new.lines().count(), 1, "{new}");
    assert!(new.contains("\"consumer\":\"alice\""), "{new}");

    // With the node stopped, from the database file: the last request was written on
    // shutdown.
    let json: serde_json::Value = serde_json::from_str(&history(&file, true)).expect("json");
    assert_eq!(json["source"], "the analytics database");
    let sum: u64 = json["rows"]
        .as_array()
        .expect("rows")
        .iter()
        .filter(|r| r["status"] == "2xx" && r["route"] == "a")
        .map(|r| r["count"].as_u64().unwrap_or(0))
        .sum();
    assert_eq!(sum, 4, "{json}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn usage_names_the_redis_it_cannot_read() {
    let dir = temp_dir("usage-redis");
    let file = dir.join("tollgate.yaml");
    let port = free_port();
    std::fs::write(
        &file,
        format!(
            "listeners: [{{address: \"127.0.0.1:0\"}}]\nupstreams: {{backend: {{targets: [\"127.0.0.1:9\"]}}}}\nplans: {{p: {{limits: [{{requests: 5, per: 1m}}]}}}}\nconsumers: [{{name: alice, keys: [t1], plan: p}}]\nroutes:\n  - {{name: a, path_prefix: /a/, upstream: backend, auth: {{}}}}\ncluster: {{redis: {{url: \"redis://:hunter2@127.0.0.1:{port}/0\"}}}}\n"
        ),
    )
    .expect("write");
    let (ok, err) = usage_failing(&file, &["alice"]);
    assert!(!ok, "{err}");
    assert!(
        err.contains(&format!("(Redis: redis://<redacted>@127.0.0.1:{port}/0)")),
        "{err}"
    );
    assert!(!err.contains("hunter2"), "{err}");
    // A time as the config writes one: whole, with a unit, and not nothing.
    for (ago, said) in [
        ("1.5h", "must be a whole number with a unit; write 90m"),
        ("0s", "a second or more"),
        ("soon", "must start with a whole number"),
    ] {
        let (ok, err) = usage_failing(&file, &["alice", "--history", ago]);
        assert!(!ok && err.contains(said), "{ago}: {err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_required_usage_history_that_cannot_be_opened_stops_the_start() {
    let dir = temp_dir("analytics-required");
    let db = dir.join("analytics.db");
    std::fs::write(&db, vec![0x5au8; 8192]).expect("write garbage");
    let file = dir.join("tollgate.yaml");
    std::fs::write(
        &file,
        "listeners: [{address: \"127.0.0.1:0\"}]\nupstreams: {backend: {targets: [\"127.0.0.1:9\"]}}\nroutes: [{path_prefix: /, upstream: backend}]\nanalytics: {path: analytics.db, required: true}\n",
    )
    .expect("write");
    let err = refused_start(&file);
    assert!(err.contains(&db.display().to_string()), "{err}");
    assert!(err.contains("analytics.required"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `GET path` on the admin listener at `addr`: the body.
fn admin_get(addr: SocketAddr, path: &str) -> String {
    let mut s = TcpStream::connect(addr).expect("admin connect");
    s.set_read_timeout(Some(WAIT)).expect("timeout");
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .expect("write");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read");
    out.split_once("\r\n\r\n")
        .map_or(out.clone(), |(_, b)| b.to_string())
}

/// A counter's value in the admin `/metrics`.
fn metric(admin: SocketAddr, name: &str) -> u64 {
    admin_get(admin, "/metrics")
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or(0)
}

#[test]
fn limit_counters_survive_sigterm_and_kill_9() {
    let (backend, _echo) = echo_backend();
    let dir = temp_dir("state");
    for f in ["state.db", "state.db-wal", "state.db-shm"] {
        let _ = std::fs::remove_file(dir.join(f));
    }
    let admin: SocketAddr = ([127, 0, 0, 1], free_port()).into();
    let file = dir.join("tollgate.yaml");
    std::fs::write(
        &file,
        format!(
            "server: {{watch_config: false, drain_timeout: 5s}}\nlisteners: [{{address: \"127.0.0.1:0\"}}]\nupstreams: {{backend: {{targets: [\"{backend}\"]}}}}\nplans: {{gold: {{limits: [{{requests: 5, per: 30d, name: month}}]}}}}\nconsumers: [{{name: alice, keys: [t1], plan: gold}}, {{name: bob, keys: [t2], plan: gold}}]\nroutes:\n  - {{name: a, path_prefix: /a/, upstream: backend, auth: {{}}}}\nadmin: {{address: \"{admin}\"}}\nstate: {{path: state.db, flush_interval: 50ms}}\n"
        ),
    )
    .expect("write");

    // SIGTERM: everything admitted is written on the way out.
    let mut gw = Gateway::start(&file);
    for _ in 0..3 {
        assert_eq!(gw.get("/a/?apikey=t1"), 200);
    }
    gw.signal("-TERM");
    gw.wait_for("all connections drained");
    assert!(gw.child.wait().expect("wait").success());
    let mut gw = Gateway::start(&file);
    assert_eq!(gw.get("/a/?apikey=t1"), 200);
    assert_eq!(gw.get("/a/?apikey=t1"), 200);
    assert_eq!(
        gw.get("/a/?apikey=t1"),
        429,
        "a month quota is not reset by a restart"
    );

    // kill -9: what was admitted before the last flush interval is kept. Two rounds of
    // writing after these requests, and then the process is killed.
    for _ in 0..4 {
        assert_eq!(gw.get("/a/?apikey=t2"), 200);
    }
    let rounds = metric(admin, "tollgate_state_flushes_total");
    let deadline = std::time::Instant::now() + WAIT;
    while metric(admin, "tollgate_state_flushes_total") < rounds + 2 {
        assert!(std::time::Instant::now() < deadline, "no state write");
        std::thread::yield_now();
    }
    gw.signal("-KILL");
    let _ = gw.child.wait();
    let gw = Gateway::start(&file);
    assert_eq!(gw.get("/a/?apikey=t2"), 200);
    assert_eq!(gw.get("/a/?apikey=t2"), 429);
    assert_eq!(gw.get("/a/?apikey=t1"), 429);

    // A second gateway on the same state file (its own admin port) does not start while
    // the first keeps it: each would restore and overwrite the other's counts.
    let other = dir.join("second.yaml");
    let yaml = std::fs::read_to_string(&file).expect("config");
    let second_admin: SocketAddr = ([127, 0, 0, 1], free_port()).into();
    std::fs::write(
        &other,
        yaml.replace(&admin.to_string(), &second_admin.to_string()),
    )
    .expect("write");
    let err = refused_start(&other);
    assert!(
        err.contains(&format!("another process (pid {})", gw.child.id()))
            && err.contains("give each gateway its own state.path")
            && err.contains("not starting"),
        "{err}"
    );
    assert_eq!(gw.get("/a/?apikey=t2"), 429);
    drop(gw);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A raw GET to `addr`, the whole answer.
fn raw_get(addr: SocketAddr, target: &str) -> String {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(WAIT)).expect("timeout");
    write!(
        s,
        "GET {target} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .expect("write");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read");
    out
}

#[test]
fn the_demo_runs_beside_busy_ports_with_everything_on() {
    let port = || -> SocketAddr { ([127, 0, 0, 1], free_port()).into() };
    let (listen, backend, admin) = (port(), port(), port());
    let mut cmd = Command::new(BIN);
    cmd.args(["demo", "--listen", &listen.to_string()])
        .args(["--backend", &backend.to_string()])
        .args(["--admin", &admin.to_string()])
        .stdout(Stdio::piped());
    let mut g = Gateway::spawn(cmd);
    assert_eq!(g.addr, listen);
    let stdout = g.child.stdout.take().expect("stdout");
    let (tx, out) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    assert_eq!(g.get("/api/hello?apikey=demo-key"), 200);
    // The access log goes to stdout, after the banner that names the addresses.
    let mut banner = String::new();
    let logged = loop {
        let line = out.recv_timeout(WAIT).expect("a line on stdout");
        if line.starts_with('{') && line.contains("/api/hello") {
            break line;
        }
        banner.push_str(&line);
    };
    assert!(logged.contains("\"status\":200"), "{logged}");
    assert!(
        banner.contains(&format!("http://{listen}/api/hello")),
        "{banner}"
    );
    assert!(banner.contains(&format!("http://{admin}/")), "{banner}");
    // A cached route: the second call is a hit.
    raw_get(listen, "/cached/x?apikey=demo-key");
    let again = raw_get(listen, "/cached/x?apikey=demo-key");
    assert!(again.contains("cache-status: tollgate; hit"), "{again}");
    // The usage history is on.
    let status = admin_get(admin, "/status");
    let v: serde_json::Value = serde_json::from_str(&status).expect("status JSON");
    assert_eq!(v["analytics"]["enabled"], true, "{status}");
    // A 429 for the demo's consumer shows under that consumer in /metrics.
    let refused = (0..6).any(|_| g.get("/api/hello?apikey=demo-key") == 429);
    assert!(
        refused,
        "the burst limit of 5 per 10 s refused none of 9 calls"
    );
    let metrics = admin_get(admin, "/metrics");
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("tollgate_consumer_requests_total{")
                && l.contains("consumer=\"demo\"")
                && l.contains("class=\"4xx\"")),
        "{metrics}"
    );
    g.signal("-TERM");
    assert!(g.child.wait().expect("wait").success());
}

#[test]
fn version_completions_and_a_json_process_log() {
    let v = Command::new(BIN).arg("--version").output().expect("run");
    let v = String::from_utf8_lossy(&v.stdout);
    assert!(
        v.starts_with(&format!("tollgate {} (", env!("CARGO_PKG_VERSION")))
            && v.contains(", built 20"),
        "{v}"
    );
    for shell in ["bash", "zsh", "fish"] {
        let c = Command::new(BIN)
            .args(["completions", shell])
            .output()
            .expect("run");
        assert!(c.status.success(), "{shell}");
        let script = String::from_utf8_lossy(&c.stdout);
        assert!(
            script.contains("completions") && script.contains("bench"),
            "{shell}"
        );
    }
    let addr: SocketAddr = ([127, 0, 0, 1], free_port()).into();
    let mut echo = Command::new(BIN)
        .args([
            "--log-format",
            "json",
            "echo",
            "--listen",
            &addr.to_string(),
        ])
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let stderr = echo.stderr.take().expect("stderr");
    let first = BufReader::new(stderr)
        .lines()
        .next()
        .expect("a log line")
        .expect("read");
    let _ = echo.kill();
    let _ = echo.wait();
    let line: serde_json::Value = serde_json::from_str(&first).expect("a JSON line");
    assert_eq!(line["level"], "INFO", "{first}");
    assert!(
        line["fields"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("echo backend")),
        "{first}"
    );
    // Why a node does not start is a JSON line too.
    let dir = temp_dir("json-refusal");
    let bad = dir.join("bad.yaml");
    std::fs::write(&bad, "listeners: []\nbogus: 1\n").expect("write");
    let out = Command::new(BIN)
        .args(["--log-format", "json", "run", "--config"])
        .arg(&bad)
        .output()
        .expect("run");
    assert!(!out.status.success());
    let text = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    assert!(
        lines.iter().any(|l| l["level"] == "ERROR"
            && l["fields"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("bogus") && m.contains("line 2"))),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bench_measures_https_too() {
    let dir = temp_dir("bench-tls");
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).expect("cert");
    std::fs::write(dir.join("c.pem"), cert.cert.pem()).expect("write cert");
    std::fs::write(dir.join("c.key"), cert.signing_key.serialize_pem()).expect("write key");
    let (backend, _echo) = echo_backend();
    let file = dir.join("tollgate.yaml");
    let tls_port = free_port();
    std::fs::write(
        &file,
        format!(
            "listeners:\n  - {{address: \"127.0.0.1:0\"}}\n  - {{address: \"127.0.0.1:{tls_port}\", tls: {{certificates: [{{cert: c.pem, key: c.key}}]}}}}\nupstreams: {{backend: {{targets: [\"{backend}\"]}}}}\nroutes: [{{path_prefix: /, upstream: backend}}]\n"
        ),
    )
    .expect("write config");
    let mut g = Gateway::start(&file);
    g.wait_for(&format!("listening on https://127.0.0.1:{tls_port}"));
    let url = format!("https://127.0.0.1:{tls_port}/x");
    // A self-signed certificate: taken with -k, as curl does.
    let (code, v) = bench_json(&["-k", "-n", "30", "-c", "2", &url]);
    assert_eq!(code, Some(0), "{v}");
    assert_eq!(v["successful"], 30, "{v}");
    // Without -k it is not trusted: every handshake fails, and the report says so
    // (not "is anything listening").
    let (code, v) = bench_json(&["-n", "3", "-c", "1", &url]);
    assert_eq!(code, Some(1), "{v}");
    assert_eq!(v["errors"]["tls"], 3, "{v}");
    assert!(v["errors"].get("connect").is_none(), "{v}");
    let out = Command::new(BIN)
        .args(["bench", "-n", "1", "-c", "1", &url])
        .output()
        .expect("bench");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("TLS handshake failed"), "{text}");
    assert!(text.contains("-k"), "{text}");
    assert!(!text.contains("listening"), "{text}");
    g.signal("-TERM");
    let _ = g.child.wait();
    let _ = std::fs::remove_dir_all(&dir);
}

/// A node whose admin API manages consumers (token in `admin.token` beside it), with
/// `more` added to its config.
fn managed_node(backend: SocketAddr, more: &str) -> String {
    format!(
        "server: {{watch_config: false, drain_timeout: 5s}}\nlisteners: [{{address: \"127.0.0.1:0\"}}]\nupstreams: {{backend: {{targets: [\"{backend}\"]}}}}\nplans: {{gold: {{limits: [{{requests: 100, per: 1m}}]}}}}\nconsumers: [{{name: alice, keys: [t1]}}]\n{more}routes:\n  - {{name: a, path_prefix: /a/, upstream: backend, auth: {{}}}}\nadmin: {{address: \"127.0.0.1:{}\", token_file: admin.token}}\n",
        free_port()
    )
}

/// `tollgate consumers ARGS --config FILE`: whether it succeeded, its stdout, its stderr.
fn consumers_cli(file: &Path, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(BIN)
        .arg("consumers")
        .args(args)
        .arg("--config")
        .arg(file)
        .output()
        .expect("run");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).trim().to_string(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn consumers_are_managed_from_the_command_line_and_kept_across_a_restart() {
    let (backend, _echo) = echo_backend();
    let dir = temp_dir("consumers-cli");
    let _ = std::fs::remove_file(dir.join("consumers.changes"));
    std::fs::write(dir.join("admin.token"), "cli-secret\n").expect("token");
    let file = dir.join("tollgate.yaml");
    std::fs::write(
        &file,
        managed_node(backend, "consumers_log: consumers.changes\n"),
    )
    .expect("write");
    let tg = |args: &[&str]| consumers_cli(&file, args);
    let mut gw = Gateway::start(&file);
    // Nothing managed yet: an empty list, and a word that the config's own are not in it.
    let (ok, list, err) = tg(&["list"]);
    assert!(ok && list.is_empty(), "{list}");
    assert!(
        err.contains("no consumer is managed through the admin API")
            && err.contains("the config's own consumers (1) are not listed"),
        "{err}"
    );
    let (ok, added, err) = tg(&["add", "bob", "--plan", "gold"]);
    assert!(ok, "{err}");
    assert_eq!(added.trim(), "bob\tplan=gold\tkeys=0", "{added}");
    let (ok, key, err) = tg(&["key", "bob"]);
    assert!(ok && key.starts_with("tg_"), "{key} {err}");
    assert!(err.contains("shown this once"), "{err}");
    assert_eq!(gw.get(&format!("/a/?apikey={key}")), 200);

    let (ok, made, err) = tg(&["key", "bob", "--json"]);
    assert!(ok, "{err}");
    let made: serde_json::Value = serde_json::from_str(&made).expect("json");
    let (second, id) = (
        made["key"].as_str().expect("key"),
        made["id"].as_str().expect("id"),
    );
    assert_eq!(gw.get(&format!("/a/?apikey={second}")), 200);
    assert!(tg(&["key", "bob", "--revoke", id]).0);
    assert_eq!(gw.get(&format!("/a/?apikey={second}")), 401);
    assert!(tg(&["rm", "alice"]).0);
    assert_eq!(gw.get("/a/?apikey=t1"), 401);
    let (ok, list, _) = tg(&["list"]);
    assert!(ok && list.contains("bob\tplan=gold\tkeys=1"), "{list}");
    assert!(
        !list.contains("alice"),
        "a deleted consumer is listed: {list}"
    );
    let (ok, list, _) = tg(&["list", "--deleted"]);
    assert!(ok && list.contains("bob\tplan=gold\tkeys=1"), "{list}");
    assert!(list.contains("alice\tplan=-\tkeys=0\tdeleted"), "{list}");
    let (ok, _, err) = tg(&["key", "nobody"]);
    assert!(!ok && err.contains("no consumer \"nobody\""), "{err}");

    // Stopped and started again: the change log brings every change back.
    gw.signal("-TERM");
    gw.wait_for("all connections drained");
    assert!(gw.child.wait().expect("wait").success());
    let mut gw = Gateway::start(&file);
    assert_eq!(gw.get(&format!("/a/?apikey={key}")), 200);
    assert_eq!(gw.get(&format!("/a/?apikey={second}")), 401);
    assert_eq!(gw.get("/a/?apikey=t1"), 401);

    // A second gateway naming the same log (its own admin port) does not start while the
    // first keeps it, and names the process that does.
    let yaml = std::fs::read_to_string(&file).expect("config");
    let cut = yaml.find("admin:").expect("admin line");
    let other = dir.join("second.yaml");
    std::fs::write(
        &other,
        format!(
            "{}admin: {{address: \"127.0.0.1:{}\", token_file: admin.token}}\n",
            &yaml[..cut],
            free_port()
        ),
    )
    .expect("write");
    let err = refused_start(&other);
    assert!(
        err.contains(&format!("another process (pid {})", gw.child.id()))
            && err.contains("not starting"),
        "{err}"
    );
    assert_eq!(gw.get(&format!("/a/?apikey={key}")), 200);
    gw.signal("-TERM");
    assert!(gw.child.wait().expect("wait").success());

    // A config giving bob's key to one of its own consumers names two for one key: the
    // gateway does not start.
    let yaml = std::fs::read_to_string(&file).expect("config");
    std::fs::write(
        &file,
        yaml.replace(
            "{name: alice, keys: [t1]}",
            &format!("{{name: alice, keys: [t1]}}, {{name: carol, keys: [\"{key}\"]}}"),
        ),
    )
    .expect("write");
    let err = refused_start(&file);
    assert!(
        err.contains("consumer \"carol\" is given a key that consumer \"bob\" holds")
            && err.contains("not starting"),
        "{err}"
    );
    std::fs::write(&file, yaml).expect("write");

    // A line damaged inside the log (here the one revoking bob's second key) is not
    // skipped: that would bring the key back. The gateway does not start, and says which
    // line.
    let log = dir.join("consumers.changes");
    let text = std::fs::read_to_string(&log).expect("log");
    let lines: Vec<&str> = text.lines().collect();
    let at = lines.len() - 2;
    assert!(
        lines[at].contains("\"bob\"") && !lines[at].contains(id),
        "{text}"
    );
    let mut damaged = lines.clone();
    damaged[at] = "{\"name\":\"bob\",\"pl";
    std::fs::write(&log, damaged.join("\n") + "\n").expect("damage");
    let err = refused_start(&file);
    assert!(
        err.contains(&format!("line {} is not a consumer change", at + 1))
            && err.contains("not starting"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_503_for_want_of_a_healthy_target_is_logged_with_its_route_and_upstream() {
    let dir = temp_dir("no-healthy");
    let file = dir.join("tollgate.yaml");
    // A target nothing listens on, taken out by active checks before any request.
    std::fs::write(
        &file,
        format!(
            "server: {{watch_config: false, drain_timeout: 5s}}\nlisteners: [{{address: \"127.0.0.1:0\"}}]\nupstreams: {{gone: {{targets: [\"127.0.0.1:{}\"], health: {{path: /health, interval: 50ms, timeout: 1s, unhealthy: 1}}}}}}\nroutes: [{{name: dead, path_prefix: /, upstream: gone}}]\n",
            free_port()
        ),
    )
    .expect("write");
    let mut gw = Gateway::start(&file);
    gw.wait_for("taken out of rotation");
    let answer = raw_get(gw.addr, "/x");
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    let id = answer
        .lines()
        .find_map(|l| l.strip_prefix("x-request-id: "))
        .unwrap_or_else(|| panic!("no request id in {answer}"))
        .trim();
    let line = gw.wait_for("no healthy upstream target");
    assert!(
        line.contains("route=\"dead\"")
            && line.contains("upstream=gone")
            && line.contains(&format!("request_id=\"{id}\"")),
        "{line}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_config_naming_no_change_log_keeps_managed_consumers_beside_it_and_may_ask_for_a_json_log() {
    let (backend, _echo) = echo_backend();
    let dir = temp_dir("implied-log");
    std::fs::write(dir.join("admin.token"), "node-secret\n").expect("token");
    let file = dir.join("node.yaml");
    std::fs::write(&file, managed_node(backend, "")).expect("write");
    let tg = |args: &[&str]| consumers_cli(&file, args);
    let mut gw = Gateway::start(&file);
    assert!(tg(&["add", "bob", "--plan", "gold"]).0);
    let (ok, key, _) = tg(&["key", "bob"]);
    assert!(ok && key.starts_with("tg_"), "{key}");
    assert_eq!(gw.get(&format!("/a/?apikey={key}")), 200);
    gw.signal("-TERM");
    gw.wait_for("all connections drained");
    assert!(gw.child.wait().expect("wait").success());
    // Kept beside the config file, under its name, and brought back by the next start.
    assert!(dir.join("node.consumers.changes").is_file());
    let gw = Gateway::start(&file);
    assert_eq!(gw.get(&format!("/a/?apikey={key}")), 200);
    gw.signal("-TERM");
    drop(gw);

    // The file may ask for a JSON process log; `--log-format` would win over it.
    let yaml = std::fs::read_to_string(&file).expect("config");
    std::fs::write(&file, format!("{yaml}log: {{format: json}}\n")).expect("write");
    let mut run = Command::new(BIN)
        .args(["run", "--config"])
        .arg(&file)
        .env_remove("TOLLGATE_LOG_FORMAT")
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let stderr = run.stderr.take().expect("stderr");
    let first = BufReader::new(stderr)
        .lines()
        .next()
        .expect("a log line")
        .expect("read");
    let _ = run.kill();
    let _ = run.wait();
    let line: serde_json::Value = serde_json::from_str(&first).expect("a JSON line");
    assert!(line["fields"]["message"].is_string(), "{first}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_process_log_reader_that_goes_away_does_not_stop_the_gateway() {
    let (backend, _echo) = echo_backend();
    let dir = temp_dir("gone-reader");
    let file = dir.join("tollgate.yaml");
    std::fs::write(&file, config(backend, "a")).expect("write");
    for format in ["text", "json"] {
        let mut child = Command::new(BIN)
            .args(["run", "--log-format", format, "--config"])
            .arg(&file)
            .env("RUST_LOG", "info")
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn");
        let stderr = child.stderr.take().expect("stderr");
        let mut lines = BufReader::new(stderr).lines();
        let line = lines
            .by_ref()
            .map_while(Result::ok)
            .find(|l| l.contains("listening on http://"))
            .expect("a listening line");
        let addr = line
            .rsplit("http://")
            .next()
            .and_then(|a| a.split(|c: char| c.is_whitespace() || c == '"').next())
            .expect("addr")
            .to_string();
        // The log's reader is gone: every later line fails to be written.
        drop(lines);
        let kill = |sig: &str| {
            let ok = Command::new("kill")
                .args([sig, &child.id().to_string()])
                .status()
                .is_ok_and(|s| s.success());
            assert!(ok, "{format}: kill {sig}");
        };
        std::fs::write(&file, config(backend, "b")).expect("write");
        kill("-HUP");
        let addr: SocketAddr = addr.parse().expect("listen address");
        let deadline = std::time::Instant::now() + WAIT;
        while try_get(addr, "/b/?apikey=t1").ok() != Some(200) {
            assert!(
                std::time::Instant::now() < deadline,
                "{format}: the reload was not served"
            );
            std::thread::yield_now();
        }
        // The drain logs too, to the closed pipe; the process ends as asked.
        kill("-TERM");
        let status = child.wait().expect("wait");
        assert!(status.success(), "{format}: {status}");
        std::fs::write(&file, config(backend, "a")).expect("write");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_change_log_in_a_folder_not_made_yet_is_warned_of_at_start() {
    let (backend, _echo) = echo_backend();
    let dir = temp_dir("log-folder");
    std::fs::write(dir.join("admin.token"), "cli-secret\n").expect("token");
    let file = dir.join("tollgate.yaml");
    std::fs::write(
        &file,
        managed_node(backend, "consumers_log: not-made/consumers.changes\n"),
    )
    .expect("write");
    let mut child = Command::new(BIN)
        .args(["run", "--config"])
        .arg(&file)
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let stderr = child.stderr.take().expect("stderr");
    // What it says up to where it listens.
    let said: Vec<String> = BufReader::new(stderr)
        .lines()
        .map_while(Result::ok)
        .take_while(|l| !l.contains("listening on http://"))
        .collect();
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        said.iter()
            .any(|l| l.contains("WARN") && l.contains("consumers_log does not exist")),
        "{said:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_node_starts_without_a_plan_its_managed_consumers_are_on_and_refuses_them_until_mended() {
    let (backend, _echo) = echo_backend();
    let dir = temp_dir("plan-gone");
    let _ = std::fs::remove_file(dir.join("consumers.changes"));
    std::fs::write(dir.join("admin.token"), "cli-secret\n").expect("token");
    let file = dir.join("tollgate.yaml");
    let yaml = managed_node(backend, "consumers_log: consumers.changes\n");
    std::fs::write(&file, &yaml).expect("write");
    let tg = |args: &[&str]| consumers_cli(&file, args);
    let mut gw = Gateway::start(&file);
    let (ok, _, err) = tg(&["add", "bob", "--plan", "gold"]);
    assert!(ok, "{err}");
    let (ok, key, err) = tg(&["key", "bob"]);
    assert!(ok, "{err}");
    assert_eq!(gw.get(&format!("/a/?apikey={key}")), 200);
    gw.signal("-TERM");
    assert!(gw.child.wait().expect("wait").success());
    // The plan leaves the config while the node is stopped: it starts, says so, and
    // refuses bob rather than serve him without the plan's limits.
    let without = yaml.replace(
        "plans: {gold: {limits: [{requests: 100, per: 1m}]}}\n",
        "plans: {silver: {limits: [{requests: 10, per: 1m}]}}\n",
    );
    assert_ne!(without, yaml);
    std::fs::write(&file, &without).expect("write");
    let mut gw = Gateway::start(&file);
    assert_eq!(gw.get(&format!("/a/?apikey={key}")), 503);
    assert_eq!(gw.get("/a/?apikey=t1"), 200);
    // A reload that still lacks it is taken (it may bring renewed certificates).
    std::fs::write(&file, format!("{without}# changed\n")).expect("write");
    gw.signal("-HUP");
    gw.wait_for("config reloaded");
    assert_eq!(gw.get(&format!("/a/?apikey={key}")), 503);
    // The way out the warning names works on the running node.
    let (ok, _, err) = tg(&["add", "bob", "--plan", "silver"]);
    assert!(ok, "{err}");
    assert_eq!(gw.get(&format!("/a/?apikey={key}")), 200);
    gw.signal("-TERM");
    assert!(gw.child.wait().expect("wait").success());
    let _ = std::fs::remove_dir_all(&dir);
}
