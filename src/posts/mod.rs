//! The post: its id (parsed wherever one arrives), its row and JSON, and
//! every `timestamptz` PostgreSQL holds as JSON. Where posts are read and
//! written is the `store` module.

mod id;
mod timestamp;

use serde::Serialize;

pub use id::{InvalidId, PostId};
pub use timestamp::Timestamp;

/// One row of `posts`, serialised as the body of `GET /posts/{id}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow, utoipa::ToSchema)]
pub struct Post {
    #[schema(minimum = 1)]
    pub id: i64,
    pub title: String,
    pub body: String,
    pub author: String,
    pub created_at: Timestamp,
    pub updated_at: Timestamp,
}
