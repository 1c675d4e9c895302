//! File types → validated [`Config`]. Every problem is collected, none stops the others.

mod jwt;
mod limits;
mod listener;
mod overlap;
mod problems;
mod redis;
mod route;
mod tracing;
mod upstream;

pub(crate) use limits::limits;
pub(crate) use problems::Problems;

use crate::consumers::{Conflict, Consumers};
use crate::error::ConfigError;
use crate::file;
use crate::model::*;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

/// The shortest admin token taken without a warning.
const MIN_TOKEN: usize = 16;

/// Validates `raw`; relative file names in it are read from `base`.
pub(crate) fn validate(
    raw: file::FileConfig,
    base: &Path,
    index_digests: bool,
) -> Result<Config, ConfigError> {
    let mut p = Problems::default();

    let server = ServerConfig {
        drain_timeout: raw
            .server
            .as_ref()
            .and_then(|s| s.drain_timeout)
            .map_or(Duration::from_secs(10), |d| d.0),
        watch_config: raw
            .server
            .as_ref()
            .and_then(|s| s.watch_config)
            .unwrap_or(true),
    };

    let listeners = listener::listeners(&raw.listeners, base, &mut p);
    let (upstreams, upstream_index) = upstream::upstreams(&raw.upstreams, base, &mut p);
    let (plans, plan_index) = plans(&raw.plans, &mut p);
    let (consumers, consumers_file) = consumers(
        &raw.consumers,
        raw.consumers_file.as_deref(),
        base,
        &plan_index,
        index_digests || may_manage_keys(&raw, base),
        &mut p,
    );
    let consumer_index = route::ConsumerNames {
        table: &consumers,
        written: raw.consumers.iter().map(|c| c.name.as_str()).collect(),
    };

    let mut routes = Vec::with_capacity(raw.routes.len());
    let mut names = HashSet::new();
    for (i, r) in raw.routes.iter().enumerate() {
        let at = format!("routes[{i}]");
        if let Some(route) = route::route(
            r,
            &at,
            base,
            &upstream_index,
            &plan_index,
            &consumer_index,
            &mut p,
        ) {
            if !names.insert(route.name.clone()) {
                p.add(
                    format!("{at}.name"),
                    format!(
                        "route name {:?} is used twice; give each route a unique name",
                        route.name
                    ),
                );
            }
            let mtls = route.auth.as_ref().is_some_and(|a| a.mtls);
            // As written: a listener whose certificate or CA failed to load has its own
            // problem, and is not taken for one without `client_ca`.
            if mtls
                && !raw
                    .listeners
                    .iter()
                    .any(|l| l.tls.as_ref().is_some_and(|t| t.client_ca.is_some()))
            {
                p.add(
                    format!("{at}.auth.mtls"),
                    "needs a listener with `tls.client_ca` (client certificates are verified there)",
                );
            }
            routes.push(route);
        }
    }
    overlap::overlaps(&raw.routes, &mut p);
    if routes.is_empty() && raw.routes.is_empty() {
        p.add("routes", "at least one route is required");
    }
    // Most specific first: exact before prefix, longer before shorter, host before none.
    // The sort is stable, so equal routes keep file order.
    routes.sort_by_key(|r| {
        let (exact, len) = match &r.path {
            PathMatch::Exact(s) => (0u8, usize::MAX - s.len()),
            PathMatch::Prefix(s) => (1u8, usize::MAX - s.len()),
        };
        let host = match &r.host {
            Some(HostMatch::Exact(_)) => 0u8,
            Some(HostMatch::Suffix(_)) => 1,
            None => 2,
        };
        (exact, len, host)
    });

    let cluster = raw.cluster.as_ref().map(|c| cluster(c, base, &mut p));
    let admin = raw
        .admin
        .as_ref()
        .and_then(|a| admin(a, &listeners, base, &mut p));

    let cache = cache(raw.cache.as_ref(), &mut p);
    let access_log = raw.access_log.as_ref().map(|a| access_log(a, base, &mut p));
    let analytics = raw.analytics.as_ref().map(|a| analytics(a, base, &mut p));
    let state = raw.state.as_ref().map(|s| state(s, base, &mut p));
    let metrics = MetricsConfig {
        per_consumer: raw.metrics.as_ref().is_some_and(|m| m.per_consumer),
    };
    let tracing = raw.tracing.as_ref().map(|t| tracing::tracing(t, &mut p));
    let consumers_log = match (&raw.consumers_log, &raw.consumers_file) {
        (Some(l), _) if l.trim().is_empty() => {
            p.add("consumers_log", "name the file");
            None
        }
        (Some(l), Some(f)) if same_file(&base.join(l), &base.join(f)) => {
            p.add(
                "consumers_log",
                "names the consumers file: the change log is appended to, so it needs a file of its own",
            );
            None
        }
        _ => log_path(&raw, base),
    };

    if !p.0.is_empty() {
        return Err(ConfigError::Invalid {
            problems: p.0,
            warnings: p.1,
        });
    }
    Ok(Config {
        consumers_log_implied: false,
        log_format: raw.log.as_ref().and_then(|l| l.format),
        cache,
        access_log,
        analytics,
        metrics,
        tracing,
        server,
        listeners,
        upstreams,
        routes,
        consumers: std::sync::Arc::new(consumers),
        consumers_file,
        consumers_log,
        state,
        plans,
        cluster,
        admin,
        warnings: p.1,
    })
}

