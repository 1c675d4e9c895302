//! OpenTelemetry traces over loopback: an OTLP receiver (gRPC, or protobuf over HTTP)
//! started by the test, what arrives there, what the upstream and the access log see,
//! and what a dead or slow collector costs (nothing but counted drops).

mod common;

use bytes::Bytes;
use common::*;
use http::{Method, StatusCode};
use http_body_util::{BodyExt, Full};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use std::collections::HashMap;
use std::net::SocketAddr;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tollgate_gateway::ManualClock;

/// One exported span, flattened for the assertions.
#[derive(Debug, Clone)]
struct Got {
    service: String,
    name: String,
    trace_id: String,
    span_id: String,
    parent: String,
    kind: i32,
    error: bool,
    attrs: HashMap<String, String>,
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn flatten(req: ExportTraceServiceRequest) -> Vec<Got> {
    let mut out = Vec::new();
    for rs in req.resource_spans {
        let service = rs
            .resource
            .iter()
            .flat_map(|r| &r.attributes)
            .find(|kv| kv.key == "service.name")
            .and_then(|kv| kv.value.as_ref()?.value.as_ref())
            .map(value_text)
            .unwrap_or_default();
        for ss in rs.scope_spans {
            for s in ss.spans {
                out.push(got(&service, s));
            }
        }
    }
    out
}

fn value_text(v: &Value) -> String {
    match v {
        Value::StringValue(s) => s.clone(),
        Value::IntValue(i) => i.to_string(),
        Value::DoubleValue(d) => d.to_string(),
        Value::BoolValue(b) => b.to_string(),
        other => format!("{other:?}"),
    }
}

fn got(service: &str, s: Span) -> Got {
    let attrs = s
        .attributes
        .iter()
        .filter_map(|kv| {
            Some((
                kv.key.clone(),
                value_text(kv.value.as_ref()?.value.as_ref()?),
            ))
        })
        .collect();
    Got {
        service: service.to_string(),
        name: s.name,
        trace_id: hex(&s.trace_id),
        span_id: hex(&s.span_id),
        parent: hex(&s.parent_span_id),
        kind: s.kind,
        error: s.status.is_some_and(|st| st.code == 2),
        attrs,
    }
}

/// The gRPC receiver: every export's spans, as they come.
struct Receiver(mpsc::UnboundedSender<Vec<Got>>);

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let _ = self.0.send(flatten(request.into_inner()));
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

async fn grpc_receiver() -> (SocketAddr, mpsc::UnboundedReceiver<Vec<Got>>) {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    let (tx, rx) = mpsc::unbounded_channel();
    let svc = TraceServiceServer::new(Receiver(tx));
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            let svc = hyper_util::service::TowerToHyperService::new(svc.clone());
            tokio::spawn(async move {
                let _ =
                    hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                        .serve_connection(hyper_util::rt::TokioIo::new(s), svc)
                        .await;
            });
        }
    });
    (addr, rx)
}

/// The OTLP/HTTP receiver: `POST /v1/traces` with a protobuf body; the path is checked.
async fn http_receiver() -> (SocketAddr, mpsc::UnboundedReceiver<Vec<Got>>) {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else { return };
            let tx = tx.clone();
            tokio::spawn(async move {
                let svc =
                    hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                        let tx = tx.clone();
                        async move {
                            let ok = req.method() == Method::POST
                                && req.uri().path() == "/v1/traces"
                                && req
                                    .headers()
                                    .get("content-type")
                                    .is_some_and(|v| v == "application/x-protobuf");
                            let body = req
                                .into_body()
                                .collect()
                                .await
                                .map(|b| b.to_bytes())
                                .unwrap_or_default();
                            let status = match (ok, ExportTraceServiceRequest::decode(body)) {
                                (true, Ok(r)) => {
                                    let _ = tx.send(flatten(r));
                                    StatusCode::OK
                                }
                                _ => StatusCode::BAD_REQUEST,
                            };
                            let mut resp = http::Response::new(Full::new(Bytes::new()));
                            *resp.status_mut() = status;
                            Ok::<_, std::convert::Infallible>(resp)
                        }
                    });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(s), svc)
                    .await;
            });
        }
    });
    (addr, rx)
}

