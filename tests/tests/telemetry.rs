//! Telemetry over a real backend (nixl-tcp on loopback): the metrics a Prometheus
//! exporter serves over HTTP match the transfers made, exactly; per-transfer records
//! and `nixl_transfer` spans carry what the docs say.
//!
//! The exporter is this process's global recorder, so every test here names its
//! agents apart and reads only their series.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime};

use nixl::{Agent, Op, RequestOptions, Status, TelemetryOptions};
use nixl_conformance::support::{bounded, one, remote};

/// The exporter's address (installed once per process).
fn exporter() -> SocketAddr {
    static ADDR: OnceLock<SocketAddr> = OnceLock::new();
    *ADDR.get_or_init(|| {
        // A free port: bind, note it, let go (the exporter binds it next).
        let addr = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        // Installed from a thread outside any runtime, the exporter runs on a runtime
        // thread of its own: the tests' runtimes come and go.
        std::thread::spawn(move || {
            metrics_exporter_prometheus::PrometheusBuilder::new()
                .with_http_listener(addr)
                .install()
                .expect("install the Prometheus exporter");
        })
        .join()
        .unwrap();
        addr
    })
}

/// GET /metrics over plain HTTP/1.0 (so the body is not chunked).
fn scrape(addr: SocketAddr) -> String {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        match TcpStream::connect(addr) {
            Ok(mut s) => {
                s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
                s.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
                    .unwrap();
                let mut out = String::new();
                s.read_to_string(&mut out).unwrap();
                let (head, body) = out.split_once("\r\n\r\n").expect("an HTTP response");
                assert!(
                    head.starts_with("HTTP/1.0 200") || head.starts_with("HTTP/1.1 200"),
                    "{head}"
                );
                return body.to_owned();
            }
            // The exporter's listener starts on its own thread.
            Err(_) if std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => panic!("connect to the exporter at {addr}: {e}"),
        }
    }
}

/// One sample: name, labels, value.
type Sample = (String, BTreeMap<String, String>, f64);

fn parse(body: &str) -> Vec<Sample> {
    body.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let (series, value) = l.rsplit_once(' ').expect("name and value");
            let (name, labels) = match series.split_once('{') {
                Some((n, rest)) => (n, rest.trim_end_matches('}')),
                None => (series, ""),
            };
            let labels = labels
                .split(',')
                .filter(|p| !p.is_empty())
                .map(|p| {
                    let (k, v) = p.split_once('=').expect("key=value");
                    (k.to_owned(), v.trim_matches('"').to_owned())
                })
                .collect();
            (name.to_owned(), labels, value.parse().expect("a number"))
        })
        .collect()
}

