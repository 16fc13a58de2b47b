//! A dependence no decision showed: the capacity in force changes while no decision does. It is
//! its own verdict, `latent` (docs/PROPERTIES.md, "Latent"), not `LEAK 0.0%` beside real leaks,
//! and it fails the default gate (`--fail-on leak,latent`).
//!
//! The example is DeepSpeed's top-2 gate served with `eval_capacity_factor=2.0`: in eval,
//! `TopKGate.forward` passes `self.eval_capacity_factor` as the capacity factor of `top2gating`
//! (deepspeedai/DeepSpeed@v0.19.8, deepspeed/moe/sharded_moe.py:575-586), whose capacity
//! `_capacity(gates, capacity_factor * 2, min_capacity)` (:364) is computed from the call's tokens
//! (:152-162), as the `deepspeed-top2` preset's is. python/tests/test_deepspeed.py audits
//! DeepSpeed's own gate served so (`top2-eval-capacity-inference`: with its seeded weights and
//! DeepSpeed's `min_capacity` 8, P is latent and F, N, R, L leak).

use super::cli::{file, tmp_dir};
use candle_core::{DType, Device, Tensor};
use moe_audit::analyze::{audit, verdicts, AuditOptions, Probe, RouterReport, Subject, Verdict};
use moe_audit::config::{preset, RouterConfig};
use moe_audit::layer::MoeLayer;
use moe_audit::progress::Silent;
use moe_audit::router::{ConfigRouter, Hints, Router};
use moe_audit::Routing;
use ndarray::ArrayView3;
use std::process::Command;
use Probe::*;
use Verdict::{Latent, Leak};

const BIN: &str = env!("CARGO_BIN_EXE_moe-audit");

/// The `deepspeed-top2` preset (training capacity factor 1.0) with DeepSpeed's
/// `eval_capacity_factor = 2.0` as its `[inference]` table.
fn deepspeed_top2_eval_cf2() -> String {
    let preset = preset("deepspeed-top2").unwrap().toml;
    format!(
        "{}\n[inference]\ncapacity = {{ factor = 2.0 }}\n",
        preset.replace("\"deepspeed-top2\"", "\"ds-top2-eval-cf2\"")
    )
}

/// A router audited in its serving mode, as `check --mode inference` audits a router command:
/// every probe's calls are routed by its `[inference]` rule, M's other calls by its training one.
/// No configuration is exposed (a router command has none), so no witness is built.
struct Served {
    serving: ConfigRouter,
    training: ConfigRouter,
}

impl Served {
    fn new(layer: &MoeLayer) -> Served {
        let training = layer.router().clone();
        let inference = training.config().unwrap().inference_config().unwrap().expect("an [inference] table");
        Served { serving: training.with_config(inference).unwrap(), training }
    }
}

impl Router for Served {
    fn name(&self) -> &str {
        "ds-top2-eval-cf2"
    }
    fn experts(&self) -> usize {
        self.serving.experts()
    }
    fn hidden_size(&self) -> Option<usize> {
        self.serving.hidden_size()
    }
    fn scores(&self, hidden: &Tensor) -> moe_audit::Result<Tensor> {
        self.serving.scores(hidden)
    }
    fn assign(&self, logits: ArrayView3<f32>) -> moe_audit::Result<Routing> {
        self.serving.assign(logits)
    }
    fn inference(&self) -> moe_audit::Result<Option<Box<dyn Router>>> {
        Ok(Some(Box::new(self.training.clone())))
    }
    fn hints(&self) -> Option<&dyn Hints> {
        Some(self)
    }
}

impl Hints for Served {
    fn serving(&self) -> bool {
        true
    }
}

const PROBES: [Probe; 6] = [P, F, N, R, M, L];

/// The sizes python/tests/test_deepspeed.py audits at: with two sequences, F's and N's targeted
/// rows are a quarter and half of the call, enough to bind twice the mean load. (At the default
/// 4 x 128 they are not, and F and N pass: every dependence there is latent.)
fn options() -> AuditOptions {
    AuditOptions { probes: PROBES.to_vec(), batch: 2, seq_len: 16, trials: 8, seed: 0, ranks: 2, exhaustive: false }
}

