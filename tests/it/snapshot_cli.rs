//! `moe-audit snapshot` through the binary, and the Python helper `moe_audit.snapshot`: the same
//! bytes as `moe_audit::snapshot` for the same routing; routing changes fail `snapshot check` with a
//! diff naming them, float noise below the precision does not; external routers round-trip.
//!
//! The Python parts need python3 with numpy (as tests/it/external.rs: a notice without, a
//! failure under CI).

use moe_audit::{assign, snapshot, RouterConfig};
use ndarray::Array3;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_moe-audit");

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// A fresh directory for one test.
fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("moe-audit-it-snapshot-{}", std::process::id())).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// `moe-audit ARGS` run in `dir`, leaving no Python bytecode behind.
fn run_in(dir: &Path, args: &[&str]) -> Output {
    Command::new(BIN).args(args).current_dir(dir).envs(crate::external::python_env()).output().expect("run moe-audit")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Runs and checks the exit code; returns stdout.
fn expect(dir: &Path, args: &[&str], code: i32) -> String {
    let o = run_in(dir, args);
    assert_eq!(o.status.code(), Some(code), "moe-audit {args:?}\nstdout: {}\nstderr: {}", stdout(&o), stderr(&o));
    stdout(&o)
}

/// The routing text of each section of a `.snap` file.
fn sections(text: &str) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = Vec::new();
    for line in text.split_inclusive('\n') {
        if let Some(mode) = line.strip_prefix("=== ").and_then(|l| l.strip_suffix(" ===\n")) {
            out.push((mode.to_string(), String::new()));
        } else if let Some((_, body)) = out.last_mut() {
            body.push_str(line);
        }
    }
    out
}

fn numpy() -> bool {
    let ok = Command::new("python3").args(["-c", "import numpy"]).output().is_ok_and(|o| o.status.success());
    if !ok {
        assert!(std::env::var_os("CI").is_none(), "python3 with numpy is required under CI");
        eprintln!("NOTICE: python3 with numpy not found; skipping the Python snapshot tests");
    }
    ok
}

/// Runs a Python program (`-c`) with the helper and the examples importable.
fn python(dir: &Path, program: &str) -> Output {
    let path = format!("{}:{}", repo().join("python").display(), repo().join("python/examples").display());
    Command::new("python3")
        .args(["-c", program])
        .current_dir(dir)
        .env("PYTHONPATH", path)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("MOE_AUDIT_BIN", BIN)
        .env_remove("CI")
        .env_remove("MOE_AUDIT_UPDATE")
        .env_remove("INSTA_UPDATE")
        .output()
        .expect("run python3")
}

/// Logits with near-ties and capacity pressure, written as the JSON rows `--logits` takes.
fn logits(dir: &Path) -> Array3<f32> {
    let l = Array3::from_shape_fn((2, 6, 8), |(b, t, e)| (((b * 5 + t * 3 + e * 7) % 11) as f32) / 4.0 - 1.0);
    let rows: Vec<Vec<f32>> =
        l.outer_iter().flat_map(|s| s.outer_iter().map(|r| r.to_vec()).collect::<Vec<_>>()).collect();
    std::fs::write(dir.join("logits.json"), serde_json::to_string(&rows).unwrap()).unwrap();
    l
}

/// A Python mixtral on logits: top-2 of the logits, softmax over the two, ties to the lowest id.
const PY_MIXTRAL: &str = r#"
import numpy as np
from moe_audit.snapshot import assert_routing_snapshot
from moe_audit import routes_from_arrays

def route(data, mode):
    logits = data.reshape(-1, 8)
    top = np.argsort(-logits, axis=1, kind="stable")[:, :2]
    chosen = np.take_along_axis(logits, top, axis=1).astype(np.float64)
    gates = np.exp(chosen - chosen.max(axis=1, keepdims=True))
    gates /= gates.sum(axis=1, keepdims=True)
    return routes_from_arrays(top, gates), None

assert_routing_snapshot(route, "py.snap", name="mixtral", experts=8, top_k=2, logits="logits.json", batch=2)
"#;

