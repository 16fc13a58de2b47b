//! The `moe-audit/1` and `moe-audit/2` messages (docs/PROTOCOL.md) and their validation: a
//! response becomes a [`Routing`] only when every field fits the request, so no verdict is ever
//! drawn from bad data. `/2` frames its requests (a JSON header line, then little-endian bytes),
//! may answer in binary frames, states a capacity with its scope, and carries a padding mask;
//! a `/2` router may be an MoE layer run expert-parallel (`ranks`: each call's sequences placed
//! over its ranks, the capacity per rank) that sends its output rows (`output`).

use crate::mode::Mode;
use moe_audit_core::config::{Flatten, ScopeConfig, ScopeGroup};
use moe_audit_core::error::{excerpt, excerpt_long, ProtocolError};
use moe_audit_core::routing::{
    scores, Decisions, GroupRecord, GroupRule, OutputDtype, Outputs, Route, Routing, ScopeRecord, TokenRouting,
};
use ndarray::ArrayView2;
use serde::{Deserialize, Serialize};

/// The protocol tag of version 1 (JSON lines both ways).
pub const PROTOCOL: &str = "moe-audit/1";
/// The protocol tag of version 2 (binary frames, scoped capacity, padding mask).
pub const PROTOCOL_2: &str = "moe-audit/2";

/// What a router's rows hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum InputKind {
    /// E gate logits per token: the analyzer crafts targeted rows itself.
    Logits,
    /// H hidden values per token: the router applies its own gate.
    Hidden,
}

/// How a `moe-audit/2` router writes its responses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Encoding {
    /// One JSON line per response, as in `/1`.
    Json,
    /// A JSON header line, then the routes as little-endian columns.
    Binary,
}

/// The first line a router writes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Handshake {
    /// [`PROTOCOL`] or [`PROTOCOL_2`].
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
    /// `/2` only: how responses are written (default JSON lines).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub responses: Option<Encoding>,
    /// `/2` only: requests carry a padding mask, so the audit's padding cases apply.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub padding_mask: bool,
    /// `/2` only: the adapter serving the router can apply each request's `seed` to the
    /// router's random draws itself, with its option `seed_calls=True` (`moe_audit.hf`): `false`
    /// when it is off, `true` when on. Absent: no such option; the advice for a random router
    /// then names only the `seed` every request carries.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed_calls: Option<bool>,
    /// `/2` only: the router is an MoE layer run expert-parallel over this many ranks; every
    /// call's batch is a multiple of it, and each response states the rank of each sequence.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ranks: Option<usize>,
    /// `/2` only (binary responses, `input: hidden`): responses carry the layer's output rows,
    /// computed in this dtype (sent as f32), compared within its tolerance.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<OutputDtype>,
    /// `/2` only: a hex fingerprint of the layer's weights (router and experts in global expert
    /// order), which two launches compared by `--layout-cmd` must share.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weights: Option<String>,
}

/// The largest `experts` and `hidden_size` a handshake may declare (2^20: a million experts, as
/// in product-key MoE); rows are allocated from them, so absurd values are errors, not crashes.
pub const MAX_SIZE: usize = 1 << 20;

/// The most expert-parallel ranks a handshake may declare.
pub const MAX_RANKS: usize = 1024;

/// The longest weights fingerprint, in hex digits (a sha512 takes 128).
pub(crate) const MAX_FINGERPRINT: usize = 128;

