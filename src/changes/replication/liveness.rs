//! The change feed (replication): the decoder's proof that it sees the
//! primary, before it beats.
//!
//! A replication connection can go silent without closing: a NAT entry
//! that died, a host gone without a reset, a moved virtual IP. The decoder
//! then reads nothing, which on an idle database looks the same as nothing
//! to read, and it beat "nothing behind" for as long as the kernel kept the
//! socket (about 15 minutes) while the fleet served the old rows. So the
//! decoder proves each beat on a connection of its own:
//!
//! ```text
//!  prober, every PROBE_EVERY: the primary's WAL insert position, and
//!      what PostgreSQL says of this session's walsender (sent up to, when
//!      it last heard this decoder, whether it waits or decodes)
//!  decoder, at each beat: judge(the last probe, what it has read and applied)
//!      applied past the position the probe read ─► Level (nothing behind, as of the probe)
//!      the walsender decodes, or waits and hears this decoder ─► Behind (alive)
//!      the probe is late ─► Unsure (no beat)
//!      not heard, sent but not received, or no probe for a while ─► Dead:
//!          the decoder gives up the slot, and another instance takes it
//! ```
//!
//! - Every commit visible before a probe was sent is below the insert
//!   position it read, so a decoder that has applied past it has applied
//!   them all: the beat is level as of the probe, and says how old the
//!   probe was (the instances count its age from there).
//! - PostgreSQL's `reply_time` is the time this decoder put in the last
//!   status it processed (one goes out every 200 ms). It is never compared
//!   with another host's clock, nor timed on this one's wall clock, which
//!   steps (found: a decoder whose clock stepped 2 s ahead took the last
//!   status for 2 s old, gave up the slot, and a change waited 163 ms, bound
//!   100 ms): a status is heard when the value changes from one probe to
//!   the next, and its age is counted on the monotonic clock from there
//!   (see [`Heard`]). A walsender that waits for WAL reads statuses at once;
//!   one that decodes a large transaction reads them every half of its
//!   `wal_sender_timeout`, which the decoder sets to REPLICATION_TIMEOUT.
//! - A position in the middle of a record (a transaction that wrote WAL and
//!   waits, uncommitted: the walsender can only read whole records, flushed)
//!   is never reached by waiting: after NUDGE_AFTER the prober commits an
//!   empty transaction (with a transaction id, so a commit record, flushed
//!   locally without waiting for a synchronous standby), which carries the
//!   flushed WAL past it.

use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use sqlx::PgPool;
use tokio::sync::watch;

/// How often the prober asks the primary.
pub(super) const PROBE_EVERY: Duration = Duration::from_millis(100);
/// A probe older than this proves nothing: the decoder does not beat.
const PROBE_FRESH: Duration = Duration::from_millis(500);
/// How long a position seemingly within reach (the walsender waits, and
/// everything it sent arrived) may stay unreached before the prober
/// commits an empty transaction to carry the flushed WAL past it, and how
/// often at most.
const NUDGE_AFTER: Duration = Duration::from_millis(300);
const NUDGE_EVERY: Duration = Duration::from_secs(1);

/// What one probe of the primary saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Probe {
    /// When it was sent, on this process's clock.
    pub at: Instant,
    /// The primary's WAL insert position then (bytes from 0/0): every
    /// commit visible before `at` is below it.
    pub wal: u64,
    /// This session's walsender, as PostgreSQL shows it (`None`: it shows
    /// none).
    pub walsender: Option<Walsender>,
}

/// A walsender, as `pg_stat_replication` and `pg_stat_activity` show it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Walsender {
    /// Sent up to here (`sent_lsn`).
    pub sent: u64,
    /// How long before the probe the last status it processed from this
    /// decoder was sent (`None`: none yet).
    pub heard: Option<Duration>,
    /// Waiting (for WAL, or for the socket) rather than decoding.
    pub idle: bool,
}

/// What the decoder has read and applied when it judges.
#[derive(Debug, Clone, Copy)]
pub(super) struct Seen {
    /// Every change up to here is applied (or waits for a retry).
    pub applied: u64,
    /// Something read is not applied yet: an open transaction, a batch, a
    /// change waiting for Redis.
    pub open: bool,
    /// The end of the last message the replication connection received.
    pub received: u64,
    /// The decoder waits for messages (all that arrived is read): what the
    /// server sent and is not in is not held back by the decoder itself.
    pub waiting: bool,
}

