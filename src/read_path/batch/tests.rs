//! The protocol: natural batching's unit tests, against sources held by
//! hand (no server).

use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::Semaphore;

use super::*;
use crate::read_path::source::{Loaded, LoadedMany};

const A_SECOND: Duration = Duration::from_secs(1);

/// Keys 1..=100 exist (their body is the key); each statement waits
/// for a permit, so a test holds statements in flight at will.
struct Held {
    gate: Semaphore,
    statements: Mutex<Vec<Vec<u64>>>,
    /// Each key read, with the change it had to include.
    asked: Mutex<Vec<(u64, Since)>>,
    fail: AtomicUsize,
    panic: AtomicUsize,
}

impl Default for Held {
    fn default() -> Self {
        Self {
            gate: Semaphore::new(0),
            statements: Mutex::default(),
            asked: Mutex::default(),
            fail: AtomicUsize::new(0),
            panic: AtomicUsize::new(0),
        }
    }
}

impl Held {
    fn open() -> Self {
        let held = Self::default();
        held.gate.add_permits(1 << 20);
        held
    }

    async fn read(&self, keys: &[u64]) -> Result<Vec<(u64, Bytes)>, LoadError> {
        self.statements.lock().unwrap().push(keys.to_vec());
        self.gate.acquire().await.unwrap().forget();
        if self.panic.load(Ordering::Relaxed) > 0 {
            panic!("a statement that panics");
        }
        if self.fail.load(Ordering::Relaxed) > 0 {
            anyhow::bail!("connection reset");
        }
        Ok(keys
            .iter()
            .filter(|&&k| (1..=100).contains(&k))
            .map(|&k| (k, Bytes::from(k.to_string())))
            .collect())
    }
}

impl Source for Arc<Held> {
    type Key = u64;

    async fn load(&self, key: &u64, since: Since) -> Result<Loaded, LoadError> {
        self.asked.lock().unwrap().push((*key, since));
        let body = self.read(&[*key]).await?.pop().map(|(_, body)| body);
        Ok(Loaded { body, upto: 0 })
    }

    async fn load_many(&self, keys: &[(u64, Since)]) -> Result<LoadedMany<u64>, LoadError> {
        self.asked.lock().unwrap().extend_from_slice(keys);
        let keys: Vec<u64> = keys.iter().map(|(key, _)| *key).collect();
        let found = self.read(&keys).await?;
        Ok(LoadedMany { found, upto: 0 })
    }
}

/// `batches.load(key)` on a task of its own.
fn spawn_load(
    batches: &Arc<Batches<Arc<Held>>>,
    key: u64,
) -> tokio::task::JoinHandle<Option<Bytes>> {
    let batches = batches.clone();
    tokio::spawn(async move { batches.load(&key, Since::ANY).await.unwrap().body })
}

/// Waits until the source has seen `n` statements.
async fn until_statements(source: &Held, n: usize) {
    until("the statements", || {
        source.statements.lock().unwrap().len() == n
    })
    .await;
}