/// Spans from the receiver until `n` have arrived (bounded by the test deadline).
async fn spans(rx: &mut mpsc::UnboundedReceiver<Vec<Got>>, n: usize) -> Vec<Got> {
    let mut all = Vec::new();
    while all.len() < n {
        let batch = bounded("spans from the collector", rx.recv())
            .await
            .expect("receiver open");
        all.extend(batch);
    }
    all
}

const ROUTES: &str = r#"
plans:
  tiny:
    limits: [{name: one-per-minute, requests: 1, per: 60s}]
consumers:
  - {name: alice, keys: [alice-key], plan: tiny}
routes:
  - name: api
    path_prefix: /api/
    upstream: backend
    auth: {query: [apikey]}
  - name: open
    path_prefix: /open/
    upstream: backend
"#;

fn traced(backend: SocketAddr, collector: &str, extra: &str) -> String {
    format!(
        "{}tracing:\n  otlp: {{{collector}, export_interval: 20ms}}\n  service_name: edge-gw\n{extra}",
        yaml(backend, ROUTES)
    )
}

/// The value of `name` in a raw request head.
fn header_in(head: &str, name: &str) -> Option<String> {
    head.lines().find_map(|l| {
        let (n, v) = l.split_once(':')?;
        n.eq_ignore_ascii_case(name).then(|| v.trim().to_string())
    })
}

/// The `traceparent` the backend received for a GET of `url` that carried
/// [`CLIENT_PARENT`].
async fn traceparent_sent(c: &TestClient, url: &str, seen: &Heads) -> Option<String> {
    let _ = c
        .request(Method::GET, url, &[("traceparent", CLIENT_PARENT)], "")
        .await;
    let head = seen
        .lock()
        .last()
        .cloned()
        .expect("the backend saw the request");
    header_in(&head, "traceparent")
}

const CLIENT_PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

