//! The Redis side: the registry of scripts, each made once and loaded on
//! every connection (`loading.rs`).

use fred::types::scripts::Script;

use super::{apply, claim, cutoff, finish, lock, lua::ScriptName};

/// The scripts, loaded on every connection.
#[derive(Clone)]
pub struct Scripts {
    claim: Script,
    claim_many: Script,
    finish: Script,
    finish_many: Script,
    release: Script,
    abandon: Script,
    extend: Script,
    apply_many: Script,
    raise_cutoff: Script,
}

impl Scripts {
    pub fn new() -> Self {
        Self {
            claim: Script::from_lua(claim::lua()),
            claim_many: Script::from_lua(claim::many_lua()),
            finish: Script::from_lua(finish::lua()),
            finish_many: Script::from_lua(finish::many_lua()),
            release: Script::from_lua(lock::release_lua()),
            abandon: Script::from_lua(lock::abandon_lua()),
            extend: Script::from_lua(lock::extend_lua()),
            apply_many: Script::from_lua(apply::lua()),
            raise_cutoff: Script::from_lua(cutoff::lua()),
        }
    }

    /// The script of `name`.
    pub fn get(&self, name: ScriptName) -> &Script {
        match name {
            ScriptName::Claim => &self.claim,
            ScriptName::ClaimMany => &self.claim_many,
            ScriptName::Finish => &self.finish,
            ScriptName::FinishMany => &self.finish_many,
            ScriptName::Release => &self.release,
            ScriptName::Abandon => &self.abandon,
            ScriptName::Extend => &self.extend,
            ScriptName::ApplyMany => &self.apply_many,
            ScriptName::RaiseCutoff => &self.raise_cutoff,
        }
    }

    pub(super) fn all(&self) -> [&Script; 9] {
        [
            &self.claim,
            &self.claim_many,
            &self.finish,
            &self.finish_many,
            &self.release,
            &self.abandon,
            &self.extend,
            &self.apply_many,
            &self.raise_cutoff,
        ]
    }
}

impl Default for Scripts {
    fn default() -> Self {
        Self::new()
    }
}