/// What a beat may say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Verdict {
    /// Every commit visible `age` ago is applied.
    Level { age: Duration },
    /// Alive, and this many bytes behind the primary's position.
    Behind { bytes: u64 },
    /// Not known now: no beat.
    Unsure,
    /// The session cannot be vouched for: the decoder gives up the slot.
    Dead(String),
}

/// Judges beats, remembering what persists from one to the next.
#[derive(Debug)]
pub(super) struct Judge {
    /// REPLICATION_TIMEOUT.
    timeout: Duration,
    started: Instant,
    /// Since when PostgreSQL has sent what did not arrive, while both
    /// sides waited.
    unsent_since: Option<Instant>,
    /// Since when a position seemingly within reach is not reached.
    stuck_since: Option<Instant>,
    nudged: Option<Instant>,
}

impl Judge {
    pub fn new(timeout: Duration, now: Instant) -> Self {
        Self {
            timeout,
            started: now,
            unsent_since: None,
            stuck_since: None,
            nudged: None,
        }
    }

    /// The verdict on the last probe and what the decoder has seen at
    /// `now`, and whether the prober should nudge the WAL along.
    pub fn judge(&mut self, probe: Option<&Probe>, seen: Seen, now: Instant) -> (Verdict, bool) {
        let timeout = self.timeout;
        let Some(probe) = probe else {
            return if now.saturating_duration_since(self.started) > timeout {
                (
                    dead(format!(
                        "the primary's position could not be read in {timeout:?}"
                    )),
                    false,
                )
            } else {
                (Verdict::Unsure, false)
            };
        };
        let age = now.saturating_duration_since(probe.at);
        if age > timeout {
            return (
                dead(format!(
                    "the primary's position could not be read for {age:?}"
                )),
                false,
            );
        }
        if age > PROBE_FRESH {
            return (Verdict::Unsure, false);
        }
        if seen.applied >= probe.wal && !seen.open {
            self.unsent_since = None;
            self.stuck_since = None;
            return (Verdict::Level { age }, false);
        }
        let behind = Verdict::Behind {
            bytes: probe.wal.saturating_sub(seen.applied).max(1),
        };
        let Some(walsender) = probe.walsender else {
            return (
                dead("PostgreSQL shows no walsender for this session".into()),
                false,
            );
        };
        if !walsender.idle {
            // Decoding (a large transaction, another table's bulk write):
            // it reads statuses every half of its wal_sender_timeout.
            self.unsent_since = None;
            self.stuck_since = None;
            return match walsender.heard {
                Some(heard) if heard <= timeout => (behind, false),
                heard => (dead(unheard(heard)), false),
            };
        }
        match walsender.heard {
            Some(heard) if heard <= timeout / 2 => {}
            heard => return (dead(unheard(heard)), false),
        }
        if seen.waiting && walsender.sent > seen.received {
            let since = *self.unsent_since.get_or_insert(probe.at);
            let unsent = now.saturating_duration_since(since);
            if unsent > timeout / 2 {
                return (
                    dead(format!(
                        "PostgreSQL sent up to {}, which has not arrived in {unsent:?}",
                        pgwire_replication::Lsn(walsender.sent)
                    )),
                    false,
                );
            }
        } else {
            self.unsent_since = None;
        }
        // Everything sent is in, and the position is still ahead: the
        // flushed WAL ends before it (a record not flushed yet).
        let mut nudge = false;
        if walsender.sent <= seen.received && !seen.open {
            let since = *self.stuck_since.get_or_insert(probe.at);
            if now.saturating_duration_since(since) >= NUDGE_AFTER
                && self
                    .nudged
                    .is_none_or(|at| now.saturating_duration_since(at) >= NUDGE_EVERY)
            {
                self.nudged = Some(now);
                nudge = true;
            }
        } else {
            self.stuck_since = None;
        }
        (behind, nudge)
    }
}

fn dead(why: String) -> Verdict {
    Verdict::Dead(why)
}

