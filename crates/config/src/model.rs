//! The validated config: what the gateway runs on. Every reference is resolved to an
//! index, every value is in range, defaults are filled in.

use http::{HeaderName, Method};
use std::net::SocketAddr;
use std::time::Duration;

/// A validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// Process-wide settings.
    pub server: ServerConfig,
    /// Listening sockets.
    pub listeners: Vec<ListenerConfig>,
    /// Backends; routes refer to them by index.
    pub upstreams: Vec<UpstreamConfig>,
    /// Routes, sorted most specific first (exact paths, then longer prefixes, hosts before none).
    pub routes: Vec<RouteConfig>,
    /// Consumers, inline and from `consumers_file`, by index (shared: a million are not copied).
    pub consumers: std::sync::Arc<crate::Consumers>,
    /// The file consumers were read from, if any.
    pub consumers_file: Option<ConsumersFile>,
    /// Where consumers managed through the admin API are kept (one JSON line a change):
    /// `consumers_log`, else beside `consumers_file`, else beside the config file when the
    /// admin API or a cluster can change consumers; `None`: in memory only.
    pub consumers_log: Option<std::path::PathBuf>,
    /// Whether `consumers_log` is the implied one beside the config file: one that cannot be
    /// kept there leaves the changes in memory (with a warning) instead of refusing them.
    pub consumers_log_implied: bool,
    /// Where limit counters are kept across restarts, if anywhere.
    pub state: Option<StateConfig>,
    /// Plans; consumers refer to them by index.
    pub plans: Vec<PlanConfig>,
    /// Shared limits, if configured.
    pub cluster: Option<ClusterConfig>,
    /// The admin listener, if configured.
    pub admin: Option<AdminConfig>,
    /// The shared response store.
    pub cache: CacheConfig,
    /// The access log, if on.
    pub access_log: Option<AccessLogConfig>,
    /// Usage history, if kept.
    pub analytics: Option<AnalyticsConfig>,
    /// `/metrics` options.
    pub metrics: MetricsConfig,
    /// OpenTelemetry traces, if exported.
    pub tracing: Option<TracingConfig>,
    /// How the process log is written, if the file says (`log.format`).
    pub log_format: Option<LogFormat>,
    /// What is taken as written but is likely a mistake (an unregistered method), each
    /// with its place in the file: `check` prints them, `run` logs them.
    pub warnings: Vec<crate::Problem>,
}

/// The file consumers were read from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsumersFile {
    /// Its path (relative ones resolved against the config file's folder).
    pub path: std::path::PathBuf,
    /// Fingerprint of the content read.
    pub fingerprint: u64,
    /// How many consumers it gave: none for a file without entries (one being rewritten?).
    pub consumers: usize,
}

/// Limit counters kept on disk so that a restart does not reset them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateConfig {
    /// SQLite database file.
    pub path: std::path::PathBuf,
    /// How often counters are written.
    pub flush_interval: Duration,
}

/// Where access log lines go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LogTarget {
    /// Standard output.
    Stdout,
    /// A file, appended to.
    File(std::path::PathBuf),
}

/// The access log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccessLogConfig {
    /// Where lines go.
    pub target: LogTarget,
    /// Lines queued for the writer at most; beyond, lines are dropped and counted.
    pub buffer: usize,
}

/// Usage history.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AnalyticsConfig {
    /// SQLite database file.
    pub path: std::path::PathBuf,
    /// How long counts are kept.
    pub retention: Duration,
    /// Refuse to start without it.
    pub required: bool,
}

/// How spans travel to the collector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OtlpProtocol {
    /// OTLP over gRPC.
    Grpc,
    /// OTLP as protobuf over HTTP (`POST …/v1/traces`).
    Http,
}

