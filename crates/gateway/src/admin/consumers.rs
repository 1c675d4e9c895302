//! `/consumers`: the consumers the gateway knows, and changes to them at runtime. A change
//! is written to the change log, then applied: the next request sees it. Keys are stored
//! as SHA-256 digests only; a key the gateway makes is shown once, in the answer that made it.
//!
//! - `GET /consumers?after=NAME&limit=N`: consumers managed here, by name, then (on the
//!   first page only, `listed`) how many the config lists
//! - `GET|PUT|DELETE /consumers/{name}`
//! - `POST /consumers/{name}/keys`, `DELETE /consumers/{name}/keys/{id}`

use super::answer::{error, json, takes_none, Answer};
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

/// A path segment percent-decoded; it keeps `+` (only a query reads it as a space).
pub(super) fn segment(p: &str) -> String {
    crate::query::percent_decode(&p.replace('+', "%2B")).into_owned()
}

/// Serves one request under `/consumers`. `path` is what follows `/consumers`.
pub async fn handle(gw: &Arc<Gateway>, req: Request<Incoming>, path: &str) -> Answer {
    let snap = gw.snapshot();
    // Segments are percent-decoded: `x%2Fy` names `x/y` (refused), never a path.
    let decoded: Vec<String> = path
        .trim_start_matches('/')
        .split('/')
        .map(segment)
        .collect();
    let parts: Vec<&str> = decoded.iter().map(String::as_str).collect();
    let method = req.method().clone();
    // Only the list reads parameters: on a consumer or a key, one given is a mistake, and
    // a `DELETE …?dry_run=true` must not delete.
    if parts != [""] {
        if let Some(bad) = takes_none("/consumers/{name}", req.uri().query()) {
            return error(StatusCode::BAD_REQUEST, &bad);
        }
    }
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

/// A managed consumer's record as the API shows it (`listed`: the config lists it too;
/// `config_keys: false` when its deletion revoked the config's keys for good).
fn managed_view(m: &Managed, listed: bool) -> Value {
    let mut v = j!({
        "name": m.name,
        "plan": m.plan,
        "source": if listed { "config+api" } else { "api" },
        "keys": m.keys,
        "metadata": m.metadata,
    });
    if listed && m.without_config_keys {
        v["config_keys"] = Value::Bool(false);
    }
    v
}

/// The consumer `name` as the API shows it: where it comes from, its plan, its keys made
/// here (digests), its metadata.
fn view(snap: &Snapshot, name: &str) -> Option<Value> {
    let listed = snap.config.consumers.find(name);
    match snap.roster.get(name) {
        Some(m) if m.deleted => None,
        Some(m) => Some(managed_view(&m, listed.is_some())),
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

/// Longest plain key `PUT` takes.
const MAX_KEY_BYTES: usize = 1024;

/// Whether `k` may be a key: what a header or a query parameter carries as it is.
fn valid_key(k: &str) -> bool {
    (1..=MAX_KEY_BYTES).contains(&k.len()) && k.bytes().all(|b| b.is_ascii_graphic())
}

fn list(snap: &Snapshot, query: Option<&str>) -> Answer {
    let mut after = None;
    let mut limit = 100;
    let mut deleted = false;
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        match k {
            "after" => after = Some(crate::query::percent_decode(v).into_owned()),
            "deleted" => match v {
                "true" => deleted = true,
                "false" => deleted = false,
                _ => return error(StatusCode::BAD_REQUEST, "deleted must be true or false"),
            },
            "limit" => match v.parse::<usize>() {
                Ok(n) if (1..=MAX_PAGE).contains(&n) => limit = n,
                _ => {
                    return error(
                        StatusCode::BAD_REQUEST,
                        &format!("limit must be 1 to {MAX_PAGE}"),
                    )
                }
            },
            other => {
                return error(
                    StatusCode::BAD_REQUEST,
                    &format!(
                        "unknown query parameter {:?}: /consumers takes after, limit and deleted",
                        crate::query::percent_decode(other)
                    ),
                )
            }
        }
    }
    let page = snap.roster.page(after.as_deref(), limit + 1, deleted);
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
    let body = super::answer::read_body(req, 256 * 1024, "256KiB").await?;
    if body.is_empty() {
        return Ok(j!({}));
    }
    super::strict::parse(&body).map_err(|e| bad(&format!("the body is not JSON: {e}")))
}

/// Why a change was not made.
enum Refused {
    NotFound,
    Bad(String),
    Conflict(String),
    Roster(RosterError),
}

impl From<RosterError> for Refused {
    fn from(e: RosterError) -> Self {
        match e {
            RosterError::KeyTaken(owner) => {
                Refused::Conflict(format!("a key is taken by consumer {owner:?}"))
            }
            other => Refused::Roster(other),
        }
    }
}

/// What a change needs to know of the config: whether it lists the consumer, and its plan
/// there.
#[derive(Clone)]
struct Listed {
    /// `Some(plan)` when the config lists the consumer.
    plan: Option<Option<String>>,
}

impl Listed {
    fn of(snap: &Snapshot, name: &str) -> Listed {
        let plan = snap.config.consumers.find(name).map(|i| {
            snap.counters
                .plan(i)
                .and_then(|p| snap.config.plans.get(p))
                .map(|p| p.name.clone())
        });
        Listed { plan }
    }

    /// The record a change of `name` starts from: the API's (unless deleted), or one made
    /// for a listed consumer; `None` when neither. A listed consumer put again after its
    /// deletion is made without the config's keys: the deletion revoked them.
    fn start(&self, now: Option<&Managed>, name: &str) -> Option<Managed> {
        if let Some(m) = now.filter(|m| !m.deleted) {
            return Some(m.clone());
        }
        let plan = self.plan.clone()?;
        Some(Managed {
            name: name.to_string(),
            plan,
            keys: Vec::new(),
            metadata: Map::new(),
            deleted: false,
            without_config_keys: now.is_some_and(|m| m.deleted || m.without_config_keys),
            version: 0,
        })
    }
}

/// Makes a change of `name` on a blocking thread (the log is synced to disk), under the
/// roster's lock (`change` sees the record as it is when the change is made).
async fn change<T: Send + 'static>(
    gw: &Arc<Gateway>,
    name: &str,
    change: impl FnOnce(Option<&Managed>) -> Result<(Managed, T), Refused> + Send + 'static,
) -> Result<(Managed, T), Answer> {
    let roster = gw.snapshot().roster.clone();
    let (name, shown) = (name.to_string(), name.to_string());
    let done = tokio::task::spawn_blocking(move || {
        let mut extra = None;
        let r = roster.update(&name, |now| {
            let (m, t) = change(now)?;
            extra = Some(t);
            Ok::<_, Refused>(m)
        });
        r.map(|m| (m, extra))
    })
    .await;
    match done {
        Ok(Ok((m, Some(t)))) => Ok((m, t)),
        Ok(Ok((_, None))) | Err(_) => Err(error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "the change was not made",
        )),
        Ok(Err(Refused::NotFound)) => Err(not_found(&shown)),
        Ok(Err(Refused::Bad(why))) => Err(error(StatusCode::BAD_REQUEST, &why)),
        Ok(Err(Refused::Conflict(why))) => Err(error(StatusCode::CONFLICT, &why)),
        Ok(Err(Refused::Roster(e))) => Err(error(StatusCode::SERVICE_UNAVAILABLE, &e.to_string())),
    }
}