#[test]
fn cli_python_helper_and_library_give_the_same_bytes() {
    let dir = tmp("same-bytes");
    let l = logits(&dir);
    let text = snapshot(&assign(&RouterConfig::load("mixtral").unwrap(), l.view()).unwrap());
    expect(
        &dir,
        &["snapshot", "record", "mixtral", "--logits", "logits.json", "--batch", "2", "--output", "cli.snap"],
        0,
    );
    let cli = std::fs::read_to_string(dir.join("cli.snap")).unwrap();
    assert_eq!(sections(&cli), [("train".to_string(), text.clone()), ("inference".to_string(), text.clone())]);
    // The same command writes the same bytes, whatever the thread count, and leaves no temporary file.
    assert_eq!(expect(&dir, &["snapshot", "record", "mixtral", "--logits", "logits.json", "--batch", "2"], 0), cli);
    let one_thread = Command::new(BIN)
        .args(["snapshot", "record", "mixtral", "--logits", "logits.json", "--batch", "2"])
        .current_dir(&dir)
        .env("RAYON_NUM_THREADS", "1")
        .output()
        .unwrap();
    assert_eq!(stdout(&one_thread), cli);
    let mut names: Vec<String> =
        std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    assert_eq!(names, ["cli.snap", "logits.json"]);
    if !numpy() {
        return;
    }
    let out = python(&dir, PY_MIXTRAL);
    assert!(out.status.success(), "{}", stderr(&out));
    let py = std::fs::read_to_string(dir.join("py.snap")).unwrap();
    assert_eq!(sections(&py), sections(&cli));
    assert!(py.contains("source = \"harness\"\nname = \"mixtral\""), "{py}");
    assert!(py.contains("rows = \"logits\"\nseed = 0\nfile = \"logits.json\""), "{py}");
    // The rows hash is of the inputs, whoever routed them.
    let hash = |t: &str| t.lines().rev().find(|l| l.starts_with("sha256 = ")).map(str::to_string);
    assert_eq!(hash(&py), hash(&cli));
}

/// A copy of the megatron-probs preset as a TOML router, with `edit` applied.
fn megatron_toml(dir: &Path, edit: impl Fn(String) -> String) {
    let text = moe_audit::config::preset("megatron-probs").expect("the preset").toml.to_string();
    std::fs::write(dir.join("router.toml"), edit(text)).unwrap();
}

#[test]
fn a_changed_capacity_formula_fails_with_a_diff_naming_it() {
    let dir = tmp("capacity");
    megatron_toml(&dir, |t| t);
    expect(&dir, &["snapshot", "record", "router.toml", "--output", "r.snap"], 0);
    assert_eq!(
        expect(&dir, &["snapshot", "check", "r.snap"], 0),
        "r.snap: unchanged\ntrain: unchanged\ninference: unchanged\n"
    );
    megatron_toml(&dir, |t| t.replace("factor = 1.0", "factor = 1.25"));
    let diff = expect(&dir, &["snapshot", "check", "r.snap"], 1);
    assert!(diff.starts_with("r.snap: routing changed\nnote: the router's file changed since the snapshot"), "{diff}");
    assert!(
        diff.contains("train: 3 of 16 tokens moved (experts 0, order 0, kept flag 3, weight 0); the call changed"),
        "{diff}"
    );
    assert!(diff.contains("  call: capacity 4 per expert per group -> capacity 5 per expert per group\n"), "{diff}");
    assert!(diff.contains("  batch 0 pos 2: e5 dropped -> kept\n"), "{diff}");
    assert!(diff.contains("    -   0    2  e7   0.5549  e5   0.4451x\n    +   0    2  e7   0.5549  e5   0.4451\n"));
    // `snapshot update` rewrites it; then it checks clean.
    let updated = expect(&dir, &["snapshot", "update", "r.snap"], 0);
    assert!(updated.starts_with("r.snap: updated\n"), "{updated}");
    expect(&dir, &["snapshot", "check", "r.snap"], 0);
    assert_eq!(expect(&dir, &["snapshot", "update", "r.snap"], 0), "r.snap: unchanged\n");
}

#[test]
fn checked_from_another_folder_the_error_names_the_snapshot_and_where_paths_are_looked_up() {
    let dir = tmp("elsewhere");
    megatron_toml(&dir, |t| t);
    expect(&dir, &["snapshot", "record", "router.toml", "--output", "r.snap"], 0);
    let out = run_in(dir.parent().unwrap(), &["snapshot", "check", "elsewhere/r.snap"]);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        stderr(&out),
        "error: elsewhere/r.snap: [router] path = \"router.toml\" is not in the working directory (paths in a snapshot header are relative to the directory it is checked from: run there)\n"
    );
}

