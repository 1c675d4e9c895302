use super::*;
use crate::limiter::live::{cell_key, escaped_route, legacy_key};
use std::time::Duration;

fn limit() -> LimitConfig {
    LimitConfig {
        name: "per-minute".into(),
        counted_as: "per-minute".into(),
        requests: 60,
        window: Duration::from_secs(60),
    }
}

#[test]
fn cell_keys_keep_the_state_files_format() {
    let plan = Scope {
        route: None,
        consumer: "acme",
    };
    let route = Scope {
        route: Some("orders"),
        consumer: "acme",
    };
    assert_eq!(
        cell_key(plan, &limit()).as_slice(),
        b"consumer:acme\tper-minute\t60"
    );
    assert_eq!(
        cell_key(route, &limit()).as_slice(),
        b"route:orders:consumer:acme\tper-minute\t60"
    );
    // A state file from before the number of requests left the key holds it under its
    // name as shown and its number.
    let unnamed = LimitConfig {
        name: "100-per-1m".into(),
        counted_as: "per-1m".into(),
        requests: 100,
        window: Duration::from_secs(60),
    };
    assert_eq!(
        cell_key(route, &unnamed).as_slice(),
        b"route:orders:consumer:acme\tper-1m\t60"
    );
    assert_eq!(
        legacy_key(route, &unnamed),
        "route:orders:consumer:acme\t100-per-1m\t100\t60"
    );
}

#[test]
fn a_route_name_holding_the_separator_cannot_share_another_routes_cell() {
    let live = Live::new(None, None);
    let now = Now { mono: 1, wall: 1 };
    let joined = Scope {
        route: Some("a:consumer:b"),
        consumer: "c",
    };
    let split = Scope {
        route: Some("a"),
        consumer: "b:consumer:c",
    };
    assert_eq!(
        cell_key(joined, &limit()).as_slice(),
        b"route:a%3Aconsumer%3Ab:consumer:c\tper-minute\t60"
    );
    // A state file from before the escape: its key is read as today's.
    let older = "route:/v1/jobs:run:consumer:alice\tper-minute\t60";
    assert_eq!(
        escaped_route(older).as_deref(),
        Some("route:/v1/jobs%3Arun:consumer:alice\tper-minute\t60")
    );
    let plain = Scope {
        route: Some("/v1/jobs:run"),
        consumer: "alice",
    };
    assert_eq!(
        escaped_route(older).as_deref().map(str::as_bytes),
        Some(cell_key(plain, &limit()).as_slice())
    );
    assert_eq!(escaped_route("route:a:consumer:c\tx\t1\t1"), None);
    assert_eq!(escaped_route("consumer:a:b\tx\t1\t1"), None);
    let one = live.cell(joined, &limit(), now);
    let other = live.cell(split, &limit(), now);
    assert!(!Arc::ptr_eq(&one, &other), "two identities, two cells");
    assert_eq!(live.len(), 2);
}

#[test]
fn one_identity_is_one_cell_until_it_is_retired() {
    let live = Live::new(None, None);
    let now = Now { mono: 1, wall: 1 };
    let who = |consumer| Scope {
        route: None,
        consumer,
    };
    let a = live.cell(who("a"), &limit(), now);
    assert!(Arc::ptr_eq(&a, &live.cell(who("a"), &limit(), now)));
    let b = live.cell(who("b"), &limit(), now);
    assert!(!Arc::ptr_eq(&a, &b));
    assert_eq!(&*a.key, "consumer:a\tper-minute\t60");
    assert_eq!(live.len(), 2);
    a.state.lock().retired = true;
    let again = live.cell(who("a"), &limit(), now);
    assert!(!Arc::ptr_eq(&a, &again), "a retired cell is replaced");
    assert_eq!(live.len(), 2);
}

const S: u64 = 1_000_000_000;

fn at(secs: u64) -> Now {
    Now {
        mono: secs * S,
        wall: secs * S,
    }
}

/// A table of consumers `a` and `b` on one plan of 3 per minute.
fn table(live: &Arc<Live>) -> Counters {
    table_of(live, 3)
}

