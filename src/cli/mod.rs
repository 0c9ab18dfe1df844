//! Subcommands other than `serve`.

pub mod inspect;
pub mod invalidate;
pub mod seed;
