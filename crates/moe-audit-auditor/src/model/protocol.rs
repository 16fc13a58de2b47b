//! The `moe-audit/3` messages (docs/PROTOCOL.md): a request is a JSON header line and the token
//! ids (and padding mask) as little-endian bytes; a response is a JSON header line listing every
//! routed layer with its route count and capacity, then each layer's routes as `/2` columns
//! (and its router logits), then the output rows. Every length is checked against the header,
//! the handshake and the memory limit before anything is allocated; each layer's routes become
//! a [`moe_audit_core::routing::Routing`] through the `/2` decoder and checks, the one place a response
//! is checked against its request.

use super::{LayerOutput, ModelInfo, ModelOutput, Path, TokenCall};
use crate::external::protocol::{Asked, BinaryHeader, Capacity, Encoding, Handshake, InputKind, PROTOCOL_2};
use crate::external::Mode;
use moe_audit_core::error::ProtocolError;
use ndarray::ArrayView2;
use serde::{Deserialize, Serialize};

/// The header line of a request; `bytes` bytes follow it.
#[derive(Debug, Serialize)]
struct RequestHeader {
    id: u64,
    mode: Mode,
    batch: usize,
    seq_len: usize,
    seed: u64,
    padding: bool,
    path: &'static str,
    prefill: usize,
    bytes: usize,
}

/// A request as written: its header line, then the token ids (u32) and, with a mask, one byte
/// per token (1 = padding).
pub(crate) fn frame_request(id: u64, call: &TokenCall) -> Vec<u8> {
    let mask = call.padding.as_deref();
    let bytes = 4 * call.tokens.len() + mask.map_or(0, <[bool]>::len);
    let (path, prefill) = match call.path {
        Path::Forward => ("forward", 0),
        Path::Generate { prefill } => ("generate", prefill),
    };
    let header = RequestHeader {
        id,
        mode: call.mode,
        batch: call.batch,
        seq_len: call.seq_len,
        seed: call.seed,
        padding: mask.is_some(),
        path,
        prefill,
        bytes,
    };
    let mut out = serde_json::to_vec(&header).expect("a header always serialises");
    out.push(b'\n');
    out.reserve(bytes);
    call.tokens.iter().for_each(|t| out.extend_from_slice(&t.to_le_bytes()));
    mask.into_iter().flatten().for_each(|&p| out.push(u8::from(p)));
    out
}

/// One routed layer in a response header.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct LayerHeader {
    /// Global layer number.
    pub layer: usize,
    /// Routes R_l over all tokens.
    pub routes: u64,
    /// As in `/2`: `null`, one number per expert, or `{scope, slots, flatten}`.
    #[serde(default)]
    pub capacity: Option<Capacity>,
}

/// The header line of a response.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ResponseHeader {
    /// The request's id.
    pub id: u64,
    /// Every routed layer of the handshake, in its order.
    pub layers: Vec<LayerHeader>,
    /// Payload length.
    pub bytes: u64,
}

impl ResponseHeader {
    /// Parses a header line; the error quotes an excerpt of a line that is not one.
    pub fn parse(line: &str) -> Result<Self, ProtocolError> {
        serde_json::from_str(line).map_err(|source| ProtocolError::NotA {
            expected: "a response header",
            line: line.to_string(),
            source,
        })
    }