/// `PUT /consumers/{name}` `{"plan": …, "key_sha256": [...], "metadata": {...}}`: makes the
/// consumer or changes it. A field left out keeps what the consumer had.
async fn put(gw: &Arc<Gateway>, snap: &Snapshot, name: &str, body: Value) -> Answer {
    let bad = |why: String| error(StatusCode::BAD_REQUEST, &why);
    if !valid_name(name) {
        return bad(format!(
            "{name:?} is not a consumer name: 1 to 256 visible ASCII characters, no quote, backslash or /, and not - (no consumer)"
        ));
    }
    // A new name: no `,` or `;` either, which a backend reading the consumer header as a
    // list would split (as for a token's caller). One the config or the log holds already
    // stays usable.
    let known = snap.config.consumers.find(name).is_some() || snap.roster.get(name).is_some();
    if !known && name.contains([',', ';']) {
        return bad(format!(
            "{name:?} is not a consumer name: a new name holds no , or ; (a backend reading the consumer header as a list would split it)"
        ));
    }
    let Value::Object(fields) = body else {
        return bad("the body must be a JSON object".into());
    };
    for k in fields.keys() {
        if !matches!(
            k.as_str(),
            "name" | "plan" | "keys" | "key_sha256" | "metadata"
        ) {
            return bad(format!(
                "unknown field {k:?}: plan, keys, key_sha256 and metadata may be set"
            ));
        }
    }
    // As Kong's clients send it: the name again, which must be the path's.
    if let Some(n) = fields.get("name") {
        if n.as_str() != Some(name) {
            return bad(format!(
                "name: the body names {n}, the path {name:?}; a consumer is renamed by making the new one and deleting the old"
            ));
        }
    }
    let plan = match fields.get("plan") {
        None => None,
        Some(Value::Null) => Some(None),
        Some(Value::String(p)) if snap.config.plans.iter().any(|plan| plan.name == *p) => {
            Some(Some(p.clone()))
        }
        Some(other) => return bad(format!("plan: no plan {other}")),
    };
    let digests = match fields.get("key_sha256") {
        None => None,
        Some(Value::Array(list)) if list.len() <= MAX_KEYS => {
            let mut out = Vec::with_capacity(list.len());
            for (i, d) in list.iter().enumerate() {
                match d.as_str().and_then(parse_digest) {
                    Some(d) => {
                        let d = hex(&d);
                        // Two of one key would share an id: revoking it would be ambiguous.
                        if let Some(j) = out.iter().position(|o| *o == d) {
                            return bad(format!("key_sha256[{i}] repeats key_sha256[{j}]"));
                        }
                        out.push(d);
                    }
                    None => return bad(format!("key_sha256[{i}] is not 64 hex digits")),
                }
            }
            Some(out)
        }
        Some(Value::Array(_)) => return bad(format!("at most {MAX_KEYS} keys a consumer")),
        Some(_) => return bad("key_sha256 must be a list of 64-hex-digit SHA-256 digests".into()),
    };
    // Where each digest came from, for answers: `key_sha256`'s first, then `keys`'.
    let given_as_digest = digests.as_ref().map_or(0, Vec::len);
    let field_of = move |i: usize| match i.checked_sub(given_as_digest) {
        None => format!("key_sha256[{i}]"),
        Some(k) => format!("keys[{k}]"),
    };
    // Plain keys are taken too, and kept as their SHA-256 only, beside `key_sha256`'s.
    let digests = match fields.get("keys") {
        None => digests,
        Some(Value::Array(list)) => {
            let mut out = digests.unwrap_or_default();
            if out.len() + list.len() > MAX_KEYS {
                return bad(format!("at most {MAX_KEYS} keys a consumer"));
            }
            for (i, k) in list.iter().enumerate() {
                let Some(k) = k.as_str().filter(|k| valid_key(k)) else {
                    return bad(format!(
                        "keys[{i}] is not a key: 1 to {MAX_KEY_BYTES} visible ASCII characters"
                    ));
                };
                let d = hex(&tollgate_config::key_digest(k.as_bytes()));
                if out.contains(&d) {
                    return bad(format!("keys[{i}] is given twice"));
                }
                out.push(d);
            }
            Some(out)
        }
        Some(_) => return bad("keys must be a list of keys".into()),
    };
    let metadata = match fields.get("metadata") {
        None => None,
        Some(v @ Value::Object(m)) if v.to_string().len() <= MAX_METADATA => Some(m.clone()),
        Some(Value::Object(_)) => {
            return bad(format!("metadata: at most {MAX_METADATA} bytes of JSON"))
        }
        Some(_) => return bad("metadata must be a JSON object".into()),
    };
    let listed = Listed::of(snap, name);
    let owned = name.to_string();
    let gw_now = gw.clone();
    let made = change(gw, name, move |now| {
        // The config's keys are checked under the roster's lock, against the config
        // running then: a reload checks the records and swaps under the same lock.
        if let Some(list) = &digests {
            let snap = gw_now.snapshot();
            for (i, d) in list.iter().enumerate() {
                let owner = parse_digest(d).and_then(|d| snap.config.consumers.digest_owner(&d));
                if let Some(o) = owner {
                    let listed = snap.config.consumers.name(o);
                    if listed != owned {
                        return Err(Refused::Conflict(format!(
                            "{}: the config gives this key to consumer {listed:?}",
                            field_of(i)
                        )));
                    }
                }
            }
        }
        let start = listed.start(now, &owned);
        // Made anew: unknown, or deleted (a listed one included) until now.
        let created = start.is_none() || now.is_some_and(|m| m.deleted);
        let mut r = start.unwrap_or_else(|| Managed {
            name: owned.clone(),
            plan: None,
            keys: Vec::new(),
            metadata: Map::new(),
            deleted: false,
            without_config_keys: false,
            version: 0,
        });
        if let Some(p) = plan {
            r.plan = p;
        }
        if let Some(list) = digests {
            // A digest kept from before keeps its id and date.
            r.keys = list
                .into_iter()
                .map(|sha256| match r.keys.iter().find(|k| k.sha256 == sha256) {
                    Some(k) => k.clone(),
                    None => ManagedKey {
                        id: sha256[..12].to_string(),
                        sha256,
                        created: now_secs(),
                    },
                })
                .collect();
        }
        if let Some(m) = metadata {
            r.metadata = m;
        }
        Ok((r, created))
    })
    .await;
    let (record, created) = match made {
        Ok(done) => done,
        Err(a) => return a,
    };
    let status = if created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    // The record as this change made it: a DELETE that came right after it does not turn
    // the answer into a 404.
    let listed = gw.snapshot().config.consumers.find(name).is_some();
    json(status, &managed_view(&record, listed))
}

