//! The protocol: a request's first look in Redis, which claims the item
//! if nobody has stored it (`RedisCommands::look_up_or_claim`: a miss and
//! its election in one command), and the claim it won on its way to the
//! key's flight (won.rs).
//!
//! A claim that no flight takes is let go, token-checked, with `retry`
//! published, so that a flight waiting on it elects again at once instead
//! of sleeping until LOCK_TTL: its request went away, found its item
//! guarded, or joined a flight that was past its election (one waiting on
//! a claim that a change or an expiry has taken away since, and that looked
//! again before this claim was put here).

use std::sync::Arc;

use super::{
    context::Context,
    leader::lock_token,
    letgo::{abandon_in_background, Attempt},
    source::Source,
};
use crate::{
    cache::{claim_of, Entry, ItemKeys},
    redis::{FirstLook, OnWon, RedisError},
};

/// One request's claim at its first look, until a flight takes it.
/// Dropped while its claim is still in [`WonClaims`](super::won::WonClaims) (not taken), it lets
/// go of it (see the module's comment).
pub(super) struct Won<S: Source> {
    ctx: Arc<Context<S>>,
    key: S::Key,
    token: String,
    /// The value key and the ready channel.
    value: String,
    channel: String,
    /// Whether the claim may be in [`WonClaims`](super::won::WonClaims): the first look won it, or
    /// its reply never came (its hook may have run).
    armed: bool,
}

impl<S: Source> Won<S> {
    /// The claim about to be tried with `token` at `key`'s first look.
    pub fn new(ctx: &Arc<Context<S>>, key: &S::Key, keys: &ItemKeys, token: String) -> Self {
        Self {
            ctx: ctx.clone(),
            key: key.clone(),
            token,
            value: keys.value.clone(),
            channel: keys.channel.clone(),
            armed: true,
        }
    }

    pub fn token(&self) -> &str {
        &self.token
    }

    /// The first look did not win it: nothing to let go of.
    pub fn disarm(&mut self) {
        self.armed = false;
    }
}

impl<S: Source> Drop for Won<S> {
    fn drop(&mut self) {
        if !self.armed || !self.ctx.won.take_if(&self.key, &self.token) {
            return;
        }
        tracing::debug!(
            key = self.value,
            "a claim won at a first look that no flight took; letting it go"
        );
        abandon_in_background(
            &self.ctx,
            std::mem::take(&mut self.value),
            std::mem::take(&mut self.channel),
            claim_of(&self.token),
        );
    }
}

/// A request's first look at `key`, which claims it for its flight if
/// nobody has stored it (see `RedisCommands::look_up_or_claim`), under
/// the same guard as [`claim`](super::leader::claim); `Some(won)` with the entry when claimed,
/// its token put where a flight's election takes it (see the module's comment).
pub(super) async fn look_up_or_claim<S: Source>(
    ctx: &Arc<Context<S>>,
    key: &S::Key,
    keys: &ItemKeys,
) -> Result<(Option<Entry>, Option<Box<Won<S>>>), RedisError> {
    let mut won = Won::new(ctx, key, keys, lock_token());
    let claim = claim_of(won.token());
    let on_won: OnWon = {
        let (claims, key, token) = (ctx.won.clone(), key.clone(), won.token().to_owned());
        Box::new(move || claims.put(key, token))
    };
    let mut attempt = Attempt {
        ctx,
        lock: &keys.value,
        channel: &keys.channel,
        token: &claim,
        answered: false,
    };
    let result = ctx
        .redis
        .look_up_or_claim(keys, &claim, ctx.settings.lock_ttl, on_won)
        .await;
    attempt.answered = matches!(result, Ok(_) | Err(RedisError::CircuitOpen));
    match result {
        Ok(FirstLook::Claimed) => Ok((None, Some(Box::new(won)))),
        Ok(FirstLook::Looked(entry)) => {
            won.disarm();
            Ok((entry, None))
        }
        Err(error) => {
            if matches!(error, RedisError::CircuitOpen) {
                won.disarm();
            }
            Err(error)
        }
    }
}
