//! The analyzer: expected verdicts of the presets, one test per applicable scenario of
//! docs/SCENARIOS.md, false positives, witnesses that replay.

use candle_core::{DType, Device, Tensor};
use moe_audit::analyze::{audit, AuditOptions, Layer, Probe, RouterReport, Subject, Verdict, Witness};
use moe_audit::config::{preset, RouterConfig};
use moe_audit::layer::MoeLayer;
use moe_audit::parallel::Gathered;
use moe_audit::progress::Silent;
use moe_audit::router::{ConfigRouter, Router};
use moe_audit::Routing;
use ndarray::ArrayView3;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use Probe::*;
use Verdict::{Leak, NotApplicable, Pass};

fn options(probes: &[Probe]) -> AuditOptions {
    AuditOptions { probes: probes.to_vec(), batch: 4, seq_len: 32, trials: 16, seed: 0, ranks: 2, exhaustive: false }
}

fn layer_of(config: RouterConfig) -> MoeLayer {
    MoeLayer::seeded(config, 32, 32, 0, DType::F32, &Device::Cpu).unwrap()
}

fn audit_config(config: RouterConfig, probes: &[Probe]) -> RouterReport {
    let layer = layer_of(config);
    audit(&Subject::layer(&layer), &options(probes), &Silent).unwrap()
}

fn audit_preset(name: &str, probes: &[Probe]) -> RouterReport {
    audit_config(config(name), probes)
}

fn config(name: &str) -> RouterConfig {
    preset(name).unwrap().config().unwrap()
}

fn verdicts(r: &RouterReport) -> Vec<Verdict> {
    r.findings.iter().map(|f| f.verdict).collect()
}

fn toml_config(text: &str) -> RouterConfig {
    RouterConfig::from_toml(text, "test.toml").unwrap()
}

#[test]
fn expected_verdicts_of_the_presets() {
    // Issue #3's table, then the other presets with the reason for each verdict.
    let table: [(&str, [Verdict; 5]); 15] = [
        ("mixtral", [Pass, Pass, Pass, Pass, Pass]),
        ("deepseek-v3", [Pass, Pass, Pass, Pass, Pass]),
        ("switch", [Pass, Pass, Pass, Pass, Pass]),
        ("expert-choice", [Leak, Leak, Leak, Leak, Pass]),
        ("megatron-probs", [Leak, Leak, Leak, Leak, Pass]),
        ("megatron-position", [Leak, Pass, Leak, Leak, Pass]),
        ("deepspeed-top2", [Leak, Leak, Leak, Leak, Pass]),
        // megatron-probs plus padding rows: the same gate-priority eviction, and which tokens
        // pad an expert depends on who else routed there.
        ("megatron-probs-pad", [Leak, Leak, Leak, Leak, Pass]),
        // First come in [B, S] order: later tokens of a sequence never outrank earlier ones (F
        // passes), but C comes from T (P) and sequence 0 outranks sequence 1 (N, R).
        ("deepspeed-top1", [Leak, Pass, Leak, Leak, Pass]),
        // Ranked by probability across the batch, renormalised after dropping.
        ("deepspeed-topk-probs", [Leak, Leak, Leak, Leak, Pass]),
        // Per token with a bias that only moves between steps.
        ("aux-loss-free", [Pass, Pass, Pass, Pass, Pass]),
        // C(t) grows with the prefix and counts only earlier tokens of the sequence.
        ("causal-capacity", [Pass, Pass, Pass, Pass, Pass]),
        // Balanced over the whole batch in training.
        ("sinkhorn", [Leak, Leak, Leak, Leak, Pass]),
        ("batch-prioritized", [Leak, Leak, Leak, Leak, Pass]),
        ("expert-choice-tc-serve", [Leak, Leak, Leak, Leak, Pass]),
    ];
    for (name, want) in table {
        let report = audit_preset(name, &[P, F, N, R, D]);
        assert_eq!(verdicts(&report), want, "{name}");
        assert!(report.invariants.is_empty(), "{name}: {:?}", report.invariants);
        for f in report.findings.iter().filter(|f| f.verdict == Leak) {
            assert!(f.rate > 0.0 && f.witness.is_some(), "{name} {}: a leak has a rate and a witness", f.probe);
        }
    }
}

#[test]
fn switch_stays_causal_when_its_fixed_capacity_binds() {
    // The preset's 64 slots never bind at 32 tokens; 3 per sequence do.
    let mut c = config("switch");
    c.capacity.as_mut().unwrap().fixed = Some(3);
    let report = audit_config(c, &[P, F, N, R]);
    assert_eq!(verdicts(&report), [Pass, Pass, Pass, Pass]);
}

