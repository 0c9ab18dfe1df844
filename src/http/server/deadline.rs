//! HTTP (the server): when a connection is closed for taking too long: the
//! deadline of one connection, moved by what happens on it, and the watch
//! that closes it.
//!
//! A connection is always in one of three phases:
//!
//! ```text
//!   opened ─► reading headers ──headers complete──► busy (a request in flight)
//!                 ▲      (close at HEADER_READ_TIMEOUT)        │ answered
//!                 │ first byte                                 ▼
//!                 └──────────────────────────────── idle (close at IDLE_TIMEOUT)
//! ```
//!
//! The header deadline runs from the connection's opening, or from the first
//! byte of the next request on a kept-alive connection: a client that
//! trickles one byte at a time does not push it back (slowloris). The idle
//! deadline runs from the end of the last answer, so a keep-alive that is
//! used keeps living. A busy connection has no deadline here: REQUEST_TIMEOUT
//! bounds the request, and its end starts the idle deadline (which also bounds
//! a client that never reads its answer).
//!
//! hyper's own `header_read_timeout` is not used: it starts when hyper is
//! ready for the next request, so it would close every idle keep-alive
//! connection after HEADER_READ_TIMEOUT instead of IDLE_TIMEOUT.

use std::{
    io,
    pin::Pin,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    task::{Context, Poll},
    time::Duration,
};

use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    time::Instant,
};

/// `close_at` of a busy connection: no deadline.
const BUSY: u64 = u64::MAX;

/// How long a connection that was busy when the shutdown began may take to
/// write its last answer once it is ready (hyper closes it right after; this
/// bounds a client that does not read).
const SHUTDOWN_WRITE_GRACE: Duration = Duration::from_secs(1);

/// What a shutdown makes of a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Drain {
    /// A request in flight: answered, then closed.
    Busy,
    /// Answered (its answer perhaps still being written), idle since:
    /// closed once written, within SHUTDOWN_WRITE_GRACE.
    Answered,
    /// Opened, or a request's first bytes in, no request yet: closed now.
    Reading,
}

/// Why a connection was closed by its deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Expiry {
    /// Its request headers were not complete in time.
    HeaderRead,
    /// It was idle for too long.
    Idle,
}

impl Expiry {
    pub(super) fn label(self) -> &'static str {
        match self {
            Expiry::HeaderRead => "header_read",
            Expiry::Idle => "idle",
        }
    }
}

/// The deadline of one connection.
///
/// Atomics, not a lock: the phase moves on every read and every request, and
/// all of it happens inside the connection's one task (hyper polls the
/// request's future inside the connection's), so there is never a
/// concurrent writer; they are atomics only because the task may move
/// between threads. The watch does not need waking when the deadline moves:
/// it looks again at least every `step` (see [`Deadline::expired`]).
#[derive(Debug)]
pub(super) struct Deadline {
    epoch: Instant,
    header_read: Duration,
    idle: Duration,
    /// The shorter of the two timeouts: no deadline can be set closer than
    /// that to the moment it is set.
    step: Duration,
    /// Nanoseconds after `epoch` at which the connection is closed, or BUSY.
    close_at: AtomicU64,
    /// Idle: the next byte read starts a request (and its header deadline).
    idle_now: AtomicBool,
    /// The service is shutting down: a busy connection closes once answered.
    draining: AtomicBool,
}

impl Deadline {
    /// A new connection: its headers are due HEADER_READ_TIMEOUT from now.
    pub(super) fn new(header_read: Duration, idle: Duration) -> Arc<Self> {
        Arc::new(Self {
            epoch: Instant::now(),
            header_read,
            idle,
            step: header_read.min(idle),
            close_at: AtomicU64::new(nanos(header_read)),
            idle_now: AtomicBool::new(false),
            draining: AtomicBool::new(false),
        })
    }

    fn now(&self) -> u64 {
        nanos(self.epoch.elapsed())
    }

    /// Bytes arrived: on an idle connection, a request begins.
    fn on_read(&self) {
        if self.idle_now.load(Ordering::Relaxed) {
            self.idle_now.store(false, Ordering::Relaxed);
            self.close_at
                .store(self.now() + nanos(self.header_read), Ordering::Relaxed);
        }
    }

    /// The request's headers are complete: no deadline until it is answered.
    pub(super) fn begin_request(self: &Arc<Self>) -> Busy {
        self.idle_now.store(false, Ordering::Relaxed);
        self.close_at.store(BUSY, Ordering::Relaxed);
        Busy(self.clone())
    }

    pub(super) fn is_busy(&self) -> bool {
        self.close_at.load(Ordering::Relaxed) == BUSY
    }

    /// The service shuts down: what is to become of this connection. One
    /// that has answered may still be writing its answer: it gets
    /// SHUTDOWN_WRITE_GRACE (hyper closes it as soon as it is done).
    pub(super) fn drain(&self) -> Drain {
        self.draining.store(true, Ordering::Relaxed);
        if self.is_busy() {
            Drain::Busy
        } else if self.idle_now.load(Ordering::Relaxed) {
            let grace = self.now() + nanos(SHUTDOWN_WRITE_GRACE);
            self.close_at.fetch_min(grace, Ordering::Relaxed);
            Drain::Answered
        } else {
            Drain::Reading
        }
    }