/// [`table`], its plan allowing `requests` per minute.
fn table_of(live: &Arc<Live>, requests: u64) -> Counters {
    let mut consumers = Consumers::default();
    assert_eq!(consumers.push("a", Some(0), &["ka"], &[]), Ok(0));
    assert_eq!(consumers.push("b", Some(0), &["kb"], &[]), Ok(1));
    let layouts = vec![
        Layout {
            limits: vec![(
                LimitConfig {
                    requests,
                    ..limit()
                },
                None,
            )],
        },
        Layout::default(),
    ];
    Counters::new(Arc::new(consumers), layouts, live.clone())
}

/// Admitted (true) or refused, for consumer `i` at `now`.
fn admit(c: &Counters, i: usize, now: Now) -> bool {
    admit_in(c, i, &[0], now)
}

/// [`admit`], counted in the limits at `positions` of the consumer's layout.
fn admit_in(c: &Counters, i: usize, positions: &[usize], now: Now) -> bool {
    match c.check(i, positions, now) {
        Ok(_) => true,
        Err(Refused::Limit(_)) => false,
        Err(e) => panic!("{e:?}"),
    }
}

#[test]
fn a_cleared_slot_is_filled_again_with_fresh_cells() {
    let live = Arc::new(Live::new(None, None));
    let counters = table(&live);
    let now = at(1);
    assert!(
        counters.active(10, now).is_empty(),
        "nothing made before a call"
    );
    let first = counters.group(0, now)[0].clone();
    assert_eq!(&*first.key, "consumer:a\tper-minute\t60");
    assert!(Arc::ptr_eq(&first, &counters.group(0, now)[0]));
    first.state.lock().retired = true;
    let again = counters.group(0, now)[0].clone();
    assert!(!Arc::ptr_eq(&first, &again));
    assert_eq!(counters.active(10, now).len(), 1);
    again.state.lock().retired = true;
    assert_eq!(counters.sweep(), 1);
    assert!(counters.active(10, now).is_empty());
    assert!(counters.holding.lock().is_empty(), "nothing left to visit");
    counters.group(1, now);
    assert_eq!(counters.sweep(), 0);
    assert_eq!(
        *counters.holding.lock(),
        [1],
        "b's cells are visited next time"
    );
}

#[test]
fn calls_in_one_sub_window_make_no_cell_and_a_later_one_moves_them_to_one() {
    let live = Arc::new(Live::new(None, None));
    let counters = table(&live);
    assert!(admit(&counters, 0, at(0)));
    assert!(admit(&counters, 0, at(1)));
    assert_eq!(live.len(), 0, "both in the sub-window [0 s, 6 s)");
    assert_eq!(counters.active(10, at(1)).len(), 1, "and seen as active");
    assert_eq!(live.len(), 1, "listing them made their cell");
    let cell = counters.group(0, at(1))[0].clone();
    assert_eq!(cell.used(at(1)), 2);
    assert!(admit(&counters, 0, at(7)));
    assert!(
        !admit(&counters, 0, at(8)),
        "3 per minute, wherever they are counted"
    );
    assert_eq!(cell.used(at(8)), 3);
    // Consumer b calls once in each of two sub-windows: a cell from the second on.
    assert!(admit(&counters, 1, at(0)));
    assert_eq!(live.len(), 1);
    assert!(admit(&counters, 1, at(7)));
    assert_eq!(live.len(), 2);
    assert!(admit(&counters, 1, at(8)));
    assert!(!admit(&counters, 1, at(9)));
}

#[test]
fn counts_kept_in_slots_carry_over_to_the_next_table() {
    let live = Arc::new(Live::new(None, None));
    let old = table(&live);
    assert!(admit(&old, 0, at(0)));
    assert!(admit(&old, 0, at(0)));
    assert_eq!(live.len(), 0);
    let new = table(&live);
    // While both exist, a request on the old table counts in a cell too.
    assert!(admit(&old, 1, at(0)));
    assert_eq!(live.len(), 1);
    old.settle_all(at(0));
    assert_eq!(live.len(), 2, "a's counts moved to a cell");
    assert!(admit(&new, 0, at(1)));
    assert!(!admit(&new, 0, at(1)), "a's two earlier calls still count");
    assert!(admit(&old, 1, at(1)));
    assert!(admit(&new, 1, at(2)));
    assert!(!admit(&new, 1, at(2)));
    drop(old);
    // Alone now, the new table keeps counts in slots again once the cells are gone.
    assert!(!admit(&new, 0, at(3)));
    assert_eq!(live.sweep(at(100)), 2);
    assert_eq!(new.sweep(), 2);
    assert!(admit(&new, 0, at(100)));
    assert!(admit(&new, 1, at(100)));
    assert_eq!(live.len(), 0);
}

