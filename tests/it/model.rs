//! Whole models on token ids: the built-in decoder's verdicts per router (every layer, first
//! layer, propagation), the generation path against the forward, a non-causal attention layer
//! caught, witnesses that replay, and a model over `moe-audit/3` with every protocol failure
//! ending in one line and exit 2.

use moe_audit::analyze::Probe;
use moe_audit::analyze::Verdict;
use moe_audit::model::audit::replay;
use moe_audit::model::{audit_model, Builtin, BuiltinSpec, Model, ModelAuditOptions, ModelReport};
use moe_audit::RouterConfig;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_moe-audit");

fn builtin(router: &str, non_causal: Option<usize>) -> Builtin {
    let router = RouterConfig::load(router).expect("preset");
    Builtin::new(BuiltinSpec { router, layers: 4, vocab: 64, hidden: 32, ffn: 32, seed: 3, non_causal }).expect("model")
}

fn options() -> ModelAuditOptions {
    ModelAuditOptions { probes: Probe::MODEL.to_vec(), batch: 2, seq_len: 16, trials: 6, seed: 0, prefill: 8 }
}

fn audit(model: &Builtin) -> ModelReport {
    audit_model(model, &options()).expect("audit")
}

fn verdict(r: &ModelReport, p: Probe) -> Verdict {
    r.finding(p).expect("ran").verdict
}

#[test]
fn a_dropless_model_passes_every_layer() {
    let r = audit(&builtin("mixtral", None));
    for f in &r.findings {
        assert!(matches!(f.verdict, Verdict::Pass | Verdict::Drift), "{:?}: {:?} ({})", f.probe, f.verdict, f.note);
        assert_eq!(f.outputs.changed, 0, "{:?}", f.probe);
        assert!(f.layers.iter().all(|t| t.changed == 0), "{:?}", f.probe);
    }
    // Every routed layer was compared, outputs too.
    let p = r.finding(Probe::P).unwrap();
    assert_eq!(p.layers.iter().map(|t| t.layer).collect::<Vec<_>>(), vec![1, 2, 3]);
    assert!(p.outputs.compared > 0 && p.layers.iter().all(|t| t.compared == p.outputs.compared));
}

#[test]
fn expert_choice_leaks_first_at_the_first_moe_layer_and_spreads() {
    let r = audit(&builtin("expert-choice", None));
    for p in [Probe::P, Probe::F, Probe::N] {
        let f = r.finding(p).unwrap();
        assert_eq!(f.verdict, Verdict::Leak, "{p:?}");
        assert_eq!(f.first_layer, Some(1), "{p:?}");
        let later = &f.layers[2];
        assert!(later.inherited > 0, "{p:?}: the leak does not reach layer {}", later.layer);
        let w = f.witness.as_ref().expect("witness");
        assert_eq!(w.layer, Some(1));
    }
    assert_eq!(verdict(&r, Probe::D), Verdict::Pass);
    assert_eq!(verdict(&r, Probe::S), Verdict::Pass);
}

#[test]
fn batch_capacity_leaks_at_layer_one_and_generation_differs_for_real() {
    let r = audit(&builtin("megatron-probs", None));
    let p = r.finding(Probe::P).unwrap();
    assert_eq!((p.verdict, p.first_layer), (Verdict::Leak, Some(1)));
    let g = r.finding(Probe::G).unwrap();
    assert_eq!(g.verdict, Verdict::Leak, "{}", g.note);
    assert!(g.layers[0].changed > g.layers[0].near_ties, "capacity makes real differences at layer 1");
}

#[test]
fn a_non_causal_attention_layer_is_caught_in_outputs_and_routing_from_there_on() {
    let r = audit(&builtin("mixtral", Some(2)));
    let p = r.finding(Probe::P).unwrap();
    assert_eq!(p.verdict, Verdict::Leak);
    assert!(p.outputs.changed > 0);
    assert_eq!(p.first_layer, Some(2), "layer 1 sees no later token; layer 2's MoE reads the leaky attention");
    assert_eq!(p.layers[0].changed, 0);
    // Generation cannot see later tokens: it disagrees with the leaky forward.
    assert_eq!(verdict(&r, Probe::G), Verdict::Leak);
}

