//! Snapshots of routing tables on small seeded inputs: one per preset, and scaled-down variants
//! (E = 4) in which capacity binds. Each snapshot is a claim about docs/ROUTING.md; the comment
//! above each call says what a reader can check in it. The logits are in each snapshot's
//! header (`description`), so every claim can be checked by hand.
//!
//! All inputs come from one ChaCha8 stream (seed 2024), standard normal × 1.5: presets with
//! the same E see the same logits, so their tables can be compared line by line.

use moe_audit::config::{preset, RouterConfig};
use moe_audit::routing::render_table;
use moe_audit::{assign, Routing};
use ndarray::Array3;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::StandardNormal;
use std::fmt::Write;

const SEED: u64 = 2024;

fn seeded_logits(batch: usize, seq_len: usize, experts: usize) -> Array3<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(SEED);
    let data: Vec<f32> = (0..batch * seq_len * experts).map(|_| rng.sample::<f32, _>(StandardNormal) * 1.5).collect();
    Array3::from_shape_vec((batch, seq_len, experts), data).expect("length matches")
}

fn cfg(name: &str) -> RouterConfig {
    preset(name).unwrap().config().unwrap()
}

/// The preset at E = 4 (everything else as in the preset).
fn small(name: &str) -> RouterConfig {
    let mut c = cfg(name);
    c.name = format!("{name}-e4");
    c.experts = 4;
    c
}

/// The logits, 3 decimals, one row per token, for the snapshot header.
fn describe(x: &Array3<f32>) -> String {
    let (b, s, e) = x.dim();
    let mut out = format!("seed {SEED}, standard normal x 1.5, [{b}, {s}, {e}]; rows: b pos | e0 e1 ...\n");
    if e > 16 {
        out.push_str("(logits omitted: too many experts to read)\n");
        return out;
    }
    for bi in 0..b {
        for p in 0..s {
            let _ = write!(out, "{bi} {p} |");
            for v in x.slice(ndarray::s![bi, p, ..]) {
                let _ = write!(out, " {v:7.3}");
            }
            out.push('\n');
        }
    }
    out
}

/// Routes 2 × 8 seeded tokens and returns the table and the record.
fn route(c: &RouterConfig) -> (String, Routing, Array3<f32>) {
    let x = seeded_logits(2, 8, c.experts);
    let r = assign(c, x.view()).unwrap();
    (render_table(&r), r, x)
}

macro_rules! table_snapshot {
    ($config:expr) => {{
        let c: RouterConfig = $config;
        let (text, routing, x) = route(&c);
        let mut settings = insta::Settings::clone_current();
        settings.set_description(describe(&x));
        settings.set_omit_expression(true);
        settings.bind(|| insta::assert_snapshot!(format!("table_{}", c.name), text));
        routing
    }};
}

fn dropped(r: &Routing) -> usize {
    r.tokens.iter().flat_map(|t| &t.routes).filter(|x| !x.kept).count()
}

fn padded(r: &Routing) -> usize {
    r.tokens.iter().flat_map(|t| &t.routes).filter(|x| x.padded).count()
}

// ---------------------------------------------------------------------------------------------
// Every preset at its own E (8, or 256 for DeepSeek-V3)

#[test]
fn table_mixtral() {
    // Dropless top-2 of the softmax: every route kept, each token's two weights sum to 1.
    table_snapshot!(cfg("mixtral"));
}

#[test]
fn table_deepseek_v3() {
    // 8 routes per token, all inside at most 4 of the 8 groups of 32, weights summing to 2.5.
    let r = table_snapshot!(cfg("deepseek-v3"));
    for t in &r.tokens {
        let mut groups: Vec<usize> = t.routes.iter().map(|x| x.expert / 32).collect();
        groups.sort_unstable();
        groups.dedup();
        assert!(groups.len() <= 4, "token ({}, {}) uses groups {groups:?}", t.batch, t.pos);
    }
}

#[test]
fn table_switch() {
    // Fixed capacity 64 per sequence never binds at 8 tokens: nothing dropped, raw softmax gate.
    let r = table_snapshot!(cfg("switch"));
    assert_eq!(dropped(&r), 0);
}

#[test]
fn table_megatron_probs() {
    // C = ceil(16*2/8) = 4: an over-full expert keeps its 4 largest gates, whatever the position.
    table_snapshot!(cfg("megatron-probs"));
}

#[test]
fn table_megatron_position() {
    // Same logits and C = 4 as megatron-probs: now the first 4 routes in [S,B] order are kept.
    table_snapshot!(cfg("megatron-position"));
}

#[test]
fn table_megatron_probs_pad() {
    // megatron-probs plus padding: every expert has exactly 4 rows, gate-0 slots on the
    // lowest-index (in [S,B] order) tokens that did not route to it.
    let r = table_snapshot!(cfg("megatron-probs-pad"));
    for l in &r.experts_load {
        assert_eq!(l.kept + l.padded, 4, "expert {}", l.expert);
    }
}

