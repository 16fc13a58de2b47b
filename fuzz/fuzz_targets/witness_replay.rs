//! Witness files from arbitrary text: a clear error, or a replay, never a panic. A witness that
//! parses is replayed as read (its content hash almost never matches: the refusal path), then
//! sealed again so that the replay itself is fuzzed too.
#![no_main]

use libfuzzer_sys::fuzz_target;
use moe_audit::analyze::Witness;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let path = Path::new("fuzz-witness.json");
    if let Ok(mut witness) = Witness::parse(text, path) {
        let _ = witness.clone().replay(path);
        if witness.seal().is_ok() {
            let _ = witness.replay(path);
        }
    }
});
