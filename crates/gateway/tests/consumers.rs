//! Consumers from a separate file (JSON lines or CSV), with plain and hashed keys, reloaded
//! when the file changes; a bad line is rejected with its line number and the old consumers
//! keep serving.

mod common;

use common::*;
use http::StatusCode;
use std::path::Path;
use std::time::Duration;

fn sha256_hex(key: &str) -> String {
    tollgate_config::key_digest(key.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn with_file(backend: std::net::SocketAddr, file: &Path) -> String {
    yaml(
        backend,
        &format!(
            r#"
plans:
  gold: {{limits: [{{requests: 2, per: 1h}}]}}
consumers:
  - {{name: inline, keys: [k-inline]}}
consumers_file: {file:?}
routes:
  - {{name: api, path_prefix: /api/, upstream: backend, auth: {{}}}}
"#
        ),
    )
}

#[tokio::test]
async fn plain_and_hashed_keys_from_a_json_lines_file_identify_their_consumers() {
    let (backend, seen) = recording_backend().await;
    let dir = tempdir("consumers-jsonl");
    let file = dir.join("consumers.jsonl");
    std::fs::write(
        &file,
        format!(
            "{{\"name\": \"c1\", \"plan\": \"gold\", \"keys\": [\"k1\"]}}\n\n{{\"name\": \"c2\", \"plan\": \"gold\", \"key_sha256\": [\"{}\"]}}\n",
            sha256_hex("secret-2")
        ),
    )
    .expect("write");
    let cfg = with_file(backend, &file);
    let (gw, _clock) = TestGateway::with_manual_clock(&cfg).await;
    for (key, name) in [("k1", "c1"), ("secret-2", "c2"), ("k-inline", "inline")] {
        let (answer, head) = exchange(
            gw.addr,
            &seen,
            &format!("GET /api/x?apikey={key} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"),
        )
        .await;
        assert_eq!(status_of(&answer), 200, "{key}: {answer}");
        let head = head.expect("forwarded");
        assert!(head.contains(&format!("x-consumer: {name}\r\n")), "{head}");
        assert!(!head.contains(key), "the key is not forwarded: {head}");
    }
    let c = TestClient::default();
    // The digest is not a key: only what hashes to it is.
    let digest = sha256_hex("secret-2");
    assert_eq!(
        c.get(&gw.url(&format!("/api/?apikey={digest}")))
            .await
            .status,
        StatusCode::UNAUTHORIZED
    );
    // A file consumer's plan applies: 2 per hour (one used above).
    assert_eq!(
        c.get(&gw.url("/api/?apikey=secret-2")).await.status,
        StatusCode::OK
    );
    let third = c.get(&gw.url("/api/?apikey=secret-2")).await;
    assert_eq!(
        third.status,
        StatusCode::TOO_MANY_REQUESTS,
        "{}",
        third.body
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_csv_file_names_its_columns_and_takes_several_keys_a_field() {
    let backend = echo_backend().await;
    let dir = tempdir("consumers-csv");
    let file = dir.join("consumers.csv");
    std::fs::write(
        &file,
        format!(
            "plan,name,keys,key_sha256\ngold,c1,k1 k1b,\n,c2,,{}\n",
            sha256_hex("s2")
        ),
    )
    .expect("write");
    let (gw, _clock) = TestGateway::with_manual_clock(&with_file(backend, &file)).await;
    let c = TestClient::default();
    for key in ["k1", "k1b", "s2", "k-inline"] {
        let a = c.get(&gw.url(&format!("/api/?apikey={key}"))).await;
        assert_eq!(a.status, StatusCode::OK, "{key}");
    }
    // c1 is on gold: both its keys count against the same 2 per hour.
    assert_eq!(
        c.get(&gw.url("/api/?apikey=k1")).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    // c2 has no plan: no limit.
    for _ in 0..3 {
        assert_eq!(
            c.get(&gw.url("/api/?apikey=s2")).await.status,
            StatusCode::OK
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn every_bad_line_is_reported_with_its_number() {
    let backend = echo_backend().await;
    let dir = tempdir("consumers-bad");
    let file = dir.join("consumers.jsonl");
    std::fs::write(
        &file,
        concat!(
            "{\"name\": \"c1\", \"keys\": [\"k1\"]}\n",
            "{\"name\": \"c2\", \"plan\": \"gld\", \"keys\": [\"k2\"]}\n",
            "{\"name\": \"c3\", \"keys\": [\"k1\"]}\n",
            "{\"name\": \"c1\", \"keys\": [\"k4\"]}\n",
            "not json\n",
            "{\"name\": \"c6\", \"key_sha256\": [\"abc\"]}\n",
            "{\"name\": \"c7\"}\n",
            "{\"name\": \"inline\", \"keys\": [\"k8\"]}\n",
            "{\"name\": \"c9\", \"keys\": [\"k-inline\"]}\n",
            "[1, 2]\n",
            "{\"name\": \"c11\", \"keys\": [\"k11\"], \"plan\": 5}\n",
            "{\"name\": \"c12\", \"keys\": [\"k12\"], \"tier\": \"x\"}\n",
            "{\"keys\": [\"k13\"]}\n",
        ),
    )
    .expect("write");
    // Problems name the file as the config does (here by its full path).
    let err = tollgate_config::from_yaml(&with_file(backend, &file))
        .expect_err("bad lines")
        .to_string()
        .replace(&format!("{}/", dir.display()), "");
    for want in [
        "consumers.jsonl:2: unknown plan \"gld\"",
        "consumers.jsonl:3: a key of \"c3\" is already used by consumers.jsonl:1",
        "consumers.jsonl:4: consumer \"c1\" is already defined at consumers.jsonl:1",
        "consumers.jsonl:5: not a consumer object (not JSON: expected ident at column 2)",
        "consumers.jsonl:6: key_sha256 \"abc\" must be 64 hex digits",
        "consumers.jsonl:7: at least one key is required",
        "consumers.jsonl:8: consumer \"inline\" is already defined at consumers[0] in the config file",
        "consumers.jsonl:9: a key of \"c9\" is already used by consumers[0] in the config file",
        "consumers.jsonl:10: not a consumer object (a JSON object is expected, not a list)",
        "consumers.jsonl:11: not a consumer object (plan must be a string (a plan's name), not a number)",
        "consumers.jsonl:12: not a consumer object (unknown field \"tier\"; expected name, plan, keys, key_sha256)",
        "consumers.jsonl:13: not a consumer object (the name is missing)",
    ] {
        assert!(err.contains(want), "missing {want:?} in {err}");
    }
    // What is wrong with a line is said in the line's own terms, with an example.
    assert!(!err.contains("at line 1 column"), "{err}");
    assert!(err.contains(r#"a line is {"name": "alice""#), "{err}");
    // A plain key given hashed to another consumer is the same key twice.
    std::fs::write(
        &file,
        format!(
            "{{\"name\": \"c1\", \"keys\": [\"k1\"]}}\n{{\"name\": \"c2\", \"key_sha256\": [\"{}\"]}}\n",
            sha256_hex("k1")
        ),
    )
    .expect("write");
    let err = tollgate_config::from_yaml(&with_file(backend, &file))
        .expect_err("same key twice")
        .to_string()
        .replace(&format!("{}/", dir.display()), "");
    assert!(
        err.contains("consumers.jsonl:1: a key of consumer \"c1\" is also given hashed to consumer \"c2\", at consumers.jsonl:2"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_changed_consumers_file_is_reloaded_and_a_bad_one_keeps_the_old_consumers() {
    let backend = echo_backend().await;
    let dir = tempdir("consumers-reload");
    let file = dir.join("consumers.jsonl");
    let config = dir.join("tollgate.yaml");
    std::fs::write(&file, "{\"name\": \"c1\", \"keys\": [\"k1\"]}\n").expect("write");
    let text = with_file(backend, &file);
    std::fs::write(&config, &text).expect("write");
    let (gw, _clock) = TestGateway::with_manual_clock(&text).await;
    gw.gw.loaded_from(text.as_bytes());
    gw.gw.set_source(&config);
    let watcher = tollgate_gateway::watch::watch_file(
        gw.gw.clone(),
        config.clone(),
        Duration::from_millis(20),
        Duration::from_millis(50),
    );
    let c = TestClient::default();
    assert_eq!(
        c.get(&gw.url("/api/?apikey=k1")).await.status,
        StatusCode::OK
    );
    assert_eq!(
        c.get(&gw.url("/api/?apikey=k2")).await.status,
        StatusCode::UNAUTHORIZED
    );
    // Nothing changed: nothing to reload.
    gw.gw.reload_file(&config).expect("unchanged");
    assert_eq!(gw.gw.reload_status().generation, 1);

    // A new file renamed into place is picked up by the watcher.
    let mut reloads = gw.gw.reloads();
    let next = dir.join("consumers.jsonl.new");
    std::fs::write(
        &next,
        "{\"name\": \"c1\", \"keys\": [\"k1\"]}\n{\"name\": \"c2\", \"keys\": [\"k2\"]}\n",
    )
    .expect("write");
    std::fs::rename(&next, &file).expect("rename");
    bounded("consumers reload", reloads.wait_for(|s| s.generation == 2))
        .await
        .expect("reloaded");
    assert_eq!(
        c.get(&gw.url("/api/?apikey=k2")).await.status,
        StatusCode::OK
    );

    // A bad line: rejected with its place, the old consumers keep serving.
    std::fs::write(
        &next,
        "{\"name\": \"c3\", \"keys\": [\"k1\"]}\n{\"name\": \"c2\"}\n",
    )
    .expect("write");
    std::fs::rename(&next, &file).expect("rename");
    bounded("rejected", reloads.wait_for(|s| s.last_error.is_some()))
        .await
        .expect("rejected");
    let status = gw.gw.reload_status();
    let error = status.last_error.clone().unwrap_or_default();
    assert!(
        error.contains("consumers.jsonl:2: at least one key"),
        "{error}"
    );
    assert_eq!(status.generation, 2);
    assert_eq!(
        c.get(&gw.url("/api/?apikey=k2")).await.status,
        StatusCode::OK
    );
    watcher.abort();
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_consumers_file_emptied_in_place_keeps_the_running_consumers() {
    let backend = echo_backend().await;
    let dir = tempdir("consumers-emptied");
    let file = dir.join("consumers.jsonl");
    let config = dir.join("tollgate.yaml");
    std::fs::write(&file, "{\"name\": \"c1\", \"keys\": [\"k1\"]}\n").expect("write");
    let text = with_file(backend, &file);
    std::fs::write(&config, &text).expect("write");
    let (gw, _clock) = TestGateway::with_manual_clock(&text).await;
    gw.gw.loaded_from(text.as_bytes());
    let c = TestClient::default();
    assert_eq!(
        c.get(&gw.url("/api/?apikey=k1")).await.status,
        StatusCode::OK
    );

    // Truncated by a rewrite in place, not yet written: refused, c1 served on.
    std::fs::write(&file, "").expect("truncate");
    let e = gw.gw.reload_file(&config).expect_err("an emptied file");
    assert!(
        e.to_string().contains("is empty now; it gave 1 consumers"),
        "{e}"
    );
    assert_eq!(gw.gw.reload_status().generation, 1);
    assert_eq!(
        c.get(&gw.url("/api/?apikey=k1")).await.status,
        StatusCode::OK
    );

    // Written out: taken.
    std::fs::write(&file, "{\"name\": \"c2\", \"keys\": [\"k2\"]}\n").expect("write");
    gw.gw.reload_file(&config).expect("a written file");
    assert_eq!(gw.gw.reload_status().generation, 2);
    assert_eq!(
        c.get(&gw.url("/api/?apikey=k2")).await.status,
        StatusCode::OK
    );
    assert_eq!(
        c.get(&gw.url("/api/?apikey=k1")).await.status,
        StatusCode::UNAUTHORIZED
    );

    // Dropping every file consumer is said by the config: the file taken out of it.
    // (Its change log stays where it was: it moves at a restart only.)
    let log = dir.join("consumers.jsonl.changes");
    let without = text.replace(
        &format!("consumers_file: {file:?}\n"),
        &format!("consumers_log: {log:?}\n"),
    );
    assert_ne!(without, text);
    std::fs::write(&config, &without).expect("write");
    gw.gw.reload_file(&config).expect("no consumers file");
    assert_eq!(
        c.get(&gw.url("/api/?apikey=k2")).await.status,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        c.get(&gw.url("/api/?apikey=k-inline")).await.status,
        StatusCode::OK
    );
    let _ = std::fs::remove_dir_all(&dir);
}
