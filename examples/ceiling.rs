//! Rust's ceiling for a hit: a plain hyper HTTP/1.1 server (no router, no
//! middleware, no bounds) answering every request with one constant body and
//! the headers a postcache hit carries, on a tokio runtime of one worker per
//! core. `load/compare hits` runs it beside postcache and nginx.
//!
//! ```text
//! cargo run --release --example ceiling -- 127.0.0.1:9091 BODY_FILE
//! ```

use std::convert::Infallible;

use axum::{
    body::Body,
    http::{header, HeaderValue, Response},
};
use bytes::Bytes;
use hyper::{server::conn::http1, service::service_fn};
use hyper_util::rt::TokioIo;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let addr = args.next().unwrap_or_else(|| "127.0.0.1:9091".into());
    let body = match args.next() {
        Some(path) => Bytes::from(std::fs::read(path)?),
        None => Bytes::from_static(br#"{"id":1}"#),
    };
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    loop {
        let (stream, _) = listener.accept().await?;
        stream.set_nodelay(true)?;
        let body = body.clone();
        tokio::spawn(async move {
            let service = service_fn(move |_request| {
                let mut response = Response::new(Body::from(body.clone()));
                let headers = response.headers_mut();
                headers.insert(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("application/json"),
                );
                headers.insert("x-cache", HeaderValue::from_static("hit"));
                headers.insert("x-cache-tier", HeaderValue::from_static("memory"));
                headers.insert(
                    header::CACHE_CONTROL,
                    HeaderValue::from_static("public, max-age=59"),
                );
                headers.insert(header::AGE, HeaderValue::from_static("0"));
                headers.insert(
                    header::ETAG,
                    HeaderValue::from_static("\"c63a3b31eb35be46\""),
                );
                async move { Ok::<_, Infallible>(response) }
            });
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}
