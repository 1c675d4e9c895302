//! The admin endpoints' answers, each a small JSON document.

use super::answer::{error, json, Answer};
use crate::gateway::Gateway;
use crate::observe::analytics::{History, Query, Step, MAX_BUCKETS};
use crate::usage::{usage as consumer_usage, UsageError};
use http::StatusCode;
use serde_json::{json as j, Value};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// `GET /status`: version, uptime, config generation, the last reload error, and each
/// upstream target's health and connections.
pub fn status(gw: &Gateway) -> Answer {
    let r = gw.reload_status();
    let snap = gw.snapshot();
    let cluster = gw.cluster().map(|c| {
        let server = c.server();
        let mut shown = j!({
            "address": server.address,
            "connected_at": server.connected_at,
            "switched_at": server.switched_at,
        });
        if c.is_cluster_topology() {
            shown["masters"] = j!(server.masters);
            shown["slots_known"] = j!(server.slots);
            shown["partly_down"] = j!(c.is_partly_down());
        }
        j!({
            "redis_up": c.is_up(),
            "redis": c.cfg.redis.shown(),
            "server": shown,
            "nodes": c.nodes(),
            "sync_rounds": c.rounds_done(),
        })
    });
    let analytics = match (snap.config.analytics.as_ref(), gw.analytics()) {
        (None, _) => j!({"enabled": false}),
        (Some(a), Some(an)) => {
            j!({"enabled": true, "path": a.path.display().to_string(), "source": an.source()})
        }
        (Some(a), None) => j!({
            "enabled": false,
            "path": a.path.display().to_string(),
            "error": gw.analytics_error(),
        }),
    };
    let access_log = snap.config.access_log.as_ref().map(|a| match &a.target {
        tollgate_config::LogTarget::Stdout => "stdout".to_string(),
        tollgate_config::LogTarget::File(p) => p.display().to_string(),
    });
    let mut upstreams = BTreeMap::new();
    for r in &snap.routes {
        upstreams
            .entry(r.upstream.cfg.name.clone())
            .or_insert_with(|| {
                r.upstream
                .pool_figures()
                .into_iter()
                .map(|(target, open, idle, healthy)| {
                    j!({"target": target, "healthy": healthy, "connections": open, "idle": idle})
                })
                .collect::<Vec<_>>()
            });
    }
    json(
        StatusCode::OK,
        &j!({
            "version": env!("CARGO_PKG_VERSION"),
            "uptime_seconds": gw.uptime().as_secs(),
            "config": {
                "generation": r.generation,
                "last_reload_error": r.last_error,
                "file": gw.source().map(|p| p.display().to_string()),
            },
            "routes": snap.routes.len(),
            "consumers": snap.config.consumers.len(),
            "managed_consumers": {
                "records": snap.roster.len(),
                "changes_applied": snap.roster.changes(),
                // The file written to: a log named since a start is taken at the next.
                "log": snap.roster.log_path().map(|p| p.display().to_string()),
                "error": snap.roster.broken(),
            },
            "cluster": cluster,
            "analytics": analytics,
            "access_log": access_log,
            "upstreams": upstreams,
        }),
    )
}

/// Replaces what must not leave the node: API keys, the user info and query values of
/// every URL (a Redis password, a key set's or collector's credentials), and the values
/// of the headers sent to the trace collector (where its API key goes).
fn redact(v: &mut Value) {
    if let Some(headers) = v
        .pointer_mut("/tracing/otlp/headers")
        .and_then(Value::as_object_mut)
    {
        for value in headers.values_mut() {
            *value = Value::from("<redacted>");
        }
    }
    if let Some(consumers) = v.get_mut("consumers").and_then(Value::as_array_mut) {
        for c in consumers {
            if let Some(keys) = c.get_mut("keys").and_then(Value::as_array_mut) {
                for k in keys {
                    *k = Value::from("<redacted>");
                }
            }
        }
    }
    redact_urls(v);
}

/// Every string that reads as a URL, anywhere in the tree, without its credentials.
fn redact_urls(v: &mut Value) {
    match v {
        Value::String(s) if s.contains("://") => *s = tollgate_config::redacted_url(s),
        Value::Array(items) => items.iter_mut().for_each(redact_urls),
        Value::Object(fields) => fields.values_mut().for_each(redact_urls),
        _ => {}
    }
}

/// `GET /config`: the running config file as JSON, keys redacted.
pub fn config(gw: &Gateway) -> Answer {
    let Some(text) = gw.running_text() else {
        return error(
            StatusCode::NOT_FOUND,
            "the running config was not read from text",
        );
    };
    let parsed: Result<Value, _> = serde_yaml_ng::from_slice(&text);
    match parsed {
        Ok(mut v) => {
            redact(&mut v);
            let r = gw.reload_status();
            json(
                StatusCode::OK,
                &j!({
                    "generation": r.generation,
                    "file": gw.source().map(|p| p.display().to_string()),
                    "config": v,
                }),
            )
        }
        Err(e) => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            &format!("the running config cannot be shown: {e}"),
        ),
    }
}