fn cluster(c: &file::Cluster, base: &Path, p: &mut Problems) -> ClusterConfig {
    let (redis, redis_tls) = redis::redis(&c.redis, base, p);
    let sync_interval = c.sync_interval.map_or(Duration::from_millis(10), |d| d.0);
    if sync_interval < Duration::from_millis(1) || sync_interval > Duration::from_secs(10) {
        p.add("cluster.sync_interval", "must be between 1ms and 10s");
    }
    let on_redis_down = match c.on_redis_down.as_deref() {
        None | Some("open") => RedisDown::Open,
        Some("closed") => RedisDown::Closed,
        Some(other) => {
            p.add(
                "cluster.on_redis_down",
                format!("{other:?} must be \"open\" or \"closed\""),
            );
            RedisDown::Open
        }
    };
    let max_overadmission = match c.max_overadmission.as_deref() {
        None => 0.01,
        Some(s) => match s
            .strip_suffix('%')
            .and_then(|n| n.trim().parse::<f64>().ok())
        {
            Some(v) if (0.0..=50.0).contains(&v) => v / 100.0,
            _ => {
                p.add(
                    "cluster.max_overadmission",
                    format!("{s:?} must be a percentage from 0% to 50%"),
                );
                0.01
            }
        },
    };
    let key_prefix = c.key_prefix.clone().unwrap_or_else(|| "tollgate".into());
    if key_prefix.is_empty() || key_prefix.contains([' ', '{', '}']) {
        p.add(
            "cluster.key_prefix",
            "must be non-empty, without spaces or braces",
        );
    }
    ClusterConfig {
        redis,
        redis_tls,
        sync_interval,
        on_redis_down,
        max_overadmission,
        key_prefix,
    }
}

fn cache(c: Option<&file::Cache>, p: &mut Problems) -> CacheConfig {
    let max_size = c.and_then(|c| c.max_size).map_or(256 << 20, |s| s.0);
    let max_object_size = c.and_then(|c| c.max_object_size).map_or(1 << 20, |s| s.0);
    if max_object_size > max_size {
        p.add(
            "cache.max_object_size",
            "must not be larger than cache.max_size",
        );
    }
    if max_object_size > u64::from(u32::MAX) {
        p.add("cache.max_object_size", "must be at most 4GiB");
    }
    CacheConfig {
        max_size,
        max_object_size,
    }
}

