//! Telemetry: logging setup: `RUST_LOG` filters, `LOG_FORMAT` picks text or
//! JSON.

pub mod metrics;

use std::io::IsTerminal;

use tracing_subscriber::{fmt, prelude::*, EnvFilter};

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
/// codes.
pub fn init(format: LogFormat) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(DEFAULT_FILTER));
    let registry = tracing_subscriber::registry().with(filter);
    match format {
        LogFormat::Text => registry
            .with(fmt::layer().with_ansi(std::io::stdout().is_terminal()))
            .init(),
        LogFormat::Json => registry
            .with(
                fmt::layer()
                    .json()
                    .flatten_event(true)
                    .with_current_span(true),
            )
            .init(),
    }
}
