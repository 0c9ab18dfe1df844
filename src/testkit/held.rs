//! Test support: a leader's first load held after its SELECT, before its
//! finish (the `after_load` hook), until the test lets it go: the window in
//! which the tests of fencing change a row.

use std::sync::{
    atomic::{AtomicBool, Ordering},
    Arc,
};

use tokio::sync::Semaphore;

use super::{wait_until, A_WHILE};
use crate::read_path::Hooks;

/// Holds the first load (of one value key, or of any) once it has read.
#[derive(Clone)]
pub struct HeldLoad {
    held: Arc<AtomicBool>,
    release: Arc<Semaphore>,
    /// The value key whose load is held; `None`: the first load of any.
    key: Option<String>,
}

impl HeldLoad {
    /// Holds the first load of any key.
    pub fn first() -> Self {
        Self {
            held: Arc::default(),
            release: Arc::new(Semaphore::new(0)),
            key: None,
        }
    }

    /// Holds the first load of `value_key` only.
    pub fn of(value_key: String) -> Self {
        Self {
            key: Some(value_key),
            ..Self::first()
        }
    }

    /// The hooks of an instance whose load is held.
    pub fn hooks(&self) -> Hooks {
        let this = self.clone();
        Hooks {
            after_load: Some(Arc::new(move |key: String| {
                let this = this.clone();
                Box::pin(async move {
                    let ours = this.key.as_ref().is_none_or(|held| *held == key);
                    if ours && !this.held.swap(true, Ordering::SeqCst) {
                        this.release.acquire().await.unwrap().forget();
                    }
                })
            })),
            ..Hooks::default()
        }
    }

    /// Waits until the load is held: its row read, its finish not begun.
    pub async fn until_held(&self) {
        wait_until("the leader to have read the row", A_WHILE, async || {
            self.held.load(Ordering::SeqCst)
        })
        .await;
    }

    /// Lets the held load go on to its finish.
    pub fn release(&self) {
        self.release.add_permits(1);
    }
}