fn unheard(heard: Option<Duration>) -> String {
    match heard {
        Some(heard) => format!("PostgreSQL has heard nothing from this decoder for {heard:?}"),
        None => "PostgreSQL has heard nothing from this decoder".into(),
    }
}

/// What the decoder of one session keeps to prove its beats.
pub(super) struct Session {
    /// Names the session in the stream's beats.
    pub id: u64,
    /// The prober's last answer.
    pub probes: watch::Receiver<Option<Probe>>,
    /// Asks the prober to nudge the WAL along.
    pub nudge: Arc<AtomicBool>,
    pub judge: Judge,
    /// When the last beat went (or was judged out).
    pub judged: Instant,
}

/// Asks the primary every PROBE_EVERY, on a connection of its own, and
/// keeps the last answer for the decoder.
pub(super) struct Prober {
    pub pool: PgPool,
    /// This session's `application_name`.
    pub session: String,
    /// Longest one question may take.
    pub timeout: Duration,
    /// Set by the decoder: commit an empty transaction before the next
    /// probe (see the module docs).
    pub nudge: Arc<AtomicBool>,
    pub probes: watch::Sender<Option<Probe>>,
}

impl Prober {
    pub async fn run(self) {
        let mut every = tokio::time::interval(PROBE_EVERY);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut heard = Heard::default();
        loop {
            every.tick().await;
            if self.nudge.swap(false, Ordering::SeqCst) {
                let nudged = tokio::time::timeout(self.timeout, nudge(&self.pool)).await;
                tracing::debug!(?nudged, "the decoder's position nudged along");
            }
            match tokio::time::timeout(self.timeout, probe(&self.pool, &self.session)).await {
                Ok(Ok((mut probe, reply))) => {
                    if let Some(walsender) = probe.walsender.as_mut() {
                        walsender.heard = heard.judge(reply, probe.at);
                    }
                    self.probes.send_replace(Some(probe));
                }
                Ok(Err(error)) => tracing::debug!(%error, "the decoder's probe failed"),
                Err(_) => {
                    tracing::debug!(timeout = ?self.timeout, "the decoder's probe went unanswered")
                }
            }
        }
    }
}

/// Commits an empty transaction that has a transaction id: a commit record,
/// flushed at once (locally: a synchronous standby is not waited for).
async fn nudge(pool: &PgPool) -> sqlx::Result<()> {
    sqlx::raw_sql(
        "begin; set local synchronous_commit = local; select pg_current_xact_id(); commit;",
    )
    .execute(pool)
    .await
    .map(drop)
}

/// One probe: the primary's insert position and this session's walsender
/// (its `heard` left for [`Heard`] to judge), and the walsender's last
/// status as PostgreSQL shows it.
async fn probe(pool: &PgPool, session: &str) -> sqlx::Result<(Probe, Option<Reply>)> {
    let at = Instant::now();
    let sent_at = SystemTime::now();
    let (wal, sent, reply_micros, wait_event): (i64, Option<i64>, Option<i64>, Option<String>) =
        sqlx::query_as(
            "select (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::bigint,
                    (r.sent_lsn - '0/0'::pg_lsn)::bigint,
                    (extract(epoch from r.reply_time) * 1000000)::bigint,
                    a.wait_event::text
             from (values (1)) as one (x)
             left join pg_stat_replication r on r.application_name = $1
             left join pg_stat_activity a on a.pid = r.pid
             limit 1",
        )
        .bind(session)
        .fetch_one(pool)
        .await?;
    let walsender = sent.map(|sent| Walsender {
        sent: u64::try_from(sent).unwrap_or(0),
        heard: None,
        idle: wait_event.as_deref().is_some_and(waits),
    });
    let reply = reply_micros
        .filter(|_| walsender.is_some())
        .map(|micros| Reply {
            micros,
            before: heard_before(sent_at, micros),
        });
    let probe = Probe {
        at,
        wal: u64::try_from(wal).unwrap_or(0),
        walsender,
    };
    Ok((probe, reply))
}

/// A walsender's last status from this decoder, as a probe read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Reply {
    /// Its `reply_time`: this process's wall clock when it sent the status
    /// (unix microseconds), which tells one status from the next.
    micros: i64,
    /// How long before the probe that was, on the wall clock (wrong by as
    /// much as the clock stepped meanwhile).
    before: Duration,
}

