//! Upstream validation: targets, timeouts, protocol, TLS roots and health checks.

use super::problems::Problems;
use crate::file;
use crate::model::*;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::time::Duration;

pub(super) fn upstreams(
    raw: &BTreeMap<String, file::Upstream>,
    base: &Path,
    p: &mut Problems,
) -> (Vec<UpstreamConfig>, HashMap<String, usize>) {
    let mut out = Vec::new();
    let mut index = HashMap::new();
    for (name, u) in raw {
        let at = format!("upstreams.{name}");
        if u.targets.is_empty() {
            p.add(format!("{at}.targets"), "at least one target is required");
        }
        let (targets, tls) = targets(&u.targets, &at, p);
        let positive = |p: &mut Problems, field: &str, d: Option<crate::units::Dur>, def: u64| {
            let d = d.map_or(Duration::from_millis(def), |d| d.0);
            if d.is_zero() {
                p.add(format!("{at}.{field}"), "must be more than 0");
            }
            d
        };
        let cfg = UpstreamConfig {
            name: name.clone(),
            targets,
            pool_max_idle: u.pool_max_idle.unwrap_or(256),
            connect_timeout: positive(p, "connect_timeout", u.connect_timeout, 5_000),
            response_timeout: positive(p, "response_timeout", u.response_timeout, 60_000),
            idle_timeout: positive(p, "idle_timeout", u.idle_timeout, 30_000),
            read_timeout: positive(p, "read_timeout", u.read_timeout, 60_000),
            max_connections: u.max_connections.unwrap_or(1024),
            tls,
            ca: u.ca_file.as_ref().and_then(|f| {
                crate::tls::load_ca(base.join(f))
                    .map_err(|e| p.add(format!("{at}.ca_file"), e))
                    .ok()
            }),
            protocol: match u.protocol.as_deref() {
                None | Some("http1") | Some("http/1.1") => UpstreamProtocol::Http1,
                Some("h2") | Some("http2") => UpstreamProtocol::H2,
                Some(other) => {
                    p.add(
                        format!("{at}.protocol"),
                        format!("{other:?} is not `http1` or `h2`"),
                    );
                    UpstreamProtocol::Http1
                }
            },
            max_concurrent_streams: u.max_concurrent_streams.unwrap_or(100),
            health: health(u.health.as_ref(), &at, p),
        };
        if !(1..=10_000).contains(&cfg.max_concurrent_streams) {
            p.add(
                format!("{at}.max_concurrent_streams"),
                "must be between 1 and 10000",
            );
        }
        if u.max_concurrent_streams.is_some() && cfg.protocol != UpstreamProtocol::H2 {
            p.warn(
                format!("{at}.max_concurrent_streams"),
                "only used with `protocol: h2`",
            );
        }
        if u.ca_file.is_some() && !cfg.tls {
            p.add(format!("{at}.ca_file"), "only used with https:// targets");
        }
        if cfg.max_connections == 0 {
            p.add(format!("{at}.max_connections"), "must be at least 1");
        }
        index.insert(name.clone(), out.len());
        out.push(cfg);
    }
    (out, index)
}

/// Targets as `host:port` (the scheme removed), and whether they are `https://`. An
/// upstream's targets all use one scheme. A target with a scheme and no port gets the
/// scheme's (`https://api.internal` is `api.internal:443`), as nginx and Kong take it.
fn targets(raw: &[String], at: &str, p: &mut Problems) -> (Vec<String>, bool) {
    let mut out = Vec::with_capacity(raw.len());
    let mut schemes = Vec::with_capacity(raw.len());
    for (j, t) in raw.iter().enumerate() {
        let (https, rest, port) = if let Some(r) = t.strip_prefix("https://") {
            (true, r, Some(443))
        } else if let Some(r) = t.strip_prefix("http://") {
            (false, r, Some(80))
        } else {
            (false, t.as_str(), None)
        };
        let rest = rest.strip_suffix('/').unwrap_or(rest);
        let with_port;
        let rest = match (port, rest.parse::<http::uri::Authority>()) {
            (Some(n), Ok(a)) if a.port_u16().is_none() && a.as_str() == rest => {
                with_port = format!("{rest}:{n}");
                with_port.as_str()
            }
            _ => rest,
        };
        // No user info: it would go upstream in `Host`.
        let ok = rest
            .parse::<http::uri::Authority>()
            .ok()
            .filter(|a| a.port_u16().is_some() && a.as_str() == rest && !rest.contains('@'));
        if ok.as_ref().is_some_and(|a| a.port_u16() == Some(0)) {
            p.add(
                format!("{at}.targets[{j}]"),
                format!("{t:?}: port 0 cannot be connected to"),
            );
        } else if let Some((_, host)) = rest.rsplit_once('@').filter(|_| ok.is_none()) {
            // Shown without what comes before the `@` (a password, most likely).
            p.add(
                format!("{at}.targets[{j}]"),
                format!(
                    "\"<redacted>@{host}\": a target takes no user info (it would go upstream in `Host`); set credentials with the route's headers"
                ),
            );
        } else if ok.is_none() {
            p.add(
                format!("{at}.targets[{j}]"),
                format!(
                    "{t:?} is not a host:port target (e.g. 127.0.0.1:8000 or https://api.internal:8443)"
                ),
            );
        }
        out.push(rest.to_string());
        schemes.push(https);
    }
    let tls = schemes.first().copied().unwrap_or(false);
    if schemes.iter().any(|s| *s != tls) {
        p.add(
            format!("{at}.targets"),
            "mixes http and https targets; give each scheme its own upstream",
        );
    }
    (out, tls)
}

fn health(h: Option<&file::Health>, at: &str, p: &mut Problems) -> HealthConfig {
    let at = format!("{at}.health");
    let d = file::Health::default();
    let h = h.unwrap_or(&d);
    let dur = |p: &mut Problems, field: &str, v: Option<crate::units::Dur>, def: u64| {
        let v = v.map_or(Duration::from_millis(def), |d| d.0);
        if v.is_zero() {
            p.add(format!("{at}.{field}"), "must be more than 0");
        }
        v
    };
    let count = |p: &mut Problems, field: &str, v: Option<u32>, def: u32| {
        let v = v.unwrap_or(def);
        if v == 0 {
            p.add(format!("{at}.{field}"), "must be at least 1");
        }
        v
    };
    let active = h.path.as_ref().map(|path| {
        if !path.starts_with('/') || path.contains(char::is_whitespace) {
            p.add(
                format!("{at}.path"),
                format!("{path:?} is not a path (e.g. /health)"),
            );
        }
        ActiveHealth {
            path: path.clone(),
            interval: dur(p, "interval", h.interval, 5_000),
            timeout: dur(p, "timeout", h.timeout, 2_000),
            healthy: count(p, "healthy", h.healthy, 2),
            unhealthy: count(p, "unhealthy", h.unhealthy, 3),
        }
    });
    if active.is_none() {
        for (field, set) in [
            ("interval", h.interval.is_some()),
            ("timeout", h.timeout.is_some()),
            ("healthy", h.healthy.is_some()),
            ("unhealthy", h.unhealthy.is_some()),
        ] {
            if set {
                p.add(
                    format!("{at}.{field}"),
                    "is for active checks, which need `path`",
                );
            }
        }
    }
    HealthConfig {
        failures: h.failures.unwrap_or(5),
        backoff: dur(p, "backoff", h.backoff, 10_000),
        active,
    }
}
