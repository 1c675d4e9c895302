//! The cache held against clients who would decide what others get: keys that hold what
//! the upstream is told, keyed parameters in every spelling, variants on what was sent, a
//! fill no client can stall, client directives that decide nothing for others, a bounded
//! index, and the rest of RFC 9111.

mod common;

use common::*;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tollgate_gateway::ManualClock;

/// A request header's value in a raw request head (empty when absent).
fn header(head: &str, name: &str) -> String {
    head.lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim()
                .eq_ignore_ascii_case(name)
                .then(|| v.trim().to_string())
        })
        .unwrap_or_default()
}

fn ok(extra: &str, body: &str) -> (Vec<u8>, bool) {
    let bytes = format!(
        "HTTP/1.1 200 OK\r\n{extra}Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    (bytes.into_bytes(), false)
}

/// What the backend answers: by path, with `n` counting every request it got.
fn answer(head: &str, n: usize) -> (Vec<u8>, bool) {
    let target = head.split(' ').nth(1).unwrap_or("/").to_string();
    let path = target.split('?').next().unwrap_or("/");
    let cc = "Cache-Control: max-age=60\r\n";
    if !head.starts_with("GET") && !head.starts_with("HEAD") {
        return ok("", &format!("n={n}"));
    }
    match path {
        "/where" => ok(
            cc,
            &format!(
                "n={n} host={} proto={}",
                header(head, "x-forwarded-host"),
                header(head, "x-forwarded-proto")
            ),
        ),
        "/list" => ok(cc, &format!("n={n} target={target}")),
        "/by-client" => ok(
            "Cache-Control: max-age=60\r\nVary: X-Forwarded-For\r\n",
            &format!("n={n} for={}", header(head, "x-forwarded-for")),
        ),
        "/big" => ok(cc, &"b".repeat(200_000)),
        "/huge" => {
            // Chunked, no length: only its end tells it is past max_object_size.
            let chunk = "h".repeat(50_000);
            let mut r = format!("HTTP/1.1 200 OK\r\n{cc}Transfer-Encoding: chunked\r\n\r\n");
            for _ in 0..8 {
                r.push_str(&format!("{:x}\r\n{chunk}\r\n", chunk.len()));
            }
            r.push_str("0\r\n\r\n");
            (r.into_bytes(), false)
        }
        "/shaped" => {
            if !header(head, "range").is_empty() {
                let r = format!("HTTP/1.1 206 Partial Content\r\n{cc}Content-Range: bytes 0-0/5\r\nContent-Length: 1\r\n\r\nx");
                return (r.into_bytes(), false);
            }
            if !header(head, "if-none-match").is_empty() {
                let r = format!("HTTP/1.1 304 Not Modified\r\n{cc}ETag: \"e\"\r\n\r\n");
                return (r.into_bytes(), false);
            }
            ok(&format!("{cc}ETag: \"e\"\r\n"), &format!("n={n}"))
        }
        "/digits" => ok(cc, "0123456789"),
        "/quoted-age" => ok(
            "Cache-Control: max-age=60\r\nAge: \"100\"\r\n",
            &format!("n={n}"),
        ),
        "/listed-age" => ok(
            "Cache-Control: max-age=60\r\nAge: 7200, 10\r\n",
            &format!("n={n}"),
        ),
        "/surrogate" => ok(
            "Cache-Control: no-store\r\nSurrogate-Control: max-age=60, max-age=5;edge2\r\n",
            &format!("n={n}"),
        ),
        "/cdn" => ok(
            "Cache-Control: max-age=60\r\nCDN-Cache-Control: no-store\r\n",
            &format!("n={n}"),
        ),
        "/understood" => ok(
            "Cache-Control: max-age=60, no-store, must-understand\r\n",
            &format!("n={n}"),
        ),
        "/gzip" => {
            if header(head, "if-none-match") == "\"g\"" {
                let r = "HTTP/1.1 304 Not Modified\r\nETag: \"g\"\r\nCache-Control: max-age=60\r\nContent-Encoding: gzip\r\n\r\n";
                return (r.as_bytes().to_vec(), false);
            }
            ok(
                "Cache-Control: max-age=1\r\nETag: \"g\"\r\n",
                &format!("n={n}"),
            )
        }
        "/retagged" => {
            if !header(head, "if-none-match").is_empty() {
                let r = "HTTP/1.1 304 Not Modified\r\nETag: \"other\"\r\nCache-Control: max-age=60\r\n\r\n";
                return (r.as_bytes().to_vec(), false);
            }
            ok(
                "Cache-Control: max-age=1\r\nETag: \"first\"\r\n",
                &format!("n={n}"),
            )
        }
        "/nostore" => ok("Cache-Control: no-store\r\n", &format!("n={n}")),
        "/session" => {
            if !header(head, "if-none-match").is_empty() {
                let r = "HTTP/1.1 304 Not Modified\r\nETag: \"s\"\r\nCache-Control: max-age=60\r\nSet-Cookie: sid=VICTIM\r\n\r\n";
                return (r.as_bytes().to_vec(), false);
            }
            ok(
                "Cache-Control: max-age=1\r\nETag: \"s\"\r\n",
                &format!("n={n}"),
            )
        }
        "/session-again" => {
            // A 304 with a session to the revalidation, and another (with headers of its
            // own) to the whole answer asked for after it.
            let r = if header(head, "if-none-match").is_empty() {
                "HTTP/1.1 304 Not Modified\r\nETag: \"s2\"\r\nCache-Control: max-age=60\r\nSet-Cookie: sid=VICTIM2\r\nX-Injected: yes\r\n\r\n"
            } else {
                "HTTP/1.1 304 Not Modified\r\nETag: \"s2\"\r\nCache-Control: max-age=60\r\nSet-Cookie: sid=VICTIM\r\n\r\n"
            };
            if n == 1 {
                return ok(
                    "Cache-Control: max-age=1\r\nETag: \"s2\"\r\n",
                    &format!("n={n}"),
                );
            }
            (r.as_bytes().to_vec(), false)
        }
        "/revary" => {
            // A 304 whose `Vary` is not the stored answer's.
            if !header(head, "if-none-match").is_empty() {
                let r = "HTTP/1.1 304 Not Modified\r\nETag: \"v\"\r\nCache-Control: max-age=60\r\nVary: Accept-Encoding\r\n\r\n";
                return (r.as_bytes().to_vec(), false);
            }
            ok(
                "Cache-Control: max-age=1\r\nETag: \"v\"\r\nVary: X-Tenant\r\n",
                &format!("n={n} tenant={}", header(head, "x-tenant")),
            )
        }
        "/whose" => {
            // A 304 that names the caller who asked.
            if !header(head, "if-none-match").is_empty() {
                let who = match header(head, "authorization") {
                    a if a.is_empty() => "nobody".to_string(),
                    a => a,
                };
                let r = format!("HTTP/1.1 304 Not Modified\r\nETag: \"w\"\r\nCache-Control: max-age=60\r\nX-User: {who}\r\n\r\n");
                return (r.into_bytes(), false);
            }
            ok(
                "Cache-Control: max-age=1\r\nETag: \"w\"\r\n",
                &format!("n={n}"),
            )
        }
        "/by-agent" => ok(
            "Cache-Control: max-age=60\r\nVary: User-Agent\r\n",
            &format!("n={n}"),
        ),
        "/prefixed" => ok(
            cc,
            &format!("n={n} prefix={}", header(head, "x-forwarded-prefix")),
        ),
        _ => ok(cc, &format!("n={n}")),
    }
}

struct Setup {
    gw: TestGateway,
    clock: Arc<ManualClock>,
    requests: Arc<AtomicUsize>,
}

async fn setup() -> Setup {
    setup_on("").await
}

/// A gateway whose listener has `listener` added to its settings.
async fn setup_on(listener: &str) -> Setup {
    let count = Arc::new(AtomicUsize::new(0));
    let c2 = count.clone();
    let (backend, _, requests) = scripted_backend(move |h, _| {
        let n = c2.fetch_add(1, Ordering::SeqCst) + 1;
        answer(h, n)
    })
    .await;
    let rest = r#"
cache: {max_size: 4MiB, max_object_size: 256KiB}
routes:
  - name: list
    path_prefix: /list
    upstream: backend
    cache: {shared: true, key_query: [page]}
  - name: open
    path_prefix: /
    upstream: backend
    cache: {shared: true}
"#;
    let cfg = format!(
        "listeners: [{{address: \"127.0.0.1:0\"{listener}}}]\nupstreams:\n  backend:\n    targets: [\"{backend}\"]\n    response_timeout: 10s\n{rest}"
    );
    let (gw, clock) = TestGateway::with_manual_clock(&cfg).await;
    Setup {
        gw,
        clock,
        requests,
    }
}

/// One request over a new connection from `from` (a loopback address), fully read.
async fn raw_from(from: &str, to: SocketAddr, head: &str) -> String {
    let sock = TcpSocket::new_v4().expect("socket");
    sock.bind(format!("{from}:0").parse().expect("addr"))
        .expect("bind");
    let mut s = sock.connect(to).await.expect("connect");
    s.write_all(head.as_bytes()).await.expect("write");
    let mut out = Vec::new();
    bounded("the answer", s.read_to_end(&mut out))
        .await
        .expect("read");
    String::from_utf8_lossy(&out).into_owned()
}

/// A GET with `Host: host` and the given extra header lines, over a new connection.
async fn get(s: &Setup, host: &str, target: &str, extra: &str) -> String {
    let head = format!("GET {target} HTTP/1.1\r\nHost: {host}\r\n{extra}Connection: close\r\n\r\n");
    raw_from("127.0.0.1", s.gw.addr, &head).await
}

fn body(answer: &str) -> &str {
    answer.split_once("\r\n\r\n").map_or("", |(_, b)| b)
}

fn upstream(s: &Setup) -> usize {
    s.requests.load(Ordering::SeqCst)
}

#[tokio::test]
async fn the_key_holds_the_host_as_sent_port_included() {
    let s = setup().await;
    let evil = get(&s, "a.test:6666", "/where", "").await;
    assert!(body(&evil).contains("host=a.test:6666"), "{evil}");
    let good = get(&s, "a.test", "/where", "").await;
    assert!(body(&good).contains("host=a.test "), "{good}");
    assert_eq!(upstream(&s), 2, "each host as sent has its own entry");
    // A client's X-Forwarded-Proto is dropped, so it keys nothing apart either way.
    let again = get(&s, "a.test", "/where", "X-Forwarded-Proto: https\r\n").await;
    assert!(body(&again).contains("proto=http"), "{again}");
    assert_eq!(upstream(&s), 2, "served from the cache");
}

#[tokio::test]
async fn a_get_asking_to_be_taken_as_another_method_is_neither_stored_nor_served_from_the_cache() {
    let s = setup().await;
    // Stored by a plain GET first: a request asking for another method is not served it.
    let plain = get(&s, "a", "/thing", "").await;
    assert!(body(&plain).contains("n=1"), "{plain}");
    for (i, name) in [
        "X-HTTP-Method-Override",
        "X-HTTP-Method",
        "X-Method-Override",
        "x_http_method_override",
    ]
    .into_iter()
    .enumerate()
    {
        let a = get(&s, "a", "/thing", &format!("{name}: DELETE\r\n")).await;
        assert!(
            a.contains("cache-status: tollgate; fwd=bypass"),
            "{name}: {a}"
        );
        let n = 2 * i + 2;
        assert_eq!(upstream(&s), n, "{name} went upstream");
        // What it got is not stored; having succeeded (a DELETE, to the upstream), it
        // invalidated what was: the next GET goes upstream too, and is stored again.
        let b = get(&s, "a", "/thing", "").await;
        assert!(body(&b).contains(&format!("n={}", n + 1)), "{name}: {b}");
    }
    // On a URI not stored yet, its answer is not stored either.
    let first = get(&s, "a", "/other", "X-HTTP-Method-Override: PUT\r\n").await;
    assert!(first.contains("fwd=bypass"), "{first}");
    let next = get(&s, "a", "/other", "").await;
    assert!(!next.contains("tollgate; hit"), "{next}");
}

#[tokio::test]
async fn keyed_query_names_match_in_every_spelling() {
    let s = setup().await;
    for evil in [
        "/list?%70age=EVIL&page=1",
        "/list?PAGE=EVIL&page=1",
        "/list?page[]=EVIL&page=1",
        "/list?page.=x&page=1",
    ] {
        let a = get(&s, "a", evil, "").await;
        assert!(a.starts_with("HTTP/1.1 200"), "{a}");
        let b = get(&s, "a", "/list?page=1", "").await;
        assert!(!body(&b).contains("EVIL"), "{evil} poisoned page=1: {b}");
    }
    // `;` inside a piece: one value to Python, Node and PHP, so never `page=1` alone; and
    // a name PHP cuts at an escaped NUL.
    for evil in [
        "/list?page=1;x=EVIL",
        "/list?x=EVIL;page=1",
        "/list?page=1&page%00=EVIL",
    ] {
        let a = get(&s, "a", evil, "").await;
        assert!(a.starts_with("HTTP/1.1 200"), "{a}");
        let b = get(&s, "a", "/list?page=1", "").await;
        assert!(!body(&b).contains("EVIL"), "{evil} poisoned page=1: {b}");
    }
    let semi = get(&s, "a", "/list?x=1;page=2", "").await;
    let amp = get(&s, "a", "/list?page=2", "").await;
    assert_ne!(body(&semi), body(&amp));
}

#[tokio::test]
async fn variants_are_judged_on_what_the_upstream_was_sent() {
    let s = setup().await;
    // The answer varies on X-Forwarded-For, which the gateway sets from the client's
    // address: a client elsewhere gets its own variant, whatever header it sends.
    let head = "GET /by-client HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n";
    let first = raw_from("127.0.0.2", s.gw.addr, head).await;
    assert!(body(&first).contains("for=127.0.0.2"), "{first}");
    let second = raw_from("127.0.0.1", s.gw.addr, head).await;
    assert!(body(&second).contains("for=127.0.0.1"), "{second}");
    let forged = "GET /by-client HTTP/1.1\r\nHost: a\r\nX-Forwarded-For: 127.0.0.2\r\nConnection: close\r\n\r\n";
    let third = raw_from("127.0.0.1", s.gw.addr, forged).await;
    assert!(body(&third).contains("for=127.0.0.1"), "{third}");
    assert_eq!(upstream(&s), 2);
}

#[tokio::test]
async fn a_client_that_does_not_read_stalls_no_one() {
    let s = setup_on(", h2c: true").await;
    // An HTTP/2 client that grants no window leads the fill of a 200 KB answer.
    let mut h2 = TcpStream::connect(s.gw.addr).await.expect("connect");
    let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    // SETTINGS_INITIAL_WINDOW_SIZE = 0.
    out.extend([0, 0, 6, 4, 0, 0, 0, 0, 0, 0, 4, 0, 0, 0, 0]);
    // HEADERS: GET http `/big`, `:authority: a`.
    let block = [
        0x82, 0x86, 0x04, 0x04, b'/', b'b', b'i', b'g', 0x41, 0x01, b'a',
    ];
    out.extend([0, 0, block.len() as u8, 1, 5, 0, 0, 0, 1]);
    out.extend(block);
    h2.write_all(&out).await.expect("write");
    // The first answer's head (HEADERS on stream 1) arrives: the fill is under way.
    bounded("the answer's head", async {
        let mut frames = Frames::default();
        while let Some((k, _, id, _)) = frames.next(&mut h2).await {
            if k == 1 && id == 1 {
                return;
            }
        }
        panic!("closed");
    })
    .await;
    let other = get(&s, "a", "/big", "").await;
    assert!(other.starts_with("HTTP/1.1 200"), "{other:.200}");
    assert_eq!(body(&other).len(), 200_000);
    assert_eq!(
        upstream(&s),
        1,
        "the waiting request was served from the fill"
    );
    // An answer that turns out larger than max_object_size marks its key to pass.
    let huge = get(&s, "a", "/huge", "").await;
    assert_eq!(body(&huge).matches('h').count(), 400_000);
    // Its length was unknown when the head went out: it was not said to be stored.
    assert!(
        huge.contains("cache-status: tollgate; fwd=uri-miss\r\n"),
        "{:.300}",
        huge
    );
    let again = get(&s, "a", "/huge", "").await;
    assert!(
        again.contains("cache-status: tollgate; fwd=uri-miss\r\n"),
        "{:.300}",
        again
    );
}

#[tokio::test]
async fn a_clients_own_directives_decide_nothing_for_the_key() {
    let s = setup().await;
    for (what, extra) in [
        ("no-store", "Cache-Control: no-store\r\n"),
        ("a conditional", "If-None-Match: \"e\"\r\n"),
        ("a range", "Range: bytes=0-0\r\n"),
    ] {
        let target = format!("/shaped?{}", what.replace(' ', "-"));
        let before = upstream(&s);
        let first = get(&s, "a", &target, extra).await;
        if what == "a conditional" {
            // Fetched whole and stored; the client's own conditional still gets its 304.
            assert!(first.starts_with("HTTP/1.1 304"), "{first}");
            assert!(first.contains("; stored"), "{first}");
        }
        get(&s, "a", &target, "").await;
        let hit = get(&s, "a", &target, "").await;
        assert!(hit.contains("tollgate; hit"), "{what}: {hit:.300}");
        assert!(upstream(&s) <= before + 2, "{what}");
    }
}

#[tokio::test]
async fn unique_urls_that_are_never_stored_grow_no_index() {
    let s = setup().await;
    let c = TestClient::default();
    for i in 0..2_000 {
        let a = c.get(&s.gw.url(&format!("/nostore?u={i}"))).await;
        assert_eq!(a.status.as_u16(), 200);
    }
    let m = s.gw.gw.metrics_text();
    let uris: u64 = m
        .lines()
        .find_map(|l| l.strip_prefix("tollgate_cache_index_uris "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no index gauge in {m}"));
    assert!(uris < 16, "{uris} URIs indexed for nothing stored");
}

#[tokio::test]
async fn a_uri_longer_than_a_request_line_is_not_kept() {
    let s = setup().await;
    let long = format!("/{}", "l".repeat(9 * 1024));
    for n in 1..=2 {
        let a = get(&s, "a", &long, "").await;
        assert!(body(&a).starts_with(&format!("n={n}")), "{a:.200}");
        assert_eq!(
            header(&a, "cache-status"),
            "tollgate; fwd=uri-miss",
            "not stored"
        );
    }
    assert_eq!(upstream(&s), 2);
    // One just under the limit is kept as any other.
    let short = format!("/{}", "s".repeat(7 * 1024));
    get(&s, "a", &short, "").await;
    get(&s, "a", &short, "").await;
    assert_eq!(upstream(&s), 3);
}

#[tokio::test]
async fn the_rest_of_rfc_9111() {
    let s = setup().await;
    // Age: only a plain non-negative integer counts (the first member of a list).
    get(&s, "a", "/quoted-age", "").await;
    let a = get(&s, "a", "/quoted-age", "").await;
    assert!(
        a.contains("tollgate; hit"),
        "a quoted Age is ignored: {a:.300}"
    );
    get(&s, "a", "/listed-age", "").await;
    let a = get(&s, "a", "/listed-age", "").await;
    assert!(
        !a.contains("tollgate; hit"),
        "Age 7200, 10 is 7200: {a:.300}"
    );
    // Targeted fields take over from Cache-Control. What of Surrogate-Control is the
    // gateway's is not passed on; what is another device's is.
    let miss = get(&s, "a", "/surrogate", "").await;
    let hit = get(&s, "a", "/surrogate", "").await;
    assert!(hit.contains("tollgate; hit"), "{hit:.300}");
    for a in [&miss, &hit] {
        assert!(
            a.contains("surrogate-control: max-age=5;edge2\r\n"),
            "{a:.300}"
        );
    }
    get(&s, "a", "/cdn", "").await;
    assert!(!get(&s, "a", "/cdn", "").await.contains("tollgate; hit"));
    // must-understand on a status it knows: no-store is ignored.
    get(&s, "a", "/understood", "").await;
    assert!(get(&s, "a", "/understood", "")
        .await
        .contains("tollgate; hit"));
    // A range of a stored whole answer, from the store.
    get(&s, "a", "/digits", "").await;
    let r = get(&s, "a", "/digits", "Range: bytes=2-4\r\n").await;
    assert!(r.starts_with("HTTP/1.1 206"), "{r}");
    assert!(r.contains("content-range: bytes 2-4/10"), "{r}");
    assert_eq!(body(&r), "234");
    let r = get(&s, "a", "/digits", "Range: bytes=-3\r\n").await;
    assert_eq!(body(&r), "789");
    let r = get(&s, "a", "/digits", "Range: bytes=20-\r\n").await;
    assert!(r.starts_with("HTTP/1.1 416"), "{r}");
    assert!(r.contains("content-range: bytes */10"), "{r}");
    // A 304 does not replace what describes the stored body.
    let first = get(&s, "a", "/gzip", "").await;
    s.clock.advance(Duration::from_secs(5));
    let refreshed = get(&s, "a", "/gzip", "").await;
    assert!(refreshed.contains("fwd-status=304"), "{refreshed}");
    assert!(!refreshed.contains("content-encoding"), "{refreshed}");
    assert_eq!(body(&refreshed), body(&first));
    // A 304 naming another entity tag refreshes nothing: the whole answer is fetched.
    let first = get(&s, "a", "/retagged", "").await;
    s.clock.advance(Duration::from_secs(5));
    let again = get(&s, "a", "/retagged", "").await;
    assert!(again.starts_with("HTTP/1.1 200"), "{again}");
    assert_ne!(body(&again), body(&first), "{again}");
    // Any method not defined as safe invalidates, unknown ones too.
    let before = upstream(&s);
    get(&s, "a", "/m", "").await;
    let m_search = "M-SEARCH /m HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n";
    let r = raw_from("127.0.0.1", s.gw.addr, m_search).await;
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    get(&s, "a", "/m", "").await;
    assert_eq!(upstream(&s), before + 3, "M-SEARCH invalidated /m");
}

#[tokio::test]
async fn a_304_that_sets_a_cookie_refreshes_no_shared_entry() {
    let s = setup().await;
    get(&s, "a", "/session", "").await;
    s.clock.advance(Duration::from_secs(5));
    // The victim's revalidation: its 304 carries the victim's session.
    let victim = get(&s, "a", "/session", "").await;
    assert!(victim.starts_with("HTTP/1.1 200"), "{victim}");
    let next = get(&s, "a", "/session", "").await;
    assert!(
        !next.contains("VICTIM"),
        "another client got the session: {next}"
    );
}

#[tokio::test]
async fn a_304_with_another_vary_does_not_file_one_tenants_answer_for_all() {
    let s = setup().await;
    let a = get(&s, "a", "/revary", "X-Tenant: a\r\n").await;
    assert!(body(&a).contains("tenant=a"), "{a}");
    s.clock.advance(Duration::from_secs(5));
    // Tenant a's revalidation gets a 304 whose `Vary` leaves the tenant out.
    let again = get(&s, "a", "/revary", "X-Tenant: a\r\n").await;
    assert!(body(&again).contains("tenant=a"), "{again}");
    let b = get(&s, "a", "/revary", "X-Tenant: b\r\n").await;
    assert!(
        body(&b).contains("tenant=b"),
        "tenant b got another tenant's answer: {b}"
    );
}

#[tokio::test]
async fn a_304_to_a_request_with_authorization_refreshes_no_shared_entry() {
    let s = setup().await;
    get(&s, "a", "/whose", "").await;
    s.clock.advance(Duration::from_secs(5));
    let alice = get(&s, "a", "/whose", "Authorization: Basic YWxpY2U6eA==\r\n").await;
    assert!(alice.starts_with("HTTP/1.1 200"), "{alice}");
    let next = get(&s, "a", "/whose", "").await;
    assert!(next.starts_with("HTTP/1.1 200"), "{next}");
    assert!(
        !next.contains("YWxpY2U6eA=="),
        "another client got alice's headers: {next}"
    );
}

#[tokio::test]
async fn a_304_to_the_whole_answer_asked_for_again_refreshes_nothing() {
    let s = setup().await;
    let first = get(&s, "a", "/session-again", "").await;
    assert!(body(&first).contains("n=1"), "{first}");
    s.clock.advance(Duration::from_secs(5));
    // The revalidation's 304 sets a cookie, so the whole answer is asked for: that one is
    // a 304 too, to a request that was not conditional.
    get(&s, "a", "/session-again", "").await;
    // The entry was not refreshed: the next client is not served it with the cookie (it
    // asks the upstream again, and gets that upstream's own answer).
    let next = get(&s, "a", "/session-again", "").await;
    assert!(
        !next.to_ascii_lowercase().contains("tollgate; hit"),
        "the shared entry took a 304's headers: {next}"
    );
}

#[tokio::test]
async fn variants_of_long_or_undecodable_values_are_kept_apart() {
    let s = setup().await;
    let long = |c: char| format!("User-Agent: {}\r\n", c.to_string().repeat(5000));
    let a = get(&s, "a", "/by-agent", &long('a')).await;
    let b = get(&s, "a", "/by-agent", &long('b')).await;
    assert_ne!(body(&a), body(&b), "two long values shared a variant");
    let again = get(&s, "a", "/by-agent", &long('a')).await;
    assert_eq!(body(&again), body(&a), "the same long value is one variant");
    // Bytes that are not UTF-8: each its own variant.
    let raw = |v: &[u8]| {
        let mut head = b"GET /by-agent HTTP/1.1\r\nHost: a\r\nUser-Agent: ".to_vec();
        head.extend_from_slice(v);
        head.extend_from_slice(b"\r\nConnection: close\r\n\r\n");
        head
    };
    let x80 = raw_bytes(s.gw.addr, &raw(b"\x80")).await;
    let x81 = raw_bytes(s.gw.addr, &raw(b"\x81")).await;
    assert!(x80.starts_with("HTTP/1.1 200"), "{x80}");
    assert_ne!(body(&x80), body(&x81), "\\x80 and \\x81 shared a variant");
}

/// Sends `head` as it is and reads the answer to its end.
async fn raw_bytes(to: SocketAddr, head: &[u8]) -> String {
    let mut c = TcpStream::connect(to).await.expect("connect");
    c.write_all(head).await.expect("write");
    let mut out = Vec::new();
    c.read_to_end(&mut out).await.expect("read");
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test]
async fn what_a_trusted_proxy_forwards_is_keyed_too() {
    let s = setup_on(", trusted_proxies: [127.0.0.1/32]").await;
    let evil = get(&s, "a", "/prefixed", "X-Forwarded-Prefix: /evil\r\n").await;
    assert!(body(&evil).contains("prefix=/evil"), "{evil}");
    let plain = get(&s, "a", "/prefixed", "").await;
    assert!(!body(&plain).contains("/evil"), "{plain}");
    // The scheme the upstream is told: an answer to https is never one to http.
    let https = get(&s, "a", "/where", "X-Forwarded-Proto: https\r\n").await;
    assert!(body(&https).contains("proto=https"), "{https}");
    let http = get(&s, "a", "/where", "X-Forwarded-Proto: http\r\n").await;
    assert!(body(&http).contains("proto=http"), "{http}");
    assert!(!body(&http).contains("proto=https"), "{http}");
}