#[tokio::test]
async fn spans_reach_a_grpc_collector_with_the_request_and_the_gateways_own_attributes() {
    let (collector, mut rx) = grpc_receiver().await;
    let (backend, seen) = recording_backend().await;
    let dir = tempdir("otel-grpc");
    let log = dir.join("access.log");
    let cfg = format!(
        "{}access_log: {{path: {}}}\n",
        traced(
            backend,
            &format!("endpoint: \"http://{collector}\", protocol: grpc"),
            ""
        ),
        log.display()
    );
    let gw = TestGateway::start(&cfg, ManualClock::new()).await;
    let c = TestClient::default();

    // An untrusted client's trace is not continued: a new trace, its state not passed on.
    let ok = c
        .request(
            Method::GET,
            &gw.url("/api/items?apikey=alice-key&page=2"),
            &[
                ("traceparent", CLIENT_PARENT),
                ("tracestate", "congo=t61rcWkgMzE"),
                ("user-agent", "otel-test/1"),
            ],
            "",
        )
        .await;
    assert_eq!(ok.status, StatusCode::OK);
    let limited = c.get(&gw.url("/api/items?apikey=alice-key")).await;
    assert_eq!(limited.status, StatusCode::TOO_MANY_REQUESTS);

    let got = spans(&mut rx, 2).await;
    let first = got
        .iter()
        .find(|s| s.attrs.get("http.response.status_code").map(String::as_str) == Some("200"))
        .expect("the 200's span");
    let head = seen
        .lock()
        .last()
        .cloned()
        .expect("upstream saw the request");
    let sent = header_in(&head, "traceparent").expect("traceparent upstream");
    assert_eq!(
        sent,
        format!("00-{}-{}-01", first.trace_id, first.span_id),
        "the upstream's parent is the gateway's span"
    );
    assert_ne!(first.trace_id, "4bf92f3577b34da6a3ce929d0e0e4736");
    assert_eq!(
        first.trace_id,
        ok.header("x-request-id"),
        "a new trace's id is the request id the gateway made"
    );
    assert!(first.parent.is_empty(), "a root span: {first:?}");
    assert_eq!(header_in(&head, "tracestate"), None, "{head}");
    assert_eq!(first.service, "edge-gw");
    assert_eq!(first.name, "GET /api/*");
    assert_eq!(first.kind, 2, "server span");
    let a = &first.attrs;
    assert_eq!(a["http.request.method"], "GET");
    assert_eq!(a["url.path"], "/api/items");
    assert_eq!(a["url.query"], "page=2", "the key is not exported: {a:?}");
    assert_eq!(a["url.scheme"], "http");
    assert_eq!(a["http.route"], "/api/*");
    assert_eq!(a["network.protocol.version"], "1.1");
    assert_eq!(a["client.address"], "127.0.0.1");
    assert_eq!(a["server.address"], "127.0.0.1");
    assert_eq!(a["server.port"], gw.addr.port().to_string());
    assert_eq!(a["user_agent.original"], "otel-test/1");
    assert_eq!(a["tollgate.route"], "api");
    assert_eq!(a["tollgate.consumer"], "alice");
    assert_eq!(a["tollgate.upstream.target"], backend.to_string());
    assert!(
        !a.contains_key("tollgate.request_id"),
        "the request id the gateway made is the trace id: not said twice"
    );
    assert!(
        !a.contains_key("http.response.body.size"),
        "opt-in: left out"
    );
    assert!(!a.contains_key("tollgate.refusal"));

    let refused = got
        .iter()
        .find(|s| s.attrs.get("http.response.status_code").map(String::as_str) == Some("429"))
        .expect("the 429's span");
    assert_eq!(refused.attrs["tollgate.refusal"], "rate_limited");
    assert_eq!(refused.attrs["tollgate.limit"], "one-per-minute");
    assert_eq!(refused.attrs["tollgate.consumer"], "alice");
    assert!(!refused.error, "a 4xx is not a server span's error");
    assert_ne!(refused.trace_id, first.trace_id);

    // The access log names each request's trace.
    assert!(gw.gw.sync_logs(DEADLINE));
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&log)
        .expect("log")
        .lines()
        .map(|l| serde_json::from_str(l).expect("json"))
        .collect();
    assert_eq!(lines[0]["trace_id"], first.trace_id.as_str());
    assert_eq!(lines[1]["trace_id"], refused.trace_id.as_str());
    let m = metrics_with(&gw.gw, "tollgate_trace_spans_exported_total 2").await;
    assert!(m.contains("tollgate_trace_spans_exported_total 2"), "{m}");
}

