//! Numerical and size edge cases: ties everywhere, non-finite and extreme scores, E = 1, k = E,
//! a capacity of 0, sequences of one token. Each is an exact decision, a clear error, or a
//! report; never a panic.

use candle_core::{DType, Device};
use moe_audit::analyze::{audit, AuditOptions, Probe, Subject, Verdict};
use moe_audit::config::{preset, presets, RouterConfig, RouterKind};
use moe_audit::layer::MoeLayer;
use moe_audit::progress::Silent;
use moe_audit::{assign, Logits, Routing};

fn config(name: &str) -> RouterConfig {
    preset(name).unwrap().config().unwrap()
}

fn route_const(config: &RouterConfig, b: usize, s: usize, value: f32) -> moe_audit::Result<Routing> {
    assign(config, Logits::from_elem((b, s, config.experts), value).view())
}

#[test]
fn all_equal_logits_tie_to_the_lowest_expert_then_the_lowest_token() {
    for p in presets() {
        let c = p.config().unwrap();
        let r = route_const(&c, 2, 8, 0.25).unwrap();
        match c.kind {
            RouterKind::TokenChoice(_) => {
                // Every token picks experts 0..k in order.
                for t in &r.tokens {
                    let ids: Vec<usize> = t.routes.iter().filter(|x| !x.padded).map(|x| x.expert).collect();
                    assert_eq!(ids, (0..c.k()).collect::<Vec<_>>(), "{} token ({}, {})", p.name, t.batch, t.pos);
                }
                // A capacity-limited router keeps expert 0's first routes in its group's order.
                if let Some(cap) = &r.capacity {
                    assert!(r.experts_load[0].kept <= cap[0], "{}", p.name);
                }
            }
            RouterKind::ExpertThreshold(_) => {
                // Every token alike: each takes the same experts (here none: 1/8 < 2/8).
                assert!(r.tokens.iter().all(|t| t.routes == r.tokens[0].routes), "{}", p.name);
            }
            RouterKind::ExpertChoice(_) => {
                // Each expert takes the same first C tokens of the group order (sequence-major
                // for this preset): those tokens get every expert, the rest none.
                let c0 = r.scope.groups[0].capacity.unwrap();
                assert!(r.tokens[..c0].iter().all(|t| t.routes.len() == c.experts), "{}", p.name);
                assert!(r.tokens[c0..].iter().all(|t| t.routes.is_empty()), "{}", p.name);
            }
        }
    }
}

#[test]
fn infinities_and_nan_are_errors_that_name_the_token() {
    for p in presets() {
        let c = p.config().unwrap();
        for (bad, shown) in [(f32::INFINITY, "inf"), (f32::NEG_INFINITY, "-inf"), (f32::NAN, "NaN")] {
            let mut logits = Logits::zeros((2, 3, c.experts));
            logits[[1, 2, c.experts - 1]] = bad;
            let err = assign(&c, logits.view()).unwrap_err().to_string();
            let want = format!("non-finite score {shown} at batch 1, position 2, expert {}", c.experts - 1);
            assert_eq!(err, want, "{}", p.name);
        }
    }
}

#[test]
fn subnormal_logits_tie_after_a_softmax_and_order_before_one() {
    // exp of a subnormal is exactly 1 in f32, so routers that select on probabilities see a tie
    // everywhere (lowest ids win); routers that select on the logits see 5e-45 > 4e-45 > ...
    // Either way the weights are finite and equal.
    let row: Vec<f32> = (0..8).map(|e| f32::from_bits(e as u32 + 1)).collect();
    assert!(row.iter().all(|x| x.is_subnormal()));
    for (name, want) in [("mixtral", [0, 1]), ("megatron-probs", [7, 6])] {
        let r = assign(&config(name), Logits::from_shape_vec((1, 1, 8), row.clone()).unwrap().view()).unwrap();
        let routes = &r.tokens[0].routes;
        assert_eq!(routes.iter().map(|x| x.expert).collect::<Vec<_>>(), want, "{name}");
        assert!(routes.iter().all(|x| x.weight == 0.5), "{name}: {routes:?}");
    }
}