impl Handshake {
    /// Checks the handshake; the error says which field is wrong.
    pub fn validate(&self) -> Result<(), ProtocolError> {
        if self.protocol != PROTOCOL && self.protocol != PROTOCOL_2 {
            let protocol = excerpt(&self.protocol);
            return Err(format!("handshake: protocol `{protocol}`, expected `{PROTOCOL}` or `{PROTOCOL_2}`").into());
        }
        let v2_only = [
            ("responses", self.responses.is_some()),
            ("padding_mask", self.padding_mask),
            ("seed_calls", self.seed_calls.is_some()),
            ("ranks", self.ranks.is_some()),
            ("output", self.output.is_some()),
            ("weights", self.weights.is_some()),
        ];
        if let Some((field, _)) = v2_only.iter().find(|(_, set)| *set && !self.framed()) {
            return Err(format!("handshake: `{field}` needs protocol `{PROTOCOL_2}`").into());
        }
        if let Some(n) = self.ranks.filter(|n| !(1..=MAX_RANKS).contains(n)) {
            return Err(format!("handshake: ranks {n} is not from 1 to {MAX_RANKS}").into());
        }
        if self.output.is_some() && (self.input != InputKind::Hidden || !self.binary_responses()) {
            return Err("handshake: `output` needs input `hidden` and responses `binary`".into());
        }
        if self.ranks.is_some() && !self.binary_responses() {
            return Err("handshake: `ranks` needs responses `binary` (their header states the placement)".into());
        }
        if let Some(w) = &self.weights {
            if w.is_empty() || w.len() > MAX_FINGERPRINT || !w.bytes().all(|b| b.is_ascii_hexdigit()) {
                let w = excerpt(w);
                return Err(
                    format!("handshake: weights `{w}` is not a hex string of 1 to {MAX_FINGERPRINT} digits").into()
                );
            }
        }
        if let Err(e) = moe_audit_core::names::check(&self.name) {
            return Err(format!("handshake: name {e}").into());
        }
        if !(1..=MAX_SIZE).contains(&self.experts) {
            return Err(format!("handshake: experts {} is not from 1 to {MAX_SIZE}", self.experts).into());
        }
        if let Some(h) = self.hidden_size.filter(|&h| h > MAX_SIZE) {
            return Err(format!("handshake: hidden_size {h} is over {MAX_SIZE}").into());
        }
        if let Some(k) = self.top_k {
            if k == 0 || k > self.experts {
                return Err(format!("handshake: top_k {k} is not from 1 to {}", self.experts).into());
            }
        }
        match (self.input, self.hidden_size) {
            (InputKind::Hidden, None | Some(0)) => Err("handshake: input `hidden` needs hidden_size >= 1".into()),
            _ => Ok(()),
        }
    }

    /// Checks that `other`, another launch of this layer (`check --layout-cmd`: the same layer
    /// at another expert-parallel size), describes the same layer: experts, top_k, input,
    /// hidden_size and output dtype equal, and the weights fingerprint when both send one. The
    /// name may differ (it may carry the EP size), and so may `ranks`. The error names the
    /// first field that differs and both values.
    pub fn same_layer(&self, other: &Handshake) -> Result<(), ProtocolError> {
        use serde_json::json;
        let mut fields = vec![
            ("experts", json!(other.experts), json!(self.experts)),
            ("top_k", json!(other.top_k), json!(self.top_k)),
            ("input", json!(other.input), json!(self.input)),
            ("hidden_size", json!(other.hidden_size), json!(self.hidden_size)),
            ("output", json!(other.output), json!(self.output)),
        ];
        if let (Some(theirs), Some(ours)) = (&other.weights, &self.weights) {
            fields.push(("weights", json!(theirs), json!(ours)));
        }
        match fields.into_iter().find(|(_, theirs, ours)| theirs != ours) {
            Some((field, theirs, ours)) => Err(format!(
                "the layers differ: `{field}` {} here, {} in router `{}`",
                excerpt(&theirs.to_string()),
                excerpt(&ours.to_string()),
                self.name
            )
            .into()),
            None => Ok(()),
        }
    }

    /// Whether the router speaks `/2` (framed requests).
    pub fn framed(&self) -> bool {
        self.protocol == PROTOCOL_2
    }

    /// Whether responses come as binary frames.
    pub(crate) fn binary_responses(&self) -> bool {
        self.responses == Some(Encoding::Binary)
    }

    /// The expert-parallel ranks (1 for a router that declares none).
    pub fn ranks(&self) -> usize {
        self.ranks.unwrap_or(1)
    }