    /// The payload length once the header is checked against the request (its id), the
    /// handshake (every routed layer, in order; at most `top_k` or E routes per token) and
    /// `limit`: nothing is allocated from a header before this.
    pub fn payload_len(&self, info: &ModelInfo, id: u64, tokens: usize, limit: u64) -> Result<usize, ProtocolError> {
        if self.id != id {
            return Err(format!("response id {} does not match", self.id).into());
        }
        info.check_layers(self.layers.iter().map(|l| l.layer))?;
        let t = tokens as u64;
        let mut total = 0u64;
        for (l, h) in info.routed().zip(&self.layers) {
            let e = l.experts.unwrap_or(0) as u64;
            let most = t.saturating_mul(l.top_k.map_or(e, |k| k as u64));
            if h.routes > most {
                return Err(
                    format!("layer {}: {} routes, more than {tokens} tokens can hold", l.layer, h.routes).into()
                );
            }
            let logits = if info.logits { t.checked_mul(4 * e) } else { Some(0) };
            let layer = h.routes.checked_mul(9).and_then(|r| r.checked_add(4 * t)).zip(logits);
            total = match layer.and_then(|(r, g)| r.checked_add(g)).and_then(|n| total.checked_add(n)) {
                Some(n) => n,
                None => return Err("the payload would be longer than 2^64 bytes".into()),
            };
        }
        let Some(total) = t.checked_mul(4 * info.outputs as u64).and_then(|o| total.checked_add(o)) else {
            return Err("the payload would be longer than 2^64 bytes".into());
        };
        if total != self.bytes {
            return Err(format!("the header says {} bytes, its layers and outputs take {total}", self.bytes).into());
        }
        if total > limit {
            return Err(ProtocolError::PayloadOverLimit { bytes: total, limit });
        }
        usize::try_from(total).map_err(|_| format!("a payload of {total} bytes does not fit in memory").into())
    }

    /// The answer the payload holds (of [`ResponseHeader::payload_len`] bytes), each layer
    /// checked and built into its record by the `/2` decoder.
    pub fn decode(self, info: &ModelInfo, call: &TokenCall, payload: &[u8]) -> Result<ModelOutput, ProtocolError> {
        let t = call.tokens.len();
        let mask: Option<ndarray::Array2<bool>> = call
            .padding
            .as_ref()
            .map(|m| ArrayView2::from_shape((call.batch, call.seq_len), m).expect("checked").to_owned());
        let mut rest = payload;
        let mut layers = Vec::with_capacity(self.layers.len());
        for (l, h) in info.routed().zip(self.layers) {
            let e = l.experts.unwrap_or(0);
            let routes_len = 4 * t + 9 * h.routes as usize;
            let (routes, after) = rest.split_at(routes_len);
            let (logits, after) = after.split_at(if info.logits { 4 * t * e } else { 0 });
            rest = after;
            let logits = info.logits.then(|| f32s(logits));
            if let Some(i) = logits.as_ref().and_then(|v| v.iter().position(|x| !x.is_finite())) {
                return Err(format!("layer {}: router logit {i} is not finite", l.layer).into());
            }
            let binary = BinaryHeader {
                id: self.id,
                routes: h.routes,
                capacity: h.capacity,
                placement: None,
                bytes: routes_len as u64,
            };
            let at = |e: ProtocolError| ProtocolError::from(moe_audit_core::text!(format!("layer {}: ", l.layer), e));
            let response = binary.decode(routes, t).map_err(at)?;
            let hs = Handshake {
                protocol: PROTOCOL_2.into(),
                name: format!("{} layer {}", info.name, l.layer),
                experts: e,
                top_k: l.top_k,
                input: InputKind::Logits,
                hidden_size: None,
                responses: Some(Encoding::Binary),
                padding_mask: info.padding_mask,
                seed_calls: None,
                ranks: None,
                output: None,
                weights: None,
            };
            let asked = Asked {
                id: self.id,
                batch: call.batch,
                seq_len: call.seq_len,
                padding: mask.as_ref().map(|m| m.view()),
                logits: logits.as_deref(),
                placement: None,
            };
            let routing = response.into_routing(&hs, &asked).map_err(at)?;
            layers.push(LayerOutput { layer: l.layer, routing, logits });
        }
        let outputs = (info.outputs > 0).then(|| f32s(rest));
        Ok(ModelOutput { layers, outputs })
    }
}

