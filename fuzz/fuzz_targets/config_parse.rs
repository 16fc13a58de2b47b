//! Router configs from arbitrary text: a clear error, or a config that routes without panicking.
#![no_main]

#[path = "common.rs"]
mod common;

use libfuzzer_sys::fuzz_target;
use moe_audit::{assign, Logits, RouterConfig};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok(config) = RouterConfig::from_toml(text, "fuzz.toml") else { return };
    if config.experts > 512 {
        return; // valid but too large to route quickly here
    }
    let logits = Logits::from_shape_fn((2, 8, config.experts), |(b, s, e)| ((b * 31 + s * 7 + e * 13) % 17) as f32 / 4.0 - 2.0);
    if let Ok(routing) = assign(&config, logits.view()) {
        common::check_routing(&routing, config.routed_scaling);
    }
    if let Ok(Some(inference)) = config.inference_config() {
        if let Ok(routing) = assign(&inference, logits.view()) {
            common::check_routing(&routing, inference.routed_scaling);
        }
    }
});
