//! The response cache: RFC 9111 storage and freshness, Vary, consumers kept apart,
//! revalidation, RFC 5861, coalescing, invalidation, purges, eviction, reloads.

mod common;

use common::*;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tollgate_gateway::ManualClock;

/// What the backend answers for a request head: status line, headers and body by path.
fn answer(head: &str, n: usize, failing: bool) -> (Vec<u8>, bool) {
    let path = head.split(' ').nth(1).unwrap_or("/").to_string();
    let header = |name: &str| {
        head.lines()
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.trim()
                    .eq_ignore_ascii_case(name)
                    .then(|| v.trim().to_string())
            })
            .unwrap_or_default()
    };
    let ok = |extra: &str, body: String| {
        let bytes = format!(
            "HTTP/1.1 200 OK\r\n{extra}Content-Length: {}\r\n\r\n{body}",
            body.len()
        );
        (bytes.into_bytes(), false)
    };
    if head.starts_with("POST") || head.starts_with("DELETE") || head.starts_with("PURGE") {
        let loc = if path.starts_with("/moved") {
            "Location: /fresh\r\n"
        } else {
            ""
        };
        return ok(loc, "done".into());
    }
    let p = path.split('?').next().unwrap_or("/");
    match p {
        "/fresh" | "/a/x" | "/a/y" => ok("Cache-Control: max-age=60\r\n", format!("n={n}")),
        "/plain" => ok("", format!("n={n}")),
        "/chained" => ok(
            "Cache-Control: max-age=60\r\nCache-Status: origin-cache; hit\r\nCache-Status: edge; fwd=miss\r\n",
            format!("n={n}"),
        ),
        "/nostore" => ok("Cache-Control: no-store\r\n", format!("n={n}")),
        "/private" => ok("Cache-Control: private, max-age=60\r\n", format!("n={n}")),
        "/malformed" => ok("Cache-Control: max-age=soon\r\n", format!("n={n}")),
        "/cookie" => ok(
            "Cache-Control: max-age=60\r\nSet-Cookie: s=1\r\n",
            format!("n={n}"),
        ),
        "/vary" => ok(
            "Cache-Control: max-age=60\r\nVary: Accept-Language\r\n",
            format!("n={n} lang={}", header("accept-language")),
        ),
        "/late-vary" if n == 1 => ok("Cache-Control: max-age=1\r\n", format!("n={n}")),
        "/late-vary" => ok(
            "Cache-Control: max-age=60\r\nVary: X-Foo\r\n",
            format!("n={n} foo={}", header("x-foo")),
        ),
        "/vary-private" if header("accept-language") == "zz" => ok(
            "Cache-Control: private\r\nVary: Accept-Language\r\n",
            format!("n={n} private"),
        ),
        "/vary-private" => ok(
            "Cache-Control: max-age=60\r\nVary: Accept-Language\r\n",
            format!("n={n} lang={}", header("accept-language")),
        ),
        "/cookie2" => ok(
            "Cache-Control: max-age=60\r\nSet-Cookie2: s=1\r\n",
            format!("n={n}"),
        ),
        "/star" => ok("Cache-Control: max-age=60\r\nVary: *\r\n", format!("n={n}")),
        "/by-consumer" => ok(
            "Cache-Control: max-age=60\r\nVary: X-Consumer\r\n",
            format!("n={n} for={}", header("x-consumer")),
        ),
        "/tagged" => ok(
            "Cache-Control: max-age=60\r\nSurrogate-Key: t1 t2\r\n",
            format!("n={n}"),
        ),
        "/etag" => {
            if header("if-none-match") == "\"v1\"" {
                let r = "HTTP/1.1 304 Not Modified\r\nETag: \"v1\"\r\nCache-Control: max-age=1\r\nX-Refreshed: yes\r\n\r\n";
                return (r.as_bytes().to_vec(), false);
            }
            ok(
                "Cache-Control: max-age=1\r\nETag: \"v1\"\r\n",
                format!("n={n}"),
            )
        }
        "/swr" => ok(
            "Cache-Control: max-age=1, stale-while-revalidate=30\r\n",
            format!("n={n}"),
        ),
        "/sie" | "/mustrev" if failing => {
            let r = "HTTP/1.1 500 Internal Server Error\r\nContent-Length: 4\r\n\r\nfail";
            (r.as_bytes().to_vec(), false)
        }
        "/sie" => ok(
            "Cache-Control: max-age=1, stale-if-error=60\r\n",
            format!("n={n}"),
        ),
        "/mustrev" => ok(
            "Cache-Control: max-age=1, must-revalidate, stale-if-error=60\r\n",
            format!("n={n}"),
        ),
        "/big" => ok("Cache-Control: max-age=60\r\n", "x".repeat(40_000)),
        "/broken" => {
            let r =
                "HTTP/1.1 200 OK\r\nCache-Control: max-age=60\r\nContent-Length: 10\r\n\r\nhello";
            (r.as_bytes().to_vec(), true)
        }
        _ => ok(
            "Cache-Control: max-age=60\r\n",
            format!("n={n} path={path}"),
        ),
    }
}

struct Setup {
    gw: TestGateway,
    clock: Arc<ManualClock>,
    requests: Arc<AtomicUsize>,
    failing: Arc<AtomicBool>,
    c: TestClient,
}

fn config(backend: std::net::SocketAddr, shared: bool, extra: &str) -> String {
    yaml(
        backend,
        &format!(
            r#"
cache: {{max_size: 200KiB, max_object_size: 32KiB}}
plans:
  small: {{limits: [{{requests: 1000, per: 1s}}]}}
consumers:
  - {{name: alice, keys: [ka, ka2], plan: small}}
  - {{name: bob, keys: [kb], plan: small}}
routes:
  - name: api
    path_prefix: /
    upstream: backend
    auth: {{header: [X-API-Key]}}
    cache: {{default_ttl: 10s, shared: {shared}}}
{extra}"#
        ),
    )
}