    /// Values per row of a request.
    pub fn row_width(&self) -> usize {
        match self.input {
            InputKind::Logits => self.experts,
            InputKind::Hidden => self.hidden_size.unwrap_or(0),
        }
    }
}

/// One `/1` call: `batch * seq_len` rows, sequence-major.
#[derive(Debug, Serialize)]
pub(crate) struct Request<'a> {
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

/// The header line of a `/2` request; `bytes` bytes follow it: the rows as little-endian f32
/// (sequence-major, `batch * seq_len * width` values), then with `padding` one byte per token
/// (1 = padding).
#[derive(Debug, Serialize)]
struct FrameHeader<'a> {
    id: u64,
    mode: Mode,
    batch: usize,
    seq_len: usize,
    width: usize,
    seed: u64,
    padding: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    placement: Option<&'a [usize]>,
    bytes: usize,
}

/// A `/2` request as written: its header line, then its payload.
///
/// # Shapes
/// `rows`: `batch * seq_len * width` values, sequence-major; `padding`: `batch * seq_len` flags;
/// `placement`: `batch` ranks.
pub(crate) fn frame_request(
    (id, mode, seed): (u64, Mode, u64),
    (batch, seq_len, width): (usize, usize, usize),
    rows: &[f32],
    padding: Option<&[bool]>,
    placement: Option<&[usize]>,
) -> Vec<u8> {
    let bytes = 4 * rows.len() + padding.map_or(0, <[bool]>::len);
    let header = FrameHeader { id, mode, batch, seq_len, width, seed, padding: padding.is_some(), placement, bytes };
    let mut out = serde_json::to_vec(&header).expect("a header always serialises");
    out.push(b'\n');
    out.reserve(bytes);
    rows.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes()));
    padding.into_iter().flatten().for_each(|&p| out.push(u8::from(p)));
    out
}

/// One route of a response.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RouteOut {
    /// Expert id (signed, so a negative id is reported as out of range, not as a parse error).
    pub expert: i64,
    /// Combine weight when kept; the gate before dropping otherwise.
    pub weight: f32,
    /// False when capacity dropped the route.
    pub kept: bool,
}

/// The capacity a response states.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged, try_from = "serde_json::Value")]
pub(crate) enum Capacity {
    /// Slots per expert over the call (`/1`): one routing group, the whole call.
    PerExpert(Vec<usize>),
    /// Slots per expert in each routing group of a scope (`/2`).
    Scoped(ScopedCapacity),
}

/// A capacity with its scope: which tokens compete together, and each group's slots.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ScopedCapacity {
    /// `batch`, `sequence` or `tokens:N`, as a built-in router's `[scope] group`; or `rank`
    /// (a router with `ranks`: one group per rank, its sequences' tokens).
    pub scope: GroupRule,
    /// Slots of every expert, one count per group, in group order.
    pub slots: Vec<usize>,
    /// The order `tokens:N` groups are cut from; default sequence-major (the rows' order).
    #[serde(default = "sequence_major")]
    pub flatten: Flatten,
}

impl TryFrom<serde_json::Value> for Capacity {
    type Error = String;

    /// A list or a scope, each with its own errors (an untagged enum would name neither).
    fn try_from(v: serde_json::Value) -> Result<Self, String> {
        let result = match v {
            serde_json::Value::Array(_) => serde_json::from_value(v).map(Capacity::PerExpert),
            serde_json::Value::Object(_) => serde_json::from_value(v).map(Capacity::Scoped),
            _ => return Err("capacity must be null, a list of slots per expert, or {scope, slots}".into()),
        };
        result.map_err(|e| format!("capacity: {}", excerpt_long(&e)))
    }
}

fn sequence_major() -> Flatten {
    Flatten::SequenceMajor
}

