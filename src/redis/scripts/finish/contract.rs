//! The Redis side: the finish script on a real Redis, through every reply
//! it gives.

use std::time::Duration;

use fred::prelude::*;

use super::*;
use crate::{
    cache::{message::framed, Keys as Names, Status},
    redis::scripts::contract::{assert_reads, clean, heard, put_for, redis, run},
};

const MINUTE: Duration = Duration::from_secs(60);

fn store() -> StoreFor {
    StoreFor {
        value: MINUTE,
        tombstone: 2 * MINUTE,
        failure: Duration::from_secs(5),
    }
}

fn finish<'a>(keys: &'a ItemKeys, entry: &'a Entry, fence: &'a str) -> Finish<'a> {
    Finish {
        keys,
        token: "ours",
        entry,
        store: store(),
        fence,
        cutoff: 0,
        sharded: false,
    }
}

fn found(body: &str) -> Entry {
    Entry::new(Status::Found, body.as_bytes(), MINUTE, Duration::ZERO)
}

async fn put(client: &Client, key: &str, value: impl Into<Value> + Send) {
    let _: () = client.set(key, value, None, None, false).await.unwrap();
}

async fn pttl(client: &Client, key: &str) -> i64 {
    client.pttl(key).await.unwrap()
}

async fn get(client: &Client, key: &str) -> Option<Entry> {
    let raw: Option<Bytes> = client.get(key).await.unwrap();
    raw.map(|raw| Entry::decode(raw).unwrap())
}

/// Runs `call`, and what its finish published on the channel.
async fn run_heard(client: &Client, call: &Finish<'_>) -> (Finished, Option<Bytes>) {
    let mut reply = None;
    let message = heard(client, &call.keys.channel, async {
        reply = Some(run(client, call).await);
    })
    .await;
    (reply.expect("ran"), message)
}

/// A holder's finish (its reply and message, `heard`) stored `entry` in the
/// value key for as long as the store policy said, released, and published it.
async fn stored_and_published(
    client: &Client,
    keys: &ItemKeys,
    (reply, message): (Finished, Option<Bytes>),
    entry: &Entry,
) {
    assert_eq!(
        reply,
        Finished {
            released: true,
            published: Some(entry.clone())
        }
    );
    // Framed with the item's fence as it is (cache/message.rs).
    let fence: Option<Bytes> = client.get(&keys.fence).await.unwrap();
    assert_eq!(
        message,
        Some(framed(&fence.unwrap_or_default(), entry.raw()))
    );
    // One key, the body stored once.
    assert_eq!(get(client, &keys.value).await.as_ref(), Some(entry));
    let ttl = pttl(client, &keys.value).await;
    assert!((50_000..=60_000).contains(&ttl), "{ttl}");
}

#[test]
fn the_script_reads_exactly_the_names_the_call_sends() {
    assert_reads(&lua(), 'K', &[Keys::<()>::NAMES]);
    assert_reads(&lua(), 'A', &[Argv::<()>::NAMES]);
}

/// A waiter judges a message by the fence it read when it looked
/// (read_path/waiter.rs): the message carries the fence as it was when it
/// was published, read in the same script as the store.
#[tokio::test]
async fn the_message_carries_the_fence_it_was_published_under() {
    let (client, prefix) = redis().await;
    let keys = Names::new(&prefix, "post").item(1);
    let entry = found("new");
    put(&client, &keys.lock, "ours").await;
    put(&client, &keys.fence, "4242").await;

    let (_, message) = run_heard(&client, &finish(&keys, &entry, "4242")).await;

    let message = crate::cache::message::Message::parse(message.expect("published"));
    assert_eq!(message.fence.as_deref(), Some(&b"4242"[..]));
    assert_eq!(&message.entry, entry.raw());
    assert!(message.published_under(b"4242"));
    assert!(
        !message.published_under(b""),
        "not under the look before the change"
    );
}

#[tokio::test]
async fn the_holder_stores_publishes_and_releases() {
    let (client, prefix) = redis().await;
    let keys = Names::new(&prefix, "post").item(1);
    let entry = found("new");
    put(&client, &keys.lock, "ours").await;

    let heard = run_heard(&client, &finish(&keys, &entry, "")).await;

    stored_and_published(&client, &keys, heard, &entry).await;
    let lock: Option<String> = client.get(&keys.lock).await.unwrap();
    assert_eq!(lock, None);
    clean(&client, &prefix).await;
}

