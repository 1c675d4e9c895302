//! The long-running commands: `run`, `echo` and `demo`.

use std::io::Write;
use std::net::SocketAddr;
use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;
use tollgate_config::Config;
use tollgate_gateway::{watch::watch_file, Gateway, Server, SystemClock};

/// The demo's config, also the README's quick start.
const DEMO_CONFIG: &str = include_str!("../../../examples/demo.yaml");

/// How the process log is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Lines for people.
    Text,
    /// One JSON object a line (`timestamp`, `level`, `fields.message`, ...), for log
    /// shippers, as Envoy, Traefik and Caddy offer.
    Json,
}

fn logging(format: LogFormat) {
    // The Redis client warns of every failed reconnection to a cluster node (a few a
    // second while one is down); the gateway logs each kind of failure once itself.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,redis=error"));
    // A log shipper reading stderr may go away: its lines are lost then, and the
    // gateway serves on (the default reports the failed write on stderr itself, which
    // panics on a closed pipe).
    let log = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .log_internal_errors(false)
        .with_target(false);
    match format {
        LogFormat::Json => log.json().init(),
        LogFormat::Text => log
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init(),
    }
}

fn runtime() -> Result<tokio::runtime::Runtime, ExitCode> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| {
            eprintln!("cannot start the async runtime: {e}");
            ExitCode::FAILURE
        })
}

impl From<tollgate_config::LogFormat> for LogFormat {
    fn from(f: tollgate_config::LogFormat) -> Self {
        match f {
            tollgate_config::LogFormat::Text => LogFormat::Text,
            tollgate_config::LogFormat::Json => LogFormat::Json,
        }
    }
}

/// `tollgate run --config FILE`; the log is written as `flag` says, else as the file's
/// `log.format` says, else as text.
pub fn run(path: &Path, flag: Option<LogFormat>) -> ExitCode {
    let read = std::fs::read_to_string(path);
    let log = flag
        .or_else(|| {
            let text = read.as_deref().ok()?;
            tollgate_config::log_format_of(text).map(LogFormat::from)
        })
        .unwrap_or(LogFormat::Text);
    logging(log);
    // Why the node does not start: plain lines, or JSON objects where the log is JSON (a
    // log shipper then reads these too).
    let say = |line: String, warning: bool| match log {
        LogFormat::Json if warning => tracing::warn!("{line}"),
        LogFormat::Json => tracing::error!("{line}"),
        LogFormat::Text => {
            let _ = writeln!(std::io::stderr(), "{line}");
        }
    };
    let text = match read {
        Ok(t) => t,
        Err(e) => {
            say(format!("cannot read {}: {e}", path.display()), false);
            return ExitCode::FAILURE;
        }
    };
    let cfg = match tollgate_config::from_text_of(&text, path) {
        Ok(c) => c,
        Err(e) => {
            for p in e.problems() {
                say(format!("{}: {p}", path.display()), false);
            }
            for w in e.warnings() {
                say(format!("{}: warning: {w}", path.display()), true);
            }
            say(
                format!(
                    "not starting; check the file with `tollgate check --config {}`",
                    path.display()
                ),
                false,
            );
            return ExitCode::FAILURE;
        }
    };
    for w in &cfg.warnings {
        tracing::warn!("{}: {w}", path.display());
    }
    let rt = match runtime() {
        Ok(r) => r,
        Err(c) => return c,
    };
    rt.block_on(serve(cfg, Some(path), text.as_bytes(), None))
}

