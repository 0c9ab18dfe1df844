//! Subcommands other than `serve`.

pub mod healthcheck;
pub mod inspect;
pub mod invalidate;
pub mod seed;
pub mod slot;
