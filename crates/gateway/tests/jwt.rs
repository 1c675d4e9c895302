//! Bearer tokens (JWT) on loopback: a JWKS server the tests run (with OpenID discovery),
//! tokens signed with every algorithm a route may accept, the refusals RFC 6750 names,
//! tokens naming callers the gateway does not list, claims set as headers, key rotation
//! and an issuer that goes down.

mod common;

use bytes::Bytes;
use common::*;
use http::Method;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use jsonwebtoken::jwk::Jwk;
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use parking_lot::Mutex;
use serde_json::{json, Value};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tollgate_gateway::SystemClock;

fn data(name: &str) -> String {
    format!("{}/tests/data/jwt/{name}", env!("CARGO_MANIFEST_DIR"))
}

/// A signing key of the tests: its private key, algorithm and key id.
struct Signer {
    key: EncodingKey,
    alg: Algorithm,
    kid: String,
}

impl Signer {
    fn load(file: &str, alg: Algorithm, kid: &str) -> Signer {
        // Before jsonwebtoken is first used here: the gateway's ring verifier is then the
        // one that checks these tokens.
        tollgate_gateway::install_crypto();
        let pem = std::fs::read(data(file)).expect("test key");
        let key = match alg {
            Algorithm::ES256 | Algorithm::ES384 => EncodingKey::from_ec_pem(&pem),
            Algorithm::EdDSA => EncodingKey::from_ed_pem(&pem),
            _ => EncodingKey::from_rsa_pem(&pem),
        }
        .expect("test key parses");
        Signer {
            key,
            alg,
            kid: kid.to_string(),
        }
    }

    /// Its public half, as a JWKS lists it.
    fn jwk(&self) -> Value {
        let mut jwk = Jwk::from_encoding_key(&self.key, self.alg).expect("jwk");
        jwk.common.key_id = Some(self.kid.clone());
        serde_json::to_value(jwk).expect("jwk json")
    }

    fn sign(&self, claims: &Value) -> String {
        self.sign_with(claims, |_| {})
    }

    /// Signed with a header `shape` changes.
    fn sign_with(&self, claims: &Value, shape: impl FnOnce(&mut Header)) -> String {
        let mut h = Header::new(self.alg);
        h.kid = Some(self.kid.clone());
        shape(&mut h);
        jsonwebtoken::encode(&h, claims, &self.key).expect("sign")
    }
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_secs()
}

/// Claims of a good token for `sub` from `iss`.
fn claims(iss: &str, sub: &str) -> Value {
    json!({"iss": iss, "sub": sub, "aud": ["orders-api"], "exp": now() + 600, "iat": now()})
}

/// What the JWKS server serves.
struct Served {
    jwks: Value,
    fail: bool,
    cache_control: Option<&'static str>,
    /// When set, a key set's fetch is counted as it arrives and answered once a permit
    /// is given.
    hold: Option<Arc<tokio::sync::Semaphore>>,
    /// The `Authorization` of the last key set's fetch.
    authorization: Option<String>,
}

/// An issuer on loopback: OpenID metadata and a JWKS, fetches counted.
struct Issuer {
    url: String,
    served: Arc<Mutex<Served>>,
    fetches: Arc<AtomicUsize>,
    fetched: Arc<Notify>,
}