/// `POST /reload`: reads the config file again, as `SIGHUP` does.
pub async fn reload(gw: &Arc<Gateway>) -> Answer {
    let Some(path) = gw.source() else {
        return error(
            StatusCode::CONFLICT,
            "the running config did not come from a file; there is nothing to reload",
        );
    };
    let before = gw.reload_status().generation;
    let g = gw.clone();
    let p = path.clone();
    let done = tokio::task::spawn_blocking(move || g.reload_file(&p)).await;
    let after = gw.reload_status().generation;
    match done {
        Ok(Ok(())) => json(
            StatusCode::OK,
            &j!({
                "reloaded": after != before,
                "generation": after,
                "file": path.display().to_string(),
            }),
        ),
        Ok(Err(e)) => json(
            StatusCode::UNPROCESSABLE_ENTITY,
            &j!({
                "status": 422,
                "error": "config rejected; the old config keeps serving",
                "problems": e.problems().iter().map(ToString::to_string).collect::<Vec<_>>(),
                "generation": after,
            }),
        ),
        Err(_) => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "the reload did not finish",
        ),
    }
}

/// `GET /cache`: the cache's figures.
pub fn cache(gw: &Gateway) -> Answer {
    let store = &gw.cache().store;
    let (entries, bytes) = store.usage();
    let m = &store.metrics;
    let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
    json(
        StatusCode::OK,
        &j!({
            "entries": entries,
            "bytes": bytes,
            "hits": n(&m.hits),
            "misses": n(&m.misses),
            "stale": n(&m.stale),
            "revalidated": n(&m.revalidated),
            "coalesced": n(&m.coalesced),
            "waiting": n(&m.waiting),
            "stored": n(&m.stored),
            "evictions": n(&m.evictions),
            "purged": n(&m.purged),
        }),
    )
}

/// `GET /usage/{consumer}`: the consumer's standing in each of its limits.
pub async fn usage(gw: &Gateway, name: &str) -> Answer {
    let snap = gw.snapshot();
    match consumer_usage(&snap, gw.cluster().map(|c| c.as_ref()), name, gw.now()).await {
        Ok(u) => json(
            StatusCode::OK,
            &serde_json::to_value(&u).unwrap_or_default(),
        ),
        Err(e @ UsageError::UnknownConsumer(_)) => error(StatusCode::NOT_FOUND, &e.to_string()),
        Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, &e.to_string()),
    }
}

/// A time given as unix seconds, RFC 3339, or a duration before `now` (`24h`, `-24h`).
fn parse_time(s: &str, now: u64) -> Option<u64> {
    if let Ok(n) = s.parse::<u64>() {
        return Some(n);
    }
    if let Ok(t) = humantime::parse_rfc3339_weak(s) {
        return t
            .duration_since(std::time::UNIX_EPOCH)
            .ok()
            .map(|d| d.as_secs());
    }
    if let Some(t) = with_offset(s) {
        return Some(t);
    }
    let d = humantime::parse_duration(s.strip_prefix('-').unwrap_or(s)).ok()?;
    Some(now.saturating_sub(d.as_secs()))
}

/// An RFC 3339 time with a numeric offset (`2027-01-15T01:00:00+01:00`; a `+` read as a
/// space from a query string is taken as one), in unix seconds.
fn with_offset(s: &str) -> Option<u64> {
    let at = s.len().checked_sub(6)?;
    let (base, offset) = (s.get(..at)?, s.get(at..)?);
    let sign: i64 = match offset.as_bytes()[0] {
        b'+' | b' ' => 1,
        b'-' => -1,
        _ => return None,
    };
    let (h, m) = offset[1..].split_once(':')?;
    let (h, m): (i64, i64) = (h.parse().ok()?, m.parse().ok()?);
    if !(0..24).contains(&h) || !(0..60).contains(&m) || !base.contains('T') {
        return None;
    }
    let local = humantime::parse_rfc3339_weak(base).ok()?;
    let secs = i64::try_from(local.duration_since(std::time::UNIX_EPOCH).ok()?.as_secs()).ok()?;
    u64::try_from(secs - sign * (h * 3600 + m * 60)).ok()
}