/// OpenTelemetry traces.
#[derive(Debug, Clone, PartialEq)]
pub struct TracingConfig {
    /// The collector's URL; for HTTP, the full URL spans are posted to.
    pub endpoint: String,
    /// gRPC or HTTP.
    pub protocol: OtlpProtocol,
    /// Longest wait for one export.
    pub timeout: Duration,
    /// Headers (gRPC metadata) sent with every export, names in lower case.
    pub headers: Vec<(String, String)>,
    /// Share of new traces recorded, 0 to 1.
    pub sample_ratio: f64,
    /// `service.name` of the spans.
    pub service_name: String,
    /// Spans held for export at most; beyond, new ones are dropped and counted.
    pub queue_size: usize,
    /// Most spans in one export.
    pub batch_size: usize,
    /// How often held spans are sent when fewer than a batch wait.
    pub export_interval: Duration,
}

/// How the process log (stderr) is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Lines for people.
    Text,
    /// One JSON object a line, for log shippers.
    Json,
}

/// `/metrics` options.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MetricsConfig {
    /// One request counter series per consumer.
    pub per_consumer: bool,
}

/// The shared response store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheConfig {
    /// Bytes of bodies, headers and keys kept at most.
    pub max_size: u64,
    /// Largest response stored, bytes.
    pub max_object_size: u64,
}

/// Which query parameters form a cache key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyQuery {
    /// The whole query (credentials removed).
    All,
    /// None: one entry per path.
    None,
    /// These parameters only, in the request's order.
    Only(Vec<String>),
}

/// A route's caching.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteCacheConfig {
    /// Freshness of a cacheable response that states none; zero: such responses are not stored.
    pub default_ttl: Duration,
    /// One entry for every consumer allowed on the route.
    pub shared: bool,
    /// Query parameters in the key.
    pub key_query: KeyQuery,
    /// Request headers in the key.
    pub key_headers: Vec<HeaderName>,
}

/// The environment variable that may hold the admin token when no `token_file` is set.
pub const ADMIN_TOKEN_ENV: &str = "TOLLGATE_ADMIN_TOKEN";

/// The admin listener.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdminConfig {
    /// Where to listen.
    pub address: SocketAddr,
    /// Bearer token required on every endpoint but `/healthz`, read from `token_file`.
    pub token: Option<String>,
    /// Most open admin connections.
    pub max_connections: usize,
    /// Time to receive a request head (also the idle keep-alive limit).
    pub header_timeout: Duration,
}

/// What to do while Redis cannot be reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RedisDown {
    /// Keep serving, each node enforcing its last share of each limit.
    Open,
    /// Refuse limited requests with 503.
    Closed,
}

/// Which Redis the nodes share their state through.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum RedisTarget {
    /// One server: `redis://[:password@]host:port/db`, or `rediss://` for TLS.
    Url(String),
    /// The master a set of Redis Sentinels watches: asked of them at every connection, so a
    /// failover is followed.
    Sentinel {
        /// Each sentinel, `host:port`.
        sentinels: Vec<String>,
        /// The master's name in the sentinels' config.
        master_name: String,
        /// The master's ACL user, if not `default`.
        username: Option<String>,
        /// The master's password, if it has one.
        password: Option<String>,
        /// The database number.
        db: i64,
        /// The sentinels' own ACL user, if they ask for one.
        sentinel_username: Option<String>,
        /// The sentinels' own password (their `requirepass`), if they have one.
        sentinel_password: Option<String>,
        /// Whether the sentinels and the master are reached over TLS (`tls:`).
        tls: bool,
    },
    /// A Redis Cluster, found through any of its nodes; keys are spread over its masters
    /// by hash slot, and MOVED / ASK redirections are followed.
    Cluster {
        /// Seed nodes, `host:port` each (the rest are learned from them).
        nodes: Vec<String>,
        /// The nodes' ACL user, if not `default`.
        username: Option<String>,
        /// The nodes' password, if they have one.
        password: Option<String>,
        /// Whether to speak TLS (`tls: true`, as `rediss://`).
        tls: bool,
    },
}

