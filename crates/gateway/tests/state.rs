//! Limit counters kept in the state file: restored by the next gateway on the same file
//! while their windows last, not for a changed limit, and a state file that cannot be read
//! is set aside while the gateway serves with empty counters.

mod common;

use common::*;
use http::StatusCode;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tollgate_gateway::ManualClock;

fn stateful(backend: std::net::SocketAddr, state: &Path, limits: &str) -> String {
    yaml(
        backend,
        &format!(
            r#"
state: {{path: {state:?}, flush_interval: 1h}}
plans:
  gold: {{limits: {limits}}}
consumers:
  - {{name: alice, keys: [t1], plan: gold}}
  - {{name: bob, keys: [t2], plan: gold}}
routes:
  - {{name: api, path_prefix: /api/, upstream: backend, auth: {{}},
      limits: [{{requests: 100, per: 1s, name: burst}}]}}
"#
        ),
    )
}

async fn codes(gw: &TestGateway, key: &str, n: usize) -> Vec<u16> {
    let c = TestClient::default();
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(
            c.get(&gw.url(&format!("/api/?apikey={key}")))
                .await
                .status
                .as_u16(),
        );
    }
    out
}

/// A gateway on `yaml` whose clock starts at `at` (both monotonic and wall).
async fn start_at(yaml: &str, at: Duration) -> (TestGateway, Arc<ManualClock>) {
    let clock = ManualClock::new();
    clock.advance(at);
    (TestGateway::start(yaml, clock.clone()).await, clock)
}

