//! Ceilings for the capacity table: a minimal axum server on this machine.
//!
//! ```text
//! cargo run --release --example baseline -- 127.0.0.1:9090 [redis://127.0.0.1:6379]
//! ```
//!
//! `GET /const` returns a constant JSON body of a post's size (the ceiling of
//! any axum handler here); `GET /redis-get` does one Redis GET of a key holding
//! the same body and returns it (the ceiling of a handler that touches Redis).

use axum::{extract::State, routing::get, Router};
use bytes::Bytes;
use fred::prelude::*;

/// The key `/redis-get` reads.
const KEY: &str = "postcache:baseline:body";

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let addr = args.next().unwrap_or_else(|| "127.0.0.1:9090".into());
    let redis_url = args
        .next()
        .unwrap_or_else(|| "redis://127.0.0.1:6379".into());
    let body = Bytes::from(format!(
        r#"{{"id":1,"title":"The quiet cache #1","body":"{}","author":"ada","created_at":"2024-01-01T00:00:01Z","updated_at":"2024-01-02T00:00:01Z"}}"#,
        "word ".repeat(40)
    ));
    let redis = Builder::from_config(Config::from_url(&redis_url)?).build()?;
    redis.init().await?;
    let _: () = redis.set(KEY, body.clone(), None, None, false).await?;
    let app = Router::new()
        .route(
            "/const",
            get({
                let body = body.clone();
                move || async move { body.clone() }
            }),
        )
        .route(
            "/redis-get",
            get(|State(redis): State<Client>| async move {
                let value: Option<Bytes> = redis.get(KEY).await.unwrap_or(None);
                value.unwrap_or_default()
            }),
        )
        .with_state(redis);
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    axum::serve(listener, app).await?;
    Ok(())
}