/// The value of the one series `name` whose labels include `want` (0 if none).
fn value(samples: &[Sample], name: &str, want: &[(&str, &str)]) -> f64 {
    let hits: Vec<f64> = samples
        .iter()
        .filter(|(n, l, _)| {
            n == name
                && want
                    .iter()
                    .all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|s| s.2)
        .collect();
    assert!(
        hits.len() <= 1,
        "{name} {want:?} matches {} series",
        hits.len()
    );
    hits.first().copied().unwrap_or(0.0)
}

async fn agent(name: &str, telemetry: TelemetryOptions) -> Agent {
    Agent::builder(name)
        .backend(nixl_tcp::TcpBackend::new())
        .telemetry(telemetry)
        .build()
        .await
        .unwrap()
}

const METRICS: TelemetryOptions = TelemetryOptions {
    transfers: false,
    metrics: true,
    peer_labels: false,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scraped_metrics_match_transfers() {
    let addr = exporter();
    let a = agent("metrics-a", METRICS).await;
    let b = agent("metrics-b", METRICS).await;
    let src = a.register(vec![1u8; 1 << 20]).unwrap();
    let dst = b.register(vec![0u8; 1 << 20]).unwrap();
    let gone = b.register(vec![0u8; 4096]).unwrap();
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    b.load_metadata(&a.metadata().unwrap()).unwrap();
    let rd = remote(&a, "metrics-b", dst.id());
    let rgone = remote(&a, "metrics-b", gone.id());
    let mut notes = b.notifications().unwrap();

    let s = parse(&scrape(addr));
    let ma = [("agent", "metrics-a")];
    assert_eq!(
        value(&s, "nixl_registrations", &[ma[0], ("kind", "dram")]),
        1.0
    );
    assert_eq!(
        value(&s, "nixl_registered_bytes", &[ma[0], ("kind", "dram")]),
        (1 << 20) as f64
    );
    assert_eq!(
        value(
            &s,
            "nixl_registered_bytes",
            &[("agent", "metrics-b"), ("kind", "dram")]
        ),
        ((1 << 20) + 4096) as f64
    );
    assert_eq!(value(&s, "nixl_peers", &ma), 1.0);

    // 5 WRITEs of 4 KiB (the last with a notification), 3 READs of 1000 B.
    for i in 0..5u64 {
        let notif = (i == 4).then(|| nixl::Bytes::from_static(b"done"));
        bounded(
            "write",
            a.write(
                &one(src.desc(i * 4096, 4096)),
                "metrics-b",
                &one(rd.desc(i * 4096, 4096)),
                notif,
            ),
        )
        .await
        .unwrap();
    }
    let mid = parse(&scrape(addr));
    let w = [ma[0], ("op", "write"), ("backend", "tcp")];
    assert_eq!(value(&mid, "nixl_transfers_completed_total", &w), 5.0);
    for _ in 0..3 {
        bounded(
            "read",
            a.read(
                &one(src.desc(0, 1000)),
                "metrics-b",
                &one(rd.desc(0, 1000)),
                None,
            ),
        )
        .await
        .unwrap();
    }
    bounded("notify", a.notify("metrics-b", &b"hello"[..]).unwrap())
        .await
        .unwrap();
    // One that fails at the target: the region was deregistered there.
    b.deregister(&gone).unwrap();
    let e = bounded(
        "write to a deregistered region",
        a.write(
            &one(src.desc(0, 64)),
            "metrics-b",
            &one(rgone.desc(0, 64)),
            None,
        ),
    )
    .await
    .unwrap_err();
    let kind = format!("{:?}", e.kind());
    for _ in 0..2 {
        bounded("notification", futures_util::StreamExt::next(&mut notes))
            .await
            .unwrap();
    }

    let s = parse(&scrape(addr));
    let r = [ma[0], ("op", "read"), ("backend", "tcp")];
    assert_eq!(value(&s, "nixl_transfers_posted_total", &w), 6.0);
    assert_eq!(value(&s, "nixl_transfers_completed_total", &w), 5.0);
    assert_eq!(value(&s, "nixl_transfer_bytes_total", &w), 5.0 * 4096.0);
    assert_eq!(value(&s, "nixl_transfers_posted_total", &r), 3.0);
    assert_eq!(value(&s, "nixl_transfers_completed_total", &r), 3.0);
    assert_eq!(value(&s, "nixl_transfer_bytes_total", &r), 3000.0);
    assert_eq!(
        value(
            &s,
            "nixl_transfer_errors_total",
            &[w[0], w[1], w[2], ("kind", &kind)]
        ),
        1.0
    );
    assert_eq!(value(&s, "nixl_transfer_errors_total", &r), 0.0);
    // Histograms (summaries without buckets configured): one sample per success.
    assert_eq!(value(&s, "nixl_transfer_duration_seconds_count", &w), 5.0);
    assert_eq!(value(&s, "nixl_transfer_duration_seconds_count", &r), 3.0);
    assert_eq!(value(&s, "nixl_transfer_post_seconds_count", &w), 6.0);
    assert_eq!(value(&s, "nixl_notifications_sent_total", &ma), 2.0);
    assert_eq!(
        value(
            &s,
            "nixl_notifications_received_total",
            &[("agent", "metrics-b")]
        ),
        2.0
    );
    assert_eq!(
        value(
            &s,
            "nixl_registered_bytes",
            &[("agent", "metrics-b"), ("kind", "dram")]
        ),
        (1 << 20) as f64
    );
    // No peer label unless asked for.
    assert!(s
        .iter()
        .filter(|(n, l, _)| n.starts_with("nixl_transfer")
            && l.get("agent").is_some_and(|x| x == "metrics-a"))
        .all(|(_, l, _)| !l.contains_key("peer")));
    drop(notes);
    a.forget_peer("metrics-b").unwrap();
    let s = parse(&scrape(addr));
    assert_eq!(value(&s, "nixl_peers", &ma), 0.0);
    let _ = a.shutdown().await;
    let _ = b.shutdown().await;
    nixl_conformance::support::figure(
        "metrics scraped over HTTP",
        "posted/completed/bytes/errors per op, notifications, registrations and peers matched 9 transfers exactly",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_labels_on_request() {
    let addr = exporter();
    let t = TelemetryOptions {
        peer_labels: true,
        ..METRICS
    };
    let a = agent("labels-a", t).await;
    let b = agent("labels-b", t).await;
    let src = a.register(vec![1u8; 4096]).unwrap();
    let dst = b.register(vec![0u8; 4096]).unwrap();
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    let rd = remote(&a, "labels-b", dst.id());
    bounded(
        "write",
        a.write(&one(src.whole()), "labels-b", &one(rd.desc(0, 4096)), None),
    )
    .await
    .unwrap();
    let s = parse(&scrape(addr));
    let want = [("agent", "labels-a"), ("op", "write"), ("peer", "labels-b")];
    assert_eq!(value(&s, "nixl_transfer_bytes_total", &want), 4096.0);
    let _ = a.shutdown().await;
    let _ = b.shutdown().await;
}

/// Spans named `nixl_transfer` that closed, with their recorded fields.
#[derive(Clone, Default)]
struct Spans(Arc<Mutex<Vec<BTreeMap<String, String>>>>);

struct Fields<'a>(&'a mut BTreeMap<String, String>);

impl tracing::field::Visit for Fields<'_> {
    fn record_debug(&mut self, f: &tracing::field::Field, v: &dyn std::fmt::Debug) {
        self.0.insert(f.name().to_owned(), format!("{v:?}"));
    }
    fn record_str(&mut self, f: &tracing::field::Field, v: &str) {
        self.0.insert(f.name().to_owned(), v.to_owned());
    }
}

struct Open(Mutex<BTreeMap<String, String>>);

impl<S> tracing_subscriber::Layer<S> for Spans
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        id: &tracing::span::Id,
        ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        if attrs.metadata().name() != "nixl_transfer" {
            return;
        }
        let mut m = BTreeMap::new();
        attrs.record(&mut Fields(&mut m));
        ctx.span(id)
            .unwrap()
            .extensions_mut()
            .insert(Open(Mutex::new(m)));
    }
    fn on_record(
        &self,
        id: &tracing::span::Id,
        values: &tracing::span::Record<'_>,
        ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        if let Some(open) = ctx.span(id).unwrap().extensions().get::<Open>() {
            values.record(&mut Fields(&mut open.0.lock().unwrap()));
        }
    }
    fn on_close(&self, id: tracing::span::Id, ctx: tracing_subscriber::layer::Context<'_, S>) {
        if let Some(open) = ctx.span(&id).unwrap().extensions().get::<Open>() {
            self.0.lock().unwrap().push(open.0.lock().unwrap().clone());
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfer_records_and_spans() {
    use tracing_subscriber::layer::SubscriberExt;
    let spans = Spans::default();
    let _guard =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(spans.clone()));
    let t = TelemetryOptions {
        transfers: true,
        ..TelemetryOptions::default()
    };
    let a = agent("records-a", t).await;
    let b = agent("records-b", TelemetryOptions::default()).await;
    let src = a.register(vec![1u8; 8192]).unwrap();
    let dst = b.register(vec![0u8; 8192]).unwrap();
    let gone = b.register(vec![0u8; 64]).unwrap();
    a.load_metadata(&b.metadata().unwrap()).unwrap();
    b.load_metadata(&a.metadata().unwrap()).unwrap();
    let rd = remote(&a, "records-b", dst.id());
    let rgone = remote(&a, "records-b", gone.id());
    let before = SystemTime::now();
    // Two descriptors, contiguous on both sides: one segment after merging.
    let local = nixl::DescList::from_descs(
        nixl::MemKind::Dram,
        [src.desc(0, 4096), src.desc(4096, 4096)],
    );
    let far =
        nixl::DescList::from_descs(nixl::MemKind::Dram, [rd.desc(0, 4096), rd.desc(4096, 4096)]);
    let req = a
        .create_request(
            Op::Write,
            &local,
            "records-b",
            &far,
            &RequestOptions::default(),
        )
        .unwrap();
    assert_eq!(req.telemetry(), None, "nothing before the first post");
    let mut t1 = req.post(None).unwrap();
    bounded("write", &mut t1).await.unwrap();
    let rec = t1.telemetry().expect("a record");
    assert_eq!(rec, req.telemetry().unwrap());
    assert_eq!((rec.op, rec.bytes, rec.segments), (Op::Write, 8192, 1));
    assert_eq!(
        (rec.backend.as_str(), rec.peer.as_deref()),
        ("tcp", Some("records-b"))
    );
    assert_eq!(rec.status, Status::Done);
    assert!(rec.posted_at >= before && rec.posted_at <= SystemTime::now());
    let (post, took) = (rec.post_duration.unwrap(), rec.duration.unwrap());
    assert!(post <= took, "post {post:?} within the whole {took:?}");
    // A failed one records its error kind.
    b.deregister(&gone).unwrap();
    let mut t2 = a
        .transfer(
            Op::Write,
            &one(src.desc(0, 64)),
            "records-b",
            &one(rgone.desc(0, 64)),
            None,
        )
        .unwrap();
    let e = bounded("failing write", &mut t2).await.unwrap_err();
    let rec2 = t2.telemetry().unwrap();
    assert_eq!(rec2.status, Status::Failed(e.kind()));
    assert!(rec2.duration.is_some());
    // Off by default.
    let c = agent("records-c", TelemetryOptions::default()).await;
    let csrc = c.register(vec![1u8; 64]).unwrap();
    c.load_metadata(&b.metadata().unwrap()).unwrap();
    let mut t3 = c
        .transfer(
            Op::Write,
            &one(csrc.whole()),
            "records-b",
            &one(remote(&c, "records-b", dst.id()).desc(0, 64)),
            None,
        )
        .unwrap();
    bounded("write", &mut t3).await.unwrap();
    assert_eq!(t3.telemetry(), None);
    let _ = a.shutdown().await;
    let _ = b.shutdown().await;
    let _ = c.shutdown().await;
    // One span per post of the recording agent, closed, with its fields.
    let closed = spans.0.lock().unwrap().clone();
    assert_eq!(closed.len(), 2, "{closed:?}");
    let s = &closed[0];
    for (k, v) in [
        ("agent", "records-a"),
        ("op", "write"),
        ("peer", "records-b"),
        ("backend", "tcp"),
        ("bytes", "8192"),
        ("segments", "1"),
        ("outcome", "ok"),
    ] {
        assert_eq!(s.get(k).map(String::as_str), Some(v), "{k} in {s:?}");
    }
    assert!(
        s.contains_key("post_us") && s.contains_key("duration_us"),
        "{s:?}"
    );
    assert_eq!(closed[1].get("outcome"), Some(&e.kind().to_string()));
}

/// A transfer that finishes on another thread before its post call returns keeps
/// every field of its span: the span closes once both happened.
#[tokio::test]
async fn a_span_finished_before_its_post_returned_keeps_post_us() {
    use nixl_testkit::double::{self, Double};
    use tracing_subscriber::layer::SubscriberExt;

    /// Completes each post on another thread, and returns only once it has.
    #[derive(Debug)]
    struct Elsewhere;
    impl nixl::PreparedTransfer for Elsewhere {
        fn post(&self, _notif: Option<nixl::Bytes>, done: nixl::Completer) {
            std::thread::spawn(move || done.complete(Ok(())))
                .join()
                .unwrap();
        }
    }
    #[derive(Debug)]
    struct Finisher;
    impl Double for Finisher {
        fn prepare(
            &self,
            _plan: nixl::TransferPlan,
        ) -> nixl::Result<Box<dyn nixl::PreparedTransfer>> {
            Ok(Box::new(Elsewhere))
        }
    }

    let spans = Spans::default();
    let _guard =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(spans.clone()));
    let build = |name: &'static str| async move {
        Agent::builder(name)
            .backend(double::backend(Finisher))
            .telemetry(TelemetryOptions {
                transfers: true,
                ..TelemetryOptions::default()
            })
            .build()
            .await
            .unwrap()
    };
    let (a, b) = (build("early-a").await, build("early-b").await);
    let src = a.register(vec![1u8; 64]).unwrap();
    let dst = b.register(vec![0u8; 64]).unwrap();
    double::introduce(&a, &b);
    let far = remote(&a, "early-b", dst.id());
    let t = a
        .transfer(
            Op::Write,
            &one(src.whole()),
            "early-b",
            &one(far.desc(0, 64)),
            None,
        )
        .unwrap();
    bounded("transfer", t).await.unwrap();
    let closed = spans.0.lock().unwrap().clone();
    assert_eq!(closed.len(), 1, "{closed:?}");
    let s = &closed[0];
    assert!(
        s.contains_key("post_us") && s.contains_key("duration_us") && s.get("outcome").is_some(),
        "{s:?}"
    );
    let _ = a.shutdown().await;
    let _ = b.shutdown().await;
}