fn served_report() -> RouterReport {
    let config = RouterConfig::from_toml(&deepspeed_top2_eval_cf2(), "ds-top2-eval-cf2.toml").unwrap();
    let layer = MoeLayer::seeded(config, 16, 32, 0, DType::F32, &Device::Cpu).unwrap();
    audit(&Subject::router(&Served::new(&layer)), &options(), &Silent).unwrap()
}

#[test]
fn deepspeed_top2_served_at_eval_capacity_factor_2_is_latent_where_no_decision_changed() {
    let r = served_report();
    // P, R, L: another call length, batch, layout states another capacity; at twice the mean
    // load it never binds on these inputs. F and N push tokens toward one expert: it binds.
    // M: training's factor 1.0 drops what serving's 2.0 keeps.
    let expected = [(P, Latent), (F, Leak), (N, Leak), (R, Latent), (M, Leak), (L, Latent)];
    assert_eq!(verdicts(&r), expected, "{:#?}", r.findings);
    for f in &r.findings {
        match f.verdict {
            Latent => assert!(f.affected == 0 && f.rate == 0.0 && f.capacity_changed, "{f:#?}"),
            _ => assert!(f.affected > 0 && f.rate > 0.0, "a real leak keeps its rate: {f:#?}"),
        }
    }
    assert!(r.leaks() && r.latent());
}

