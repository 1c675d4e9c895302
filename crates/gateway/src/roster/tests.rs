//! The roster's tests: records, keys, the log kept through removals and compactions.

use super::*;
use record::{hex, ManagedKey};

#[test]
fn the_log_is_compacted_in_the_background_and_read_back_whole() {
    let dir = std::env::temp_dir().join(format!("tollgate-roster-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let path = dir.join("c.changes");
    let _ = std::fs::remove_file(&path);
    let r = Arc::new(Roster::open(&path).expect("open"));
    for i in 0..1500u32 {
        r.update("alice", |_| {
            let mut m = rec("alice", 1, 0);
            m.metadata.insert("n".into(), i.into());
            Ok::<_, RosterError>(m)
        })
        .expect("update");
        r.update(&format!("c{}", i % 3), |_| {
            Ok::<_, RosterError>(rec(&format!("c{}", i % 3), 9, 0)).map(|mut m| {
                m.keys.clear();
                m
            })
        })
        .expect("update");
    }
    r.compacted();
    let lines = std::fs::read_to_string(&path).expect("log").lines().count();
    assert!(
        lines < 1100,
        "{lines} lines for 4 consumers after 3000 changes"
    );
    let again = Roster::open(&path).expect("reopen");
    assert_eq!(again.len(), 4);
    let alice = again.get("alice").expect("alice");
    assert_eq!(alice.metadata.get("n"), Some(&1499.into()));
    let _ = std::fs::remove_dir_all(&dir);
}

fn rec(name: &str, digest: u8, version: u64) -> Managed {
    Managed {
        name: name.into(),
        plan: Some("gold".into()),
        keys: vec![ManagedKey {
            id: "k".into(),
            sha256: hex(&[digest; 32]),
            created: 0,
        }],
        metadata: Default::default(),
        deleted: false,
        without_config_keys: false,
        version,
    }
}

#[test]
fn the_newest_record_wins_and_keys_follow_it() {
    let r = Arc::new(Roster::in_memory());
    assert!(r.is_empty());
    r.update("alice", |_| Ok::<_, RosterError>(rec("alice", 1, 0)))
        .expect("update");
    assert_eq!(
        r.by_digest(&[1; 32]).map(|m| m.name.clone()),
        Some("alice".into())
    );
    // An older change is ignored; a newer one moves the key.
    let v = r.get("alice").expect("alice").version;
    assert!(!r.apply(rec("alice", 2, v - 1)));
    assert!(r.apply(rec("alice", 2, v + 1)));
    assert!(r.by_digest(&[1; 32]).is_none());
    assert!(r.by_digest(&[2; 32]).is_some());
    // Another consumer may not take alice's key.
    assert!(matches!(
        r.update("bob", |_| Ok(rec("bob", 2, 0))),
        Err(RosterError::KeyTaken(o)) if o == "alice"
    ));
    let gone = r
        .update("alice", |now| {
            let mut m = now.cloned().expect("alice");
            m.deleted = true;
            Ok::<_, RosterError>(m)
        })
        .expect("delete");
    assert!(gone.version > v + 1);
    assert!(r.by_digest(&[2; 32]).is_none());
    assert!(r.get("alice").is_some_and(|m| m.deleted));
    assert!(r.next_version() > gone.version);
    // A change dated far ahead is not taken from another node.
    assert_eq!(r.absorb(vec![rec("carol", 3, u64::MAX)]), 0);
}

#[test]
fn a_change_after_the_log_was_removed_or_replaced_writes_every_consumer_again() {
    let dir = std::env::temp_dir().join(format!("tollgate-roster-gone-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let path = dir.join("c.changes");
    let _ = std::fs::remove_file(&path);
    let r = Arc::new(Roster::open(&path).expect("open"));
    for (i, name) in ["alice", "bob"].iter().enumerate() {
        r.update(name, |_| Ok::<_, RosterError>(rec(name, i as u8, 0)))
            .expect("update");
    }
    let names = |path: &Path| -> Vec<String> {
        let (_, got) = Log::open(path).expect("reopen");
        let mut n: Vec<String> = got.records.into_iter().map(|m| m.name).collect();
        n.sort();
        n.dedup();
        n
    };
    // Removed (a stray clean-up): the next change writes the whole roster.
    std::fs::remove_file(&path).expect("remove");
    r.update("carol", |_| Ok::<_, RosterError>(rec("carol", 7, 0)))
        .expect("update");
    assert_eq!(names(&path), ["alice", "bob", "carol"]);
    // Emptied, or replaced by another file: the same.
    std::fs::write(&path, "").expect("empty");
    r.update("dave", |_| Ok::<_, RosterError>(rec("dave", 8, 0)))
        .expect("update");
    assert_eq!(names(&path), ["alice", "bob", "carol", "dave"]);
    std::fs::write(dir.join("other"), "").expect("other");
    std::fs::rename(dir.join("other"), &path).expect("replace");
    r.update("dave", |_| Ok::<_, RosterError>(rec("dave", 8, 0)))
        .expect("update");
    assert_eq!(names(&path), ["alice", "bob", "carol", "dave"]);
    // A shared change too.
    std::fs::remove_file(&path).expect("remove");
    let v = r.next_version();
    assert_eq!(r.absorb(vec![rec("erin", 9, v)]), 1);
    assert_eq!(names(&path), ["alice", "bob", "carol", "dave", "erin"]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_log_removed_while_changes_are_made_ends_up_holding_every_consumer() {
    let dir = std::env::temp_dir().join(format!("tollgate-roster-race-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let path = dir.join("c.changes");
    let _ = std::fs::remove_file(&path);
    let r = Arc::new(Roster::open(&path).expect("open"));
    let writers: Vec<_> = (0..2u8)
        .map(|t| {
            let r = r.clone();
            std::thread::spawn(move || {
                for i in 0..150u8 {
                    let name = format!("w{t}-{i}");
                    r.update(&name, |_| {
                        let mut m = rec(&name, 0, 0);
                        m.keys.clear();
                        Ok::<_, RosterError>(m)
                    })
                    .expect("update");
                }
            })
        })
        .collect();
    // Removed and emptied again and again while the writers go on.
    for i in 0..40 {
        if i % 2 == 0 {
            let _ = std::fs::remove_file(&path);
        } else {
            let _ = std::fs::write(&path, "");
        }
        std::thread::yield_now();
    }
    for w in writers {
        w.join().expect("writer");
    }
    // One change after the last removal: what the log holds is every consumer.
    r.update("last", |_| Ok::<_, RosterError>(rec("last", 9, 0)))
        .expect("update");
    r.compacted();
    let (_, got) = Log::open(&path).expect("reopen");
    let names: std::collections::HashSet<String> =
        got.records.into_iter().map(|m| m.name).collect();
    assert_eq!(names.len(), 301, "{} consumers in the log", names.len());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_log_giving_one_key_to_two_live_consumers_is_refused() {
    let dir = std::env::temp_dir().join(format!("tollgate-roster-two-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let path = dir.join("c.changes");
    let line = |r: &Managed| serde_json::to_string(r).expect("json");
    std::fs::write(
        &path,
        format!("{}\n{}\n", line(&rec("u1", 4, 1)), line(&rec("u3", 4, 2))),
    )
    .expect("write");
    let e = Roster::open(&path).expect_err("refused");
    assert!(e.to_string().contains("to both"), "{e}");
    // Moved from one to the other, in order: fine.
    let mut moved = rec("u1", 5, 3);
    moved.keys.clear();
    std::fs::write(
        &path,
        format!(
            "{}\n{}\n{}\n",
            line(&rec("u1", 4, 1)),
            line(&moved),
            line(&rec("u3", 4, 4))
        ),
    )
    .expect("write");
    let r = Roster::open(&path).expect("open");
    assert_eq!(
        r.by_digest(&[4; 32]).map(|m| m.name.clone()),
        Some("u3".into())
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_fifo_as_the_log_is_refused_rather_than_waited_on() {
    let dir = std::env::temp_dir().join(format!("tollgate-roster-fifo-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    let path = dir.join("c.changes");
    let made = std::process::Command::new("mkfifo")
        .arg(&path)
        .status()
        .expect("mkfifo");
    assert!(made.success());
    let e = Roster::open(&path).expect_err("refused");
    assert!(e.to_string().contains("not a regular file"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}
