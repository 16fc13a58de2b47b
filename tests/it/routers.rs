//! The load-balancing routers of issue #6 in the analyzer: aux-loss-free balancing stays
//! deterministic and stateless while its bias moves toward balance, causal capacity stays causal
//! when it binds, and M measures how often training and serving rules disagree.

use candle_core::{DType, Device, Tensor};
use moe_audit::analyze::{audit, AuditOptions, Probe, RouterReport, Subject, Verdict};
use moe_audit::config::{preset, RouterConfig};
use moe_audit::layer::{MoeLayer, Seeded};
use moe_audit::progress::Silent;
use moe_audit::router::{logits_to_host, Router};
use moe_audit::routing::{diff_token, StepBatch};
use moe_audit::Routing;
use ndarray::ArrayView3;
use std::sync::Mutex;
use Probe::*;
use Verdict::{Leak, Pass};

const HIDDEN: usize = 32;

fn options(probes: &[Probe]) -> AuditOptions {
    AuditOptions { probes: probes.to_vec(), batch: 4, seq_len: 32, trials: 8, seed: 0, ranks: 2, exhaustive: false }
}

fn config(name: &str) -> RouterConfig {
    preset(name).unwrap().config().unwrap()
}

fn layer_of(config: RouterConfig) -> MoeLayer {
    MoeLayer::seeded(config, HIDDEN, 32, 0, DType::F32, &Device::Cpu).unwrap()
}

fn run(subject: &Subject, probes: &[Probe]) -> RouterReport {
    audit(subject, &options(probes), &Silent).unwrap()
}

fn verdicts(r: &RouterReport) -> Vec<Verdict> {
    r.findings.iter().map(|f| f.verdict).collect()
}

fn batch(seed: u64) -> Tensor {
    Seeded::new(seed).normal(&[4, 32, HIDDEN], &Device::Cpu).unwrap()
}

/// Hidden states with a common mean (as real activations have): the gate then prefers some
/// experts systematically, an imbalance balancing can remove (sampling noise it cannot).
fn skewed(seed: u64, seq_len: usize) -> Tensor {
    (Seeded::new(seed).normal(&[4, seq_len, HIDDEN], &Device::Cpu).unwrap() + 0.5).unwrap()
}

#[test]
fn aux_loss_free_moves_toward_balance_between_steps_and_passes_d_and_s() {
    let mut layer = layer_of(config("aux-loss-free"));
    let eval = skewed(1_000, 256);
    let cv = |layer: &MoeLayer| layer.forward(&eval).unwrap().1.stats.load_cv;
    let first_cv = cv(&layer);
    for step in 0..60u64 {
        if step % 30 == 0 {
            let r = run(&Subject::layer(&layer), &[P, F, N, R, D, S]);
            assert_eq!(verdicts(&r), [Pass; 6], "step {step}");
        }
        let bias = |layer: &MoeLayer| layer.router().config().unwrap().token_choice().unwrap().expert_bias.clone();
        let before = bias(&layer);
        let x = skewed(step, 64);
        let (_, routing) = layer.forward(&x).unwrap();
        assert_eq!(bias(&layer), before, "a forward changed the bias");
        let logits = logits_to_host(&layer.router().scores(&x).unwrap()).unwrap();
        layer.step(&StepBatch { logits: logits.view(), loads: &routing.experts_load }).unwrap();
    }
    let last_cv = cv(&layer);
    assert!(last_cv < 0.5 * first_cv, "load CV {first_cv} -> {last_cv}: the bias did not balance");
    assert_eq!(verdicts(&run(&Subject::layer(&layer), &[P, F, N, R, D, S])), [Pass; 6]);
}

/// The same rule applied inside every forward: the bug the explicit step avoids.
struct UpdatesInForward {
    config: Mutex<RouterConfig>,
    experts: usize,
}

impl Router for UpdatesInForward {
    fn name(&self) -> &str {
        "updates-in-forward"
    }
    fn experts(&self) -> usize {
        self.experts
    }
    fn scores(&self, hidden: &Tensor) -> moe_audit::Result<Tensor> {
        Ok(hidden.clone())
    }
    fn assign(&self, logits: ArrayView3<f32>) -> moe_audit::Result<Routing> {
        let mut config = self.config.lock().unwrap();
        let routing = moe_audit::assign(&config, logits)?;
        config.step(&StepBatch { logits: logits.view(), loads: &routing.experts_load })?;
        Ok(routing)
    }
}