impl RedisTarget {
    /// How logs and the admin API name it: without a password.
    pub fn shown(&self) -> String {
        match self {
            RedisTarget::Url(u) => crate::redacted_url(u),
            RedisTarget::Sentinel {
                sentinels,
                master_name,
                ..
            } => format!(
                "master {master_name:?} via sentinels {}",
                sentinels.join(", ")
            ),
            RedisTarget::Cluster { nodes, .. } => format!("Redis Cluster via {}", nodes.join(", ")),
        }
    }
}

/// Shared limits through Redis.
#[derive(Debug, Clone, PartialEq)]
pub struct ClusterConfig {
    /// The Redis (one server, or a master found through sentinels).
    pub redis: RedisTarget,
    /// How often a node settles with Redis.
    pub sync_interval: Duration,
    /// Policy while Redis is unreachable.
    pub on_redis_down: RedisDown,
    /// Fraction of a limit the nodes together may admit before Redis confirms (0–0.5).
    pub max_overadmission: f64,
    /// Prefix of every Redis key.
    pub key_prefix: String,
    /// What TLS to Redis trusts and presents (`cluster.redis.tls: {ca_file, cert_file,
    /// key_file}`); `None`: the system's roots, no client certificate.
    pub redis_tls: Option<std::sync::Arc<crate::tls::RedisTls>>,
}

/// Process-wide settings.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Longest wait for in-flight requests on shutdown.
    pub drain_timeout: Duration,
    /// Reload when the file changes.
    pub watch_config: bool,
}

/// One listening socket and its limits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListenerConfig {
    /// Where to listen.
    pub address: SocketAddr,
    /// Largest request head (request line and headers), bytes.
    pub max_header_bytes: usize,
    /// Most request headers.
    pub max_headers: usize,
    /// Time allowed to receive a request head.
    pub header_timeout: Duration,
    /// Largest request body, bytes.
    pub max_body_bytes: u64,
    /// Longest wait for the next piece of a request body.
    pub body_timeout: Duration,
    /// Longest wait for the client to take more of what is written to it (nginx's
    /// `send_timeout`); the connection is closed after.
    pub send_timeout: Duration,
    /// Most open client connections.
    pub max_connections: usize,
    /// Proxies whose `X-Forwarded-*` headers are kept (appended to, for `-For`).
    pub trusted_proxies: Vec<IpNet>,
    /// Keep every client's `X-Request-Id` (trusted proxies' are always kept).
    pub trust_request_id: bool,
    /// Continue every client's W3C trace context (trusted proxies' are always continued).
    pub trust_trace_context: bool,
    /// TLS termination, if on; reloads with the config.
    pub tls: Option<crate::tls::TlsConfig>,
    /// Cleartext HTTP/2 with prior knowledge, beside HTTP/1.1.
    pub h2c: bool,
    /// HTTP/2 limits.
    pub http2: Http2Config,
}

impl ListenerConfig {
    /// Whether two listeners differ only in what applies without a restart (TLS material).
    pub fn same_socket(&self, other: &ListenerConfig) -> bool {
        let strip = |l: &ListenerConfig| ListenerConfig {
            tls: None,
            ..l.clone()
        };
        self.tls.is_some() == other.tls.is_some() && strip(self) == strip(other)
    }
}

/// HTTP/2 server limits (guards against rapid-reset and header floods).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Http2Config {
    /// Streams open at once per connection.
    pub max_concurrent_streams: u32,
    /// Largest decoded header list, bytes.
    pub max_header_list_size: u32,
    /// Flow-control window per stream, bytes.
    pub stream_window: u32,
    /// Flow-control window per connection, bytes.
    pub connection_window: u32,
    /// Streams the client may reset before their answer, net of the answered ones each
    /// banks (up to `max_concurrent_streams`), before GOAWAY.
    pub max_pending_resets: usize,
    /// Streams of one connection that may hold an upstream connection at once: one client
    /// takes at most this share of an upstream's connections.
    pub max_upstream_streams: u32,
    /// Request-body bytes one connection's streams may hold in the gateway before their
    /// requests go upstream; past it, bodies stream as they come (and are read only as
    /// fast as the upstream takes them).
    pub max_request_buffer: u64,
}

