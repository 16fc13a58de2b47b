//! Assignment on arbitrary score matrices (NaN, ±inf, subnormals, huge values) for every preset:
//! an error or a routing whose invariants hold, never a panic; the routes-only assignment the
//! analyzer uses gives the same routes.
#![no_main]

#[path = "common.rs"]
mod common;

use libfuzzer_sys::fuzz_target;
use moe_audit::config::presets;
use moe_audit::routing::assign_routes;
use moe_audit::{assign, Logits, Routing};

fuzz_target!(|data: &[u8]| {
    let [which, batch, seq, rest @ ..] = data else { return };
    let all = presets();
    let config = all[*which as usize % all.len()].config().expect("presets are valid");
    let (b, s, e) = (1 + *batch as usize % 4, 1 + *seq as usize % 24, config.experts);
    // Each logit from 4 bytes, so every f32 bit pattern occurs; short inputs repeat.
    let values: Vec<f32> = rest.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    if values.is_empty() {
        return;
    }
    let logits = Logits::from_shape_fn((b, s, e), |(i, j, k)| values[(i * s * e + j * e + k) % values.len()]);
    let routes = assign_routes(&config, logits.view(), None);
    match assign(&config, logits.view()) {
        Ok(routing) => {
            assert!(logits.iter().all(|v| v.is_finite()), "non-finite scores must be rejected");
            common::check_routing(&routing, config.routed_scaling);
            assert_eq!(Routing { stats: routing.stats, ..routes.expect("assign succeeded") }, routing);
        }
        Err(e) => assert_eq!(routes.expect_err("assign failed").to_string(), e.to_string()),
    }
});