#[test]
fn a_renormalised_weight_fails_with_a_diff_naming_it() {
    let dir = tmp("renormalised");
    megatron_toml(&dir, |t| t);
    expect(&dir, &["snapshot", "record", "router.toml", "--output", "r.snap"], 0);
    megatron_toml(&dir, |t| t.replace("policy = \"probs\"", "policy = \"probs\"\nrenormalize_after_drop = true"));
    let diff = expect(&dir, &["snapshot", "check", "r.snap"], 1);
    // Ids and kept flags stay; the surviving gate becomes 1.
    assert!(diff.contains("train: 7 of 16 tokens moved (experts 0, order 0, kept flag 0, weight 7)\n"), "{diff}");
    assert!(diff.contains("  batch 0 pos 2: e7 weight 0.5549 -> 1.0000\n"), "{diff}");
}

#[test]
fn float_noise_below_the_precision_passes_and_more_fails() {
    let dir = tmp("noise");
    expect(&dir, &["snapshot", "record", "megatron-probs", "--output", "r.snap"], 0);
    let text = std::fs::read_to_string(dir.join("r.snap")).unwrap();
    // e6 0.5519 at batch 0, position 0: last-bit noise can print it one unit away, either side.
    assert!(text.contains("  0    0  e6   0.5519  e5   0.4481\n"));
    for (noise, code) in [("0.5520", 0), ("0.5518", 0), ("0.5521", 1)] {
        std::fs::write(dir.join("r.snap"), text.replacen("e6   0.5519", &format!("e6   {noise}"), 1)).unwrap();
        let out = expect(&dir, &["snapshot", "check", "r.snap"], code);
        if code == 1 {
            assert!(out.contains("  batch 0 pos 0: e6 weight 0.5521 -> 0.5519\n"), "{out}");
            assert!(out.contains("inference: unchanged"), "{out}");
        }
    }
    // The load figures (3 decimals) likewise.
    let aux = text.lines().find(|l| l.starts_with("max/mean load")).unwrap().to_string();
    let value: f64 = aux.rsplit(' ').next().unwrap().parse().unwrap();
    let moved = |d: f64| aux.replace(&format!("{value:.3}"), &format!("{:.3}", value + d));
    std::fs::write(dir.join("r.snap"), text.replacen(&aux, &moved(0.001), 1)).unwrap();
    expect(&dir, &["snapshot", "check", "r.snap"], 0);
    std::fs::write(dir.join("r.snap"), text.replacen(&aux, &moved(0.002), 1)).unwrap();
    assert!(expect(&dir, &["snapshot", "check", "r.snap"], 1).contains("aux loss"));
}

/// A Python router on logits, top-2 with a tie rule, served over the protocol.
fn tie_router(dir: &Path, lowest_first: bool) {
    let order = if lowest_first { "-logits" } else { "-logits[:, ::-1]" };
    let fix = if lowest_first { "" } else { "top = 7 - top" };
    let program = format!(
        r#"import numpy as np
from moe_audit import routes_from_arrays, run

def route(data, mode):
    logits = data.reshape(-1, 8)
    top = np.argsort({order}, axis=1, kind="stable")[:, :2]
    {fix}
    gates = np.full(top.shape, 0.5)
    return routes_from_arrays(top, gates), None

run(route, name="tie", experts=8, top_k=2, input="logits")
"#
    );
    std::fs::write(dir.join("tie.py"), program).unwrap();
}

#[test]
fn a_changed_tie_rule_fails_and_an_external_router_round_trips() {
    if !numpy() {
        return;
    }
    let dir = tmp("ties");
    // Every value twice in a row: the best two experts often tie.
    let rows: Vec<Vec<f32>> = (0..12).map(|t| (0..8).map(|e| ((e * 3 + t) % 4) as f32).collect()).collect();
    std::fs::write(dir.join("ties.json"), serde_json::to_string(&rows).unwrap()).unwrap();
    tie_router(&dir, true);
    let make = ["snapshot", "record", "--router-cmd", "python3 tie.py", "--logits", "ties.json", "--batch", "2"];
    expect(&dir, &[&make[..], &["--output", "t.snap"]].concat(), 0);
    assert!(std::fs::read_to_string(dir.join("t.snap"))
        .unwrap()
        .contains("source = \"command\"\ncommand = \"python3 tie.py\""));
    let check = ["snapshot", "check", "t.snap", "--router-cmd", "python3 tie.py"];
    expect(&dir, &check, 0);
    // Ties to the highest id now: tokens with tied logits change order or experts.
    tie_router(&dir, false);
    let diff = expect(&dir, &check, 1);
    assert!(diff.contains("train: 12 of 12 tokens moved (experts 0, order 12, kept flag 0, weight 0)\n"), "{diff}");
    assert!(diff.contains("  batch 0 pos 0: order e1 e5 -> e5 e1\n"), "{diff}");
}