#[tokio::test]
async fn a_month_quota_is_restored_by_the_next_gateway_and_passed_windows_are_not() {
    let backend = echo_backend().await;
    let dir = tempdir("state-restore");
    let db = dir.join("state.db");
    let cfg = stateful(
        backend,
        &db,
        "[{requests: 5, per: 30d, name: month}, {requests: 3, per: 10s, name: short}]",
    );
    let day = Duration::from_secs(86_400);
    let (gw, _clock) = start_at(&cfg, 100 * day).await;
    assert_eq!(codes(&gw, "t1", 3).await, [200, 200, 200]);
    assert_eq!(codes(&gw, "t2", 1).await, [200]);
    gw.gw.flush_all().await;
    drop(gw);

    // A day later: the month quota remembers 3 of 5; the 10 s window has passed.
    let (gw, _clock) = start_at(&cfg, 101 * day).await;
    let a = TestClient::default().get(&gw.url("/api/?apikey=t1")).await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(a.header("ratelimit"), "\"month\";r=1;t=2678400");
    assert_eq!(codes(&gw, "t1", 2).await, [200, 429]);
    assert_eq!(codes(&gw, "t2", 3).await, [200, 200, 200]);
    let refused = TestClient::default().get(&gw.url("/api/?apikey=t2")).await;
    assert!(
        refused.body.contains("\"limit\":\"short\""),
        "{}",
        refused.body
    );
    // Written again on the way out, including what the restored counts became.
    assert!(gw.gw.flush_state() >= 2);
    drop(gw);

    // Once the month has passed, nothing is restored.
    let (gw, _clock) = start_at(&cfg, 132 * day).await;
    assert_eq!(codes(&gw, "t1", 3).await, [200; 3]);
    drop(gw);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_raised_limit_keeps_its_counts_across_a_restart_and_a_new_window_starts_from_zero() {
    let backend = echo_backend().await;
    let dir = tempdir("state-changed");
    let db = dir.join("state.db");
    let at = Duration::from_secs(1_000_000);
    let (gw, _) = start_at(&stateful(backend, &db, "[{requests: 2, per: 1d}]"), at).await;
    assert_eq!(codes(&gw, "t1", 3).await, [200, 200, 429]);
    gw.gw.flush_all().await;
    drop(gw);
    // The two calls made count against three.
    let (gw, _) = start_at(&stateful(backend, &db, "[{requests: 3, per: 1d}]"), at).await;
    assert_eq!(codes(&gw, "t1", 2).await, [200, 429]);
    gw.gw.flush_all().await;
    drop(gw);
    // Another window is another limit.
    let (gw, _) = start_at(&stateful(backend, &db, "[{requests: 3, per: 2d}]"), at).await;
    assert_eq!(codes(&gw, "t1", 4).await, [200, 200, 200, 429]);
    drop(gw);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn an_unreadable_state_file_is_set_aside_and_the_gateway_serves_from_zero() {
    let backend = echo_backend().await;
    let dir = tempdir("state-corrupt");
    let db = dir.join("state.db");
    std::fs::write(
        &db,
        b"this is not a database, and it is long enough to look like one...",
    )
    .expect("write");
    let cfg = stateful(backend, &db, "[{requests: 2, per: 1d}]");
    let (gw, _) = start_at(&cfg, Duration::from_secs(1_000)).await;
    assert_eq!(codes(&gw, "t1", 3).await, [200, 200, 429]);
    let metrics = gw.gw.metrics_text();
    assert!(
        metrics.contains("tollgate_state_errors_total 1"),
        "{metrics}"
    );
    assert!(dir.join("state.db.corrupt").exists());
    // The new file works: the counts (plan and route limit) survive the next start.
    assert_eq!(gw.gw.flush_state(), 2);
    drop(gw);
    let (gw, _) = start_at(&cfg, Duration::from_secs(1_000)).await;
    assert_eq!(codes(&gw, "t1", 1).await, [429]);
    drop(gw);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_state_path_that_cannot_be_written_is_counted_and_serving_goes_on() {
    let backend = echo_backend().await;
    let dir = tempdir("state-readonly");
    // In a folder that does not exist: SQLite cannot make the file.
    let db = dir.join("missing").join("state.db");
    let cfg = stateful(backend, &db, "[{requests: 2, per: 1d}]");
    let (gw, _) = start_at(&cfg, Duration::from_secs(1_000)).await;
    assert_eq!(codes(&gw, "t1", 3).await, [200, 200, 429]);
    assert_eq!(gw.gw.flush_state(), 0);
    let metrics = gw.gw.metrics_text();
    let errors: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("tollgate_state_errors_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    assert!(errors >= 2, "{metrics}");
    assert_eq!(codes(&gw, "t2", 1).await, [200]);
    drop(gw);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn idle_counters_are_retired_and_made_again_on_the_next_call() {
    let backend = echo_backend().await;
    let cfg = yaml(
        backend,
        r#"
plans:
  gold: {limits: [{requests: 2, per: 10s}]}
consumers:
  - {name: alice, keys: [t1], plan: gold}
routes:
  - {name: api, path_prefix: /api/, upstream: backend, auth: {}}
"#,
    );
    let (gw, clock) = TestGateway::with_manual_clock(&cfg).await;
    // Calls within one sub-window (a tenth of the window) are counted without a cell.
    assert_eq!(codes(&gw, "t1", 1).await, [200]);
    assert!(gw.gw.metrics_text().contains("tollgate_limit_cells 0"));
    // A call in a later one, while the first still counts, needs the whole window.
    clock.advance(Duration::from_secs(1));
    assert_eq!(codes(&gw, "t1", 2).await, [200, 429]);
    assert!(gw.gw.metrics_text().contains("tollgate_limit_cells 1"));
    // Still counting: nothing retired.
    assert_eq!(gw.gw.sweep(), 0);
    // The second call stops counting 11 s after its sub-window began.
    clock.advance(Duration::from_secs(11));
    assert_eq!(gw.gw.sweep(), 1);
    assert!(gw.gw.metrics_text().contains("tollgate_limit_cells 0"));
    assert_eq!(codes(&gw, "t1", 3).await, [200, 200, 429]);
    assert!(gw.gw.metrics_text().contains("tollgate_limit_cells 0"));
}

#[tokio::test]
async fn a_state_path_that_is_a_folder_keeps_the_counters_in_a_file_inside_it() {
    let backend = echo_backend().await;
    let dir = tempdir("state-folder");
    let folder = dir.join("state");
    std::fs::create_dir(&folder).expect("mkdir");
    std::fs::write(folder.join("notes.txt"), b"kept").expect("write");
    let cfg = stateful(backend, &folder, "[{requests: 2, per: 1d}]");
    let (gw, _) = start_at(&cfg, Duration::from_secs(1_000)).await;
    assert_eq!(codes(&gw, "t1", 1).await, [200]);
    assert_eq!(gw.gw.flush_state(), 2);
    let metrics = gw.gw.metrics_text();
    assert!(
        metrics.contains("tollgate_state_errors_total 0"),
        "{metrics}"
    );
    drop(gw);
    // The folder is left as it was, with the state file beside what it held.
    assert!(folder.join("state.db").is_file());
    assert_eq!(
        std::fs::read(folder.join("notes.txt")).expect("read"),
        b"kept"
    );
    assert!(!dir.join("state.corrupt").exists());
    let (gw, _) = start_at(&cfg, Duration::from_secs(1_000)).await;
    assert_eq!(codes(&gw, "t1", 2).await, [200, 429]);
    drop(gw);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_database_of_another_shape_is_set_aside_like_a_damaged_one() {
    let backend = echo_backend().await;
    let dir = tempdir("state-other");
    let db = dir.join("state.db");
    {
        let c = rusqlite::Connection::open(&db).expect("open");
        c.execute_batch("CREATE TABLE windows (name TEXT); INSERT INTO windows VALUES ('x');")
            .expect("schema");
    }
    let cfg = stateful(backend, &db, "[{requests: 2, per: 1d}]");
    let (gw, _) = start_at(&cfg, Duration::from_secs(1_000)).await;
    assert_eq!(codes(&gw, "t1", 3).await, [200, 200, 429]);
    assert!(dir.join("state.db.corrupt").is_file());
    assert_eq!(gw.gw.flush_state(), 2, "the new file takes the counts");
    drop(gw);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A folder and the files in it made read-only for as long as it lives: immutable
/// (`chattr +i`) for root, whom modes do not stop, else by their modes.
struct ReadOnly(Vec<std::path::PathBuf>);

impl ReadOnly {
    /// One file made read-only, its folder left writable.
    fn file(file: &Path) -> ReadOnly {
        let guard = ReadOnly(vec![file.to_path_buf()]);
        guard.set(file, true);
        assert!(
            std::fs::OpenOptions::new().append(true).open(file).is_err(),
            "cannot make {} read-only on this machine",
            file.display()
        );
        guard
    }

    fn make(dir: &Path) -> ReadOnly {
        let mut paths: Vec<_> = std::fs::read_dir(dir)
            .expect("list")
            .map(|e| e.expect("entry").path())
            .collect();
        paths.push(dir.to_path_buf());
        let guard = ReadOnly(paths);
        for p in &guard.0 {
            guard.set(p, true);
        }
        let probe = dir.join("probe");
        assert!(
            std::fs::write(&probe, b"x").is_err(),
            "cannot make {} read-only on this machine",
            dir.display()
        );
        guard
    }

    fn set(&self, p: &Path, on: bool) {
        use std::os::unix::fs::PermissionsExt;
        let flag = if on { "+i" } else { "-i" };
        let immutable = std::process::Command::new("chattr")
            .arg(flag)
            .arg(p)
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !immutable {
            let mode = match (p.is_dir(), on) {
                (true, true) => 0o555,
                (true, false) => 0o755,
                (false, true) => 0o444,
                (false, false) => 0o644,
            };
            let _ = std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode));
        }
    }
}

impl Drop for ReadOnly {
    fn drop(&mut self) {
        for p in self.0.iter().rev() {
            self.set(p, false);
        }
    }
}

#[tokio::test]
async fn a_state_file_on_a_read_only_disk_is_restored_and_its_rows_kept() {
    let backend = echo_backend().await;
    let dir = tempdir("state-rofs");
    let first = dir.join("first.db");
    let (gw, _) = start_at(
        &stateful(backend, &first, "[{requests: 3, per: 1d}]"),
        Duration::from_secs(1_000),
    )
    .await;
    assert_eq!(codes(&gw, "t1", 3).await, [200, 200, 200]);
    assert_eq!(codes(&gw, "t2", 1).await, [200]);
    gw.gw.flush_all().await;
    drop(gw);
    // The file as a stopped gateway leaves it, on a disk of its own (a gateway of this
    // process may still hold the first one open).
    let disk = dir.join("disk");
    std::fs::create_dir(&disk).expect("mkdir");
    let db = disk.join("state.db");
    rusqlite::Connection::open(&first)
        .and_then(|c| c.execute("VACUUM INTO ?1", [db.to_string_lossy()]))
        .expect("copy");
    let cfg = stateful(backend, &db, "[{requests: 3, per: 1d}]");

    // The disk is read-only at the next start: the counts are read all the same.
    let read_only = ReadOnly::make(&disk);
    let (gw, _) = start_at(&cfg, Duration::from_secs(1_010)).await;
    assert_eq!(codes(&gw, "t1", 1).await, [429]);
    assert_eq!(codes(&gw, "t2", 2).await, [200, 200]);
    assert_eq!(gw.gw.flush_state(), 0, "nothing can be written yet");
    // Writable again: what is counted now is written, bob's restored and new counts in it.
    drop(read_only);
    assert!(gw.gw.flush_state() >= 1);
    gw.gw.flush_all().await;
    drop(gw);
    let (gw, _) = start_at(&cfg, Duration::from_secs(1_020)).await;
    assert_eq!(codes(&gw, "t1", 1).await, [429], "alice's row was kept");
    assert_eq!(codes(&gw, "t2", 1).await, [429]);
    gw.gw.flush_all().await;
    drop(gw);

    // The file alone write-protected, its folder writable: SQLite would open it for
    // reading only. Read, not written, then written once it may be.
    let copy = disk.join("copy.db");
    rusqlite::Connection::open(&db)
        .and_then(|c| c.execute("VACUUM INTO ?1", [copy.to_string_lossy()]))
        .expect("copy");
    // (A raised limit keeps its counts: alice's 3 leave her 2 of 5.)
    let cfg = stateful(backend, &copy, "[{requests: 5, per: 1d}]");
    let protected = ReadOnly::file(&copy);
    let (gw, _) = start_at(&cfg, Duration::from_secs(1_030)).await;
    assert_eq!(codes(&gw, "t1", 3).await, [200, 200, 429]);
    assert_eq!(gw.gw.flush_state(), 0, "nothing can be written yet");
    drop(protected);
    assert!(gw.gw.flush_state() >= 1, "written once the file may be");
    drop(gw);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_database_of_something_else_is_left_untouched_and_not_used() {
    let backend = echo_backend().await;
    let dir = tempdir("state-foreign");
    let db = dir.join("app.db");
    {
        let c = rusqlite::Connection::open(&db).expect("open");
        c.execute_batch("CREATE TABLE accounts (id INTEGER); INSERT INTO accounts VALUES (7);")
            .expect("schema");
    }
    let before = std::fs::read(&db).expect("read");
    let cfg = stateful(backend, &db, "[{requests: 2, per: 1d}]");
    let (gw, _) = start_at(&cfg, Duration::from_secs(1_000)).await;
    assert_eq!(codes(&gw, "t1", 3).await, [200, 200, 429]);
    assert_eq!(gw.gw.flush_state(), 0, "not written to");
    let metrics = gw.gw.metrics_text();
    let errors: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("tollgate_state_errors_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no error count in {metrics}"));
    assert!(errors >= 2, "the open and the write: {metrics}");
    gw.gw.flush_all().await;
    drop(gw);
    assert_eq!(
        std::fs::read(&db).expect("read"),
        before,
        "the file changed"
    );
    assert!(!dir.join("app.db.corrupt").exists());
    let _ = std::fs::remove_dir_all(&dir);
}