#[tokio::test]
async fn many_finishes_in_one_call_each_do_what_their_own_would() {
    let (client, prefix) = redis().await;
    let names = Names::new(&prefix, "post");
    let (held, fenced, lost) = (names.item(11), names.item(12), names.item(13));
    let (new, old, stored) = (found("new"), found("before the change"), found("theirs"));
    put(&client, &held.lock, "ours").await;
    put(&client, &fenced.lock, "ours").await;
    put(&client, &fenced.fence, "7").await;
    put(&client, &lost.lock, "theirs").await;
    put(&client, &lost.value, stored.raw().clone()).await;
    let finishes = [
        finish(&held, &new, ""),
        finish(&fenced, &old, "6"),
        finish(&lost, &new, ""),
    ];
    let keys: Vec<Vec<String>> = finishes
        .iter()
        .map(|f| f.keys().into_iter().map(str::to_owned).collect())
        .collect();
    let args: Vec<Vec<Value>> = finishes.iter().map(Finish::args).collect();
    let items: Vec<(&[String], &[Value])> = keys
        .iter()
        .zip(&args)
        .map(|(k, a)| (k.as_slice(), a.as_slice()))
        .collect();

    let replies = run(&client, &FinishMany { items: &items }).await;

    let replies: Vec<Finished> = finishes
        .iter()
        .zip(replies)
        .map(|(f, reply)| f.reply(reply).expect("a finish's reply"))
        .collect();
    assert_eq!(
        replies,
        [
            Finished {
                released: true,
                published: Some(new.clone())
            },
            Finished {
                released: true,
                published: None
            },
            Finished {
                released: false,
                published: Some(stored.clone())
            },
        ]
    );
    assert_eq!(get(&client, &held.value).await.as_ref(), Some(&new));
    assert_eq!(get(&client, &fenced.value).await, None);
    assert_eq!(get(&client, &lost.value).await.as_ref(), Some(&stored));
    let lock: Option<String> = client.get(&lost.lock).await.unwrap();
    assert_eq!(lock.as_deref(), Some("theirs"));
    clean(&client, &prefix).await;
}

#[tokio::test]
async fn a_changed_fence_stores_nothing_and_publishes_retry() {
    let (client, prefix) = redis().await;
    let keys = Names::new(&prefix, "post").item(2);
    let entry = found("read before the change");
    put(&client, &keys.lock, "ours").await;
    put(&client, &keys.fence, "7").await;

    let (reply, message) = run_heard(&client, &finish(&keys, &entry, "6")).await;

    assert_eq!(
        reply,
        Finished {
            released: true,
            published: None
        }
    );
    assert_eq!(message.as_deref(), Some(RETRY));
    assert_eq!(get(&client, &keys.value).await, None);

    // Fenced without holding the lock: the holder's lock stays.
    put(&client, &keys.lock, "theirs").await;
    let reply = run(&client, &finish(&keys, &entry, "6")).await;
    assert_eq!(
        reply,
        Finished {
            released: false,
            published: None
        }
    );
    let lock: Option<String> = client.get(&keys.lock).await.unwrap();
    assert_eq!(lock.as_deref(), Some("theirs"));
    clean(&client, &prefix).await;
}

#[tokio::test]
async fn a_lost_lock_publishes_what_is_stored_or_nothing() {
    let (client, prefix) = redis().await;
    let keys = Names::new(&prefix, "post").item(3);
    let ours = found("older");
    let theirs = found("newer");
    put(&client, &keys.lock, "theirs").await;

    // Nothing stored: nothing written, our entry stands for the reply.
    let reply = run(&client, &finish(&keys, &ours, "")).await;
    assert_eq!(
        reply,
        Finished {
            released: false,
            published: Some(ours.clone())
        }
    );
    assert_eq!(get(&client, &keys.value).await, None);

    // Another leader's value stored: it is what we publish.
    put(&client, &keys.value, theirs.raw().clone()).await;
    let reply = run(&client, &finish(&keys, &ours, "")).await;
    assert_eq!(reply.published.as_ref(), Some(&theirs));
    assert_eq!(get(&client, &keys.value).await.as_ref(), Some(&theirs));
    clean(&client, &prefix).await;
}

