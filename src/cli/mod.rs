//! Subcommands other than `serve`.

pub mod seed;