#[test]
fn a_limit_raised_or_lowered_by_a_reload_keeps_its_counts() {
    let live = Arc::new(Live::new(None, None));
    let three = table_of(&live, 3);
    for _ in 0..3 {
        assert!(admit(&three, 0, at(0)));
    }
    assert!(!admit(&three, 0, at(0)));
    let five = table_of(&live, 5);
    three.settle_all(at(0));
    drop(three);
    assert!(admit(&five, 0, at(1)));
    assert!(admit(&five, 0, at(1)));
    assert!(
        !admit(&five, 0, at(1)),
        "the three earlier calls count against five"
    );
    let two = table_of(&live, 2);
    five.settle_all(at(1));
    drop(five);
    assert!(!admit(&two, 0, at(2)), "five counted are past two");
    // The counts leave the window as they would have.
    assert!(admit(&two, 0, at(130)));
}

#[test]
fn two_tables_sharing_a_cell_each_enforce_their_own_number() {
    let live = Arc::new(Live::new(None, None));
    let three = table_of(&live, 3);
    let five = table_of(&live, 5);
    // While both exist, counts go to the cell both find by identity.
    for _ in 0..4 {
        assert!(admit(&five, 0, at(0)));
    }
    // A request on the older config (a reload under way) looks the cell up last.
    assert!(!admit(&three, 0, at(0)), "four counted are past three");
    assert!(admit(&five, 0, at(0)), "the newer table still allows five");
    assert!(!admit(&five, 0, at(0)));
}

#[test]
fn counters_kept_on_disk_or_shared_always_take_cells() {
    let live = Arc::new(Live::new(None, Some(Arc::default())));
    let counters = table(&live);
    assert!(admit(&counters, 0, at(0)));
    assert_eq!(live.len(), 1);
}

#[test]
fn names_and_plans_are_read_from_the_line_or_the_consumers_table() {
    let long = "a-consumer-name-longer-than-a-line-holds";
    let exact = "n".repeat(SHORT);
    let mut consumers = Consumers::default();
    assert_eq!(consumers.push("a", Some(1), &["ka"], &[]), Ok(0));
    assert_eq!(consumers.push(&exact, Some(0), &["kb"], &[]), Ok(1));
    assert_eq!(consumers.push(long, None, &["kc"], &[]), Ok(2));
    let layouts = vec![Layout::default(), Layout::default(), Layout::default()];
    let counters = Counters::new(
        Arc::new(consumers),
        layouts,
        Arc::new(Live::new(None, None)),
    );
    assert_eq!(counters.lines[1].short_name(), Some(exact.as_str()));
    assert_eq!(counters.lines[2].short_name(), None, "too long to hold");
    let names: Vec<&str> = (0..3).map(|i| counters.name(i)).collect();
    assert_eq!(names, ["a", exact.as_str(), long]);
    let plans: Vec<_> = (0..3)
        .map(|i| (counters.plan(i), counters.plan_slot(i)))
        .collect();
    assert_eq!(plans, [(Some(1), 1), (Some(0), 0), (None, 2)]);
}

/// A fresh table of consumer `a` on a plan of 3 per 10 s and 5 per minute.
fn two_limits(live: &Arc<Live>) -> Counters {
    let mut consumers = Consumers::default();
    assert_eq!(consumers.push("a", Some(0), &["ka"], &[]), Ok(0));
    let per = |requests, secs| LimitConfig {
        name: format!("{requests}-per-{secs}s"),
        counted_as: format!("{requests}-per-{secs}s"),
        requests,
        window: Duration::from_secs(secs),
    };
    let layouts = vec![
        Layout {
            limits: vec![(per(3, 10), None), (per(5, 60), None)],
        },
        Layout::default(),
    ];
    Counters::new(Arc::new(consumers), layouts, live.clone())
}

