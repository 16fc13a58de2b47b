//! Witnesses: the smallest input pair found that still shows a leak, saved as a file that
//! replays from itself alone (`moe-audit replay witness.json`).
//!
//! This file is the witness file format: the two calls, the token, what changed, sealed by a
//! sha256 of the content that a replay checks before it routes. Building and shrinking a witness
//! (`shrink.rs`) and replaying one (`replay.rs`) are kept apart, so the format a user's file must
//! keep reading stays in one place whatever the search for a small witness becomes.
//!
//! A router outside moe-audit (a subprocess, trace files) has no config to replay from: its
//! witness keeps the two calls as the audit sent them, unshrunk (shrinking would call the router
//! again, and change what a stateful router answers the probes after it), with its handshake,
//! and replays against the live router (`replay W --router-cmd CMD`). A leak of L across two
//! launches of one layer (`check --layout-cmd`) also records the launch that routed call `b`,
//! its command and handshake; its replay spawns both (`replay W --router-cmd CMD --layout-cmd
//! CMD2`): a witness is data, and the command it records is named, never run.

mod replay;
mod shrink;

pub(crate) use replay::Replayer;
#[allow(deprecated)]
pub use replay::{Replay, ReplayOutcome};
pub(crate) use shrink::{build, build_routed};

use super::case::Call;
use super::{Probe, Property};
use crate::hints::HintsOf;
use crate::mode::Mode;
use moe_audit_core::config::RouterConfig;
use moe_audit_core::error::{excerpt, Error, Result};
use moe_audit_core::routing::{Logits, TokenRouting};
use moe_audit_core::text;
use moe_audit_core::MemoryBudget;
use ndarray::Array2;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The witness file format tag.
pub const FORMAT: &str = "moe-audit-witness/2";
/// The format before the content hash: such a witness cannot be checked, so it is refused.
const FORMAT_UNSEALED: &str = "moe-audit-witness/1";

/// One call as stored in a witness.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoredCall {
    /// Sequences.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// `batch*seq_len` rows of logits (hidden states for an external router fed hidden
    /// states), sequence-major.
    pub logits: Vec<Vec<f32>>,
    /// `batch` rows of `seq_len` flags (`true` = padding), when the call has a mask.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub padding: Option<Vec<Vec<bool>>>,
    /// The rank of each sequence, when the call placed them (a layer over ranks; a replay sends
    /// it again).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement: Option<Vec<usize>>,
}

/// Another launch of a layer as a witness records it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoredLaunch {
    /// The command that started it (`replay --layout-cmd` takes it; a replay never runs it
    /// from the file).
    pub command: String,
    /// Its handshake, which the replayed launch must match.
    pub handshake: serde_json::Value,
}

/// A token of a stored call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenRef {
    /// Sequence.
    pub batch: usize,
    /// Position.
    pub pos: usize,
}

/// A minimal, replayable leak: token `token_a` of call `a` and token `token_b` of call `b` must
/// route alike, and do not.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Witness {
    /// Always [`FORMAT`].
    pub format: String,
    /// The router, complete (its `[inference]` table included); absent for a router outside
    /// moe-audit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub router: Option<RouterConfig>,
    /// The handshake of a router outside moe-audit, which replays against the live router.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handshake: Option<serde_json::Value>,
    /// The mode call `a` is routed in (S: the same call around a call of the other mode).
    #[serde(default, skip_serializing_if = "Mode::is_train")]
    pub a_mode: Mode,
    /// The mode call `b` is routed in.
    #[serde(default, skip_serializing_if = "Mode::is_train")]
    pub b_mode: Mode,
    /// The probe that found it.
    pub probe: Probe,
    /// The property broken.
    pub property: Property,
    /// What differs, e.g. `kept, weight`.
    pub differs: String,
    /// L across launches: the other launch of the layer that routed call `b` (call `a` was
    /// routed by the router of `handshake`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layout: Option<StoredLaunch>,
    /// The reference call. For S, `b` is the call made in between; for D and M, `b` is unused.
    pub a: StoredCall,
    /// The changed call.
    pub b: StoredCall,
    /// The token in `a`.
    pub token_a: TokenRef,
    /// The same token in `b`.
    pub token_b: TokenRef,
    /// Its routing in the reference run.
    pub before: TokenRouting,
    /// Its routing in the changed run.
    pub after: TokenRouting,
    /// Hex sha256 of every other field as written (compact JSON): a replay refuses a witness
    /// whose content no longer matches, so an edited witness cannot pass as "fixed". It guards
    /// against edits and corruption, not against someone who recomputes it.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub sha256: String,
}