/// An address block: `10.0.0.0/8`, `::1/128`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpNet {
    /// The network address.
    pub addr: std::net::IpAddr,
    /// Prefix length in bits.
    pub prefix: u8,
}

impl IpNet {
    /// Parses `ip` or `ip/prefix`.
    pub fn parse(s: &str) -> Option<IpNet> {
        let (ip, prefix) = match s.split_once('/') {
            Some((ip, p)) => (ip, Some(p)),
            None => (s, None),
        };
        let addr: std::net::IpAddr = ip.trim().parse().ok()?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            Some(p) if !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) => p.parse().ok()?,
            Some(_) => return None,
            None => max,
        };
        (prefix <= max).then_some(IpNet { addr, prefix })
    }

    /// Whether `ip` is in the block (IPv4-mapped IPv6 addresses count as IPv4).
    pub fn contains(&self, ip: std::net::IpAddr) -> bool {
        use std::net::IpAddr;
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
            v4 => v4,
        };
        match (self.addr, ip) {
            (IpAddr::V4(n), IpAddr::V4(a)) => {
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix))
                    .unwrap_or(0);
                u32::from(n) & mask == u32::from(a) & mask
            }
            (IpAddr::V6(n), IpAddr::V6(a)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix))
                    .unwrap_or(0);
                u128::from(n) & mask == u128::from(a) & mask
            }
            _ => false,
        }
    }
}

/// A backend and its pool settings.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct UpstreamConfig {
    /// Name as written in the file.
    pub name: String,
    /// `host:port` targets, used round-robin.
    pub targets: Vec<String>,
    /// Idle connections kept per target.
    pub pool_max_idle: usize,
    /// Connect timeout.
    pub connect_timeout: Duration,
    /// Time to the response head.
    pub response_timeout: Duration,
    /// Idle pooled connection lifetime.
    pub idle_timeout: Duration,
    /// Longest wait for the next piece of a response body.
    pub read_timeout: Duration,
    /// Most connections open at once to each target.
    pub max_connections: usize,
    /// Targets are `https://`: TLS to each, verified against `ca` or the system's roots.
    pub tls: bool,
    /// CA bundle for `https://` targets; the system's roots when absent.
    pub ca: Option<crate::tls::CaBundle>,
    /// HTTP/1.1 or HTTP/2 to the targets.
    pub protocol: UpstreamProtocol,
    /// HTTP/2: streams one connection to a target carries before another is opened.
    pub max_concurrent_streams: usize,
    /// Passive and active health checks.
    pub health: HealthConfig,
}

/// The protocol spoken to an upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum UpstreamProtocol {
    /// HTTP/1.1 over kept-alive connections.
    Http1,
    /// HTTP/2: ALPN `h2` over TLS, prior knowledge in cleartext.
    H2,
}

/// When a target is taken out of rotation and brought back.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct HealthConfig {
    /// Failed connects or 5xx answers in a row that take a target out; 0: passive checks off.
    pub failures: u32,
    /// How long a target taken out by passive checks stays out before it is tried again.
    pub backoff: Duration,
    /// Active checks, if configured.
    pub active: Option<ActiveHealth>,
}

/// Active health checks: `GET path` on every target each `interval`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ActiveHealth {
    /// Path checked.
    pub path: String,
    /// Time between checks of a target.
    pub interval: Duration,
    /// Time allowed for a check.
    pub timeout: Duration,
    /// Successes in a row that bring a target back.
    pub healthy: u32,
    /// Failures in a row that take a target out.
    pub unhealthy: u32,
}

