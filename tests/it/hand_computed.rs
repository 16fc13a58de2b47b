//! Cases computed by hand from docs/ROUTING.md: each pins one published rule.

use moe_audit::config::{
    preset, Arithmetic, CapacityConfig, DropPolicy, Flatten, RouterConfig, RouterKind, ScopeConfig, ScopeGroup,
    ScoreFn, ThresholdConfig,
};
use moe_audit::routing::{Route, StepBatch};
use moe_audit::{assign, Logits, Routing};

fn token_choice(experts: usize, k: usize, score: ScoreFn, capacity: Option<CapacityConfig>) -> RouterConfig {
    let mut c = preset("megatron-probs").unwrap().config().unwrap();
    c.name = "hand".into();
    c.experts = experts;
    c.token_choice_mut().unwrap().top_k = k;
    c.score = score;
    c.capacity = capacity;
    c
}

fn cap(factor: f64, policy: DropPolicy, arithmetic: Arithmetic) -> CapacityConfig {
    CapacityConfig {
        factor: Some(factor),
        fixed: None,
        policy,
        arithmetic,
        min: 0,
        pad: false,
        renormalize_after_drop: false,
    }
}

fn route(config: &RouterConfig, batch: usize, rows: &[&[f32]]) -> Routing {
    let e = rows[0].len();
    let logits = Logits::from_shape_vec((batch, rows.len() / batch, e), rows.concat()).unwrap();
    assign(config, logits.view()).unwrap()
}

/// One training step of the router's state on `logits` (routed as a forward routes them).
fn step(config: &mut RouterConfig, logits: &Logits) {
    let routing = assign(config, logits.view()).unwrap();
    config.step(&StepBatch { logits: logits.view(), loads: &routing.experts_load }).unwrap();
}

fn kept(expert: usize, weight: f32) -> Route {
    Route { expert, weight, kept: true, padded: false }
}

fn dropped(expert: usize, weight: f32) -> Route {
    Route { expert, weight, kept: false, padded: false }
}

fn padded(expert: usize) -> Route {
    Route { expert, weight: 0.0, kept: true, padded: true }
}

fn ln(p: f32) -> f32 {
    p.ln()
}

#[test]
fn fifty_tokens_four_experts_cf_1_2_gives_15_slots_in_megatron_and_16_in_deepspeed() {
    // Every token wants expert 0, so the kept count shows the capacity in force.
    let rows: Vec<&[f32]> = vec![&[1.0, 0.0, 0.0, 0.0]; 50];
    for (arithmetic, c) in [(Arithmetic::Megatron, 15), (Arithmetic::Deepspeed, 16)] {
        let config = token_choice(4, 1, ScoreFn::SoftmaxPre, Some(cap(1.2, DropPolicy::Position, arithmetic)));
        let r = route(&config, 1, &rows);
        assert_eq!(r.capacity, Some(vec![c; 4]), "{arithmetic:?}");
        assert_eq!(r.experts_load[0].kept, c);
        // Position policy: the first c tokens keep it.
        assert!(r.tokens[..c].iter().all(|t| t.routes[0].kept));
        assert!(r.tokens[c..].iter().all(|t| !t.routes[0].kept));
    }
}

#[test]
fn megatron_probs_a_later_stronger_token_evicts_an_earlier_one() {
    // Scenario 1: cf 1.0, E = 2, k = 1: C = ceil(2*1/2*1) = 1.
    let config = token_choice(2, 1, ScoreFn::SoftmaxPre, Some(cap(1.0, DropPolicy::Probs, Arithmetic::Megatron)));
    let full = route(&config, 1, &[&[1.0, 0.0], &[3.0, 0.0]]);
    assert!(!full.tokens[0].routes[0].kept, "token 0 is evicted by token 1");
    assert!(full.tokens[1].routes[0].kept);
    // The prefix alone (what a decoder sees at step 0) keeps it: the P probe's leak.
    let prefix = route(&config, 1, &[&[1.0, 0.0]]);
    assert!(prefix.tokens[0].routes[0].kept);
}

