//! The admin dashboard in a real headless browser (Debian's `chromium`; `scripts/test`
//! installs it): the numbers it renders are the numbers `/metrics` gives.

mod common;

use common::*;
use http::{Method, StatusCode};
use std::process::Command;
use tollgate_gateway::ManualClock;

const TOKEN: &str = "dash-token-1";

fn browser() -> &'static str {
    for b in ["chromium", "chromium-browser", "google-chrome"] {
        if Command::new(b).arg("--version").output().is_ok() {
            return b;
        }
    }
    panic!(
        "the dashboard test needs chromium (scripts/test installs it: apt-get install chromium)"
    );
}

/// Loads `url` in headless chromium, lets its scripts run for a few (virtual) seconds, and
/// returns the DOM.
fn render(url: &str) -> String {
    // A profile of its own per page: the tests of this file run at once, and chromium
    // refuses a profile another instance holds.
    static PAGES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let page = PAGES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let profile =
        std::env::temp_dir().join(format!("tollgate-chromium-{}-{page}", std::process::id()));
    let out = Command::new("timeout")
        .arg("90")
        .arg(browser())
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--virtual-time-budget=4000",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(["--dump-dom", url])
        .output()
        .expect("run chromium");
    let _ = std::fs::remove_dir_all(&profile);
    assert!(
        out.status.success(),
        "chromium failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The text of the element with `id` in `dom`.
fn text_of(dom: &str, id: &str) -> String {
    let at = dom
        .find(&format!("id=\"{id}\""))
        .unwrap_or_else(|| panic!("no #{id} in the page"));
    let rest = &dom[at..];
    let start = rest.find('>').expect("tag end") + 1;
    let end = rest[start..].find('<').expect("text end");
    rest[start..start + end].trim().to_string()
}

/// A number as the page prints it (thin spaces between thousands).
fn number(s: &str) -> f64 {
    s.replace([' ', '\u{a0}'], "")
        .trim_end_matches(" %")
        .trim_end_matches('%')
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("not a number: {s:?}"))
}

/// The sum of every sample of `name` whose labels contain `filter`.
fn metric(text: &str, name: &str, filter: &str) -> f64 {
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|r| r.starts_with('{') || r.starts_with(' '))
                && l.contains(filter)
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_shows_what_metrics_says() {
    let backend = echo_backend().await;
    let cfg = yaml(
        backend,
        r#"
plans:
  tiny: {limits: [{name: five-a-minute, requests: 5, per: 60s}]}
consumers:
  - {name: alice, keys: [alice-key], plan: tiny}
routes:
  - name: api
    path_prefix: /api/
    upstream: backend
    auth: {query: [apikey]}
  - name: cached
    path_prefix: /cached/
    upstream: backend
    cache: {default_ttl: 60s, shared: true}
"#,
    );
    let clock = ManualClock::new();
    let gw = TestGateway::start(&cfg, clock.clone()).await;
    let admin = start_admin(&gw.gw, Some(TOKEN)).await;

    // A little load: passes, refusals of each kind, cache hits and a miss.
    let c = TestClient::default();
    for _ in 0..7 {
        let _ = c.get(&gw.url("/api/x?apikey=alice-key")).await;
    }
    for _ in 0..3 {
        let _ = c.get(&gw.url("/api/x")).await;
    }
    for _ in 0..4 {
        assert_eq!(c.get(&gw.url("/cached/a")).await.status, StatusCode::OK);
    }
    let _ = c.get(&gw.url("/nowhere")).await;

    // The gateway kept the last seconds: the charts start from them, not empty.
    for _ in 0..4 {
        gw.gw.sample_series();
        let _ = c.get(&gw.url("/cached/a")).await;
        clock.advance(std::time::Duration::from_secs(1));
    }
    let dom =
        tokio::task::spawn_blocking(move || render(&format!("http://{admin}/#token={TOKEN}")))
            .await
            .expect("render");
    assert!(
        dom.contains("data-ready=\"1\""),
        "the page never rendered data:\n{dom}"
    );
    // Three seconds at least (the admin listener's own once-a-second sample may add one).
    let history: usize = dom
        .split("data-history=\"")
        .nth(1)
        .and_then(|r| r.split('"').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(
        history >= 3,
        "the charts did not start from the kept seconds:\n{dom}"
    );

    let m = c
        .request(
            Method::GET,
            &format!("http://{admin}/metrics"),
            &[("authorization", &format!("Bearer {TOKEN}"))],
            "",
        )
        .await
        .body;
    let total = metric(&m, "tollgate_requests_total", "");
    assert_eq!(total, 19.0, "{m}");
    assert_eq!(number(&text_of(&dom, "total-requests")), total);
    for class in ["2xx", "4xx"] {
        assert_eq!(
            number(&text_of(&dom, &format!("status-{class}"))),
            metric(&m, "tollgate_requests_total", &format!("class=\"{class}\"")),
            "{class}"
        );
    }
    let hits = metric(&m, "tollgate_cache_hits_total", "");
    let misses = metric(&m, "tollgate_cache_misses_total", "");
    assert_eq!((hits, misses), (7.0, 1.0), "{m}");
    assert_eq!(number(&text_of(&dom, "cache-hit-ratio")), 87.5);
    assert_eq!(text_of(&dom, "generation"), "1");
    assert_eq!(text_of(&dom, "redis"), "not used");
    // Refusals by limit, as a table row.
    assert_eq!(
        metric(&m, "tollgate_limit_refusals_total", "five-a-minute"),
        2.0
    );
    assert!(
        dom.contains("<td>five-a-minute</td><td class=\"n\">2</td>"),
        "{dom}"
    );
    // Closest to quota: alice used all five.
    assert!(
        dom.contains("<td>alice</td><td class=\"n\">five-a-minute</td>"),
        "{dom}"
    );

    // A token given as `?token=` is taken too (and moved out of the address).
    let dom =
        tokio::task::spawn_blocking(move || render(&format!("http://{admin}/?token={TOKEN}")))
            .await
            .expect("render");
    assert!(dom.contains("data-ready=\"1\""), "{dom}");

    // Without the token the page asks for it and shows no data.
    let dom = tokio::task::spawn_blocking(move || render(&format!("http://{admin}/")))
        .await
        .expect("render");
    assert!(dom.contains("data-ready=\"0\""));
    assert!(
        dom.contains("id=\"login\" style=\"display: flex;\""),
        "{dom}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_names_the_redis_cluster_a_node_uses() {
    let cluster = common::redis_cluster::RedisCluster::start("dashboard-cluster", false);
    let backend = echo_backend().await;
    let cfg = yaml(
        backend,
        &format!(
            "cluster: {{redis: {{cluster_nodes: [{}]}}, sync_interval: 5ms, key_prefix: dash}}\nroutes:\n  - {{name: api, path_prefix: /api/, upstream: backend}}\n",
            cluster.seeds()
        ),
    );
    let gw = TestGateway::start(&cfg, ManualClock::new()).await;
    let admin = start_admin(&gw.gw, Some(TOKEN)).await;
    let up = "tollgate_cluster_redis_up 1";
    assert!(metrics_with(&gw.gw, up).await.contains(up));
    bounded("the masters known", async {
        let c = gw.gw.cluster().expect("cluster");
        let mut rounds = c.rounds();
        while c.server().slots != 16384 {
            let _ = rounds.changed().await;
        }
    })
    .await;
    let dom =
        tokio::task::spawn_blocking(move || render(&format!("http://{admin}/#token={TOKEN}")))
            .await
            .expect("render");
    let redis = text_of(&dom, "redis");
    assert!(
        redis.starts_with("up · 3 masters, 16") && redis.ends_with(" slots"),
        "{redis}"
    );
}
