//! Routers outside moe-audit, through the binary: the moe-audit/1 subprocess protocol (the
//! Python examples, and every way a router can misbehave), trace files, real gate weights and
//! the CI report formats.
//!
//! The Python examples need python3 with numpy (`.ci/run` installs it). Without numpy the tests
//! that run them print a notice and pass on a developer machine, and fail when `CI` is set.

use crate::routes::bad;
use candle_core::{DType, Device, Tensor};
use moe_audit::analyze::{Probe, Report, Verdict};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_moe-audit");
const MIXTRAL: &str = "python3 python/examples/mixtral_router.py";
const MEGATRON: &str = "python3 python/examples/megatron_probs_router.py";

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("moe-audit-it-external-{}", std::process::id())).join(name);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// The environment of a Python router run from the checkout: the `moe_audit` package importable
/// from `python/` (a user has it from `pip install moe-audit`), and no bytecode left in the tree.
pub(crate) fn python_env() -> [(&'static str, std::ffi::OsString); 2] {
    let mut path = std::ffi::OsString::from(repo().join("python"));
    if let Some(more) = std::env::var_os("PYTHONPATH").filter(|p| !p.is_empty()) {
        path.push(":");
        path.push(more);
    }
    [("PYTHONDONTWRITEBYTECODE", "1".into()), ("PYTHONPATH", path)]
}

/// A command run from the repository root with the Python environment above.
fn python(program: &str) -> Command {
    let mut command = Command::new(program);
    command.current_dir(repo()).envs(python_env());
    command
}

fn run(args: &[&str]) -> Output {
    python(BIN).args(args).output().expect("run moe-audit")
}

/// Whether python3 with numpy is here; without it, a notice (or a failure under CI).
pub(crate) fn numpy() -> bool {
    let ok = Command::new("python3").args(["-c", "import numpy"]).output().is_ok_and(|o| o.status.success());
    if !ok {
        assert!(
            std::env::var_os("CI").is_none(),
            "python3 with numpy is required under CI: python3 -m pip install numpy"
        );
        eprintln!(
            "NOTICE: python3 with numpy not found; skipping the Python router tests (python3 -m pip install numpy)"
        );
    }
    ok
}

/// Runs `check --format json` and returns the exit code and the report.
fn check_json(args: &[&str]) -> (i32, Report) {
    let mut all = vec!["check", "--format", "json", "--batch", "2", "--seq-len", "32", "--trials", "8"];
    all.extend_from_slice(args);
    let out = run(&all);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(matches!(out.status.code(), Some(0 | 1)), "moe-audit {all:?}: {:?}\n{err}", out.status);
    (out.status.code().unwrap(), serde_json::from_slice(&out.stdout).expect("a JSON report"))
}

fn verdicts(report: &Report) -> Vec<(Probe, Verdict)> {
    report.routers.iter().flat_map(moe_audit::analyze::verdicts).collect()
}

const MEGATRON_VERDICTS: [(Probe, Verdict); 8] = [
    (Probe::P, Verdict::Leak),
    (Probe::F, Verdict::Leak),
    (Probe::N, Verdict::Leak),
    (Probe::R, Verdict::Leak),
    (Probe::D, Verdict::Pass),
    (Probe::S, Verdict::Pass),
    (Probe::M, Verdict::Pass),
    // Per-rank capacity: each rank's tokens compete for a smaller capacity of their own.
    (Probe::L, Verdict::Leak),
];

#[test]
fn mixtral_style_python_router_passes_every_probe() {
    if !numpy() {
        return;
    }
    let (code, report) = check_json(&["--router-cmd", MIXTRAL]);
    assert_eq!(code, 0);
    assert_eq!(report.routers[0].router, "mixtral-py");
    assert_eq!(verdicts(&report), Probe::DEFAULT.iter().map(|&p| (p, Verdict::Pass)).collect::<Vec<_>>());
    assert!(report.routers[0].invariants.is_empty());
}

#[test]
fn megatron_probs_style_python_router_leaks_on_p_f_n_r() {
    if !numpy() {
        return;
    }
    let (code, report) = check_json(&["--router-cmd", MEGATRON]);
    assert_eq!(code, 1);
    assert_eq!(verdicts(&report), MEGATRON_VERDICTS);
    // Capacity ceil(T*k/E) with T the tokens of the call: the prefix has a smaller one.
    assert!(report.routers[0].finding(Probe::P).unwrap().capacity_changed);
}

#[test]
fn trace_files_give_the_subprocess_verdicts() {
    if !numpy() {
        return;
    }
    let dir = tmp("megatron-trace");
    let dir_s = dir.to_str().unwrap();
    let out = run(&[
        "plan",
        "--output-dir",
        dir_s,
        "--name",
        "megatron-probs-py",
        "--experts",
        "8",
        "--top-k",
        "2",
        "--batch",
        "2",
        "--seq-len",
        "32",
        "--trials",
        "8",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // Before the harness ran: a clear error, not a verdict.
    let err = bad(&["check", "--traces", dir_s]);
    assert!(err.contains("decisions.jsonl: cannot read"), "{err}");
    let harness =
        python("python3").args(["python/examples/megatron_probs_router.py", "--answer-plan", dir_s]).output().unwrap();
    assert!(harness.status.success(), "{}", String::from_utf8_lossy(&harness.stderr));
    let (code, traced) = check_json(&["--traces", dir_s]);
    let (_, live) = check_json(&["--router-cmd", MEGATRON]);
    assert_eq!(code, 1);
    assert_eq!(verdicts(&traced), MEGATRON_VERDICTS);
    // Same inputs, same answers: the same findings, rates included.
    assert_eq!(traced.routers, live.routers);

    // A decision missing, then one with a wrong shape: clear errors naming the call.
    let decisions = std::fs::read_to_string(dir.join("decisions.jsonl")).unwrap();
    let lines: Vec<&str> = decisions.lines().collect();
    std::fs::write(dir.join("decisions.jsonl"), lines[..lines.len() - 1].join("\n")).unwrap();
    let err = bad(&["check", "--traces", dir_s]);
    assert!(err.contains(&format!("no response for call {}", lines.len())), "{err}");
    let mut wrong = lines.clone();
    let short = r#"{"id": 1, "tokens": [], "capacity": null}"#;
    wrong[0] = short;
    std::fs::write(dir.join("decisions.jsonl"), wrong.join("\n")).unwrap();
    let err = bad(&["check", "--traces", dir_s]);
    assert!(
        err.contains("call 1 (train, batch 2 x seq_len 32): 0 tokens, expected batch 2 x seq_len 32 = 64"),
        "{err}"
    );
}

/// Every file `plan` and `snapshot plan` write gets the mode a new file gets here (0666 less
/// the umask): the inputs were once 0600 beside a 0644 manifest.
#[cfg(unix)]
#[test]
fn plan_outputs_share_the_normal_file_mode() {
    use std::os::unix::fs::PermissionsExt;
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    let dir = tmp("plan-modes");
    let normal = dir.join("normal");
    std::fs::write(&normal, b"").unwrap();
    let plan = dir.join("plan");
    let snap = dir.join("snapshot-plan");
    let (p, s) = (plan.to_str().unwrap(), snap.to_str().unwrap());
    let plan_args = ["plan", "--output", p, "--experts", "4", "--top-k", "2", "--batch", "1", "--seq-len", "2"];
    let snapshot_args = ["snapshot", "plan", s, "--experts", "4", "--top-k", "2"];
    for (args, out) in [(&plan_args[..], &plan), (&snapshot_args[..], &snap)] {
        let run = run(args);
        assert!(run.status.success(), "{args:?}: {}", String::from_utf8_lossy(&run.stderr));
        let mut files: Vec<_> = std::fs::read_dir(out).unwrap().map(|e| e.unwrap().path()).collect();
        files.sort();
        assert!(files.iter().any(|f| f.ends_with("inputs.safetensors")), "{files:?}");
        for f in &files {
            assert_eq!(mode(f), mode(&normal), "{}", f.display());
        }
    }
}

#[test]
fn trace_plan_covers_hidden_input_routers() {
    if !numpy() {
        return;
    }
    let dir = tmp("mixtral-trace");
    let dir_s = dir.to_str().unwrap();
    let args = [
        "plan",
        "--output",
        dir_s,
        "--name",
        "mixtral-py",
        "--experts",
        "8",
        "--top-k",
        "2",
        "--input",
        "hidden",
        "--hidden",
        "32",
    ];
    let out = run(&[&args[..], &["--batch", "2", "--seq-len", "32", "--trials", "8"]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let harness =
        python("python3").args(["python/examples/mixtral_router.py", "--answer-plan", dir_s]).output().unwrap();
    assert!(harness.status.success(), "{}", String::from_utf8_lossy(&harness.stderr));
    let (code, report) = check_json(&["--traces", dir_s]);
    assert_eq!(code, 0);
    assert_eq!(verdicts(&report), Probe::DEFAULT.iter().map(|&p| (p, Verdict::Pass)).collect::<Vec<_>>());
}

#[test]
fn the_pytorch_recipe_compiles() {
    let out = python("python3")
        .args(["-c", "import ast; ast.parse(open('python/examples/torch_router.py').read())"])
        .output();
    let Ok(out) = out else {
        return eprintln!("NOTICE: no python3; skipping");
    };
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// A router written in sh: the handshake, then `answer` for every request line.
fn sh_router(handshake: &str, answer: &str) -> String {
    format!("printf '%s\\n' '{handshake}'; while read -r line; do {answer}; done")
}

const HS: &str = r#"{"protocol": "moe-audit/1", "name": "sh", "experts": 2, "top_k": 1, "input": "logits"}"#;

/// `check` on a 1 x 1 batch with a misbehaving router: exit 2, one error line.
fn protocol_error(command: &str, extra: &[&str]) -> String {
    let mut args = vec!["check", "--router-cmd", command, "--batch", "1", "--seq-len", "1", "--probes", "D"];
    args.extend_from_slice(extra);
    let started = std::time::Instant::now();
    let out = run(&args);
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(out.status.code(), Some(2), "{command}: {err}");
    assert!(out.stdout.is_empty());
    assert!(err.starts_with("error: ") && err.trim_end().lines().count() == 1, "{err}");
    assert!(started.elapsed().as_secs() < 10, "took {:?}", started.elapsed());
    err.trim_end().to_string()
}

#[test]
fn misbehaving_routers_are_clear_errors() {
    let ok = r#"printf '%s\n' '{"id": 1, "tokens": [[{"expert": 0, "weight": 1.0, "kept": true}]], "capacity": null}'"#;
    let cases = [
        (sh_router(HS, "echo hello"), "request 1 (train, batch 1 x seq_len 1): not a response (expected value at line 1 column 1): `hello`"),
        (sh_router(HS, r#"printf '%s\n' '{"id": 7, "tokens": [], "capacity": null}'"#), "request 1 (train, batch 1 x seq_len 1): response id 7 does not match"),
        (sh_router(HS, r#"printf '%s\n' '{"id": 1, "tokens": [], "capacity": null}'"#), "request 1 (train, batch 1 x seq_len 1): 0 tokens, expected batch 1 x seq_len 1 = 1"),
        (
            sh_router(HS, r#"printf '%s\n' '{"id": 1, "tokens": [[{"expert": 2, "weight": 1.0, "kept": true}]], "capacity": null}'"#),
            "request 1 (train, batch 1 x seq_len 1): token 0 (batch 0, position 0): expert 2 is out of range 0 to 1",
        ),
        (
            sh_router(HS, r#"printf '%s\n' '{"id": 1, "tokens": [[{"expert": 0, "weight": 1.0, "kept": true}]], "capacity": [1]}'"#),
            "request 1 (train, batch 1 x seq_len 1): capacity has 1 entries, expected one per expert (2)",
        ),
        (
            sh_router(HS, "echo oops >&2; exit 3"),
            "the router exited (exit status: 3) before answering request 1 (train, batch 1 x seq_len 1); its stderr ends: oops",
        ),
        // Answers the first request only: D's second call finds it gone.
        (
            format!("printf '%s\\n' '{HS}'; read -r line; {ok}"),
            "the router exited (exit status: 0) before answering request 2 (train, batch 1 x seq_len 1)",
        ),
        ("echo '{\"protocol\": \"moe-audit/0\"}'".to_string(), "bad handshake (missing field `name` at line 1 column 27)"),
        (sh_router(&HS.replace("\"top_k\": 1", "\"top_k\": 3"), "true"), "bad handshake (handshake: top_k 3 is not from 1 to 2)"),
        ("true".to_string(), "the router exited (exit status: 0) before its handshake"),
    ];
    for (command, want) in cases {
        let err = protocol_error(&command, &[]);
        assert!(err.contains(want), "{command}\n  got:  {err}\n  want: {want}");
        assert!(err.starts_with("error: router `"), "{err}");
    }
}

#[test]
fn a_hanging_router_times_out_and_is_killed() {
    let pid_file = tmp("hang").join("pid");
    let command = format!("echo $$ > {}; {}", pid_file.display(), sh_router(HS, "sleep 30"));
    let err = protocol_error(&command, &["--timeout", "0.5"]);
    assert!(err.contains("timed out after 0.5 s (--timeout) waiting for the answer to request 1 (train, batch 1 x seq_len 1); the router was killed"), "{err}");
    let pid = std::fs::read_to_string(&pid_file).unwrap();
    let alive = Command::new("kill").args(["-0", pid.trim()]).output().unwrap().status.success();
    assert!(!alive, "the router process {pid} is still running");
}

/// A safetensors file with a gate `[experts, hidden]` (and a bias) under real-looking names.
fn checkpoint(name: &str, tensors: &[(&str, Tensor)]) -> String {
    let path = tmp("weights").join(name);
    let map: HashMap<String, Tensor> = tensors.iter().map(|(n, t)| (n.to_string(), t.clone())).collect();
    candle_core::safetensors::save(&map, &path).unwrap();
    path.to_str().unwrap().to_string()
}

fn gate(experts: usize, hidden: usize) -> Tensor {
    let mut seeded = moe_audit::layer::Seeded::new(7);
    seeded.normal(&[experts, hidden], &Device::Cpu).unwrap()
}

#[test]
fn real_gate_weights_are_audited() {
    const MIXTRAL_GATE: &str = "model.layers.3.block_sparse_moe.gate.weight";
    let file = checkpoint("mixtral.safetensors", &[(MIXTRAL_GATE, gate(8, 16).to_dtype(DType::BF16).unwrap())]);
    let (code, report) = check_json(&[
        "mixtral",
        "megatron-probs",
        "--weights",
        &file,
        "--gate",
        MIXTRAL_GATE,
        "--probes",
        "P,F,N,R,D,S",
    ]);
    assert_eq!(code, 1);
    let v: Vec<Verdict> = report.routers.iter().flat_map(|r| r.findings.iter().map(|f| f.verdict)).collect();
    use Verdict::{Leak, Pass};
    assert_eq!(v, [Pass, Pass, Pass, Pass, Pass, Pass, Leak, Leak, Leak, Leak, Pass, Pass]);

    // Real hidden states: tokens sampled (seeded) from the file's rows; same bytes every run.
    let states = checkpoint("states.safetensors", &[("h", gate(40, 16).reshape((4, 10, 16)).unwrap())]);
    let sampled =
        ["mixtral", "--weights", &file, "--gate", MIXTRAL_GATE, "--hidden-states", &states, "--probes", "P,F"];
    let (code, report) = check_json(&sampled);
    assert_eq!((code, verdicts(&report)), (0, vec![(Probe::P, Pass), (Probe::F, Pass)]));
    let (_, seeded) = check_json(&["mixtral", "--weights", &file, "--gate", MIXTRAL_GATE, "--probes", "P,F"]);
    assert_ne!(report.routers[0].load, seeded.routers[0].load, "the states file is used");
    let twice = |args: &[&str]| run(&[&["check", "--format", "json"], args].concat()).stdout;
    assert_eq!(twice(&sampled), twice(&sampled));
    let bad = checkpoint("bad-states.safetensors", &[("a", gate(3, 5)), ("b", gate(3, 16))]);
    for (spec, want) in [
        (bad.clone(), "holds 2 tensors: name one as FILE:TENSOR".to_string()),
        (format!("{bad}:a"), "tensor `a` has shape [3, 5], expected [..., 16] (the gate's hidden size)".to_string()),
    ] {
        let out = run(&["check", "mixtral", "--weights", &file, "--gate", MIXTRAL_GATE, "--hidden-states", &spec]);
        assert_eq!(String::from_utf8(out.stderr).unwrap().trim_end(), format!("error: {bad}: {want}"));
    }

    // DeepSeek-V3: a gate with 256 experts would do; the preset's expert count is what matters.
    let experts = moe_audit::RouterConfig::load("deepseek-v3").unwrap().experts;
    let bias = Tensor::arange(0f32, experts as f32, &Device::Cpu).unwrap();
    let file = checkpoint(
        "deepseek.safetensors",
        &[("mlp.gate.weight", gate(experts, 16)), ("mlp.gate.e_score_correction_bias", bias)],
    );
    let (code, report) = check_json(&[
        "deepseek-v3",
        "--weights",
        &file,
        "--gate",
        "mlp.gate.weight",
        "--bias",
        "mlp.gate.e_score_correction_bias",
        "--probes",
        "P,F",
    ]);
    assert_eq!((code, verdicts(&report)), (0, vec![(Probe::P, Pass), (Probe::F, Pass)]));
}

#[test]
fn bad_gate_weights_are_clear_errors() {
    let good = gate(8, 16);
    let file = checkpoint(
        "bad.safetensors",
        &[
            ("gate", good.clone()),
            ("short", gate(7, 16)),
            ("ids", Tensor::zeros((8, 16), DType::U32, &Device::Cpu).unwrap()),
            ("bias3", Tensor::zeros(3, DType::F32, &Device::Cpu).unwrap()),
        ],
    );
    let cases: [(&[&str], &str); 5] = [
        (&["--gate", "nope"], "no tensor `nope`; it has bias3, gate, ids, short"),
        (&["--gate", "short"], "tensor `short` has 7 rows (experts), router `mixtral` has 8 experts"),
        (&["--gate", "ids"], "tensor `ids` is U32, expected a float dtype (f16, bf16, f32, f64)"),
        (&["--gate", "bias3"], "tensor `bias3` has shape [3], expected [experts, hidden]"),
        (&["--gate", "gate", "--bias", "bias3"], "tensor `bias3` has shape [3], expected [8]"),
    ];
    for (extra, want) in cases {
        let args = [&["check", "mixtral", "--weights", file.as_str()], extra].concat();
        let out = run(&args);
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.trim_end(), format!("error: {file}: {want}"));
    }
}

#[test]
fn junit_and_github_formats() {
    let out = run(&[
        "check",
        "megatron-probs",
        "mixtral",
        "--format",
        "junit",
        "--github",
        "--batch",
        "2",
        "--seq-len",
        "16",
        "--probes",
        "P,M",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.starts_with("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<testsuites name=\"moe-audit\" tests=\"6\" failures=\"1\" skipped=\"2\">"), "{text}");
    assert!(text.contains("<testcase classname=\"moe-audit.megatron-probs\" name=\"P prefix (C-length)\">\n      <failure type=\"leak\" message=\"P prefix leaks C-length: "), "{text}");
    assert!(text.contains("witness: token batch 0, position 0 routes differently (kept): before [e"), "{text}");
    assert!(text.contains("<testcase classname=\"moe-audit.mixtral\" name=\"P prefix (C-length)\"/>"), "{text}");
    let md = String::from_utf8(
        run(&["check", "megatron-probs", "--format", "markdown", "--batch", "2", "--seq-len", "16", "--probes", "P"])
            .stdout,
    )
    .unwrap();
    assert!(md.ends_with("\n❌ 1 of 1 router(s) leak: `megatron-probs`\n"), "{md}");
    let annotations: Vec<&str> = text.lines().filter(|l| l.starts_with("::")).collect();
    assert_eq!(annotations.len(), 1, "{text}");
    assert!(
        annotations[0].starts_with(
            "::error title=moe-audit%3A megatron-probs leaks on P prefix::megatron-probs: P prefix leaks C-length: "
        ),
        "{text}"
    );
}

#[test]
fn junit_report_snapshot() {
    let out = run(&[
        "check",
        "megatron-probs",
        "--format",
        "junit",
        "--batch",
        "2",
        "--seq-len",
        "4",
        "--trials",
        "4",
        "--probes",
        "P,N,D,M",
    ]);
    assert_eq!(out.status.code(), Some(1));
    insta::assert_snapshot!(String::from_utf8(out.stdout).unwrap());
}
