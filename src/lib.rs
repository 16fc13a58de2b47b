//! moe-audit: Mixture-of-Experts layers on candle, and an auditor for train/inference causality
//! leaks in MoE routers.
//!
//! This crate is the `moe-audit` binary's (the command line, its rendering, progress bars and
//! fonts). Its library target gathers the workspace's crates under one name, so that a user
//! depends on `moe-audit` alone, and holds the command line as a function for the Python
//! wheel's `moe-audit` ([`command`]):
//! - `moe-audit-core`: [`config`], [`router`], [`routing`], [`layer`], [`error`], [`files`],
//!   [`memory`], [`names`];
//! - `moe-audit-parallel`: [`parallel`] (expert parallelism, all-reduce in low precision);
//! - `moe-audit-records`: [`records`] (rollout and trainer routing records);
//! - `moe-audit-engine`: [`engine`] (a live vLLM or SGLang server's routing audited);
//! - `moe-audit-auditor`: [`analyze`], [`check`](mod@check), [`external`], [`model`], [`snapshot`](mod@snapshot), [`sweep`],
//!   [`exploit`], [`progress`], [`seeds`], [`sizes`].
#![warn(missing_docs)]

// The command line's files name this crate as `moe_audit::`, as a binary would.
extern crate self as moe_audit;

mod cli;
#[doc(hidden)]
pub mod command;
mod font;
mod render;
mod runtime;

pub use moe_audit_auditor::{analyze, check, exploit, external, model, progress, seeds, sizes, snapshot, sweep};
pub use moe_audit_core::text;
pub use moe_audit_core::{config, error, files, layer, memory, names, router, routing};
pub use moe_audit_engine as engine;
pub use moe_audit_parallel as parallel;

/// Every setting a message may name, from the crate that owns each
/// ([`Setting`](error::Setting); the command line spells them as its flags).
pub mod settings {
    pub use moe_audit_auditor::settings::{
        CURVE_POINTS, EVAL_BATCHES, HIDDEN_STATES, LAYOUT_CMD, LOGITS, LR, MODE, OUTPUT, PLAN, PROBES, PROBE_BATCHES,
        ROUTER_CMD, SEEDS, STEPS, TIMEOUT, TRACES, TRIALS, UPDATE, VOCAB, WITNESS_DIR,
    };
    pub use moe_audit_core::settings::{BATCH, FFN, HIDDEN, MAX_MEMORY, SEQ_LEN};
    pub use moe_audit_parallel::settings::{MAX_BIAS, RANKS};
    pub use moe_audit_records::settings::{CONFIG, MAX_DISAGREEMENT};

    /// Every setting of every crate.
    pub fn all() -> impl Iterator<Item = crate::error::Setting> {
        [
            &moe_audit_core::settings::ALL[..],
            &moe_audit_parallel::settings::ALL[..],
            &moe_audit_records::settings::ALL[..],
            &moe_audit_auditor::settings::ALL[..],
        ]
        .into_iter()
        .flatten()
        .copied()
    }
}
pub use moe_audit_records as records;
/// The routing records of RL runs, by the name of the command and the Python module (`routes`);
/// `records` is the crate's name and stays.
pub use moe_audit_records as routes;

pub use moe_audit_auditor::RunSizes;
pub use moe_audit_core::{
    assign, assign_masked, ConfigRouter, Error, Logits, MemoryBudget, Result, Router, RouterConfig, Routing,
};
