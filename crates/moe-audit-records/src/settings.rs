//! The settings this crate owns, as messages name them
//! ([`Setting`]); a front end spells them (the command line as
//! flags, Python as keyword arguments).

use moe_audit_core::error::Setting;

/// The model's `config.json`, which says the layers, top-k and pipeline split of a record.
pub const CONFIG: Setting = Setting::new("config");
/// The share of routing decisions two records may disagree on.
pub const MAX_DISAGREEMENT: Setting = Setting::new("max_disagreement");

/// Every setting of this crate.
pub const ALL: [Setting; 2] = [CONFIG, MAX_DISAGREEMENT];
