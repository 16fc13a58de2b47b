//! The settings this crate owns, as messages name them
//! ([`Setting`]); a front end spells them (the command line as
//! flags).

use moe_audit_core::error::Setting;

/// Random cases per probe.
pub const TRIALS: Setting = Setting::new("trials");
/// The probes an audit runs.
pub const PROBES: Setting = Setting::new("probes");
/// How long an external router may take to answer.
pub const TIMEOUT: Setting = Setting::new("timeout");
/// The command of an external router.
pub const ROUTER_CMD: Setting = Setting::new("router_cmd");
/// The command of another launch of the same layer (replicas, other ranks).
pub const LAYOUT_CMD: Setting = Setting::new("layout_cmd");
/// Rewriting a snapshot in place.
pub const UPDATE: Setting = Setting::new("update");
/// Trace files answered by a harness.
pub const TRACES: Setting = Setting::new("traces");
/// Writing a harness's inputs instead of a snapshot.
pub const PLAN: Setting = Setting::new("plan");
/// A file of logit rows.
pub const LOGITS: Setting = Setting::new("logits");
/// A file of hidden-state rows.
pub const HIDDEN_STATES: Setting = Setting::new("hidden_states");
/// Vocabulary size of the exploit decoder.
pub const VOCAB: Setting = Setting::new("vocab");
/// Training steps.
pub const STEPS: Setting = Setting::new("steps");
/// Independent training runs.
pub const SEEDS: Setting = Setting::new("seeds");
/// Peak learning rate.
pub const LR: Setting = Setting::new("lr");
/// Held-out evaluation batches.
pub const EVAL_BATCHES: Setting = Setting::new("eval_batches");
/// Points on the learning curve.
pub const CURVE_POINTS: Setting = Setting::new("curve_points");
/// Batches of the untrained probe.
pub const PROBE_BATCHES: Setting = Setting::new("probe_batches");
/// The mode the audited calls are made in (training or inference).
pub const MODE: Setting = Setting::new("mode");
/// Where witnesses are written.
pub const WITNESS_DIR: Setting = Setting::new("witness_dir");
/// The output file.
pub const OUTPUT: Setting = Setting::new("output");

/// Every setting of this crate.
pub const ALL: [Setting; 20] = [
    TRIALS,
    PROBES,
    TIMEOUT,
    ROUTER_CMD,
    LAYOUT_CMD,
    UPDATE,
    TRACES,
    PLAN,
    LOGITS,
    HIDDEN_STATES,
    VOCAB,
    STEPS,
    SEEDS,
    LR,
    EVAL_BATCHES,
    CURVE_POINTS,
    PROBE_BATCHES,
    MODE,
    WITNESS_DIR,
    OUTPUT,
];