#[test]
fn deepspeed_top2_every_first_choice_outranks_every_second_choice() {
    // Scenario 5: T = 4, E = 2, k = 2, cf 0.5: C = ceil(f32(4/2) * f32(0.5*2)) = 2.
    let mut c = cap(0.5, DropPolicy::ChoiceRank, Arithmetic::Deepspeed);
    c.renormalize_after_drop = true;
    let config = token_choice(2, 2, ScoreFn::SoftmaxPre, Some(c));
    let r = route(&config, 1, &[&[1.0, 0.0], &[1.0, 0.0], &[0.0, 1.0], &[0.0, 1.0]]);
    // Expert 1: tokens 0 and 1 chose it 2nd, tokens 2 and 3 1st: the later 1st choices win.
    for t in 0..2 {
        assert_eq!(r.tokens[t].routes, vec![kept(0, 1.0), dropped(1, 1.0 / (1.0 + 1f32.exp()))]);
    }
    for t in 2..4 {
        assert_eq!(r.tokens[t].routes, vec![kept(1, 1.0), dropped(0, 1.0 / (1.0 + 1f32.exp()))]);
    }
    // Position priority would have kept tokens 0 and 1 at expert 1 instead.
    let mut position = config.clone();
    position.capacity.as_mut().unwrap().policy = DropPolicy::Position;
    let r = route(&position, 1, &[&[1.0, 0.0], &[1.0, 0.0], &[0.0, 1.0], &[0.0, 1.0]]);
    assert!(r.tokens[0].routes[1].kept && !r.tokens[2].routes[0].kept);
}

#[test]
fn renormalising_after_a_drop_turns_0_73_into_1() {
    // Scenario 4: token 0's gates are 0.73 / 0.27; token 1 takes expert 1 with 0.9, so token 0's
    // 2nd route is dropped and its surviving weight becomes 1.0 while its expert ids stay the same.
    let mut c = cap(0.5, DropPolicy::Probs, Arithmetic::Deepspeed);
    c.renormalize_after_drop = true;
    let config = token_choice(2, 2, ScoreFn::SoftmaxPre, Some(c));
    let full = route(&config, 1, &[&[ln(0.73), ln(0.27)], &[ln(0.1), ln(0.9)]]);
    assert_eq!(full.capacity, Some(vec![1, 1]));
    let t0 = &full.tokens[0].routes;
    assert_eq!((t0[0].expert, t0[0].weight, t0[0].kept), (0, 1.0, true));
    assert_eq!((t0[1].expert, t0[1].kept), (1, false));
    let prefix = route(&config, 1, &[&[ln(0.73), ln(0.27)]]);
    let w: Vec<f32> = prefix.tokens[0].routes.iter().map(|r| r.weight).collect();
    assert!((w[0] - 0.73).abs() < 1e-6 && (w[1] - 0.27).abs() < 1e-6, "{w:?}");
    assert!(prefix.tokens[0].routes.iter().all(|r| r.kept));
}

#[test]
fn pad_to_capacity_fills_with_the_lowest_index_non_routed_tokens_at_gate_0() {
    // T = 4, E = 2, k = 1, cf 1: C = 2. Everyone wants expert 0; it keeps the two largest gates
    // (tokens 1 and 3). Expert 1 got no route, so it is padded with tokens 0 and 1.
    let mut c = cap(1.0, DropPolicy::Probs, Arithmetic::Megatron);
    c.pad = true;
    let config = token_choice(2, 1, ScoreFn::SoftmaxPre, Some(c));
    let r = route(&config, 1, &[&[2.0, 0.0], &[3.0, 0.0], &[1.0, 0.0], &[4.0, 0.0]]);
    let p = |l: f32| 1.0 / (1.0 + (-l).exp());
    assert_eq!(r.tokens[0].routes, vec![dropped(0, p(2.0)), padded(1)]);
    assert_eq!(r.tokens[1].routes, vec![kept(0, p(3.0)), padded(1)]);
    assert_eq!(r.tokens[2].routes, vec![dropped(0, p(1.0))]);
    assert_eq!(r.tokens[3].routes, vec![kept(0, p(4.0))]);
    assert_eq!((r.experts_load[1].routed, r.experts_load[1].kept, r.experts_load[1].padded), (0, 0, 2));
}

#[test]
fn pad_to_capacity_skips_tokens_already_routed_to_the_expert() {
    // Expert 1 has one route (token 2); the one missing slot goes to token 0.
    let mut c = cap(1.0, DropPolicy::Probs, Arithmetic::Megatron);
    c.pad = true;
    let config = token_choice(2, 1, ScoreFn::SoftmaxPre, Some(c));
    let r = route(&config, 1, &[&[2.0, 0.0], &[3.0, 0.0], &[0.0, 1.0], &[4.0, 0.0]]);
    assert_eq!(r.tokens[0].routes[1], padded(1));
    assert!(r.tokens[1].routes.iter().all(|x| !x.padded));
    assert_eq!(r.experts_load[1].padded, 1);
}