/// Little-endian f32s.
fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes"))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{LayerInfo, LayerKind, PROTOCOL_3};

    fn info() -> ModelInfo {
        ModelInfo {
            protocol: PROTOCOL_3.into(),
            name: "m".into(),
            vocab: 10,
            layers: vec![
                LayerInfo { layer: 0, kind: LayerKind::Dense, experts: None, top_k: None },
                LayerInfo { layer: 1, kind: LayerKind::Moe, experts: Some(4), top_k: Some(1) },
            ],
            outputs: 2,
            logits: true,
            padding_mask: false,
            generate: false,
        }
    }

    /// A response to a call of 2 tokens: routes of layer 1 (experts 3 and 0), logits, outputs.
    fn payload() -> Vec<u8> {
        let mut p = Vec::new();
        [1u32, 1].iter().for_each(|c| p.extend_from_slice(&c.to_le_bytes()));
        [3i32, 0].iter().for_each(|e| p.extend_from_slice(&e.to_le_bytes()));
        [1.0f32, 1.0].iter().for_each(|w| p.extend_from_slice(&w.to_le_bytes()));
        p.extend_from_slice(&[1, 1]);
        (0..8).for_each(|i| p.extend_from_slice(&(i as f32).to_le_bytes()));
        [0.5f32, 0.25, -1.0, 2.0].iter().for_each(|o| p.extend_from_slice(&o.to_le_bytes()));
        p
    }

    #[test]
    fn a_request_frames_ids_then_mask() {
        let mut call = TokenCall::forward(1, 2, 7, vec![3, 9]);
        call.padding = Some(vec![false, true]);
        call.path = Path::Generate { prefill: 1 };
        let bytes = frame_request(5, &call);
        let newline = bytes.iter().position(|&b| b == b'\n').unwrap();
        assert_eq!(
            std::str::from_utf8(&bytes[..newline]).unwrap(),
            r#"{"id":5,"mode":"train","batch":1,"seq_len":2,"seed":7,"padding":true,"path":"generate","prefill":1,"bytes":10}"#
        );
        assert_eq!(&bytes[newline + 1..], &[3, 0, 0, 0, 9, 0, 0, 0, 0, 1]);
    }

    #[test]
    fn a_response_becomes_every_layer_s_record() {
        let call = TokenCall::forward(1, 2, 0, vec![1, 2]);
        let p = payload();
        let header = ResponseHeader::parse(&format!(
            r#"{{"id": 4, "layers": [{{"layer": 1, "routes": 2}}], "bytes": {}}}"#,
            p.len()
        ))
        .unwrap();
        assert_eq!(header.payload_len(&info(), 4, 2, 1 << 20), Ok(p.len()));
        let out = header.decode(&info(), &call, &p).unwrap();
        assert_eq!(info().check_output(&call, &out), Ok(()));
        assert_eq!(out.layers[0].routing.token(0, 0).routes[0].expert, 3);
        assert_eq!(out.layers[0].logits.as_deref().unwrap()[7], 7.0);
        assert_eq!(out.outputs, Some(vec![0.5, 0.25, -1.0, 2.0]));
    }

    #[test]
    fn headers_are_checked_before_reading() {
        let check = |line: &str| ResponseHeader::parse(line).and_then(|h| h.payload_len(&info(), 4, 2, 1 << 20));
        assert_eq!(
            check(r#"{"id": 4, "layers": [], "bytes": 0}"#),
            Err("layer 1 is missing (the response lists layers [], the handshake [1])".into())
        );
        assert_eq!(check(r#"{"id": 3, "layers": [], "bytes": 0}"#), Err("response id 3 does not match".into()));
        assert_eq!(
            check(r#"{"id": 4, "layers": [{"layer": 1, "routes": 3}], "bytes": 0}"#),
            Err("layer 1: 3 routes, more than 2 tokens can hold".into())
        );
        assert_eq!(
            check(r#"{"id": 4, "layers": [{"layer": 1, "routes": 2}], "bytes": 9}"#),
            Err("the header says 9 bytes, its layers and outputs take 74".into())
        );
        let huge = ResponseHeader::parse(r#"{"id": 4, "layers": [{"layer": 1, "routes": 2}], "bytes": 74}"#).unwrap();
        assert!(huge
            .payload_len(&info(), 4, 2, 50)
            .unwrap_err()
            .to_string()
            .starts_with("a payload of 74 bytes is over 50"));
    }
}
