//! `cluster.redis:`: one server by URL, as before, or a map naming it (`url`), the
//! sentinels that know the master (`sentinels`, `master_name`) or the nodes of a Redis
//! Cluster (`cluster_nodes`), with the password in a file (`password_file`) and an ACL
//! user (`username`); sentinels that ask for their own password take
//! `sentinel_password_file` (and `sentinel_username`).

use super::problems::Problems;
use crate::model::RedisTarget;
use crate::tls::RedisTls;
use serde_yaml_ng::{Mapping, Value};
use std::path::Path;
use std::sync::Arc;

const AT: &str = "cluster.redis";

/// Validates `cluster.redis`: the target, and the files TLS to it takes (`tls:` as a map).
pub(super) fn redis(
    v: &Value,
    base: &Path,
    p: &mut Problems,
) -> (RedisTarget, Option<Arc<RedisTls>>) {
    let mut files = None;
    let target = target(v, base, &mut files, p);
    (target, files.map(Arc::new))
}

fn target(v: &Value, base: &Path, files: &mut Option<RedisTls>, p: &mut Problems) -> RedisTarget {
    match v {
        Value::String(url) => url_target(url, AT, None, p),
        Value::Mapping(m) => {
            let mut url = None;
            let mut sentinels = Vec::new();
            let mut master_name = None;
            let mut password = None;
            let mut username = None;
            let mut sentinel_password = None;
            let mut sentinel_username = None;
            let mut db = 0;
            let mut db_given = false;
            let mut cluster_nodes = Vec::new();
            let mut tls = None;
            // A list given but wrong has its own problems: "needs one of" would repeat them.
            let mut listed = false;
            for (k, v) in m {
                let key = k.as_str().unwrap_or("?");
                let here = format!("{AT}.{key}");
                match key {
                    "url" => url = Some(text(v, &here, p)),
                    "master_name" => master_name = Some(text(v, &here, p)),
                    // Redis has 16 by default (`databases` raises it): a number past
                    // the server's is refused by it, and logged.
                    "db" => match v.as_i64() {
                        Some(n) if (0..=i64::from(u32::MAX)).contains(&n) => {
                            db = n;
                            db_given = true;
                        }
                        _ => p.add(here, "must be a database number (0 or more)"),
                    },
                    "sentinels" => {
                        listed = true;
                        sentinels = host_ports(v, &here, "sentinel", "10.0.0.1:26379", p);
                    }
                    "password_file" => password = secret(v, base, &here, p),
                    "username" => username = Some(text(v, &here, p)).filter(|u| !u.is_empty()),
                    "sentinel_password_file" => sentinel_password = secret(v, base, &here, p),
                    "sentinel_username" => {
                        sentinel_username = Some(text(v, &here, p)).filter(|u| !u.is_empty())
                    }
                    "tls" => match v {
                        Value::Bool(b) => tls = Some(*b),
                        Value::Mapping(t) => {
                            tls = Some(true);
                            *files = tls_files(t, base, &here, p);
                        }
                        _ => p.add(
                            here,
                            "must be true, false, or a map of `ca_file`, `cert_file` and `key_file`",
                        ),
                    },
                    "cluster_nodes" => {
                        listed = true;
                        cluster_nodes =
                            host_ports(v, &here, "node of the Redis Cluster", "10.0.1.1:6379", p);
                    }
                    other => p.add(
                        here,
                        format!(
                            "unknown setting {other:?}, expected one of `url`, `sentinels`, `master_name`, `cluster_nodes`, `password_file`, `username`, `db`, `tls`, `sentinel_password_file`, `sentinel_username`"
                        ),
                    ),
                }
            }
            let forms = usize::from(url.is_some())
                + usize::from(!sentinels.is_empty())
                + usize::from(!cluster_nodes.is_empty());
            if forms > 1 {
                p.add(
                    AT,
                    "give one of `url`, `sentinels` or `cluster_nodes`, not several",
                );
                return RedisTarget::Url(String::new());
            }
            if sentinels.is_empty() {
                for (given, key) in [
                    (sentinel_password.is_some(), "sentinel_password_file"),
                    (sentinel_username.is_some(), "sentinel_username"),
                ] {
                    if given {
                        p.add(format!("{AT}.{key}"), "goes with `sentinels`");
                    }
                }
            }
            // One server's URL says whether it speaks TLS; `tls:` must agree with it.
            if let (Some(t), Some(u)) = (tls, &url) {
                if t != u.starts_with("rediss://") {
                    p.add(
                        format!("{AT}.tls"),
                        if t {
                            "TLS to one server needs a rediss:// URL"
                        } else {
                            "the URL is rediss:// (TLS)"
                        },
                    );
                }
            }
            if !cluster_nodes.is_empty() {
                if db != 0 {
                    p.add(format!("{AT}.db"), "a Redis Cluster has database 0 only");
                }
                if master_name.is_some() {
                    p.add(
                        format!("{AT}.master_name"),
                        "goes with `sentinels`, not with `cluster_nodes`",
                    );
                }
                return RedisTarget::Cluster {
                    nodes: cluster_nodes,
                    username,
                    password,
                    tls: tls.unwrap_or(false),
                };
            }
            if username.is_some() && url.is_some() {
                p.add(
                    format!("{AT}.username"),
                    "with `url`, write the user in the URL (redis://user@host:port)",
                );
            }
            // At most one form is given by now.
            match (url, sentinels.is_empty()) {
                (Some(u), _) => {
                    if master_name.is_some() {
                        p.add(
                            format!("{AT}.master_name"),
                            "goes with `sentinels`, not with `url`",
                        );
                    }
                    // The URL's path is its database, as the client reads it: a second
                    // place would be one of two, and was once left unread.
                    if db_given {
                        p.add(
                            format!("{AT}.db"),
                            "with `url`, the database is the URL's path (redis://host:6379/2); `db` goes with `sentinels`",
                        );
                    }
                    url_target(&u, &format!("{AT}.url"), password, p)
                }
                (None, false) => {
                    let Some(master_name) = master_name.filter(|n| !n.is_empty()) else {
                        let at = if m.contains_key("master_name") {
                            format!("{AT}.master_name")
                        } else {
                            AT.to_string()
                        };
                        p.add(
                            at,
                            "with `sentinels`, name the master they watch (`master_name`)",
                        );
                        return RedisTarget::Url(String::new());
                    };
                    RedisTarget::Sentinel {
                        sentinels,
                        master_name,
                        username,
                        password,
                        db,
                        sentinel_username,
                        sentinel_password,
                        tls: tls.unwrap_or(false),
                    }
                }
                (None, true) => {
                    if !listed {
                        p.add(
                            AT,
                            "needs `url`, `sentinels` (with `master_name`) or `cluster_nodes`",
                        );
                    }
                    RedisTarget::Url(String::new())
                }
            }
        }
        _ => {
            p.add(
                AT,
                "must be a redis:// URL, or a map with `url`, `sentinels` and `master_name`, or `cluster_nodes`",
            );
            RedisTarget::Url(String::new())
        }
    }
}

