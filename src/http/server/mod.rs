//! HTTP (the server): serving connections: the accept loop, the connection
//! cap, each connection's deadlines, and the graceful shutdown.
//!
//! `axum::serve` sets no deadline on a connection: a client that never
//! finishes its headers, or a kept-alive connection nobody uses, is held for
//! ever, and enough of them exhaust the instance's memory and file
//! descriptors. Here every connection is closed when its headers take longer
//! than HEADER_READ_TIMEOUT or it stays idle longer than IDLE_TIMEOUT
//! ([`deadline`]), and at most MAX_CONNECTIONS are open at once: past it, a
//! new connection is answered 503 and closed at once, while those already
//! open keep working.

mod deadline;

use std::{
    convert::Infallible,
    future::Future,
    io,
    sync::Arc,
    time::{Duration, Instant},
};

use axum::response::Response;
use bytes::Bytes;
use futures::FutureExt;
use hyper::{body::Incoming, server::conn::http1, Request};
use hyper_util::rt::TokioIo;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    sync::{OwnedSemaphorePermit, Semaphore},
};
use tokio_util::{sync::CancellationToken, task::TaskTracker};

use self::deadline::{Deadline, Drain, Watched};
use super::{ApiError, Endpoint};
use crate::telemetry::metrics;

/// Refused connections lingering at once to hand over their 503 (past it, a
/// refused connection is closed without waiting).
const REFUSALS_LINGERING: usize = 64;
/// How long a refused connection lingers: its 503 is written, then what the
/// client sends is read and dropped until it closes, at most this long.
const REFUSAL_LINGER: Duration = Duration::from_secs(1);
/// Pause after an accept that failed for want of resources (file
/// descriptors, memory), before trying again.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);
/// At most one warning per this long about failing accepts.
const ACCEPT_WARNING_EVERY: Duration = Duration::from_secs(10);

/// What bounds the connections.
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    /// Longest from a connection's opening, or from a request's first byte on
    /// a kept-alive one, to its complete headers.
    pub header_read_timeout: Duration,
    /// Longest a kept-alive connection stays open with no request in flight.
    pub idle_timeout: Duration,
    /// Most connections open at once.
    pub max_connections: usize,
}

/// Serves `endpoint` on `listener` until `shutdown` completes; then stops
/// accepting, closes idle connections at once, lets requests in flight be
/// answered, and returns once every connection is closed.
pub async fn serve(
    listener: TcpListener,
    endpoint: Endpoint,
    limits: ConnectionLimits,
    shutdown: impl Future<Output = ()>,
) {
    // A semaphore, not a counter: its permit is given back by the connection
    // task's end however it ends (closed, timed out, panicked).
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let lingering = Arc::new(Semaphore::new(REFUSALS_LINGERING));
    let refusal = refusal_response();
    let stopping = CancellationToken::new();
    let tasks = TaskTracker::new();
    let mut last_warning: Option<Instant> = None;
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    accept_failed(e, &mut last_warning).await;
                    continue;
                }
            },
        };
        match slots.clone().try_acquire_owned() {
            Ok(slot) => {
                tasks.spawn(connection(
                    stream,
                    endpoint.clone(),
                    limits,
                    stopping.clone(),
                    Slot::new(slot),
                ));
            }
            Err(_) => refuse(stream, &refusal, &lingering, &tasks),
        }
    }
    drop(listener);
    stopping.cancel();
    tasks.close();
    tasks.wait().await;
}

