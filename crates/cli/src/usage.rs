//! `tollgate usage --config FILE CONSUMER`.

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use std::path::Path;
use std::process::ExitCode;
use tollgate_config::Config;
use tollgate_gateway::cluster::Cluster;
use tollgate_gateway::limiter::Now;
use tollgate_gateway::snapshot::{Registry, Snapshot};
use tollgate_gateway::usage::{usage, LimitUsage};

/// Runs the command.
pub fn run(path: &Path, consumer: &str, json: bool) -> ExitCode {
    let cfg = match tollgate_config::from_path(path) {
        Ok(c) => c,
        Err(e) => {
            for p in e.problems() {
                eprintln!("{}: {p}", path.display());
            }
            return ExitCode::FAILURE;
        }
    };
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
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
    if let Some(c) = cfg.cluster.clone() {
        // Shared limits: read the counters in Redis directly, no node needed.
        let cluster = Cluster::new(c);
        let registry = Registry::new(Some(cluster.clone()));
        let snap = Snapshot::build(cfg, &registry);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
        let u = usage(&snap, Some(&cluster), consumer, Now { mono: 0, wall: now })
            .await
            .map_err(|e| e.to_string())?;
        return serde_json::to_value(u).map_err(|e| e.to_string());
    }
    let Some(admin_cfg) = cfg.admin else {
        return Err("this config keeps its counters in the running node; add `admin: {address: 127.0.0.1:9901}` to it and ask that node".into());
    };
    let admin = admin_cfg.address;
    let stream = tokio::net::TcpStream::connect(admin).await.map_err(|e| {
        format!("cannot reach the admin endpoint at {admin}: {e} (is the node running?)")
    })?;
    let (mut tx, conn) =
        hyper::client::conn::http1::handshake::<_, Empty<Bytes>>(TokioIo::new(stream))
            .await
            .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let mut req =
        http::Request::get(format!("/usage/{consumer}")).header("host", admin.to_string());
    if let Some(t) = &admin_cfg.token {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    let req = req.body(Empty::new()).map_err(|e| e.to_string())?;
    let resp = tx.send_request(req).await.map_err(|e| e.to_string())?;
    let status = resp.status();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    let value: serde_json::Value = serde_json::from_slice(&body).map_err(|e| e.to_string())?;
    if !status.is_success() {
        return Err(value["error"]
            .as_str()
            .unwrap_or("admin endpoint error")
            .to_string());
    }
    Ok(value)
}

fn print_table(v: &serde_json::Value) {
    let shared = v["shared"].as_bool().unwrap_or(false);
    println!(
        "{} ({})",
        v["consumer"].as_str().unwrap_or(""),
        if shared {
            "counted across the cluster, from Redis"
        } else {
            "counted on this node"
        }
    );
    let limits: Vec<LimitUsage> = serde_json::from_value(v["limits"].clone()).unwrap_or_default();
    if limits.is_empty() {
        println!("  no limits");
    }
    for l in limits {
        println!(
            "  {:<24} {:<16} {:>10} / {:<10} per {:>7}s  ({} left)",
            l.name, l.scope, l.used, l.requests, l.window_seconds, l.remaining
        );
    }
}