#[tokio::test]
async fn a_trusted_clients_trace_is_continued_and_its_decision_honoured() {
    let (collector, mut rx) = http_receiver().await;
    let (backend, seen) = recording_backend().await;
    let cfg = traced(
        backend,
        &format!("endpoint: \"http://{collector}\", protocol: http"),
        "  sample_ratio: 0\n",
    )
    .replace(
        "listeners: [{address: \"127.0.0.1:0\"}]",
        "listeners: [{address: \"127.0.0.1:0\", trust_trace_context: true}]",
    );
    let gw = TestGateway::start(&cfg, ManualClock::new()).await;
    let c = TestClient::default();

    // Sampled by the parent, though the ratio is 0: recorded, as a child of the client's.
    let ok = c
        .request(
            Method::GET,
            &gw.url("/open/a"),
            &[
                ("traceparent", CLIENT_PARENT),
                ("tracestate", "congo=t61rcWkgMzE"),
            ],
            "",
        )
        .await;
    assert_eq!(ok.status, StatusCode::OK);
    let got = spans(&mut rx, 1).await;
    let s = &got[0];
    assert_eq!(s.trace_id, "4bf92f3577b34da6a3ce929d0e0e4736");
    assert_eq!(s.parent, "00f067aa0ba902b7");
    assert_ne!(s.span_id, "00f067aa0ba902b7");
    let head = seen.lock().last().cloned().expect("seen");
    assert_eq!(
        header_in(&head, "traceparent").as_deref(),
        Some(format!("00-4bf92f3577b34da6a3ce929d0e0e4736-{}-01", s.span_id).as_str())
    );
    assert_eq!(
        header_in(&head, "tracestate").as_deref(),
        Some("congo=t61rcWkgMzE"),
        "a continued trace's state is passed on"
    );

    // Not sampled by the parent, nor at ratio 0: nothing recorded, the decision passed on.
    let unsampled = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00";
    let _ = c
        .request(
            Method::GET,
            &gw.url("/open/b"),
            &[("traceparent", unsampled)],
            "",
        )
        .await;
    let head = seen.lock().last().cloned().expect("seen");
    let sent = header_in(&head, "traceparent").expect("traceparent");
    assert!(
        sent.starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-") && sent.ends_with("-00"),
        "{sent}"
    );
    // Without a parent, ratio 0: a new trace, not recorded, and said so upstream.
    let _ = c.get(&gw.url("/open/c")).await;
    let head = seen.lock().last().cloned().expect("seen");
    let sent = header_in(&head, "traceparent").expect("traceparent");
    assert!(
        sent.ends_with("-00") && !sent.contains("4bf92f35"),
        "{sent}"
    );
    // Neither reached the collector: the next span to arrive is the next sampled one.
    let _ = c
        .request(
            Method::GET,
            &gw.url("/open/d"),
            &[("traceparent", CLIENT_PARENT)],
            "",
        )
        .await;
    let got = spans(&mut rx, 1).await;
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].attrs["url.path"], "/open/d");
}

#[tokio::test]
async fn a_dead_collector_costs_requests_nothing_and_its_losses_are_counted() {
    // Nothing listens: every export fails.
    let dead = closed_port().await;
    let backend = echo_backend().await;
    let cfg = traced(
        backend,
        &format!("endpoint: \"http://{dead}\", protocol: grpc, timeout: 200ms"),
        "",
    );
    let gw = TestGateway::start(&cfg, ManualClock::new()).await;
    let c = TestClient::default();
    for _ in 0..3 {
        let a = c.get(&gw.url("/api/x?apikey=alice-key")).await;
        assert!(a.status == StatusCode::OK || a.status == StatusCode::TOO_MANY_REQUESTS);
    }
    let want = "tollgate_trace_spans_dropped_total{reason=\"export_failed\"} 3";
    let m = metrics_with(&gw.gw, want).await;
    assert!(m.contains(want), "{m}");

    // A collector that takes the connection and never answers, a queue of one: what
    // does not fit is dropped at once and counted, and every request is answered.
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let silent = l.local_addr().expect("addr");
    let (hold_tx, mut hold_rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            let _ = hold_tx.send(s);
        }
    });
    let cfg = traced(
        backend,
        &format!(
            "endpoint: \"http://{silent}\", protocol: http, timeout: 30s, queue_size: 1, batch_size: 1"
        ),
        "",
    );
    let gw = TestGateway::start(&cfg, ManualClock::new()).await;
    let c = TestClient::default();
    // The first span goes out and hangs in its export; the second waits in the queue.
    let _ = c.get(&gw.url("/nowhere")).await;
    let _held = bounded("the collector's connection", hold_rx.recv()).await;
    for _ in 0..6 {
        let a = c.get(&gw.url("/nowhere")).await;
        assert_eq!(a.status, StatusCode::NOT_FOUND);
    }
    // Six requests: one waits in the queue of one, five are dropped.
    let want = "tollgate_trace_spans_dropped_total{reason=\"queue_full\"} 5";
    let m = metrics_with(&gw.gw, want).await;
    assert!(m.contains(want), "{m}");
}