/// Reads `consumer`, `route`, `from`, `to` and `step` from a query string.
pub fn parse_query(q: Option<&str>, now: u64) -> Result<Query, String> {
    let mut consumer = None;
    let mut route = None;
    let mut from = None;
    let mut to = None;
    let mut step = None;
    let mut seen: Vec<&str> = Vec::new();
    for pair in q.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let v = crate::policy::auth::percent_decode(v).into_owned();
        if seen.contains(&k) {
            return Err(format!("{k} is given twice"));
        }
        seen.push(k);
        match k {
            "consumer" if !v.is_empty() => consumer = Some(v),
            "route" if !v.is_empty() => route = Some(v),
            "consumer" | "route" => {}
            "from" => {
                from = Some(parse_time(&v, now).ok_or(format!(
                    "from={v:?}: give unix seconds, an RFC 3339 time, or a duration ago like 24h"
                ))?)
            }
            "to" => {
                to = Some(parse_time(&v, now).ok_or(format!(
                    "to={v:?}: give unix seconds, an RFC 3339 time, or a duration ago like 1h"
                ))?)
            }
            "step" => {
                step = Some(Step::parse(&v).ok_or(format!("step={v:?}: must be 1m, 1h or 1d"))?)
            }
            other => {
                return Err(format!(
                    "unknown parameter {other:?}; use consumer, route, from, to, step"
                ))
            }
        }
    }
    // Without `to`, up to now included: the range asked for is `now - from` (`from=6h`
    // is six hours, in minutes).
    let open_end = to.is_none();
    let to = to.unwrap_or(now + 1);
    let from = from.unwrap_or(to.saturating_sub(86_400));
    if from >= to {
        return Err("from must be before to".into());
    }
    let asked = to - from - u64::from(open_end);
    let step = step.unwrap_or_else(|| Step::for_range(asked));
    if (to - from).div_ceil(step.secs()) > MAX_BUCKETS {
        return Err(format!(
            "that range holds more than {MAX_BUCKETS} buckets of {}; use a larger step or a shorter range",
            step.name()
        ));
    }
    Ok(Query {
        consumer,
        route,
        from,
        to,
        step,
    })
}

/// `GET /analytics?consumer=&route=&from=&to=&step=`: counts per bucket, consumer, route
/// and status class.
pub async fn analytics(gw: &Gateway, q: Option<&str>) -> Answer {
    let now = gw.wall_secs();
    let query = match parse_query(q, now) {
        Ok(q) => q,
        Err(why) => return error(StatusCode::BAD_REQUEST, &why),
    };
    let Some(an) = gw.analytics() else {
        return match gw.analytics_error() {
            Some(e) => error(
                StatusCode::SERVICE_UNAVAILABLE,
                &format!("usage history is off: {e}"),
            ),
            None => error(
                StatusCode::NOT_FOUND,
                "usage history is not configured; add `analytics: {path: …}` to the config",
            ),
        };
    };
    match an.query(&query, now).await {
        Ok(History {
            rows,
            source,
            cluster_error,
        }) => {
            let mut totals: BTreeMap<String, u64> = BTreeMap::new();
            for r in &rows {
                *totals.entry(r.status.clone()).or_default() += r.count;
            }
            json(
                StatusCode::OK,
                &j!({
                    "source": source,
                    "cluster_error": cluster_error,
                    "step": query.step.name(),
                    "from": query.from / query.step.secs() * query.step.secs(),
                    "to": query.to,
                    "consumer": query.consumer,
                    "route": query.route,
                    "totals": totals,
                    "rows": rows,
                }),
            )
        }
        Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, &e.to_string()),
    }
}

