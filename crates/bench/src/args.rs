//! The options of `tollgate bench`.

use std::path::PathBuf;
use std::time::Duration;

/// Options of `tollgate bench`.
#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// Target URL (http:// or https://host:port/path?query; without a scheme, http://).
    pub url: String,
    /// Total number of requests (default: run for --duration).
    #[arg(short = 'n', long = "requests", conflicts_with = "duration")]
    pub requests: Option<u64>,
    /// How long to run, e.g. 10s, 1m (default 10s).
    #[arg(short = 'd', long, value_parser = parse_duration)]
    pub duration: Option<Duration>,
    /// Concurrent keep-alive connections.
    #[arg(short = 'c', long, default_value_t = 50)]
    pub connections: usize,
    /// Open loop: send this many requests per second on a fixed schedule.
    #[arg(long, value_name = "RPS")]
    pub rate: Option<f64>,
    /// HTTP method.
    #[arg(short = 'm', long, default_value = "GET")]
    pub method: String,
    /// Extra header, 'Name: value' (repeatable).
    #[arg(short = 'H', long = "header", value_name = "HEADER")]
    pub headers: Vec<String>,
    /// Send this file as the request body.
    #[arg(long, value_name = "FILE")]
    pub body: Option<PathBuf>,
    /// Statuses that count as success, e.g. 200,429 (default: any 2xx).
    #[arg(long, value_delimiter = ',', value_name = "CODES")]
    pub expect: Vec<u16>,
    /// Run this long first without recording (connections warm, pools filled).
    #[arg(long, value_parser = parse_duration, value_name = "DURATION")]
    pub warmup: Option<Duration>,
    /// Give up on a response after this long.
    #[arg(long, value_parser = parse_duration, default_value = "30s")]
    pub timeout: Duration,
    /// Worker threads (default: the CPUs this process may run on).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// With https://, accept any certificate (self-signed, another name), as curl's -k.
    #[arg(short = 'k', long)]
    pub insecure: bool,
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    tollgate_config::units::parse_duration(s)
}