#[test]
fn scenario_01_probs_eviction() {
    let c = toml_config(
        "name = \"s1\"\nkind = \"token-choice\"\nexperts = 2\ntop_k = 1\nscore = \"softmax-pre\"\n[capacity]\nfactor = 1.0\npolicy = \"probs\"\n",
    );
    let r = audit_config(c, &[P, F]);
    assert_eq!(verdicts(&r), [Leak, Leak]);
    let w = r.finding(F).unwrap().witness.as_ref().unwrap();
    assert!(w.before.routes[0].kept && !w.after.routes[0].kept, "evicted by a later token: {w:?}");
}

#[test]
fn scenario_02_capacity_from_length() {
    let r = audit_preset("megatron-position", &[P, F]);
    assert_eq!(verdicts(&r), [Leak, Pass]);
    assert!(r.finding(P).unwrap().capacity_changed);
}

#[test]
fn scenario_03_position_priority_across_sequence_major_flattening() {
    // deepspeed-top1: first come in [B, S] order; sequence 0 outranks all of sequence 1.
    let r = audit_preset("deepspeed-top1", &[F, N, R]);
    assert_eq!(verdicts(&r), [Pass, Leak, Leak]);
}

#[test]
fn scenario_04_renormalisation_after_drop_changes_weights_not_ids() {
    let r = audit_preset("deepspeed-topk-probs", &[F]);
    let w = r.finding(F).unwrap().witness.as_ref().unwrap();
    let ids = |t: &moe_audit::routing::TokenRouting| t.routes.iter().map(|x| x.expert).collect::<Vec<_>>();
    assert_eq!(ids(&w.before), ids(&w.after), "same experts");
    let kept_weight =
        |t: &moe_audit::routing::TokenRouting| t.routes.iter().filter(|x| x.kept).map(|x| x.weight).collect::<Vec<_>>();
    assert_ne!(kept_weight(&w.before), kept_weight(&w.after));
    assert!(
        w.after.routes.iter().any(|x| x.kept && (x.weight - 1.0).abs() < 1e-6),
        "the survivor takes all the weight: {w:?}"
    );
}

#[test]
fn scenario_05_choice_rank_priority_loses_the_second_choice() {
    let r = audit_preset("deepspeed-top2", &[F]);
    let w = r.finding(F).unwrap().witness.as_ref().unwrap();
    // Later tokens' 1st choices outrank token t's 2nd choice: changing them takes it (or gives it
    // back), while t's 1st choice is kept either way.
    assert!(
        w.before.routes[0].kept && w.after.routes[0].kept,
        "1st choices are never displaced by later tokens: {w:?}"
    );
    assert_ne!(w.before.routes[1].kept, w.after.routes[1].kept, "{w:?}");
}

#[test]
fn scenario_06_cross_sequence_competition() {
    let r = audit_preset("megatron-probs", &[N, R]);
    assert_eq!(verdicts(&r), [Leak, Leak]);
}

#[test]
fn scenario_07_expert_choice_in_a_decoder() {
    let r = audit_preset("expert-choice", &[P, F, N]);
    assert_eq!(verdicts(&r), [Leak, Leak, Leak]);
}

#[test]
fn scenario_08_batch_prioritised_routing() {
    // V-MoE BPR with k = 1: the batch is served in order of each token's top probability, which
    // for top-1 is exactly keeping each expert's largest gates over the whole batch.
    assert_eq!(verdicts(&audit_preset("batch-prioritized", &[F, N])), [Leak, Leak]);
}

#[test]
fn scenario_09_algorithm_switch_between_train_and_eval() {
    let mut text = preset("expert-choice").unwrap().toml.to_string();
    text.push_str("\n[inference]\nkind = \"token-choice\"\ntop_k = 2\ndropless = true\n");
    let r = audit_config(toml_config(&text), &[M]);
    let f = r.finding(M).unwrap();
    assert_eq!(f.verdict, Leak);
    assert!(f.rate > 0.5, "most tokens route differently, got {}", f.rate);
    // A capacity factor raised for serving is a T/I mismatch too; no [inference] table is n/a.
    let mut text = preset("megatron-probs").unwrap().toml.to_string();
    text.push_str("\n[inference]\ncapacity = { factor = 4.0 }\n");
    assert_eq!(verdicts(&audit_config(toml_config(&text), &[M])), [Leak]);
    assert_eq!(verdicts(&audit_preset("megatron-probs", &[M])), [NotApplicable]);
}

#[test]
fn scenario_11_padding_that_takes_capacity_leaks_on_re_padding() {
    let router = |mask: &str| {
        toml_config(&format!(
            "name = \"pads-{mask}\"\nkind = \"token-choice\"\nexperts = 4\ntop_k = 1\nscore = \"softmax-pre\"\npadding_mask = \"{mask}\"\n\
             [capacity]\nfixed = 4\npolicy = \"position\"\n[scope]\ngroup = \"sequence\"\n"
        ))
    };
    assert_eq!(verdicts(&audit_config(router("compete"), &[R])), [Leak]);
    assert_eq!(verdicts(&audit_config(router("exclude"), &[R])), [Pass]);
}