/// A router's answer to one request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Response {
    /// The request's id.
    pub id: u64,
    /// Per token (sequence-major), its routes in choice order.
    pub tokens: Vec<Vec<RouteOut>>,
    /// `null` (or absent) when dropless.
    #[serde(default)]
    pub capacity: Option<Capacity>,
    /// The rank of each sequence (binary responses of a router with `ranks`).
    #[serde(skip)]
    pub placement: Option<Vec<usize>>,
    /// The output rows, `tokens * H` values (binary responses of a router with `output`).
    #[serde(skip)]
    pub output: Option<Vec<f32>>,
}

/// The header line of a binary `/2` response; `bytes` bytes follow it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct BinaryHeader {
    /// The request's id.
    pub id: u64,
    /// Routes R over all tokens.
    pub routes: u64,
    /// As in [`Response`].
    #[serde(default)]
    pub capacity: Option<Capacity>,
    /// As in [`Response`].
    #[serde(default)]
    pub placement: Option<Vec<usize>>,
    /// Payload length: `4 * tokens + 9 * routes`, plus `4 * tokens * H` with `output`.
    pub bytes: u64,
}

impl BinaryHeader {
    /// Parses a header line; the error quotes an excerpt of a line that is not one.
    pub fn parse(line: &str) -> Result<Self, ProtocolError> {
        serde_json::from_str(line).map_err(|source| ProtocolError::NotA {
            expected: "a binary response header",
            line: line.to_string(),
            source,
        })
    }

    /// The payload length once checked against what `tokens` tokens of `hs` can hold (at most
    /// `top_k` or E routes each) and against `limit`: nothing is allocated from a header
    /// before this.
    pub fn payload_len(&self, hs: &Handshake, tokens: usize, limit: u64) -> Result<usize, ProtocolError> {
        let per_token = hs.top_k.unwrap_or(hs.experts) as u64;
        let most = (tokens as u64).saturating_mul(per_token);
        if self.routes > most {
            return Err(format!(
                "{} routes, more than {tokens} tokens x {per_token} routes each can hold",
                self.routes
            )
            .into());
        }
        let rows = if hs.output.is_some() { hs.row_width() as u64 } else { 0 };
        let want = self.routes.checked_mul(9).and_then(|r| r.checked_add(4 * tokens as u64)).and_then(|w| {
            (tokens as u64).checked_mul(rows).and_then(|o| o.checked_mul(4)).and_then(|o| w.checked_add(o))
        });
        let Some(want) = want.filter(|&w| w == self.bytes) else {
            let outputs = if rows > 0 { format!(" and their output rows of {rows}") } else { String::new() };
            return Err(format!(
                "the header says {} bytes, {tokens} tokens and {} routes{outputs} take {}",
                self.bytes,
                self.routes,
                want.map_or("more than 2^64".to_string(), |w| w.to_string())
            )
            .into());
        };
        if want > limit {
            return Err(ProtocolError::PayloadOverLimit { bytes: want, limit });
        }
        usize::try_from(want).map_err(|_| format!("a payload of {want} bytes does not fit in memory").into())
    }

    /// The response the payload holds: counts (u32), experts (i32), weights (f32), kept
    /// flags (u8, 0 or 1), then with `output` the output rows (f32), little-endian. `payload`
    /// has [`BinaryHeader::payload_len`] bytes.
    pub fn decode(self, payload: &[u8], tokens: usize) -> Result<Response, ProtocolError> {
        let r = self.routes as usize;
        let (counts, rest) = payload.split_at(4 * tokens);
        let (experts, rest) = rest.split_at(4 * r);
        let (weights, rest) = rest.split_at(4 * r);
        let (kept, rows) = rest.split_at(r);
        let word = |b: &[u8]| <[u8; 4]>::try_from(b).expect("4 bytes");
        let mut total = 0u64;
        let counts: Vec<usize> = counts
            .chunks_exact(4)
            .map(|c| {
                let n = u32::from_le_bytes(word(c));
                total += u64::from(n);
                n as usize
            })
            .collect();
        if total != self.routes {
            return Err(format!("the token counts add up to {total} routes, the header says {}", self.routes).into());
        }
        if let Some(i) = kept.iter().position(|&k| k > 1) {
            return Err(format!("route {i}: kept flag {} is not 0 or 1", kept[i]).into());
        }
        let mut routes = experts.chunks_exact(4).zip(weights.chunks_exact(4)).zip(kept).map(|((e, w), &k)| RouteOut {
            expert: i64::from(i32::from_le_bytes(word(e))),
            weight: f32::from_le_bytes(word(w)),
            kept: k == 1,
        });
        let tokens = counts.iter().map(|&n| routes.by_ref().take(n).collect()).collect();
        let output = (!rows.is_empty()).then(|| rows.chunks_exact(4).map(|v| f32::from_le_bytes(word(v))).collect());
        Ok(Response { id: self.id, tokens, capacity: self.capacity, placement: self.placement, output })
    }
}