#[test]
fn position_major_flattening_puts_sequence_1_position_0_before_sequence_0_position_1() {
    // Megatron [S, B]: order is (b0,s0), (b1,s0), (b0,s1), (b1,s1). T = 4, E = 2, k = 1: C = 2.
    let config = token_choice(2, 1, ScoreFn::SoftmaxPre, Some(cap(1.0, DropPolicy::Position, Arithmetic::Megatron)));
    let rows: [&[f32]; 4] = [&[1.0, 0.0]; 4];
    let r = route(&config, 2, &rows);
    let kept_at = |b, s| r.token(b, s).routes[0].kept;
    assert!(kept_at(0, 0) && kept_at(1, 0) && !kept_at(0, 1) && !kept_at(1, 1));
    let mut seq_major = config.clone();
    seq_major.scope.flatten = Flatten::SequenceMajor;
    let r = route(&seq_major, 2, &rows);
    let kept_at = |b, s| r.token(b, s).routes[0].kept;
    assert!(kept_at(0, 0) && kept_at(0, 1) && !kept_at(1, 0) && !kept_at(1, 1));
}

#[test]
fn switch_capacity_is_per_sequence_and_first_come() {
    let mut config = preset("switch").unwrap().config().unwrap();
    config.experts = 2;
    config.capacity.as_mut().unwrap().fixed = Some(1);
    let rows: [&[f32]; 4] = [&[1.0, 0.0]; 4];
    let r = route(&config, 2, &rows);
    assert_eq!(r.scope.groups.len(), 2);
    assert_eq!(r.capacity, Some(vec![2, 2]), "one slot per expert in each of two sequences");
    let kept_at = |b, s| r.token(b, s).routes[0].kept;
    assert!(kept_at(0, 0) && !kept_at(0, 1) && kept_at(1, 0) && !kept_at(1, 1));
}

#[test]
fn expert_choice_each_expert_takes_its_top_c_tokens() {
    // E = 2, T = 4, cf 1: C = round(1*4/2) = 2. Expert 0 takes tokens 3 and 0, expert 1 tokens 1 and 2.
    let mut config = preset("expert-choice").unwrap().config().unwrap();
    config.experts = 2;
    config.capacity.as_mut().unwrap().factor = Some(1.0);
    let r = route(&config, 1, &[&[1.0, 0.0], &[0.0, 1.0], &[0.0, 2.0], &[3.0, 0.0]]);
    let experts = |t: usize| r.tokens[t].routes.iter().map(|x| x.expert).collect::<Vec<_>>();
    assert_eq!((experts(0), experts(1), experts(2), experts(3)), (vec![0], vec![1], vec![1], vec![0]));
    assert_eq!(r.top_k, None);
    // Token 0 loses expert 0 when a later token wants it more: not causal.
    let r = route(&config, 1, &[&[1.0, 0.0], &[0.0, 1.0], &[2.0, 0.0], &[3.0, 0.0]]);
    assert!(r.tokens[0].routes.iter().all(|x| x.expert != 0));
}

#[test]
fn tokens_groups_split_the_flattened_order() {
    let mut config =
        token_choice(2, 1, ScoreFn::SoftmaxPre, Some(cap(1.0, DropPolicy::Position, Arithmetic::Megatron)));
    config.scope = ScopeConfig { group: ScopeGroup::Tokens(3), flatten: Flatten::SequenceMajor };
    let rows: [&[f32]; 4] = [&[1.0, 0.0]; 4];
    let r = route(&config, 1, &rows);
    // Groups of 3 and 1 tokens: capacities ceil(3/2) = 2 and ceil(1/2) = 1.
    let caps: Vec<_> = r.scope.groups.iter().map(|g| (g.tokens, g.capacity)).collect();
    assert_eq!(caps, vec![(3, Some(2)), (1, Some(1))]);
    let kept: Vec<bool> = r.tokens.iter().map(|t| t.routes[0].kept).collect();
    assert_eq!(kept, vec![true, true, false, true]);
}

#[test]
fn non_finite_scores_are_errors_naming_batch_position_and_expert() {
    let config = token_choice(2, 1, ScoreFn::SoftmaxPre, None);
    let mut logits = Logits::zeros((2, 3, 2));
    logits[[1, 2, 1]] = f32::NAN;
    let err = assign(&config, logits.view()).unwrap_err().to_string();
    assert_eq!(err, "non-finite score NaN at batch 1, position 2, expert 1");
}