/// Runs the binary: (exit code, stdout).
fn run(args: &[&str]) -> (i32, String) {
    let out = Command::new(BIN).args(args).output().expect("run moe-audit");
    assert!(out.stderr.is_empty(), "moe-audit {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    (out.status.code().expect("exit code"), String::from_utf8(out.stdout).expect("utf-8"))
}

/// The serving rule as a router file: `deepspeed-top2` at DeepSpeed's eval capacity factor.
fn served_rule_file() -> String {
    let text = preset("deepspeed-top2").unwrap().toml.replace("factor = 1.0", "factor = 2.0");
    file("ds-top2-cf2.toml", &text.replace("\"deepspeed-top2\"", "\"ds-top2-cf2\""))
}

const SIZES: [&str; 8] = ["--batch", "2", "--seq-len", "16", "--trials", "8", "--hidden", "16"];

#[test]
fn a_latent_finding_fails_the_default_gate_and_fail_on_counts_it() {
    let rule = served_rule_file();
    let check = |extra: &[&str]| run(&[&["check", &rule, "--probes", "P,R,L"], &SIZES[..], extra].concat());
    let (code, text) = check(&[]);
    assert_eq!(code, 1, "latent fails by default: {text}");
    assert!(!text.contains("LEAK"), "{text}");
    for probe in ["P prefix  ", "R re-batch", "L layout  "] {
        let row = text.lines().find(|l| l.contains(probe)).unwrap_or_else(|| panic!("{probe}: {text}"));
        assert!(row.contains(" latent ") && row.contains("   0.0%  "), "{row}");
        assert!(row.contains("the capacity in force changed, no decision did"), "{row}");
    }
    assert!(text.contains("no leak found in 1 router(s)\n"), "{text}");
    assert!(text.ends_with("1 of 1 router(s) latent: ds-top2-cf2 (P R L): the capacity in force depends on what a token must not see; no decision changed on these inputs, one does where the capacity binds\n"), "{text}");
    assert_eq!(check(&["--fail-on", "leak"]).0, 0, "only latent: `--fail-on leak` passes it");
    assert_eq!(check(&["--fail-on", "latent"]).0, 1);
    assert_eq!(check(&["--fail-on", "leak,drift"]).0, 0);
    let (_, json) = check(&["--format", "json"]);
    let report: serde_json::Value = serde_json::from_str(&json).unwrap();
    let findings = report["routers"][0]["findings"].as_array().unwrap();
    // 0.2.0's fields of a capacity-only change stay as they were; the verdict is its own.
    for f in findings {
        assert_eq!(
            (&f["verdict"], &f["affected"], &f["capacity_changed"]),
            (&"latent".into(), &0.into(), &true.into())
        );
    }
    let (_, md) = check(&["--format", "markdown"]);
    assert!(md.contains("| ⏳ latent | C-length | 0.0% |") && md.contains("\n⏳ 1 of 1 router(s) latent: "), "{md}");
    let (_, junit) = check(&["--format", "junit"]);
    assert!(junit.contains("failures=\"3\"") && junit.contains("<failure type=\"latent\""), "{junit}");
    let (_, html) = check(&["--format", "html"]);
    assert!(html.contains("<span class=\"v latent\">latent</span>") && html.contains("summary latent"), "{html}");
    let (_, github) = check(&["--github", "--format", "json"]);
    assert!(github.contains("::error title=moe-audit%3A ds-top2-cf2 is latent on P prefix::"), "{github}");
}

#[test]
fn a_latent_witness_replays_as_latent() {
    let dir = tmp_dir().join("latent-witnesses");
    let _ = std::fs::remove_dir_all(&dir);
    let rule = served_rule_file();
    let dir_s = dir.to_str().unwrap();
    assert_eq!(run(&[&["check", &rule, "--probes", "P", "--witness-dir", dir_s], &SIZES[..]].concat()).0, 1);
    let witness = dir.join("ds-top2-cf2-P.json");
    let witness = witness.to_str().unwrap();
    let (code, text) = run(&["replay", witness]);
    assert_eq!(code, 1, "{text}");
    assert!(
        text.starts_with("LATENT reproduced: router ds-top2-cf2, probe P (prefix), property C-length: token "),
        "{text}"
    );
    assert!(text.contains("routes differently (capacity)") && text.contains(", capacity "), "{text}");
    assert_eq!(run(&["replay", witness, "--fail-on", "leak"]).0, 0, "no decision changes: not a leak");
}

#[test]
fn a_whole_model_whose_capacity_never_binds_is_latent() {
    // Megatron's `probs` dropping at capacity factor 64 in the built-in decoder: the capacity
    // follows the call's tokens (a prefix, a re-batch, the generation path's calls), no decision
    // or output moves. Every case of those probes is latent, none leaks.
    let text = preset("megatron-probs").unwrap().toml.replace("factor = 1.0", "factor = 64.0");
    let rule = file("mp-cf64.toml", &text.replace("\"megatron-probs\"", "\"mp-cf64\""));
    let dir = tmp_dir().join("latent-model-witnesses");
    let _ = std::fs::remove_dir_all(&dir);
    let audit = |extra: &[&str]| {
        run(&[&["model", &rule, "--layers", "2", "--batch", "2", "--seq-len", "16", "--trials", "4"], extra].concat())
    };
    let (code, json) = audit(&["--format", "json", "--witness-dir", dir.to_str().unwrap()]);
    assert_eq!(code, 1, "latent fails by default: {json}");
    let report: serde_json::Value = serde_json::from_str(&json).unwrap();
    let seen: Vec<(&str, &str, u64, u64)> = (report["findings"].as_array().unwrap().iter())
        .map(|f| {
            (
                f["probe"].as_str().unwrap(),
                f["verdict"].as_str().unwrap(),
                f["leak_cases"].as_u64().unwrap(),
                f["latent_cases"].as_u64().unwrap(),
            )
        })
        .collect();
    for &(probe, verdict, leak_cases, latent_cases) in &seen {
        match ["P", "R", "G"].contains(&probe) {
            true => assert!(verdict == "latent" && leak_cases == 0 && latent_cases > 0, "{seen:?}"),
            false => assert_eq!((verdict, leak_cases, latent_cases), ("pass", 0, 0), "{seen:?}"),
        }
    }
    assert_eq!(audit(&["--fail-on", "leak"]).0, 0);
    let (_, text) = audit(&[]);
    assert!(text.contains("P prefix       C-length  latent ") && !text.contains("LEAK"), "{text}");
    assert!(text.contains("  5 cases change only the capacity in force, no decision (latent)\n"), "{text}");
    let replay = |extra: &[&str]| {
        let witness = dir.join("builtin-mp-cf64-P.json");
        run(&[&["model", &rule, "--layers", "2", "--replay", witness.to_str().unwrap()], extra].concat())
    };
    let (code, line) = replay(&[]);
    assert_eq!(code, 1, "{line}");
    assert_eq!(line, "builtin-mp-cf64 P prefix: sequence 0, position 0 at layer 1: LATENT reproduced\n");
    assert_eq!(replay(&["--fail-on", "leak"]).0, 0);
}