#[tokio::test]
async fn a_cache_fill_carries_the_requests_traceparent_and_long_values_are_cut() {
    let (collector, mut rx) = grpc_receiver().await;
    let (backend, seen) = recording_backend().await;
    let cfg = format!(
        "listeners: [{{address: \"127.0.0.1:0\"}}]\nupstreams:\n  backend:\n    targets: [\"{backend}\"]\n    response_timeout: 2s\nroutes:\n  - name: cached\n    path_prefix: /c/\n    upstream: backend\n    cache: {{default_ttl: 10s}}\ntracing:\n  otlp: {{endpoint: \"http://{collector}\", export_interval: 20ms}}\n"
    );
    let gw = TestGateway::start(&cfg, ManualClock::new()).await;
    let c = TestClient::default();
    let long = "x".repeat(3000);
    let miss = c
        .request(
            Method::GET,
            &gw.url(&format!("/c/{long}")),
            &[("traceparent", CLIENT_PARENT), ("user-agent", &long)],
            "",
        )
        .await;
    assert_eq!(miss.status, StatusCode::OK);
    let got = spans(&mut rx, 1).await;
    let head = seen.lock().last().cloned().expect("the fill went upstream");
    assert_eq!(
        header_in(&head, "traceparent"),
        Some(format!("00-{}-{}-01", got[0].trace_id, got[0].span_id)),
        "one traceparent, the gateway's, on the fill: {head}"
    );
    assert_eq!(head.matches("traceparent").count(), 1, "{head}");
    let a = &got[0].attrs;
    assert_eq!(a["url.path"].len(), 1024, "cut at 1 KiB");
    assert_eq!(
        a["user_agent.original"].len(),
        512,
        "a span keeps 512 bytes of a header"
    );
}

#[tokio::test]
async fn a_reload_moves_spans_to_the_new_collector_and_can_turn_tracing_off() {
    let (first, mut first_rx) = grpc_receiver().await;
    let (second, mut second_rx) = http_receiver().await;
    let (backend, seen) = recording_backend().await;
    let cfg = |collector: &str| traced(backend, collector, "");
    let gw = TestGateway::start(
        &cfg(&format!("endpoint: \"http://{first}\", protocol: grpc")),
        ManualClock::new(),
    )
    .await;
    let c = TestClient::default();
    let _ = c.get(&gw.url("/open/one")).await;
    let got = spans(&mut first_rx, 1).await;
    assert_eq!(got[0].attrs["url.path"], "/open/one");

    gw.apply(&cfg(&format!(
        "endpoint: \"http://{second}\", protocol: http"
    )));
    let _ = c.get(&gw.url("/open/two")).await;
    let got = spans(&mut second_rx, 1).await;
    assert_eq!(got[0].attrs["url.path"], "/open/two");

    // Without `tracing:`, the client's trace headers pass as they came.
    gw.apply(&yaml(backend, ROUTES));
    assert_eq!(
        traceparent_sent(&c, &gw.url("/open/three"), &seen)
            .await
            .as_deref(),
        Some(CLIENT_PARENT),
        "the client's trace headers pass as they came"
    );
}

#[tokio::test]
async fn without_tracing_trace_headers_pass_untouched() {
    let (backend, seen) = recording_backend().await;
    let gw = TestGateway::start(&yaml(backend, ROUTES), ManualClock::new()).await;
    let c = TestClient::default();
    assert_eq!(
        traceparent_sent(&c, &gw.url("/api/x?apikey=alice-key"), &seen)
            .await
            .as_deref(),
        Some(CLIENT_PARENT),
        "the client's trace headers pass as they came"
    );
}
