//! Hot reload and graceful shutdown.

mod common;

use common::*;
use http::StatusCode;
use std::net::SocketAddr;
use std::time::Duration;
use tollgate_gateway::SystemClock;

fn two_routes(backend: SocketAddr, limit: u64, with_b: bool) -> String {
    let b = if with_b {
        "  - {name: b, path_prefix: /b/, upstream: backend}\n"
    } else {
        ""
    };
    yaml(
        backend,
        &format!(
            "plans:\n  gold: {{limits: [{{requests: {limit}, per: 1s}}]}}\nconsumers:\n  - {{name: alice, keys: [t1], plan: gold}}\nroutes:\n  - {{name: a, path_prefix: /a/, upstream: backend, auth: {{}}}}\n{b}"
        ),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_under_load_fails_no_request() {
    let backend = echo_backend().await;
    let gw = TestGateway::start(&two_routes(backend, 1_000_000, true), SystemClock::new()).await;
    let url = gw.url("/a/?apikey=t1");
    let mut workers = Vec::new();
    for _ in 0..8 {
        let url = url.clone();
        workers.push(tokio::spawn(async move {
            let c = TestClient::default();
            let mut bad = Vec::new();
            for _ in 0..300 {
                let a = c.get(&url).await;
                if a.status != StatusCode::OK {
                    bad.push(a.status);
                }
            }
            bad
        }));
    }
    // Alternate between two valid configs while the load runs (bounded).
    let mut reloads = 0u32;
    while !workers.iter().all(|w| w.is_finished()) && reloads < 20_000 {
        gw.apply(&two_routes(
            backend,
            1_000_000 + u64::from(reloads % 2),
            reloads.is_multiple_of(2),
        ));
        reloads += 1;
        tokio::task::yield_now().await;
    }
    let mut failed = 0;
    for w in workers {
        failed += w.await.expect("worker").len();
    }
    assert!(reloads >= 10, "reloads overlapped the load: {reloads}");
    assert_eq!(failed, 0, "2400 requests during {reloads} reloads");
}

#[tokio::test]
async fn a_bad_file_is_rejected_and_the_old_config_keeps_serving() {
    let backend = echo_backend().await;
    let gw = TestGateway::start(&two_routes(backend, 100, true), SystemClock::new()).await;
    let dir = std::env::temp_dir().join(format!("tollgate-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let path = dir.join("bad.yaml");
    std::fs::write(
        &path,
        two_routes(backend, 100, true)
            .replace("upstream: backend, auth", "upstream: nowhere, auth"),
    )
    .expect("write");
    let err = gw.gw.reload_file(&path).expect_err("must be rejected");
    assert!(
        err.to_string()
            .contains("routes[0].upstream: unknown upstream \"nowhere\""),
        "{err}"
    );
    let status = gw.gw.reloads().borrow().clone();
    assert_eq!(status.generation, 1);
    assert!(status.last_error.is_some());
    // The same content rejected the same way again (the watcher after `SIGHUP`) is tried
    // and refused, but counted once.
    gw.gw.reload_file(&path).expect_err("still rejected");
    let errors = |gw: &TestGateway| {
        gw.gw
            .metrics_text()
            .lines()
            .find_map(|l| l.strip_prefix("tollgate_config_reload_errors_total "))
            .map(str::to_string)
    };
    assert_eq!(errors(&gw).as_deref(), Some("1"));
    let c = TestClient::default();
    assert_eq!(c.get(&gw.url("/a/?apikey=t1")).await.status, StatusCode::OK);
    assert_eq!(c.get(&gw.url("/b/")).await.status, StatusCode::OK);

    std::fs::write(&path, two_routes(backend, 100, false)).expect("write");
    gw.gw.reload_file(&path).expect("valid");
    assert_eq!(gw.gw.reloads().borrow().generation, 2);
    // After a success, the same bad content is a new rejection.
    std::fs::write(&path, "routes: [").expect("write");
    gw.gw.reload_file(&path).expect_err("rejected");
    gw.gw.reload_file(&path).expect_err("rejected");
    assert_eq!(errors(&gw).as_deref(), Some("2"));
    assert_eq!(c.get(&gw.url("/b/")).await.status, StatusCode::NOT_FOUND);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_changed_file_is_reloaded() {
    let backend = echo_backend().await;
    let gw = TestGateway::start(&two_routes(backend, 100, true), SystemClock::new()).await;
    let dir = std::env::temp_dir().join(format!("tollgate-watch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let path = dir.join("tollgate.yaml");
    let first = two_routes(backend, 100, true);
    std::fs::write(&path, &first).expect("write");
    let mut reloads = gw.gw.reloads();
    gw.gw.loaded_from(first.as_bytes());
    let watcher = tollgate_gateway::watch::watch_file(
        gw.gw.clone(),
        path.clone(),
        Duration::from_millis(20),
        Duration::from_secs(3),
    );
    // A slow editor adds route c: the file is cut after route a (a valid config without
    // route b), then, after a pause longer than a look, written whole. The half must never
    // be applied. The settle time (3 s) leaves a busy machine ample room around the pause.
    let second = format!("{first}  - {{name: c, path_prefix: /c/, upstream: backend}}\n");
    let half = &second[..second.find("  - {name: b").expect("route b")];
    std::fs::write(&path, half).expect("write");
    tokio::time::sleep(Duration::from_millis(100)).await;
    std::fs::write(&path, &second).expect("write");
    bounded(
        "reload after the file changed",
        reloads.wait_for(|s| s.generation == 2),
    )
    .await
    .expect("watch");
    let c = TestClient::default();
    assert_eq!(c.get(&gw.url("/c/")).await.status, StatusCode::OK);
    assert_eq!(c.get(&gw.url("/b/")).await.status, StatusCode::OK);
    assert_eq!(reloads.borrow().generation, 2, "one change, one reload");
    // SIGHUP after the change has been applied: the same content is not applied again.
    gw.gw.reload_file(&path).expect("reload");
    assert_eq!(gw.gw.reloads().borrow().generation, 2);
    // A broken edit is reported and changes nothing.
    std::fs::write(&path, "routes: [").expect("write");
    bounded(
        "bad edit noticed",
        reloads.wait_for(|s| s.last_error.is_some()),
    )
    .await
    .expect("watch");
    assert_eq!(gw.gw.reloads().borrow().generation, 2);
    assert_eq!(
        TestClient::default()
            .get(&gw.url("/a/?apikey=t1"))
            .await
            .status,
        StatusCode::OK
    );
    watcher.abort();
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn in_flight_requests_finish_on_the_config_they_started_with() {
    let (gated, mut arrived, release) = gated_backend().await;
    let other = echo_backend().await;
    let gw = TestGateway::start(&two_routes(gated, 100, true), SystemClock::new()).await;
    let url = gw.url("/b/slow");
    let inflight = tokio::spawn(async move { TestClient::default().get(&url).await });
    bounded("request reached the backend", arrived.recv()).await;
    // The new config drops /b/ and points elsewhere.
    gw.apply(&two_routes(other, 100, false));
    assert_eq!(
        TestClient::default().get(&gw.url("/b/slow")).await.status,
        StatusCode::NOT_FOUND
    );
    release.notify_one();
    let a = bounded("in-flight answer", inflight).await.expect("join");
    assert_eq!((a.status, a.body.as_str()), (StatusCode::OK, "late"));
}

#[tokio::test]
async fn shutdown_drains_in_flight_requests_and_stops_accepting() {
    let (gated, mut arrived, release) = gated_backend().await;
    let mut gw = TestGateway::start(&two_routes(gated, 100, true), SystemClock::new()).await;
    let url = gw.url("/b/slow");
    let inflight = tokio::spawn(async move { TestClient::default().get(&url).await });
    bounded("request reached the backend", arrived.recv()).await;
    let server = gw.server.take().expect("server");
    let addr = gw.addr;
    let shutdown = tokio::spawn(server.shutdown(Duration::from_secs(10)));
    // New connections are refused once the listener is closed.
    bounded("listener closed", async {
        while tokio::net::TcpStream::connect(addr).await.is_ok() {
            tokio::task::yield_now().await;
        }
    })
    .await;
    assert!(!shutdown.is_finished(), "waits for the in-flight request");
    release.notify_one();
    let a = bounded("in-flight answer", inflight).await.expect("join");
    assert_eq!((a.status, a.body.as_str()), (StatusCode::OK, "late"));
    assert!(
        bounded("drained", shutdown).await.expect("join"),
        "drained in time"
    );
}

#[tokio::test]
async fn shutdown_gives_up_after_the_drain_time() {
    let (gated, mut arrived, _release) = gated_backend().await;
    let mut gw = TestGateway::start(&two_routes(gated, 100, true), SystemClock::new()).await;
    let url = gw.url("/b/stuck");
    let _inflight = tokio::spawn(async move { TestClient::default().get(&url).await });
    bounded("request reached the backend", arrived.recv()).await;
    let server = gw.server.take().expect("server");
    let drained = bounded("shutdown", server.shutdown(Duration::from_millis(100))).await;
    assert!(
        !drained,
        "a stuck request cannot hold shutdown past the drain time"
    );
}
