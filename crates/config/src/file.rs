//! The config file as written: serde types that mirror the YAML, unknown fields rejected.
//! Nothing here is validated beyond its type; see [`crate::model`] for the runtime form.

use crate::units::{Dur, Size};
use serde::Deserialize;
use std::collections::BTreeMap;

/// The whole file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    /// Process-wide settings.
    #[serde(default)]
    pub server: Option<Server>,
    /// Addresses to accept client connections on.
    #[serde(default)]
    pub listeners: Vec<Listener>,
    /// Backends, by name.
    #[serde(default)]
    pub upstreams: BTreeMap<String, Upstream>,
    /// Routes, matched most specific first.
    #[serde(default)]
    pub routes: Vec<Route>,
    /// API consumers and their keys.
    #[serde(default)]
    pub consumers: Vec<Consumer>,
    /// More consumers, one per line (JSON lines, or CSV for `*.csv`).
    pub consumers_file: Option<String>,
    /// The change log of consumers managed through the admin API (default: beside
    /// `consumers_file` as `<file>.changes`; without either, changes live in memory).
    pub consumers_log: Option<String>,
    /// Keep limit counters on disk across restarts.
    pub state: Option<State>,
    /// Plans: named sets of limits that consumers subscribe to.
    #[serde(default)]
    pub plans: BTreeMap<String, Plan>,
    /// Share limits with other nodes through Redis.
    pub cluster: Option<Cluster>,
    /// The admin listener: usage per consumer, metrics.
    pub admin: Option<Admin>,
    /// The response cache all routes share (routes opt in with their own `cache:`).
    pub cache: Option<Cache>,
    /// One JSON line per request, to a file or stdout.
    pub access_log: Option<AccessLog>,
    /// Usage history per consumer, route and status class, kept on the node.
    pub analytics: Option<Analytics>,
    /// What `/metrics` breaks down.
    pub metrics: Option<Metrics>,
    /// OpenTelemetry traces, exported over OTLP.
    pub tracing: Option<Tracing>,
    /// The process log (stderr).
    pub log: Option<Log>,
}

/// The process log: how it is written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Log {
    /// `text` for people (the default), `json` for log shippers; `--log-format` and
    /// `TOLLGATE_LOG_FORMAT` win over it.
    pub format: Option<crate::model::LogFormat>,
}

/// OpenTelemetry traces: one span per request, sampled, exported in batches over OTLP.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tracing {
    /// Where spans are sent.
    pub otlp: Otlp,
    /// Share of new traces recorded, 0 to 1 (default 1). A trusted parent's decision wins.
    pub sample_ratio: Option<f64>,
    /// `service.name` of the spans (default `tollgate`).
    pub service_name: Option<String>,
}

/// The OTLP collector and how spans reach it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Otlp {
    /// The collector's URL (default `http://localhost:4317` for gRPC,
    /// `http://localhost:4318/v1/traces` for HTTP).
    pub endpoint: Option<String>,
    /// `grpc` or `http` (protobuf over HTTP); default `grpc`.
    pub protocol: Option<String>,
    /// Longest wait for one export (default 10s).
    pub timeout: Option<Dur>,
    /// Headers (gRPC metadata) sent with every export, e.g. an API key for the collector.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// Spans held for export; beyond, new spans are dropped and counted (default 2048).
    pub queue_size: Option<usize>,
    /// Most spans in one export (default 512).
    pub batch_size: Option<usize>,
    /// How often held spans are sent when fewer than a batch wait (default 1s).
    pub export_interval: Option<Dur>,
}

/// Where limit counters are kept across restarts.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct State {
    /// The SQLite database file.
    pub path: String,
    /// How often counters are written (default 1s).
    pub flush_interval: Option<Dur>,
}

/// The access log.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AccessLog {
    /// A file (appended to, reopened on `SIGUSR1`), or `stdout`.
    pub path: String,
    /// Lines held for the writer before new ones are dropped (default 65536).
    pub buffer: Option<usize>,
}

/// Usage history.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Analytics {
    /// The SQLite database file.
    pub path: String,
    /// How long counts are kept (default 30d).
    pub retention: Option<Dur>,
    /// Refuse to start when the database cannot be opened (default: start without analytics).
    #[serde(default)]
    pub required: bool,
}

/// `/metrics` options.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Metrics {
    /// Count requests per consumer too (one series per consumer).
    #[serde(default)]
    pub per_consumer: bool,
}

/// The shared response store.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Cache {
    /// Bodies, headers and keys together; the least valuable entries go when it is full.
    pub max_size: Option<Size>,
    /// Larger responses stream through uncached.
    pub max_object_size: Option<Size>,
}

