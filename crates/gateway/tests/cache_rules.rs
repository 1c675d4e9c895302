//! The cache's finer RFC 9111 rules: a 304 without `Date`, relative `Location`s, an empty
//! varying header, method overrides, `only-if-cached`, `Surrogate-Control` on answers not
//! stored, `If-Modified-Since` against `Date`, HEAD and `Range` misses fetched whole.

mod common;

use common::*;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// The backend: its answer to a request head, by path (`n` counts the requests to it).
fn answer(head: &str, n: usize) -> (Vec<u8>, bool) {
    let path = head.split(' ').nth(1).unwrap_or("/").to_string();
    let has = |name: &str| {
        head.lines().any(|l| {
            l.split_once(':')
                .is_some_and(|(k, _)| k.trim().eq_ignore_ascii_case(name))
        })
    };
    let reply = |status: &str, extra: &str, body: &str| {
        let bytes = format!(
            "HTTP/1.1 {status}\r\n{extra}Content-Length: {}\r\n\r\n{body}",
            body.len()
        );
        (bytes.into_bytes(), false)
    };
    if head.starts_with("POST") {
        let loc = path.split_once("loc=").map_or("", |(_, l)| l);
        return reply("201 Created", &format!("Location: {loc}\r\n"), "made");
    }
    let body = format!("n={n}");
    match path.split('?').next().unwrap_or("/") {
        // The first answer is dated; the 304s that refresh it are not.
        "/dated" if has("if-none-match") => reply(
            "304 Not Modified",
            "ETag: \"v1\"\r\nCache-Control: max-age=2\r\n",
            "",
        ),
        "/dated" => reply(
            "200 OK",
            "Date: Thu, 01 Jan 1970 00:00:00 GMT\r\nETag: \"v1\"\r\nCache-Control: max-age=2\r\n",
            &body,
        ),
        "/foo" => reply(
            "200 OK",
            "Cache-Control: max-age=60\r\nVary: X-Foo\r\n",
            &body,
        ),
        "/surrogate" => reply(
            "200 OK",
            "Cache-Control: max-age=60\r\nSurrogate-Control: no-store\r\n",
            &body,
        ),
        "/digits" => reply(
            "200 OK",
            "Cache-Control: max-age=60\r\nETag: \"d\"\r\n",
            "0123456789",
        ),
        "/private-digits" if has("range") => reply(
            "206 Partial Content",
            "Cache-Control: private\r\nContent-Range: bytes 1-2/10\r\n",
            "12",
        ),
        "/private-digits" => reply("200 OK", "Cache-Control: private\r\n", "0123456789"),
        // Stored for one value of `X-Foo`; private for `b`.
        "/varied-digits" if head.to_ascii_lowercase().contains("x-foo: b") => {
            if has("range") {
                reply(
                    "206 Partial Content",
                    "Cache-Control: private\r\nVary: X-Foo\r\nContent-Range: bytes 1-2/10\r\n",
                    "12",
                )
            } else {
                let extra = "Cache-Control: private\r\nVary: X-Foo\r\n";
                reply("200 OK", extra, "0123456789")
            }
        }
        "/varied-digits" => reply(
            "200 OK",
            "Cache-Control: max-age=60\r\nVary: X-Foo\r\n",
            "0123456789",
        ),
        // Modified a second before it was sent, or within its second.
        "/lm-digits" => reply(
            "200 OK",
            "Date: Sun, 06 Dec 2026 10:00:01 GMT\r\nLast-Modified: Sun, 06 Dec 2026 10:00:00 GMT\r\nCache-Control: max-age=60\r\n",
            "0123456789",
        ),
        "/same-second-digits" => reply(
            "200 OK",
            "Date: Sun, 06 Dec 2026 10:00:00 GMT\r\nLast-Modified: Sun, 06 Dec 2026 10:00:00 GMT\r\nCache-Control: max-age=60\r\n",
            "0123456789",
        ),
        "/undated-digits" => reply(
            "200 OK",
            "Last-Modified: Sun, 06 Dec 2026 10:00:00 GMT\r\nCache-Control: max-age=60\r\n",
            "0123456789",
        ),
        "/date-only" => reply(
            "200 OK",
            "Date: Thu, 01 Jan 1970 00:00:00 GMT\r\nCache-Control: max-age=60\r\n",
            &body,
        ),
        _ => reply("200 OK", "Cache-Control: max-age=60\r\n", &body),
    }
}

struct Setup {
    gw: TestGateway,
    clock: std::sync::Arc<tollgate_gateway::ManualClock>,
    requests: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    /// The request heads the backend got, in order.
    heads: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    c: TestClient,
}

async fn setup() -> Setup {
    setup_trusting(false).await
}