/// What a response answers: the request's id, shape, padding mask (`true` = padding) and its
/// rows when they are logits (for the load statistics).
pub(crate) struct Asked<'a> {
    /// The request's id.
    pub id: u64,
    /// Sequences.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// `[batch, seq_len]`; a padding token may have no route.
    pub padding: Option<ArrayView2<'a, bool>>,
    /// The rows, when they are logits.
    pub logits: Option<&'a [f32]>,
    /// The placement the request sent (a router with `ranks`).
    pub placement: Option<&'a [usize]>,
}

/// Checks that `placement` puts `batch / ranks` sequences on each of `ranks` ranks.
pub(crate) fn check_placement(placement: &[usize], batch: usize, ranks: usize) -> Result<(), ProtocolError> {
    if placement.len() != batch {
        return Err(format!("placement has {} entries, the batch {batch} sequences", placement.len()).into());
    }
    if let Some(r) = placement.iter().find(|&&r| r >= ranks) {
        return Err(format!("placement names rank {r}, the router has ranks 0 to {}", ranks - 1).into());
    }
    let mut held = vec![0usize; ranks];
    placement.iter().for_each(|&r| held[r] += 1);
    match held.iter().position(|&n| n * ranks != batch) {
        Some(r) => Err(format!(
            "placement puts {} sequences on rank {r}, a balanced one {} of {batch} on each of {ranks} ranks",
            held[r],
            batch / ranks
        )
        .into()),
        None => Ok(()),
    }
}

impl Response {
    /// Checks the response against its request and builds the routing record.
    pub(crate) fn into_routing(self, hs: &Handshake, asked: &Asked) -> Result<Routing, ProtocolError> {
        let Asked { id, batch, seq_len, .. } = *asked;
        if self.id != id {
            return Err(format!("response id {} does not match", self.id).into());
        }
        let n = batch * seq_len;
        if self.tokens.len() != n {
            return Err(
                format!("{} tokens, expected batch {batch} x seq_len {seq_len} = {n}", self.tokens.len()).into()
            );
        }
        let e = hs.experts;
        let mut tokens = self
            .tokens
            .into_iter()
            .enumerate()
            .map(|(i, routes)| token_routing(i, routes, hs, asked))
            .collect::<Result<Vec<_>, _>>()?;
        let placement = placement_of(self.placement, hs, asked)?;
        let output = output_of(self.output, hs, seq_len)?;
        let ranked = hs.ranks.zip(placement.as_deref());
        let (capacity, scope, members) = scope_of(self.capacity, e, (batch, seq_len), ranked)?;
        for (g, members) in members.into_iter().enumerate() {
            members.into_iter().for_each(|i| tokens[i].group = g);
        }
        let softmax = asked.logits.map(|flat| scores::softmax_rows(flat, e)).unwrap_or_default();
        let decisions =
            Decisions { router: hs.name.clone(), batch, seq_len, experts: e, top_k: hs.top_k, capacity, scope, tokens };
        let mut routing = Routing::assemble(decisions, Some(&softmax));
        (routing.placement, routing.output) = (placement, output);
        Ok(routing)
    }
}

