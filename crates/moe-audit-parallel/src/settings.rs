//! The settings this crate owns, as messages name them
//! ([`Setting`]); a front end spells them (the command line as
//! flags).

use moe_audit_core::error::Setting;

/// Expert-parallel ranks.
pub const RANKS: Setting = Setting::new("ranks");
/// The largest bias a low-precision reduction may have.
pub const MAX_BIAS: Setting = Setting::new("max_bias");

/// Every setting of this crate.
pub const ALL: [Setting; 2] = [RANKS, MAX_BIAS];