fn store(call: &Call) -> StoredCall {
    let (batch, seq_len) = call.dims();
    StoredCall {
        batch,
        seq_len,
        logits: call.logits.rows().into_iter().map(|r| r.to_vec()).collect(),
        padding: call.padding.as_ref().map(|m| m.rows().into_iter().map(|r| r.to_vec()).collect()),
        placement: call.placement.clone(),
    }
}

fn load(call: &StoredCall, name: &str, path: &Path) -> Result<Call> {
    let experts = call.logits.first().map_or(0, Vec::len);
    let Some(rows) = call.batch.checked_mul(call.seq_len) else {
        return Err(Error::input(
            path,
            format!("call `{name}`: batch {} x seq_len {} overflows", call.batch, call.seq_len),
        ));
    };
    if rows != call.logits.len() || call.logits.iter().any(|r| r.len() != experts) || experts == 0 {
        return Err(Error::input(path, format!("call `{name}`: expected {rows} rows of equal length")));
    }
    let logits = Logits::from_shape_vec((call.batch, call.seq_len, experts), call.logits.concat()).expect("checked");
    let padding = match &call.padding {
        Some(rows) if rows.len() != call.batch || rows.iter().any(|r| r.len() != call.seq_len) => {
            return Err(Error::input(
                path,
                format!("call `{name}`: padding must be {} rows of {} flags", call.batch, call.seq_len),
            ))
        }
        Some(rows) => Some(Array2::from_shape_vec((call.batch, call.seq_len), rows.concat()).expect("checked")),
        None => None,
    };
    if call.placement.as_ref().is_some_and(|p| p.len() != call.batch) {
        return Err(Error::input(path, format!("call `{name}`: placement must name {} ranks", call.batch)));
    }
    Ok(Call { logits, padding, placement: call.placement.clone() })
}

impl Witness {
    /// Reads a witness file (at most a quarter of the default memory limit).
    pub fn read(path: &Path) -> Result<Witness> {
        Self::read_within(path, MemoryBudget::from_request(None))
    }

    /// Reads a witness file under the memory limit `budget`: the text, and the values parsed
    /// from it (about four times the text), must fit.
    pub(crate) fn read_within(path: &Path, budget: MemoryBudget) -> Result<Witness> {
        let text = moe_audit_core::files::read_text_within(path, budget)?;
        Self::parse(&text, path)
    }

