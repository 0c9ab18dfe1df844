//! Telemetry: logging setup: `RUST_LOG` filters, `LOG_FORMAT` picks text or
//! JSON.

pub mod metrics;
pub mod traces;

use std::io::IsTerminal;

use tracing_subscriber::{fmt, prelude::*, EnvFilter, Layer, Registry};

/// How log lines are written (LOG_FORMAT).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// Filter used when RUST_LOG is not set.
const DEFAULT_FILTER: &str = "info,sqlx=warn,fred=warn";

/// Installs the global subscriber; call once, from `main`. Text has
/// colours only on a terminal: a log file or a collector gets no escape
/// codes. RUST_LOG filters the log alone (a filter of the log's layer, not
/// of the subscriber): OpenTelemetry traces, when the standard variables
/// turn them on, take postcache's spans at debug whatever it says
/// (`traces.rs`). Refused (an error) for traces' variables this build
/// cannot follow.
pub fn init(format: LogFormat) -> anyhow::Result<()> {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(DEFAULT_FILTER));
    let registry = tracing_subscriber::registry();
    match (traces::layer()?, format) {
        // Traces off: the log's filter is the subscriber's, decided once per
        // call site (a filter per layer costs every read on the hit path).
        (None, LogFormat::Text) => registry.with(filter).with(text()).init(),
        (None, LogFormat::Json) => registry.with(filter).with(json()).init(),
        (Some(traces), format) => {
            let log: Box<dyn Layer<Registry> + Send + Sync> = match format {
                LogFormat::Text => text().with_filter(filter).boxed(),
                LogFormat::Json => json().with_filter(filter).boxed(),
            };
            registry.with(vec![log, traces]).init();
        }
    }
    Ok(())
}

/// The log's layer, as text (colours only on a terminal).
fn text<S>() -> impl Layer<S> + Send + Sync
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    fmt::layer().with_ansi(std::io::stdout().is_terminal())
}

/// The log's layer, as JSON lines with the current span.
fn json<S>() -> impl Layer<S> + Send + Sync
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    fmt::layer()
        .json()
        .flatten_event(true)
        .with_current_span(true)
}