/// [`setup`], its listener trusting 127.0.0.1 as a proxy when `trusted`.
async fn setup_trusting(trusted: bool) -> Setup {
    // Bodies name the count of requests the backend saw.
    let count = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let c2 = count.clone();
    let heads = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let h2 = heads.clone();
    let (backend, _, _) = scripted_backend(move |h, _| {
        let n = c2.fetch_add(1, Ordering::SeqCst) + 1;
        h2.lock().expect("heads").push(h.to_string());
        answer(h, n)
    })
    .await;
    let cfg = yaml(
        backend,
        r#"
cache: {max_size: 1MiB, max_object_size: 64KiB}
routes:
  - name: reads
    path_prefix: /g/
    upstream: backend
    methods: [GET, HEAD]
    cache: {default_ttl: 10s, shared: true}
  - name: all
    path_prefix: /
    upstream: backend
    cache: {default_ttl: 10s, shared: true}
"#,
    );
    let cfg = if trusted {
        cfg.replace(
            "listeners: [{address: \"127.0.0.1:0\"}]",
            "listeners: [{address: \"127.0.0.1:0\", trusted_proxies: [127.0.0.1]}]",
        )
    } else {
        cfg
    };
    let (gw, clock) = TestGateway::with_manual_clock(&cfg).await;
    Setup {
        gw,
        clock,
        requests: count,
        heads,
        c: TestClient::default(),
    }
}

impl Setup {
    async fn get(&self, path: &str, headers: &[(&str, &str)]) -> Answer {
        self.c
            .request(http::Method::GET, &self.gw.url(path), headers, "")
            .await
    }

    /// The last request head the backend got.
    fn last_head(&self) -> String {
        self.heads
            .lock()
            .expect("heads")
            .last()
            .cloned()
            .unwrap_or_default()
    }

    fn upstream(&self) -> usize {
        self.requests.load(Ordering::SeqCst)
    }

    /// Whether `path` is answered from the store now.
    async fn is_hit(&self, path: &str) -> bool {
        let a = self.get(path, &[]).await;
        assert_eq!(a.status, 200, "{path}");
        a.header("cache-status").contains("hit")
    }
}

#[tokio::test]
async fn a_304_without_date_makes_the_entry_fresh_again() {
    let s = setup().await;
    assert_eq!(s.get("/dated", &[]).await.body, "n=1");
    s.clock.advance(Duration::from_secs(5));
    let a = s.get("/dated", &[]).await;
    assert_eq!(
        a.header("cache-status"),
        "tollgate; fwd=stale; fwd-status=304"
    );
    // Dated when it arrived (RFC 9110 §6.6.1): fresh for its two seconds from then.
    let again = s.get("/dated", &[]).await;
    assert!(
        again.header("cache-status").contains("hit"),
        "{:?}",
        again.headers
    );
    assert_eq!(again.body, "n=1");
    assert_eq!(s.upstream(), 2);
}

#[tokio::test]
async fn a_relative_location_invalidates_the_uri_it_names_resolved_against_the_request() {
    let s = setup().await;
    for (stored, loc) in [
        ("/o/x9", "x9"),
        ("/y2", "../y2"),
        ("/o/x4", "//127.0.0.1/o/x4"),
        ("/o/x7-X", "/o/x7%2DX"),
    ] {
        s.get(stored, &[]).await;
        assert!(s.is_hit(stored).await, "{stored}");
        let url = s.gw.url(&format!("/o/w?loc={loc}"));
        let made = s.c.request(http::Method::POST, &url, &[], "").await;
        assert_eq!(made.status, 201);
        assert!(
            !s.is_hit(stored).await,
            "{loc} should have dropped {stored}"
        );
    }
    // Another host's URI is not this one's.
    s.get("/o/z", &[]).await;
    let url = s.gw.url("/o/w?loc=//other.test/o/z");
    s.c.request(http::Method::POST, &url, &[], "").await;
    assert!(s.is_hit("/o/z").await);
}

#[tokio::test]
async fn an_empty_varying_header_is_not_an_absent_one() {
    let s = setup().await;
    assert_eq!(s.get("/foo", &[("X-Foo", "")]).await.body, "n=1");
    let absent = s.get("/foo", &[]).await;
    assert_eq!(absent.body, "n=2", "{:?}", absent.headers);
    assert_eq!(s.get("/foo", &[("X-Foo", "")]).await.body, "n=1");
    assert_eq!(s.get("/foo", &[]).await.body, "n=2");
}

