//! Witness files from arbitrary text: a clear error, or a replay, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use moe_audit::analyze::Witness;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let path = Path::new("fuzz-witness.json");
    if let Ok(witness) = Witness::parse(text, path) {
        let _ = witness.replay(path);
    }
});