async fn setup_with(shared: bool, extra: &str) -> Setup {
    let failing = Arc::new(AtomicBool::new(false));
    let count = Arc::new(AtomicUsize::new(0));
    let (f2, c2) = (failing.clone(), count.clone());
    let (backend, _, requests) = scripted_backend(move |h, _| {
        let n = c2.fetch_add(1, Ordering::SeqCst) + 1;
        answer(h, n, f2.load(Ordering::SeqCst))
    })
    .await;
    let (gw, clock) = TestGateway::with_manual_clock(&config(backend, shared, extra)).await;
    Setup {
        gw,
        clock,
        requests,
        failing,
        c: TestClient::default(),
    }
}

async fn setup() -> Setup {
    setup_with(false, "").await
}

impl Setup {
    async fn get_as(&self, key: &str, path: &str, headers: &[(&str, &str)]) -> Answer {
        let mut h = vec![("X-API-Key", key)];
        h.extend_from_slice(headers);
        self.c
            .request(http::Method::GET, &self.gw.url(path), &h, "")
            .await
    }

    async fn get(&self, path: &str) -> Answer {
        self.get_as("ka", path, &[]).await
    }

    fn upstream(&self) -> usize {
        self.requests.load(Ordering::SeqCst)
    }
}

#[tokio::test]
async fn a_fresh_response_is_served_from_the_cache_until_it_goes_stale() {
    let s = setup().await;
    let a = s.get("/fresh").await;
    assert_eq!((a.status.as_u16(), a.body.as_str()), (200, "n=1"));
    assert_eq!(a.header("cache-status"), "tollgate; fwd=uri-miss; stored");
    s.clock.advance(Duration::from_secs(20));
    let b = s.get("/fresh").await;
    assert_eq!(b.body, "n=1");
    assert_eq!(b.header("cache-status"), "tollgate; hit; ttl=40");
    assert_eq!(b.header("age"), "20");
    assert!(
        b.header("ratelimit").starts_with("\"1000-per-1s\""),
        "{:?}",
        b.headers
    );
    assert_eq!(s.upstream(), 1);
    s.clock.advance(Duration::from_secs(41));
    let c = s.get("/fresh").await;
    assert_eq!(c.body, "n=2", "stale: fetched again");
    assert_eq!(s.upstream(), 2);
}

#[tokio::test]
async fn the_gateway_adds_its_cache_status_after_the_upstreams() {
    // RFC 9211 §2: each cache keeps the field and adds its member at the end.
    let s = setup().await;
    let a = s.get("/chained").await;
    assert_eq!(
        a.header("cache-status"),
        "origin-cache; hit, edge; fwd=miss, tollgate; fwd=uri-miss; stored"
    );
    let b = s.get("/chained").await;
    assert_eq!(b.body, "n=1");
    assert_eq!(
        b.header("cache-status"),
        "origin-cache; hit, edge; fwd=miss, tollgate; hit; ttl=60"
    );
    assert_eq!(b.headers.get_all("cache-status").iter().count(), 1);
    let p =
        s.c.request(
            http::Method::POST,
            &s.gw.url("/chained"),
            &[("X-API-Key", "ka")],
            "x",
        )
        .await;
    assert_eq!(p.header("cache-status"), "tollgate; fwd=method");
    assert_eq!(
        s.get("/chained").await.body,
        "n=3",
        "the POST invalidated it"
    );
}

#[tokio::test]
async fn default_ttl_applies_only_when_the_response_states_no_lifetime() {
    let s = setup().await;
    assert_eq!(s.get("/plain").await.body, "n=1");
    s.clock.advance(Duration::from_secs(9));
    assert_eq!(s.get("/plain").await.body, "n=1");
    s.clock.advance(Duration::from_secs(2));
    assert_eq!(s.get("/plain").await.body, "n=2");
}

#[tokio::test]
async fn an_answer_that_sets_a_cookie_is_not_stored_for_one_consumer_either() {
    // One key may serve many end users: a session cookie is never replayed from the cache.
    let s = setup().await;
    let before = s.upstream();
    s.get("/cookie").await;
    let again = s.get("/cookie").await;
    assert_eq!(s.upstream(), before + 2, "served from the cache");
    assert!(!again.header("cache-status").contains("hit"), "{again:?}");
}

#[tokio::test]
async fn what_a_shared_cache_must_not_store_is_never_served_from_it() {
    let s = setup_with(true, "").await;
    for path in ["/nostore", "/private", "/malformed", "/cookie", "/star"] {
        let before = s.upstream();
        s.get(path).await;
        let again = s.get(path).await;
        assert_eq!(s.upstream(), before + 2, "{path} was served from the cache");
        assert!(!again.header("cache-status").contains("stored"), "{path}");
    }
    // A request that went upstream with Authorization (RFC 9111 §3.5).
    let before = s.upstream();
    for _ in 0..2 {
        s.get_as("ka", "/authz", &[("Authorization", "Basic eDp5")])
            .await;
    }
    assert_eq!(s.upstream(), before + 2);
}

#[tokio::test]
async fn vary_keeps_variants_apart() {
    let s = setup().await;
    let en = [("Accept-Language", "en")];
    let fr = [("Accept-Language", "fr")];
    assert_eq!(s.get_as("ka", "/vary", &en).await.body, "n=1 lang=en");
    let b = s.get_as("ka", "/vary", &fr).await;
    assert_eq!(b.body, "n=2 lang=fr");
    assert_eq!(b.header("cache-status"), "tollgate; fwd=vary-miss; stored");
    assert_eq!(s.get_as("ka", "/vary", &en).await.body, "n=1 lang=en");
    assert_eq!(s.get_as("ka", "/vary", &fr).await.body, "n=2 lang=fr");
    assert_eq!(s.upstream(), 2);
}

