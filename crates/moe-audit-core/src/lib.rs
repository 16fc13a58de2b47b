//! moe-audit-core: Mixture-of-Experts routing and layers on candle.
//!
//! The crate follows the data flow:
//! [`config`] (TOML, validated) → [`router`] (scores → assignment) → [`routing::Routing`] (the
//! record) → [`layer`] (dispatch → experts → combine). [`error`] is the one error type of every
//! moe-audit crate; [`files`] and [`memory`] bound what is read, written and allocated.
#![warn(missing_docs)]

pub mod config;
pub mod error;
pub mod files;
pub mod layer;
pub mod memory;
pub mod names;
pub mod router;
pub mod routing;
pub mod settings;

pub use config::RouterConfig;
pub use error::{Error, Result};
pub use memory::MemoryBudget;
pub use router::{ConfigRouter, Router};
pub use routing::{assign, assign_masked, Logits, Routing};