/// `tls: {ca_file, cert_file, key_file}`: the CA bundle to trust instead of the system's
/// roots, and the client certificate with its key, each read and checked now.
fn tls_files(t: &Mapping, base: &Path, here: &str, p: &mut Problems) -> Option<RedisTls> {
    let mut out = RedisTls {
        ca_pem: None,
        client: None,
    };
    let (mut cert, mut key) = (None, None);
    let mut ok = true;
    for (k, v) in t {
        let key_name = k.as_str().unwrap_or("?");
        let at = format!("{here}.{key_name}");
        let file = || base.join(v.as_str().unwrap_or_default());
        match key_name {
            "ca_file" => match crate::tls::load_ca(file()) {
                Ok(_) => out.ca_pem = std::fs::read(file()).ok(),
                Err(e) => {
                    p.add(at, e);
                    ok = false;
                }
            },
            "cert_file" => cert = Some((file(), at)),
            "key_file" => key = Some((file(), at)),
            other => {
                p.add(
                    at,
                    format!("unknown setting {other:?}, expected one of `ca_file`, `cert_file`, `key_file`"),
                );
                ok = false;
            }
        }
    }
    match (cert, key) {
        (Some((c, at)), Some((k, _))) => match crate::tls::load_cert(c.clone(), k.clone()) {
            Ok(_) => {
                out.client = std::fs::read(&c).ok().zip(std::fs::read(&k).ok());
            }
            Err(e) => {
                p.add(at, e);
                ok = false;
            }
        },
        (Some((_, at)), None) => {
            p.add(at, "needs `key_file`, the certificate's key");
            ok = false;
        }
        (None, Some((_, at))) => {
            p.add(at, "needs `cert_file`, the certificate it is the key of");
            ok = false;
        }
        (None, None) => {}
    }
    ok.then_some(out)
}

/// The first line of the file `v` names (relative to the config's folder).
fn secret(v: &Value, base: &Path, at: &str, p: &mut Problems) -> Option<String> {
    let f = text(v, at, p);
    match std::fs::read_to_string(base.join(&f)) {
        Ok(s) if s.trim().is_empty() => {
            p.add(
                at,
                format!(
                    "{} is empty: it must hold the password",
                    base.join(&f).display()
                ),
            );
            None
        }
        Ok(s) => Some(s.trim_end_matches(['\n', '\r']).to_string()),
        Err(e) => {
            p.add(at, format!("cannot read {}: {e}", base.join(&f).display()));
            None
        }
    }
}

fn text(v: &Value, at: &str, p: &mut Problems) -> String {
    match v.as_str() {
        Some(s) => s.to_string(),
        None => {
            p.add(at, "must be text");
            String::new()
        }
    }
}