/// Token `i`'s routes checked: experts in range, none twice, finite weights, top_k of them (a
/// padding token may be left unrouted, as built-in routers that exclude it do).
fn token_routing(
    i: usize,
    routes: Vec<RouteOut>,
    hs: &Handshake,
    asked: &Asked,
) -> Result<TokenRouting, ProtocolError> {
    let e = hs.experts;
    let (b, s) = (i / asked.seq_len, i % asked.seq_len);
    let at = || format!("token {i} (batch {b}, position {s})");
    let mut seen = vec![false; e];
    let mut out = Vec::with_capacity(routes.len());
    for r in routes {
        let expert = usize::try_from(r.expert).ok().filter(|&x| x < e);
        let Some(expert) = expert else {
            return Err(format!("{}: expert {} is out of range 0 to {}", at(), r.expert, e.saturating_sub(1)).into());
        };
        if std::mem::replace(&mut seen[expert], true) {
            return Err(format!("{}: expert {expert} appears twice", at()).into());
        }
        if !r.weight.is_finite() {
            return Err(format!("{}: weight {} of expert {expert} is not finite", at(), r.weight).into());
        }
        out.push(Route { expert, weight: r.weight, kept: r.kept, padded: false });
    }
    let unrouted_padding = out.is_empty() && asked.padding.is_some_and(|m| m[[b, s]]);
    if let Some(k) = hs.top_k.filter(|&k| out.len() != k && !unrouted_padding) {
        return Err(format!("{}: {} routes, the handshake declared top_k {k}", at(), out.len()).into());
    }
    Ok(TokenRouting { batch: b, pos: s, group: 0, routes: out, capacity: None })
}

/// The placement a response states: there exactly when the handshake declared `ranks`,
/// balanced, and the one requested when the request sent one.
fn placement_of(
    stated: Option<Vec<usize>>,
    hs: &Handshake,
    asked: &Asked,
) -> Result<Option<Vec<usize>>, ProtocolError> {
    match (hs.ranks, stated) {
        (None, None) => Ok(None),
        (None, Some(_)) => Err("a `placement` from a router that declared no `ranks`".into()),
        (Some(_), None) => Err("no `placement`: a router with `ranks` names the rank of each sequence".into()),
        (Some(n), Some(p)) => {
            check_placement(&p, asked.batch, n)?;
            if asked.placement.is_some_and(|want| want != p.as_slice()) {
                return Err(format!(
                    "placement {} is not the requested {}",
                    excerpt_long(format!("{p:?}")),
                    excerpt_long(format!("{:?}", asked.placement.unwrap_or_default()))
                )
                .into());
            }
            Ok(Some(p))
        }
    }
}

/// The output rows a response states: there when the handshake declared `output`, finite.
fn output_of(rows: Option<Vec<f32>>, hs: &Handshake, seq_len: usize) -> Result<Option<Outputs>, ProtocolError> {
    match (hs.output, rows) {
        (Some(dtype), Some(rows)) => {
            let h = hs.row_width();
            if let Some(i) = rows.chunks_exact(h.max(1)).position(|r| r.iter().any(|v| !v.is_finite())) {
                return Err(format!(
                    "token {i} (batch {}, position {}): output row is not finite",
                    i / seq_len,
                    i % seq_len
                )
                .into());
            }
            Ok(Some(Outputs { dtype, hidden: h, rows }))
        }
        (Some(_), None) => Err("no output rows: the handshake declared `output`".into()),
        (None, _) => Ok(None),
    }
}

/// A stated capacity in force: the record's capacity (per expert over the call), its scope,
/// and the flat token indices of each of its groups.
type Scoped = (Option<Vec<usize>>, ScopeRecord, Vec<Vec<usize>>);