/// How a route matches the path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathMatch {
    /// The path starts with this.
    Prefix(String),
    /// The path is exactly this.
    Exact(String),
}

/// How a route matches the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostMatch {
    /// Exactly this host (lowercase, no port).
    Exact(String),
    /// Any host ending with this suffix (`.example.com` for `*.example.com`).
    Suffix(String),
}

/// A validated route.
#[derive(Debug, Clone)]
pub struct RouteConfig {
    /// Stable name.
    pub name: String,
    /// Host to match, if any.
    pub host: Option<HostMatch>,
    /// Path to match.
    pub path: PathMatch,
    /// Allowed methods; `None` allows all.
    pub methods: Option<Vec<Method>>,
    /// Index into [`Config::upstreams`].
    pub upstream: usize,
    /// Remove the matched prefix before forwarding.
    pub strip_prefix: bool,
    /// Forward the client's Host header.
    pub preserve_host: bool,
    /// Match the path ignoring ASCII case.
    pub case_insensitive: bool,
    /// Read request bodies up to 64KiB before taking an upstream connection.
    pub request_buffering: bool,
    /// API key authentication, if required.
    pub auth: Option<AuthConfig>,
    /// Who may call; `None` lets every authenticated consumer call.
    pub allow: Option<AllowConfig>,
    /// Per-consumer limits on this route.
    pub limits: Vec<LimitConfig>,
    /// CORS, if enabled.
    pub cors: Option<CorsConfig>,
    /// Caching, if the route's responses may be stored.
    pub cache: Option<RouteCacheConfig>,
    /// Upgrade requests (WebSocket) pass and are joined both ways.
    pub websocket: bool,
}

/// Where the key comes from.
#[derive(Debug, Clone)]
pub struct AuthConfig {
    /// Query parameters that may carry the key.
    pub query: Vec<String>,
    /// Headers that may carry the key.
    pub header: Vec<HeaderName>,
    /// Forward the credential upstream.
    pub keep_credential: bool,
    /// Header carrying the consumer's name upstream.
    pub consumer_header: HeaderName,
    /// The consumer is named by the verified client certificate instead of a key.
    pub mtls: bool,
    /// Signed bearer tokens, accepted instead of or beside a key.
    pub jwt: Option<std::sync::Arc<crate::token::JwtConfig>>,
}

/// Who may call a route.
#[derive(Debug, Clone, Default)]
pub struct AllowConfig {
    /// Indices into [`Config::consumers`], sorted.
    pub consumers: Vec<usize>,
    /// Indices into [`Config::plans`].
    pub plans: Vec<usize>,
}

/// "N requests per window".
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct LimitConfig {
    /// Name shown in headers and errors.
    pub name: String,
    /// What its counts are kept under, with the window: the name when given, else `per-W`
    /// (a new number of requests keeps the counts), `N-per-W` if another shares `W`.
    pub counted_as: String,
    /// Requests allowed per window.
    pub requests: u64,
    /// Window length.
    pub window: Duration,
}

/// CORS settings.
#[derive(Debug, Clone)]
pub struct CorsConfig {
    /// Allowed origins; `None` means any (`*`).
    pub origins: Option<Vec<String>>,
    /// Methods allowed cross-origin.
    pub methods: Vec<Method>,
    /// Allowed request headers; `None` echoes what the preflight asks for.
    pub headers: Option<Vec<HeaderName>>,
    /// Response headers exposed to scripts.
    pub expose_headers: Vec<HeaderName>,
    /// Preflight cache lifetime.
    pub max_age: Option<Duration>,
    /// Allow credentials.
    pub credentials: bool,
}

/// A plan.
#[derive(Debug, Clone)]
pub struct PlanConfig {
    /// Name as written in the file.
    pub name: String,
    /// Limits checked together.
    pub limits: Vec<LimitConfig>,
}