/// A non-empty list of `host:port`, each a `name` (for the errors, with an `example`).
fn host_ports(v: &Value, here: &str, name: &str, example: &str, p: &mut Problems) -> Vec<String> {
    let Some(list) = v.as_sequence().filter(|l| !l.is_empty()) else {
        let given = match v {
            Value::String(s) => format!(" (a list: [{s}], not {s:?})"),
            _ => String::new(),
        };
        p.add(
            here,
            format!("must list at least one {name} as host:port{given}"),
        );
        return Vec::new();
    };
    let mut out = Vec::with_capacity(list.len());
    // Each good address with its place in the list.
    let mut at = Vec::with_capacity(list.len());
    for (i, s) in list.iter().enumerate() {
        let s = text(s, &format!("{here}[{i}]"), p);
        if let Some(j) = out.iter().position(|o| *o == s) {
            p.add(format!("{here}[{i}]"), format!("repeats {here}[{}]", at[j]));
        } else if host_port(&s) {
            out.push(s);
            at.push(i);
        } else {
            p.add(
                format!("{here}[{i}]"),
                format!("{s:?} must be host:port (a {name}, e.g. {example})"),
            );
        }
    }
    out
}

/// `host:port` or `[v6]:port`: no scheme, user, path or space (`redis://h:1` is a URL, not
/// an address the sentinels or the cluster's nodes are asked at).
fn host_port(s: &str) -> bool {
    s.rsplit_once(':').is_some_and(|(h, port)| {
        let plain = !h.is_empty()
            && !h.contains(['/', '@', ' ', '\t'])
            && (!h.contains(':') || (h.starts_with('[') && h.ends_with(']')));
        // `0.0.0.0` or `[::]` is what a server listens on, not an address to connect to.
        let wildcard = h
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_unspecified());
        plain && !wildcard && port.parse::<u16>().is_ok_and(|n| n > 0)
    })
}

/// A `redis://` or `rediss://` URL, with the password from a file put in it when it has
/// none.
fn url_target(url: &str, at: &str, password: Option<String>, p: &mut Problems) -> RedisTarget {
    let shown = crate::redacted_url(url);
    let Some((scheme, rest)) = url
        .split_once("://")
        .filter(|(s, _)| matches!(*s, "redis" | "rediss"))
    else {
        p.add(
            at,
            format!(
                "{shown:?} must be a redis:// or rediss:// URL (e.g. redis://127.0.0.1:6379/0)"
            ),
        );
        return RedisTarget::Url(url.to_string());
    };
    // A password holding one of these, unencoded, moves the host the client reads.
    let encode = "a password holding `#`, `@`, `/` or `?` is written percent-encoded (`%23`, `%40`, `%2F`, `%3F`)";
    // What the Redis client would refuse at every connect, said here with its place.
    match url::Url::parse(url) {
        Err(e) => {
            let hint = if url.contains(['#', '?']) || url.matches('@').count() > 1 {
                format!("; {encode}")
            } else {
                String::new()
            };
            p.add(
                at,
                format!("{shown:?} is not a valid URL ({e}); e.g. redis://127.0.0.1:6379/0{hint}"),
            );
            return RedisTarget::Url(url.to_string());
        }
        // A Redis URL has no fragment: a `#` here is a password's, and what follows it
        // would be dropped (the client would connect to what precedes it).
        Ok(u) if u.fragment().is_some() || rest.matches('@').count() > 1 => {
            p.add(at, format!("{shown:?}: {encode}"));
            return RedisTarget::Url(url.to_string());
        }
        Ok(u) => {
            match u.host() {
                None => p.add(
                    at,
                    format!("{shown:?} names no host; e.g. redis://127.0.0.1:6379/0"),
                ),
                // What a server listens on, not an address to connect to (the client
                // refuses it).
                // (A `redis://` host is opaque to the URL parser: an IPv4 address comes
                // as a name.)
                Some(host) => {
                    let ip = match host {
                        url::Host::Domain(d) => d.parse::<std::net::IpAddr>().ok(),
                        url::Host::Ipv4(ip) => Some(ip.into()),
                        url::Host::Ipv6(ip) => Some(ip.into()),
                    };
                    if let Some(ip) = ip.filter(std::net::IpAddr::is_unspecified) {
                        p.add(at, format!("{shown:?}: {ip} is no address to connect to"));
                    }
                }
            }
            // Read as the client reads it: slashes on either side of the number.
            let db = u.path().trim_matches('/');
            if !db.is_empty() && db.parse::<u32>().is_err() {
                p.add(
                    at,
                    format!("{shown:?}: the path is the database number (`/0`), not {db:?}"),
                );
            }
        }
    }
    let Some(pw) = password else {
        return RedisTarget::Url(url.to_string());
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    let pw = crate::percent_encode(&pw);
    match authority.rsplit_once('@') {
        None => RedisTarget::Url(format!("{scheme}://:{pw}@{rest}")),
        // A user and no password (`redis://user@host`, or `user:@host`): the file's goes in.
        Some((user, _))
            if user
                .split_once(':')
                .is_none_or(|(_, given)| given.is_empty()) =>
        {
            let name = user.split(':').next().unwrap_or("");
            let host = &rest[user.len() + 1..];
            RedisTarget::Url(format!("{scheme}://{name}:{pw}@{host}"))
        }
        Some(_) => {
            p.add(at, "holds a password already; leave out `password_file`");
            RedisTarget::Url(url.to_string())
        }
    }
}