async fn delete(gw: &Arc<Gateway>, snap: &Snapshot, name: &str) -> Answer {
    let listed = Listed::of(snap, name);
    let owned = name.to_string();
    let done = change(gw, name, move |now| {
        let mut r = listed.start(now, &owned).ok_or(Refused::NotFound)?;
        r.deleted = true;
        r.keys.clear();
        Ok((r, ()))
    })
    .await;
    match done {
        Ok(_) => json(StatusCode::OK, &j!({"deleted": name})),
        Err(a) => a,
    }
}

/// Makes a random key (32 bytes from the system's generator, base64url, `tg_` before it),
/// keeps its digest and answers the key this once.
async fn add_key(gw: &Arc<Gateway>, snap: &Snapshot, name: &str) -> Answer {
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
    let listed = Listed::of(snap, name);
    let (owned, this) = (name.to_string(), made.clone());
    let done = change(gw, name, move |now| {
        let mut r = listed.start(now, &owned).ok_or(Refused::NotFound)?;
        if r.keys.len() >= MAX_KEYS {
            return Err(Refused::Conflict(format!(
                "{owned:?} holds {MAX_KEYS} keys already; revoke one first"
            )));
        }
        r.keys.push(this);
        Ok((r, ()))
    })
    .await;
    match done {
        Ok(_) => json(
            StatusCode::CREATED,
            &j!({"consumer": name, "id": made.id, "key": key, "sha256": made.sha256,
                 "note": "the key is shown this once; the gateway keeps its SHA-256 only"}),
        ),
        Err(a) => a,
    }
}

async fn revoke(gw: &Arc<Gateway>, snap: &Snapshot, name: &str, id: &str) -> Answer {
    let listed = Listed::of(snap, name);
    let (owned, id_owned) = (name.to_string(), id.to_string());
    let done = change(gw, name, move |now| {
        let mut r = listed.start(now, &owned).ok_or(Refused::NotFound)?;
        let before = r.keys.len();
        r.keys.retain(|k| k.id != id_owned);
        if r.keys.len() == before {
            return Err(Refused::Bad(format!(
                "consumer {owned:?} has no key {id_owned:?} made or given through this API"
            )));
        }
        Ok((r, ()))
    })
    .await;
    match done {
        Ok(_) => json(StatusCode::OK, &j!({"consumer": name, "revoked": id})),
        Err(a) if a.status() == StatusCode::BAD_REQUEST => error(
            StatusCode::NOT_FOUND,
            &format!("consumer {name:?} has no key {id:?} made or given through this API"),
        ),
        Err(a) => a,
    }
}