/// A router that breaks ties at random in eval, like DeepSpeed's random token selection: every
/// call drops a different token of an over-full expert.
struct RandomSelection {
    inner: ConfigRouter,
    calls: AtomicUsize,
}

impl Router for RandomSelection {
    fn name(&self) -> &str {
        "random-selection"
    }
    fn experts(&self) -> usize {
        self.inner.experts()
    }
    fn hidden_size(&self) -> Option<usize> {
        self.inner.hidden_size()
    }
    fn scores(&self, hidden: &Tensor) -> moe_audit::Result<Tensor> {
        self.inner.scores(hidden)
    }
    fn assign(&self, logits: ArrayView3<f32>) -> moe_audit::Result<Routing> {
        let call = self.calls.fetch_add(1, Ordering::SeqCst);
        let mut r = self.inner.assign(logits)?;
        let n = r.tokens.len();
        let t = &mut r.tokens[(call * 7919) % n];
        t.routes.iter_mut().for_each(|x| x.kept = !x.kept);
        Ok(r)
    }
}

#[test]
fn scenario_12_random_selection_in_eval() {
    let layer = layer_of(config("megatron-probs"));
    let router = RandomSelection { inner: layer.router().clone(), calls: AtomicUsize::new(0) };
    let r = audit(&Subject::router(&router), &options(&[D, S]), &Silent).unwrap();
    // Random, not stateful: S changes no more tokens than D, so S is inconclusive.
    assert_eq!(verdicts(&r), [Leak, Verdict::Inconclusive]);
    assert!(r.finding(D).unwrap().note.starts_with("random router (or one that every call changes): "));
    assert!(r.finding(D).unwrap().witness.is_none(), "no config to replay from");
}

/// A router random only in training (HF Mixtral's `router_jitter_noise`, DeepSpeed's
/// `noisy_gate_policy="RSample"`), audited in its serving mode as `check --mode inference`
/// audits a router over the protocol: its [`Router::inference`] is its training mode, where
/// every call drops a different token (as [`RandomSelection`]).
struct RandomInTraining {
    inner: ConfigRouter,
    calls: std::sync::Arc<AtomicUsize>,
    serving: bool,
}

impl Router for RandomInTraining {
    fn name(&self) -> &str {
        "random-in-training"
    }
    fn experts(&self) -> usize {
        self.inner.experts()
    }
    fn hidden_size(&self) -> Option<usize> {
        self.inner.hidden_size()
    }
    fn scores(&self, hidden: &Tensor) -> moe_audit::Result<Tensor> {
        self.inner.scores(hidden)
    }
    fn assign(&self, logits: ArrayView3<f32>) -> moe_audit::Result<Routing> {
        let mut r = self.inner.assign(logits)?;
        if !self.serving {
            let call = self.calls.fetch_add(1, Ordering::SeqCst);
            let n = r.tokens.len();
            r.tokens[(call * 7919) % n].routes.iter_mut().for_each(|x| x.kept = !x.kept);
        }
        Ok(r)
    }
    fn inference(&self) -> moe_audit::Result<Option<Box<dyn Router>>> {
        let calls = std::sync::Arc::clone(&self.calls);
        Ok(Some(Box::new(RandomInTraining { inner: self.inner.clone(), calls, serving: !self.serving })))
    }
    fn hints(&self) -> Option<&dyn moe_audit::router::Hints> {
        Some(self)
    }
}

impl moe_audit::router::Hints for RandomInTraining {
    fn serving(&self) -> bool {
        self.serving
    }
}

#[test]
fn a_router_random_only_in_training_audited_in_inference_mode_leaks_nowhere() {
    // Issue 37: S compared two training-mode calls around an inference call, D had run in
    // inference mode only, and S reported a leak of state ("routes differently in training
    // mode, after an inference call"). Every probe now weighs a mode's calls against D in that
    // mode: D passes (inference is deterministic), S and M, which call training mode, are
    // inconclusive, and nothing leaks.
    let layer = layer_of(config("mixtral"));
    let calls = std::sync::Arc::new(AtomicUsize::new(0));
    let router = RandomInTraining { inner: layer.router().clone(), calls, serving: true };
    let r = audit(&Subject::router(&router), &options(&[P, F, D, S, M]), &Silent).unwrap();
    assert_eq!(verdicts(&r), [Pass, Pass, Pass, Verdict::Inconclusive, Verdict::Inconclusive], "{:#?}", r.findings);
    assert!(!r.leaks());
    let d = &r.finding(D).unwrap().note;
    assert!(d.starts_with("the same call twice; in training mode, 2 of 128 tokens"), "{d}");
    let s = &r.finding(S).unwrap().note;
    assert!(
        s.starts_with("inconclusive: random in training mode (")
            && s.ends_with("the same call routes differently in training mode, after an inference call"),
        "{s}"
    );
    // Audited in training mode, the same router is random where D looks: D leaks.
    let calls = std::sync::Arc::new(AtomicUsize::new(0));
    let router = RandomInTraining { inner: layer.router().clone(), calls, serving: false };
    let r = audit(&Subject::router(&router), &options(&[D, S, M]), &Silent).unwrap();
    assert_eq!(verdicts(&r), [Leak, Verdict::Inconclusive, Verdict::Inconclusive], "{:#?}", r.findings);
}

