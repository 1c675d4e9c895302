//! `tollgate usage --config FILE CONSUMER [--history 24h]`.

use std::path::Path;
use std::process::ExitCode;
use tollgate_config::Config;
use tollgate_gateway::analytics::{self, Query, Row, Step};
use tollgate_gateway::usage::{usage, LimitUsage, UsageError};
use tollgate_gateway::Cluster;
use tollgate_gateway::Now;
use tollgate_gateway::{Registry, Snapshot};

/// A single-threaded runtime for one command, or `None` (said on stderr).
fn runtime() -> Option<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| eprintln!("cannot start the async runtime: {e}"))
        .ok()
}

/// The validated config at `path`, or `None` (every problem said on stderr).
fn load(path: &Path) -> Option<Config> {
    tollgate_config::from_path(path)
        .map_err(|e| {
            for p in e.problems() {
                eprintln!("{}: {p}", path.display());
            }
        })
        .ok()
}

/// Runs the command.
pub fn run(path: &Path, consumer: &str, json: bool) -> ExitCode {
    let Some(cfg) = load(path) else {
        return ExitCode::FAILURE;
    };
    let Some(rt) = runtime() else {
        return ExitCode::FAILURE;
    };
    match rt.block_on(fetch(cfg, consumer)) {
        Ok(value) => {
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&value).unwrap_or_default()
                );
            } else {
                print_table(&value);
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("tollgate usage: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn fetch(cfg: Config, consumer: &str) -> Result<serde_json::Value, String> {
    let admin = cfg.admin.clone();
    if let Some(c) = cfg.cluster.clone() {
        // Shared limits: read the counters in Redis directly, no node needed.
        let redis = c.redis.shown();
        let cluster = Cluster::new(c);
        let registry = Registry::new(Some(cluster.clone()));
        let snap = Snapshot::build(cfg, &registry);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
        match usage(&snap, Some(&cluster), consumer, Now { mono: 0, wall: now }).await {
            Ok(u) => return serde_json::to_value(u).map_err(|e| e.to_string()),
            // Not in the file: it may be managed through the admin API, which a node
            // knows of; asked below when the config names one.
            Err(UsageError::UnknownConsumer(_)) if admin.is_some() => {}
            Err(e @ UsageError::Redis(_)) => return Err(format!("{e} (Redis: {redis})")),
            Err(e) => return Err(e.to_string()),
        }
    }
    let Some(admin_cfg) = admin else {
        return Err("this config keeps its counters in the running node; add `admin: {address: 127.0.0.1:9901}` to it and ask that node".into());
    };
    crate::admin::call(
        &admin_cfg,
        http::Method::GET,
        &format!("/usage/{}", tollgate_config::percent_encode(consumer)),
        None,
    )
    .await
}

fn print_table(v: &serde_json::Value) {
    print!("{}", table_text(v));
}

/// The usage as a table. Shared limits are counted in Redis as what the nodes were granted
/// (leased ahead of their requests), not as requests: the column says so.
fn table_text(v: &serde_json::Value) -> String {
    let shared = v["shared"].as_bool().unwrap_or(false);
    let mut out = format!(
        "{} ({})\n",
        v["consumer"].as_str().unwrap_or(""),
        if shared {
            "counted across the cluster, from Redis: tokens granted to the nodes, some of them maybe not yet used by a request"
        } else {
            "counted on this node"
        }
    );
    let limits: Vec<LimitUsage> = serde_json::from_value(v["limits"].clone()).unwrap_or_default();
    if limits.is_empty() {
        out.push_str("  no limits\n");
        return out;
    }
    let counted = if shared { "granted" } else { "used" };
    out.push_str(&format!(
        "  {:<24} {:<16} {:>10} / {:<10} {:>11}\n",
        "limit", "scope", counted, "allowed", "window"
    ));
    for l in limits {
        out.push_str(&format!(
            "  {:<24} {:<16} {:>10} / {:<10} per {:>8}  ({} left)\n",
            l.name,
            l.scope,
            l.used,
            l.requests,
            window(l.window_seconds),
            l.remaining
        ));
    }
    out
}

/// A window as the config writes it: `10s`, `5m`, `1h`, `30d` (the shortest exact form).
fn window(seconds: u64) -> String {
    for (unit, len) in [("d", 86_400), ("h", 3_600), ("m", 60)] {
        if seconds >= len && seconds.is_multiple_of(len) {
            return format!("{}{unit}", seconds / len);
        }
    }
    format!("{seconds}s")
}

/// `tollgate usage CONSUMER --history DURATION`: the consumer's requests per route and
/// status class over that time, from Redis (cluster), the node's admin endpoint, or the
/// analytics database file, in that order of preference.
pub fn history(path: &Path, consumer: &str, ago: &str, json: bool) -> ExitCode {
    // Written as the config writes durations: a whole number and a unit, not zero.
    let d = match tollgate_config::units::parse_duration(ago) {
        Ok(d) if d.as_secs() > 0 => d,
        Ok(_) => {
            eprintln!("tollgate usage: --history {ago:?}: give a time of a second or more, such as 90m, 24h or 7d");
            return ExitCode::FAILURE;
        }
        Err(e) => {
            eprintln!("tollgate usage: --history: {e}");
            return ExitCode::FAILURE;
        }
    };
    let Some(cfg) = load(path) else {
        return ExitCode::FAILURE;
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let from = now.saturating_sub(d.as_secs());
    let q = Query {
        consumer: Some(consumer.to_string()),
        route: None,
        from,
        to: now + 1,
        step: Step::for_range(now - from),
    };
    let Some(rt) = runtime() else {
        return ExitCode::FAILURE;
    };
    match rt.block_on(read_history(&cfg, &q)) {
        Ok((rows, _)) if rows.is_empty() && rt.block_on(unknown(&cfg, consumer)) => {
            eprintln!(
                "tollgate usage: no consumer named {consumer:?} in {}{}, and no history under that name",
                path.display(),
                if cfg.admin.is_some() { " nor on the running node" } else { "" }
            );
            ExitCode::FAILURE
        }
        Ok((rows, source)) => {
            if json {
                let v = serde_json::json!({
                    "consumer": consumer, "source": source, "step": q.step.name(),
                    "from": q.from / q.step.secs() * q.step.secs(), "to": q.to, "rows": rows,
                });
                println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
            } else {
                print_history(consumer, &q, source, &rows);
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("tollgate usage: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Whether `consumer` is surely no consumer: not in the config's table, and not known to
/// the running node (managed through its admin API, or named by a token) when the config
/// names one. A node that cannot be asked may know it: not surely unknown then.
async fn unknown(cfg: &Config, consumer: &str) -> bool {
    if cfg.consumers.find(consumer).is_some() {
        return false;
    }
    match &cfg.admin {
        None => true,
        Some(admin) => {
            let path = format!("/usage/{}", tollgate_config::percent_encode(consumer));
            crate::admin::status_of(admin, &path).await == Some(http::StatusCode::NOT_FOUND)
        }
    }
}

async fn read_history(cfg: &Config, q: &Query) -> Result<(Vec<Row>, &'static str), String> {
    if let Some(c) = &cfg.cluster {
        match analytics::query_redis(c, q).await {
            Ok(rows) => return Ok((rows, "cluster (Redis)")),
            // The node's own history, as its admin endpoint answers then.
            Err(e) => {
                eprintln!(
                    "tollgate usage: Redis ({}) cannot answer ({e}); this node's history only",
                    c.redis.shown()
                )
            }
        }
    }
    let mut tried = None;
    if let Some(admin) = &cfg.admin {
        let path = format!(
            "/analytics?consumer={}&from={}&to={}&step={}",
            tollgate_config::percent_encode(q.consumer.as_deref().unwrap_or("")),
            q.from,
            q.to,
            q.step.name()
        );
        match crate::admin::call(admin, http::Method::GET, &path, None).await {
            Ok(v) => {
                let rows: Vec<Row> = serde_json::from_value(v["rows"].clone())
                    .map_err(|e| format!("unexpected answer from the admin endpoint: {e}"))?;
                return Ok((rows, "the running node"));
            }
            Err(e) => tried = Some(e),
        }
    }
    match &cfg.analytics {
        Some(a) => analytics::query_file(&a.path, q)
            .map(|rows| (rows, "the analytics database"))
            .map_err(|e| e.to_string()),
        None => Err(tried.unwrap_or_else(|| {
            "this config keeps no usage history; add `analytics: {path: …}` to it".into()
        })),
    }
}

fn print_history(consumer: &str, q: &Query, source: &str, rows: &[Row]) {
    println!(
        "{consumer}: requests per {} from {}, from {source}",
        q.step.name(),
        humantime::format_rfc3339_seconds(
            std::time::UNIX_EPOCH + std::time::Duration::from_secs(q.from)
        )
    );
    if rows.is_empty() {
        println!("  no requests in that time");
        return;
    }
    println!(
        "  {:<20} {:<20} {:>8} {:>8} {:>8} {:>8} {:>9}",
        "time (UTC)", "route", "2xx", "3xx", "4xx", "5xx", "total"
    );
    // One line per bucket and route.
    let mut lines: std::collections::BTreeMap<(u64, &str), [u64; 5]> = Default::default();
    for r in rows {
        let digit = r
            .status
            .as_bytes()
            .first()
            .and_then(|c| c.checked_sub(b'0'));
        let class = usize::from(digit.unwrap_or(5)).clamp(1, 5) - 1;
        lines.entry((r.ts, &r.route)).or_default()[class] += r.count;
    }
    let mut total = [0u64; 5];
    for ((ts, route), c) in &lines {
        let time = humantime::format_rfc3339_seconds(
            std::time::UNIX_EPOCH + std::time::Duration::from_secs(*ts),
        )
        .to_string();
        println!(
            "  {:<20} {:<20} {:>8} {:>8} {:>8} {:>8} {:>9}",
            time.trim_end_matches('Z').replace('T', " "),
            route,
            c[1],
            c[2],
            c[3],
            c[4],
            c.iter().sum::<u64>()
        );
        for (t, n) in total.iter_mut().zip(c) {
            *t += n;
        }
    }
    println!(
        "  {:<20} {:<20} {:>8} {:>8} {:>8} {:>8} {:>9}",
        "total",
        "",
        total[1],
        total[2],
        total[3],
        total[4],
        total.iter().sum::<u64>()
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_limits_say_granted_not_used() {
        let limit = serde_json::json!({"name": "burst", "scope": "plan", "requests": 10,
            "window_seconds": 60, "used": 4, "remaining": 6});
        let shared = table_text(&serde_json::json!({"consumer": "alice", "shared": true,
            "limits": [limit.clone()]}));
        assert!(shared.contains("granted / allowed"), "{shared}");
        assert!(!shared.contains("used / allowed"), "{shared}");
        let local = table_text(&serde_json::json!({"consumer": "alice", "shared": false,
            "limits": [limit]}));
        assert!(local.contains("used / allowed"), "{local}");
        assert!(local.contains("         4 / 10"), "{local}");
        assert!(local.contains("per       1m  (6 left)"), "{local}");
    }

    #[test]
    fn windows_read_as_the_config_writes_them() {
        let got: Vec<String> = [1, 10, 60, 90, 3_600, 86_400, 2_592_000]
            .into_iter()
            .map(window)
            .collect();
        assert_eq!(got, ["1s", "10s", "1m", "90s", "1h", "1d", "30d"]);
    }
}