#[test]
fn table_deepspeed_top1() {
    // C = max(ceil(2*1), 4) = 4: each expert keeps its first 4 tokens in [B,S] order, raw gate.
    table_snapshot!(cfg("deepspeed-top1"));
}

#[test]
fn table_deepspeed_top2() {
    // C = max(ceil(2*2), 4) = 4: 1st choices before 2nd; survivors renormalised (a token whose
    // partner was dropped has weight 1.0).
    table_snapshot!(cfg("deepspeed-top2"));
}

#[test]
fn table_deepspeed_topk_probs() {
    // C = 4: each expert keeps its largest full-softmax probabilities; survivors renormalised.
    table_snapshot!(cfg("deepspeed-topk-probs"));
}

#[test]
fn table_expert_choice() {
    // C = round(2*16/8) = 4: each expert takes its 4 best tokens; a token gets 0..8 experts.
    let r = table_snapshot!(cfg("expert-choice"));
    for e in 0..8 {
        let n = r.tokens.iter().filter(|t| t.routes.iter().any(|x| x.expert == e)).count();
        assert_eq!(n, 4, "expert {e}");
    }
}

// ---------------------------------------------------------------------------------------------
// E = 4: capacity binds

#[test]
fn table_megatron_probs_e4() {
    // C = ceil(16*2/4) = 8; the over-full experts drop their smallest gates.
    let r = table_snapshot!(small("megatron-probs"));
    assert!(dropped(&r) > 0, "capacity should bind");
}

#[test]
fn table_megatron_position_e4() {
    // C = 8 on the same logits: the over-full experts drop their latest routes in [S,B] order
    // (all positions of both sequences interleaved), whatever the gate.
    let r = table_snapshot!(small("megatron-position"));
    assert!(dropped(&r) > 0, "capacity should bind");
}

#[test]
fn table_megatron_probs_pad_e4() {
    // C = 8: over-full experts drop as in megatron-probs-e4, under-full ones get gate-0 rows
    // up to exactly 8.
    let r = table_snapshot!(small("megatron-probs-pad"));
    assert!(dropped(&r) > 0 && padded(&r) > 0, "capacity should bind and pad");
    for l in &r.experts_load {
        assert_eq!(l.kept + l.padded, 8, "expert {}", l.expert);
    }
}

#[test]
fn table_deepspeed_top1_e4() {
    // C = max(ceil(4*1), 4) = 4: the first 4 tokens of each expert in [B,S] order keep it, so
    // sequence 1 loses to sequence 0.
    let r = table_snapshot!(small("deepspeed-top1"));
    assert!(dropped(&r) > 0, "capacity should bind");
}

#[test]
fn table_deepspeed_top2_e4() {
    // C = max(ceil(4*2), 4) = 8: every 1st choice of an expert is kept before any 2nd choice;
    // a token left with one route has weight 1.0.
    let r = table_snapshot!(small("deepspeed-top2"));
    assert!(dropped(&r) > 0, "capacity should bind");
}

#[test]
fn table_deepspeed_topk_probs_e4() {
    // C = 8: each expert keeps its 8 largest full-softmax probabilities; survivors renormalised.
    let r = table_snapshot!(small("deepspeed-topk-probs"));
    assert!(dropped(&r) > 0, "capacity should bind");
}

#[test]
fn table_switch_e4_fixed_2() {
    // Capacity 2 per sequence: the first 2 tokens of each sequence that chose an expert keep
    // it, independently in each sequence (2 groups).
    let mut c = small("switch");
    c.name = "switch-e4-fixed2".into();
    c.capacity.as_mut().unwrap().fixed = Some(2);
    let r = table_snapshot!(c);
    assert!(dropped(&r) > 0, "capacity should bind");
}

#[test]
fn table_expert_choice_e4() {
    // C = round(2*16/4) = 8: each of the 4 experts takes its 8 best tokens of the batch.
    let r = table_snapshot!(small("expert-choice"));
    for e in 0..4 {
        let n = r.tokens.iter().filter(|t| t.routes.iter().any(|x| x.expert == e)).count();
        assert_eq!(n, 8, "expert {e}");
    }
}

// ---------------------------------------------------------------------------------------------
// The full JSON record

#[test]
fn json_megatron_probs_pad_e4() {
    // 2 x 4 tokens, E = 4, k = 2: C = ceil(8*2/4) = 4; every expert has exactly 4 rows.
    let c = small("megatron-probs-pad");
    let x = seeded_logits(2, 4, 4);
    let r = assign(&c, x.view()).unwrap();
    let mut settings = insta::Settings::clone_current();
    settings.set_description(describe(&x));
    settings.set_omit_expression(true);
    settings.bind(|| {
        insta::assert_json_snapshot!("json_megatron_probs_pad_e4", r, {
            ".tokens[].routes[].weight" => insta::rounded_redaction(4),
            ".stats.*" => insta::rounded_redaction(4),
        })
    });
}
