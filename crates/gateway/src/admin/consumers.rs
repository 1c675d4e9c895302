//! `/consumers`: the consumers the gateway knows, and changes to them at runtime. A change
//! is written to the change log, then applied: the next request sees it. Keys are stored
//! as SHA-256 digests only; a key the gateway makes is shown once, in the answer that made it.
//!
//! - `GET /consumers?after=NAME&limit=N`: consumers managed here, by name, then (on the
//!   first page only, `listed`) how many the config lists
//! - `GET|PUT|DELETE /consumers/{name}`
//! - `POST /consumers/{name}/keys`, `DELETE /consumers/{name}/keys/{id}`

use super::answer::{error, json, Answer};
use crate::gateway::Gateway;
use crate::roster::record::{hex, parse_digest, valid_name, Managed, ManagedKey};
use crate::roster::RosterError;
use crate::snapshot::Snapshot;
use http::{Method, Request, StatusCode};
use hyper::body::Incoming;
use serde_json::{json as j, Map, Value};
use std::sync::Arc;

/// Most consumers on one page.
const MAX_PAGE: usize = 1000;
/// Most keys one consumer holds through the API.
const MAX_KEYS: usize = 100;
/// Largest metadata of one consumer, as JSON.
const MAX_METADATA: usize = 16 * 1024;

/// Serves one request under `/consumers`. `path` is what follows `/consumers`.
pub async fn handle(gw: &Arc<Gateway>, req: Request<Incoming>, path: &str) -> Answer {
    let snap = gw.snapshot();
    // Segments are percent-decoded: `x%2Fy` names `x/y` (refused), never a path.
    let decoded: Vec<String> = path
        .trim_start_matches('/')
        .split('/')
        // A path keeps `+` (only a query reads it as a space).
        .map(|p| crate::query::percent_decode(&p.replace('+', "%2B")).into_owned())
        .collect();
    let parts: Vec<&str> = decoded.iter().map(String::as_str).collect();
    let method = req.method().clone();
    match (parts.as_slice(), &method) {
        ([""], &Method::GET | &Method::HEAD) => list(&snap, req.uri().query()),
        ([name], &Method::GET | &Method::HEAD) => match view(&snap, name) {
            Some(v) => json(StatusCode::OK, &v),
            None => not_found(name),
        },
        ([name], &Method::PUT) => {
            let body = match read_json(req).await {
                Ok(v) => v,
                Err(a) => return a,
            };
            put(gw, &snap, name, body).await
        }
        ([name], &Method::DELETE) => delete(gw, &snap, name).await,
        ([name, "keys"], &Method::POST) => add_key(gw, &snap, name).await,
        ([name, "keys", id], &Method::DELETE) => revoke(gw, &snap, name, id).await,
        ([""], _) => allow("GET, HEAD"),
        ([_], _) => allow("GET, HEAD, PUT, DELETE"),
        ([_, "keys"], _) => allow("POST"),
        ([_, "keys", _], _) => allow("DELETE"),
        _ => error(StatusCode::NOT_FOUND, "no such admin endpoint"),
    }
}

fn allow(methods: &'static str) -> Answer {
    let mut r = error(StatusCode::METHOD_NOT_ALLOWED, "method not allowed");
    r.headers_mut()
        .insert(http::header::ALLOW, http::HeaderValue::from_static(methods));
    r
}