#[test]
fn witnesses_replay_against_the_live_model() {
    let model = builtin("expert-choice", None);
    let r = audit(&model);
    let w = r.finding(Probe::F).unwrap().witness.clone().expect("witness");
    assert_eq!(replay(&model, &w).expect("replay"), Verdict::Leak);
    // The same witness on a dropless model of the same name no longer leaks.
    let mut fixed = w.clone();
    fixed.model = builtin("mixtral", None).info().name.clone();
    assert_eq!(replay(&builtin("mixtral", None), &fixed).expect("replay"), Verdict::Pass);
}

#[test]
fn the_audit_is_deterministic() {
    let a = serde_json::to_string(&audit(&builtin("megatron-probs", None))).unwrap();
    let b = serde_json::to_string(&audit(&builtin("megatron-probs", None))).unwrap();
    assert_eq!(a, b);
}

fn run(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(BIN).args(args).current_dir(env!("CARGO_MANIFEST_DIR")).output().expect("run");
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.code().unwrap_or(-1), text(&out.stdout), text(&out.stderr))
}

const SMALL: &[&str] = &["--batch", "2", "--seq-len", "8", "--trials", "4", "--timeout", "30"];

fn toy(how: &str) -> (i32, String, String) {
    let cmd = format!("python3 tests/it/routers/toy_model3.py {how}");
    let mut args = vec!["model", "--cmd", cmd.as_str()];
    args.extend_from_slice(SMALL);
    run(&args)
}

#[test]
fn check_model_builtin_through_the_binary() {
    let (code, out, err) =
        run(&["model", "expert-choice", "--layers", "3", "--batch", "2", "--seq-len", "8", "--trials", "2"]);
    assert_eq!(code, 1, "{err}");
    assert!(
        out.starts_with("model builtin-expert-choice: vocab 256; layers 0 dense, 1-2 moe (8 experts, expert choice)"),
        "{out}"
    );
    assert!(out.contains("first at layer 1"), "{out}");
    let (code, _, err) = run(&["model", "mixtral", "--layers", "1"]);
    assert_eq!(code, 2);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("has no MoE layer"), "{err}");
    assert_eq!(
        crate::routes::bad(&["model", "mixtral", "--probes", "P,L"]),
        "error: --probes: unknown probe `L` for a whole model: expected letters of P,F,N,R,D,S,M,G\n"
    );
}

#[test]
fn a_model_over_the_protocol_is_audited_at_every_layer() {
    let (code, out, err) = toy("ok");
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("layers 0 dense, 1-2 moe (4 experts, top 1)"), "{out}");
    let (code, out, err) = toy("leaky");
    assert_eq!(code, 1, "{out}{err}");
    assert!(out.contains("first at layer 2"), "{out}");
}

#[test]
fn protocol_failures_are_one_line_and_exit_2() {
    for (how, want) in [
        ("missing", "request 1 (train, forward, batch 2 x seq_len 8): layer 2 is missing (the response lists layers [1], the handshake [1, 2])"),
        ("changing", "request 2 ("),
        ("bytes", "the header says"),
        ("nomoe", "model `toy-nomoe` has no MoE layer: nothing to audit"),
    ] {
        let (code, out, err) = toy(how);
        assert_eq!(code, 2, "{how}: {out}{err}");
        assert_eq!(err.trim().lines().count(), 1, "{how}: {err}");
        assert!(err.contains(want), "{how}: {err}");
    }
}

#[test]
fn a_witness_with_token_ids_beyond_the_vocabulary_is_refused() {
    let model = builtin("expert-choice", None);
    let mut w = audit(&model).finding(Probe::P).unwrap().witness.clone().expect("witness");
    w.model = "builtin-expert-choice".into();
    w.b.tokens[0] = 1000;
    let dir = std::env::temp_dir().join(format!("moe-audit-it-model-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("w.json");
    std::fs::write(&path, serde_json::to_string(&w).unwrap()).unwrap();
    let path = path.to_str().unwrap();
    let (code, _, err) = run(&[
        "model",
        "expert-choice",
        "--hidden",
        "32",
        "--ffn",
        "32",
        "--vocab",
        "64",
        "--seed",
        "3",
        "--replay",
        path,
    ]);
    assert_eq!(code, 2, "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("token id 1000 at batch 0, position 0 is not below vocab 64"), "{err}");
}