#[tokio::test]
async fn a_failure_keeps_a_fresh_entry_else_serves_the_copy_as_backoff_else_a_marker() {
    let (client, prefix) = redis().await;
    let keys = Names::new(&prefix, "post").item(4);
    let failed = Entry::new(Status::Failed, &[], Duration::ZERO, Duration::ZERO);

    // Still fresh: left as it is, and published.
    let fresh = found("fresh");
    put(&client, &keys.value, fresh.raw().clone()).await;
    let reply = run(&client, &finish(&keys, &failed, "")).await;
    assert_eq!(reply.published.as_ref(), Some(&fresh));

    // Past freshness, kept as the fail-safe copy: it comes back flagged as
    // backoff until FAILURE_TTL from now, and stays as long as it had left.
    let now = now_millis();
    let past = Entry::stamped(
        Status::Found,
        b"past",
        now - 2_000,
        now - 1_000,
        Duration::ZERO,
    );
    put_for(&client, &keys.value, &past, 600_000).await;
    let published = run(&client, &finish(&keys, &failed, ""))
        .await
        .published
        .unwrap();
    assert!(published.is_backoff());
    let until = published.backoff_until();
    assert!(
        (now + 5_000..=now_millis() + 5_000).contains(&until),
        "{until}"
    );
    assert_eq!(published.body(), past.body());
    assert_eq!(get(&client, &keys.value).await.as_ref(), Some(&published));
    assert!(pttl(&client, &keys.value).await > 590_000);

    // Invalidated by a change: still the last good copy, served on purpose
    // (no longer flagged invalidated); a copy with little life left is kept
    // for the whole backoff.
    put_for(&client, &keys.value, &past.as_invalidated(), 100).await;
    let published = run(&client, &finish(&keys, &failed, ""))
        .await
        .published
        .unwrap();
    assert!(published.is_backoff() && !published.is_invalidated());
    assert_eq!(published.body(), past.body());
    let ttl = pttl(&client, &keys.value).await;
    assert!((4_000..=5_000).contains(&ttl), "{ttl}");

    // A deleted post's tombstone comes back as a backoff 404, unless it was
    // read before the cutoff.
    let tombstone = Entry::stamped(
        Status::NotFound,
        &[],
        now - 2_000,
        now - 1_000,
        Duration::ZERO,
    )
    .as_invalidated();
    put_for(&client, &keys.value, &tombstone, 600_000).await;
    let published = run(&client, &finish(&keys, &failed, ""))
        .await
        .published
        .unwrap();
    assert!(published.is_backoff());
    assert_eq!(published.status(), Status::NotFound);
    put_for(&client, &keys.value, &tombstone, 600_000).await;
    let after_cutoff = Finish {
        cutoff: now,
        ..finish(&keys, &failed, "")
    };
    let published = run(&client, &after_cutoff).await.published.unwrap();
    assert_eq!(published.status(), Status::Failed, "read before the cutoff");

    // No copy at all: the failure marker, stored for FAILURE_TTL.
    let _: i64 = client.del(&keys.value).await.unwrap();
    let published = run(&client, &finish(&keys, &failed, ""))
        .await
        .published
        .unwrap();
    assert_eq!(published.status(), Status::Failed);
    let ttl = pttl(&client, &keys.value).await;
    assert!(ttl > 0 && ttl <= 5_000, "{ttl}");
    clean(&client, &prefix).await;
}

/// A leader that reloads a kept copy holds the lock key; the copy expires
/// meanwhile and another leader claims the value key. The first one's
/// load fails: its failure must not replace that claim (every reader would
/// get 503 for FAILURE_TTL though the other load succeeds), nor be
/// published to the other leader's waiters. (Seen before: the marker was
/// stored over the claim.)
#[tokio::test]
async fn a_failure_never_replaces_another_leaders_claim() {
    let (client, prefix) = redis().await;
    let keys = Names::new(&prefix, "post").item(9);
    let failed = Entry::new(Status::Failed, &[], Duration::ZERO, Duration::ZERO);
    put(&client, &keys.lock, "ours").await;
    let theirs = crate::cache::claim_of("theirs");
    put(&client, &keys.value, theirs.as_str()).await;

    let (reply, message) = run_heard(&client, &finish(&keys, &failed, "")).await;

    assert_eq!(message, None, "nothing published to the other's waiters");
    assert!(reply.released);
    let value: Option<String> = client.get(&keys.value).await.unwrap();
    assert_eq!(value.as_deref(), Some(theirs.as_str()), "their claim stays");
    let lock: Option<String> = client.get(&keys.lock).await.unwrap();
    assert_eq!(lock, None);
    clean(&client, &prefix).await;
}

#[tokio::test]
async fn a_not_found_entry_over_a_copy_is_kept_as_the_tombstone() {
    let (client, prefix) = redis().await;
    let names = Names::new(&prefix, "post");
    let (existed, never) = (names.item(5), names.item(6));
    let not_found = Entry::new(Status::NotFound, &[], MINUTE, Duration::ZERO);
    put(&client, &existed.lock, "ours").await;
    put(&client, &never.lock, "ours").await;
    put_for(
        &client,
        &existed.value,
        &found("old").as_invalidated(),
        600_000,
    )
    .await;

    for keys in [&existed, &never] {
        let reply = run(&client, &finish(keys, &not_found, "")).await;
        assert_eq!(reply.published.as_ref(), Some(&not_found));
        assert_eq!(get(&client, &keys.value).await.as_ref(), Some(&not_found));
    }
    // The item existed: kept as long as a copy (`tombstone`, 2 minutes), so
    // that its old body never comes back; never seen: for its freshness.
    let ttl = pttl(&client, &existed.value).await;
    assert!((110_000..=120_000).contains(&ttl), "{ttl}");
    let ttl = pttl(&client, &never.value).await;
    assert!((50_000..=60_000).contains(&ttl), "{ttl}");
    clean(&client, &prefix).await;
}