impl Issuer {
    async fn start(keys: &[&Signer]) -> Issuer {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr: SocketAddr = l.local_addr().expect("addr");
        let url = format!("http://{addr}");
        let served = Arc::new(Mutex::new(Served {
            jwks: json!({"keys": keys.iter().map(|k| k.jwk()).collect::<Vec<_>>()}),
            fail: false,
            cache_control: None,
            hold: None,
            authorization: None,
        }));
        let fetches = Arc::new(AtomicUsize::new(0));
        let fetched = Arc::new(Notify::new());
        let (s, f, n, base) = (
            served.clone(),
            fetches.clone(),
            fetched.clone(),
            url.clone(),
        );
        tokio::spawn(async move {
            loop {
                let Ok((conn, _)) = l.accept().await else {
                    return;
                };
                let (s, f, n, base) = (s.clone(), f.clone(), n.clone(), base.clone());
                tokio::spawn(async move {
                    let svc = service_fn(move |req: hyper::Request<Incoming>| {
                        let (s, f, n, base) = (s.clone(), f.clone(), n.clone(), base.clone());
                        async move {
                            let hold = s.lock().hold.clone();
                            if let (Some(hold), "/jwks") = (hold, req.uri().path()) {
                                f.fetch_add(1, Ordering::SeqCst);
                                n.notify_waiters();
                                let _ = hold.acquire().await.map(|p| p.forget());
                                let served = s.lock();
                                let body = Bytes::from(served.jwks.to_string());
                                return Ok::<_, Infallible>(hyper::Response::new(Full::new(body)));
                            }
                            let mut served = s.lock();
                            if req.uri().path() == "/jwks" {
                                served.authorization = req
                                    .headers()
                                    .get("authorization")
                                    .and_then(|v| v.to_str().ok())
                                    .map(str::to_string);
                            }
                            let mut r = hyper::Response::new(Full::new(Bytes::new()));
                            if served.fail {
                                *r.status_mut() = http::StatusCode::INTERNAL_SERVER_ERROR;
                            } else if req.uri().path() == "/.well-known/openid-configuration" {
                                let meta =
                                    json!({"issuer": base, "jwks_uri": format!("{base}/jwks")});
                                *r.body_mut() = Full::new(Bytes::from(meta.to_string()));
                            } else if req.uri().path() == "/jwks" {
                                *r.body_mut() = Full::new(Bytes::from(served.jwks.to_string()));
                                if let Some(cc) = served.cache_control {
                                    r.headers_mut()
                                        .insert("cache-control", cc.parse().expect("value"));
                                }
                            } else {
                                *r.status_mut() = http::StatusCode::NOT_FOUND;
                            }
                            if req.uri().path() == "/jwks" || served.fail {
                                f.fetch_add(1, Ordering::SeqCst);
                                n.notify_waiters();
                            }
                            Ok::<_, Infallible>(r)
                        }
                    });
                    let _ = http1::Builder::new()
                        .serve_connection(TokioIo::new(conn), svc)
                        .await;
                });
            }
        });
        Issuer {
            url,
            served,
            fetches,
            fetched,
        }
    }

    /// Waits until the set has been asked for `n` times in all.
    async fn fetched(&self, n: usize) {
        bounded("JWKS fetch", async {
            loop {
                let notified = self.fetched.notified();
                if self.fetches.load(Ordering::SeqCst) >= n {
                    return;
                }
                notified.await;
            }
        })
        .await;
    }
}

/// A gateway whose route `/orders/` takes tokens from `issuer` (discovery) and whose
/// backend shows what it received.
async fn gateway(issuer: &Issuer, jwt_extra: &str, rest: &str) -> TestGateway {
    let (backend, _) = inspect_backend().await;
    let yaml = yaml(
        backend,
        &format!(
            r#"plans:
  free: {{limits: [{{requests: 1, per: 1m}}]}}
  gold: {{limits: [{{requests: 2, per: 1m}}]}}
consumers:
  - {{name: alice, keys: [ka]}}
routes:
  - name: orders
    path_prefix: /orders/
    upstream: backend
    auth:
      jwt: {{issuer: "{}", audiences: [orders-api]{jwt_extra}}}
{rest}"#,
            issuer.url
        ),
    );
    TestGateway::start(&yaml, SystemClock::new()).await
}

async fn call(gw: &TestGateway, token: &str) -> Answer {
    let auth = format!("Bearer {token}");
    TestClient::default()
        .request(
            Method::GET,
            &gw.url("/orders/1"),
            &[("authorization", &auth)],
            "",
        )
        .await
}

/// A 401 whose `WWW-Authenticate` says `why`.
fn assert_refused(a: &Answer, why: &str) {
    assert_eq!(a.status, 401, "{}", a.body);
    assert!(challenge(a).contains(why), "{}", challenge(a));
}

fn challenge(a: &Answer) -> String {
    a.headers
        .get_all("www-authenticate")
        .iter()
        .map(|v| v.to_str().expect("ascii").to_string())
        .collect::<Vec<_>>()
        .join(" | ")
}

