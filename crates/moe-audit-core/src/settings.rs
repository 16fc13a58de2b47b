//! The settings this crate owns, as messages name them ([`Setting`]); a front end spells them
//! (the command line as flags).

use crate::error::Setting;

/// Sequences per call.
pub const BATCH: Setting = Setting::new("batch");
/// Tokens per sequence.
pub const SEQ_LEN: Setting = Setting::new("seq_len");
/// Hidden size.
pub const HIDDEN: Setting = Setting::new("hidden");
/// Expert FFN size.
pub const FFN: Setting = Setting::new("ffn");
/// The memory limit.
pub const MAX_MEMORY: Setting = Setting::new("max_memory");

/// Every setting of this crate.
pub const ALL: [Setting; 5] = [BATCH, SEQ_LEN, HIDDEN, FFN, MAX_MEMORY];