#[test]
fn a_python_router_snapshots_alike_through_the_cli_the_helper_and_trace_files() {
    if !numpy() {
        return;
    }
    let dir = tmp("external");
    let cmd = "python3 python/examples/megatron_probs_router.py";
    let out = Command::new(BIN)
        .args(["snapshot", "record", "--router-cmd", cmd, "--output"])
        .arg(dir.join("cmd.snap"))
        .current_dir(repo())
        .envs(crate::external::python_env())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let cmd_snap = std::fs::read_to_string(dir.join("cmd.snap")).unwrap();
    let out = python(
        &dir,
        r#"import megatron_probs_router as m
from moe_audit.snapshot import assert_routing_snapshot
assert_routing_snapshot(m.route, "py.snap", name="megatron-probs-py", experts=8, top_k=2)"#,
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let py_snap = std::fs::read_to_string(dir.join("py.snap")).unwrap();
    assert_eq!(sections(&py_snap), sections(&cmd_snap));
    // Trace files of an audit plan, answered by the same router: its first calls.
    let traces = dir.join("traces");
    let t = traces.to_str().unwrap();
    let plan = ["plan", "--output", t, "--name", "megatron-probs-py", "--experts", "8", "--top-k", "2"];
    expect(&dir, &[&plan[..], &["--batch", "2", "--seq-len", "8", "--trials", "2", "--probes", "M"]].concat(), 0);
    let answer = Command::new("python3")
        .args(["python/examples/megatron_probs_router.py", "--answer-plan", t])
        .current_dir(repo())
        .envs(crate::external::python_env())
        .output()
        .unwrap();
    assert!(answer.status.success(), "{}", stderr(&answer));
    expect(&dir, &["snapshot", "record", "--traces", t, "--output", "traces.snap"], 0);
    // The header records the folder as given (here absolute): a check names it again.
    expect(&dir, &["snapshot", "check", "traces.snap", "--traces", t], 0);
    let traced = std::fs::read_to_string(dir.join("traces.snap")).unwrap();
    assert!(traced.contains("source = \"traces\"") && traced.contains("rows = \"traces\""), "{traced}");
    // A harness snapshot needs its harness: a clear error without one.
    let out = run_in(&dir, &["snapshot", "check", "py.snap"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).starts_with("error: py.snap: answered by a harness (the Python helper)"), "{}", stderr(&out));
}

#[test]
fn the_python_helper_tests_pass() {
    if !numpy() {
        return;
    }
    let out = Command::new("python3")
        .arg("python/tests/test_snapshot.py")
        .current_dir(repo())
        .envs(crate::external::python_env())
        .env("MOE_AUDIT_BIN", BIN)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    assert_eq!(stdout(&out).lines().filter(|l| l.starts_with("ok test_")).count(), 6, "{}", stdout(&out));
}

#[test]
fn a_real_gate_and_hidden_states_files_snapshot_and_check() {
    use candle_core::{Device, Tensor};
    let dir = tmp("gate");
    let gate: Vec<f32> = (0..8 * 16).map(|i| ((i * 37 % 23) as f32 - 11.0) / 10.0).collect();
    let save = |scale: f32| {
        let t = Tensor::from_vec(gate.iter().map(|v| v * scale).collect::<Vec<f32>>(), (8, 16), &Device::Cpu).unwrap();
        candle_core::safetensors::save(
            &std::collections::HashMap::from([("g".to_string(), t)]),
            dir.join("w.safetensors"),
        )
        .unwrap();
    };
    save(1.0);
    let rows: Vec<Vec<f32>> =
        (0..8).map(|t| (0..16).map(|h| (((t * 16 + h) * 29 % 17) as f32 - 8.0) / 4.0).collect()).collect();
    std::fs::write(dir.join("h.json"), serde_json::to_string(&rows).unwrap()).unwrap();
    let make = ["snapshot", "record", "megatron-probs", "--weights", "w.safetensors", "--gate", "g"];
    expect(&dir, &[&make[..], &["--hidden-states", "h.json", "--output", "g.snap"]].concat(), 0);
    let text = std::fs::read_to_string(dir.join("g.snap")).unwrap();
    assert!(
        text.contains("source = \"gate\"\nrouter = \"megatron-probs\"\nweights = \"w.safetensors\"\ngate = \"g\""),
        "{text}"
    );
    assert!(text.contains("batch = 2\nseq_len = 4\nrows = \"hidden-states\""), "{text}");
    expect(&dir, &["snapshot", "check", "g.snap"], 0);
    // A retrained gate: the file's hash is noted, the routing compared.
    save(1.0 + 1e-7);
    let out = run_in(&dir, &["snapshot", "check", "g.snap"]);
    assert!(stdout(&out).contains("note: the router's file changed since the snapshot"), "{}", stdout(&out));
    save(-1.0);
    let diff = expect(&dir, &["snapshot", "check", "g.snap"], 1);
    assert!(diff.contains("train: 8 of 8 tokens moved"), "{diff}");
    // A TOML router's seeded gate on given hidden states; --hidden is their width.
    expect(
        &dir,
        &["snapshot", "record", "mixtral", "--hidden-states", "h.json", "--hidden", "16", "--output", "m.snap"],
        0,
    );
    expect(&dir, &["snapshot", "check", "m.snap"], 0);
}

#[test]
fn bad_snapshots_and_flags_exit_2_with_one_line() {
    let dir = tmp("bad");
    logits(&dir);
    expect(
        &dir,
        &["snapshot", "record", "mixtral", "--logits", "logits.json", "--batch", "2", "--output", "l.snap"],
        0,
    );
    std::fs::write(dir.join("garbage.snap"), "hello\n").unwrap();
    let good = std::fs::read_to_string(dir.join("l.snap")).unwrap();
    std::fs::write(dir.join("broken.snap"), good.replace("  0    1  e", "  0    1  q")).unwrap();
    let cases: [(&[&str], &str); 13] = [
        (&["snapshot", "check", "l.snap", "--max-memory", "100B"], "error: reading l.snap needs about"),
        (
            &["snapshot", "record", "--traces", "t", "--batch", "2"],
            "error: the argument '--traces <DIR>' cannot be used with '--batch <BATCH>'",
        ),
        (
            &["snapshot", "record", "mixtral", "--hidden-states", "logits.json"],
            "error: logits.json: row 0 has 8 values, the router's hidden size is 64",
        ),
        (&["snapshot", "check", "missing.snap"], "error: missing.snap: cannot read"),
        (&["snapshot", "check", "garbage.snap"], "error: garbage.snap: not a moe-audit snapshot header"),
        (&["snapshot", "check", "broken.snap"], "error: broken.snap: section `train`: line 4 of the routing text"),
        (&["snapshot", "check", "l.snap", "--batch", "4"], "error: unexpected argument '--batch' found"),
        (
            &["snapshot", "record", "mixtral", "--router-cmd", "true"],
            "error: the argument '[ROUTER]' cannot be used with '--router-cmd <COMMAND>'",
        ),
        (&["snapshot", "record", "mixtral", "--output", "logits.json/x.snap"], "error: logits.json: cannot create"),
        (
            &["snapshot", "record", "mixtral", "--logits", "logits.json", "--batch", "5"],
            "error: logits.json: 12 rows cannot be split",
        ),
        // A hidden size is the width of hidden rows: with logits it was once silently unused.
        (
            &["snapshot", "plan", "p", "--experts", "4", "--hidden", "16"],
            "error: --hidden is the size of --input hidden rows",
        ),
        (
            &["plan", "--output-dir", "p", "--experts", "4", "--hidden", "16"],
            "error: --hidden is the size of --input hidden rows",
        ),
        (
            &["snapshot", "plan", "p", "--experts", "4", "--input", "hidden"],
            "error: handshake: input `hidden` needs hidden_size >= 1",
        ),
    ];
    for (args, want) in cases {
        let out = run_in(&dir, args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        let err = stderr(&out);
        assert!(err.starts_with(want) && err.lines().count() == 1, "{args:?}: {err}");
    }
    // Other inputs than the snapshot's cannot be compared.
    std::fs::write(
        dir.join("logits.json"),
        std::fs::read_to_string(dir.join("logits.json")).unwrap().replacen("-1", "-2", 1),
    )
    .unwrap();
    let out = run_in(&dir, &["snapshot", "check", "l.snap"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("l.snap: the inputs are not those the snapshot was made from"), "{}", stderr(&out));
    // A hand-edited header: refused by its seal before anything is made.
    std::fs::write(dir.join("edited.snap"), good.replace("rows = \"logits\"", "rows = \"traces\"")).unwrap();
    let out = run_in(&dir, &["snapshot", "check", "edited.snap"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).starts_with("error: edited.snap: the header does not match its `header_sha256`"),
        "{}",
        stderr(&out)
    );
    // A missing directory is made, as insta does.
    expect(&dir, &["snapshot", "record", "mixtral", "--output", "snapshots/new/m.snap"], 0);
    assert!(dir.join("snapshots/new/m.snap").is_file());
}
