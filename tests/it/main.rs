//! Behaviour tests, one file per feature area, in one integration binary.

mod analyze;
mod cli;
mod collectives;
mod edge_cases;
mod exploit;
mod external;
mod faults;
mod hand_computed;
mod html;
mod invariants;
mod layer;
mod model;
mod noise;
mod parallel;
mod progress;
mod protocol2;
mod readme;
mod routers;
mod routes;
mod routes_writers;
mod search;
mod security;
mod snapshot_cli;
mod snapshots;
mod sweep;
mod user_snapshot;
