//! Subcommands other than `serve`.

pub mod invalidate;
pub mod seed;
