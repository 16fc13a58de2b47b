//! Protocol messages (`moe-audit/1`) from arbitrary text: a handshake line, then a response
//! line. A clear error, or a routing record that names only valid experts and finite weights;
//! never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use moe_audit::external::protocol::parse_response;
use moe_audit::external::Handshake;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Some((first, second)) = text.split_once('\n') else { return };
    let Ok(handshake) = serde_json::from_str::<Handshake>(first) else { return };
    if handshake.validate().is_err() {
        return;
    }
    let Ok(response) = parse_response(second) else { return };
    // Ask for exactly what the response answers, so the checks past the shape run too.
    let request = (response.id, 1, response.tokens.len());
    if let Ok(routing) = response.into_routing(&handshake, request, None) {
        for route in routing.tokens.iter().flat_map(|t| &t.routes) {
            assert!(route.expert < routing.experts && route.weight.is_finite());
        }
    }
});