fn not_found(name: &str) -> Answer {
    error(StatusCode::NOT_FOUND, &format!("no consumer {name:?}"))
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The consumer `name` as the API shows it: where it comes from, its plan, its keys made
/// here (digests), its metadata.
fn view(snap: &Snapshot, name: &str) -> Option<Value> {
    let listed = snap.config.consumers.find(name);
    match snap.roster.get(name) {
        Some(m) if m.deleted => None,
        Some(m) => Some(j!({
            "name": m.name,
            "plan": m.plan,
            "source": if listed.is_some() { "config+api" } else { "api" },
            "keys": m.keys,
            "metadata": m.metadata,
        })),
        None => {
            let i = listed?;
            let plan = snap.counters.plan(i).and_then(|p| snap.config.plans.get(p));
            Some(j!({
                "name": name,
                "plan": plan.map(|p| p.name.clone()),
                "source": "config",
                "keys": [],
                "metadata": {},
            }))
        }
    }
}

fn list(snap: &Snapshot, query: Option<&str>) -> Answer {
    let mut after = None;
    let mut limit = 100;
    for (k, v) in query
        .unwrap_or("")
        .split('&')
        .filter_map(|p| p.split_once('='))
    {
        match k {
            "after" => after = Some(crate::query::percent_decode(v).into_owned()),
            "limit" => match v.parse::<usize>() {
                Ok(n) if (1..=MAX_PAGE).contains(&n) => limit = n,
                _ => {
                    return error(
                        StatusCode::BAD_REQUEST,
                        &format!("limit must be 1 to {MAX_PAGE}"),
                    )
                }
            },
            _ => {}
        }
    }
    let page = snap.roster.page(after.as_deref(), limit + 1);
    let more = page.len() > limit;
    let shown: Vec<Value> = page
        .iter()
        .take(limit)
        .map(|m| {
            j!({
                "name": m.name,
                "plan": m.plan,
                "deleted": m.deleted,
                "keys": m.keys.len(),
            })
        })
        .collect();
    let next = more
        .then(|| page.get(limit - 1).map(|m| m.name.clone()))
        .flatten();
    json(
        StatusCode::OK,
        &j!({
            "consumers": shown,
            "next": next,
            "listed_in_config": snap.config.consumers.len(),
        }),
    )
}

async fn read_json(req: Request<Incoming>) -> Result<Value, Answer> {
    let bad = |why: &str| error(StatusCode::BAD_REQUEST, why);
    let body =
        http_body_util::BodyExt::collect(http_body_util::Limited::new(req.into_body(), 256 * 1024))
            .await
            .map_err(|_| bad("the body must be JSON of at most 256KiB"))?
            .to_bytes();
    if body.is_empty() {
        return Ok(j!({}));
    }
    serde_json::from_slice(&body).map_err(|e| bad(&format!("the body is not JSON: {e}")))
}

/// Writes `r` on a blocking thread (the log is synced to disk) and answers `ok` with it.
async fn commit(gw: &Arc<Gateway>, r: Managed) -> Result<(), Answer> {
    let roster = gw.snapshot().roster.clone();
    let done = tokio::task::spawn_blocking(move || roster.commit(r)).await;
    match done {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(RosterError::KeyTaken(owner))) => Err(error(
            StatusCode::CONFLICT,
            &format!("a key is taken by consumer {owner:?}"),
        )),
        Ok(Err(e)) => Err(error(StatusCode::SERVICE_UNAVAILABLE, &e.to_string())),
        Err(_) => Err(error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "the change was not made",
        )),
    }
}

/// The record `name` starts from: the API's, or one made for a listed consumer (its plan).
fn base(snap: &Snapshot, name: &str) -> Option<Managed> {
    if let Some(m) = snap.roster.get(name).filter(|m| !m.deleted) {
        return Some((*m).clone());
    }
    let i = snap.config.consumers.find(name)?;
    let plan = snap.counters.plan(i).and_then(|p| snap.config.plans.get(p));
    Some(Managed {
        name: name.to_string(),
        plan: plan.map(|p| p.name.clone()),
        keys: Vec::new(),
        metadata: Map::new(),
        deleted: false,
        version: 0,
    })
}

