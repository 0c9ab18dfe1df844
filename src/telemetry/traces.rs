//! Telemetry: OpenTelemetry traces, exported over OTLP/HTTP (protobuf)
//! when the standard variables name an endpoint, and off otherwise.
//!
//! Read from the environment, as every OpenTelemetry SDK reads them:
//! `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`)
//! turns traces on; `OTEL_EXPORTER_OTLP_PROTOCOL` (or `..._TRACES_...`) is
//! `http/protobuf` (the only one this build speaks: another is refused at
//! start); `OTEL_SERVICE_NAME` (default `postcache`),
//! `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER` and
//! `OTEL_TRACES_SAMPLER_ARG` (default `parentbased_always_on`),
//! `OTEL_EXPORTER_OTLP_HEADERS` and `OTEL_EXPORTER_OTLP_TIMEOUT` are the
//! SDK's. `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none` keeps them
//! off.
//!
//! The spans are `tracing`'s: the request's (`get_post`, joined to an
//! incoming W3C `traceparent`), the flight's, the first look's, the load's
//! (its SQL), the wait's, the finish's, and the change applier's. They are
//! at debug level, so that with traces off they cost nothing (their call
//! sites are never enabled: the log's filter is the fmt layer's alone);
//! with traces on, this layer enables postcache's spans at debug whatever
//! RUST_LOG says of the log.

use std::sync::{
    atomic::{AtomicBool, Ordering},
    OnceLock,
};

use anyhow::bail;
use opentelemetry::{
    propagation::{Extractor, TextMapPropagator},
    trace::TracerProvider as _,
};
use opentelemetry_otlp::{Protocol, WithExportConfig as _};
use opentelemetry_sdk::{propagation::TraceContextPropagator, trace::SdkTracerProvider, Resource};
use tracing::Subscriber;
use tracing_subscriber::{filter::filter_fn, registry::LookupSpan, Layer};

/// Whether traces are exported (set once, at start).
static ON: AtomicBool = AtomicBool::new(false);

/// The provider, flushed at exit (see [`shutdown`]).
static PROVIDER: OnceLock<SdkTracerProvider> = OnceLock::new();

/// Whether traces are on: the endpoint answers memory hits through the full
/// read (with its span) only then.
#[inline]
pub fn on() -> bool {
    ON.load(Ordering::Relaxed)
}

/// The variable `name`, or its `OTEL_EXPORTER_OTLP_TRACES_*` form first.
fn var(general: &str) -> Option<String> {
    let traces = general.replacen("OTEL_EXPORTER_OTLP_", "OTEL_EXPORTER_OTLP_TRACES_", 1);
    std::env::var(traces)
        .ok()
        .or_else(|| std::env::var(general).ok())
        .filter(|value| !value.trim().is_empty())
}

/// Whether the variables turn traces on, or why they are refused.
pub fn wanted() -> anyhow::Result<bool> {
    let disabled = std::env::var("OTEL_SDK_DISABLED").is_ok_and(|v| v.eq_ignore_ascii_case("true"))
        || std::env::var("OTEL_TRACES_EXPORTER").is_ok_and(|v| v.eq_ignore_ascii_case("none"));
    if disabled || var("OTEL_EXPORTER_OTLP_ENDPOINT").is_none() {
        return Ok(false);
    }
    if let Some(exporter) = std::env::var("OTEL_TRACES_EXPORTER")
        .ok()
        .filter(|v| !v.is_empty() && v != "otlp")
    {
        bail!(
            "OTEL_TRACES_EXPORTER={exporter}: this build exports traces with otlp only (or none)"
        );
    }
    match var("OTEL_EXPORTER_OTLP_PROTOCOL").as_deref() {
        None | Some("http/protobuf") => {}
        Some(other) => bail!(
            "OTEL_EXPORTER_OTLP_PROTOCOL={other}: this build speaks http/protobuf only (to a collector's port 4318)"
        ),
    }
    let endpoint = var("OTEL_EXPORTER_OTLP_ENDPOINT").unwrap_or_default();
    if !endpoint.starts_with("http://") {
        bail!(
            "OTEL_EXPORTER_OTLP_ENDPOINT={endpoint}: an http:// address (a collector beside the instance); this build has no TLS for OTLP"
        );
    }
    Ok(true)
}

/// The layer that exports postcache's spans, when the variables turn
/// traces on (`None` otherwise), or why they are refused.
pub fn layer<S>() -> anyhow::Result<Option<Box<dyn Layer<S> + Send + Sync>>>
where
    S: Subscriber + for<'a> LookupSpan<'a> + Send + Sync,
{
    if !wanted()? {
        return Ok(None);
    }
    // The endpoint, headers and timeout are read from the variables by
    // the exporter itself (the `/v1/traces` path appended to the general
    // endpoint, as the specification says).
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpBinary)
        .build()?;
    let mut resource = Resource::builder();
    if std::env::var("OTEL_SERVICE_NAME").is_err() {
        resource = resource.with_service_name("postcache");
    }
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource.build())
        .build();
    let tracer = provider.tracer("postcache");
    let _ = PROVIDER.set(provider);
    ON.store(true, Ordering::Relaxed);
    let layer = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_filter(filter_fn(|meta| {
            meta.is_span() && meta.target().starts_with("postcache")
        }));
    Ok(Some(Box::new(layer)))
}

/// Flushes the spans not exported yet (at exit).
pub fn shutdown() {
    if let Some(provider) = PROVIDER.get() {
        if let Err(error) = provider.shutdown() {
            eprintln!("traces not all exported at exit: {error}");
        }
    }
}

/// The W3C trace context (`traceparent`, `tracestate`) of a request's
/// headers, as the parent of its span; `None` without one.
pub fn remote_parent(headers: &axum::http::HeaderMap) -> Option<opentelemetry::Context> {
    headers.get("traceparent")?;
    struct Headers<'a>(&'a axum::http::HeaderMap);
    impl Extractor for Headers<'_> {
        fn get(&self, key: &str) -> Option<&str> {
            self.0.get(key).and_then(|value| value.to_str().ok())
        }

        fn keys(&self) -> Vec<&str> {
            self.0.keys().map(|name| name.as_str()).collect()
        }
    }
    Some(TraceContextPropagator::new().extract(&Headers(headers)))
}