/// A router whose forward overwrites its own capacity (an eval capacity that persists).
struct MutatingCapacity {
    inner: Mutex<ConfigRouter>,
}

impl Router for MutatingCapacity {
    fn name(&self) -> &str {
        "mutating-capacity"
    }
    fn experts(&self) -> usize {
        8
    }
    fn hidden_size(&self) -> Option<usize> {
        self.inner.lock().unwrap().hidden_size()
    }
    fn scores(&self, hidden: &Tensor) -> moe_audit::Result<Tensor> {
        self.inner.lock().unwrap().scores(hidden)
    }
    fn assign(&self, logits: ArrayView3<f32>) -> moe_audit::Result<Routing> {
        let mut inner = self.inner.lock().unwrap();
        let r = inner.assign(logits)?;
        let mut config = inner.config().unwrap().clone();
        let cap = config.capacity.as_mut().unwrap();
        cap.factor = Some(cap.factor.unwrap() * 0.5);
        *inner = inner.with_config(config)?;
        Ok(r)
    }
}

#[test]
fn scenario_13_state_mutated_by_forward() {
    let layer = layer_of(config("megatron-probs"));
    let router = MutatingCapacity { inner: Mutex::new(layer.router().clone()) };
    let r = audit(&Subject::router(&router), &options(&[D, S]), &Silent).unwrap();
    assert_eq!(verdicts(&r), [Leak, Leak]);
}

/// HF transformers issue 48293: a capacity configured and reported, never enforced.
struct UnenforcedCapacity(ConfigRouter);

impl Router for UnenforcedCapacity {
    fn name(&self) -> &str {
        "unenforced-capacity"
    }
    fn experts(&self) -> usize {
        self.0.experts()
    }
    fn hidden_size(&self) -> Option<usize> {
        self.0.hidden_size()
    }
    fn config(&self) -> Option<&RouterConfig> {
        self.0.config()
    }
    fn scores(&self, hidden: &Tensor) -> moe_audit::Result<Tensor> {
        self.0.scores(hidden)
    }
    fn assign(&self, logits: ArrayView3<f32>) -> moe_audit::Result<Routing> {
        let mut r = self.0.assign(logits)?;
        r.tokens.iter_mut().flat_map(|t| &mut t.routes).for_each(|x| x.kept = true);
        Ok(r)
    }
}

#[test]
fn scenario_14_capacity_silently_not_enforced() {
    let layer = layer_of(config("megatron-probs"));
    let router = UnenforcedCapacity(layer.router().clone());
    let r = audit(&Subject::router(&router), &options(&[D]), &Silent).unwrap();
    assert!(r.leaks());
    assert!(r.invariants.iter().any(|v| v.contains("over its capacity")), "{:?}", r.invariants);
}

#[test]
fn scenario_16_gradient_only_coupling_is_not_a_leak() {
    // A sequence-wise auxiliary loss couples tokens through gradients only; the forward routing is
    // plain top-k, which every forward probe must pass.
    let r = audit_preset("mixtral", &[P, F, N, R, D, S]);
    assert!(!r.leaks(), "{:?}", verdicts(&r));
}

/// The layer with f32 noise that depends on the call's token count, as a different summation
/// order over more rows gives.
struct SummationOrderNoise(MoeLayer);

impl Layer for SummationOrderNoise {
    fn forward(&self, x: &Tensor) -> moe_audit::Result<(Tensor, Routing)> {
        let (y, r) = self.0.forward(x)?;
        let tokens = (x.dims()[0] * x.dims()[1]) as f64;
        Ok(((y.clone() + (y * (1e-7 * tokens))?)?, r))
    }
}

/// A layer whose outputs leak batch-mates into each token (a layer bug, not a routing one).
struct BatchMeanLeak(MoeLayer);