/// `PUT /consumers/{name}` `{"plan": …, "key_sha256": [...], "metadata": {...}}`: makes the
/// consumer or changes it. A field left out keeps what the consumer had.
async fn put(gw: &Arc<Gateway>, snap: &Snapshot, name: &str, body: Value) -> Answer {
    let bad = |why: String| error(StatusCode::BAD_REQUEST, &why);
    if !valid_name(name) {
        return bad(format!(
            "{name:?} is not a consumer name: 1 to 256 visible ASCII characters, no quote, backslash or /"
        ));
    }
    let Some(fields) = body.as_object() else {
        return bad("the body must be a JSON object".into());
    };
    for k in fields.keys() {
        if !matches!(k.as_str(), "plan" | "key_sha256" | "metadata") {
            return bad(format!(
                "unknown field {k:?}: plan, key_sha256 and metadata may be set"
            ));
        }
    }
    let existing = base(snap, name);
    let created = existing.is_none();
    let mut r = existing.unwrap_or_else(|| Managed {
        name: name.to_string(),
        plan: None,
        keys: Vec::new(),
        metadata: Map::new(),
        deleted: false,
        version: 0,
    });
    match fields.get("plan") {
        None => {}
        Some(Value::Null) => r.plan = None,
        Some(Value::String(p)) if snap.config.plans.iter().any(|plan| plan.name == *p) => {
            r.plan = Some(p.clone())
        }
        Some(other) => return bad(format!("plan: no plan {other}")),
    }
    if let Some(list) = fields.get("key_sha256") {
        let Some(list) = list.as_array() else {
            return bad("key_sha256 must be a list of 64-hex-digit SHA-256 digests".into());
        };
        if list.len() > MAX_KEYS {
            return bad(format!("at most {MAX_KEYS} keys a consumer"));
        }
        let mut keys = Vec::with_capacity(list.len());
        for (i, d) in list.iter().enumerate() {
            let Some(digest) = d.as_str().and_then(parse_digest) else {
                return bad(format!("key_sha256[{i}] is not 64 hex digits"));
            };
            let sha256 = hex(&digest);
            // A digest kept from before keeps its id and date.
            match r.keys.iter().find(|k| k.sha256 == sha256) {
                Some(k) => keys.push(k.clone()),
                None => keys.push(ManagedKey {
                    id: sha256[..12].to_string(),
                    sha256,
                    created: now_secs(),
                }),
            }
        }
        r.keys = keys;
    }
    match fields.get("metadata") {
        None => {}
        Some(v @ Value::Object(m)) if v.to_string().len() <= MAX_METADATA => r.metadata = m.clone(),
        Some(Value::Object(_)) => {
            return bad(format!("metadata: at most {MAX_METADATA} bytes of JSON"))
        }
        Some(_) => return bad("metadata must be a JSON object".into()),
    }
    r.version = snap.roster.next_version();
    if let Err(a) = commit(gw, r).await {
        return a;
    }
    let status = if created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    match view(&gw.snapshot(), name) {
        Some(v) => json(status, &v),
        None => not_found(name),
    }
}

async fn delete(gw: &Arc<Gateway>, snap: &Snapshot, name: &str) -> Answer {
    let Some(mut r) = base(snap, name) else {
        return not_found(name);
    };
    r.deleted = true;
    r.keys.clear();
    r.version = snap.roster.next_version();
    match commit(gw, r).await {
        Ok(()) => json(StatusCode::OK, &j!({"deleted": name})),
        Err(a) => a,
    }
}

/// Makes a random key (32 bytes from the system's generator, base64url, `tg_` before it),
/// keeps its digest and answers the key this once.
async fn add_key(gw: &Arc<Gateway>, snap: &Snapshot, name: &str) -> Answer {
    let Some(mut r) = base(snap, name) else {
        return not_found(name);
    };
    if r.keys.len() >= MAX_KEYS {
        return error(
            StatusCode::CONFLICT,
            &format!("{name:?} holds {MAX_KEYS} keys already; revoke one first"),
        );
    }
    let mut raw = [0u8; 32];
    if ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut raw).is_err() {
        return error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "no random bytes for a key",
        );
    }
    let key = {
        use base64::Engine;
        format!(
            "tg_{}",
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(raw)
        )
    };
    let sha256 = hex(&tollgate_config::key_digest(key.as_bytes()));
    let made = ManagedKey {
        id: sha256[..12].to_string(),
        sha256,
        created: now_secs(),
    };
    r.keys.push(made.clone());
    r.version = snap.roster.next_version();
    match commit(gw, r).await {
        Ok(()) => json(
            StatusCode::CREATED,
            &j!({"consumer": name, "id": made.id, "key": key, "sha256": made.sha256,
                 "note": "the key is shown this once; the gateway keeps its SHA-256 only"}),
        ),
        Err(a) => a,
    }
}

async fn revoke(gw: &Arc<Gateway>, snap: &Snapshot, name: &str, id: &str) -> Answer {
    let Some(mut r) = base(snap, name) else {
        return not_found(name);
    };
    let before = r.keys.len();
    r.keys.retain(|k| k.id != id);
    if r.keys.len() == before {
        return error(
            StatusCode::NOT_FOUND,
            &format!("consumer {name:?} has no key {id:?} made or given through this API"),
        );
    }
    r.version = snap.roster.next_version();
    match commit(gw, r).await {
        Ok(()) => json(StatusCode::OK, &j!({"consumer": name, "revoked": id})),
        Err(a) => a,
    }
}