/// Serves `cfg` (read from `text`, from the file at `path` if any) until SIGTERM or
/// SIGINT; `banner` is printed once every listener is bound.
async fn serve(cfg: Config, path: Option<&Path>, text: &[u8], banner: Option<String>) -> ExitCode {
    let analytics_required = cfg.analytics.as_ref().is_some_and(|a| a.required);
    let bound = match tollgate_gateway::bind(&cfg.listeners).await {
        Ok(b) => b,
        // The demo's addresses are its flags', not a file's.
        Err(e) if banner.is_some() => {
            tracing::error!(
                "cannot listen on {}: {} (is another process using it? give tollgate demo other ports with --listen, --backend and --admin)",
                e.address,
                e.source
            );
            return ExitCode::FAILURE;
        }
        Err(e) => {
            tracing::error!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let admin = cfg.admin.clone();
    // What each listener speaks, for the log line that says where it listens.
    let schemes: Vec<(&str, &str)> = cfg
        .listeners
        .iter()
        .map(|l| match (&l.tls, l.h2c) {
            (Some(_), _) => ("https", " (HTTP/1.1 and HTTP/2)"),
            (None, true) => ("http", " (HTTP/1.1 and h2c)"),
            (None, false) => ("http", ""),
        })
        .collect();
    let gw = Gateway::new(cfg, SystemClock::new());
    if let Some(e) = gw.roster_error().or(gw.state_error().map(str::to_string)) {
        tracing::error!("{e}; not starting");
        return ExitCode::FAILURE;
    }
    // A managed consumer on a plan the config lacks is refused (503) until a change
    // moves it or the config brings the plan: said, and served, since a node that does
    // not start can take neither.
    let missing = gw.missing_plans();
    for p in &missing {
        tracing::warn!("{p}; the consumer is refused (503) until then");
    }
    let clash: Vec<_> = gw
        .config_conflicts()
        .into_iter()
        .filter(|p| !missing.contains(p))
        .collect();
    if !clash.is_empty() {
        for p in &clash {
            tracing::error!("config rejected: {p}");
        }
        tracing::error!(
            "not starting: the config contradicts the consumers managed through the admin API"
        );
        return ExitCode::FAILURE;
    }
    if let (true, Some(e)) = (analytics_required, gw.analytics_error()) {
        tracing::error!("{e}; not starting, since `analytics.required` is true");
        return ExitCode::FAILURE;
    }
    // Token routes start with their issuers' keys (or, past this wait, without them:
    // the fetch goes on and such tokens are refused until it succeeds).
    gw.keys_settled(std::time::Duration::from_secs(10)).await;
    gw.loaded_from(text);
    if let Some(p) = path {
        gw.set_source(p);
    }
    if let Some(admin) = admin {
        let addr = admin.address;
        match tokio::net::TcpListener::bind(addr).await {
            Ok(l) => {
                tracing::info!(
                    "admin endpoints and dashboard on http://{addr}/ (/status, /metrics, /usage/CONSUMER, /analytics, /config, POST /reload, /healthz)"
                );
                tokio::spawn(tollgate_gateway::admin::serve(gw.clone(), l, admin));
            }
            Err(e) if banner.is_some() => {
                tracing::error!(
                    "cannot listen on the admin address {addr}: {e} (is another process using it? give tollgate demo another with --admin)"
                );
                return ExitCode::FAILURE;
            }
            Err(e) => {
                tracing::error!("cannot listen on the admin address {addr}: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    let signals = match Signals::take() {
        Ok(s) => s,
        Err(e) => {
            tracing::error!("cannot listen for signals: {e}; not starting");
            return ExitCode::FAILURE;
        }
    };
    let server = Server::start(gw.clone(), bound);
    // Listeners are bound in the order the config lists them.
    for (a, (scheme, protocols)) in server.local_addrs().iter().zip(&schemes) {
        tracing::info!("listening on {scheme}://{a}{protocols}");
    }
    if let Some(b) = banner {
        // Read by a person, or by a pipe that may close: the demo serves on either way.
        let _ = writeln!(std::io::stdout(), "{b}");
    }
    // The watcher runs whatever the first config says: a reload may turn watching on or
    // off (`server.watch_config`), and the watcher follows the running config.
    let watcher = path.map(|p| {
        watch_file(
            gw.clone(),
            p.to_path_buf(),
            Duration::from_millis(250),
            Duration::from_secs(1),
        )
    });
    wait_for_stop(&gw, path, signals).await;
    if let Some(w) = watcher {
        w.abort();
    }
    // As the running config says now: a reload may have changed it since the start.
    let drain = gw.snapshot().config.server.drain_timeout;
    tracing::info!("shutting down: draining for at most {drain:?}");
    if server.shutdown(drain).await {
        tracing::info!("all connections drained");
    } else {
        tracing::warn!("drain time over; closing the remaining connections");
    }
    gw.flush_all().await;
    ExitCode::SUCCESS
}

/// The signals the gateway answers, taken before it says it listens: a SIGHUP or
/// SIGTERM sent from then on (a reload right after the start) is the gateway's to
/// handle, never the default that ends the process.
struct Signals {
    hup: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
    usr1: tokio::signal::unix::Signal,
}

impl Signals {
    fn take() -> std::io::Result<Signals> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Signals {
            hup: signal(SignalKind::hangup())?,
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
            usr1: signal(SignalKind::user_defined1())?,
        })
    }
}

/// Reloads on SIGHUP, reopens the access log on SIGUSR1; returns on SIGTERM or SIGINT.
async fn wait_for_stop(gw: &std::sync::Arc<Gateway>, path: Option<&Path>, signals: Signals) {
    let Signals {
        mut hup,
        mut term,
        mut int,
        mut usr1,
    } = signals;
    loop {
        tokio::select! {
            _ = usr1.recv() => {
                tracing::info!("SIGUSR1: reopening the access log");
                gw.reopen_logs();
            }
            _ = hup.recv() => match path {
                Some(p) => {
                    tracing::info!("SIGHUP: reloading {}", p.display());
                    // Off the workers: a large consumers file takes a moment to load, and
                    // traffic goes on meanwhile on the old config.
                    let (g, p) = (gw.clone(), p.to_path_buf());
                    let _ = tokio::task::spawn_blocking(move || g.reload_file(&p)).await;
                }
                None => tracing::info!("SIGHUP: no config file to reload"),
            },
            _ = term.recv() => return,
            _ = int.recv() => return,
        }
    }
}

/// `tollgate echo --listen ADDR`.
pub fn echo(addr: SocketAddr, log: LogFormat) -> ExitCode {
    logging(log);
    let rt = match runtime() {
        Ok(r) => r,
        Err(c) => return c,
    };
    rt.block_on(async {
        let listener = match tokio::net::TcpListener::bind(addr).await {
            Ok(l) => l,
            Err(e) => {
                tracing::error!("cannot listen on {addr}: {e}");
                return ExitCode::FAILURE;
            }
        };
        tracing::info!("echo backend on http://{addr}");
        tokio::select! {
            _ = tollgate_gateway::echo::serve(listener) => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        ExitCode::SUCCESS
    })
}

/// `tollgate demo`'s addresses, for when the usual ports are taken.
#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// Where the gateway listens.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// Where the echo backend listens.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:1337")]
    backend: SocketAddr,
    /// Where the admin endpoints and the dashboard listen.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:9901")]
    admin: SocketAddr,
}

/// `tollgate demo`: the embedded example with everything on (access log to stdout, usage
/// history in a temporary file, a cached route), at the addresses asked for.
pub fn demo(args: DemoArgs, log: LogFormat) -> ExitCode {
    logging(log);
    let history = std::env::temp_dir().join(format!("tollgate-demo-{}.db", std::process::id()));
    let text = DEMO_CONFIG
        .replace("127.0.0.1:8080", &args.listen.to_string())
        .replace("127.0.0.1:1337", &args.backend.to_string())
        .replace("127.0.0.1:9901", &args.admin.to_string())
        + &format!(
            "\n# Usage history, in a temporary file for the demo.\nanalytics: {{path: {:?}}}\n",
            history.display().to_string()
        );
    let cfg = match tollgate_config::from_yaml(&text) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("the embedded demo config is invalid: {e}");
            return ExitCode::FAILURE;
        }
    };
    let rt = match runtime() {
        Ok(r) => r,
        Err(c) => return c,
    };
    let code = rt.block_on(async {
        let backend = args.backend;
        let listener = match tokio::net::TcpListener::bind(backend).await {
            Ok(l) => l,
            Err(e) => {
                tracing::error!("cannot start the echo backend on {backend}: {e} (stop whatever uses it, or give --backend ADDR)");
                return ExitCode::FAILURE;
            }
        };
        tokio::spawn(tollgate_gateway::echo::serve(listener));
        let gw = args.listen;
        let admin = args.admin;
        let banner = format!(
            "tollgate demo: gateway on http://{gw} in front of the echo backend on http://{backend}\n\
             Consumer \"demo\" (key demo-key) may make 5 calls per 10 s. Try:\n\
             \x20 curl -i 'http://{gw}/api/hello?apikey=demo-key'     # 200, with RateLimit headers\n\
             \x20 curl -i -H 'X-API-Key: demo-key' http://{gw}/api/hello # 200, key in a header\n\
             \x20 curl -i http://{gw}/api/hello                         # 401, no key\n\
             \x20 curl -i 'http://{gw}/api/hello?apikey=nope'          # 401, unknown key\n\
             \x20 curl -i -X DELETE 'http://{gw}/api/hello?apikey=demo-key' # 405\n\
             \x20 curl -si 'http://{gw}/cached/x?apikey=demo-key' | grep -i cache-status  # twice: the second is a hit\n\
             \x20 for i in 1 2 3 4 5 6; do curl -s -o /dev/null -w '%{{http_code}}\\n' 'http://{gw}/api/hello?apikey=demo-key'; done  # ... 429\n\
             Dashboard, metrics and status: http://{admin}/ (also /metrics, /status, /usage/demo)\n\
             Access log below; usage history in {}. Stop with Ctrl-C.",
            history.display()
        );
        serve(cfg, None, text.as_bytes(), Some(banner)).await
    });
    for f in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{f}", history.display()));
    }
    code
}