#[test]
fn a_longer_limit_keeps_its_counts_when_a_shorter_ones_cell_is_retired() {
    let ms = |ms: u64| Now {
        mono: ms * 1_000_000,
        wall: ms * 1_000_000,
    };
    let admit2 = |c: &Counters, now| admit_in(c, 0, &[0, 1], now);
    // Retired and swept from the table, or retired only (the request meets the retired
    // cell before the sweep does): either way the minute's three calls still count.
    for swept in [true, false] {
        let live = Arc::new(Live::new(None, None));
        let counters = two_limits(&live);
        assert!(admit2(&counters, ms(0)));
        assert!(admit2(&counters, ms(1_500)));
        assert!(admit2(&counters, ms(1_600)));
        assert_eq!(live.len(), 2, "calls in two sub-windows: cells");
        assert_eq!(live.sweep(ms(40_000)), 1, "the 10 s limit's cell is idle");
        if swept {
            assert_eq!(counters.sweep(), 1);
        }
        assert!(admit2(&counters, ms(40_000)));
        assert!(admit2(&counters, ms(40_100)));
        assert!(
            !admit2(&counters, ms(40_200)),
            "5 per minute: 3 before, 2 now (swept: {swept})"
        );
        assert_eq!(counters.active(10, ms(40_200)).len(), 1);
    }
}

/// A fresh table of consumer `a` listed on plan A (3 per 10 s) beside plan B (the same
/// limit and 100 per minute).
fn two_plans(live: &Arc<Live>) -> Counters {
    let mut consumers = Consumers::default();
    assert_eq!(consumers.push("a", Some(0), &["ka"], &[]), Ok(0));
    let q = LimitConfig {
        name: "q".into(),
        counted_as: "q".into(),
        requests: 3,
        window: Duration::from_secs(10),
    };
    let wide = LimitConfig {
        name: "wide".into(),
        counted_as: "wide".into(),
        requests: 100,
        window: Duration::from_secs(60),
    };
    let layouts = vec![
        Layout {
            limits: vec![(q.clone(), None)],
        },
        Layout {
            limits: vec![(q, None), (wide, None)],
        },
        Layout::default(),
    ];
    Counters::new(Arc::new(consumers), layouts, live.clone())
}

#[test]
fn a_listed_consumer_moved_to_another_plan_keeps_the_counts_of_the_limits_both_hold() {
    // Counted in its line on plan A, then as a guest on plan B (the admin API moved it).
    let live = Arc::new(Live::new(None, None));
    let c = two_plans(&live);
    for _ in 0..3 {
        assert!(admit_in(&c, 0, &[0], at(0)));
    }
    assert_eq!(live.len(), 0, "counts held in the line");
    let guest = c.managed_guest("a", 1, Some(0)).expect("guest");
    assert!(
        !admit_in(&c, guest, &[0, 1], at(1)),
        "q's three calls count on B"
    );
    // Counted as the guest first, then in its line again (moved back).
    let live = Arc::new(Live::new(None, None));
    let c = two_plans(&live);
    let guest = c.managed_guest("a", 1, Some(0)).expect("guest");
    for _ in 0..3 {
        assert!(admit_in(&c, guest, &[0, 1], at(0)));
    }
    assert!(!admit_in(&c, 0, &[0], at(1)), "q's three calls count on A");
    // Moved while a request identified before the move is in flight: the guest's first
    // request has handed the line over but not counted yet when one on the line counts.
    let live = Arc::new(Live::new(None, None));
    let c = two_plans(&live);
    let guest = c.managed_guest("a", 1, Some(0)).expect("guest");
    c.hand_over(guest, at(0));
    // The line counts in the cells the guest will find from now on, not in counts of its
    // own that the rest of the guest's request would not see.
    assert!(matches!(*c.lines[0].slot.lock(), Slot::Cells(_)));
    assert!(admit_in(&c, 0, &[0], at(0)));
    assert!(admit_in(&c, guest, &[0, 1], at(0)));
    assert!(admit_in(&c, 0, &[0], at(0)));
    assert!(
        !admit_in(&c, guest, &[0, 1], at(0)),
        "three calls, wherever each was counted"
    );
}