#[tokio::test]
async fn a_method_override_invalidates_only_as_an_unsafe_method_the_route_takes() {
    let s = setup().await;
    let with = |name: &'static str, value: &'static str| [(name, value)];
    // A route that takes GET and HEAD only: no override drops its entries.
    s.get("/g/a", &[]).await;
    for (name, value) in [
        ("X-HTTP-Method-Override", "DELETE"),
        ("X-HTTP-Method-Override", "GET"),
        ("X_Method_Override", "put"),
    ] {
        let a = s.get("/g/a", &with(name, value)).await;
        assert_eq!(
            a.header("cache-status"),
            "tollgate; fwd=bypass",
            "not served from it"
        );
        assert!(s.is_hit("/g/a").await, "{name}: {value}");
    }
    // A route that takes every method: an unsafe one taken as such does.
    s.get("/b", &[]).await;
    s.get("/b", &with("X-HTTP-Method-Override", "HEAD")).await;
    assert!(s.is_hit("/b").await, "HEAD changes nothing");
    s.get("/b", &with("X-HTTP-Method", " delete ")).await;
    assert!(!s.is_hit("/b").await, "taken as DELETE");
}

#[tokio::test]
async fn only_if_cached_is_answered_from_the_store_or_with_504() {
    let s = setup().await;
    let only = [("Cache-Control", "only-if-cached")];
    let miss = s.get("/c", &only).await;
    assert_eq!(miss.status, 504);
    assert_eq!(
        miss.header("cache-status"),
        "tollgate; detail=only-if-cached"
    );
    assert_eq!(s.upstream(), 0);
    s.get("/c", &[]).await;
    let hit = s.get("/c", &only).await;
    assert_eq!((hit.status.as_u16(), hit.body.as_str()), (200, "n=1"));
    // Stale, it would need the upstream.
    s.clock.advance(Duration::from_secs(120));
    assert_eq!(s.get("/c", &only).await.status, 504);
    assert_eq!(s.upstream(), 1);
    // Nor does a request the cache would pass by: a bypass, or a key that passes.
    for h in [
        [("Cache-Control", "no-store, only-if-cached"), ("X-A", "1")],
        [
            ("Cache-Control", "only-if-cached"),
            ("X-HTTP-Method-Override", "GET"),
        ],
    ] {
        assert_eq!(s.get("/c", &h).await.status, 504, "{h:?}");
    }
    s.get("/surrogate", &[]).await;
    assert_eq!(s.get("/surrogate", &only).await.status, 504, "hit-for-pass");
    assert_eq!(s.upstream(), 2);
}

#[tokio::test]
async fn surrogate_control_is_taken_out_of_answers_it_kept_out_of_the_store() {
    let s = setup().await;
    for _ in 0..2 {
        let a = s.get("/surrogate", &[]).await;
        assert!(a.header("cache-status").contains("fwd="), "{:?}", a.headers);
        assert!(
            a.headers.get("surrogate-control").is_none(),
            "{:?}",
            a.headers
        );
    }
    assert_eq!(s.upstream(), 2);
}

#[tokio::test]
async fn if_modified_since_is_judged_by_date_without_last_modified() {
    let s = setup().await;
    s.get("/date-only", &[]).await;
    let since = [("If-Modified-Since", "Thu, 01 Jan 1970 00:00:00 GMT")];
    assert_eq!(s.get("/date-only", &since).await.status, 304);
    let before = [("If-Modified-Since", "Wed, 31 Dec 1969 23:59:59 GMT")];
    assert_eq!(s.get("/date-only", &before).await.status, 200);
    assert_eq!(s.upstream(), 1);
}

#[tokio::test]
async fn a_trusted_proxys_scheme_keys_as_the_listeners_own() {
    let s = setup_trusting(true).await;
    assert_eq!(s.get("/x", &[]).await.body, "n=1");
    // `X-Forwarded-Proto: http` from a trusted proxy is the scheme the listener has.
    let via = s.get("/x", &[("X-Forwarded-Proto", "http")]).await;
    assert!(
        via.header("cache-status").contains("hit"),
        "{:?}",
        via.headers
    );
    assert_eq!(via.body, "n=1");
    assert_eq!(
        s.get("/x", &[("X-Forwarded-Proto", "https")]).await.body,
        "n=2"
    );
}

#[tokio::test]
async fn a_head_miss_fetches_the_whole_get_and_stores_it() {
    let s = setup().await;
    let head = |path: &'static str| {
        let url = s.gw.url(path);
        let c = &s.c;
        async move { c.request(http::Method::HEAD, &url, &[], "").await }
    };
    let a = head("/h").await;
    assert_eq!((a.status.as_u16(), a.body.as_str()), (200, ""));
    assert_eq!(a.header("content-length"), "3", "{:?}", a.headers);
    assert_eq!(a.header("cache-status"), "tollgate; fwd=uri-miss; stored");
    assert!(s.last_head().starts_with("GET /h "), "{}", s.last_head());
    assert_eq!(s.get("/h", &[]).await.body, "n=1");
    assert_eq!(head("/h").await.header("content-length"), "3");
    assert_eq!(s.upstream(), 1);
    // A stale entry is refreshed by a HEAD as by a GET: whole, and stored.
    s.clock.advance(Duration::from_secs(120));
    assert_eq!(head("/h").await.status, 200);
    assert!(s.last_head().starts_with("GET /h "), "{}", s.last_head());
    assert_eq!(s.get("/h", &[]).await.body, "n=2");
    assert_eq!(s.upstream(), 2);
}

