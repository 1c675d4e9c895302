//! Tests of the config validation.

use crate::from_yaml;

const GOOD: &str = r#"
listeners: [{address: "127.0.0.1:8080"}]
upstreams:
  backend: {targets: ["127.0.0.1:1337"]}
plans:
  gold: {limits: [{requests: 10, per: 1s}, {requests: 100, per: 100s, name: slow}]}
consumers:
  - {name: alice, keys: [k1], plan: gold}
routes:
  - path_prefix: /test/
    upstream: backend
    auth: {query: [apikey]}
    allow: {plans: [gold]}
"#;

#[test]
fn accepts_a_good_config() {
    let c = from_yaml(GOOD).expect("valid");
    assert_eq!(c.plans[0].limits[0].name, "10-per-1s");
    assert_eq!(c.plans[0].limits[1].name, "slow");
    assert_eq!(c.routes[0].upstream, 0);
    // Counts are kept by the window, or the name when given: a new number of requests
    // keeps them.
    assert_eq!(c.plans[0].limits[0].counted_as, "per-1s");
    assert_eq!(c.plans[0].limits[1].counted_as, "slow");
}

#[test]
fn unnamed_limits_sharing_a_window_are_counted_by_their_full_names() {
    let c = from_yaml(&GOOD.replace(
        "{requests: 100, per: 100s, name: slow}",
        "{requests: 20, per: 1s}, {requests: 5, per: 1m, name: per-1m}, {requests: 6, per: 1m}",
    ))
    .expect("valid");
    let counted: Vec<&str> = c.plans[0]
        .limits
        .iter()
        .map(|l| l.counted_as.as_str())
        .collect();
    assert_eq!(counted, ["10-per-1s", "20-per-1s", "per-1m", "6-per-1m"]);
}

#[test]
fn reports_every_problem_with_its_place() {
    let bad = r#"
listeners: [{address: "nowhere"}]
upstreams:
  backend: {targets: ["127.0.0.1"]}
consumers:
  - {name: alice, keys: [k1], plan: bronze}
  - {name: bob, keys: [k1]}
  - {name: "-", keys: [k3]}
  - {name: dave, key_sha256: [not-hex]}
  - {name: erin, keys: [k5, k5]}
  - {name: erin, keys: [k6]}
routes:
  - {path_prefix: /a/, upstream: backend}
  - {path_prefix: b, upstream: orders, methods: [GET, "B@D"]}
  - {path: /c, upstream: backend, allow: {consumers: [carol, dave]}}
"#;
    let err = from_yaml(bad).expect_err("invalid");
    let text: Vec<String> = err.problems().iter().map(|p| p.to_string()).collect();
    let expect = [
        "listeners[0].address: \"nowhere\" is not an ip:port address",
        "upstreams.backend.targets[0]: \"127.0.0.1\" is not a host:port target",
        "consumers[0].plan: unknown plan \"bronze\"",
        "consumers[1].keys[0]: this key is already used by consumers[0]",
        "consumers[2].name: `-` stands for requests without a consumer",
        "routes[1].path_prefix: \"b\" must start with '/'",
        "routes[1].upstream: unknown upstream \"orders\"",
        "routes[1].methods[1]: \"B@D\" is not an HTTP method",
        "routes[2].allow: needs `auth` on the route",
        "routes[2].allow.consumers[0]: unknown consumer \"carol\"",
        "consumers[3].key_sha256[0]:",
        "consumers[4].keys[1]: this key is listed twice for this consumer",
        "consumers[5].name: consumer \"erin\" is defined twice (also consumers[4])",
    ];
    for e in expect {
        assert!(
            text.iter().any(|t| t.starts_with(e)),
            "missing {e:?} in {text:#?}"
        );
    }
    // dave is refused for his own key, not named unknown as well.
    assert!(
        !text.iter().any(|t| t.contains("unknown consumer \"dave\"")),
        "{text:#?}"
    );
}

#[test]
fn a_limit_whose_window_is_unreadable_gets_no_second_problem_for_its_made_up_name() {
    let bad = GOOD.replace(
        "upstream: backend",
        "upstream: backend\n    limits: [{requests: 10, per: 1 minute}, {requests: 10, per: 60}]",
    );
    let err = from_yaml(&bad).expect_err("invalid");
    let said: Vec<String> = err.problems().iter().map(|p| p.to_string()).collect();
    assert_eq!(said.len(), 2, "{said:#?}");
    assert!(said.iter().all(|p| p.contains(".per: ")), "{said:#?}");
}

#[test]
fn unknown_fields_are_rejected_with_their_path() {
    let bad = GOOD.replace("upstream: backend", "upstream: backend\n    upstrem: x");
    let err = from_yaml(&bad).expect_err("invalid");
    let text = err.to_string();
    assert!(
        text.starts_with("routes[0].upstrem: unknown setting `upstrem`"),
        "{text}"
    );
    assert!(text.contains("(line 12, column 5)"), "{text}");
}

#[test]
fn parse_level_problems_are_all_reported_with_line_and_column() {
    let bad = r#"
listeners: [{address: "127.0.0.1:8080", max_headers: many}]
upstreams:
  backend: {targets: ["127.0.0.1:1337"], connect_timeout: 1.5s, pool_max_idle: -3}
plans:
  gold: {limits: [{requests: lots, per: 1s}]}
consumers:
  - {name: alice, keys: [k1], plan: gold, colour: blue}
routes:
  - {path_prefix: /test/, upstream: nowhere}
"#;
    let err = from_yaml(bad).expect_err("invalid");
    let text: Vec<String> = err.problems().iter().map(|p| p.to_string()).collect();
    let expect = [
            "listeners[0].max_headers: must be a whole number ≥ 0 (found string \"many\") (line 2, column 54)",
            "upstreams.backend.connect_timeout: duration \"1.5s\" must be a whole number with a unit; write 1500ms",
            "upstreams.backend.pool_max_idle: must be a whole number ≥ 0",
            "plans.gold.limits[0].requests: must be a whole number ≥ 0",
            "consumers[0].colour: unknown setting `colour`",
            "routes[0].upstream: unknown upstream \"nowhere\" (line 10, column 37)",
        ];
    for e in expect {
        assert!(
            text.iter().any(|t| t.starts_with(e)),
            "missing {e:?} in {text:#?}"
        );
    }
    assert!(
        !text
            .iter()
            .any(|t| t.contains("u64") || t.contains("usize")),
        "{text:#?}"
    );
    assert_eq!(text.len(), expect.len(), "{text:#?}");
}

