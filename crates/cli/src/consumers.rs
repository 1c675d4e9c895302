//! `tollgate consumers list|add|rm|key`: consumers managed at runtime, through the admin API
//! of the node the config names (`admin:`, with its token).

use clap::Subcommand;
use http::Method;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// What to do with consumers.
#[derive(Subcommand)]
pub enum Action {
    /// List the consumers managed through the admin API (the config's own are not listed).
    List {
        /// The YAML config file (its `admin:` names the node).
        #[arg(short, long, value_name = "FILE")]
        config: PathBuf,
        /// Start after this name (the `next` of the page before).
        #[arg(long)]
        after: Option<String>,
        /// List the deleted ones too (a deleted consumer of the config stays refused).
        #[arg(long)]
        deleted: bool,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Add a consumer, or change one: its plan, its metadata.
    Add {
        /// The YAML config file (its `admin:` names the node).
        #[arg(short, long, value_name = "FILE")]
        config: PathBuf,
        /// The consumer's name.
        name: String,
        /// Its plan (`none` for no plan).
        #[arg(long)]
        plan: Option<String>,
        /// Metadata kept with it, a JSON object.
        #[arg(long, value_name = "JSON")]
        metadata: Option<String>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Delete a consumer: its keys are refused from now on, the config's included.
    Rm {
        /// The YAML config file (its `admin:` names the node).
        #[arg(short, long, value_name = "FILE")]
        config: PathBuf,
        /// The consumer's name.
        name: String,
    },
    /// Make a key for a consumer (printed this once), or revoke one (`--revoke ID`).
    Key {
        /// The YAML config file (its `admin:` names the node).
        #[arg(short, long, value_name = "FILE")]
        config: PathBuf,
        /// The consumer's name.
        name: String,
        /// Revoke the key with this id instead.
        #[arg(long, value_name = "ID")]
        revoke: Option<String>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

/// Runs one action.
pub fn run(action: Action) -> ExitCode {
    let (config, method, path, body, json_out) = match action {
        Action::List {
            config,
            after,
            deleted,
            json,
        } => {
            let mut q = Vec::new();
            if let Some(a) = after {
                q.push(format!("after={}", tollgate_config::percent_encode(&a)));
            }
            if deleted {
                q.push("deleted=true".to_string());
            }
            let q = if q.is_empty() {
                String::new()
            } else {
                format!("?{}", q.join("&"))
            };
            (config, Method::GET, format!("/consumers{q}"), None, json)
        }
        Action::Add {
            config,
            name,
            plan,
            metadata,
            json,
        } => {
            let mut body = serde_json::Map::new();
            match plan.as_deref() {
                None => {}
                Some("none") => {
                    body.insert("plan".into(), Value::Null);
                }
                Some(p) => {
                    body.insert("plan".into(), json!(p));
                }
            }
            if let Some(m) = metadata {
                match serde_json::from_str::<Value>(&m) {
                    Ok(v @ Value::Object(_)) => {
                        body.insert("metadata".into(), v);
                    }
                    _ => {
                        eprintln!("tollgate consumers add: --metadata must be a JSON object");
                        return ExitCode::FAILURE;
                    }
                }
            }
            let path = format!("/consumers/{}", tollgate_config::percent_encode(&name));
            (config, Method::PUT, path, Some(Value::Object(body)), json)
        }
        Action::Rm { config, name } => {
            let path = format!("/consumers/{}", tollgate_config::percent_encode(&name));
            (config, Method::DELETE, path, None, false)
        }
        Action::Key {
            config,
            name,
            revoke: None,
            json,
        } => (
            config,
            Method::POST,
            format!("/consumers/{}/keys", tollgate_config::percent_encode(&name)),
            None,
            json,
        ),
        Action::Key {
            config,
            name,
            revoke: Some(id),
            json,
        } => (
            config,
            Method::DELETE,
            format!(
                "/consumers/{}/keys/{}",
                tollgate_config::percent_encode(&name),
                tollgate_config::percent_encode(&id)
            ),
            None,
            json,
        ),
    };
    match call(&config, method, &path, body.as_ref()) {
        Ok(v) => {
            print(&v, json_out);
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("tollgate consumers: {e}");
            ExitCode::FAILURE
        }
    }
}

fn call(config: &Path, method: Method, path: &str, body: Option<&Value>) -> Result<Value, String> {
    let cfg = tollgate_config::from_path(config).map_err(|e| {
        e.problems()
            .iter()
            .map(|p| format!("{}: {p}", config.display()))
            .collect::<Vec<_>>()
            .join("\n")
    })?;
    let admin = cfg.admin.ok_or_else(|| {
        format!(
            "{} has no `admin:`; consumers are managed through a node's admin endpoint",
            config.display()
        )
    })?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the async runtime: {e}"))?;
    rt.block_on(crate::admin::call(&admin, method, path, body))
}

fn print(v: &Value, json: bool) {
    if json {
        println!("{}", serde_json::to_string_pretty(v).unwrap_or_default());
        return;
    }
    if let Some(key) = v.get("key").and_then(Value::as_str) {
        println!("{key}");
        eprintln!(
            "key {} for {}: shown this once; the gateway keeps its SHA-256 only",
            v["id"].as_str().unwrap_or("?"),
            v["consumer"].as_str().unwrap_or("?")
        );
        return;
    }
    if let Some(list) = v.get("consumers").and_then(Value::as_array) {
        for c in list {
            println!("{}", row(c));
        }
        if let Some(next) = v.get("next").and_then(Value::as_str) {
            eprintln!("more: --after {next}");
        } else {
            // The config's own consumers are not listed: say so, so that an empty list
            // does not read as "no consumers".
            let in_config = v["listed_in_config"].as_u64().unwrap_or(0);
            match (list.is_empty(), in_config) {
                (true, 0) => eprintln!(
                    "no consumer is managed through the admin API, and the config lists none"
                ),
                (true, n) => eprintln!(
                    "no consumer is managed through the admin API; the config's own consumers ({n}) are not listed here"
                ),
                (false, 0) => {}
                (false, n) => eprintln!("the config's own consumers ({n}) are not listed here"),
            }
        }
        return;
    }
    // One consumer (as `add` answers): the list's line for it.
    if v.get("name").and_then(Value::as_str).is_some() && v.get("plan").is_some() {
        println!("{}", row(v));
        return;
    }
    println!("{}", serde_json::to_string(v).unwrap_or_default());
}

/// A consumer as one line: name, plan, keys (and `deleted`), tab-separated.
fn row(c: &Value) -> String {
    // A list counts the keys; one consumer's record holds them.
    let keys = c["keys"]
        .as_array()
        .map_or_else(|| c["keys"].to_string(), |k| k.len().to_string());
    format!(
        "{}\tplan={}\tkeys={keys}{}",
        c["name"].as_str().unwrap_or("?"),
        c["plan"].as_str().unwrap_or("-"),
        if c["deleted"] == true {
            "\tdeleted"
        } else {
            ""
        }
    )
}