/// Which query parameters form a cache key: `all`, `none`, or a list of names.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum KeyQuery {
    /// `all` or `none`.
    Word(String),
    /// These parameters only.
    Names(Vec<String>),
}

/// A route's caching.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteCache {
    /// Freshness of a cacheable response without Cache-Control or Expires (0s: not stored).
    pub default_ttl: Option<Dur>,
    /// One entry for every consumer allowed on the route (default: one per consumer).
    #[serde(default)]
    pub shared: bool,
    /// Query parameters that form the key (default `all`).
    pub key_query: Option<KeyQuery>,
    /// Request headers that also form the key.
    #[serde(default)]
    pub key_headers: Vec<String>,
}

/// Shared limits through Redis.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Cluster {
    /// `redis://[:password@]host:port/db` (`rediss://` for TLS), or a map: `url`, or
    /// `sentinels` with `master_name`; `password_file`, `db`.
    pub redis: serde_yaml_ng::Value,
    /// How often a node settles with Redis (default 10ms).
    pub sync_interval: Option<Dur>,
    /// `open` (default): keep enforcing each node's last share; `closed`: answer 503.
    pub on_redis_down: Option<String>,
    /// Largest share of a limit the nodes together may admit before Redis confirms it,
    /// as a percentage (default "1%"). 0% makes every admission wait for a lease.
    pub max_overadmission: Option<String>,
    /// Prefix of every Redis key (default `tollgate`).
    pub key_prefix: Option<String>,
}

/// The admin listener.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Admin {
    /// `ip:port`; keep it on a private address.
    pub address: String,
    /// A file holding the bearer token the admin endpoints require (all but `/healthz`).
    pub token_file: Option<String>,
    /// Most open admin connections (default 64); the proxy listeners have their own.
    pub max_connections: Option<usize>,
    /// Time to receive a request head, and the idle keep-alive limit (default 30s).
    pub header_timeout: Option<Dur>,
}

/// Process-wide settings.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Server {
    /// How long in-flight requests may take to finish on shutdown.
    pub drain_timeout: Option<Dur>,
    /// Reload when the config file changes (checked once a second). Default: true.
    pub watch_config: Option<bool>,
}

/// One listening socket.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Listener {
    /// `ip:port`.
    pub address: String,
    /// Largest request head (request line and headers) accepted; larger gets 431.
    pub max_header_bytes: Option<Size>,
    /// Most request headers accepted; more gets 431.
    pub max_headers: Option<usize>,
    /// Time allowed to receive a request head.
    pub header_timeout: Option<Dur>,
    /// Largest request body accepted; larger gets 413.
    pub max_body_bytes: Option<Size>,
    /// Longest wait for the next piece of a request body; longer gets 408.
    pub body_timeout: Option<Dur>,
    /// Longest wait for the client to take the next piece of an answer; longer closes.
    pub send_timeout: Option<Dur>,
    /// Most open client connections; more wait in the listen backlog.
    pub max_connections: Option<usize>,
    /// Addresses (`10.0.0.0/8`, `127.0.0.1`) of proxies whose `X-Forwarded-*` headers are kept.
    #[serde(default)]
    pub trusted_proxies: Vec<String>,
    /// Keep the client's `X-Request-Id` (default: only from `trusted_proxies`; others get a new one).
    #[serde(default)]
    pub trust_request_id: bool,
    /// Continue every client's W3C trace (`traceparent`, `tracestate`) and honour its
    /// sampling decision (default: only from `trusted_proxies`; others start a new trace).
    #[serde(default)]
    pub trust_trace_context: bool,
    /// Terminate TLS on this listener (HTTP/1.1 and HTTP/2 by ALPN).
    pub tls: Option<ListenerTls>,
    /// Serve cleartext HTTP/2 with prior knowledge too (HTTP/1.1 is still served).
    #[serde(default)]
    pub h2c: bool,
    /// HTTP/2 limits (TLS and h2c listeners).
    pub http2: Option<Http2>,
}

/// TLS on a listener.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListenerTls {
    /// Certificate chains and keys; each serves the names of its SAN, the first is the default.
    pub certificates: Vec<CertificateFiles>,
    /// CA bundle that client certificates are verified against (mTLS).
    pub client_ca: Option<String>,
    /// `required` (default when `client_ca` is set) or `optional`.
    pub client_auth: Option<String>,
    /// Oldest TLS version accepted: `"1.2"` (default) or `"1.3"` (quoted or not, or as
    /// nginx writes it: `TLSv1.3`).
    pub min_version: Option<crate::units::Text>,
}