/// When the walsender last heard this decoder, on the monotonic clock: a
/// status is new when its `reply_time` differs from the one the last probe
/// read, and so was processed after that probe; from then on its age
/// grows with the monotonic clock, whatever the wall clock does.
#[derive(Debug, Default)]
struct Heard {
    /// The last status read, and when it was processed at the latest.
    last: Option<(i64, Instant)>,
    /// When the last probe that read a status was sent.
    probed: Option<Instant>,
}

impl Heard {
    /// How long before the probe sent `at` the walsender processed the
    /// last status it read of this decoder (`None`: none yet).
    fn judge(&mut self, reply: Option<Reply>, at: Instant) -> Option<Duration> {
        let Some(reply) = reply else {
            *self = Self::default();
            return None;
        };
        let previous = self.probed.replace(at);
        match self.last {
            Some((micros, heard_at)) if micros == reply.micros => {
                Some(at.saturating_duration_since(heard_at))
            }
            _ => {
                // New since the last probe: no older than that probe, and
                // the wall clock's word where it says less (it is the
                // whole estimate for the first one read).
                let before = previous.map_or(reply.before, |previous| {
                    reply.before.min(at.saturating_duration_since(previous))
                });
                let heard_at = at.checked_sub(before).unwrap_or(at);
                self.last = Some((reply.micros, heard_at));
                Some(at.saturating_duration_since(heard_at))
            }
        }
    }
}

/// How long before `at` the status sent at `micros` (unix microseconds, on
/// this process's clock, as it put them in the status) went out.
fn heard_before(at: SystemTime, micros: i64) -> Duration {
    let at = at
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64);
    Duration::from_micros(at.saturating_sub(micros).max(0) as u64)
}