// ---------------------------------------------------------------------------------------------
// The load-balancing routers (issue #6)

#[test]
fn causal_capacity_grows_with_the_prefix() {
    // E = 2, k = 1, cf 1.0: C(t) = ceil((t+1)/2) = 1, 1, 2, 2, 3. Every token wants expert 0;
    // t keeps it iff fewer than C(t) earlier tokens kept it: kept, dropped, kept, dropped, kept.
    let mut config = token_choice(2, 1, ScoreFn::SoftmaxPre, Some(cap(1.0, DropPolicy::Causal, Arithmetic::Megatron)));
    config.scope = ScopeConfig { group: ScopeGroup::Sequence, flatten: Flatten::PositionMajor };
    let rows: Vec<&[f32]> = vec![&[1.0, 0.0]; 5];
    let r = route(&config, 1, &rows);
    let p = 1f32.exp() / (1f32.exp() + 1.0);
    let want = [kept(0, p), dropped(0, p), kept(0, p), dropped(0, p), kept(0, p)];
    for (t, want) in r.tokens.iter().zip(want) {
        assert_eq!(t.routes, [want], "position {}", t.pos);
    }
    assert_eq!(r.tokens.iter().map(|t| t.capacity).collect::<Vec<_>>(), [Some(1), Some(1), Some(2), Some(2), Some(3)]);
    assert_eq!(r.scope.groups[0].capacity, Some(3), "the group's bound is the usual ceil(cf*T*k/E)");
    // The first three positions route the same alone: nothing later was counted.
    let prefix = route(&config, 1, &rows[..3]);
    assert_eq!(prefix.tokens, r.tokens[..3]);
}

#[test]
fn batch_prioritized_serves_the_most_confident_tokens_first() {
    // 2 sequences × 2 tokens, all top-1 on expert 0, C = ceil(4*1/8*1.0) = 1: the largest
    // probability over the batch (0.9 at (0, 1)) keeps it; the earlier 0.6 and the other
    // sequence's 0.8 lose it, whatever their position.
    let config = preset("batch-prioritized").unwrap().config().unwrap();
    let row = |p: f32| {
        let mut v = vec![-30.0f32; 8];
        (v[0], v[1]) = (ln(p), ln(1.0 - p));
        v
    };
    let rows = [row(0.6), row(0.9), row(0.8), row(0.7)];
    let r = route(&config, 2, &rows.iter().map(Vec::as_slice).collect::<Vec<_>>());
    let kept_of: Vec<bool> = r.tokens.iter().map(|t| t.routes[0].kept).collect();
    assert_eq!(kept_of, [false, true, false, false]);
    assert!(r.tokens.iter().all(|t| t.routes[0].expert == 0));
}

#[test]
fn sinkhorn_sends_the_weaker_preference_elsewhere_and_serving_does_not() {
    // exp(logits) = [[e², 1], [e, 1]]: the balanced 2×2 limit is [[a, ½-a], [½-a, a]] with
    // (a / (½-a))² = e, a = √e / (2(1+√e)) ≈ 0.311: token 0 keeps expert 0, token 1 moves to 1.
    let config = preset("sinkhorn").unwrap().config().unwrap();
    let mut c = config.clone();
    c.experts = 2;
    let r = route(&c, 1, &[&[2.0, 0.0], &[1.0, 0.0]]);
    let sigmoid = |x: f32| 1.0 / (1.0 + (-x).exp());
    assert_eq!(r.tokens[0].routes, [kept(0, sigmoid(2.0))]);
    assert_eq!(r.tokens[1].routes, [kept(1, sigmoid(0.0))], "the gate is the token's own score");
    // Served with plain top-1, both take expert 0: one of two tokens routes differently (M).
    let serve = c.inference_config().unwrap().unwrap();
    let s = route(&serve, 1, &[&[2.0, 0.0], &[1.0, 0.0]]);
    assert_eq!((s.tokens[0].routes[0].expert, s.tokens[1].routes[0].expert), (0, 0));
}