/// `GET /top`: for the dashboard, the busiest consumers of the last 15 minutes (from the
/// usage history) and the consumers closest to one of their limits on this node.
pub async fn top(gw: &Gateway) -> Answer {
    let now = gw.wall_secs();
    let mut consumers: Vec<(String, u64)> = Vec::new();
    let history = gw.analytics().is_some();
    if let Some(an) = gw.analytics() {
        let q = Query {
            consumer: None,
            route: None,
            from: now.saturating_sub(15 * 60),
            to: now + 1,
            step: Step::Minute,
        };
        if let Ok(History { rows, .. }) = an.query(&q, now).await {
            let mut by: BTreeMap<String, u64> = BTreeMap::new();
            for r in rows.iter().filter(|r| r.consumer != "-") {
                *by.entry(r.consumer.clone()).or_default() += r.count;
            }
            consumers = by.into_iter().collect();
            consumers.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
            consumers.truncate(10);
        }
    }
    let snap = gw.snapshot();
    let t = gw.now();
    let mut quota: Vec<Value> = Vec::new();
    // Bounded work: the counters of at most 10,000 consumers that have called here (a
    // shared limit's count as Redis last gave it, what `/usage` shows as granted).
    for (i, group) in snap.counters.active(10_000, t) {
        let mut best: Option<(f64, &str, u64, u64)> = None;
        for (cell, info) in snap.limits_of(i, &group) {
            if cell.requests() == 0 {
                continue;
            }
            let used = cell.used(t);
            let share = used as f64 / cell.requests() as f64;
            if best.is_none_or(|b| share > b.0) {
                best = Some((share, &info.name, used, cell.requests()));
            }
        }
        if let Some((share, limit, used, requests)) = best {
            if used > 0 {
                quota.push(j!({
                    "consumer": snap.consumer_name(i), "limit": limit, "used": used,
                    "requests": requests, "share": share,
                }));
            }
        }
    }
    quota.sort_by(|a, b| {
        let s = |v: &Value| v["share"].as_f64().unwrap_or(0.0);
        s(b).total_cmp(&s(a))
    });
    // A listed consumer the admin API moved to another plan is counted under two indexes
    // that share the limits both plans hold: named once, where it stands closest.
    let mut named = std::collections::HashSet::new();
    quota.retain(|q| named.insert(q["consumer"].as_str().unwrap_or_default().to_string()));
    quota.truncate(10);
    json(
        StatusCode::OK,
        &j!({
            "history": history,
            "consumers": consumers.iter().map(|(c, n)| j!({"consumer": c, "requests": n})).collect::<Vec<_>>(),
            "closest_to_quota": quota,
        }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn analytics_queries_are_checked() {
        let now = 1_800_000_000;
        let q = parse_query(Some("consumer=c%201&step=1h&from=48h"), now).expect("ok");
        assert_eq!(q.consumer.as_deref(), Some("c 1"));
        assert_eq!(q.step, Step::Hour);
        assert_eq!(q.from, now - 48 * 3600);
        let q = parse_query(None, now).expect("defaults");
        assert_eq!((q.to - q.from, q.step), (86_400, Step::Hour));
        // The default step fits the range asked: minutes up to 6 h, hours up to 14 d.
        for (from, step) in [
            ("6h", Step::Minute),
            ("7h", Step::Hour),
            ("14d", Step::Hour),
            ("15d", Step::Day),
        ] {
            let q = parse_query(Some(&format!("from={from}")), now).expect(from);
            assert_eq!(q.step, step, "{from}");
        }
        for bad in [
            "step=5m",
            "from=yesterday",
            "from=10&to=5",
            "bogus=1",
            "from=0&step=1m",
        ] {
            assert!(parse_query(Some(bad), now).is_err(), "{bad}");
        }
        let q = parse_query(
            Some("from=2027-01-15T00:00:00Z&to=2027-01-16T00:00:00Z"),
            now,
        )
        .expect("rfc3339");
        assert_eq!(q.to - q.from, 86_400);
        // With an offset: the same instants.
        let q2 = parse_query(
            Some("from=2027-01-15T01:00:00%2B01:00&to=2027-01-15T19:00:00-05:00"),
            now,
        )
        .expect("offsets");
        assert_eq!((q2.from, q2.to), (q.from, q.to));
        let q3 = parse_query(
            Some("from=2027-01-15T01:00:00+01:00&to=2027-01-16T00:00:00Z"),
            now,
        )
        .expect("a + read as a space");
        assert_eq!(q3.from, q.from);
        for twice in [
            "step=1h&step=1d",
            "from=1&from=2",
            "consumer=a&consumer=b",
            "consumer=&consumer=b",
        ] {
            let e = parse_query(Some(twice), now).expect_err(twice);
            assert!(e.contains("given twice"), "{e}");
        }
    }

    #[test]
    fn redacts_keys_and_redis_passwords() {
        let mut v = j!({
            "consumers": [{"name": "a", "keys": ["k1", "k2"]}],
            "cluster": {"redis": "redis://:hunter2@10.0.0.1:6379/0"},
            "tracing": {"otlp": {"endpoint": "http://user:pw@collector:4318", "headers": {"x-api-key": "vendor-secret"}}},
            "routes": [{"auth": {"jwt": {"jwks_url": "https://u:jwks-pw@idp.test/keys?token=jwks-token"}}}],
        });
        redact(&mut v);
        let s = v.to_string();
        assert!(!s.contains("k1") && !s.contains("hunter2"), "{s}");
        assert!(!s.contains("vendor-secret"), "{s}");
        assert!(!s.contains("jwks-pw") && !s.contains("jwks-token"), "{s}");
        assert_eq!(
            v["routes"][0]["auth"]["jwt"]["jwks_url"],
            "https://<redacted>@idp.test/keys?token=<redacted>"
        );
        assert!(s.contains("10.0.0.1:6379"), "{s}");
        assert_eq!(v["tracing"]["otlp"]["headers"]["x-api-key"], "<redacted>");
        assert_eq!(
            v["tracing"]["otlp"]["endpoint"],
            "http://<redacted>@collector:4318"
        );
    }
}
