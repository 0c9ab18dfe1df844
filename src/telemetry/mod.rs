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
    let log: Box<dyn Layer<Registry> + Send + Sync> = match format {
        LogFormat::Text => fmt::layer()
            .with_ansi(std::io::stdout().is_terminal())
            .with_filter(filter)
            .boxed(),
        LogFormat::Json => fmt::layer()
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_filter(filter)
            .boxed(),
    };
    let mut layers = vec![log];
    layers.extend(traces::layer()?);
    tracing_subscriber::registry().with(layers).init();
    Ok(())
}