#[test]
fn aux_loss_free_bias_moves_against_the_load_and_only_selects() {
    // E = 2, k = 1, sigmoid: logits [1.0, 0.95] send all 3 tokens to expert 0. Loads [3, 0], mean
    // 1.5: one step at rate 0.01 gives bias [-0.01, +0.01]; σ(1) - 0.01 ≈ 0.7211 < σ(0.95) + 0.01
    // ≈ 0.7311, so expert 1 now wins, at its unbiased gate σ(0.95).
    let mut c = preset("aux-loss-free").unwrap().config().unwrap();
    c.experts = 2;
    let tc = c.token_choice_mut().unwrap();
    (tc.top_k, tc.expert_bias) = (1, None);
    let rows: Vec<&[f32]> = vec![&[1.0, 0.95]; 3];
    let before = route(&c, 1, &rows);
    assert!(before.tokens.iter().all(|t| t.routes[0].expert == 0));
    step(&mut c, &Logits::from_shape_vec((1, 3, 2), rows.concat()).unwrap());
    assert_eq!(c.token_choice().unwrap().expert_bias, Some(vec![-0.01, 0.01]));
    let after = route(&c, 1, &rows);
    let sigmoid = |x: f32| 1.0 / (1.0 + (-x).exp());
    assert!(after.tokens.iter().all(|t| t.routes == [kept(1, sigmoid(0.95))]), "{:?}", after.tokens);
}

#[test]
fn batch_priority_ranks_second_choices_by_the_tokens_max_probability() {
    // E = 3, k = 2, cf 0.5: C = ceil(2*2/3*0.5) = 1. Token A = [0.45, 0.35, 0.2], token B = [0.01,
    // 0.19, 0.8]: both 2nd choices want expert 1. BPR serves B first (max probability 0.8 > 0.45),
    // so A's 2nd choice drops although its gate (0.35) beats B's (0.19), which `probs` keeps.
    let mut config = preset("batch-prioritized").unwrap().config().unwrap();
    config.experts = 3;
    config.token_choice_mut().unwrap().top_k = 2;
    config.capacity.as_mut().unwrap().factor = Some(0.5);
    let (a, b) = ([ln(0.45), ln(0.35), ln(0.2)], [ln(0.01), ln(0.19), ln(0.8)]);
    let r = route(&config, 1, &[&a, &b]);
    assert_eq!(r.capacity, Some(vec![1; 3]));
    let close = |x: f32, y: f32| (x - y).abs() < 1e-6;
    let (ta, tb) = (&r.tokens[0].routes, &r.tokens[1].routes);
    assert_eq!((ta[0].expert, ta[0].kept, ta[1].expert, ta[1].kept), (0, true, 1, false));
    assert_eq!((tb[0].expert, tb[0].kept, tb[1].expert, tb[1].kept), (2, true, 1, true));
    assert!(close(ta[1].weight, 0.35) && close(tb[1].weight, 0.19), "gates are the raw probabilities");
    config.capacity.as_mut().unwrap().policy = DropPolicy::Probs;
    let r = route(&config, 1, &[&a, &b]);
    assert_eq!((r.tokens[0].routes[1].kept, r.tokens[1].routes[1].kept), (true, false));
}

/// Expert threshold over 2 experts (docs/ROUTING.md, "Expert threshold").
fn expert_threshold(score: ScoreFn, values: Vec<f32>, factor: f64, ema: f32) -> RouterConfig {
    let mut c = preset("expert-threshold").unwrap().config().unwrap();
    c.name = "hand".into();
    c.experts = values.len();
    c.score = score;
    c.kind = RouterKind::ExpertThreshold(ThresholdConfig { factor, ema, values });
    c
}

/// Softmax of `[ln 3, 0]` as the router computes it in f32: (≈0.75, ≈0.25).
fn three_to_one() -> (f32, f32) {
    let third = (-(3f32.ln())).exp();
    (1.0 / (1.0 + third), third / (1.0 + third))
}

