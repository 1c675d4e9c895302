//! `tollgate`: the command line. `run` serves a config, `check` validates one, `echo` is a
//! tiny test backend, `demo` starts a ready example in front of the echo backend.
#![forbid(unsafe_code)]

mod admin;
mod consumers;
mod serve;
mod usage;

/// jemalloc instead of glibc's allocator: glibc kept the memory of closed connections
/// (freed chunks under live ones are never trimmed), so resident memory only grew with each
/// wave of connections. jemalloc's background thread gives unused pages back
/// (docs/benchmarks.md, "Memory").
#[global_allocator]
static ALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

use clap::{Parser, Subcommand};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

/// tollgate: a fast API gateway. Identifies callers by API key, checks what they may call,
/// counts every call against their plan's limits, answers 401/403/405/429 at the edge and
/// forwards the rest over kept-alive connections.
/// The version line: the package version, the commit and the build date.
const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (",
    env!("TOLLGATE_COMMIT"),
    ", built ",
    env!("TOLLGATE_BUILD_DATE"),
    ")"
);

#[derive(Parser)]
#[command(name = "tollgate", version = VERSION, propagate_version = true)]
struct Cli {
    /// How the process log (stderr) is written: `text` for people, `json` (one object a
    /// line) for log shippers. Default: the config's `log: {format: ...}`, else `text`.
    #[arg(long, global = true, value_enum, env = "TOLLGATE_LOG_FORMAT")]
    log_format: Option<serve::LogFormat>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the gateway described by a config file (reloads on SIGHUP and when the file changes).
    #[command(
        after_help = "Environment:\n  RUST_LOG               what the process log shows (default: info,redis=error; e.g. debug, tollgate_gateway=debug)\n  TOLLGATE_ADMIN_TOKEN   the admin token, when admin.token_file is not set\n  TOLLGATE_LOG_FORMAT    text or json, as --log-format"
    )]
    Run {
        /// The YAML config file.
        #[arg(short, long, value_name = "FILE")]
        config: PathBuf,
    },
    /// Validate a config file; print every problem with its place in the file.
    Check {
        /// The YAML config file.
        #[arg(short, long, value_name = "FILE")]
        config: PathBuf,
    },
    /// Run the built-in test backend: 200 with a short JSON body, keep-alive.
    Echo {
        /// Address to listen on.
        #[arg(short, long, value_name = "ADDR", default_value = "127.0.0.1:1337")]
        listen: SocketAddr,
    },
    /// Show a consumer's current usage of each of its limits (from Redis when limits are
    /// shared, otherwise from the running node's admin endpoint).
    Usage {
        /// The YAML config file.
        #[arg(short, long, value_name = "FILE")]
        config: PathBuf,
        /// The consumer's name.
        consumer: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
        /// Show the request history of this long ago to now (e.g. 24h, 7d) instead of
        /// the limits: counts per route and status class, from the usage history.
        #[arg(long, value_name = "DURATION")]
        history: Option<String>,
    },
    /// Manage consumers at runtime through a node's admin API: list, add (or change), rm,
    /// key (make one, or --revoke).
    #[command(subcommand)]
    Consumers(consumers::Action),
    /// Measure an HTTP endpoint: closed loop, or open loop at a fixed rate (--rate).
    Bench(tollgate_bench::BenchArgs),
    /// Start a ready example: the gateway on 127.0.0.1:8080 in front of the echo backend on
    /// 127.0.0.1:1337, with curl lines to try.
    Demo(serve::DemoArgs),
    /// Print a shell completion script: `tollgate completions bash > /etc/bash_completion.d/tollgate`.
    Completions {
        /// The shell.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
}

fn main() -> ExitCode {
    // Purge freed pages in the background, so an idle gateway gives memory back too.
    let _ = tikv_jemalloc_ctl::background_thread::write(true);
    let cli = Cli::parse();
    let log = cli.log_format;
    match cli.command {
        Command::Check { config } => check(&config),
        Command::Run { config } => serve::run(&config, log),
        Command::Echo { listen } => serve::echo(listen, log.unwrap_or(serve::LogFormat::Text)),
        Command::Demo(args) => serve::demo(args, log.unwrap_or(serve::LogFormat::Text)),
        Command::Completions { shell } => {
            let mut cmd = <Cli as clap::CommandFactory>::command();
            // Made whole first: a reader that stops early (`| head`) is no failure.
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut cmd, "tollgate", &mut script);
            let _ = std::io::Write::write_all(&mut std::io::stdout(), &script);
            ExitCode::SUCCESS
        }
        Command::Bench(args) => tollgate_bench::run(args),
        Command::Consumers(action) => consumers::run(action),
        Command::Usage {
            config,
            consumer,
            json,
            history: None,
        } => usage::run(&config, &consumer, json),
        Command::Usage {
            config,
            consumer,
            json,
            history: Some(h),
        } => usage::history(&config, &consumer, &h, json),
    }
}

fn check(path: &std::path::Path) -> ExitCode {
    match tollgate_config::from_path(path) {
        Ok(cfg) => {
            // What a start reads beside the file: the consumer change log, key files.
            let beside = tollgate_gateway::preflight(&cfg);
            for w in cfg.warnings.iter().chain(&beside.warnings) {
                eprintln!("{}: warning: {w}", path.display());
            }
            if !beside.problems.is_empty() {
                for p in &beside.problems {
                    eprintln!("{}: {p}", path.display());
                }
                eprintln!(
                    "{}: {} problem(s); not valid",
                    path.display(),
                    beside.problems.len()
                );
                return ExitCode::FAILURE;
            }
            println!(
                "{}: valid ({} listener(s), {} route(s), {} upstream(s), {} consumer(s), {} plan(s))",
                path.display(),
                cfg.listeners.len(),
                cfg.routes.len(),
                cfg.upstreams.len(),
                cfg.consumers.len(),
                cfg.plans.len()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            let problems = e.problems();
            for p in &problems {
                eprintln!("{}: {p}", path.display());
            }
            for w in e.warnings() {
                eprintln!("{}: warning: {w}", path.display());
            }
            eprintln!(
                "{}: {} problem(s); not valid",
                path.display(),
                problems.len()
            );
            ExitCode::FAILURE
        }
    }
}