#[tokio::test]
async fn a_range_miss_fetches_the_whole_answer_and_serves_its_part() {
    let s = setup().await;
    let a = s.get("/digits", &[("Range", "bytes=2-4")]).await;
    assert_eq!((a.status.as_u16(), a.body.as_str()), (206, "234"));
    assert_eq!(a.header("content-range"), "bytes 2-4/10");
    let sent = s.last_head().to_ascii_lowercase();
    assert!(!sent.contains("range:"), "{sent}");
    assert_eq!(s.get("/digits", &[]).await.body, "0123456789");
    assert_eq!(s.upstream(), 1);
    // Past the end: 416, and the whole answer stored all the same.
    let a = s.get("/digits?b", &[("Range", "bytes=20-")]).await;
    assert_eq!(a.status, 416);
    assert_eq!(a.header("content-range"), "bytes */10");
    assert_eq!(s.get("/digits?b", &[]).await.body, "0123456789");
    assert_eq!(s.upstream(), 2);
    // A suffix; an `If-Range` that does not hold gets the whole answer.
    let a = s.get("/digits?c", &[("Range", "bytes=-3")]).await;
    assert_eq!((a.status.as_u16(), a.body.as_str()), (206, "789"));
    let other = [("Range", "bytes=0-0"), ("If-Range", "\"other\"")];
    let a = s.get("/digits?d", &other).await;
    assert_eq!((a.status.as_u16(), a.body.as_str()), (200, "0123456789"));
    let held = [("Range", "bytes=9-"), ("If-Range", "\"d\"")];
    let a = s.get("/digits?e", &held).await;
    assert_eq!((a.status.as_u16(), a.body.as_str()), (206, "9"));
    // An `If-Range` date holds only for a strong `Last-Modified`: one a second or more
    // before the answer's `Date` (RFC 9110 §8.8.2.2).
    let dated = [
        ("Range", "bytes=9-"),
        ("If-Range", "Sun, 06 Dec 2026 10:00:00 GMT"),
    ];
    let a = s.get("/lm-digits", &dated).await;
    assert_eq!((a.status.as_u16(), a.body.as_str()), (206, "9"));
    let a = s.get("/same-second-digits", &dated).await;
    assert_eq!((a.status.as_u16(), a.body.as_str()), (200, "0123456789"));
    // Without `Date`, nothing shows the `Last-Modified` strong: the whole answer, from
    // the store as from upstream.
    for _ in 0..2 {
        let a = s.get("/undated-digits", &dated).await;
        assert_eq!((a.status.as_u16(), a.body.as_str()), (200, "0123456789"));
    }
    // A whole answer that will not be stored is not read through to the part asked for
    // (a byte at the end of a large file would cost the whole file): the range goes
    // upstream as the client sent it, and so do the key's next ones while it passes.
    let range = [("Range", "bytes=1-2")];
    for n in [10, 11] {
        let a = s.get("/private-digits", &range).await;
        assert_eq!((a.status.as_u16(), a.body.as_str()), (206, "12"));
        assert_eq!(a.header("content-range"), "bytes 1-2/10");
        let sent = s.last_head().to_ascii_lowercase();
        assert!(sent.contains("range: bytes=1-2"), "{sent}");
        assert_eq!(s.upstream(), n);
    }
    let whole = s.heads.lock().expect("heads")[8].to_ascii_lowercase();
    assert!(
        whole.starts_with("get /private-digits ") && !whole.contains("range:"),
        "{whole}"
    );
    // So for a variant of a URI that varies: the one that cannot be stored passes while
    // it is marked, with or without credentials.
    assert_eq!(s.get("/varied-digits", &[("X-Foo", "a")]).await.status, 200);
    assert_eq!(s.upstream(), 12);
    let ranged = [("Range", "bytes=1-2"), ("X-Foo", "b")];
    for n in [14, 15] {
        let a = s.get("/varied-digits", &ranged).await;
        assert_eq!((a.status.as_u16(), a.body.as_str()), (206, "12"));
        assert!(s
            .last_head()
            .to_ascii_lowercase()
            .contains("range: bytes=1-2"));
        assert_eq!(s.upstream(), n);
    }
    let a = s.get("/varied-digits", &[("X-Foo", "a")]).await;
    assert!(a.header("cache-status").contains("hit"), "{:?}", a.headers);
}