/// The record's capacity (per expert over the call), scope and groups of a stated capacity.
/// Without a scope the call is one group; unequal per-expert capacities count by their largest.
/// A `rank` scope's groups are the `ranked` router's ranks, each holding the tokens of the
/// sequences its placement puts there, in batch order.
fn scope_of(
    capacity: Option<Capacity>,
    e: usize,
    (batch, seq_len): (usize, usize),
    ranked: Option<(usize, &[usize])>,
) -> Result<Scoped, String> {
    let n = batch * seq_len;
    let whole = |capacity: Option<usize>| {
        let group = GroupRule::Scope(ScopeGroup::Batch);
        let groups = vec![GroupRecord { tokens: n, capacity }];
        (ScopeRecord { group, flatten: Flatten::SequenceMajor, groups }, vec![(0..n).collect()])
    };
    match capacity {
        None => {
            let (scope, members) = whole(None);
            Ok((None, scope, members))
        }
        Some(Capacity::PerExpert(c)) => {
            if c.len() != e {
                return Err(format!("capacity has {} entries, expected one per expert ({e})", c.len()));
            }
            let (scope, members) = whole(c.iter().copied().max());
            Ok((Some(c), scope, members))
        }
        Some(Capacity::Scoped(ScopedCapacity { scope, slots, flatten })) => {
            let groups: Vec<Vec<usize>> = match (scope, ranked) {
                (GroupRule::Scope(group), _) => {
                    moe_audit_core::routing::scope::groups(&ScopeConfig { group, flatten }, batch, seq_len)
                }
                (GroupRule::Rank, Some((n, p))) => (0..n)
                    .map(|r| (0..batch).filter(|&b| p[b] == r).flat_map(|b| b * seq_len..(b + 1) * seq_len).collect())
                    .collect(),
                (GroupRule::Rank, None) => {
                    return Err("capacity scope `rank` from a router that declared no `ranks`".into())
                }
            };
            if scope == GroupRule::Rank && slots.len() != groups.len() {
                return Err(format!(
                    "capacity scope `rank` has {} ranks, slots has {} entries",
                    groups.len(),
                    slots.len()
                ));
            }
            if slots.len() != groups.len() {
                return Err(format!(
                    "capacity scope `{scope}` has {} groups in batch {batch} x seq_len {seq_len}, slots has {} entries",
                    groups.len(),
                    slots.len()
                ));
            }
            let total = slots.iter().try_fold(0usize, |a, &c| a.checked_add(c));
            let Some(total) = total else {
                return Err("capacity slots add up to more than 2^64".into());
            };
            let records = groups.iter().zip(&slots).map(|(g, &c)| GroupRecord { tokens: g.len(), capacity: Some(c) });
            let flatten = if scope == GroupRule::Rank { Flatten::SequenceMajor } else { flatten };
            Ok((Some(vec![total; e]), ScopeRecord { group: scope, flatten, groups: records.collect() }, groups))
        }
    }
}