fn access_log(a: &file::AccessLog, base: &Path, p: &mut Problems) -> AccessLogConfig {
    let target = match a.path.trim() {
        "stdout" | "-" => LogTarget::Stdout,
        "" => {
            p.add("access_log.path", "name a file, or `stdout`");
            LogTarget::Stdout
        }
        f => LogTarget::File(base.join(f)),
    };
    let buffer = a.buffer.unwrap_or(65_536);
    if !(1..=1 << 24).contains(&buffer) {
        p.add("access_log.buffer", "must be between 1 and 16777216 lines");
    }
    AccessLogConfig { target, buffer }
}

fn analytics(a: &file::Analytics, base: &Path, p: &mut Problems) -> AnalyticsConfig {
    if a.path.trim().is_empty() {
        p.add("analytics.path", "name the database file");
    }
    let retention = a
        .retention
        .map_or(Duration::from_secs(30 * 86_400), |d| d.0);
    if retention < Duration::from_secs(3600) || retention > Duration::from_secs(3660 * 86_400) {
        p.add("analytics.retention", "must be between 1h and 10 years");
    }
    AnalyticsConfig {
        path: base.join(a.path.trim()),
        retention,
        required: a.required,
    }
}

fn admin(
    a: &file::Admin,
    listeners: &[ListenerConfig],
    base: &Path,
    p: &mut Problems,
) -> Option<AdminConfig> {
    let Ok(address) = a.address.parse::<SocketAddr>() else {
        p.add(
            "admin.address",
            format!("{:?} is not an ip:port address", a.address),
        );
        return None;
    };
    if let Some(i) = listeners.iter().position(|l| {
        l.address.port() == address.port()
            && (l.address.ip() == address.ip()
                || l.address.ip().is_unspecified()
                || address.ip().is_unspecified())
    }) {
        p.add(
            "admin.address",
            format!(
                "{address} clashes with listeners[{i}] ({}); give the admin listener its own port",
                listeners[i].address
            ),
        );
    }
    let token = a.token_file.as_ref().and_then(|f| {
        let path = base.join(f);
        match std::fs::read_to_string(&path) {
            Ok(t)
                if !t.trim().is_empty() && t.trim().bytes().all(|b| (0x21..0x7f).contains(&b)) =>
            {
                Some(t.trim().to_string())
            }
            Ok(_) => {
                p.add(
                    "admin.token_file",
                    format!("{} must hold one token of printable ASCII", path.display()),
                );
                None
            }
            Err(e) => {
                p.add(
                    "admin.token_file",
                    format!("cannot read {}: {e}", path.display()),
                );
                None
            }
        }
    });
    let token = token.or_else(|| {
        let t = std::env::var(ADMIN_TOKEN_ENV).ok()?;
        let t = t.trim();
        if t.is_empty() || !t.bytes().all(|b| (0x21..0x7f).contains(&b)) {
            p.add(
                "admin",
                format!("{ADMIN_TOKEN_ENV} must hold one token of printable ASCII"),
            );
            return None;
        }
        Some(t.to_string())
    });
    if !address.ip().is_loopback() && token.is_none() && a.token_file.is_none() {
        p.add(
            "admin.address",
            format!("{address} is reachable from other machines: set `admin.token_file` (or {ADMIN_TOKEN_ENV}), or listen on 127.0.0.1"),
        );
    }
    // Taken (it is the operator's), but said: a short token can be guessed by trying.
    if let Some(t) = token.as_ref().filter(|t| t.len() < MIN_TOKEN) {
        let at = if a.token_file.is_some() {
            "admin.token_file"
        } else {
            "admin"
        };
        p.warn(
            at,
            format!("the admin token is {} characters long: one of {MIN_TOKEN} or more random ones is not guessed by trying (e.g. `openssl rand -hex 32`)", t.len()),
        );
    }
    let max_connections = a.max_connections.unwrap_or(64);
    if max_connections == 0 {
        p.add("admin.max_connections", "must be at least 1");
    }
    let header_timeout = a.header_timeout.map_or(Duration::from_secs(30), |d| d.0);
    if header_timeout.is_zero() {
        p.add("admin.header_timeout", "must be more than 0");
    }
    Some(AdminConfig {
        address,
        token,
        max_connections,
        header_timeout,
    })
}