#[tokio::test]
async fn each_consumer_has_its_own_entries_unless_the_route_shares_them() {
    let s = setup().await;
    assert_eq!(s.get_as("ka", "/fresh", &[]).await.body, "n=1");
    assert_eq!(s.get_as("kb", "/fresh", &[]).await.body, "n=2");
    assert_eq!(s.get_as("ka", "/fresh", &[]).await.body, "n=1");
    assert_eq!(s.get_as("kb", "/fresh", &[]).await.body, "n=2");
    // Keys are no part of a stored key: the consumer's other key finds its entries.
    assert_eq!(s.get_as("ka2", "/fresh", &[]).await.body, "n=1");

    let s = setup_with(true, "").await;
    assert_eq!(s.get_as("ka", "/fresh", &[]).await.body, "n=1");
    assert_eq!(s.get_as("kb", "/fresh", &[]).await.body, "n=1", "shared");
    // A response that varies by consumer stays each consumer's own.
    assert_eq!(
        s.get_as("ka", "/by-consumer", &[]).await.body,
        "n=2 for=alice"
    );
    assert_eq!(
        s.get_as("kb", "/by-consumer", &[]).await.body,
        "n=3 for=bob"
    );
    assert_eq!(
        s.get_as("ka", "/by-consumer", &[]).await.body,
        "n=2 for=alice"
    );
    // The key is no part of a stored key: a consumer's second key finds its entries.
}

#[tokio::test]
async fn head_is_served_from_a_stored_get_and_conditional_requests_get_304() {
    let s = setup().await;
    s.get("/etag").await;
    let h =
        s.c.request(
            http::Method::HEAD,
            &s.gw.url("/etag"),
            &[("X-API-Key", "ka")],
            "",
        )
        .await;
    assert_eq!((h.status.as_u16(), h.body.as_str()), (200, ""));
    assert_eq!(h.header("content-length"), "3");
    assert!(h.header("cache-status").contains("hit"));
    let c = s
        .get_as("ka", "/etag", &[("If-None-Match", "\"v1\"")])
        .await;
    assert_eq!(c.status.as_u16(), 304);
    assert_eq!(c.header("etag"), "\"v1\"");
    assert_eq!(s.upstream(), 1);
    // A conditional miss (bob's entries are his own): the whole answer is fetched and
    // stored, the client gets its 304, and Cache-Status says so once.
    let m = s
        .get_as("kb", "/etag", &[("If-None-Match", "\"v1\"")])
        .await;
    assert_eq!(m.status.as_u16(), 304);
    assert_eq!(m.header("cache-status"), "tollgate; fwd=uri-miss; stored");
    assert_eq!(s.upstream(), 2);
}

#[tokio::test]
async fn a_stale_entry_with_a_validator_is_revalidated_and_refreshed_by_304() {
    let s = setup().await;
    assert_eq!(s.get("/etag").await.body, "n=1");
    s.clock.advance(Duration::from_secs(2));
    let a = s.get("/etag").await;
    assert_eq!((a.status.as_u16(), a.body.as_str()), (200, "n=1"));
    assert_eq!(
        a.header("cache-status"),
        "tollgate; fwd=stale; fwd-status=304"
    );
    assert_eq!(
        a.header("x-refreshed"),
        "yes",
        "headers updated from the 304"
    );
    // Fresh again for the 304's max-age.
    assert_eq!(
        s.get("/etag").await.header("cache-status"),
        "tollgate; hit; ttl=1"
    );
    assert_eq!(s.upstream(), 2);
}

#[tokio::test]
async fn unsafe_methods_invalidate_the_uri_and_its_location() {
    let s = setup().await;
    assert_eq!(s.get("/fresh").await.body, "n=1");
    let p =
        s.c.request(
            http::Method::POST,
            &s.gw.url("/fresh"),
            &[("X-API-Key", "kb")],
            "x",
        )
        .await;
    assert_eq!(p.status.as_u16(), 200);
    assert_eq!(
        s.get("/fresh").await.body,
        "n=3",
        "invalidated for every consumer"
    );
    // A POST elsewhere whose Location names /fresh.
    let p =
        s.c.request(
            http::Method::POST,
            &s.gw.url("/moved"),
            &[("X-API-Key", "ka")],
            "x",
        )
        .await;
    assert_eq!(p.status.as_u16(), 200);
    assert_eq!(s.get("/fresh").await.body, "n=5");
    // A client's PURGE is a method like any other not defined as safe: it goes upstream
    // and, answered 200, invalidates its own URI (RFC 9111 §4.4), nothing more.
    let purge = http::Method::from_bytes(b"PURGE").expect("method");
    let p =
        s.c.request(purge, &s.gw.url("/fresh"), &[("X-API-Key", "ka")], "")
            .await;
    assert_eq!(p.status.as_u16(), 200);
    assert_eq!(s.get("/fresh").await.body, "n=7", "invalidated");
}

#[tokio::test]
async fn a_stale_answer_that_did_not_vary_does_not_hide_the_variants_stored_after_it() {
    let s = setup().await;
    assert_eq!(s.get("/late-vary").await.body, "n=1");
    s.clock.advance(Duration::from_secs(5));
    let foo = [("X-Foo", "1")];
    assert_eq!(s.get_as("ka", "/late-vary", &foo).await.body, "n=2 foo=1");
    let again = s.get_as("ka", "/late-vary", &foo).await;
    assert_eq!(again.body, "n=2 foo=1", "{}", again.header("cache-status"));
    assert_eq!(s.upstream(), 2);
}

#[tokio::test]
async fn a_varying_header_spelled_with_underscores_keeps_its_own_variant() {
    let s = setup().await;
    // Stored for a request without Accept-Language.
    assert_eq!(s.get("/vary").await.body, "n=1 lang=");
    // A backend that reads `Accept_Language` as `Accept-Language` may answer it in
    // French: not the answer stored for no language, nor one to store for it.
    let under = s.get_as("ka", "/vary", &[("Accept_Language", "fr")]).await;
    assert_eq!(under.body, "n=2 lang=", "{}", under.header("cache-status"));
    assert_eq!(s.get("/vary").await.body, "n=1 lang=");
}

#[tokio::test]
async fn set_cookie2_and_proxy_credentials_keep_an_answer_out() {
    let s = setup().await;
    assert_eq!(s.get("/cookie2").await.body, "n=1");
    assert_eq!(
        s.get("/cookie2").await.body,
        "n=2",
        "a session is never stored"
    );
    let proxied = s
        .get_as("ka", "/a/y", &[("Proxy-Authorization", "Basic cDp4")])
        .await;
    assert_eq!(proxied.body, "n=3");
    assert_eq!(s.get("/a/y").await.body, "n=4", "not stored for the others");
}