impl Layer for BatchMeanLeak {
    fn forward(&self, x: &Tensor) -> moe_audit::Result<(Tensor, Routing)> {
        let (y, r) = self.0.forward(x)?;
        let mean = x.mean_keepdim(0)?.mean_keepdim(1)?;
        Ok((y.broadcast_add(&(mean * 0.1)?)?, r))
    }
}

#[test]
fn summation_order_noise_is_drift_not_a_leak() {
    let layer = SummationOrderNoise(layer_of(config("mixtral")));
    let r =
        audit(&Subject { router: layer.0.router(), layer: Some(&layer), layouts: &[] }, &options(&[P, N, R]), &Silent)
            .unwrap();
    assert_eq!(verdicts(&r), [Pass, Pass, Pass]);
    assert!(r.finding(P).unwrap().output_drift.is_some_and(|d| d > 0.0), "the drift is measured and reported");
}

#[test]
fn an_output_that_changes_while_routing_does_not_is_a_leak() {
    let layer = BatchMeanLeak(layer_of(config("mixtral")));
    let r = audit(&Subject { router: layer.0.router(), layer: Some(&layer), layouts: &[] }, &options(&[N, D]), &Silent)
        .unwrap();
    assert_eq!(verdicts(&r), [Leak, Pass]);
    assert!(r.finding(N).unwrap().output_leaks > 0);
}

/// A layer whose expert-parallel run scales the last rank's outputs (a combine bug on one rank).
struct LastRankScaled(MoeLayer);

impl Layer for LastRankScaled {
    fn forward(&self, x: &Tensor) -> moe_audit::Result<(Tensor, Routing)> {
        self.0.forward(x)
    }

    fn forward_parallel(&self, x: &Tensor, ranks: usize) -> moe_audit::Result<Option<Gathered>> {
        let mut ep = moe_audit::parallel::forward_in_process(&self.0, x, ranks)?;
        let b = x.dims()[0];
        let last = ep.y.narrow(0, b - b / ranks, b / ranks)?;
        ep.y = Tensor::cat(&[ep.y.narrow(0, 0, b - b / ranks)?, (last * 1.5)?], 0)?;
        Ok(Some(ep))
    }
}

#[test]
fn an_expert_parallel_run_that_differs_from_one_device_is_a_leak() {
    // Mixtral is dropless: its routing passes L, so only the layer run can fail it, on 2 ranks
    // (the sample's two sequences) and on 4 (the sample grows to one sequence per rank).
    for ranks in [2, 4] {
        let layer = LastRankScaled(layer_of(config("mixtral")));
        let options = AuditOptions { ranks, ..options(&[L]) };
        let r =
            audit(&Subject { router: layer.0.router(), layer: Some(&layer), layouts: &[] }, &options, &Silent).unwrap();
        let f = r.finding(L).unwrap();
        assert_eq!((f.verdict, f.affected), (Leak, 0), "{ranks} ranks: {}", f.note);
        assert!(
            f.output_leaks > 0 && f.note.contains(&format!("expert-parallel layer on {ranks} ranks")),
            "{}",
            f.note
        );
    }
    let layer = layer_of(config("mixtral"));
    let r = audit(&Subject::layer(&layer), &options(&[L]), &Silent).unwrap();
    assert_eq!(verdicts(&r), [Pass]);
}