fn plans(
    raw: &BTreeMap<String, file::Plan>,
    p: &mut Problems,
) -> (Vec<PlanConfig>, HashMap<String, usize>) {
    let mut out = Vec::new();
    let mut index = HashMap::new();
    for (name, plan) in raw {
        let limits = limits(&plan.limits, &format!("plans.{name}.limits"), p);
        index.insert(name.clone(), out.len());
        out.push(PlanConfig {
            name: name.clone(),
            limits,
        });
    }
    (out, index)
}

/// Whether the admin API may give keys beside this config's: it is on, or nodes share
/// its changes (`cluster:`), or the change log holds some already. Only then are the
/// config's plain keys indexed by digest (one key, one consumer, checked both ways).
fn may_manage_keys(raw: &file::FileConfig, base: &Path) -> bool {
    raw.admin.is_some()
        || raw.cluster.is_some()
        || log_path(raw, base).is_some_and(|l| std::fs::metadata(l).is_ok_and(|m| m.len() > 0))
}

/// The consumer change log's path: `consumers_log`, else `<consumers_file>.changes`.
fn log_path(raw: &file::FileConfig, base: &Path) -> Option<std::path::PathBuf> {
    match (&raw.consumers_log, &raw.consumers_file) {
        (Some(l), _) => Some(base.join(l)),
        (None, Some(f)) => Some(base.join(format!("{f}.changes"))),
        (None, None) => None,
    }
}