#[tokio::test]
async fn one_variants_private_answer_does_not_turn_the_cache_off_for_the_others() {
    let s = setup().await;
    let lang = |l| [("Accept-Language", l)];
    assert_eq!(
        s.get_as("ka", "/vary-private", &lang("en")).await.body,
        "n=1 lang=en"
    );
    let zz = s.get_as("ka", "/vary-private", &lang("zz")).await;
    assert_eq!(zz.body, "n=2 private");
    // The stored variant is still served; the private one is asked for again.
    let en = s.get_as("ka", "/vary-private", &lang("en")).await;
    assert_eq!(en.body, "n=1 lang=en", "{}", en.header("cache-status"));
    assert_eq!(
        s.get_as("ka", "/vary-private", &lang("zz")).await.body,
        "n=3 private"
    );
}

#[tokio::test]
async fn a_write_through_a_route_that_does_not_cache_drops_what_another_stored() {
    // Reads of /a/ are cached by `api`; its writes go through `writes`, which caches
    // nothing.
    let s = setup_with(
        false,
        "  - name: writes\n    path_prefix: /a/\n    methods: [DELETE]\n    upstream: backend\n    auth: {header: [X-API-Key]}\n",
    )
    .await;
    assert_eq!(s.get("/a/x").await.body, "n=1");
    assert_eq!(s.get("/a/x").await.body, "n=1", "stored");
    let d =
        s.c.request(
            http::Method::DELETE,
            &s.gw.url("/a/x"),
            &[("X-API-Key", "kb")],
            "",
        )
        .await;
    assert_eq!((d.status.as_u16(), d.body.as_str()), (200, "done"));
    assert_eq!(
        s.get("/a/x").await.body,
        "n=3",
        "the DELETE through `writes` dropped what `api` stored"
    );
}

#[tokio::test]
async fn a_url_with_a_query_has_its_own_entry_and_unsafe_methods_on_it_invalidate_it() {
    let s = setup().await;
    // A `&` in the path is not a query: the two never share an entry.
    let amp = s.get("/item&id=7").await;
    assert!(amp.body.ends_with("path=/item&id=7"), "{}", amp.body);
    let q = s.get("/item?id=7").await;
    assert!(q.body.ends_with("path=/item?id=7"), "{}", q.body);
    assert_eq!(s.get("/item?id=7").await.body, q.body, "stored");
    assert_eq!(s.get("/item&id=7").await.body, amp.body, "stored");
    for method in [http::Method::PUT, http::Method::POST, http::Method::DELETE] {
        let before = s.upstream();
        let p =
            s.c.request(
                method.clone(),
                &s.gw.url("/item?id=7"),
                &[("X-API-Key", "kb")],
                "x",
            )
            .await;
        assert_eq!(p.status.as_u16(), 200);
        assert_eq!(p.header("cache-status"), "tollgate; fwd=method");
        let again = s.get("/item?id=7").await;
        assert_eq!(s.upstream(), before + 2, "{method} invalidated the URL");
        assert!(again.body.ends_with("path=/item?id=7"), "{}", again.body);
    }
    assert_eq!(s.get("/item&id=7").await.body, amp.body, "left alone");
}

#[tokio::test]
async fn stale_while_revalidate_serves_stale_and_refreshes_once_in_the_background() {
    let s = setup().await;
    assert_eq!(s.get("/swr").await.body, "n=1");
    s.clock.advance(Duration::from_secs(5));
    let a = s.get("/swr").await;
    assert_eq!(a.body, "n=1", "stale, at once");
    assert_eq!(a.header("cache-status"), "tollgate; hit; ttl=-4");
    let stored = &s.gw.gw.cache().store.metrics.stored;
    bounded("background refresh stored", async {
        while stored.load(Ordering::SeqCst) < 2 {
            tokio::task::yield_now().await;
        }
    })
    .await;
    assert_eq!(s.get("/swr").await.body, "n=2");
    assert_eq!(s.upstream(), 2);
}

#[tokio::test]
async fn stale_if_error_serves_stale_when_the_upstream_fails_unless_it_must_revalidate() {
    let s = setup().await;
    assert_eq!(s.get("/sie").await.body, "n=1");
    assert_eq!(s.get("/mustrev").await.body, "n=2");
    s.clock.advance(Duration::from_secs(5));
    s.failing.store(true, Ordering::SeqCst);
    let a = s.get("/sie").await;
    assert_eq!((a.status.as_u16(), a.body.as_str()), (200, "n=1"));
    assert_eq!(
        a.header("cache-status"),
        "tollgate; fwd=stale; fwd-status=500"
    );
    let b = s.get("/mustrev").await;
    assert_eq!(b.status.as_u16(), 500, "must-revalidate: never stale");
}

#[tokio::test]
async fn concurrent_misses_for_one_key_reach_the_backend_once() {
    let (backend, mut arrived, release) = gated_backend().await;
    // Waiters wait at most the upstream's response timeout: long, for a busy machine.
    let cfg = config(backend, true, "").replace("response_timeout: 2s", "response_timeout: 20s");
    let (gw, _clock) = TestGateway::with_manual_clock(&cfg).await;
    let c = TestClient::default();
    let mut calls = Vec::new();
    for _ in 0..200 {
        let (c, url) = (c.clone(), gw.url("/cold"));
        calls.push(tokio::spawn(async move {
            c.request(http::Method::GET, &url, &[("X-API-Key", "ka")], "")
                .await
        }));
    }
    bounded("first request upstream", arrived.recv()).await;
    release.notify_one();
    let mut collapsed = 0;
    for call in calls {
        let a = bounded("answer", call).await.expect("join");
        assert_eq!((a.status.as_u16(), a.body.as_str()), (200, "late"));
        collapsed += usize::from(a.header("cache-status").contains("collapsed"));
    }
    assert!(
        arrived.try_recv().is_err(),
        "a second request reached the backend"
    );
    assert!(collapsed > 0);
}

/// Waits until `n` requests wait for another's fetch.
async fn waiting(gw: &TestGateway, n: u64) {
    let w = &gw.gw.cache().store.metrics.waiting;
    bounded("requests waiting", async {
        while w.load(Ordering::SeqCst) != n {
            tokio::task::yield_now().await;
        }
    })
    .await;
}

