//! The HTTP interface: the endpoint (memory hits at once, reads of posts
//! past the router, the bounds every other request is held to:
//! `endpoint.rs`), the state every handler reaches (`state.rs`), routes,
//! handlers, the error type, and reads that ask for a position (read your
//! writes: `position.rs`).

mod caching;
mod endpoint;
mod error;
mod handlers;
mod head;
mod many;
pub mod openapi;
pub mod position;
mod probe;
mod served;
mod server;
mod state;

pub use crate::posts::{InvalidId, PostId};
pub use caching::CachingHeaders;
pub use endpoint::{admin_app, app, Endpoint, Limits};
pub use error::ApiError;
pub use handlers::etag;
pub use probe::{Probe, PROBE_TIMEOUT};
pub use server::{connection_cap, serve, ConnectionLimits};
pub use state::{AppState, Shared};