/// One certificate chain and its private key, PEM files.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CertificateFiles {
    /// The chain, leaf first.
    pub cert: String,
    /// The leaf's private key (PKCS#8, PKCS#1 or SEC1).
    pub key: String,
}

/// HTTP/2 server limits.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Http2 {
    /// Streams a client may have open at once (default 100).
    pub max_concurrent_streams: Option<u32>,
    /// Largest header list (decoded) accepted (default: the listener's `max_header_bytes`).
    pub max_header_list_size: Option<Size>,
    /// Flow-control window per stream (default 256KiB).
    pub stream_window: Option<Size>,
    /// Flow-control window per connection (default 1MiB).
    pub connection_window: Option<Size>,
    /// Streams a client may reset before their answer, net of answered ones, before it is
    /// sent GOAWAY (default 20; the rapid-reset guard).
    pub max_pending_resets: Option<usize>,
    /// Streams of one connection that may hold an upstream connection at once (default
    /// 32); more wait for one of them to end.
    pub max_upstream_streams: Option<u32>,
    /// Request-body bytes one connection's streams may hold in the gateway before their
    /// requests go upstream (default 1MiB); past it, bodies stream as they come.
    pub max_request_buffer: Option<Size>,
}

/// A backend: one or more targets, used round-robin over a keep-alive pool.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Upstream {
    /// `host:port` of each target.
    pub targets: Vec<String>,
    /// Idle keep-alive connections kept per target.
    pub pool_max_idle: Option<usize>,
    /// Time allowed to open a connection.
    pub connect_timeout: Option<Dur>,
    /// Time allowed from sending the request to receiving the response head.
    pub response_timeout: Option<Dur>,
    /// How long an idle pooled connection is kept.
    pub idle_timeout: Option<Dur>,
    /// Longest wait for the next piece of a response body.
    pub read_timeout: Option<Dur>,
    /// Most connections open at once to each target; requests beyond wait, then get 503.
    pub max_connections: Option<usize>,
    /// `http1` (default) or `h2` (ALPN over TLS, prior knowledge in cleartext).
    pub protocol: Option<String>,
    /// `h2`: streams one connection to a target carries before another is opened
    /// (default 100).
    pub max_concurrent_streams: Option<usize>,
    /// CA bundle that `https://` targets' certificates are verified against (default: the
    /// system's roots).
    pub ca_file: Option<String>,
    /// Health checks: passive always (unless `failures: 0`), active with `path`.
    pub health: Option<Health>,
}

/// Upstream health checks.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Health {
    /// Path of the active check (`GET`, 2xx/3xx is healthy); no active checks when absent.
    pub path: Option<String>,
    /// Time between active checks of a target (default 5s).
    pub interval: Option<Dur>,
    /// Time allowed for an active check (default 2s).
    pub timeout: Option<Dur>,
    /// Successful checks in a row that bring a target back (default 2).
    pub healthy: Option<u32>,
    /// Failed checks in a row that take a target out (default 3).
    pub unhealthy: Option<u32>,
    /// Passive: failed connects or 5xx answers in a row that take a target out (default 5; 0: off).
    pub failures: Option<u32>,
    /// Passive: how long a target stays out before it is tried again (default 10s).
    pub backoff: Option<Dur>,
}

/// A route: which requests, where they go, which policies apply.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Route {
    /// A stable name (keeps per-route counters across reloads); default derived from host and path.
    pub name: Option<String>,
    /// Host to match (`api.example.com`, or `*.example.com`); any host when absent.
    pub host: Option<String>,
    /// Path prefix to match.
    pub path_prefix: Option<String>,
    /// Exact path to match.
    pub path: Option<String>,
    /// Methods allowed; others get 405 with `Allow`. All methods when absent.
    pub methods: Option<Vec<String>>,
    /// Name of the upstream to forward to.
    pub upstream: String,
    /// Remove the matched prefix before forwarding.
    #[serde(default)]
    pub strip_prefix: bool,
    /// Forward the client's `Host` instead of the target's.
    #[serde(default)]
    pub preserve_host: bool,
    /// Match the path ignoring ASCII case (for case-insensitive backends).
    #[serde(default)]
    pub case_insensitive: bool,
    /// Read request bodies up to 64KiB before taking an upstream connection (default
    /// true); false streams them at once, for full-duplex APIs.
    pub request_buffering: Option<bool>,
    /// API key authentication.
    pub auth: Option<Auth>,
    /// Who may call the route (requires `auth`).
    pub allow: Option<Allow>,
    /// Per-consumer limits on this route, on top of the consumer's plan (requires `auth`).
    #[serde(default)]
    pub limits: Vec<Limit>,
    /// CORS: preflights answered here, headers added to responses.
    pub cors: Option<Cors>,
    /// Store this route's responses in the shared cache.
    pub cache: Option<RouteCache>,
    /// Let WebSocket (and other `Upgrade`) requests through: joined both ways once admitted.
    #[serde(default)]
    pub websocket: bool,
}