/// A gateway sharing entries before a backend that answers `Vary: Accept-Encoding` (the
/// request's value in the body) only when released.
async fn varying_gated() -> (
    TestGateway,
    tokio::sync::mpsc::UnboundedReceiver<()>,
    Arc<tokio::sync::Notify>,
) {
    let (backend, arrived, release) = gated_backend_with(|req, n| {
        let enc = req
            .headers()
            .get("accept-encoding")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        let mut r = hyper::Response::new(format!("enc={enc} n={n}"));
        let h = r.headers_mut();
        h.insert(
            "cache-control",
            http::HeaderValue::from_static("max-age=60"),
        );
        h.insert("vary", http::HeaderValue::from_static("Accept-Encoding"));
        (r, true)
    })
    .await;
    let cfg = config(backend, true, "").replace("response_timeout: 2s", "response_timeout: 20s");
    let (gw, _clock) = TestGateway::with_manual_clock(&cfg).await;
    (gw, arrived, release)
}

/// `n` concurrent GETs of `path` with key `ka` and `headers`.
fn burst_with(
    gw: &TestGateway,
    path: &str,
    n: usize,
    headers: &'static [(&'static str, &'static str)],
) -> Vec<tokio::task::JoinHandle<Answer>> {
    let c = TestClient::default();
    (0..n)
        .map(|_| {
            let (c, url) = (c.clone(), gw.url(path));
            tokio::spawn(async move {
                let mut h = vec![("X-API-Key", "ka")];
                h.extend_from_slice(headers);
                c.request(http::Method::GET, &url, &h, "").await
            })
        })
        .collect()
}