#[test]
fn expert_threshold_takes_tokens_strictly_above_and_a_token_above_none_gets_no_expert() {
    let config = expert_threshold(ScoreFn::SoftmaxPre, vec![0.6, 0.5], 1.0, 0.5);
    let ln3 = 3f32.ln();
    let (big, small) = three_to_one();
    let r = route(&config, 1, &[&[ln3, 0.0], &[0.0, 0.0], &[0.0, ln3]]);
    // t0 (0.75, 0.25): only expert 0 is above its threshold.
    assert_eq!(r.token(0, 0).routes, vec![kept(0, big)]);
    // t1 (0.5, 0.5): below 0.6, and exactly at 0.5 is not above: no expert at all.
    assert_eq!(r.token(0, 1).routes, vec![]);
    assert_eq!(r.token(0, 2).routes, vec![kept(1, big)]);
    assert!(small < 0.5);
    assert_eq!((r.top_k, r.capacity.clone()), (None, None));
    // Sigmoid: a token may take every expert, strongest first, ties to the lower id.
    let config = expert_threshold(ScoreFn::Sigmoid, vec![0.5, 0.5, 0.9], 1.0, 0.5);
    let r = route(&config, 1, &[&[1.0, 1.0, 1.0]]);
    let s = 1.0 / (1.0 + (-1f32).exp());
    assert_eq!(r.token(0, 0).routes, vec![kept(0, s), kept(1, s)]);
}

#[test]
fn expert_threshold_step_moves_each_threshold_toward_its_c_th_best_score() {
    let mut config = expert_threshold(ScoreFn::SoftmaxPre, vec![0.6, 0.3], 1.0, 0.5);
    let ln3 = 3f32.ln();
    let rows = [ln3, 0.0, 0.0, 0.0, 0.0, ln3, 0.0, 0.0];
    let logits = Logits::from_shape_vec((2, 2, 2), rows.to_vec()).unwrap();
    // T 4, E 2, cf 1: c = 2. Expert 0's scores 0.75, 0.5, 0.25, 0.5 → 2nd best 0.5 (a tie,
    // counted); expert 1's likewise 0.5.
    assert_eq!(moe_audit::routing::threshold::quantiles(&config, logits.view()).unwrap(), vec![0.5, 0.5]);
    // A forward reads the thresholds and never moves them.
    let before = assign(&config, logits.view()).unwrap();
    assert_eq!(config.threshold().unwrap().values, vec![0.6, 0.3]);
    step(&mut config, &logits);
    // τ + α(q − τ), α 0.5, in f32.
    assert_eq!(config.threshold().unwrap().values, vec![0.6 + 0.5 * (0.5 - 0.6), 0.3 + 0.5 * (0.5 - 0.3)]);
    // Here the move changes no decision (0.55 and 0.4 split the scores as 0.6 and 0.3 did).
    assert_eq!(assign(&config, logits.view()).unwrap(), before);
    // α 1 sets τ to the quantile: routing the same batch takes expert choice's 2 picks of each
    // expert less the one tied with the 2nd score (0.5 is not above 0.5).
    let RouterKind::ExpertThreshold(t) = &mut config.kind else { unreachable!("an expert-threshold router") };
    t.ema = 1.0;
    step(&mut config, &logits);
    assert_eq!(config.threshold().unwrap().values, vec![0.5, 0.5]);
    let r = assign(&config, logits.view()).unwrap();
    let (big, _) = three_to_one();
    let routes: Vec<Vec<Route>> = r.tokens.iter().map(|t| t.routes.clone()).collect();
    assert_eq!(routes, vec![vec![kept(0, big)], vec![], vec![kept(1, big)], vec![]]);
}

#[test]
fn null_experts_compute_nothing_and_leave_the_record_with_fewer_routes() {
    // 2 real experts and 1 null (id 2); top-2 of softmax over all 3, normalised over the 2.
    let mut config = token_choice(3, 2, ScoreFn::SoftmaxPre, None);
    config.token_choice_mut().unwrap().null_experts = 1;
    config.normalize = Some(true);
    let r = route(&config, 1, &[&[0.0, -20.0, 0.0], &[0.0, 0.0, -20.0], &[-20.0, -20.0, 0.0]]);
    assert_eq!(r.experts, 2, "the record holds the real experts");
    // t0 chose experts 0 and the null 2 (equal probability): half its gate is computed by nobody.
    assert_eq!(r.token(0, 0).routes, vec![kept(0, 0.5)]);
    assert_eq!(r.token(0, 1).routes, vec![kept(0, 0.5), kept(1, 0.5)]);
    // t2 chose the null expert first, then expert 0 (tied with 1: the lower id).
    let t2 = &r.token(0, 2).routes;
    assert_eq!(t2.len(), 1);
    assert_eq!(t2[0].expert, 0);
    let tiny = (-20f32).exp();
    assert!((t2[0].weight - tiny / (1.0 + tiny)).abs() < 1e-12, "{t2:?}");
    let routed: Vec<usize> = r.experts_load.iter().map(|l| l.routed).collect();
    assert_eq!(routed, vec![3, 1]);
}
