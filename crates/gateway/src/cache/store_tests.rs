//! Tests of the store: variants, invalidation, the URI index.

use super::*;

fn entry(store: &Store, uri: &str) -> Entry {
    Entry {
        status: StatusCode::OK,
        headers: HeaderMap::new(),
        body: Bytes::from_static(b"x"),
        fresh: Freshness::default(),
        stored_ns: 0,
        host: String::new(),
        path: uri.to_string(),
        tags: Vec::new(),
        born: store.born(uri),
    }
}

#[test]
fn what_is_kept_holds_its_own_bytes() {
    let head = Bytes::from(b"HTTP/1.1 200 OK\r\nETag: \"1\"\r\n\r\n".to_vec());
    let shared = HeaderValue::from_maybe_shared(head.slice(23..26)).expect("value");
    let mut secret = HeaderValue::from_static("s");
    secret.set_sensitive(true);
    let h = HeaderMap::from_iter([
        (http::header::ETAG, shared),
        (http::header::SET_COOKIE, secret),
    ]);
    let kept = owned(&h);
    assert_eq!(kept, h);
    let at = |m: &HeaderMap| m[http::header::ETAG].as_bytes().as_ptr();
    assert_ne!(at(&h), at(&kept), "a copy, not a slice");
    assert!(kept[http::header::SET_COOKIE].is_sensitive());
}

#[test]
fn invalidating_a_uri_reaches_variants_past_the_remembered_ones() {
    let store = Store::new(1 << 30, 1 << 20);
    let n = MAX_VARIANTS + 500;
    for i in 0..n {
        let e = entry(&store, "u");
        store.put(Varies::from([]), format!("u\0{i}"), e);
    }
    let other = entry(&store, "v");
    store.put(Varies::from([]), "v\0".to_string(), other);
    assert!(
        store.get(&format!("u\0{}", 0)).is_some(),
        "the oldest variant is stored"
    );
    store.invalidate_uri("u");
    for i in 0..n {
        assert!(
            store.get(&format!("u\0{i}")).is_none(),
            "variant {i} served"
        );
    }
    assert!(store.get("v\0").is_some(), "another URI kept");
}

#[test]
fn a_uri_remembers_about_the_variants_stored_not_every_one_ever() {
    // Room for a few dozen entries: most of 3,000 variants are evicted.
    let store = Store::new(32 << 10, 1 << 20);
    for i in 0..3000 {
        let e = entry(&store, "u");
        store.put(Varies::from([]), format!("u\0{i:0>200}"), e);
        if i % 100 == 0 {
            store.entries.run_pending_tasks();
        }
    }
    store.entries.run_pending_tasks();
    let stored = store.entries.entry_count() as usize;
    let remembered = store.uris.get("u").map_or(0, |i| i.keys.lock().len());
    assert!(stored < 200, "{stored} stored");
    assert!(
        remembered <= 4 * stored.max(64),
        "{remembered} keys remembered for {stored} variants stored"
    );
}

#[test]
fn an_answer_fetched_before_an_invalidation_is_not_stored() {
    let store = Store::new(1 << 30, 1 << 20);
    let e = entry(&store, "u");
    store.invalidate_uri("u");
    store.put(Varies::from([]), "u\0".to_string(), e);
    assert!(store.get("u\0").is_none());
    let e = entry(&store, "u");
    store.put(Varies::from([]), "u\0".to_string(), e);
    assert!(store.get("u\0").is_some(), "fetched after: stored");
}

#[test]
fn misses_file_nothing_in_the_index() {
    let store = Store::new(16 * 1024, 1 << 20);
    for i in 0..50_000 {
        let born = store.born(&format!("u{i}"));
        assert!(born.unchanged());
    }
    assert_eq!(store.index_len(), 0);
    // An invalidation while a URI with nothing stored was upstream keeps its answer out.
    let e = entry(&store, "fresh");
    store.invalidate_uri("fresh");
    store.put(Varies::from([]), "fresh\0".to_string(), e);
    assert!(store.get("fresh\0").is_none());
}

#[test]
fn uri_infos_are_dropped_with_their_entries() {
    // Room for a few entries only: most are evicted as new URIs come.
    let store = Store::new(16 * 1024, 1 << 20);
    for i in 0..20_000 {
        let uri = format!("u{i}");
        let e = entry(&store, &uri);
        store.put(Varies::from([]), format!("{uri}\0"), e);
    }
    store.entries.run_pending_tasks();
    let infos = store.uris.len() as u64;
    assert!(
        infos <= 2 * store.entries.entry_count() + 2048,
        "{infos} URI infos kept for {} entries",
        store.entries.entry_count()
    );
}
