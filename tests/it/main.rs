//! Behaviour tests, one file per feature area, in one integration binary.

mod analyze;
mod cli;
mod hand_computed;
mod invariants;
mod layer;
mod routers;
mod snapshots;
mod sweep;
