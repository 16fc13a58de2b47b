//! moe-audit-auditor: causality audits of MoE routers and whole models.
//!
//! [`check`] audits routers of every kind ([`check::Target`]) into one report; [`analyze`] runs the probes on a router and shrinks each leak to a minimal, replayable
//! [`analyze::Witness`]; [`external`] runs a router in another process (your PyTorch code) or
//! from trace files; [`model`] audits whole decoders layer by layer; [`snapshot`](mod@snapshot) records and
//! checks a router's decisions on fixed inputs; [`sweep`] compares load balance against
//! causality over a grid of routers; [`exploit`] trains a tiny decoder through a router to show
//! a leak is learnable. Routers and layers come from `moe-audit-core`, expert parallelism from
//! `moe-audit-parallel`.
#![warn(missing_docs)]

pub mod analyze;
pub mod check;
pub mod exploit;
pub mod external;
mod hints;
mod mode;
pub mod model;
pub mod progress;
pub mod seeds;
pub mod settings;
pub mod sizes;
pub mod snapshot;
pub mod sweep;

pub use sizes::RunSizes;
pub use snapshot::snapshot;