/// One connection, until the client closes it, its deadline passes, or the
/// shutdown closes it.
async fn connection(
    stream: TcpStream,
    endpoint: Endpoint,
    limits: ConnectionLimits,
    stopping: CancellationToken,
    _slot: Slot,
) {
    // Answers are written whole in one go; Nagle would only delay the next.
    let _ = stream.set_nodelay(true);
    let deadline = Deadline::new(limits.header_read_timeout, limits.idle_timeout);
    let io = TokioIo::new(Watched::new(stream, deadline.clone()));
    let service = hyper::service::service_fn({
        let deadline = deadline.clone();
        move |request: Request<Incoming>| answer(&endpoint, &deadline, request)
    });
    // hyper's own header timeout is off: see `deadline`.
    let conn = http1::Builder::new()
        .header_read_timeout(None)
        // Answers are small: copied into one buffer and written with one
        // plain write, they beat a vectored write of head and body (A/B on
        // memory hits: 176.7k against 170.4k requests/s).
        .writev(false)
        .serve_connection(io, service);
    tokio::pin!(conn);
    let mut draining = false;
    loop {
        tokio::select! {
            biased;
            served = conn.as_mut() => {
                if let Err(e) = served {
                    tracing::debug!(error = %e, "connection ended with an error");
                }
                return;
            }
            expiry = deadline.expired() => {
                tracing::debug!(timeout = expiry.label(), "connection closed by its deadline");
                metrics::connection_timed_out(expiry.label());
                return;
            }
            () = stopping.cancelled(), if !draining => {
                draining = true;
                match deadline.drain() {
                    // No request yet: closed at once.
                    Drain::Reading => return,
                    // hyper closes an idle connection at once, and one
                    // still writing (or busy) once its answer is out.
                    Drain::Answered | Drain::Busy => conn.as_mut().graceful_shutdown(),
                }
            }
        }
    }
}

/// The future of one request: the endpoint's answer, with the connection
/// busy until it is done.
///
/// hyper keeps it in a box of the connection's, for as long as the request
/// waits (for a load, say): its size is part of what each waiting request
/// costs. A combinator, not an async block: the block would keep the
/// answer's future twice, its capture beside the one it awaits.
fn answer(
    endpoint: &Endpoint,
    deadline: &Arc<Deadline>,
    request: Request<Incoming>,
) -> impl Future<Output = Result<Response, Infallible>> + Send + 'static {
    let busy = deadline.begin_request();
    endpoint.answer(request).map(move |answer| {
        drop(busy);
        answer
    })
}

/// An open connection's place under MAX_CONNECTIONS, counted in the gauge.
struct Slot {
    _permit: OwnedSemaphorePermit,
}

impl Slot {
    fn new(permit: OwnedSemaphorePermit) -> Self {
        metrics::connections_open(1.0);
        Self { _permit: permit }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        metrics::connections_open(-1.0);
    }
}

/// The whole answer to a connection past MAX_CONNECTIONS: 503 with the JSON
/// error body, and the connection closed.
fn refusal_response() -> Bytes {
    let error = ApiError::TooManyConnections;
    let body = serde_json::json!({ "error": error.to_string() }).to_string();
    let status = error.status_code();
    Bytes::from(format!(
        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         connection: close\r\nretry-after: 1\r\n\r\n{body}",
        body.len()
    ))
}

/// Answers a connection past MAX_CONNECTIONS with 503 and closes it.
///
/// The answer is written at once (a new connection's send buffer is empty,
/// so it fits). Closing right away would reset the connection if the
/// client's request had arrived unread, and a reset can destroy the answer
/// before the client reads it; so the connection lingers: its sending side
/// is shut, and what the client sends is read and dropped until it closes,
/// for at most REFUSAL_LINGER. At most REFUSALS_LINGERING linger at once;
/// past that, the connection is closed at once.
fn refuse(stream: TcpStream, answer: &Bytes, lingering: &Arc<Semaphore>, tasks: &TaskTracker) {
    metrics::connection_refused();
    metrics::http_error(503);
    let _ = stream.try_write(answer);
    let Ok(permit) = lingering.clone().try_acquire_owned() else {
        return;
    };
    tasks.spawn(async move {
        let _permit = permit;
        let mut stream = stream;
        let _ = tokio::time::timeout(REFUSAL_LINGER, async {
            let _ = stream.shutdown().await;
            let mut sink = [0u8; 1024];
            while matches!(stream.read(&mut sink).await, Ok(n) if n > 0) {}
        })
        .await;
    });
}

/// An accept that failed: a connection that went away before it was
/// accepted is nothing; a want of resources (file descriptors: see
/// [`connection_cap`]) is waited out briefly and warned about.
async fn accept_failed(e: io::Error, last_warning: &mut Option<Instant>) {
    use io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    if matches!(
        e.kind(),
        ConnectionAborted | ConnectionRefused | ConnectionReset
    ) {
        return;
    }
    if last_warning.is_none_or(|at| at.elapsed() >= ACCEPT_WARNING_EVERY) {
        *last_warning = Some(Instant::now());
        tracing::warn!(error = %e, "accepting a connection failed; retrying");
    }
    tokio::time::sleep(ACCEPT_BACKOFF).await;
}

