//! Protocol messages from arbitrary bytes: a handshake line, then a response: a JSON line
//! (`moe-audit/1`, or `/2` without binary responses) or a `/2` binary header line and its
//! payload. A clear error, or a routing record that names only valid experts and finite
//! weights; never a panic, never an allocation the header alone asks for.
#![no_main]

use libfuzzer_sys::fuzz_target;
use moe_audit::external::protocol::{parse_response, Asked, BinaryHeader};
use moe_audit::external::Handshake;

fuzz_target!(|data: &[u8]| {
    let Some(end) = data.iter().position(|&b| b == b'\n') else { return };
    let Ok(first) = std::str::from_utf8(&data[..end]) else { return };
    let Ok(handshake) = serde_json::from_str::<Handshake>(first) else { return };
    if handshake.validate().is_err() {
        return;
    }
    let rest = &data[end + 1..];
    let end = rest.iter().position(|&b| b == b'\n').unwrap_or(rest.len());
    let Ok(second) = std::str::from_utf8(&rest[..end]) else { return };
    let response = if handshake.binary_responses() {
        // The request's token count is the payload's first byte (1..=256); the rest is the payload.
        let Some((&tokens, payload)) = rest.get(end + 1..).and_then(|p| p.split_first()) else { return };
        let tokens = usize::from(tokens) + 1;
        let Ok(header) = BinaryHeader::parse(second) else { return };
        match header.payload_len(&handshake, tokens, 1 << 20) {
            Ok(len) if len == payload.len() => {}
            _ => return,
        }
        let Ok(response) = header.decode(payload, tokens) else { return };
        response
    } else {
        let Ok(response) = parse_response(second) else { return };
        response
    };
    // Ask for exactly what the response answers, so the checks past the shape run too.
    let asked = Asked { id: response.id, batch: 1, seq_len: response.tokens.len(), padding: None, logits: None };
    if let Ok(routing) = response.into_routing(&handshake, &asked) {
        for route in routing.tokens.iter().flat_map(|t| &t.routes) {
            assert!(route.expert < routing.experts && route.weight.is_finite());
        }
    }
});