/// Inline consumers, then those of `consumers_file`, into one table; a name or key used
/// twice (in either place, plain or hashed) is an error.
fn consumers(
    raw: &[file::Consumer],
    file_name: Option<&str>,
    base: &Path,
    plan_index: &HashMap<String, usize>,
    index_digests: bool,
    p: &mut Problems,
) -> (Consumers, Option<ConsumersFile>) {
    let mut table = Consumers::with_capacity(raw.len(), raw.len());
    // Where each consumer came from: `consumers[i]` inline.
    let mut placed: Vec<usize> = Vec::with_capacity(raw.len());
    // Each name's first consumer, whether or not it was valid, so that a problem in one
    // does not hide that another takes its name.
    let mut named: HashMap<&str, usize> = HashMap::with_capacity(raw.len());
    for (i, c) in raw.iter().enumerate() {
        let at = format!("consumers[{i}]");
        let mut ok = true;
        if let Some(first) = named.get(c.name.as_str()) {
            p.add(
                format!("{at}.name"),
                format!(
                    "consumer {:?} is defined twice (also consumers[{first}])",
                    c.name
                ),
            );
            ok = false;
        } else {
            named.insert(&c.name, i);
        }
        if c.name.is_empty() || HeaderValueCheck::invalid(&c.name) {
            p.add(
                format!("{at}.name"),
                "must be non-empty printable ASCII without spaces (it is sent upstream in a header)",
            );
            ok = false;
        } else if c.name == crate::NO_CONSUMER {
            p.add(
                format!("{at}.name"),
                crate::consumers_file::NO_CONSUMER_TAKEN,
            );
            ok = false;
        }
        if c.keys.is_empty() && c.key_sha256.is_empty() {
            p.add(format!("{at}.keys"), "at least one key is required");
            ok = false;
        }
        for (j, k) in c.keys.iter().enumerate() {
            if k.is_empty() || HeaderValueCheck::invalid(k) {
                p.add(
                    format!("{at}.keys[{j}]"),
                    "must be non-empty printable ASCII",
                );
                ok = false;
            }
        }
        let mut digests = Vec::new();
        for (j, h) in c.key_sha256.iter().enumerate() {
            match crate::consumers_file::parse_digest(h) {
                Some(d) => digests.push(d),
                None => {
                    p.add(
                        format!("{at}.key_sha256[{j}]"),
                        "must be 64 hex digits (the SHA-256 of the key)",
                    );
                    ok = false;
                }
            }
        }
        let plan = c.plan.as_ref().and_then(|name| {
            let found = plan_index.get(name).copied();
            if found.is_none() {
                p.add(format!("{at}.plan"), format!("unknown plan {name:?}"));
            }
            found
        });
        if !ok {
            continue;
        }
        let keys: Vec<&str> = c.keys.iter().map(String::as_str).collect();
        match table.push(&c.name, plan, &keys, &digests) {
            Ok(_) => placed.push(i),
            Err(Conflict::Name(other)) => p.add(
                format!("{at}.name"),
                format!(
                    "consumer {:?} is defined twice (also consumers[{}])",
                    c.name, placed[other]
                ),
            ),
            Err(Conflict::Key { other, at: k }) => {
                let field = if k < keys.len() {
                    format!("{at}.keys[{k}]")
                } else {
                    format!("{at}.key_sha256[{}]", k - keys.len())
                };
                let said = match placed.get(other) {
                    Some(o) => format!("this key is already used by consumers[{o}]"),
                    None => "this key is listed twice for this consumer".to_string(),
                };
                p.add(field, said);
            }
            Err(Conflict::TooLarge) => p.add(at, "too many consumers or keys"),
        }
    }
    let inline = table.len();
    // Each file consumer's line, to place a problem found once all are read.
    let mut file_lines = Vec::new();
    let source = file_name.and_then(|f| {
        let f = f.trim();
        if f.is_empty() {
            p.add("consumers_file", "name the file");
            return None;
        }
        let loaded =
            crate::consumers_file::load(f, base, plan_index, &mut table, inline, &mut p.0)?;
        file_lines = loaded.2;
        if file_lines.is_empty() {
            p.warn("consumers_file", format!("{f} holds no consumer"));
        }
        Some(ConsumersFile {
            path: loaded.0,
            fingerprint: loaded.1,
            consumers: file_lines.len(),
        })
    });
    // Where consumer `i` was given: `consumers[n]`, or the file and its line.
    let place = |i: usize| match i.checked_sub(inline) {
        None => placed.get(i).map(|n| format!("consumers[{n}]")),
        Some(k) => {
            let file = file_name.map(str::trim).unwrap_or_default();
            file_lines.get(k).map(|l| format!("{file}:{l}"))
        }
    };
    for (plain, hashed) in table.digest_plain_keys(index_digests).into_iter().take(20) {
        let other = place(hashed).map_or(String::new(), |at| format!(", at {at}"));
        p.add(
            place(plain).unwrap_or_else(|| "consumers".to_string()),
            format!(
                "a key of consumer {:?} is also given hashed to consumer {:?}{other}",
                table.name(plain),
                table.name(hashed)
            ),
        );
    }
    table.shrink_to_fit();
    (table, source)
}

fn state(s: &file::State, base: &Path, p: &mut Problems) -> StateConfig {
    if s.path.trim().is_empty() {
        p.add("state.path", "name the database file");
    }
    let flush_interval = s.flush_interval.map_or(Duration::from_secs(1), |d| d.0);
    if flush_interval < Duration::from_millis(10) || flush_interval > Duration::from_secs(3600) {
        p.add("state.flush_interval", "must be between 10ms and 1h");
    }
    StateConfig {
        path: base.join(s.path.trim()),
        flush_interval,
    }
}

pub(crate) struct HeaderValueCheck;
impl HeaderValueCheck {
    fn invalid(s: &str) -> bool {
        !s.bytes().all(|b| (0x21..0x7f).contains(&b))
    }
}

#[cfg(test)]
mod tests;

/// Whether two paths name one file: the same text, or (when both exist) the same file
/// once symbolic links and `..` are resolved, or one file under two hard links.
pub fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    // A hard link is one file under two names: the same device and inode.
    let inode = |p: &Path| std::fs::metadata(p).ok().map(|m| (m.dev(), m.ino()));
    a == b
        || matches!((a.canonicalize(), b.canonicalize()), (Ok(x), Ok(y)) if x == y)
        || matches!((inode(a), inode(b)), (Some(x), Some(y)) if x == y)
}