#[test]
fn admin_may_not_clash_with_a_listener_nor_listen_everywhere_without_a_token() {
    let clash = format!("{GOOD}admin: {{address: \"0.0.0.0:8080\"}}\n");
    let err = from_yaml(&clash).expect_err("invalid");
    let text = err.to_string();
    assert!(
        text.contains("admin.address: 0.0.0.0:8080 clashes with listeners[0]"),
        "{text}"
    );
    assert!(text.contains("set `admin.token_file`"), "{text}");
    let missing =
        format!("{GOOD}admin: {{address: \"0.0.0.0:9901\", token_file: /nonexistent/t}}\n");
    let err = from_yaml(&missing).expect_err("invalid");
    assert!(
        err.to_string()
            .contains("admin.token_file: cannot read /nonexistent/t"),
        "{err}"
    );
    let ok = format!("{GOOD}admin: {{address: \"127.0.0.1:9901\"}}\n");
    assert!(from_yaml(&ok).is_ok());
    // Any address other machines can reach needs a token, not only 0.0.0.0.
    let private = format!("{GOOD}admin: {{address: \"10.1.2.3:9901\"}}\n");
    let err = from_yaml(&private).expect_err("invalid");
    assert!(
        err.to_string()
            .contains("10.1.2.3:9901 is reachable from other machines"),
        "{err}"
    );
    let v6 = format!("{GOOD}admin: {{address: \"[::1]:9901\"}}\n");
    assert!(from_yaml(&v6).is_ok());
    // A short token is taken, with a warning; a long one without.
    let dir = std::env::temp_dir().join(format!("tollgate-admin-token-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    for (token, warned) in [("s3cret", true), ("0123456789abcdef0123", false)] {
        std::fs::write(dir.join("t"), format!("{token}\n")).expect("write");
        let with = format!(
            "{GOOD}admin: {{address: \"127.0.0.1:9901\", token_file: {:?}}}\n",
            dir.join("t")
        );
        let cfg = from_yaml(&with).expect("a token is taken");
        let said: Vec<String> = cfg.warnings.iter().map(|w| w.to_string()).collect();
        assert_eq!(
            said.iter()
                .any(|w| w.contains("admin.token_file: the admin token is 6 characters long")),
            warned,
            "{said:?}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_process_log_format_is_read_from_the_file_and_checked() {
    let json = format!("{GOOD}log: {{format: json}}\n");
    assert_eq!(
        from_yaml(&json).expect("valid").log_format,
        Some(crate::LogFormat::Json)
    );
    assert_eq!(from_yaml(GOOD).expect("valid").log_format, None);
    // Read before the file is validated: a file wrong elsewhere still says how to log it.
    let wrong = format!("{GOOD}log: {{format: json}}\nroutes_typo: 1\n");
    assert_eq!(crate::log_format_of(&wrong), Some(crate::LogFormat::Json));
    let bad = format!("{GOOD}log: {{format: xml}}\n");
    let text = from_yaml(&bad).expect_err("invalid").to_string();
    assert!(
        text.contains("log.format: unknown variant `xml`, expected `text` or `json`"),
        "{text}"
    );
}

#[test]
fn observability_settings_are_checked() {
    let cfg = format!(
        "{GOOD}access_log: {{path: stdout}}\nanalytics: {{path: a.db, retention: 7d}}\nmetrics: {{per_consumer: true}}\n"
    );
    let c = from_yaml(&cfg).expect("valid");
    assert_eq!(
        c.access_log.map(|a| a.target),
        Some(crate::LogTarget::Stdout)
    );
    let a = c.analytics.expect("analytics");
    assert_eq!(a.retention, std::time::Duration::from_secs(7 * 86_400));
    assert!(c.metrics.per_consumer);
    let bad = format!(
        "{GOOD}access_log: {{path: \"\", buffer: 0}}\nanalytics: {{path: a.db, retention: 10m}}\n"
    );
    let text = from_yaml(&bad).expect_err("invalid").to_string();
    for want in [
        "access_log.path: name a file",
        "access_log.buffer: must be between",
        "analytics.retention: must be between 1h",
    ] {
        assert!(text.contains(want), "{want}: {text}");
    }
}

#[test]
fn tracing_settings_are_checked_and_defaulted() {
    let c = from_yaml(&format!("{GOOD}tracing: {{otlp: {{}}}}\n")).expect("valid");
    let t = c.tracing.expect("tracing");
    assert_eq!(t.endpoint, "http://localhost:4317");
    assert_eq!(t.protocol, crate::OtlpProtocol::Grpc);
    assert!((t.sample_ratio - 1.0).abs() < f64::EPSILON);
    assert_eq!(t.service_name, "tollgate");
    assert_eq!((t.queue_size, t.batch_size), (2048, 512));
    let c = from_yaml(&format!(
        "{GOOD}tracing: {{otlp: {{endpoint: \"http://10.0.0.9:4318/\", protocol: http, headers: {{X-Key: abc}}}}, sample_ratio: 0.01, service_name: edge}}\n"
    ))
    .expect("valid");
    let t = c.tracing.expect("tracing");
    assert_eq!(
        t.endpoint, "http://10.0.0.9:4318/v1/traces",
        "a base URL gets the signal's path"
    );
    assert_eq!(t.headers, vec![("x-key".to_string(), "abc".to_string())]);
    assert_eq!(t.service_name, "edge");
    let bad = format!(
        "{GOOD}tracing: {{otlp: {{endpoint: \"udp://x:1\", protocol: thrift, batch_size: 9, queue_size: 8, headers: {{auth-bin: x}}}}, sample_ratio: 1.5, service_name: \" \"}}\n"
    );
    let text = from_yaml(&bad).expect_err("invalid").to_string();
    for want in [
        "tracing.otlp.endpoint: \"udp://x:1\" must be an http:// or https:// URL",
        "tracing.otlp.protocol: \"thrift\" must be \"grpc\" or \"http\"",
        "tracing.otlp.batch_size: must be between 1 and `queue_size`",
        "tracing.sample_ratio: must be between 0",
        "tracing.service_name: must not be empty",
        "tracing.otlp.headers.auth-bin: binary gRPC metadata",
    ] {
        assert!(text.contains(want), "{want}: {text}");
    }
}

#[test]
fn trusted_proxies_are_address_blocks() {
    let cfg = GOOD.replace(
        "address: \"127.0.0.1:8080\"",
        "address: \"127.0.0.1:8080\", trusted_proxies: [10.0.0.0/8, \"::1\"]",
    );
    let c = from_yaml(&cfg).expect("valid");
    let t = &c.listeners[0].trusted_proxies;
    assert!(t[0].contains("10.1.2.3".parse().expect("ip")));
    assert!(!t[0].contains("11.1.2.3".parse().expect("ip")));
    assert!(t[1].contains("::1".parse().expect("ip")));
    let bad = GOOD.replace(
        "address: \"127.0.0.1:8080\"",
        "address: \"127.0.0.1:8080\", trusted_proxies: [10.0.0.0/33]",
    );
    let err = from_yaml(&bad).expect_err("invalid");
    assert!(
        err.to_string().contains("listeners[0].trusted_proxies[0]"),
        "{err}"
    );
}

#[test]
fn limit_windows_are_bounded() {
    let bad = GOOD.replace("per: 100s", "per: 31d");
    let err = from_yaml(&bad).expect_err("invalid");
    assert!(
        err.to_string()
            .contains("plans.gold.limits[1].per: must be between 1s and 30d"),
        "{err}"
    );
}

#[test]
fn limit_names_are_printable_ascii_for_the_ratelimit_headers() {
    for name in [
        r#""a\r\nX-Evil: 1""#,
        r#""tab\there""#,
        r#""say \"hi\"""#,
        "café",
    ] {
        let bad = GOOD.replace("name: slow", &format!("name: {name}"));
        let err = from_yaml(&bad).expect_err("invalid");
        assert!(
            err.to_string().contains(
                "plans.gold.limits[1].name: must be non-empty printable ASCII without quotes or backslashes"
            ),
            "{name}: {err}"
        );
    }
    let good = GOOD.replace("name: slow", r#"name: "slow lane (v2)""#);
    let c = from_yaml(&good).expect("valid");
    assert_eq!(c.plans[0].limits[1].name, "slow lane (v2)");
}

#[test]
fn routes_sort_most_specific_first() {
    let cfg = GOOD.replace(
            "routes:",
            "routes:\n  - {path_prefix: /, upstream: backend}\n  - {path: /test/exact, upstream: backend}\n  - {path_prefix: /test/longer/, upstream: backend}",
        );
    let c = from_yaml(&cfg).expect("valid");
    let names: Vec<&str> = c.routes.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["/test/exact", "/test/longer/", "/test/", "/"]);
}

#[test]
fn a_target_with_a_scheme_and_no_port_takes_the_schemes() {
    let cfg = "listeners: [{address: \"127.0.0.1:8080\"}]\nupstreams:\n  s: {targets: [\"https://api.internal\"]}\n  p: {targets: [\"http://[::1]/\"]}\nroutes:\n  - {path_prefix: /s/, upstream: s}\n  - {path_prefix: /p/, upstream: p}\n";
    let c = from_yaml(cfg).expect("valid");
    let targets: Vec<_> = c.upstreams.iter().map(|u| u.targets.clone()).collect();
    assert!(
        targets.contains(&vec!["api.internal:443".to_string()]),
        "{targets:?}"
    );
    assert!(
        targets.contains(&vec!["[::1]:80".to_string()]),
        "{targets:?}"
    );
    // User info would go upstream in `Host`.
    // Said as such, without what comes before the `@`, with a scheme or without.
    for target in [
        "https://u:s3cret@api.internal:8443",
        "svc:s3cret@127.0.0.1:8443",
    ] {
        let cfg = format!("listeners: [{{address: \"127.0.0.1:8080\"}}]\nupstreams:\n  s: {{targets: [\"{target}\"]}}\nroutes:\n  - {{path_prefix: /, upstream: s}}\n");
        let text = from_yaml(&cfg).expect_err("user info").to_string();
        assert!(
            text.contains("a target takes no user info") && !text.contains("s3cret"),
            "{text}"
        );
    }
}

#[test]
fn a_tls_version_is_taken_unquoted_and_as_nginx_writes_it() {
    for v in ["1.3", "\"1.3\"", "TLSv1.3", "1.2", "tlsv1.2", "TLS1.2"] {
        let cfg = format!(
            "listeners:\n  - {{address: \"127.0.0.1:8443\", tls: {{certificates: [{{cert: /nonexistent/c.pem, key: /nonexistent/k.pem}}], min_version: {v}}}}}\n"
        );
        let text = from_yaml(&cfg).expect_err("no certificate").to_string();
        assert!(!text.contains("min_version"), "{v}: {text}");
    }
    let cfg = "listeners:\n  - {address: \"127.0.0.1:8443\", tls: {certificates: [{cert: /nonexistent/c.pem, key: /nonexistent/k.pem}], min_version: 1.1}}\n";
    let text = from_yaml(cfg).expect_err("invalid").to_string();
    assert!(text.contains("min_version: \"1.1\" is not"), "{text}");
}

#[test]
fn edge_settings_are_checked_with_their_place() {
    let bad = r#"
listeners:
  - address: "127.0.0.1:8443"
    h2c: true
    tls: {certificates: [{cert: /nonexistent/c.pem, key: /nonexistent/k.pem}], client_auth: maybe, min_version: "1.1"}
  - address: "127.0.0.1:8080"
    http2: {max_concurrent_streams: 0, stream_window: 1KiB}
upstreams:
  mixed: {targets: ["https://a.internal:443", "b.internal:80"]}
  plain: {targets: ["127.0.0.1:1"], ca_file: /nonexistent/ca.pem, protocol: h3, health: {interval: 1s, backoff: 0s}}
routes:
  - {path_prefix: /a/, upstream: mixed, auth: {mtls: true, header: [x-key]}}
"#;
    let err = from_yaml(bad).expect_err("invalid");
    let text: Vec<String> = err.problems().iter().map(|p| p.to_string()).collect();
    let expect = [
        "listeners[0].h2c: is for cleartext listeners",
        "listeners[0].tls.certificates[0]: cannot read /nonexistent/c.pem",
        "listeners[0].tls.client_auth: \"maybe\" is not `required` or `optional`",
        "listeners[0].tls.client_auth: needs `client_ca`",
        "listeners[0].tls.min_version: \"1.1\" is not",
        "listeners[1].http2: HTTP/2 needs `tls`",
        "listeners[1].http2.max_concurrent_streams: must be at least 1",
        "listeners[1].http2.stream_window: must be between 65535 bytes",
        "upstreams.mixed.targets: mixes http and https targets",
        "upstreams.plain.ca_file: cannot read /nonexistent/ca.pem",
        "upstreams.plain.protocol: \"h3\" is not `http1` or `h2`",
        "upstreams.plain.health.interval: is for active checks, which need `path`",
        "upstreams.plain.health.backoff: must be more than 0",
        "routes[0].auth.mtls: names the consumer by its client certificate",
        "routes[0].auth.mtls: needs a listener with `tls.client_ca`",
    ];
    for e in expect {
        assert!(
            text.iter().any(|t| t.starts_with(e)),
            "missing {e:?} in {text:#?}"
        );
    }
    // A certificate that fails to load (a renewal half written) is that listener's
    // problem alone: the route is not told its listener lacks `client_ca`.
    let half = r#"
listeners:
  - {address: "127.0.0.1:8443", tls: {certificates: [{cert: /nonexistent/c.pem, key: /nonexistent/c.key}], client_ca: /nonexistent/ca.pem}}
upstreams: {b: {targets: ["127.0.0.1:1"]}}
routes:
  - {path_prefix: /, upstream: b, auth: {mtls: true}}
"#;
    let err = from_yaml(half).expect_err("invalid");
    let text: Vec<String> = err.problems().iter().map(|p| p.to_string()).collect();
    assert!(
        !text.iter().any(|t| t.contains("needs a listener with")),
        "{text:#?}"
    );
    assert!(
        text.iter()
            .any(|t| t.starts_with("listeners[0].tls.certificates[0]: cannot read")),
        "{text:#?}"
    );
}

#[test]
fn edge_defaults_are_safe() {
    let c = from_yaml(
        r#"
listeners: [{address: "127.0.0.1:8080", h2c: true}]
upstreams:
  api: {targets: ["https://api.internal:8443/"], protocol: h2, health: {path: /health}}
routes:
  - {path_prefix: /, upstream: api, websocket: true}
"#,
    )
    .expect("valid");
    let l = &c.listeners[0];
    assert!(l.h2c && l.tls.is_none());
    assert_eq!(l.http2.max_concurrent_streams, 100);
    assert_eq!(l.http2.max_header_list_size, 32 * 1024);
    assert_eq!(l.http2.max_pending_resets, 20);
    let u = &c.upstreams[0];
    assert!(u.tls);
    assert_eq!(u.targets, ["api.internal:8443"]);
    assert_eq!(u.protocol, crate::UpstreamProtocol::H2);
    assert_eq!(u.health.failures, 5, "passive checks are on by default");
    let a = u.health.active.as_ref().expect("active checks");
    assert_eq!((a.interval.as_secs(), a.healthy, a.unhealthy), (5, 2, 3));
    assert!(c.routes[0].websocket);
}

#[test]
fn token_settings_are_checked_with_their_place() {
    let dir = std::env::temp_dir().join(format!("tollgate-jwt-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    std::fs::write(dir.join("short.secret"), "too short\n").expect("write");
    std::fs::write(dir.join("forty.secret"), "x".repeat(40)).expect("write");
    std::fs::write(dir.join("set.json"), r#"{"kids": []}"#).expect("write");
    std::fs::write(dir.join("garbage.json"), "garbage\n").expect("write");
    std::fs::write(
        dir.join("oct.json"),
        r#"{"keys": [{"kty": "oct", "k": "c2VjcmV0"}]}"#,
    )
    .expect("write");
    let bad = r#"
upstreams:
  backend: {targets: ["127.0.0.1:1337"]}
routes:
  - {name: a, path_prefix: /a/, upstream: backend, auth: {jwt: {audiences: [x]}}}
  - {name: b, path_prefix: /b/, upstream: backend, auth: {jwt: {issuer: "id.example.com"}}}
  - {name: c, path_prefix: /c/, upstream: backend, auth: {jwt: {secret_file: short.secret}}}
  - {name: d, path_prefix: /d/, upstream: backend, auth: {jwt: {jwks_file: set.json}}}
  - name: e
    path_prefix: /e/
    upstream: backend
    auth:
      header: [Authorization]
      jwt:
        jwks_url: https://id.example.com/jwks
        algorithms: [RS256, XS256]
        anonymous_plan: platinum
        claims_to_headers: {Host: sub, X-Email: "", X_User: sub, X-Forwarded-User: sub}
        clock_skew: 1h
  - {name: f, path_prefix: /f/, upstream: backend, auth: {jwt: {jwks_url: "http://x/j", secret_file: s}}}
  - {name: g, path_prefix: /g/, upstream: backend, auth: {jwt: {jwks_file: oct.json}}}
  - {name: h, path_prefix: /h/, upstream: backend, auth: {jwt: {secret_file: forty.secret, algorithms: [HS256, HS384]}}}
  - {name: i, path_prefix: /i/, upstream: backend, auth: {jwt: {secret_file: missing.secret, clock_skew: 1h, max_token_bytes: 100}}}
  - {name: j, path_prefix: /j/, upstream: backend, auth: {jwt: {jwks_file: garbage.json}}}
"#;
    let err = crate::from_yaml_in(bad, &dir)
        .expect_err("invalid")
        .to_string();
    // Its place in the key file, and the setting's in the config.
    assert!(
        err.contains("routes[9].auth.jwt.jwks_file: ")
            && err.contains("garbage.json:1:1 is not JSON: expected value (line 24, column 76)"),
        "{err}"
    );
    for want in [
        "routes[0].auth.jwt: needs `issuer`",
        "routes[1].auth.jwt.issuer: \"id.example.com\" must be an http:// or https:// URL",
        "routes[2].auth.jwt.secret_file: the secret in",
        "HMAC needs at least 32",
        "routes[3].auth.jwt.jwks_file:",
        "is not a JSON Web Key Set",
        "routes[4].auth.header: `Authorization` carries the route's bearer token",
        "routes[4].auth.jwt.algorithms[1]: unknown algorithm \"XS256\"",
        "routes[4].auth.jwt.anonymous_plan: unknown plan \"platinum\"",
        "routes[4].auth.jwt.claims_to_headers.Host: frames or routes the request",
        "routes[4].auth.jwt.claims_to_headers.X_User: use `-`, not `_`, in the name",
        "routes[4].auth.jwt.claims_to_headers.X-Forwarded-User: frames or routes the request",
        "routes[4].auth.jwt.claims_to_headers.X-Email: must name a claim",
        "routes[4].auth.jwt.clock_skew: must be at most 10m",
        "routes[5].auth.jwt: give one of `jwks_url`, `jwks_file` and `secret_file`, not several",
        "holds no public key (only shared-secret `oct` keys, or none)",
        "routes[7].auth.jwt.algorithms[1]: HS384 needs a secret of at least 48 bytes (RFC 7518 §3.2); the secret has 40",
        // A key source that cannot be read hides nothing else of the route's `jwt`.
        "routes[8].auth.jwt.secret_file:",
        "routes[8].auth.jwt.clock_skew: must be at most 10m",
        "routes[8].auth.jwt.max_token_bytes: must be between 256 and 64KiB",
    ] {
        assert!(err.contains(want), "missing {want:?} in:\n{err}");
    }
    assert!(!err.contains("routes[7].auth.jwt.algorithms[0]"), "{err}");
    // Left to the default, the algorithms are those the secret is long enough for.
    let good = r#"
listeners: [{address: "127.0.0.1:8080"}]
upstreams:
  backend: {targets: ["127.0.0.1:1337"]}
routes:
  - {name: h, path_prefix: /h/, upstream: backend, auth: {jwt: {secret_file: forty.secret}}}
"#;
    let cfg = crate::from_yaml_in(good, &dir).expect("valid");
    let jwt = cfg.routes[0]
        .auth
        .as_ref()
        .and_then(|a| a.jwt.as_ref())
        .expect("jwt");
    assert_eq!(jwt.algorithms, vec![crate::JwtAlgorithm::HS256]);
    let warned: Vec<String> = cfg.warnings.iter().map(|w| w.to_string()).collect();
    assert!(
        warned.iter().any(|w| w.starts_with(
            "routes[0].auth.jwt.secret_file: the secret has 40 bytes, too short for HS384, HS512"
        )),
        "{warned:#?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_token_route_takes_no_api_key_unless_it_names_one() {
    let c = from_yaml(
        r#"
listeners: [{address: "127.0.0.1:8080"}]
upstreams:
  backend: {targets: ["127.0.0.1:1337"]}
routes:
  - {name: t, path_prefix: /t/, upstream: backend, auth: {jwt: {jwks_url: "https://id.example.com/jwks"}}}
  - {name: k, path_prefix: /k/, upstream: backend, auth: {header: [x-key], jwt: {issuer: "https://id.example.com/"}}}
"#,
    )
    .expect("valid");
    let (t, k) = (&c.routes[0], &c.routes[1]);
    let auth = t.auth.as_ref().expect("auth");
    assert!(auth.header.is_empty() && auth.query.is_empty());
    let jwt = auth.jwt.as_ref().expect("jwt");
    assert_eq!(jwt.consumer_claim, "sub");
    assert_eq!(jwt.clock_skew, std::time::Duration::from_secs(30));
    assert!(jwt.algorithms.iter().all(|a| !a.symmetric()) && jwt.algorithms.len() == 9);
    let auth = k.auth.as_ref().expect("auth");
    assert_eq!(auth.header.len(), 1);
    assert!(matches!(
        auth.jwt.as_ref().map(|j| &j.keys),
        Some(crate::JwtKeys::Discovery(_))
    ));
}

#[test]
fn redis_is_a_url_or_the_sentinels_of_a_master() {
    let dir = std::env::temp_dir().join(format!("tollgate-redis-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    std::fs::write(dir.join("redis.pass"), "s3cret/+\n").expect("write");
    let with = |redis: &str| {
        crate::from_yaml_in(
            &format!(
                "listeners: [{{address: \"127.0.0.1:8080\"}}]\nupstreams: {{b: {{targets: [\"127.0.0.1:1\"]}}}}\nroutes: [{{name: r, path_prefix: /, upstream: b}}]\ncluster:\n  redis: {redis}\n"
            ),
            &dir,
        )
    };
    let c = with("redis://10.0.0.5:6379/0").expect("a URL, as before");
    assert_eq!(
        c.cluster.expect("cluster").redis,
        crate::RedisTarget::Url("redis://10.0.0.5:6379/0".into())
    );
    // What the Redis client would refuse at every connect is refused here, in its place.
    for (url, want) in [
        ("redis://127.0.0.1:notaport/0", "is not a valid URL"),
        ("redis://:6379/0", "is not a valid URL"),
        ("redis:///0", "names no host"),
        (
            "redis://127.0.0.1:6379/abc",
            "the path is the database number",
        ),
        ("redis://0.0.0.0:6379/0", "is no address to connect to"),
        ("redis://[::]:6379/0", "is no address to connect to"),
        // The error shows the URL without its password.
        (
            "redis://:hunter2@0.0.0.0:6379/0",
            "\"redis://<redacted>@0.0.0.0:6379/0\": 0.0.0.0 is no address",
        ),
        // A password's `#` or `@` written as it is moves the host the client reads.
        (
            "redis://:hunter2#x@10.0.0.5:6379/0",
            "written percent-encoded (`%23`",
        ),
        (
            "redis://:hunter2@x@10.0.0.5:6379/0",
            "written percent-encoded (`%23`",
        ),
    ] {
        let err = with(url).expect_err(url).to_string();
        assert!(
            err.contains("cluster.redis: ") && err.contains(want),
            "{url}: {err}"
        );
        assert!(!err.contains("hunter2"), "{err}");
    }
    assert!(
        with("redis://127.0.0.1:6379/99").is_ok(),
        "a server may have more databases"
    );
    for ok in [
        "redis://127.0.0.1:6379/0/",
        "redis://[::1]:6379/0?protocol=resp3",
        "rediss://user:p%40ss@redis.internal:6380",
    ] {
        assert!(with(ok).is_ok(), "{ok}");
    }
    // The URL's path is its database: `db` beside it is refused, not one of two.
    for given in [
        "{url: \"redis://10.0.0.5\", db: 20}",
        "{url: \"redis://10.0.0.5/3\", db: 3}",
    ] {
        let err = with(given).expect_err(given).to_string();
        assert!(
            err.contains("cluster.redis.db: with `url`, the database is the URL's path"),
            "{given}: {err}"
        );
    }
    std::fs::write(dir.join("empty.pass"), "\n").expect("write");
    let err = with("{url: \"redis://10.0.0.5\", password_file: empty.pass}")
        .expect_err("an empty password file")
        .to_string();
    assert!(
        err.contains("cluster.redis.password_file: ") && err.contains("is empty"),
        "{err}"
    );
    let err = with("{cluster_nodes: [\"0.0.0.0:7000\"]}")
        .expect_err("a wildcard node")
        .to_string();
    assert!(
        err.contains("cluster.redis.cluster_nodes[0]: \"0.0.0.0:7000\" must be host:port"),
        "{err}"
    );
    let err = with("{cluster_nodes: \"10.0.1.1:6379\"}")
        .expect_err("one node not in a list")
        .to_string();
    assert!(err.contains("(a list: [10.0.1.1:6379]"), "{err}");
    let c = with("{url: \"redis://10.0.0.5:6379/0\", password_file: redis.pass}").expect("url");
    let target = c.cluster.expect("cluster").redis;
    assert_eq!(
        target,
        crate::RedisTarget::Url("redis://:s3cret%2F%2B@10.0.0.5:6379/0".into())
    );
    // Logs and `/status` hide it as every other URL is hidden.
    assert_eq!(target.shown(), "redis://<redacted>@10.0.0.5:6379/0");
    // An ACL user in the URL takes the file's password.
    for (url, want) in [
        (
            "redis://gw@10.0.0.5:6379/0",
            "redis://gw:s3cret%2F%2B@10.0.0.5:6379/0",
        ),
        ("rediss://gw:@10.0.0.5", "rediss://gw:s3cret%2F%2B@10.0.0.5"),
    ] {
        let c = with(&format!("{{url: \"{url}\", password_file: redis.pass}}")).expect(url);
        assert_eq!(
            c.cluster.expect("cluster").redis,
            crate::RedisTarget::Url(want.into())
        );
    }
    let err = with("{url: \"redis://gw:pw@10.0.0.5\", password_file: redis.pass}")
        .expect_err("two passwords")
        .to_string();
    assert!(
        err.contains("cluster.redis.url: holds a password already"),
        "{err}"
    );
    let c = with("{sentinels: [\"10.0.0.1:26379\", \"10.0.0.2:26379\"], master_name: tollgate, password_file: redis.pass, sentinel_password_file: redis.pass, sentinel_username: watch}")
        .expect("sentinels");
    let target = c.cluster.expect("cluster").redis;
    assert_eq!(
        target,
        crate::RedisTarget::Sentinel {
            sentinels: vec!["10.0.0.1:26379".into(), "10.0.0.2:26379".into()],
            master_name: "tollgate".into(),
            username: None,
            password: Some("s3cret/+".into()),
            db: 0,
            sentinel_username: Some("watch".into()),
            sentinel_password: Some("s3cret/+".into()),
            tls: false,
        }
    );
    let err = with("{url: \"redis://h:1\", sentinel_password_file: redis.pass}")
        .expect_err("sentinel password without sentinels")
        .to_string();
    assert!(
        err.contains("cluster.redis.sentinel_password_file: goes with `sentinels`"),
        "{err}"
    );
    assert!(!target.shown().contains("s3cret"));
    let c = with("{cluster_nodes: [\"10.0.1.1:6379\", \"10.0.1.2:6379\"], username: gw, password_file: redis.pass, tls: true}")
        .expect("cluster");
    let target = c.cluster.expect("cluster").redis;
    assert_eq!(
        target,
        crate::RedisTarget::Cluster {
            nodes: vec!["10.0.1.1:6379".into(), "10.0.1.2:6379".into()],
            username: Some("gw".into()),
            password: Some("s3cret/+".into()),
            tls: true,
        }
    );
    assert!(!target.shown().contains("s3cret"));
    let err = with("{sentinels: [\"nohost\", \"10.0.0.1:26379\"], colour: blue}")
        .expect_err("bad")
        .to_string();
    for want in [
        "cluster.redis.sentinels[0]: \"nohost\" must be host:port",
        "cluster.redis.colour: unknown setting",
        "cluster.redis: with `sentinels`, name the master",
    ] {
        assert!(err.contains(want), "missing {want:?} in:\n{err}");
    }
    let err = with("{cluster_nodes: [\"a:1\", \"b\"], db: 3, tls: yes}")
        .expect_err("bad cluster")
        .to_string();
    for want in [
        "cluster.redis.cluster_nodes[1]: \"b\" must be host:port",
        "cluster.redis.db: a Redis Cluster has database 0 only",
        "cluster.redis.tls: must be true, false, or a map",
    ] {
        assert!(err.contains(want), "missing {want:?} in:\n{err}");
    }
    // TLS files: a CA to trust, a client certificate and its key, read now; `tls:` and a
    // one-server URL agree on TLS.
    let ca = rcgen::generate_simple_self_signed(vec!["redis.test".to_string()]).expect("cert");
    std::fs::write(dir.join("ca.pem"), ca.cert.pem()).expect("write");
    std::fs::write(dir.join("client.key"), ca.signing_key.serialize_pem()).expect("write");
    let c = with("{url: \"rediss://10.0.0.5:6380/0\", tls: {ca_file: ca.pem, cert_file: ca.pem, key_file: client.key}}")
        .expect("TLS files");
    let files = c.cluster.expect("cluster").redis_tls.expect("files");
    assert_eq!(files.ca_pem.as_deref(), Some(ca.cert.pem().as_bytes()));
    assert!(files.client.is_some());
    let c = with("{sentinels: [\"10.0.0.1:26379\"], master_name: m, tls: {ca_file: ca.pem}}")
        .expect("sentinels over TLS");
    assert!(matches!(
        c.cluster.expect("cluster").redis,
        crate::RedisTarget::Sentinel { tls: true, .. }
    ));
    let err = with(
        "{url: \"redis://10.0.0.5/0\", tls: {ca_file: missing.pem, cert_file: ca.pem, colour: x}}",
    )
    .expect_err("bad TLS")
    .to_string();
    for want in [
        "cluster.redis.tls: TLS to one server needs a rediss:// URL",
        "cluster.redis.tls.ca_file: cannot read",
        "cluster.redis.tls.cert_file: needs `key_file`",
        "cluster.redis.tls.colour: unknown setting",
    ] {
        assert!(err.contains(want), "missing {want:?} in:\n{err}");
    }
    let err = with("{sentinels: [\"10.0.0.1:26379\"], master_name: m, cluster_nodes: [\"a:1\"]}")
        .expect_err("two forms")
        .to_string();
    assert!(
        err.contains("cluster.redis: give one of `url`, `sentinels` or `cluster_nodes`"),
        "{err}"
    );
    // A URL where an address goes, a repeated node, an empty master name: each at its
    // place, and no "needs one of" beside them.
    let err = with(
        "{sentinels: [\"redis://10.0.0.1:26379\", \"[::1]:26379\", \"[::1]:26379\"], master_name: \"\"}",
    )
    .expect_err("bad sentinels");
    let text: Vec<String> = err.problems().iter().map(|p| p.to_string()).collect();
    for want in [
        "cluster.redis.sentinels[0]: \"redis://10.0.0.1:26379\" must be host:port",
        "cluster.redis.sentinels[2]: repeats cluster.redis.sentinels[1]",
        "cluster.redis.master_name: with `sentinels`, name the master",
    ] {
        assert!(
            text.iter().any(|t| t.starts_with(want)),
            "missing {want:?} in {text:#?}"
        );
    }
    assert_eq!(text.len(), 3, "{text:#?}");
    let err = with("{cluster_nodes: [\"user@h:1\"]}").expect_err("bad node");
    let text: Vec<String> = err.problems().iter().map(|p| p.to_string()).collect();
    assert_eq!(text.len(), 1, "{text:#?}");
    let err = with("{url: \"http://x\"}")
        .expect_err("bad url")
        .to_string();
    assert!(
        err.contains("cluster.redis.url: \"http://x\" must be a redis://"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_bad_value_is_reported_once_not_again_through_a_default_drawn_from_it() {
    let bad = GOOD.replace(
        r#"listeners: [{address: "127.0.0.1:8080"}]"#,
        r#"listeners: [{address: "127.0.0.1:8080", max_header_bytes: 512}]"#,
    );
    let err = from_yaml(&bad).expect_err("invalid");
    let text: Vec<String> = err.problems().iter().map(|p| p.to_string()).collect();
    assert_eq!(text.len(), 1, "{text:#?}");
    assert!(
        text[0].starts_with("listeners[0].max_header_bytes"),
        "{text:#?}"
    );
    // Set itself, the header list is still checked.
    let bad = GOOD.replace(
        r#"listeners: [{address: "127.0.0.1:8080"}]"#,
        r#"listeners: [{address: "127.0.0.1:8080", http2: {max_header_list_size: 512}}]"#,
    );
    let err = from_yaml(&bad).expect_err("invalid");
    let text: Vec<String> = err.problems().iter().map(|p| p.to_string()).collect();
    assert!(
        text.iter()
            .any(|t| t.starts_with("listeners[0].http2.max_header_list_size")),
        "{text:#?}"
    );
}

#[test]
fn a_cors_origin_a_browser_never_sends_is_warned_of() {
    let cfg = from_yaml(
        r#"
listeners: [{address: "127.0.0.1:8080"}]
upstreams:
  backend: {targets: ["127.0.0.1:1337"]}
routes:
  - name: a
    path_prefix: /
    upstream: backend
    cors: {origins: ["https://a.example", "http://b.example:8080", "null", "https://c.example/", "HTTPS://D.example", "e.example", "https://f.example:443", "https://*.g.example", "https://bücher.example"]}
"#,
    )
    .expect("valid: a warning, not a problem");
    let warned: Vec<String> = cfg.warnings.iter().map(|w| w.to_string()).collect();
    for i in 3..=8 {
        let at = format!("routes[0].cors.origins[{i}]: ");
        assert!(
            warned
                .iter()
                .any(|w| w.starts_with(&at) && w.contains("never matches")),
            "missing {at} in {warned:#?}"
        );
    }
    assert!(
        !warned
            .iter()
            .any(|w| w.starts_with("routes[0].cors.origins[0]")
                || w.starts_with("routes[0].cors.origins[1]")
                || w.starts_with("routes[0].cors.origins[2]")),
        "{warned:#?}"
    );
}

#[test]
fn a_method_written_in_lower_case_is_taken_in_upper_case_with_a_warning() {
    let cfg = from_yaml(
        r#"
listeners: [{address: "127.0.0.1:8080"}]
upstreams:
  backend: {targets: ["127.0.0.1:1337"]}
routes:
  - {name: a, path_prefix: /, upstream: backend, methods: [get, POST]}
"#,
    )
    .expect("valid");
    // (`GET` brings `HEAD`.)
    assert_eq!(
        cfg.routes[0].methods,
        Some(vec![
            http::Method::GET,
            http::Method::POST,
            http::Method::HEAD
        ])
    );
    let warned: Vec<String> = cfg.warnings.iter().map(|w| w.to_string()).collect();
    assert!(
        warned.iter().any(|w| w.starts_with(
            "routes[0].methods[0]: methods are case-sensitive: \"get\" is taken as GET"
        )),
        "{warned:#?}"
    );
    assert!(
        !warned.iter().any(|w| w.starts_with("routes[0].methods[1]")),
        "{warned:#?}"
    );
}

#[test]
fn cors_wildcards_browsers_read_literally_with_credentials_are_refused() {
    let yaml = |cors: &str| {
        format!("listeners: [{{address: \"127.0.0.1:8080\"}}]\nupstreams:\n  backend: {{targets: [\"127.0.0.1:1337\"]}}\nroutes:\n  - {{name: a, path_prefix: /, upstream: backend, cors: {cors}}}\n")
    };
    let err = from_yaml(&yaml(
        "{origins: [\"https://a.example\"], credentials: true, expose_headers: [X-A, \"*\"]}",
    ))
    .expect_err("refused")
    .to_string();
    assert!(
        err.contains("routes[0].cors.expose_headers[1]: \"*\" exposes nothing"),
        "{err}"
    );
    // Without credentials `*` is a wildcard; a long max_age is warned of.
    let cfg = from_yaml(&yaml(
        "{origins: [\"https://a.example\"], expose_headers: [\"*\"], headers: [\"*\"], max_age: 30d}",
    ))
    .expect("valid");
    let warned: Vec<String> = cfg.warnings.iter().map(|w| w.to_string()).collect();
    assert!(
        warned
            .iter()
            .any(|w| w.starts_with("routes[0].cors.max_age: browsers keep a preflight at most 24h")),
        "{warned:#?}"
    );
}

#[test]
fn a_route_without_one_path_hides_none_of_the_files_other_problems() {
    let err = from_yaml(
        r#"
listeners: [{address: "127.0.0.1:8080"}]
upstreams:
  backend: {targets: ["127.0.0.1:0"]}
routes:
  - {name: a, path: /a, path_prefix: /a/, upstream: nowhere, host: "*.*.org", limits: [{requests: 0, per: 1s}]}
"#,
    )
    .expect_err("refused")
    .to_string();
    for want in [
        "routes[0]: give either `path_prefix` or `path`, not both",
        "routes[0].upstream: unknown upstream \"nowhere\"",
        "routes[0].host: \"*.*.org\" never matches",
        "routes[0].limits",
        "upstreams.backend.targets[0]: \"127.0.0.1:0\": port 0",
    ] {
        assert!(err.contains(want), "missing {want:?} in {err}");
    }
}

#[test]
fn routes_hidden_by_others_or_open_to_other_methods_are_warned_of() {
    let cfg = from_yaml(
        r#"
listeners: [{address: "127.0.0.1:8080"}]
upstreams:
  backend: {targets: ["127.0.0.1:1337"]}
consumers:
  - {name: alice, keys: [k1]}
routes:
  - {name: admin, path_prefix: /admin/, upstream: backend, methods: [GET, HEAD], auth: {}, allow: {consumers: [alice]}}
  - {name: first, path_prefix: /b/, upstream: backend}
  - {name: again, path_prefix: /b/, upstream: backend, methods: [GET]}
  - {name: posts, path_prefix: /b/, upstream: backend, methods: [POST], auth: {}}
  - {name: all, path_prefix: /, upstream: backend}
  - {name: open, path_prefix: /x/, upstream: backend, methods: [GET, POST]}
  - {name: guarded, path_prefix: /x/, upstream: backend, methods: [POST, DELETE], auth: {}}
  - {name: trace, path_prefix: /b/, upstream: backend, methods: [TRACE]}
"#,
    )
    .expect("valid: warnings, not problems");
    let warned: Vec<String> = cfg.warnings.iter().map(|w| w.to_string()).collect();
    let has = |at: &str, what: &str| {
        warned
            .iter()
            .any(|w| w.starts_with(&format!("{at}: ")) && w.contains(what))
    };
    assert!(
        has(
            "routes[0].methods",
            "go to routes[4] (\"all\"), which has no `auth`"
        ),
        "{warned:#?}"
    );
    assert!(
        has("routes[2]", "never used: routes[1] (\"first\")"),
        "{warned:#?}"
    );
    assert!(has("routes[3]", "never used"), "{warned:#?}");
    // An open route first on the same paths takes some of a guarded route's methods.
    assert!(
        has(
            "routes[6].methods",
            "POST requests to \"/x/\" go to routes[5] (\"open\"), which comes first"
        ),
        "{warned:#?}"
    );
    // A route without a list of methods does not take TRACE: one that lists it is used.
    assert!(
        !warned.iter().any(|w| w.starts_with("routes[7]")),
        "{warned:#?}"
    );
    assert!(
        !warned
            .iter()
            .any(|w| w.starts_with("routes[1]") || w.starts_with("routes[4]")),
        "{warned:#?}"
    );
}