/// The answers to `calls`, each let go by a gated backend however many of them wait there
/// at once: a release given before its request waits is kept (one at most), so it is
/// given again until the call ends.
async fn released(
    calls: Vec<tokio::task::JoinHandle<Answer>>,
    release: &tokio::sync::Notify,
) -> Vec<Answer> {
    let mut answers = Vec::new();
    for call in calls {
        let a = bounded("answer", async {
            loop {
                release.notify_one();
                if call.is_finished() {
                    return call.await;
                }
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("join");
        answers.push(a);
    }
    answers
}

#[tokio::test]
async fn requests_that_cannot_use_the_answer_they_waited_for_send_one_of_them_upstream() {
    let (gw, mut arrived, release) = varying_gated().await;
    let first = burst_with(&gw, "/v", 1, &[("Accept-Encoding", "identity")]).remove(0);
    bounded("first upstream", arrived.recv()).await;
    // They wait for the first request's answer, which turns out to be another variant's.
    let calls = burst_with(&gw, "/v", 50, &[("Accept-Encoding", "gzip")]);
    waiting(&gw, 50).await;
    release.notify_one();
    let a = bounded("first", first).await.expect("join");
    assert_eq!(a.body, "enc=identity n=1");
    // One of them goes upstream; the others wait for it again.
    bounded("second upstream", arrived.recv()).await;
    waiting(&gw, 49).await;
    release.notify_one();
    for call in calls {
        let a = bounded("answer", call).await.expect("join");
        assert_eq!((a.status.as_u16(), a.body.as_str()), (200, "enc=gzip n=2"));
    }
    assert!(
        arrived.try_recv().is_err(),
        "a third request reached the backend"
    );
}

#[tokio::test]
async fn a_request_with_credentials_does_not_lead_requests_without_them() {
    let (gw, mut arrived, release) = varying_gated().await;
    // Its answer (not `public`) may not be stored for others (RFC 9111 §3.5).
    let mut first = burst_with(
        &gw,
        "/v",
        1,
        &[("Accept-Encoding", "gzip"), ("Authorization", "Bearer x")],
    )
    .remove(0);
    bounded("first upstream", arrived.recv()).await;
    // They do not wait for it: one of them goes upstream, the others wait for that one.
    let calls = burst_with(&gw, "/v", 50, &[("Accept-Encoding", "gzip")]);
    bounded("second upstream", arrived.recv()).await;
    waiting(&gw, 49).await;
    // One release lets one of the two gated requests go; then the other.
    release.notify_one();
    let done = bounded("one answered", async {
        tokio::select! {
            a = &mut first => Some(a),
            _ = waiting(&gw, 0) => None,
        }
    })
    .await;
    release.notify_one();
    let a = match done {
        Some(a) => a,
        None => bounded("first", first).await,
    }
    .expect("join");
    assert!(a.body.starts_with("enc=gzip n="), "{}", a.body);
    let mut bodies = std::collections::BTreeSet::new();
    for call in calls {
        let a = bounded("answer", call).await.expect("join");
        assert_eq!(a.status, 200);
        bodies.insert(a.body);
    }
    assert_eq!(bodies.len(), 1, "all from one fetch: {bodies:?}");
    assert!(
        arrived.try_recv().is_err(),
        "a third request reached the backend"
    );
}

#[tokio::test]
async fn requests_with_credentials_wait_for_one_another() {
    let (backend, mut arrived, release) = gated_backend_with(|_, n| {
        let mut r = hyper::Response::new(format!("n={n}"));
        r.headers_mut().insert(
            "cache-control",
            http::HeaderValue::from_static("public, max-age=60"),
        );
        (r, true)
    })
    .await;
    let cfg = config(backend, true, "").replace("response_timeout: 2s", "response_timeout: 20s");
    let (gw, _clock) = TestGateway::with_manual_clock(&cfg).await;
    let calls = burst_with(&gw, "/p", 20, &[("Authorization", "Basic dTpw")]);
    bounded("first upstream", arrived.recv()).await;
    waiting(&gw, 19).await;
    release.notify_one();
    for call in calls {
        let a = bounded("answer", call).await.expect("join");
        assert_eq!((a.status.as_u16(), a.body.as_str()), (200, "n=1"));
    }
    assert!(
        arrived.try_recv().is_err(),
        "a second request went upstream"
    );
}

#[tokio::test]
async fn waiting_requests_go_upstream_together_when_the_refresh_may_not_be_stored() {
    let (backend, mut arrived, release) = gated_backend_with(|_, n| {
        let cc = if n == 1 { "max-age=1" } else { "no-store" };
        let mut r = hyper::Response::new(format!("n={n}"));
        r.headers_mut()
            .insert("cache-control", http::HeaderValue::from_static(cc));
        (r, n > 1)
    })
    .await;
    let cfg = config(backend, true, "").replace("response_timeout: 2s", "response_timeout: 20s");
    let (gw, clock) = TestGateway::with_manual_clock(&cfg).await;
    let first = bounded("first", burst(&gw, "/s", 1).remove(0))
        .await
        .expect("join");
    assert_eq!(first.body, "n=1");
    clock.advance(Duration::from_secs(5));
    let calls = burst(&gw, "/s", 20);
    bounded("refresh upstream", arrived.recv()).await;
    waiting(&gw, 19).await;
    release.notify_one();
    // The answer says `no-store`: the others go upstream at once, not one after another
    // (each would wait for the one before it).
    for _ in 0..19 {
        bounded("the others upstream together", arrived.recv()).await;
    }
    for a in released(calls, &release).await {
        assert_eq!(a.status, 200);
    }
}

#[tokio::test]
async fn waiting_requests_go_upstream_together_when_a_304_cannot_refresh_for_them() {
    let (backend, mut arrived, release) = gated_backend_with(|req, n| {
        let conditional = req.headers().contains_key("if-none-match");
        let mut r = hyper::Response::new(if conditional {
            String::new()
        } else {
            format!("n={n}")
        });
        if conditional {
            *r.status_mut() = http::StatusCode::NOT_MODIFIED;
        }
        let h = r.headers_mut();
        // Public at first (stored for requests with credentials too); the 304s are not.
        let cc = if n == 1 {
            "public, max-age=1"
        } else {
            "max-age=60"
        };
        h.insert("cache-control", http::HeaderValue::from_static(cc));
        h.insert("etag", http::HeaderValue::from_static("\"v1\""));
        (r, n > 1)
    })
    .await;
    let cfg = config(backend, true, "").replace("response_timeout: 2s", "response_timeout: 20s");
    let (gw, clock) = TestGateway::with_manual_clock(&cfg).await;
    let auth: &'static [(&'static str, &'static str)] = &[("Authorization", "Bearer u")];
    let first = bounded("first", burst_with(&gw, "/e", 1, auth).remove(0))
        .await
        .expect("join");
    assert_eq!(first.body, "n=1");
    clock.advance(Duration::from_secs(5));
    let calls = burst_with(&gw, "/e", 10, auth);
    bounded("revalidation upstream", arrived.recv()).await;
    waiting(&gw, 9).await;
    release.notify_one();
    // The 304 may not refresh what others are served: they ask for themselves, together.
    for _ in 0..9 {
        bounded("the others upstream together", arrived.recv()).await;
    }
    for a in released(calls, &release).await {
        assert_eq!(a.status, 200);
    }
}

/// A backend whose first answer to `path` is `first` (with `Cache-Control: cc`), then `later`
/// after a release; unsafe methods are answered at once.
async fn stale_backend(
    cc: &'static str,
    later: u16,
) -> (
    std::net::SocketAddr,
    tokio::sync::mpsc::UnboundedReceiver<()>,
    Arc<tokio::sync::Notify>,
) {
    gated_backend_with(move |req, n| {
        if req.method() == http::Method::POST {
            return (hyper::Response::new("done".to_string()), false);
        }
        let mut r = hyper::Response::new(format!("n={n}"));
        r.headers_mut()
            .insert("cache-control", http::HeaderValue::from_static(cc));
        if n > 1 {
            *r.status_mut() = http::StatusCode::from_u16(later).expect("status");
        }
        (r, n > 1)
    })
    .await
}

/// `n` concurrent GETs of `path` with key `ka`.
fn burst(gw: &TestGateway, path: &str, n: usize) -> Vec<tokio::task::JoinHandle<Answer>> {
    let c = TestClient::default();
    (0..n)
        .map(|_| {
            let (c, url) = (c.clone(), gw.url(path));
            tokio::spawn(async move {
                c.request(http::Method::GET, &url, &[("X-API-Key", "ka")], "")
                    .await
            })
        })
        .collect()
}

/// A gateway before [`stale_backend`] whose entry for `/s` (`n=1`) has gone stale by its
/// clock. Waiters may wait long: the machine may be busy.
async fn stale_entry(
    cc: &'static str,
    later: u16,
) -> (
    TestGateway,
    tokio::sync::mpsc::UnboundedReceiver<()>,
    Arc<tokio::sync::Notify>,
) {
    let (backend, arrived, release) = stale_backend(cc, later).await;
    let cfg = config(backend, true, "").replace("response_timeout: 2s", "response_timeout: 20s");
    let (gw, clock) = TestGateway::with_manual_clock(&cfg).await;
    let first = bounded("first", burst(&gw, "/s", 1).remove(0))
        .await
        .expect("join");
    assert_eq!(first.body, "n=1");
    clock.advance(Duration::from_secs(5));
    (gw, arrived, release)
}

#[tokio::test]
async fn concurrent_requests_for_a_stale_entry_without_validators_reach_the_backend_once() {
    let (gw, mut arrived, release) = stale_entry("max-age=1", 200).await;
    let calls = burst(&gw, "/s", 100);
    bounded("refresh upstream", arrived.recv()).await;
    release.notify_one();
    let mut collapsed = 0;
    for call in calls {
        let a = bounded("answer", call).await.expect("join");
        assert_eq!((a.status.as_u16(), a.body.as_str()), (200, "n=2"));
        collapsed += usize::from(a.header("cache-status").contains("collapsed"));
    }
    assert!(
        arrived.try_recv().is_err(),
        "a second request reached the backend"
    );
    assert!(collapsed > 0);
}

#[tokio::test]
async fn requests_waiting_on_a_failed_refresh_are_served_stale_within_stale_if_error() {
    let (gw, mut arrived, release) = stale_entry("max-age=1, stale-if-error=60", 500).await;
    let calls = burst(&gw, "/s", 50);
    bounded("refresh upstream", arrived.recv()).await;
    release.notify_one();
    let mut statuses = Vec::new();
    for call in calls {
        let a = bounded("answer", call).await.expect("join");
        assert_eq!((a.status.as_u16(), a.body.as_str()), (200, "n=1"));
        statuses.push(a.header("cache-status").to_string());
    }
    assert!(
        arrived.try_recv().is_err(),
        "a second request reached the failing backend"
    );
    assert!(statuses.contains(&"tollgate; fwd=stale; fwd-status=500".to_string()));
    assert!(statuses.contains(&"tollgate; fwd=stale; collapsed".to_string()));
}

#[tokio::test]
async fn an_answer_fetched_while_an_unsafe_method_invalidates_its_uri_is_not_stored() {
    let (backend, mut arrived, release) = stale_backend("max-age=60", 200).await;
    let cfg = config(backend, true, "");
    let (gw, _clock) = TestGateway::with_manual_clock(&cfg).await;
    // n=1 is answered at once and stored; a POST drops it.
    let a = bounded("first", burst(&gw, "/x", 1).remove(0))
        .await
        .expect("join");
    assert_eq!(a.body, "n=1");
    let c = TestClient::default();
    let post = |c: TestClient| {
        let url = gw.url("/x");
        async move {
            c.request(http::Method::POST, &url, &[("X-API-Key", "ka")], "")
                .await
        }
    };
    assert_eq!(post(c.clone()).await.status.as_u16(), 200);
    // The next GET goes upstream; while it is there, another POST lands.
    let get = burst(&gw, "/x", 1).remove(0);
    bounded("GET upstream", arrived.recv()).await;
    assert_eq!(post(c.clone()).await.status.as_u16(), 200);
    release.notify_one();
    let a = bounded("answer", get).await.expect("join");
    assert_eq!(a.body, "n=3");
    assert_eq!(a.header("cache-status"), "tollgate; fwd=uri-miss");
    // Not stored: the next GET goes upstream again.
    let again = burst(&gw, "/x", 1).remove(0);
    bounded("GET upstream again", arrived.recv()).await;
    release.notify_one();
    assert_eq!(bounded("answer", again).await.expect("join").body, "n=5");
}

#[tokio::test]
async fn a_response_that_breaks_off_or_is_too_large_is_not_stored() {
    let s = setup().await;
    for path in ["/broken", "/big"] {
        let before = s.upstream();
        for _ in 0..2 {
            // The gateway closes the connection of a body cut short: read it raw.
            let req = format!(
                "GET {path} HTTP/1.1\r\nHost: a\r\nX-API-Key: ka\r\nConnection: close\r\n\r\n"
            );
            raw(s.gw.addr, req.as_bytes()).await;
        }
        assert_eq!(s.upstream(), before + 2, "{path}");
    }
}

#[tokio::test]
async fn a_full_cache_evicts_instead_of_growing() {
    let s = setup().await;
    let store = &s.gw.gw.cache().store;
    for i in 0..60 {
        let path = format!("/item/{i}?pad={}", "p".repeat(3000));
        assert_eq!(s.get(&path).await.status.as_u16(), 200);
    }
    let (_, bytes) = store.usage();
    assert!(bytes <= 200 * 1024, "{bytes} bytes held over max_size");
    assert!(store.metrics.evictions.load(Ordering::SeqCst) > 0);
}

#[tokio::test]
async fn a_reload_keeps_the_entries_of_routes_that_remain() {
    let s = setup().await;
    assert_eq!(s.get("/fresh").await.body, "n=1");
    let backend = s.gw.gw.snapshot().config.upstreams[0].targets[0].clone();
    let cfg = config(
        backend.parse().expect("addr"),
        false,
        "  - {name: other, path: /other, upstream: backend}\n",
    );
    s.gw.apply(&cfg);
    assert_eq!(s.gw.gw.reloads().borrow().generation, 2);
    assert_eq!(s.get("/fresh").await.body, "n=1");
}

#[tokio::test]
async fn hits_count_against_the_consumers_limits() {
    let s = setup_with(false, "").await;
    let cfg = s.gw.gw.snapshot().config.clone();
    let mut cfg = cfg;
    cfg.plans[0].limits[0].requests = 2;
    s.gw.gw.apply(cfg);
    assert_eq!(s.get("/fresh").await.status.as_u16(), 200);
    assert_eq!(s.get("/fresh").await.status.as_u16(), 200);
    assert_eq!(
        s.get("/fresh").await.status.as_u16(),
        429,
        "a hit is a call"
    );
    assert_eq!(s.upstream(), 1);
}

#[tokio::test]
async fn purges_by_url_prefix_tag_and_everything() {
    // A second route keys only `id`, and takes its key in the query.
    let s = setup_with(
        false,
        "  - name: keyed\n    path_prefix: /k/\n    upstream: backend\n    auth: {query: [apikey]}\n    cache: {default_ttl: 10s, key_query: [id]}\n",
    )
    .await;
    let admin_cfg = tollgate_config::AdminConfig {
        address: "127.0.0.1:0".parse().expect("addr"),
        token: None,
        max_connections: 4,
        header_timeout: Duration::from_secs(5),
    };
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let admin = l.local_addr().expect("addr");
    tokio::spawn(tollgate_gateway::admin::serve(
        s.gw.gw.clone(),
        l,
        admin_cfg,
    ));
    let purge = |json: &'static str| async move {
        let req = format!(
            "POST /cache/purge HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{json}",
            json.len()
        );
        raw(admin, req.as_bytes()).await
    };
    let paths = [
        "/fresh", "/a/x", "/a/y", "/tagged", "/other", "/q?x=1", "/h?y=2",
    ];
    for p in paths {
        s.get(p).await;
    }
    let host = s.gw.addr.ip().to_string();
    let url = format!("{{\"url\": \"http://{host}/fresh\"}}");
    let url: &'static str = Box::leak(url.into_boxed_str());
    assert!(purge(url).await.contains("\"purged\":1"));
    // A URL with its query, as a path or whole.
    assert!(purge(r#"{"url": "/q?x=1"}"#).await.contains("\"purged\":1"));
    let url = format!("{{\"url\": \"http://{host}/h?y=2\"}}");
    let url: &'static str = Box::leak(url.into_boxed_str());
    assert!(purge(url).await.contains("\"purged\":1"));
    // A URL as a client wrote it finds the entry the keyed route stored for it: the
    // API key and the parameters the route does not key are left out, as in its key.
    let keyed = s.gw.url("/k/item?id=7&utm=mail&apikey=ka");
    let first = s.c.request(http::Method::GET, &keyed, &[], "").await;
    assert_eq!(
        first.header("cache-status"),
        "tollgate; fwd=uri-miss; stored"
    );
    let hit = s.c.request(http::Method::GET, &keyed, &[], "").await;
    assert!(
        hit.header("cache-status").contains("hit"),
        "{:?}",
        hit.headers
    );
    let url = format!("{{\"url\": \"http://{host}/k/item?utm=web&id=7&apikey=other\"}}");
    let url: &'static str = Box::leak(url.into_boxed_str());
    assert!(purge(url).await.contains("\"purged\":1"));
    let again = s.c.request(http::Method::GET, &keyed, &[], "").await;
    assert!(
        again.header("cache-status").contains("fwd="),
        "{:?}",
        again.headers
    );
    let stored = s.upstream();
    assert!(purge(r#"{"prefix": "/a/"}"#).await.contains("\"purged\":2"));
    assert!(purge(r#"{"tag": "t2"}"#).await.contains("\"purged\":1"));
    for p in paths {
        s.get(p).await;
    }
    assert_eq!(s.upstream(), stored + 6, "only /other was left");
    let stats = raw(
        admin,
        b"GET /cache HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(stats.contains("\"entries\":8"), "{stats}");
    assert!(purge(r#"{"all": true}"#).await.contains("\"purged\":8"));
    assert!(purge(r#"{"nothing": 1}"#).await.starts_with("HTTP/1.1 400"));
    // A URL or prefix spelled as a client may spell it finds what its request stored
    // (the path normalized as the request's was); one no request could name is refused.
    for (client, purged) in [
        ("/n/a%7Eb", r#"{"url": "/n//a~b"}"#),
        ("/n/%41bc", r#"{"url": "/n/Abc"}"#),
        ("/n/x//y", r#"{"url": "/n/x%2fy"}"#),
        ("/p/re~fix/1", r#"{"prefix": "/p/re%7efix/"}"#),
    ] {
        assert!(s
            .get(client)
            .await
            .header("cache-status")
            .contains("stored"));
        assert!(s.get(client).await.header("cache-status").contains("hit"));
        let answer = purge(purged).await;
        if purged.contains("%2f") {
            assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
            assert!(answer.contains("encoded slash"), "{answer}");
            continue;
        }
        assert!(answer.contains("\"purged\":1"), "{purged}: {answer}");
        let again = s.get(client).await;
        assert!(again.header("cache-status").contains("fwd="), "{client}");
    }
    assert!(purge(r#"{"url": "/n/../a"}"#)
        .await
        .starts_with("HTTP/1.1 400"));
}

#[tokio::test]
async fn after_an_answer_that_could_not_be_stored_requests_do_not_wait_for_one_another() {
    // The gated backend states no lifetime and default_ttl is 0s: nothing is stored.
    let (backend, mut arrived, release) = gated_backend().await;
    let cfg = config(backend, true, "").replace("default_ttl: 10s", "default_ttl: 0s");
    let (gw, _clock) = TestGateway::with_manual_clock(&cfg).await;
    let c = TestClient::default();
    let get = |c: TestClient, url: String| {
        tokio::spawn(async move {
            c.request(http::Method::GET, &url, &[("X-API-Key", "ka")], "")
                .await
        })
    };
    let first = get(c.clone(), gw.url("/x"));
    bounded("first upstream", arrived.recv()).await;
    release.notify_one();
    let a = bounded("first", first).await.expect("join");
    assert_eq!(a.header("cache-status"), "tollgate; fwd=uri-miss");
    // Both are upstream at once: neither waits for the other's answer.
    let (x, y) = (get(c.clone(), gw.url("/x")), get(c.clone(), gw.url("/x")));
    bounded("second upstream", arrived.recv()).await;
    bounded(
        "third upstream, not queued behind the second",
        arrived.recv(),
    )
    .await;
    release.notify_one();
    release.notify_one();
    for call in [x, y] {
        assert_eq!(
            bounded("answer", call).await.expect("join").status.as_u16(),
            200
        );
    }
}

#[tokio::test]
async fn after_an_answer_that_could_not_be_stored_caching_resumes_within_five_seconds() {
    let s = setup().await;
    s.failing.store(true, Ordering::SeqCst);
    assert_eq!(s.get("/sie").await.status.as_u16(), 500, "not stored");
    s.failing.store(false, Ordering::SeqCst);
    // For five seconds such a key goes straight upstream; then it is stored again.
    let pass = s.get("/sie").await;
    assert_eq!(pass.header("cache-status"), "tollgate; fwd=uri-miss");
    s.clock.advance(Duration::from_secs(6));
    let a = s.get("/sie").await;
    assert_eq!(a.header("cache-status"), "tollgate; fwd=uri-miss; stored");
    assert_eq!(
        s.get("/sie").await.header("cache-status"),
        "tollgate; hit; ttl=1"
    );
    assert_eq!(s.upstream(), 3);
}

#[tokio::test]
async fn a_key_that_passes_leaves_the_other_keys_cached() {
    let s = setup().await;
    let first = s.get("/nostore").await;
    assert_eq!(first.header("cache-status"), "tollgate; fwd=uri-miss");
    // `/nostore` now goes straight upstream for a while; `/fresh` is looked up and stored.
    let again = s.get("/nostore").await;
    assert_eq!(again.status.as_u16(), 200);
    assert_eq!(again.header("cache-status"), "tollgate; fwd=uri-miss");
    assert_eq!(
        s.get("/fresh").await.header("cache-status"),
        "tollgate; fwd=uri-miss; stored"
    );
    let hit = s.get("/fresh").await;
    assert!(
        hit.header("cache-status").starts_with("tollgate; hit"),
        "{}",
        hit.header("cache-status")
    );
    assert_eq!(s.upstream(), 3);
}