#[test]
fn witnesses_of_long_calls_stay_small_and_replay() {
    // 4 × 2048: every pair is long enough for shrinking to try windows around the witness token
    // (8192 tokens a side; without windows these witnesses are 2 to 44 tokens a side).
    let options = AuditOptions { seq_len: 2048, ..options(&[P, F, N, R]) };
    let dir = std::env::temp_dir().join(format!("moe-audit-long-witness-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for name in ["megatron-probs", "deepspeed-top2"] {
        let layer = layer_of(config(name));
        let r = audit(&Subject::layer(&layer), &options, &Silent).unwrap();
        for f in &r.findings {
            let w = f.witness.as_ref().unwrap_or_else(|| panic!("{name} {}: {:?}", f.probe, f.verdict));
            assert!(w.a.batch * w.a.seq_len <= 48, "{name} {}: {}x{}", f.probe, w.a.batch, w.a.seq_len);
            let path = dir.join(format!("{name}-{}.json", f.probe));
            std::fs::write(&path, serde_json::to_string(w).unwrap()).unwrap();
            assert!(Witness::read(&path).unwrap().replay(&path).unwrap().reproduces(), "{name} {}", f.probe);
        }
    }
}

#[test]
fn every_witness_replays_from_its_file_alone() {
    let dir = std::env::temp_dir().join(format!("moe-audit-witness-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for name in ["megatron-probs", "expert-choice", "deepspeed-top2"] {
        let r = audit_preset(name, &[P, F, N, R]);
        for f in &r.findings {
            let w = f.witness.as_ref().unwrap();
            assert!(
                w.a.batch * w.a.seq_len <= 16,
                "{name} {}: witness not minimal: {}x{}",
                f.probe,
                w.a.batch,
                w.a.seq_len
            );
            let path = dir.join(format!("{name}-{}.json", f.probe));
            std::fs::write(&path, serde_json::to_string(w).unwrap()).unwrap();
            let replay = Witness::read(&path).unwrap().replay(&path).unwrap();
            assert!(replay.reproduces(), "{name} {}", f.probe);
            assert_eq!((&replay.before, &replay.after), (&w.before, &w.after));
            // The same witness against a dropless router does not reproduce.
            let mut fixed = w.clone();
            let router = fixed.router.as_mut().unwrap();
            router.capacity = None;
            router.kind = moe_audit::config::RouterKind::TokenChoice(moe_audit::config::TokenChoice::new(2));
            router.score = moe_audit::config::ScoreFn::SoftmaxPost;
            // An edit not sealed again is refused: the content no longer matches its hash.
            std::fs::write(&path, serde_json::to_string(&fixed).unwrap()).unwrap();
            let err = Witness::read(&path).unwrap().replay(&path).unwrap_err().to_string();
            assert!(err.contains("does not match its `sha256`"), "{err}");
            fixed.seal().unwrap();
            std::fs::write(&path, serde_json::to_string(&fixed).unwrap()).unwrap();
            assert!(!Witness::read(&path).unwrap().replay(&path).unwrap().reproduces());
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_same_audit_gives_the_same_json() {
    let a = serde_json::to_string(&audit_preset("megatron-probs", &[P, F, N, R, D, S])).unwrap();
    let b = serde_json::to_string(&audit_preset("megatron-probs", &[P, F, N, R, D, S])).unwrap();
    assert_eq!(a, b);
}

/// Every float rounded to 4 decimals, so the snapshots claim decisions, not last bits.
fn rounded(v: serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    match v {
        Value::Number(n) if n.is_f64() => serde_json::json!((n.as_f64().unwrap() * 1e4).round() / 1e4),
        Value::Array(a) => Value::Array(a.into_iter().map(rounded).collect()),
        Value::Object(o) => Value::Object(o.into_iter().map(|(k, v)| (k, rounded(v))).collect()),
        other => other,
    }
}

/// A finding's JSON as one line: what a report claims (verdict, counts, rate, the witness's
/// calls and what changed for its token), floats rounded to 4 decimals.
fn claims(f: &serde_json::Value) -> String {
    let first = if f["first_position"].is_null() { "-".to_string() } else { f["first_position"].to_string() };
    let mut line = format!(
        "{} {} {}: {}/{} rate {} first {first} capacity {} outputs {}",
        f["probe"].as_str().unwrap(),
        f["verdict"].as_str().unwrap(),
        f["property"].as_str().unwrap(),
        f["affected"],
        f["compared"],
        f["rate"],
        f["capacity_changed"],
        f["output_leaks"]
    );
    let w = &f["witness"];
    if !w.is_null() {
        line += &format!(
            " | witness {}x{} vs {}x{}, differs {}: {}",
            w["a"]["batch"],
            w["a"]["seq_len"],
            w["b"]["batch"],
            w["b"]["seq_len"],
            w["differs"].as_str().unwrap(),
            f["explain"]["changed"].as_str().unwrap()
        );
    }
    line
}

#[test]
fn json_reports() {
    // Small enough to read: 2 sequences of 8 tokens, 4 trials. The report has no timings.
    let options = AuditOptions {
        probes: Probe::DEFAULT.to_vec(),
        batch: 2,
        seq_len: 8,
        trials: 4,
        seed: 0,
        ranks: 2,
        exhaustive: false,
    };
    let want: [(&str, &[&str], &str); 3] = [
        (
            "mixtral",
            &[
                "P pass C-length: 0/56 rate 0.0 first - capacity false outputs 0",
                "F pass C-content: 0/12 rate 0.0 first - capacity false outputs 0",
                "N pass B: 0/32 rate 0.0 first - capacity false outputs 0",
                "R pass B: 0/56 rate 0.0 first - capacity false outputs 0",
                "D pass D: 0/16 rate 0.0 first - capacity false outputs 0",
                "S pass S: 0/32 rate 0.0 first - capacity false outputs 0",
                "M not-applicable T/I: 0/0 rate 0.0 first - capacity false outputs 0",
                "L pass L: 0/32 rate 0.0 first - capacity false outputs 0",
            ],
            "load cv 0.6124 max/mean 2.0 drop 0.0 aux 1.1035, invariants 0",
        ),
        (
            "megatron-probs",
            &[
                "P leak C-length: 11/56 rate 0.1964 first 0 capacity true outputs 0 | witness 1x2 vs 1x1, differs kept: expert 6 dropped -> kept",
                "F leak C-content: 2/12 rate 0.1667 first 1 capacity false outputs 0 | witness 1x2 vs 1x2, differs kept: expert 6 kept -> dropped",
                "N leak B: 15/32 rate 0.4688 first 1 capacity false outputs 0 | witness 2x2 vs 2x2, differs kept: expert 6 dropped -> kept",
                "R leak B: 8/56 rate 0.1429 first 0 capacity true outputs 0 | witness 2x2 vs 1x2, differs kept: expert 1 dropped -> kept",
                "D pass D: 0/16 rate 0.0 first - capacity false outputs 0",
                "S pass S: 0/32 rate 0.0 first - capacity false outputs 0",
                "M not-applicable T/I: 0/0 rate 0.0 first - capacity false outputs 0",
                "L leak L: 4/32 rate 0.125 first 0 capacity true outputs 0 | witness 2x2 vs 1x2, differs kept: expert 1 dropped -> kept",
            ],
            "load cv 0.6124 max/mean 2.0 drop 0.2813 aux 1.1035, invariants 0",
        ),
        (
            "expert-choice",
            &[
                "P leak C-length: 30/56 rate 0.5357 first 0 capacity true outputs 0 | witness 1x3 vs 1x1, differs experts, capacity: experts [e1 0.3782, e3 0.1245] -> none; the capacity in force changed",
                "F leak C-content: 7/12 rate 0.5833 first 0 capacity false outputs 0 | witness 1x3 vs 1x3, differs experts: experts [e1 0.3782, e3 0.1245] -> [e1 0.3782, e6 0.1385, e3 0.1245]",
                "N leak B: 23/32 rate 0.7188 first 0 capacity false outputs 0 | witness 2x2 vs 2x2, differs experts: experts [e1 0.3782, e6 0.1385, e3 0.1245] -> [e1 0.3782, e6 0.1385]",
                "R leak B: 20/56 rate 0.3571 first 0 capacity true outputs 0 | witness 2x2 vs 1x2, differs experts, capacity: experts [e2 0.1149] -> none; the capacity in force changed",
                "D pass D: 0/16 rate 0.0 first - capacity false outputs 0",
                "S pass S: 0/32 rate 0.0 first - capacity false outputs 0",
                "M not-applicable T/I: 0/0 rate 0.0 first - capacity false outputs 0",
                "L leak L: 8/32 rate 0.25 first 0 capacity true outputs 0 | witness 2x2 vs 1x2, differs experts, capacity: experts [e2 0.1149] -> none; the capacity in force changed",
            ],
            "load cv 0.0 max/mean 1.0 drop 0.0 aux 1.0, invariants 0",
        ),
    ];
    for (name, findings, load) in want {
        let layer = layer_of(config(name));
        let report = audit(&Subject::layer(&layer), &options, &Silent).unwrap();
        let json = rounded(serde_json::to_value(&report).unwrap());
        assert_eq!(json["router"], name);
        let got: Vec<String> = json["findings"].as_array().unwrap().iter().map(claims).collect();
        assert_eq!(got, findings, "{name}");
        let l = &json["load"];
        let got = format!(
            "load cv {} max/mean {} drop {} aux {}, invariants {}",
            l["load_cv"],
            l["max_over_mean_load"],
            l["drop_rate"],
            l["aux_loss"],
            json["invariants"].as_array().unwrap().len()
        );
        assert_eq!(got, load, "{name}");
        if name == "megatron-probs" {
            // The prose of one finding, as every format prints it.
            let e = &json["findings"][0]["explain"];
            let text = |k: &str| e[k].as_str().unwrap().to_string();
            let calls = e["calls"].as_array().unwrap().iter().map(|c| c.as_str().unwrap()).collect::<Vec<_>>();
            let prose = format!(
                "{}\ncause: {}\nchanged: {}\nfix: {}",
                calls.join(" vs "),
                text("cause"),
                text("changed"),
                text("fix")
            );
            insta::assert_snapshot!(prose, @r"
            the sequence of 2 tokens vs its prefix of 1 token
            cause: the nearest removed token, 1 position later
            changed: expert 6 dropped -> kept
            fix: capacity is shared by the whole batch (or rank), so later tokens and other sequences compete for this token's slot: go dropless, or keep capacity per sequence by position (causal capacity); raising cf only makes overflow rarer (docs/sweep/sweep.md, 4x64 tokens, 8 experts, k=2: dropless mixtral leaks 0.0% at max/mean load 1.234; causal-capacity at cf 1.25 leaks 0.0% and drops 6.8%; megatron-probs at cf 2 still changes 0.1% under P)
            ");
        }
    }
}

/// Megatron-LM's `probs` dropping with a capacity factor so large that nothing drops: the
/// capacity in force still follows the tokens routed, no decision does.
fn capacity_only(factor: f64) -> RouterConfig {
    let mut c = config("megatron-probs");
    c.capacity.as_mut().unwrap().factor = Some(factor);
    c
}

#[test]
fn a_capacity_only_change_is_latent_and_its_witness_replays_as_latent() {
    // Routing is the full record, the capacity in force included (docs/PROPERTIES.md): a
    // capacity computed from the call's length changes under P before it changes a decision:
    // latent, not a leak. The rate counts decisions (0%), the report says only the capacity
    // changed, and the witness replays as latent (exit 1 by default) with both capacities.
    let r = audit_config(capacity_only(64.0), &[P]);
    let f = &r.findings[0];
    assert_eq!((f.verdict, f.capacity_changed, f.affected), (Verdict::Latent, true, 0), "{}", f.note);
    assert!(!r.leaks() && r.latent());
    let w = f.witness.as_ref().expect("a witness of the capacity change");
    assert_eq!(w.before.routes, w.after.routes);
    let path = std::env::temp_dir().join(format!("moe-audit-capacity-only-{}.json", std::process::id()));
    std::fs::write(&path, serde_json::to_string(w).unwrap()).unwrap();
    let replay = Witness::read(&path).unwrap().replay(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert!(replay.reproduces() && replay.diff.capacity && !replay.diff.decision());
    assert_eq!(replay.verdict(), Verdict::Latent);
    // How the report and the replay say it: src/render/text.rs's tests.
}

#[test]
fn l_on_a_batch_the_ranks_do_not_split_runs_on_its_largest_prefix_that_does() {
    // Batch 3 over the default 2 ranks: L said "pass, 0 tokens differ" without comparing a
    // single rank layout. It compares the first 2 sequences now, and leaks as at batch 4.
    let at = |batch| {
        let layer = layer_of(config("megatron-probs"));
        audit(&Subject::layer(&layer), &AuditOptions { batch, ..options(&[L]) }, &Silent).unwrap().findings[0].clone()
    };
    let (three, four) = (at(3), at(4));
    assert_eq!((three.verdict, four.verdict), (Leak, Leak), "{} | {}", three.note, four.note);
    assert!(three.note.contains("2 ranks of 1 sequence; on the first 2 of 3 sequences"), "{}", three.note);
    // One sequence cannot be laid out over 2 ranks: n/a with the reason, never a pass.
    let one = at(1);
    assert_eq!(one.verdict, NotApplicable, "{}", one.note);
    assert!(one.note.starts_with("rank layouts not compared: needs a batch of at least 2 sequences"), "{}", one.note);
}

mod witness_props {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 8, failure_persistence: None, ..ProptestConfig::default() })]

        /// Every witness an audit writes replays with the audit's verdict (a leak as a leak, a
        /// capacity-only change as latent: the capacity in force is part of the record), and
        /// after the fix (dropless: no capacity) with no leak: exit 0.
        #[test]
        fn every_witness_replays_with_the_audits_verdict(
            name in prop::sample::select(vec!["megatron-probs", "megatron-position", "deepspeed-top2", "deepspeed-top1"]),
            factor in prop::sample::select(vec![1.0, 1.5, 64.0]),
            seed in 0u64..1000,
            batch in 2usize..5,
        ) {
            let mut c = config(name);
            c.capacity.as_mut().unwrap().factor = Some(factor);
            let layer = MoeLayer::seeded(c, 32, 32, seed, DType::F32, &Device::Cpu).unwrap();
            let options = AuditOptions { seed, batch, seq_len: 12, trials: 4, ..options(&[P, F, N, R, L, D, S]) };
            let r = audit(&Subject::layer(&layer), &options, &Silent).unwrap();
            let path = std::env::temp_dir().join(format!("moe-audit-prop-{}-{name}.json", std::process::id()));
            for f in &r.findings {
                let Some(w) = &f.witness else { continue };
                std::fs::write(&path, serde_json::to_string(w).unwrap()).unwrap();
                let replay = Witness::read(&path).unwrap().replay(&path).unwrap();
                prop_assert_eq!(replay.verdict(), f.verdict, "{} {}: {}", name, f.probe, f.note);
                let mut fixed = w.clone();
                fixed.router.as_mut().unwrap().capacity = None;
                fixed.seal().unwrap();
                std::fs::write(&path, serde_json::to_string(&fixed).unwrap()).unwrap();
                let replay = Witness::read(&path).unwrap().replay(&path).unwrap();
                prop_assert!(!replay.reproduces(), "{} {} after the fix: {:?}", name, f.probe, replay.diff);
            }
            let _ = std::fs::remove_file(&path);
        }
    }
}