/// Whether a walsender's wait event is a wait for WAL or for its client,
/// not work.
fn waits(event: &str) -> bool {
    matches!(
        event,
        "WalSenderWaitForWAL" | "WalSenderMain" | "WalSenderWriteData" | "ClientWrite"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const TIMEOUT: Duration = Duration::from_secs(4);

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn probe(at: Instant, wal: u64, walsender: Option<Walsender>) -> Probe {
        Probe { at, wal, walsender }
    }

    fn idle(sent: u64, heard: u64) -> Option<Walsender> {
        Some(Walsender {
            sent,
            heard: Some(ms(heard)),
            idle: true,
        })
    }

    fn seen(applied: u64, received: u64) -> Seen {
        Seen {
            applied,
            open: false,
            received,
            waiting: true,
        }
    }

    #[test]
    fn level_only_past_the_position_a_fresh_probe_read() {
        let t0 = Instant::now();
        let mut judge = Judge::new(TIMEOUT, t0);
        let p = probe(t0, 1000, idle(1000, 100));
        let (verdict, _) = judge.judge(Some(&p), seen(1000, 1000), t0 + ms(40));
        assert_eq!(verdict, Verdict::Level { age: ms(40) });
        // Something read but not applied: not level.
        let open = Seen {
            open: true,
            ..seen(1000, 1000)
        };
        assert_eq!(
            judge.judge(Some(&p), open, t0 + ms(40)).0,
            Verdict::Behind { bytes: 1 }
        );
        let (verdict, _) = judge.judge(Some(&p), seen(900, 1000), t0 + ms(40));
        assert_eq!(verdict, Verdict::Behind { bytes: 100 });
        // A probe too old proves nothing; older still, nothing is known.
        assert_eq!(
            judge.judge(Some(&p), seen(1000, 1000), t0 + ms(600)).0,
            Verdict::Unsure
        );
        assert!(matches!(
            judge.judge(Some(&p), seen(1000, 1000), t0 + ms(4100)).0,
            Verdict::Dead(_)
        ));
    }

    #[test]
    fn no_probe_is_unsure_then_dead() {
        let t0 = Instant::now();
        let mut judge = Judge::new(TIMEOUT, t0);
        assert_eq!(
            judge.judge(None, seen(0, 0), t0 + ms(100)).0,
            Verdict::Unsure
        );
        assert!(matches!(
            judge.judge(None, seen(0, 0), t0 + ms(4100)).0,
            Verdict::Dead(_)
        ));
    }

    #[test]
    fn a_walsender_that_waits_and_has_not_heard_this_decoder_is_dead() {
        let t0 = Instant::now();
        let mut judge = Judge::new(TIMEOUT, t0);
        // Heard 1.9 s ago: a silence not yet long enough.
        let p = probe(t0, 2000, idle(1000, 1900));
        assert!(matches!(
            judge.judge(Some(&p), seen(1000, 1000), t0).0,
            Verdict::Behind { .. }
        ));
        let p = probe(t0, 2000, idle(1000, 2100));
        assert!(matches!(
            judge.judge(Some(&p), seen(1000, 1000), t0).0,
            Verdict::Dead(why) if why.contains("heard nothing")
        ));
        // No walsender at all: the session is gone.
        let p = probe(t0, 2000, None);
        assert!(matches!(
            judge.judge(Some(&p), seen(1000, 1000), t0).0,
            Verdict::Dead(_)
        ));
    }

    #[test]
    fn a_walsender_that_decodes_is_alive_until_the_timeout() {
        let t0 = Instant::now();
        let mut judge = Judge::new(TIMEOUT, t0);
        let busy = |heard: u64| {
            Some(Walsender {
                sent: 1000,
                heard: Some(ms(heard)),
                idle: false,
            })
        };
        let p = probe(t0, 9_000_000, busy(3000));
        assert_eq!(
            judge.judge(Some(&p), seen(1000, 1000), t0).0,
            Verdict::Behind { bytes: 8_999_000 }
        );
        let p = probe(t0, 9_000_000, busy(4100));
        assert!(matches!(
            judge.judge(Some(&p), seen(1000, 1000), t0).0,
            Verdict::Dead(_)
        ));
    }

    #[test]
    fn what_was_sent_and_never_arrived_is_a_dead_connection() {
        let t0 = Instant::now();
        let mut judge = Judge::new(TIMEOUT, t0);
        // Sent to 1500, received to 1000, both sides waiting.
        for at in [0, 1000, 2000] {
            let p = probe(t0 + ms(at), 1500, idle(1500, 100));
            let (verdict, _) = judge.judge(Some(&p), seen(1000, 1000), t0 + ms(at));
            assert!(
                matches!(verdict, Verdict::Behind { .. }),
                "{at}: {verdict:?}"
            );
        }
        let p = probe(t0 + ms(2100), 1500, idle(1500, 100));
        assert!(matches!(
            judge.judge(Some(&p), seen(1000, 1000), t0 + ms(2100)).0,
            Verdict::Dead(why) if why.contains("has not arrived")
        ));
        // The decoder busy with what it has: not the connection's fault.
        let mut judge = Judge::new(TIMEOUT, t0);
        let busy = Seen {
            waiting: false,
            ..seen(1000, 1000)
        };
        for at in [0, 3000] {
            let p = probe(t0 + ms(at), 1500, idle(1500, 100));
            assert!(matches!(
                judge.judge(Some(&p), busy, t0 + ms(at)).0,
                Verdict::Behind { .. }
            ));
        }
    }

    #[test]
    fn a_position_inside_a_record_is_nudged_along_now_and_then() {
        let t0 = Instant::now();
        let mut judge = Judge::new(TIMEOUT, t0);
        // Everything sent arrived; the position is ahead of it.
        let at = |n: u64| {
            let p = probe(t0 + ms(n), 1200, idle(1000, 50));
            (p, t0 + ms(n))
        };
        let (p, now) = at(0);
        assert!(!judge.judge(Some(&p), seen(1000, 1000), now).1);
        let (p, now) = at(300);
        assert!(judge.judge(Some(&p), seen(1000, 1000), now).1);
        let (p, now) = at(400);
        assert!(!judge.judge(Some(&p), seen(1000, 1000), now).1);
        let (p, now) = at(1300);
        assert!(judge.judge(Some(&p), seen(1000, 1000), now).1);
        // Reached: the stall is over.
        let p = probe(t0 + ms(1400), 1200, idle(1200, 50));
        assert!(matches!(
            judge.judge(Some(&p), seen(1200, 1200), t0 + ms(1400)).0,
            Verdict::Level { .. }
        ));
    }

    fn reply(micros: i64, before: u64) -> Option<Reply> {
        Some(Reply {
            micros,
            before: ms(before),
        })
    }

    #[test]
    fn a_status_is_timed_from_the_probe_that_first_read_it_on_the_monotonic_clock() {
        let t0 = Instant::now();
        let mut heard = Heard::default();
        // The first one read: the wall clock's word.
        assert_eq!(heard.judge(reply(1_000, 150), t0), Some(ms(150)));
        // The same status, read again: older by the monotonic clock only.
        assert_eq!(heard.judge(reply(1_000, 250), t0 + ms(100)), Some(ms(250)));
        // A new one, which the wall clock says is 30 ms old.
        assert_eq!(heard.judge(reply(200_000, 30), t0 + ms(200)), Some(ms(30)));
        // The wall clock stepped 3 s ahead: the status the walsender holds
        // looks 3 s old to it, and is not (found: the decoder gave up the
        // slot; a change waited 163 ms, bound 100 ms).
        assert_eq!(
            heard.judge(reply(200_000, 3_130), t0 + ms(300)),
            Some(ms(130))
        );
        // The next status, stamped by the stepped clock: new since the last
        // probe, so no older than it, whatever the clock says.
        assert_eq!(
            heard.judge(reply(3_400_000, 5_000), t0 + ms(400)),
            Some(ms(100))
        );
        // The clock stepped 3 s back, and the connection went silent: the
        // status stamped before the step looks fresh to the wall clock
        // for 3 s, and ages on the monotonic clock all the same.
        assert_eq!(
            heard.judge(reply(3_400_000, 0), t0 + ms(500)),
            Some(ms(200))
        );
        assert_eq!(
            heard.judge(reply(3_400_000, 0), t0 + ms(2_600)),
            Some(ms(2_300))
        );
        // No walsender: forgotten.
        assert_eq!(heard.judge(None, t0 + ms(2_700)), None);
        assert_eq!(
            heard.judge(reply(3_400_000, 40), t0 + ms(2_800)),
            Some(ms(40))
        );
    }

    #[test]
    fn a_clock_step_is_not_a_silent_connection() {
        // The judge, fed by the probes: a walsender that waits, a status
        // every 200 ms, a probe every 100 ms, and the wall clock stepped
        // 2.1 s ahead at 1.1 s, between a status and the next.
        let t0 = Instant::now();
        let mut judge = Judge::new(TIMEOUT, t0);
        let mut wall_only = Judge::new(TIMEOUT, t0);
        let mut heard = Heard::default();
        let mut wall_only_dead = false;
        let wall = |at_ms: u64| at_ms as i64 * 1000 + if at_ms >= 1_100 { 2_100_000 } else { 0 };
        for tick in 0..40u64 {
            let at_ms = tick * 100;
            let at = t0 + ms(at_ms);
            let stamped = wall(at_ms / 200 * 200);
            let before = ms(((wall(at_ms) - stamped).max(0) / 1000) as u64);
            let walsender = |heard| {
                Some(Walsender {
                    sent: 1000,
                    heard: Some(heard),
                    idle: true,
                })
            };
            let judged = heard.judge(reply(stamped, before.as_millis() as u64), at);
            let p = probe(at, 2000, walsender(judged.unwrap()));
            let (verdict, _) = judge.judge(Some(&p), seen(1000, 1000), at);
            assert!(
                matches!(verdict, Verdict::Behind { .. }),
                "at {at_ms} ms: {verdict:?}"
            );
            // What the wall clock alone made of it.
            let p = probe(at, 2000, walsender(before));
            wall_only_dead |= matches!(
                wall_only.judge(Some(&p), seen(1000, 1000), at).0,
                Verdict::Dead(_)
            );
        }
        assert!(
            wall_only_dead,
            "the step must be one the wall clock misjudges"
        );
    }

    #[test]
    fn the_last_status_heard_is_timed_on_this_clock() {
        let at = UNIX_EPOCH + Duration::from_secs(1_000);
        assert_eq!(heard_before(at, 999_750_000), ms(250));
        // A status stamped after the probe (the clock stepped): heard now.
        assert_eq!(heard_before(at, 1_000_100_000), Duration::ZERO);
        assert!(waits("WalSenderWaitForWAL") && waits("WalSenderMain"));
        assert!(!waits("WALRead") && !waits("BufFileRead"));
    }
}