/// The keys of a leader whose lock is its claim in the value key.
fn in_value(keys: &ItemKeys) -> ItemKeys {
    ItemKeys {
        lock: keys.value.clone(),
        ..keys.clone()
    }
}

/// A finish by the leader whose claim in the value key is "ours".
fn claimed_finish<'a>(keys: &'a ItemKeys, entry: &'a Entry, fence: &'a str) -> Finish<'a> {
    Finish {
        token: "\0claim:ours",
        ..finish(keys, entry, fence)
    }
}

#[tokio::test]
async fn a_claim_in_the_value_key_is_replaced_by_what_its_holder_stores() {
    let (client, prefix) = redis().await;
    let keys = in_value(&Names::new(&prefix, "post").item(11));
    let entry = found("new");
    put(&client, &keys.value, "\0claim:ours").await;

    let heard = run_heard(&client, &claimed_finish(&keys, &entry, "")).await;

    // Stored over the claim, and not deleted as a lock would be.
    stored_and_published(&client, &keys, heard, &entry).await;

    // A failed load with nothing to fall back on and no failure marker
    // (FAILURE_TTL off): nothing stored, the claim deleted.
    let failed = Entry::new(Status::Failed, b"", Duration::ZERO, Duration::ZERO);
    put(&client, &keys.value, "\0claim:ours").await;
    let no_marker = Finish {
        store: StoreFor {
            failure: Duration::ZERO,
            ..store()
        },
        ..claimed_finish(&keys, &failed, "")
    };
    let reply = run(&client, &no_marker).await;
    assert!(reply.released);
    assert_eq!(pttl(&client, &keys.value).await, -2, "the claim is gone");

    // With FAILURE_TTL: the marker replaces the claim.
    put(&client, &keys.value, "\0claim:ours").await;
    let reply = run(&client, &claimed_finish(&keys, &failed, "")).await;
    assert!(reply.released);
    let marker = get(&client, &keys.value).await.expect("a failure marker");
    assert_eq!(marker.status(), Status::Failed);
    let ttl = pttl(&client, &keys.value).await;
    assert!((4_000..=5_000).contains(&ttl), "{ttl}");
    clean(&client, &prefix).await;
}

#[tokio::test]
async fn a_claim_gone_stores_nothing_and_answers_what_is_stored_or_retry() {
    let (client, prefix) = redis().await;
    let keys = in_value(&Names::new(&prefix, "post").item(12));
    let entry = found("read before the change");

    // A change deleted the claim during the load (the fence it moved is not
    // what tells: the claim is): nothing stored, the waiters told to elect
    // again, and this leader's flight too.
    put(&client, &keys.fence, "7").await;
    let (reply, message) = run_heard(&client, &claimed_finish(&keys, &entry, "")).await;
    assert_eq!(
        reply,
        Finished {
            released: false,
            published: None
        }
    );
    assert_eq!(message.as_deref(), Some(RETRY));
    assert_eq!(pttl(&client, &keys.value).await, -2);

    // Our claim expired and another leader claimed: theirs stays.
    put(&client, &keys.value, "\0claim:theirs").await;
    let (reply, message) = run_heard(&client, &claimed_finish(&keys, &entry, "7")).await;
    assert_eq!(reply.published, None);
    assert_eq!(message.as_deref(), Some(RETRY));
    let held: Option<Bytes> = client.get(&keys.value).await.unwrap();
    assert_eq!(held.as_deref(), Some(&b"\0claim:theirs"[..]));

    // Another leader stored meanwhile: theirs stays, and is published.
    let theirs = found("newer");
    put(&client, &keys.value, theirs.raw().clone()).await;
    let (reply, message) = run_heard(&client, &claimed_finish(&keys, &entry, "")).await;
    assert_eq!(reply.published.as_ref(), Some(&theirs));
    // Under the fence as it is (a change fenced it earlier in this test).
    let fence: Option<Bytes> = client.get(&keys.fence).await.unwrap();
    assert_eq!(
        message,
        Some(framed(&fence.unwrap_or_default(), theirs.raw()))
    );
    assert_eq!(get(&client, &keys.value).await.as_ref(), Some(&theirs));

    // The claim intact under a fence that moved (a change applied before
    // the claim, whose fence a replica-less leader never read): stored.
    put(&client, &keys.value, "\0claim:ours").await;
    let reply = run(&client, &claimed_finish(&keys, &entry, "")).await;
    assert_eq!(reply.published.as_ref(), Some(&entry));
    assert_eq!(get(&client, &keys.value).await.as_ref(), Some(&entry));
    clean(&client, &prefix).await;
}