/// Parses one response line; the error quotes an excerpt of a line that is not a response.
pub(crate) fn parse_response(line: &str) -> Result<Response, ProtocolError> {
    serde_json::from_str(line).map_err(|source| ProtocolError::NotA {
        expected: "a response",
        line: line.to_string(),
        source,
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
            responses: None,
            padding_mask: false,
            seed_calls: None,
            ranks: None,
            output: None,
            weights: None,
        }
    }

    #[test]
    fn another_launch_must_describe_the_same_layer() {
        let ep2 = Handshake { name: "ep2".into(), ranks: Some(2), weights: Some("00ff".into()), ..hs() };
        // The name and the ranks may differ; a fingerprint is compared only when both send one.
        assert_eq!(ep2.same_layer(&Handshake { ranks: None, ..hs() }), Ok(()));
        assert_eq!(ep2.same_layer(&Handshake { weights: Some("00ff".into()), ..hs() }), Ok(()));
        let differs = |other: Handshake| ep2.same_layer(&other).unwrap_err().to_string();
        assert_eq!(
            differs(Handshake { top_k: Some(1), ..hs() }),
            "the layers differ: `top_k` 1 here, 2 in router `ep2`"
        );
        assert_eq!(
            differs(Handshake { weights: Some("ab".into()), ..hs() }),
            r#"the layers differ: `weights` "ab" here, "00ff" in router `ep2`"#
        );
        assert!(differs(Handshake { input: InputKind::Hidden, hidden_size: Some(8), ..hs() }).contains("`input`"));
    }

    fn check(line: &str) -> Result<Routing, String> {
        let asked = Asked { id: 3, batch: 1, seq_len: 2, padding: None, logits: None, placement: None };
        parse_response(line).and_then(|r| r.into_routing(&hs(), &asked)).map_err(|e| e.to_string())
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
                "token 0 (batch 0, position 0): expert -1 is out of range 0 to 3",
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
    fn placements_and_rank_scopes_need_ranks() {
        assert_eq!(check_placement(&[1, 0, 1, 0], 4, 2), Ok(()));
        assert_eq!(check_placement(&[0, 2], 2, 2), Err("placement names rank 2, the router has ranks 0 to 1".into()));
        assert_eq!(check_placement(&[0], 2, 2), Err("placement has 1 entries, the batch 2 sequences".into()));
        let tokens = r#""tokens": [[{"expert": 1, "weight": 1.0, "kept": true}, {"expert": 0, "weight": 0.0, "kept": false}], [{"expert": 1, "weight": 1.0, "kept": true}, {"expert": 3, "weight": 0.0, "kept": true}]]"#;
        let placed = |line: &str, placement: &[usize]| {
            let mut response = parse_response(line).unwrap();
            response.placement = Some(placement.to_vec());
            response
        };
        let asked = Asked { id: 3, batch: 1, seq_len: 2, padding: None, logits: None, placement: None };
        let unranked = placed(&format!(r#"{{"id": 3, {tokens}}}"#), &[0]).into_routing(&hs(), &asked);
        assert_eq!(unranked.unwrap_err(), "a `placement` from a router that declared no `ranks`");
        let scoped = format!(r#"{{"id": 3, {tokens}, "capacity": {{"scope": "rank", "slots": [1]}}}}"#);
        assert_eq!(check(&scoped).unwrap_err(), "capacity scope `rank` from a router that declared no `ranks`");
        // A ranked router's rank groups: sequence 0 on rank 1 holds both tokens.
        let hs = Handshake { protocol: PROTOCOL_2.into(), ranks: Some(2), responses: Some(Encoding::Binary), ..hs() };
        assert_eq!(hs.validate(), Ok(()));
        let json = Handshake { responses: None, ..hs.clone() }.validate().unwrap_err();
        assert_eq!(json, "handshake: `ranks` needs responses `binary` (their header states the placement)");
        let asked = Asked { id: 3, batch: 2, seq_len: 1, padding: None, logits: None, placement: None };
        let two = format!(r#"{{"id": 3, {tokens}, "capacity": {{"scope": "rank", "slots": [2, 1]}}}}"#);
        let r = placed(&two, &[1, 0]).into_routing(&hs, &asked).unwrap();
        assert_eq!((r.scope.group, r.tokens[0].group, r.tokens[1].group), (GroupRule::Rank, 1, 0));
        assert_eq!(r.placement, Some(vec![1, 0]));
        // `rank` is a record's and the protocol's scope, never a config's.
        assert!(ScopeGroup::try_from("rank".to_string()).is_err());
    }

    #[test]
    fn handshakes_are_validated() {
        assert_eq!(
            Handshake { input: InputKind::Hidden, ..hs() }.validate(),
            Err("handshake: input `hidden` needs hidden_size >= 1".into())
        );
        assert_eq!(
            Handshake { protocol: "moe-audit/3".into(), ..hs() }.validate(),
            Err("handshake: protocol `moe-audit/3`, expected `moe-audit/1` or `moe-audit/2`".into())
        );
        assert_eq!(Handshake { top_k: None, ..hs() }.validate(), Ok(()));
    }
}