#[test]
fn huge_logits_do_not_overflow_the_softmax() {
    // exp(1000) overflows f32; the softmax must subtract the maximum first.
    let c = config("mixtral");
    let mut row = vec![-1000.0f32; c.experts];
    row[3] = 1000.0;
    row[5] = 999.0;
    let r = assign(&c, Logits::from_shape_vec((1, 1, c.experts), row).unwrap().view()).unwrap();
    let routes = &r.tokens[0].routes;
    assert_eq!((routes[0].expert, routes[1].expert), (3, 5));
    let first = 1.0 / (1.0 + (-1.0f32).exp());
    assert!((routes[0].weight - first).abs() < 1e-6 && (routes[1].weight - (1.0 - first)).abs() < 1e-6, "{routes:?}");
    assert!(r.stats.aux_loss.is_finite());
}

#[test]
fn one_expert_takes_every_token_at_weight_one() {
    for name in ["mixtral", "megatron-probs", "deepspeed-top1"] {
        let mut c = config(name);
        c.experts = 1;
        let tc = c.token_choice_mut().unwrap();
        (tc.top_k, tc.expert_bias, tc.group_limit) = (1, None, None);
        let r = route_const(&c, 2, 5, 0.3).unwrap();
        for t in &r.tokens {
            assert_eq!(t.routes.len(), 1, "{name}");
            assert_eq!((t.routes[0].expert, t.routes[0].weight), (0, 1.0), "{name}");
        }
        assert_eq!(r.stats.max_over_mean_load, 1.0);
    }
}

#[test]
fn top_k_equal_to_experts_routes_every_expert_in_score_order() {
    let mut c = config("mixtral");
    c.token_choice_mut().unwrap().top_k = c.experts;
    let row: Vec<f32> = (0..c.experts).map(|e| [0.5, -1.0, 2.0, 0.0, 1.5, -0.5, 1.0, -2.0][e % 8]).collect();
    let r = assign(&c, Logits::from_shape_vec((1, 1, c.experts), row).unwrap().view()).unwrap();
    let ids: Vec<usize> = r.tokens[0].routes.iter().map(|x| x.expert).collect();
    assert_eq!(ids, vec![2, 4, 6, 0, 3, 5, 1, 7]);
    let sum: f32 = r.tokens[0].routes.iter().map(|x| x.weight).sum();
    assert!((sum - 1.0).abs() < 1e-6);
}

#[test]
fn a_capacity_of_zero_drops_everything_and_says_so() {
    let mut c = config("megatron-probs");
    let cap = c.capacity.as_mut().unwrap();
    cap.factor = None;
    cap.fixed = Some(0);
    let r = route_const(&c, 2, 4, 0.0).unwrap();
    assert_eq!(r.capacity, Some(vec![0; c.experts]));
    assert!(r.tokens.iter().all(|t| t.routes.iter().all(|x| !x.kept)));
    assert_eq!(r.stats.drop_rate, 1.0);
    // The layer outputs zeros, and the audit reports rather than fails.
    let layer = MoeLayer::seeded(c, 16, 32, 0, DType::F32, &Device::Cpu).unwrap();
    let x = moe_audit::layer::Seeded::new(1).normal(&[2, 4, 16], &Device::Cpu).unwrap();
    let (y, _) = layer.forward(&x).unwrap();
    assert_eq!(y.abs().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap(), 0.0);
    let options = AuditOptions { batch: 2, seq_len: 4, ..AuditOptions::default() };
    let report = audit(&Subject::layer(&layer), &options, &Silent).unwrap();
    assert_eq!(report.load.drop_rate, 1.0);
}

#[test]
fn sequences_of_one_token_route_and_audit() {
    for p in presets() {
        let c = p.config().unwrap();
        let r = route_const(&c, 3, 1, 0.1).unwrap();
        assert_eq!(r.tokens.len(), 3, "{}", p.name);
        let layer = MoeLayer::seeded(c, 16, 32, 0, DType::F32, &Device::Cpu).unwrap();
        let options = AuditOptions { batch: 2, seq_len: 1, trials: 4, ..AuditOptions::default() };
        let report = audit(&Subject::layer(&layer), &options, &Silent).unwrap();
        // P and F need a later token; with one token per sequence there is none.
        for probe in [Probe::P, Probe::F] {
            assert_eq!(report.finding(probe).unwrap().verdict, Verdict::NotApplicable, "{} {probe}", p.name);
        }
    }
}
