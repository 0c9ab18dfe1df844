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

/// A post's columns in a row that may have none (a left join's, or a row
/// that carries only a position).
#[derive(Debug, sqlx::FromRow)]
pub struct PostColumns {
    id: Option<i64>,
    title: Option<String>,
    body: Option<String>,
    author: Option<String>,
    created_at: Option<Timestamp>,
    updated_at: Option<Timestamp>,
}

impl PostColumns {
    /// The post, when the row has one.
    pub fn post(self) -> Option<Post> {
        Some(Post {
            id: self.id?,
            title: self.title?,
            body: self.body?,
            author: self.author?,
            created_at: self.created_at?,
            updated_at: self.updated_at?,
        })
    }
}