#[test]
fn balancing_inside_the_forward_fails_d_and_s() {
    let mut c = config("aux-loss-free");
    c.token_choice_mut().unwrap().bias_update_rate = Some(0.05);
    let router = UpdatesInForward { experts: c.experts, config: Mutex::new(c) };
    let r = run(&Subject::router(&router), &[D, S]);
    // Every call changes the bias, so the same call twice already differs (D), and S's changes
    // are no more than that: S is inconclusive, D names the cause.
    assert_eq!(verdicts(&r), [Leak, Verdict::Inconclusive]);
    assert!(r.findings[0].note.contains("or one that every call changes"), "{}", r.findings[0].note);
}

#[test]
fn causal_capacity_stays_causal_where_it_binds() {
    let mut c = config("causal-capacity");
    c.capacity.as_mut().unwrap().factor = Some(0.5);
    let layer = layer_of(c.clone());
    let (_, routing) = layer.forward(&batch(0)).unwrap();
    assert!(routing.stats.drop_rate > 0.2, "capacity must bind: drop rate {}", routing.stats.drop_rate);
    let r = run(&Subject::layer(&layer), &[P, F, N, R, D, S]);
    assert_eq!(verdicts(&r), [Pass; 6]);
    // The same capacity over the batch in position order is the usual leak.
    c.capacity.as_mut().unwrap().policy = moe_audit::config::DropPolicy::Position;
    c.scope.group = moe_audit::config::ScopeGroup::Batch;
    let leaky = run(&Subject::layer(&layer_of(c)), &[P, N]);
    assert_eq!(verdicts(&leaky), [Leak, Leak]);
}

/// Share of the audit's base tokens that the training and serving configs route differently,
/// counted here from the two records.
fn mismatch(layer: &MoeLayer) -> f64 {
    let o = options(&[M]);
    let x = Seeded::new(o.seed).normal(&[o.batch, o.seq_len, HIDDEN], &Device::Cpu).unwrap();
    let logits = logits_to_host(&layer.router().scores(&x).unwrap()).unwrap();
    let train = layer.router().assign(logits.view()).unwrap();
    let serve = layer.router().inference().unwrap().unwrap().assign(logits.view()).unwrap();
    let differ = train
        .tokens
        .iter()
        .filter(|t| diff_token(&train, (t.batch, t.pos), &serve, (t.batch, t.pos)).decision())
        .count();
    differ as f64 / train.tokens.len() as f64
}

#[test]
fn m_reports_how_often_training_and_serving_disagree() {
    for name in ["sinkhorn", "expert-choice-tc-serve"] {
        let layer = layer_of(config(name));
        let f = run(&Subject::layer(&layer), &[M]).findings.remove(0);
        assert_eq!(f.verdict, Leak, "{name}");
        let want = mismatch(&layer);
        assert!(want > 0.0 && want < 1.0, "{name}: some tokens agree, some do not ({want})");
        assert_eq!(f.rate, want, "{name}");
    }
}

#[test]
fn scenario_15_bf16_flips_sit_at_near_ties() {
    let layer = layer_of(config("mixtral"));
    let o = AuditOptions { probes: vec![X], batch: 4, seq_len: 256, trials: 1, seed: 0, ranks: 2, exhaustive: false };
    let f = audit(&Subject::layer(&layer), &o, &Silent).unwrap().findings.remove(0);
    let n = f.numerics.as_ref().unwrap();
    let bf16 = &n.flips[0];
    assert_eq!((bf16.dtype.as_str(), bf16.tokens), ("bf16", 1024));
    assert!(bf16.flipped > 0 && f.verdict == Verdict::Drift, "precision drift, not a leak: {bf16:?}");
    assert!(bf16.median_margin_at_flips.unwrap() < bf16.median_margin.unwrap() / 10.0, "flips are near-ties: {bf16:?}");
    assert_eq!(bf16.margins_at_flips.iter().map(|b| b.count).sum::<usize>(), bf16.flipped);
    assert!(f.witness.is_some(), "a flip replays from its witness");
    // Swamping: f16 stalls on long sums, f32 and pairwise do not.
    let last = n.swamping.last().unwrap();
    assert!(last.f16 > 0.5 && last.f32 < 1e-4 && last.f16_pairwise < 1e-3, "{last:?}");
    // X is opt-in.
    assert!(!Probe::DEFAULT.contains(&X));
}
