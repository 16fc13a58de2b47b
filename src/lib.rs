//! moe-audit: Mixture-of-Experts layers on candle, and an auditor for train/inference causality
//! leaks in MoE routers.
//!
//! The crate follows the data flow:
//! [`config`] (TOML, validated) → [`router`] (scores → assignment) → [`routing::Routing`] (the
//! record) → [`layer`] (dispatch → experts → combine).
#![warn(missing_docs)]

// The command line is compiled here (feature `cli`) so that the binary and the Python
// extension run the same code; its files name this crate as `moe_audit::`, as a binary would.
extern crate self as moe_audit;

pub mod analyze;
#[cfg(feature = "cli")]
mod cli;
#[cfg(feature = "cli")]
#[doc(hidden)]
pub mod command;
pub mod config;
pub mod error;
pub mod exploit;
pub mod external;
pub mod files;
mod font;
pub mod layer;
pub mod memory;
pub mod model;
pub mod names;
pub mod parallel;
pub mod progress;
pub mod render;
pub mod router;
pub mod routes;
pub mod routing;
#[cfg(feature = "cli")]
mod runtime;
pub mod seeds;
pub mod sizes;
pub mod snapshot;
pub mod sweep;

pub use config::RouterConfig;
pub use error::{Error, Result};
pub use memory::MemoryBudget;
pub use router::{ConfigRouter, Router};
pub use routing::{assign, assign_masked, Logits, Routing};
pub use sizes::RunSizes;
pub use snapshot::snapshot;