    /// Completes when the deadline passes, saying which one it was.
    ///
    /// Looks at the deadline at least every `step`: a deadline set while it
    /// sleeps is at least `step` after the moment it was set, so never
    /// before the watch looks again. That keeps the moves of the deadline
    /// (on every request) free of timer resets and wake-ups.
    pub(super) async fn expired(&self) -> Expiry {
        loop {
            let now = self.now();
            let close_at = self.close_at.load(Ordering::Relaxed);
            if close_at != BUSY && close_at <= now {
                return if self.idle_now.load(Ordering::Relaxed) {
                    Expiry::Idle
                } else {
                    Expiry::HeaderRead
                };
            }
            // Draining, deadlines are set SHUTDOWN_WRITE_GRACE ahead.
            let step = if self.draining.load(Ordering::Relaxed) {
                self.step.min(SHUTDOWN_WRITE_GRACE)
            } else {
                self.step
            };
            let wake = close_at.min(now + nanos(step));
            tokio::time::sleep_until(self.epoch + Duration::from_nanos(wake)).await;
        }
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(BUSY - 1)
}

/// A request in flight on a connection; its end starts the idle deadline.
/// A guard, so that a request future dropped half-way (REQUEST_TIMEOUT, a
/// panic) leaves the connection idle rather than busy for ever.
pub(super) struct Busy(Arc<Deadline>);

impl Drop for Busy {
    fn drop(&mut self) {
        let d = &self.0;
        let after = if d.draining.load(Ordering::Relaxed) {
            SHUTDOWN_WRITE_GRACE
        } else {
            d.idle
        };
        d.close_at.store(d.now() + nanos(after), Ordering::Relaxed);
        d.idle_now.store(true, Ordering::Relaxed);
    }
}

/// A connection's socket, telling its deadline when bytes arrive.
pub(super) struct Watched<S> {
    inner: S,
    deadline: Arc<Deadline>,
}

impl<S> Watched<S> {
    pub(super) fn new(inner: S, deadline: Arc<Deadline>) -> Self {
        Self { inner, deadline }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Watched<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.deadline.on_read();
        }
        polled
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Watched<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEADERS: Duration = Duration::from_secs(10);
    const IDLE: Duration = Duration::from_secs(60);

    #[tokio::test(start_paused = true)]
    async fn a_new_connection_must_complete_its_headers_in_time() {
        let d = Deadline::new(HEADERS, IDLE);
        let opened = Instant::now();

        assert_eq!(d.expired().await, Expiry::HeaderRead);
        assert_eq!(opened.elapsed(), HEADERS);
    }

    #[tokio::test(start_paused = true)]
    async fn trickled_bytes_do_not_push_the_header_deadline_back() {
        let d = Deadline::new(HEADERS, IDLE);
        let opened = Instant::now();
        let trickle = async {
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                d.on_read();
            }
        };

        let expiry = tokio::select! {
            e = d.expired() => e,
            () = trickle => unreachable!(),
        };

        assert_eq!(expiry, Expiry::HeaderRead);
        assert_eq!(opened.elapsed(), HEADERS);
    }

    #[tokio::test(start_paused = true)]
    async fn an_answered_connection_is_idle_until_the_idle_timeout() {
        let d = Deadline::new(HEADERS, IDLE);
        tokio::time::sleep(Duration::from_secs(1)).await;
        drop(d.begin_request());
        let answered = Instant::now();

        assert_eq!(d.expired().await, Expiry::Idle);
        assert_eq!(answered.elapsed(), IDLE);
    }

    #[tokio::test(start_paused = true)]
    async fn the_first_byte_on_an_idle_connection_starts_the_header_deadline() {
        let d = Deadline::new(HEADERS, IDLE);
        drop(d.begin_request());
        let client = async {
            tokio::time::sleep(Duration::from_secs(30)).await;
            d.on_read();
            Instant::now()
        };

        // The watch is asleep towards the idle deadline (60 s after the
        // answer) when the byte arrives: it still closes at the header
        // deadline, 20 s sooner.
        let (expiry, first_byte) = tokio::join!(d.expired(), client);

        assert_eq!(expiry, Expiry::HeaderRead);
        assert_eq!(first_byte.elapsed(), HEADERS);
    }

    #[tokio::test(start_paused = true)]
    async fn a_busy_connection_has_no_deadline() {
        let d = Deadline::new(HEADERS, IDLE);
        let busy = d.begin_request();

        let waited = tokio::time::timeout(10 * IDLE, d.expired()).await;

        assert!(waited.is_err(), "closed while busy: {waited:?}");
        assert!(d.is_busy());
        drop(busy);
        assert!(!d.is_busy());
    }

    #[tokio::test(start_paused = true)]
    async fn a_shutdown_closes_a_busy_connection_soon_after_its_answer() {
        let d = Deadline::new(HEADERS, IDLE);
        let busy = d.begin_request();

        assert_eq!(d.drain(), Drain::Busy, "closed once answered");
        drop(busy);
        let answered = Instant::now();

        assert_eq!(d.expired().await, Expiry::Idle);
        assert_eq!(answered.elapsed(), SHUTDOWN_WRITE_GRACE);
    }

    #[tokio::test(start_paused = true)]
    async fn a_shutdown_gives_an_answered_connection_the_write_grace_and_a_reading_one_none() {
        let answered = Deadline::new(HEADERS, IDLE);
        drop(answered.begin_request());
        let reading = Deadline::new(HEADERS, IDLE);
        let stopped = Instant::now();

        assert_eq!(answered.drain(), Drain::Answered);
        assert_eq!(reading.drain(), Drain::Reading);
        assert_eq!(answered.expired().await, Expiry::Idle);
        assert_eq!(
            stopped.elapsed(),
            SHUTDOWN_WRITE_GRACE,
            "not the idle timeout"
        );
    }
}
