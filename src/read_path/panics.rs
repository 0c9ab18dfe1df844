//! The protocol: a flight that panics. Its requests are answered 503, the
//! panic is logged once with the key and counted, and its leader's lock (if it held one) is
//! let go as the panic unwinds (`leader.rs`, [`Held`](super::leader)).
//!
//! The default panic hook prints every panic to stderr, with a backtrace
//! when RUST_BACKTRACE asks for one, and knows nothing of the key. A panic
//! inside [`caught`] is instead kept (message and location) for the catcher,
//! which logs it once through tracing, with the key; panics anywhere else
//! go to the hook that was installed before.

use std::{
    any::Any,
    cell::{Cell, RefCell},
    future::Future,
    panic::{AssertUnwindSafe, PanicHookInfo},
    pin::Pin,
    sync::Once,
    task::{Context, Poll},
};

use futures::FutureExt;

thread_local! {
    /// A [`Catching`] future is being polled on this thread.
    static CATCHING: Cell<bool> = const { Cell::new(false) };
    /// What the hook kept of the last panic caught on this thread.
    static CAUGHT: RefCell<Option<String>> = const { RefCell::new(None) };
}

static HOOK: Once = Once::new();

/// Installs the hook (once per process); panics outside [`caught`] still
/// reach the previous hook.
pub(super) fn install_hook() {
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info: &PanicHookInfo<'_>| {
            if CATCHING.with(Cell::get) {
                let location = info
                    .location()
                    .map(|l| format!(" at {}:{}", l.file(), l.line()))
                    .unwrap_or_default();
                let kept = format!("{}{location}", message(info.payload()));
                CAUGHT.with(|caught| *caught.borrow_mut() = Some(kept));
            } else {
                previous(info);
            }
        }));
    });
}

/// The text of a panic's payload.
fn message(payload: &(dyn Any + Send)) -> &str {
    payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a panic without a message")
}

/// Marks this thread as catching while its future is polled (a guard: the
/// mark is cleared however the poll ends, by a return or a panic).
struct Catching<F>(F);

struct Mark(bool);

impl Mark {
    fn set() -> Self {
        Self(CATCHING.with(|c| c.replace(true)))
    }
}

impl Drop for Mark {
    fn drop(&mut self) {
        CATCHING.with(|c| c.set(self.0));
    }
}

impl<F: Future + Unpin> Future for Catching<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let _mark = Mark::set();
        Pin::new(&mut self.0).poll(cx)
    }
}

/// Runs `flight`; if it panics, the panic is logged once with `key`,
/// counted, and `Err(panicked)` returned in place of its output.
pub(super) async fn caught<T>(
    flight: impl Future<Output = T> + Send,
    key: &(dyn std::fmt::Display + Sync),
    panicked: impl FnOnce() -> T,
) -> T {
    match AssertUnwindSafe(Catching(Box::pin(flight)))
        .catch_unwind()
        .await
    {
        Ok(output) => output,
        Err(payload) => {
            let kept = CAUGHT.with(|caught| caught.borrow_mut().take());
            let panic = kept.unwrap_or_else(|| message(payload.as_ref()).to_owned());
            crate::telemetry::metrics::flight_panicked();
            tracing::error!(%key, panic, "a flight panicked; its requests are answered 503");
            panicked()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_panic_inside_becomes_the_fallback_and_one_outside_is_not_caught() {
        install_hook();
        let ok = caught(async { 1 }, &"k", || 0).await;
        let fallback = caught(async { panic!("boom") }, &"k", || 0).await;
        let outside = tokio::spawn(async { panic!("elsewhere") }).await;

        assert_eq!((ok, fallback), (1, 0));
        assert!(outside.unwrap_err().is_panic());
        assert!(!CATCHING.with(Cell::get), "the mark is cleared");
    }
}