#[tokio::test]
async fn every_listed_algorithm_verifies_through_discovery() {
    let signers = [
        Signer::load("rsa-a.pem", Algorithm::RS256, "rs256"),
        Signer::load("rsa-a.pem", Algorithm::RS384, "rs384"),
        Signer::load("rsa-a.pem", Algorithm::RS512, "rs512"),
        Signer::load("rsa-b.pem", Algorithm::PS256, "ps256"),
        Signer::load("ec256.pem", Algorithm::ES256, "es256"),
        Signer::load("ec384.pem", Algorithm::ES384, "es384"),
        Signer::load("ed25519.pem", Algorithm::EdDSA, "eddsa"),
    ];
    let issuer = Issuer::start(&signers.iter().collect::<Vec<_>>()).await;
    let gw = gateway(&issuer, "", "").await;
    for s in &signers {
        let a = call(&gw, &s.sign(&claims(&issuer.url, "alice"))).await;
        assert_eq!(a.status, 200, "{:?}: {}", s.alg, a.body);
        // The consumer goes upstream by name; the token does not (forward_token: false).
        assert!(a.body.contains("x-consumer: alice\n"), "{}", a.body);
        assert!(!a.body.contains("authorization"), "{}", a.body);
    }
    // Discovery fetched the metadata and the set once for all of them.
    assert_eq!(issuer.fetches.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn refusals_name_the_reason_as_rfc_6750_says() {
    let good = Signer::load("rsa-a.pem", Algorithm::RS256, "a");
    let stranger = Signer::load("rsa-b.pem", Algorithm::RS256, "a");
    let issuer = Issuer::start(&[&good]).await;
    let gw = gateway(&issuer, ", algorithms: [RS256]", "").await;
    let iss = issuer.url.clone();

    // No token: the challenge without an error code (§3.1).
    let a = TestClient::default().get(&gw.url("/orders/1")).await;
    assert_eq!(
        (a.status.as_u16(), challenge(&a)),
        (401, "Bearer".to_string())
    );
    assert_eq!(
        a.refusal(),
        r#"{"status":401,"error":"missing bearer token"}"#
    );

    let mut expired = claims(&iss, "alice");
    expired["exp"] = json!(now() - 120);
    let mut early = claims(&iss, "alice");
    early["nbf"] = json!(now() + 120);
    let mut stringy = claims(&iss, "alice");
    stringy["exp"] = json!("9999999999");
    let mut negative = claims(&iss, "alice");
    negative["nbf"] = json!(-1);
    let mut no_exp = claims(&iss, "alice");
    no_exp.as_object_mut().expect("object").remove("exp");
    let mut wrong_aud = claims(&iss, "alice");
    wrong_aud["aud"] = json!("billing-api");
    let huge = {
        let mut c = claims(&iss, "alice");
        c["pad"] = json!("x".repeat(9000));
        good.sign(&c)
    };
    let ps = Signer::load("rsa-a.pem", Algorithm::RS384, "a");
    let unsigned = {
        let t = good.sign(&claims(&iss, "alice"));
        let mut parts: Vec<&str> = t.split('.').collect();
        parts[0] = "eyJhbGciOiJub25lIiwidHlwIjoiSldUIn0"; // {"alg":"none","typ":"JWT"}
        format!("{}.{}.", parts[0], parts[1])
    };
    // An HS256 token "signed" with the RSA key's own bytes: the forgery that works where a
    // library verifies HMAC with whatever key the set holds.
    let forged = jsonwebtoken::encode(
        &Header::new(Algorithm::HS256),
        &claims(&iss, "alice"),
        &EncodingKey::from_secret(&std::fs::read(data("rsa-a.pem")).expect("pem")),
    )
    .expect("sign");
    let cases = [
        (forged, "signing algorithm not accepted"),
        (good.sign(&expired), "token expired"),
        (good.sign(&early), "token not yet valid"),
        (good.sign(&stringy), "exp is not a number"),
        (good.sign(&negative), "nbf is before 1970"),
        (good.sign(&no_exp), "token has no exp"),
        (
            good.sign(&claims("https://evil.example", "alice")),
            "wrong issuer",
        ),
        (good.sign(&wrong_aud), "wrong audience"),
        (stranger.sign(&claims(&iss, "alice")), "bad signature"),
        (
            ps.sign(&claims(&iss, "alice")),
            "signing algorithm not accepted",
        ),
        (unsigned, "signing algorithm not accepted"),
        (
            // A known algorithm, a header wrong elsewhere (`kid` a number).
            format!("eyJhbGciOiJFUzI1NiIsImtpZCI6N30.{}.", {
                let t = good.sign(&claims(&iss, "alice"));
                t.split('.').nth(1).unwrap_or("").to_string()
            }),
            "malformed token",
        ),
        (
            good.sign_with(&claims(&iss, "alice"), |h| {
                h.crit = Some(vec!["exp-hint".to_string()]);
            }),
            "critical header not supported",
        ),
        (huge, "token too large"),
        (good.sign(&claims(&iss, "mallory")), "unknown consumer"),
        (
            good.sign(&claims(&iss, "two words")),
            "consumer claim is not a usable name",
        ),
        // A numeric user id is a name (here one the gateway does not list).
        (
            good.sign(&{
                let mut c = claims(&iss, "x");
                c["sub"] = json!(12345);
                c
            }),
            "unknown consumer",
        ),
        (
            good.sign(&{
                let mut c = claims(&iss, "x");
                c["sub"] = json!(true);
                c
            }),
            "consumer claim is not a usable name",
        ),
        ("not.a.token".to_string(), "malformed token"),
    ];
    for (token, why) in cases {
        let a = call(&gw, &token).await;
        assert_eq!(a.status, 401, "{why}: {}", a.body);
        assert_eq!(
            challenge(&a),
            format!(r#"Bearer error="invalid_token", error_description="{why}""#)
        );
    }
    // `Bearer ` with nothing after it (the server drops the trailing space).
    let a = TestClient::default()
        .request(
            Method::GET,
            &gw.url("/orders/1"),
            &[("authorization", "Bearer ")],
            "",
        )
        .await;
    assert_eq!(
        challenge(&a),
        r#"Bearer error="invalid_token", error_description="empty token""#
    );
    // The same token twice: an answer of its own, as for two API keys.
    let t = format!("Bearer {}", good.sign(&claims(&iss, "alice")));
    let a = TestClient::default()
        .request(
            Method::GET,
            &gw.url("/orders/1"),
            &[("authorization", &t), ("authorization", &t)],
            "",
        )
        .await;
    assert_eq!(a.status, 400);
    assert!(challenge(&a).starts_with(r#"Bearer error="invalid_request""#));
    let m = gw.gw.metrics_text();
    assert!(m.contains(r#"reason="invalid_token"} 20"#), "{m}");
}

#[tokio::test]
async fn an_hmac_route_takes_its_secret_and_no_key_pair_algorithm() {
    let (backend, _) = inspect_backend().await;
    let secret = std::fs::read(data("hs256.secret")).expect("secret");
    let yaml = yaml(
        backend,
        &format!(
            r#"consumers:
  - {{name: alice, keys: [ka]}}
routes:
  - name: orders
    path_prefix: /orders/
    upstream: backend
    auth:
      jwt: {{secret_file: "{}", issuer: "https://id.example.com/"}}
"#,
            data("hs256.secret")
        ),
    );
    let gw = TestGateway::start(&yaml, SystemClock::new()).await;
    let c = json!({"iss": "https://id.example.com/", "sub": "alice", "exp": now() + 60});
    let sign = |alg, key: &[u8]| {
        jsonwebtoken::encode(&Header::new(alg), &c, &EncodingKey::from_secret(key)).expect("sign")
    };
    assert_eq!(
        call(&gw, &sign(Algorithm::HS256, &secret)).await.status,
        200
    );
    let wrong = sign(
        Algorithm::HS256,
        b"another secret of at least thirty-two bytes",
    );
    let a = call(&gw, &wrong).await;
    assert_eq!(
        (a.status.as_u16(), a.refusal()),
        (
            401,
            r#"{"status":401,"error":"invalid token","detail":"bad signature"}"#.to_string()
        )
    );
    // A secret route takes no key-pair algorithm, and a key-set route no HS256 (refused
    // in the config, below; refused in tokens: see the refusals test).
    let rsa = Signer::load("rsa-a.pem", Algorithm::RS256, "a");
    let a = call(&gw, &rsa.sign(&c)).await;
    assert_refused(&a, "signing algorithm not accepted");
    let refused = tollgate_config::from_yaml(
        "upstreams: {b: {targets: [\"127.0.0.1:1\"]}}\nroutes:\n  - {name: r, path_prefix: /, upstream: b, auth: {jwt: {jwks_url: \"http://127.0.0.1:1/jwks\", algorithms: [HS256, none]}}}\n",
    )
    .expect_err("HS256 and none are refused on a key set");
    let text = refused.to_string();
    assert!(text.contains("routes[0].auth.jwt.algorithms[0]: HS256 is signed with a shared secret: it needs `secret_file`"), "{text}");
    assert!(
        text.contains("routes[0].auth.jwt.algorithms[1]: `none` is never accepted"),
        "{text}"
    );
}

#[tokio::test]
async fn a_rotated_secret_file_is_taken_by_a_reload_of_an_unchanged_config() {
    let (backend, _) = inspect_backend().await;
    let dir = tempdir("jwt-secret-rotates");
    let secret = dir.join("hs.secret");
    let (old, new) = (
        b"the first secret, of at least thirty-two bytes".as_slice(),
        b"the second secret, of at least thirty-two bytes".as_slice(),
    );
    std::fs::write(&secret, old).expect("write");
    let yaml = yaml(
        backend,
        &format!(
            "consumers:\n  - {{name: alice, keys: [ka]}}\nroutes:\n  - {{name: orders, path_prefix: /orders/, upstream: backend, auth: {{jwt: {{secret_file: \"{}\"}}}}}}\n",
            secret.display()
        ),
    );
    let path = dir.join("tollgate.yaml");
    std::fs::write(&path, &yaml).expect("write");
    let gw = TestGateway::start(&yaml, SystemClock::new()).await;
    // As the gateway reloads: on a blocking thread (the key sets are made on the runtime).
    let reload = |g: std::sync::Arc<tollgate_gateway::Gateway>, p: std::path::PathBuf| async move {
        tokio::task::spawn_blocking(move || g.reload_file(&p))
            .await
            .expect("join")
    };
    reload(gw.gw.clone(), path.clone())
        .await
        .expect("from its file");
    let c = json!({"sub": "alice", "exp": now() + 60});
    let sign = |key: &[u8]| {
        jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            &c,
            &EncodingKey::from_secret(key),
        )
        .expect("sign")
    };
    assert_eq!(call(&gw, &sign(old)).await.status, 200);
    std::fs::write(&secret, new).expect("rotate");
    reload(gw.gw.clone(), path.clone()).await.expect("reload");
    assert_eq!(call(&gw, &sign(new)).await.status, 200);
    assert_refused(&call(&gw, &sign(old)).await, "bad signature");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn unlisted_callers_get_the_plan_of_their_token_or_the_anonymous_plan() {
    let key = Signer::load("ec256.pem", Algorithm::ES256, "e");
    let issuer = Issuer::start(&[&key]).await;
    let gw = gateway(
        &issuer,
        ", plan_claim: plan, anonymous_plan: free, claims_to_headers: {X-User-Email: email}",
        "metrics: {per_consumer: true}\n",
    )
    .await;
    let iss = issuer.url.clone();
    let mut zed = claims(&iss, "zed");
    zed["plan"] = json!("gold");
    zed["email"] = json!("zed@example.com");
    let zed = key.sign(&zed);
    // gold: 2 a minute, counted under zed.
    for _ in 0..2 {
        let a = call(&gw, &zed).await;
        assert_eq!(a.status, 200, "{}", a.body);
        assert!(a.body.contains("x-consumer: zed\n"), "{}", a.body);
        assert!(
            a.body.contains("x-user-email: zed@example.com\n"),
            "{}",
            a.body
        );
    }
    let a = call(&gw, &zed).await;
    assert_eq!(a.status, 429, "{}", a.body);
    // Its usage, as for a listed consumer: gold's limit, both requests counted.
    let u = tollgate_gateway::usage::usage(&gw.gw.snapshot(), None, "zed", gw.gw.now())
        .await
        .expect("zed's usage");
    let l = &u.limits[0];
    assert_eq!((l.requests, l.used, l.remaining), (2, 2, 0), "{u:?}");
    assert!(
        tollgate_gateway::usage::usage(&gw.gw.snapshot(), None, "nobody", gw.gw.now())
            .await
            .is_err(),
        "a name no token brought stays unknown"
    );
    // No plan in the token: the anonymous plan (free: 1 a minute), counted apart.
    let yve = key.sign(&claims(&iss, "yve"));
    assert_eq!(call(&gw, &yve).await.status, 200);
    assert_eq!(call(&gw, &yve).await.status, 429);
    // A name a list reader would split (`X-Consumer: admin,bob` read as two) is no
    // caller's name: the issuer may let its users choose theirs.
    for name in ["admin,bob", "admin;bob"] {
        let a = call(&gw, &key.sign(&claims(&iss, name))).await;
        assert_refused(&a, "consumer claim is not a usable name");
    }
    // A forged copy of a claim header from the client never reaches the backend.
    let a = TestClient::default()
        .request(
            Method::GET,
            &gw.url("/orders/1"),
            &[
                (
                    "authorization",
                    &format!("Bearer {}", key.sign(&claims(&iss, "xia"))),
                ),
                ("x-user-email", "ceo@example.com"),
            ],
            "",
        )
        .await;
    assert_eq!(a.status, 200);
    assert!(!a.body.contains("ceo@example.com"), "{}", a.body);
    let m = gw.gw.metrics_text();
    assert!(m.contains(r#"reason="rate_limited"} 2"#), "{m}");
    // Their names come from tokens: one series for all of them, not one each.
    for line in [
        r#"tollgate_consumer_requests_total{consumer="unlisted callers",class="2xx"} 4"#,
        r#"tollgate_consumer_requests_total{consumer="unlisted callers",class="4xx"} 2"#,
    ] {
        assert!(m.lines().any(|l| l == line), "{line}\n{m}");
    }
    assert!(!m.contains(r#"consumer="zed""#), "{m}");
}

#[tokio::test]
async fn a_rotated_key_is_fetched_on_its_first_token_and_the_old_one_stops() {
    let old = Signer::load("rsa-a.pem", Algorithm::RS256, "2026-01");
    let new = Signer::load("rsa-b.pem", Algorithm::RS256, "2026-02");
    let issuer = Issuer::start(&[&old]).await;
    let gw = gateway(&issuer, "", "").await;
    let iss = issuer.url.clone();
    let old_token = old.sign(&claims(&iss, "alice"));
    assert_eq!(call(&gw, &old_token).await.status, 200);

    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    {
        let mut served = issuer.served.lock();
        served.jwks = json!({"keys": [new.jwk()]});
        served.hold = Some(gate.clone());
    }
    let new_token = new.sign(&claims(&iss, "alice"));
    // Within 10 s of the last fetch, an unknown kid is refused at once.
    let a = call(&gw, &new_token).await;
    assert_refused(&a, "unknown key id");
    // It asked for the set again, no sooner than 10 s after the last fetch. While that
    // fetch is under way, a token of the new key waits for it and then passes.
    issuer.fetched(2).await;
    let mut waiting = {
        let (url, auth) = (gw.url("/orders/1"), format!("Bearer {new_token}"));
        tokio::spawn(async move {
            TestClient::default()
                .request(Method::GET, &url, &[("authorization", &auth)], "")
                .await
        })
    };
    // Not answered while the fetch is held (had it been refused, it would be by now).
    let early = tokio::time::timeout(Duration::from_millis(300), &mut waiting).await;
    assert!(
        early.is_err(),
        "answered before the fetch it waits for: {early:?}"
    );
    gate.add_permits(1);
    let a = waiting.await.expect("the waiting request");
    assert_eq!(a.status, 200, "{}", a.body);
    issuer.served.lock().hold = None;
    // A fetch is counted once its keys are in place.
    let counted = format!(
        r#"tollgate_jwks_fetches_total{{source="{}",result="ok"}} 2"#,
        issuer.url
    );
    let m = metrics_with(&gw.gw, &counted).await;
    assert!(m.contains(&counted), "{m}");
    assert_eq!(call(&gw, &new_token).await.status, 200);
    // The remembered old token is checked again under the new keys, and refused.
    assert_eq!(call(&gw, &old_token).await.status, 401);
    assert_eq!(issuer.fetches.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn credentials_in_a_key_set_url_are_sent_as_basic_and_never_shown() {
    use base64::Engine;
    let key = Signer::load("ed25519.pem", Algorithm::EdDSA, "k1");
    let issuer = Issuer::start(&[&key]).await;
    let host = issuer.url.trim_start_matches("http://").to_string();
    let extra = format!(r#", jwks_url: "http://reader:p%40ss+1@{host}/jwks?tenant=t-secret""#);
    let gw = gateway(&issuer, &extra, "").await;
    let token = key.sign(&claims(&issuer.url, "alice"));
    assert_eq!(call(&gw, &token).await.status, 200);
    let sent = issuer.served.lock().authorization.clone();
    let expected = base64::engine::general_purpose::STANDARD.encode("reader:p@ss+1");
    assert_eq!(sent, Some(format!("Basic {expected}")));
    let m = gw.gw.metrics_text();
    let label = format!(
        r#"tollgate_jwks_keys{{source="http://<redacted>@{host}/jwks?tenant=<redacted>"}} 1"#
    );
    assert!(m.lines().any(|l| l == label), "{m}");
    assert!(!m.contains("p%40ss") && !m.contains("t-secret"), "{m}");
}

#[tokio::test]
async fn when_the_issuer_is_down_the_last_good_keys_keep_serving() {
    let key = Signer::load("ed25519.pem", Algorithm::EdDSA, "k1");
    let issuer = Issuer::start(&[&key]).await;
    issuer.served.lock().cache_control = Some("public, max-age=3600");
    let gw = gateway(&issuer, "", "").await;
    let iss = issuer.url.clone();
    // The set is kept as long as its Cache-Control says.
    let m = gw.gw.metrics_text();
    let refresh: u64 = m
        .lines()
        .find(|l| l.starts_with("tollgate_jwks_refresh_in_seconds{"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no refresh gauge in {m}"));
    assert!((3590..=3600).contains(&refresh), "{refresh}");

    issuer.served.lock().fail = true;
    let ghost = Signer::load("ed25519.pem", Algorithm::EdDSA, "k-unknown");
    assert_eq!(
        call(&gw, &ghost.sign(&claims(&iss, "alice"))).await.status,
        401
    );
    issuer.fetched(2).await;
    let stale = format!(r#"tollgate_jwks_stale{{source="{}"}} 1"#, issuer.url);
    let m = metrics_with(&gw.gw, &stale).await;
    assert!(m.contains(&stale), "{m}");
    assert!(
        m.contains(&format!(
            r#"tollgate_jwks_keys{{source="{}"}} 1"#,
            issuer.url
        )),
        "{m}"
    );
    // A token the kept key signed still passes.
    assert_eq!(
        call(&gw, &key.sign(&claims(&iss, "alice"))).await.status,
        200
    );
}

#[tokio::test]
async fn a_route_may_take_a_key_or_a_token() {
    let key = Signer::load("ec384.pem", Algorithm::ES384, "k");
    let issuer = Issuer::start(&[&key]).await;
    let gw = gateway(&issuer, "", "      header: [x-api-key]").await;
    let a = TestClient::default()
        .request(
            Method::GET,
            &gw.url("/orders/1"),
            &[("x-api-key", "ka")],
            "",
        )
        .await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert!(a.body.contains("x-consumer: alice\n"));
    assert_eq!(
        call(&gw, &key.sign(&claims(&issuer.url, "alice")))
            .await
            .status,
        200
    );
    let a = TestClient::default().get(&gw.url("/orders/1")).await;
    assert_eq!(a.status, 401);
    assert_eq!(challenge(&a), "Bearer | ApiKey");
    // Judged by its token, a request's key goes no further; judged by its key, neither
    // does an `Authorization` of another scheme.
    let token = format!("Bearer {}", key.sign(&claims(&issuer.url, "alice")));
    let a = TestClient::default()
        .request(
            Method::GET,
            &gw.url("/orders/1"),
            &[("authorization", &token), ("x-api-key", "ka")],
            "",
        )
        .await;
    assert_eq!(a.status, 200);
    assert!(
        !a.body.contains("x-api-key") && !a.body.contains("authorization"),
        "{}",
        a.body
    );
    let a = TestClient::default()
        .request(
            Method::GET,
            &gw.url("/orders/1"),
            &[("authorization", "Basic YWxpY2U6cHc="), ("x-api-key", "ka")],
            "",
        )
        .await;
    assert_eq!(a.status, 200);
    assert!(!a.body.contains("authorization"), "{}", a.body);
    // Deleted through the admin API: its remembered token is refused from the next
    // request on.
    assert_eq!(
        call(&gw, &key.sign(&claims(&issuer.url, "alice")))
            .await
            .status,
        200
    );
    let admin = start_admin(&gw.gw, Some("t0ken")).await;
    let gone = TestClient::default()
        .request(
            Method::DELETE,
            &format!("http://{admin}/consumers/alice"),
            &[("authorization", "Bearer t0ken")],
            "",
        )
        .await;
    assert_eq!(gone.status, 200, "{}", gone.body);
    let a = call(&gw, &key.sign(&claims(&issuer.url, "alice"))).await;
    assert_refused(&a, "consumer deleted");
}

#[tokio::test]
async fn a_token_without_kid_is_tried_against_the_keys_of_its_kind() {
    let a = Signer::load("rsa-a.pem", Algorithm::RS256, "a");
    let b = Signer::load("rsa-b.pem", Algorithm::RS256, "b");
    let issuer = Issuer::start(&[&a, &b]).await;
    let gw = gateway(&issuer, "", "").await;
    let token = jsonwebtoken::encode(
        &Header::new(Algorithm::RS256),
        &claims(&issuer.url, "alice"),
        &b.key,
    )
    .expect("sign");
    assert_eq!(call(&gw, &token).await.status, 200);
    // A key whose set says `alg: RS256` verifies no PS256 token, though both are RSA.
    let ps = Signer::load("rsa-a.pem", Algorithm::PS256, "a");
    let mut set = issuer.served.lock().jwks.clone();
    set["keys"][0]["alg"] = json!("RS256");
    assert_eq!(set["keys"][0]["kid"], "a");
    let gw2 = {
        issuer.served.lock().jwks = set;
        gateway(&issuer, "", "").await
    };
    let a = call(&gw2, &ps.sign(&claims(&issuer.url, "alice"))).await;
    assert_refused(&a, "no key for this algorithm");
}

#[tokio::test]
async fn an_elliptic_key_verifies_the_algorithm_of_its_curve_only() {
    // The set's key `p` is on P-256; a token signed ES384 naming it finds no key for its
    // algorithm (its set gives the key no `alg`: the curve says ES256).
    let p256 = Signer::load("ec256.pem", Algorithm::ES256, "p");
    let issuer = Issuer::start(&[&p256]).await;
    let mut set = issuer.served.lock().jwks.clone();
    if let Some(key) = set["keys"][0].as_object_mut() {
        key.remove("alg");
    }
    assert!(set["keys"][0].get("alg").is_none(), "{set}");
    issuer.served.lock().jwks = set;
    let gw = gateway(&issuer, "", "").await;
    assert_eq!(
        call(&gw, &p256.sign(&claims(&issuer.url, "alice")))
            .await
            .status,
        200
    );
    let p384 = Signer::load("ec384.pem", Algorithm::ES384, "p");
    let a = call(&gw, &p384.sign(&claims(&issuer.url, "alice"))).await;
    assert_refused(&a, "no key for this algorithm");
}

#[tokio::test]
async fn a_reload_keeps_the_keys_it_has_while_the_issuer_is_down() {
    let key = Signer::load("ec256.pem", Algorithm::ES256, "k");
    let issuer = Issuer::start(&[&key]).await;
    let gw = gateway(&issuer, "", "").await;
    let token = key.sign(&claims(&issuer.url, "alice"));
    assert_eq!(call(&gw, &token).await.status, 200);
    issuer.served.lock().fail = true;
    // Another fetch timeout and another route: the same source, the same keys.
    let (backend, _) = inspect_backend().await;
    gw.apply(&yaml(
        backend,
        &format!(
            r#"consumers:
  - {{name: alice, keys: [ka]}}
routes:
  - name: orders
    path_prefix: /orders/
    upstream: backend
    auth:
      jwt: {{issuer: "{url}", audiences: [orders-api], fetch_timeout: 3s}}
  - name: more
    path_prefix: /more/
    upstream: backend
    auth:
      jwt: {{issuer: "{url}"}}
"#,
            url = issuer.url
        ),
    ));
    assert_eq!(call(&gw, &token).await.status, 200);
    assert_eq!(issuer.fetches.load(Ordering::SeqCst), 1);
}
