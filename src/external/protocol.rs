//! The `moe-audit/1` messages (docs/PROTOCOL.md) and their validation: a response becomes a
//! [`Routing`] only when every field fits the request, so no verdict is ever drawn from bad data.

use crate::config::{Flatten, ScopeGroup};
use crate::routing::{scores, Decisions, GroupRecord, Route, Routing, ScopeRecord, TokenRouting};
use serde::{Deserialize, Serialize};
use std::fmt;

/// The protocol tag a router announces in its handshake.
pub const PROTOCOL: &str = "moe-audit/1";

/// What a router's rows hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum InputKind {
    /// E gate logits per token: the analyzer crafts targeted rows itself.
    Logits,
    /// H hidden values per token: the router applies its own gate.
    Hidden,
}

/// The first line a router writes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Handshake {
    /// Always [`PROTOCOL`].
    pub protocol: String,
    /// Name used in reports.
    pub name: String,
    /// Number of experts E.
    pub experts: usize,
    /// Experts per token; `null` for expert choice.
    pub top_k: Option<usize>,
    /// Row contents.
    pub input: InputKind,
    /// Hidden size H (required with `input: hidden`).
    #[serde(default)]
    pub hidden_size: Option<usize>,
}

/// The largest `experts` and `hidden_size` a handshake may declare (2^20: a million experts, as
/// in product-key MoE); rows are allocated from them, so absurd values are errors, not crashes.
pub const MAX_SIZE: usize = 1 << 20;

impl Handshake {
    /// Checks the handshake; the error says which field is wrong.
    pub fn validate(&self) -> Result<(), String> {
        if self.protocol != PROTOCOL {
            return Err(format!("handshake: protocol `{}`, expected `{PROTOCOL}`", self.protocol));
        }
        if let Err(e) = crate::names::check(&self.name) {
            return Err(format!("handshake: name {e}"));
        }
        if !(1..=MAX_SIZE).contains(&self.experts) {
            return Err(format!("handshake: experts {} is not in 1..={MAX_SIZE}", self.experts));
        }
        if let Some(h) = self.hidden_size.filter(|&h| h > MAX_SIZE) {
            return Err(format!("handshake: hidden_size {h} is over {MAX_SIZE}"));
        }
        if let Some(k) = self.top_k {
            if k == 0 || k > self.experts {
                return Err(format!("handshake: top_k {k} is not in 1..={}", self.experts));
            }
        }
        match (self.input, self.hidden_size) {
            (InputKind::Hidden, None | Some(0)) => Err("handshake: input `hidden` needs hidden_size >= 1".into()),
            _ => Ok(()),
        }
    }

    /// Values per row of a request.
    pub fn row_width(&self) -> usize {
        match self.input {
            InputKind::Logits => self.experts,
            InputKind::Hidden => self.hidden_size.unwrap_or(0),
        }
    }
}

/// Which configuration the router must route with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Training (every probe but M's second call).
    Train,
    /// Serving (the M probe).
    Inference,
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Mode::Train => "train",
            Mode::Inference => "inference",
        })
    }
}

/// One call: `batch * seq_len` rows, sequence-major.
#[derive(Debug, Serialize)]
pub struct Request<'a> {
    /// Request number, from 1.
    pub id: u64,
    /// Configuration to route with.
    pub mode: Mode,
    /// Sequences.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// The rows.
    pub data: Vec<&'a [f32]>,
}

/// One route of a response.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteOut {
    /// Expert id (signed, so a negative id is reported as out of range, not as a parse error).
    pub expert: i64,
    /// Combine weight when kept; the gate before dropping otherwise.
    pub weight: f32,
    /// False when capacity dropped the route.
    pub kept: bool,
}

/// A router's answer to one request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Response {
    /// The request's id.
    pub id: u64,
    /// Per token (sequence-major), its routes in choice order.
    pub tokens: Vec<Vec<RouteOut>>,
    /// Slots per expert over the call; `null` (or absent) when dropless.
    pub capacity: Option<Vec<usize>>,
}