/// Where to find the API key and what to do with it.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Auth {
    /// Query parameter names that may carry the key.
    #[serde(default)]
    pub query: Vec<String>,
    /// Header names that may carry the key.
    #[serde(default)]
    pub header: Vec<String>,
    /// Forward the credential upstream (default: removed).
    #[serde(default)]
    pub keep_credential: bool,
    /// Header that carries the consumer's name upstream (default `X-Consumer`).
    pub consumer_header: Option<String>,
    /// Identify the consumer by its verified TLS client certificate: the first SAN (DNS,
    /// URI, email) or subject CN that names a consumer.
    #[serde(default)]
    pub mtls: bool,
    /// Accept a signed bearer token (JWT) instead of, or beside, an API key.
    pub jwt: Option<Jwt>,
}

/// `auth.jwt:`: who signs the tokens a route accepts, and what in them names the caller.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Jwt {
    /// The issuer: checked against `iss`; alone, its OpenID metadata names the JWKS.
    pub issuer: Option<String>,
    /// The issuer's JSON Web Key Set, fetched over HTTP(S).
    pub jwks_url: Option<String>,
    /// A JSON Web Key Set on disk.
    pub jwks_file: Option<String>,
    /// The shared secret of HS256/384/512 tokens, on disk.
    pub secret_file: Option<String>,
    /// Accepted `aud` values (any one must be in the token).
    #[serde(default)]
    pub audiences: Vec<String>,
    /// Accepted signing algorithms.
    pub algorithms: Option<Vec<String>>,
    /// The claim naming the consumer (default `sub`).
    pub consumer_claim: Option<String>,
    /// The claim naming the plan of a caller who is not a listed consumer.
    pub plan_claim: Option<String>,
    /// The plan of a caller with a valid token who is not a listed consumer.
    pub anonymous_plan: Option<String>,
    /// Tolerance on `exp` and `nbf` (default 30s).
    pub clock_skew: Option<Dur>,
    /// Forward `Authorization` upstream (default: removed).
    #[serde(default)]
    pub forward_token: bool,
    /// Request headers set from claims: header name → claim name.
    #[serde(default)]
    pub claims_to_headers: BTreeMap<String, String>,
    /// Longest token accepted (default 8KiB); longer ones are refused unread.
    pub max_token_bytes: Option<Size>,
    /// Timeout of one fetch of the JWKS or the issuer's metadata (default 10s).
    pub fetch_timeout: Option<Dur>,
}

/// Who may call a route.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Allow {
    /// Consumers by name.
    #[serde(default)]
    pub consumers: Vec<String>,
    /// Plans by name: every consumer on them may call.
    #[serde(default)]
    pub plans: Vec<String>,
}

/// "N requests per duration".
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Limit {
    /// Name in RateLimit headers and errors; default e.g. `1000-per-10s`.
    pub name: Option<String>,
    /// Requests allowed per window.
    pub requests: u64,
    /// Window length, from 1s to 30d.
    pub per: Dur,
}

/// CORS settings.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Cors {
    /// Allowed origins (`https://app.example.com`), or `*`.
    pub origins: Vec<String>,
    /// Methods allowed cross-origin (default: the route's methods, or common ones).
    pub methods: Option<Vec<String>>,
    /// Request headers allowed (default: what the preflight asks for).
    pub headers: Option<Vec<String>>,
    /// Response headers exposed to scripts.
    #[serde(default)]
    pub expose_headers: Vec<String>,
    /// How long browsers may cache a preflight answer.
    pub max_age: Option<Dur>,
    /// Allow credentials (cookies); not with origin `*`.
    #[serde(default)]
    pub credentials: bool,
}

/// A caller of the API.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Consumer {
    /// Unique name, passed upstream in the consumer header.
    pub name: String,
    /// API keys that identify the consumer.
    #[serde(default)]
    pub keys: Vec<String>,
    /// SHA-256 digests (64 hex digits) of more keys, so the file holds no secret.
    #[serde(default)]
    pub key_sha256: Vec<String>,
    /// The consumer's plan.
    pub plan: Option<String>,
}

/// A named set of limits.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Plan {
    /// Limits, all checked together on every call.
    #[serde(default)]
    pub limits: Vec<Limit>,
}