async fn until(what: &str, check: impl Fn() -> bool) {
    for _ in 0..1000 {
        if check() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    panic!("timed out waiting for {what}");
}

#[tokio::test]
async fn a_lone_load_starts_at_once_with_the_single_key_statement() {
    let source = Arc::new(Held::open());
    let batches = Batches::new(source.clone(), 256, 2, A_SECOND);
    assert_eq!(
        batches.load(&7, Since::ANY).await.unwrap().body,
        Some(Bytes::from("7"))
    );
    assert_eq!(batches.load(&700, Since::ANY).await.unwrap().body, None);
    assert_eq!(*source.statements.lock().unwrap(), vec![vec![7], vec![700]]);
}

#[tokio::test]
async fn loads_queued_behind_running_statements_share_the_next_ones() {
    let source = Arc::new(Held::default());
    let batches = Batches::new(source.clone(), 4, 2, A_SECOND);
    let load = |key: u64| spawn_load(&batches, key);
    // Two statements in flight, held.
    let mut loads = vec![load(1)];
    until("a statement", || {
        source.statements.lock().unwrap().len() == 1
    })
    .await;
    loads.push(load(2));
    until("two statements", || {
        source.statements.lock().unwrap().len() == 2
    })
    .await;
    // Ten more, one of them twice and one absent: they queue.
    for key in [3, 3, 4, 5, 6, 7, 8, 9, 10, 500] {
        loads.push(load(key));
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(
        source.statements.lock().unwrap().len(),
        2,
        "queued, not sent"
    );
    source.gate.add_permits(1 << 20);
    let got: Vec<Option<Bytes>> = futures::future::join_all(loads)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let want: Vec<Option<Bytes>> = [1, 2, 3, 3, 4, 5, 6, 7, 8, 9, 10]
        .iter()
        .map(|k| Some(Bytes::from(k.to_string())))
        .chain([None])
        .collect();
    assert_eq!(got, want);
    let statements = source.statements.lock().unwrap().clone();
    // 2 + ⌈10 queued / 4⌉ at most; the duplicate read once.
    assert!(statements.len() <= 5, "{statements:?}");
    assert!(statements.iter().all(|s| s.len() <= 4), "{statements:?}");
    let read: usize = statements.iter().map(Vec::len).sum();
    assert_eq!(read, 11, "every key once: {statements:?}");
    assert_eq!(batches.queue.lock().unwrap().running, 0, "slots freed");
}

#[tokio::test]
async fn a_key_queued_twice_is_read_once_so_as_to_include_the_later_change() {
    let source = Arc::new(Held::default());
    let batches = Batches::new(source.clone(), 16, 1, A_SECOND);
    let first = spawn_load(&batches, 1);
    until_statements(&source, 1).await;
    let load = |key: u64, since: u64| {
        let batches = batches.clone();
        tokio::spawn(async move { batches.load(&key, Since(since)).await.unwrap().body })
    };
    let queued = [load(5, 30), load(5, 70), load(5, 0), load(6, 0)];
    tokio::time::sleep(Duration::from_millis(20)).await;
    source.gate.add_permits(1 << 20);
    first.await.unwrap();
    for load in queued {
        assert!(load.await.unwrap().is_some());
    }
    let mut asked = source.asked.lock().unwrap().clone();
    asked.sort();
    assert_eq!(
        asked,
        vec![(1, Since::ANY), (5, Since(70)), (6, Since::ANY)],
        "each key once, with the latest change asked for"
    );
}

#[tokio::test]
async fn a_failed_statement_fails_each_of_its_keys_and_the_next_goes_on() {
    let source = Arc::new(Held::open());
    source.fail.store(1, Ordering::Relaxed);
    let batches = Batches::new(source.clone(), 256, 1, A_SECOND);
    let loads: Vec<_> = (1..=5)
        .map(|key| {
            let batches = batches.clone();
            tokio::spawn(async move { batches.load(&key, Since::ANY).await })
        })
        .collect();
    for load in futures::future::join_all(loads).await {
        let error = load.unwrap().unwrap_err();
        assert!(
            format!("{error:#}").contains("connection reset"),
            "{error:#}"
        );
    }
    source.fail.store(0, Ordering::Relaxed);
    assert_eq!(
        batches.load(&9, Since::ANY).await.unwrap().body,
        Some(Bytes::from("9"))
    );
}

#[tokio::test]
async fn a_statement_that_panics_answers_its_keys_and_frees_its_slot() {
    let source = Arc::new(Held::open());
    source.panic.store(1, Ordering::Relaxed);
    let batches = Batches::new(source.clone(), 256, 1, A_SECOND);
    let error = batches.load(&1, Since::ANY).await.unwrap_err();
    assert!(format!("{error:#}").contains("panicked"), "{error:#}");
    source.panic.store(0, Ordering::Relaxed);
    assert_eq!(
        batches.load(&2, Since::ANY).await.unwrap().body,
        Some(Bytes::from("2"))
    );
}

#[tokio::test]
async fn a_busy_source_is_busy_for_each_key() {
    struct Busy1;
    impl Source for Busy1 {
        type Key = u64;
        async fn load(&self, _: &u64, _: Since) -> Result<Loaded, LoadError> {
            Err(Busy.into())
        }
        async fn load_many(&self, _: &[(u64, Since)]) -> Result<LoadedMany<u64>, LoadError> {
            Err(Busy.into())
        }
    }
    let batches = Batches::new(Busy1, 256, 1, A_SECOND);
    assert!(batches.load(&1, Since::ANY).await.unwrap_err().is::<Busy>());
}

#[tokio::test]
async fn a_load_given_up_is_left_out_of_the_statement() {
    let source = Arc::new(Held::default());
    let batches = Batches::new(source.clone(), 256, 1, A_SECOND);
    let first = spawn_load(&batches, 1);
    until_statements(&source, 1).await;
    // Queued, then given up (a LOAD_TIMEOUT).
    let gone = tokio::time::timeout(Duration::from_millis(20), batches.load(&2, Since::ANY)).await;
    assert!(gone.is_err());
    let kept = spawn_load(&batches, 3);
    tokio::time::sleep(Duration::from_millis(10)).await;
    source.gate.add_permits(1 << 20);
    first.await.unwrap();
    kept.await.unwrap();
    assert_eq!(*source.statements.lock().unwrap(), vec![vec![1], vec![3]]);
}

#[tokio::test]
async fn a_key_whose_statement_does_not_start_in_time_while_others_succeed_is_busy() {
    let source = Arc::new(Held::default());
    let batches = Batches::new(source.clone(), 1, 1, Duration::from_millis(50));
    let first = spawn_load(&batches, 1);
    until_statements(&source, 1).await;
    let second = spawn_load(&batches, 2);
    let third = {
        let batches = batches.clone();
        tokio::spawn(async move { batches.load(&3, Since::ANY).await })
    };
    tokio::time::sleep(Duration::from_millis(10)).await;
    // Key 1 succeeds and key 2's statement starts, held: key 3 waits
    // out its patience while statements succeed. Busy, out of the queue.
    source.gate.add_permits(1);
    assert_eq!(first.await.unwrap(), Some(Bytes::from("1")));
    let queued = third.await.unwrap().unwrap_err();
    assert!(queued.is::<Busy>(), "{queued:#}");
    assert!(batches.lock().waiting.is_empty());
    // A statement that started is waited for, however long it takes.
    tokio::time::sleep(Duration::from_millis(100)).await;
    source.gate.add_permits(1);
    assert_eq!(second.await.unwrap(), Some(Bytes::from("2")));
}

#[tokio::test]
async fn a_key_whose_statement_does_not_start_in_time_while_none_succeeds_fails() {
    let source = Arc::new(Held::default());
    let batches = Batches::new(source.clone(), 256, 1, Duration::from_millis(50));
    let first = spawn_load(&batches, 1);
    until_statements(&source, 1).await;
    // The one statement hangs (a database gone silent): not busy.
    let queued = batches.load(&2, Since::ANY).await.unwrap_err();
    assert!(!queued.is::<Busy>(), "{queued:#}");
    assert!(
        format!("{queued:#}").contains("not answering"),
        "{queued:#}"
    );
    assert!(batches.lock().waiting.is_empty());
    source.gate.add_permits(1 << 20);
    assert_eq!(first.await.unwrap(), Some(Bytes::from("1")));
}

#[tokio::test]
async fn a_statement_waits_for_the_keys_a_batch_read_expects() {
    let source = Arc::new(Held::open());
    // A bound far past the test's steps: the statement waits for the
    // keys, not for the bound.
    let batches = Batches::waiting(source.clone(), 256, 2, A_SECOND, Duration::from_secs(30));
    let expected: Vec<_> = [1, 2, 3, 4].iter().map(|k| batches.expect(k)).collect();
    let first = spawn_load(&batches, 1);
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert!(
        source.statements.lock().unwrap().is_empty(),
        "held for 2, 3, 4"
    );
    let (second, third) = (spawn_load(&batches, 2), spawn_load(&batches, 3));
    // Key 4 will not load (another instance leads it).
    batches.not_loading(&4);
    for load in [first, second, third] {
        assert!(load.await.unwrap().is_some());
    }
    assert_eq!(*source.statements.lock().unwrap(), vec![vec![1, 2, 3]]);
    drop(expected);
    assert!(batches.lock().expected.is_empty());
    // Expected but never coming: a statement waits no more than the bound.
    let batches = Batches::new(source.clone(), 256, 2, A_SECOND);
    let _stuck = batches.expect(&9);
    let started = std::time::Instant::now();
    assert!(batches.load(&5, Since::ANY).await.unwrap().body.is_some());
    assert!(started.elapsed() < Duration::from_millis(500));
}