impl Response {
    /// Checks the response against its request and builds the routing record. `rows` are the
    /// request's logits (for the load statistics), or `None` for hidden rows.
    pub fn into_routing(
        self,
        hs: &Handshake,
        (id, batch, seq_len): (u64, usize, usize),
        rows: Option<&[f32]>,
    ) -> Result<Routing, String> {
        if self.id != id {
            return Err(format!("response id {} does not match", self.id));
        }
        let n = batch * seq_len;
        if self.tokens.len() != n {
            return Err(format!("{} tokens, expected batch {batch} x seq_len {seq_len} = {n}", self.tokens.len()));
        }
        let e = hs.experts;
        let mut tokens = Vec::with_capacity(n);
        for (i, routes) in self.tokens.into_iter().enumerate() {
            let at = || format!("token {i} (batch {}, position {})", i / seq_len, i % seq_len);
            let mut seen = vec![false; e];
            let mut out = Vec::with_capacity(routes.len());
            for r in routes {
                let expert = usize::try_from(r.expert).ok().filter(|&x| x < e);
                let Some(expert) = expert else {
                    return Err(format!("{}: expert {} is out of range 0..{e}", at(), r.expert));
                };
                if std::mem::replace(&mut seen[expert], true) {
                    return Err(format!("{}: expert {expert} appears twice", at()));
                }
                if !r.weight.is_finite() {
                    return Err(format!("{}: weight {} of expert {expert} is not finite", at(), r.weight));
                }
                out.push(Route { expert, weight: r.weight, kept: r.kept, padded: false });
            }
            if let Some(k) = hs.top_k {
                if out.len() != k {
                    return Err(format!("{}: {} routes, the handshake declared top_k {k}", at(), out.len()));
                }
            }
            tokens.push(TokenRouting { batch: i / seq_len, pos: i % seq_len, group: 0, routes: out, capacity: None });
        }
        if let Some(c) = &self.capacity {
            if c.len() != e {
                return Err(format!("capacity has {} entries, expected one per expert ({e})", c.len()));
            }
        }
        // One routing group: the whole call. Unequal capacities count by their largest.
        let group_capacity = self.capacity.as_ref().and_then(|c| c.iter().copied().max());
        let softmax = rows.map(|flat| scores::softmax_rows(flat, e)).unwrap_or_default();
        let decisions = Decisions {
            router: hs.name.clone(),
            batch,
            seq_len,
            experts: e,
            top_k: hs.top_k,
            capacity: self.capacity,
            scope: ScopeRecord {
                group: ScopeGroup::Batch,
                flatten: Flatten::SequenceMajor,
                groups: vec![GroupRecord { tokens: n, capacity: group_capacity }],
            },
            tokens,
        };
        Ok(Routing::assemble(decisions, Some(&softmax)))
    }
}

/// Parses one response line; the error quotes the start of a line that is not a response.
pub fn parse_response(line: &str) -> Result<Response, String> {
    serde_json::from_str(line).map_err(|e| {
        let head: String = line.chars().take(80).collect();
        format!("not a response ({e}): `{head}`")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hs() -> Handshake {
        Handshake {
            protocol: PROTOCOL.into(),
            name: "t".into(),
            experts: 4,
            top_k: Some(2),
            input: InputKind::Logits,
            hidden_size: None,
        }
    }

    fn check(line: &str) -> Result<Routing, String> {
        parse_response(line)?.into_routing(&hs(), (3, 1, 2), None)
    }

    #[test]
    fn a_valid_response_becomes_the_record() {
        let r = check(r#"{"id": 3, "tokens": [[{"expert": 1, "weight": 0.6, "kept": true}, {"expert": 0, "weight": 0.4, "kept": false}], [{"expert": 1, "weight": 0.5, "kept": true}, {"expert": 3, "weight": 0.5, "kept": true}]], "capacity": [1, 2, 1, 1]}"#).unwrap();
        assert_eq!(r.token(0, 0).routes[1], Route { expert: 0, weight: 0.4, kept: false, padded: false });
        assert_eq!(r.token(0, 1).pos, 1);
        assert_eq!(r.scope.groups, vec![GroupRecord { tokens: 2, capacity: Some(2) }]);
        assert_eq!((r.experts_load[1].routed, r.experts_load[0].kept), (2, 0));
    }

    #[test]
    fn every_inconsistency_is_named() {
        let route = |e: i64| format!(r#"{{"expert": {e}, "weight": 0.5, "kept": true}}"#);
        let two = |a: i64, b: i64| format!("[{}, {}]", route(a), route(b));
        let cases = [
            (
                format!(r#"{{"id": 3, "tokens": [{}, [{}]], "capacity": null}}"#, two(0, 1), route(2)),
                "token 1 (batch 0, position 1): 1 routes, the handshake declared top_k 2",
            ),
            (
                format!(r#"{{"id": 3, "tokens": [{}, {}], "capacity": null}}"#, two(0, 1), two(2, 2)),
                "token 1 (batch 0, position 1): expert 2 appears twice",
            ),
            (
                format!(r#"{{"id": 3, "tokens": [{}, {}], "capacity": null}}"#, two(-1, 1), two(2, 3)),
                "token 0 (batch 0, position 0): expert -1 is out of range 0..4",
            ),
            (
                format!(r#"{{"id": 3, "tokens": [{}, {}], "capacity": null, "extra": 1}}"#, two(0, 1), two(2, 3)),
                "not a response (unknown field `extra`",
            ),
        ];
        for (line, want) in cases {
            let err = check(&line).unwrap_err();
            assert!(err.starts_with(want), "{err}");
        }
    }

    #[test]
    fn handshakes_are_validated() {
        assert_eq!(
            Handshake { input: InputKind::Hidden, ..hs() }.validate(),
            Err("handshake: input `hidden` needs hidden_size >= 1".into())
        );
        assert_eq!(
            Handshake { protocol: "moe-audit/2".into(), ..hs() }.validate(),
            Err("handshake: protocol `moe-audit/2`, expected `moe-audit/1`".into())
        );
        assert_eq!(Handshake { top_k: None, ..hs() }.validate(), Ok(()));
    }
}