    /// Parses and validates a witness; `path` names it in errors.
    pub fn parse(text: &str, path: &Path) -> Result<Witness> {
        let w: Witness = serde_json::from_str(text).map_err(|e| Error::parse(path, "not a witness", e))?;
        if w.format == FORMAT_UNSEALED {
            return Err(Error::input(
                path,
                text!(
                    format!("format `{FORMAT_UNSEALED}` has no content hash to check: write the witness again with "),
                    crate::settings::WITNESS_DIR
                ),
            ));
        }
        if w.format != FORMAT {
            return Err(Error::input(path, format!("format `{}` is not `{FORMAT}`", excerpt(&w.format))));
        }
        w.probe.check_router().map_err(|m| Error::input(path, m))?;
        if w.sha256.is_empty() {
            return Err(Error::input(path, "no `sha256` content hash to check".to_string()));
        }
        match (&w.router, &w.handshake) {
            (Some(router), None) => {
                router.validate().map_err(|e| e.within("router").in_config(&path.display().to_string()))?
            }
            (None, Some(_)) if w.experts().is_some() && w.name().is_some() => {}
            (None, Some(_)) => {
                return Err(Error::input(path, "`handshake` needs a `name` and a number of `experts` of at least 1"))
            }
            _ => return Err(Error::input(path, "a witness holds either a `router` config or a `handshake`")),
        }
        if let Some(launch) = &w.layout {
            let named = launch.handshake.get("name").is_some_and(|n| n.is_string());
            if w.handshake.is_none() || w.probe != Probe::L || !named {
                return Err(Error::input(
                    path,
                    "`layout` belongs to a layout (L) witness of a router outside moe-audit, with a named `handshake`",
                ));
            }
        }
        w.check_stored_routings().map_err(|m| Error::input(path, m))?;
        Ok(w)
    }

    /// This witness with call `b` routed by `launch` (L across launches), sealed again.
    pub(crate) fn across(mut self, launch: &crate::analyze::Launch) -> Result<Witness> {
        let handshake = launch.router.handshake().unwrap_or_default();
        self.layout = Some(StoredLaunch { command: launch.command.to_string(), handshake });
        self.seal()?;
        Ok(self)
    }

    /// The stored routings are what the witness claims: on valid experts, and different (a
    /// capacity difference aside, which lives in the group, not the token).
    fn check_stored_routings(&self) -> std::result::Result<(), String> {
        let experts = self.experts().expect("checked");
        for (name, t) in [("before", &self.before), ("after", &self.after)] {
            let mut seen = vec![false; experts];
            for r in &t.routes {
                if r.expert >= experts || std::mem::replace(&mut seen[r.expert], true) {
                    return Err(format!(
                        "`{name}` routes to expert {} twice or out of range 0 to {}",
                        r.expert,
                        experts.saturating_sub(1)
                    ));
                }
            }
        }
        // A capacity or an output row lives outside the token's routes.
        let beside = ["capacity", "output"].iter().any(|d| self.differs.contains(d));
        if self.before.routes == self.after.routes && !beside {
            return Err(format!(
                "`before` and `after` route alike, yet the witness says `{}` differ: not a leak (was it edited?)",
                excerpt(&self.differs)
            ));
        }
        Ok(())
    }

    /// Sets [`Witness::sha256`] from the content.
    pub fn seal(&mut self) -> Result<()> {
        self.sha256.clear();
        self.sha256 = self.content_hash()?;
        Ok(())
    }

    /// Hex sha256 of the compact JSON of the witness, its `sha256` field left out (empty fields
    /// are not written). Floats write in their shortest round-trip form, so a witness read back
    /// from a file hashes as it did when written.
    fn content_hash(&self) -> Result<String> {
        use sha2::{Digest, Sha256};
        debug_assert!(self.sha256.is_empty(), "the hash covers every field but itself");
        let mut hasher = Sha256::new();
        serde_json::to_writer(&mut hasher, self).map_err(|e| Error::system("cannot hash a witness", e))?;
        Ok(hasher.finalize().iter().map(|b| format!("{b:02x}")).collect())
    }

    /// The router's name (its config's, or its handshake's).
    pub fn name(&self) -> Option<&str> {
        match (&self.router, &self.handshake) {
            (Some(router), _) => Some(&router.name),
            (None, Some(h)) => h.get("name").and_then(|n| n.as_str()),
            (None, None) => None,
        }
    }

    /// The router's number of experts (its config's, or its handshake's).
    fn experts(&self) -> Option<usize> {
        match (&self.router, &self.handshake) {
            (Some(router), _) => Some(router.experts),
            (None, Some(h)) => h.get("experts").and_then(|e| e.as_u64()).and_then(|e| usize::try_from(e).ok()),
            (None, None) => None,
        }
        .filter(|&e| e > 0)
    }
}