/// File descriptors kept for everything but client connections and the
/// PostgreSQL pool: the Redis connections (one per primary on a cluster),
/// the change feed, lingering refusals, logs.
const FD_RESERVE: u64 = 256;

/// MAX_CONNECTIONS as the process can honour it beside `db_connections`:
/// the soft file-descriptor limit is raised (up to the hard one) to fit
/// both, and where it cannot be, the cap is lowered to fit the limit, with a
/// warning, so that connections past it are refused rather than left in
/// the listen queue by failing accepts.
pub fn connection_cap(max_connections: usize, db_connections: u32) -> usize {
    let wanted = fds_wanted(max_connections, db_connections);
    let limit = match rlimit::increase_nofile_limit(wanted) {
        Ok(limit) => limit,
        Err(e) => {
            tracing::warn!(error = %e, "could not read the file-descriptor limit");
            return max_connections;
        }
    };
    let cap = cap_within(max_connections, db_connections, limit);
    if cap < max_connections {
        tracing::warn!(
            max_connections,
            file_descriptor_limit = limit,
            cap,
            "the file-descriptor limit is below MAX_CONNECTIONS plus what else is kept open: connections capped lower"
        );
    }
    cap
}

/// The file descriptors MAX_CONNECTIONS needs, with everything else.
fn fds_wanted(max_connections: usize, db_connections: u32) -> u64 {
    (max_connections as u64)
        .saturating_add(FD_RESERVE)
        .saturating_add(u64::from(db_connections))
}

/// MAX_CONNECTIONS, lowered to fit a file-descriptor limit of `limit`
/// beside the reserve and the PostgreSQL pool (at least 1).
fn cap_within(max_connections: usize, db_connections: u32, limit: u64) -> usize {
    if limit >= fds_wanted(max_connections, db_connections) {
        return max_connections;
    }
    let reserve = FD_RESERVE + u64::from(db_connections);
    limit.saturating_sub(reserve).max(1) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_refusal_is_a_whole_503_with_the_json_error() {
        let raw = refusal_response();
        let text = std::str::from_utf8(&raw).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").expect("head and body");

        assert!(
            head.starts_with("HTTP/1.1 503 Service Unavailable\r\n"),
            "{head}"
        );
        assert!(head.contains("\r\nconnection: close"), "{head}");
        assert!(
            head.contains(&format!("\r\ncontent-length: {}", body.len())),
            "{head}"
        );
        let json: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(json["error"], "too many connections, try again");
    }

    /// Every waiting request keeps its future for the whole wait. Wrapping
    /// the answer in an async block (here, or in `Endpoint::answer`) doubled
    /// it, to 2 KiB. It was 1,016 bytes, 1,040 since each read keeps the
    /// change feed's position it looked at (never back in time: see
    /// `read_path/floor.rs`), and 1,064 since every read enters the read
    /// path by one door (`ReadPath::serve`: the plain read's future, or
    /// the boxed route of the others, told apart).
    #[test]
    fn a_request_future_stays_small() {
        fn size<F, R>(_: F) -> usize
        where
            F: FnOnce(&'static Endpoint, &'static Arc<Deadline>, Request<Incoming>) -> R,
        {
            std::mem::size_of::<R>()
        }
        let bytes = size(answer);
        assert!(bytes <= 1064, "a request's future is {bytes} bytes");
    }

    /// The arithmetic alone: the process's own limit is not touched.
    #[test]
    fn the_cap_is_lowered_to_fit_the_file_descriptor_limit() {
        let reserve = FD_RESERVE + 16;
        // Room for all: kept.
        assert_eq!(cap_within(10_000, 16, 10_000 + reserve), 10_000);
        assert_eq!(cap_within(10_000, 16, 1 << 20), 10_000);
        // One short: lowered to what fits beside the reserve and the pool.
        assert_eq!(cap_within(10_000, 16, 10_000 + reserve - 1), 9_999);
        assert_eq!(cap_within(10_000, 16, 1_024), 1_024 - reserve as usize);
        // A limit below the reserve: one connection, never zero.
        assert_eq!(cap_within(10_000, 16, 100), 1);
        // No overflow, whatever the setting.
        assert_eq!(cap_within(usize::MAX, u32::MAX, u64::MAX), usize::MAX);
    }
}
