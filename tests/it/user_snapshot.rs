//! The snapshot test a user copies into their own crate (docs/SNAPSHOTS.md):
//! route fixed inputs, snapshot the whole record with `moe_audit::snapshot`. Any change of an
//! expert, its order, a kept flag, a weight (4 decimals) or the capacity fails the test.

use moe_audit::{snapshot, Router, RouterConfig};
use ndarray::Array3;

/// Fixed logits that make experts compete: tokens 2 and 3 want the same expert as token 0.
fn logits() -> Array3<f32> {
    let rows = [[2.0, 1.0, 0.0, 0.0], [0.0, 2.0, 1.0, 0.0], [3.0, 0.0, 0.0, 1.0], [4.0, 0.0, 1.0, 0.0]];
    Array3::from_shape_fn((1, 4, 8), |(_, t, e)| rows[t].get(e).copied().unwrap_or(-1.0))
}

#[test]
fn megatron_probs_routing_snapshot() {
    let config = RouterConfig::load("megatron-probs").unwrap();
    let routing = moe_audit::assign(&config, logits().view()).unwrap();
    insta::assert_snapshot!(snapshot(&routing));
}

#[test]
fn snapshot_through_the_router_trait() {
    // Any `Router` (a built-in one here; yours in your crate) snapshots the same way.
    let router: &dyn Router = &moe_audit::layer::MoeLayer::seeded(
        RouterConfig::load("mixtral").unwrap(),
        8,
        8,
        0,
        candle_core::DType::F32,
        &candle_core::Device::Cpu,
    )
    .unwrap()
    .router()
    .clone();
    insta::assert_snapshot!(snapshot(&router.assign(logits().view()).unwrap()));
}
