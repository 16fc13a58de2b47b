//! `moe-audit sweep`: outputs, determinism, the figures of a small grid, bad grid files.

use super::cli::{fail, file, stdout, tmp_dir};
use moe_audit::analyze::Probe;

const SMALL: &str =
    "routers = [\"causal-capacity\", \"batch-prioritized\", \"sinkhorn\"]\ncapacity_factor = [1.0]\ntop_k = [1, 2]\n\
                     experts = [4]\nseq_len = [16]\nbatch = [2]\ntrials = 2\nheatmap = \"batch-prioritized\"\n";

fn sweep(name: &str) -> (String, std::path::PathBuf) {
    let grid = file(&format!("{name}.toml"), SMALL);
    let dir = tmp_dir().join(name);
    let text = stdout(&["sweep", &grid, "--output-dir", dir.to_str().unwrap()]);
    (text, dir)
}

#[test]
fn a_small_grid_writes_every_output_byte_identically() {
    let (text, a) = sweep("sweep-a");
    let (_, b) = sweep("sweep-b");
    let names = [
        "sweep.json",
        "sweep.csv",
        "sweep.md",
        "leak-vs-imbalance.svg",
        "leak-vs-imbalance.png",
        "heatmap-batch-prioritized.svg",
        "heatmap-batch-prioritized.png",
    ];
    for name in names {
        let (x, y) = (std::fs::read(a.join(name)).unwrap(), std::fs::read(b.join(name)).unwrap());
        assert!(!x.is_empty() && x == y, "{name} differs between two runs");
        assert!(text.contains(&format!("wrote {}", a.join(name).display())), "{text}");
    }
    assert!(std::fs::read(a.join("leak-vs-imbalance.png")).unwrap().starts_with(b"\x89PNG"));
    assert!(std::fs::read_to_string(a.join("leak-vs-imbalance.svg")).unwrap().starts_with("<svg"));

    let json = std::fs::read_to_string(a.join("sweep.json")).unwrap();
    let report: moe_audit::sweep::SweepReport = serde_json::from_str(&json).unwrap();
    assert_eq!(moe_audit::command::json(&report), json, "the leak_<probe> fields read back as written");
    // 3 routers × k {1, 2}; one capacity factor.
    assert_eq!(report.cells.len(), 6);
    let csv = std::fs::read_to_string(a.join("sweep.csv")).unwrap();
    assert_eq!(csv.lines().count(), 7);
    // One column per probe in the registry's order, M and X in columns of their own.
    assert!(csv.contains(",max_over_mean_kept,leak_p,leak_f,leak_n,leak_r,leak_d,leak_s,leak_l,leak_rate,"), "{csv}");
    for c in &report.cells {
        match c.router.as_str() {
            "causal-capacity" => {
                assert_eq!(c.leak_rate, 0.0, "{c:?}");
                assert!(c.leaking.split(' ').all(|p| p == "X" || p.is_empty()), "only precision flips may show: {c:?}");
                assert!(c.drop_rate > 0.0 && c.output_change == Some(0.0), "capacity binds, outputs stay: {c:?}");
                assert_eq!(c.leak(Probe::L), Some(0.0), "per-token capacity does not depend on the rank split: {c:?}");
            }
            "batch-prioritized" => assert!(c.leak_rate > 0.0 && c.mismatch.is_none(), "{c:?}"),
            _ => {
                assert!(c.mismatch.is_some_and(|m| m > 0.0) && c.leak_rate > 0.0, "sinkhorn: M measured: {c:?}");
                assert!(c.leak(Probe::L).is_some_and(|l| l > 0.0), "sinkhorn balances over the batch it sees: {c:?}");
            }
        }
        assert!(c.flips_bf16.is_some() && c.max_over_mean_kept >= 1.0);
    }
    let h = &report.heatmap;
    assert_eq!((h.router.as_str(), h.seq_len, h.rate.len()), ("batch-prioritized", 16, 15));
    assert!(h.rate.iter().enumerate().all(|(d, row)| row.len() == 16 - (d + 1)));
    assert!(h.rate.iter().flatten().any(|&r| r > 0.0), "later tokens affect earlier ones");
    assert_eq!(report.swamping.as_ref().unwrap().len(), moe_audit::analyze::numerics::SWAMPING_TERMS.len());
}

#[test]
fn a_probe_that_does_not_apply_leaves_its_field_empty() {
    // One sequence: N has no other sequence to change, so it measures nothing (not 0%).
    let grid = "routers = [\"mixtral\"]\ntop_k = [1]\nexperts = [4]\nseq_len = [8]\nbatch = [1]\ntrials = 2\n\
                numerics = false\nheatmap = \"mixtral\"\n";
    let dir = tmp_dir().join("sweep-one-sequence");
    stdout(&["sweep", &file("sweep-one-sequence.toml", grid), "--output-dir", dir.to_str().unwrap()]);
    let json = std::fs::read_to_string(dir.join("sweep.json")).unwrap();
    assert!(json.contains("\"leak_n\": null,"), "{json}");
    let report: moe_audit::sweep::SweepReport = serde_json::from_str(&json).unwrap();
    let c = &report.cells[0];
    assert_eq!((c.leak(Probe::N), c.leak(Probe::P)), (None, Some(0.0)), "{c:?}");
    let csv = std::fs::read_to_string(dir.join("sweep.csv")).unwrap();
    let column = |line: &str| line.split(',').nth(14).unwrap().to_string();
    let lines: Vec<&str> = csv.lines().collect();
    assert_eq!((column(lines[0]).as_str(), column(lines[1]).as_str()), ("leak_n", ""), "{csv}");
}

#[test]
fn bad_grid_files_name_file_field_and_value() {
    let cases = [
        ("g1.toml", "top_k = [1, 0]\n"),
        ("g2.toml", "capacity_factor = \"x\"\n"),
        ("g3.toml", "routers = [\"nope\"]\nheatmap = \"nope\"\n"),
        ("g4.toml", "routerz = 1\n"),
        ("g5.toml", "capacity_factor = [1.0, -2.0]\n"),
        ("g6.toml", "heatmap = \"mixtral-x\"\n"),
    ];
    let errors: Vec<String> = cases.iter().map(|(name, text)| fail(&["sweep", &file(name, text)])).collect();
    insta::assert_snapshot!(errors.join("\n"), @r#"
    error: [TMP]/g1.toml: top_k[1]: must be at least 1, got 0
    error: [TMP]/g2.toml: capacity_factor: invalid type: string "x", expected a sequence (line 1, column 19)
    error: [TMP]/g3.toml: routers[0]: unknown router `nope`: not a preset (mixtral, deepseek-v3, switch, megatron-probs, megatron-position, megatron-probs-pad, deepspeed-top1, deepspeed-top2, deepspeed-topk-probs, expert-choice, aux-loss-free, causal-capacity, sinkhorn, batch-prioritized, expert-choice-tc-serve, expert-threshold, null-experts) and not a file
    error: [TMP]/g4.toml: routerz: unknown field `routerz`, expected one of `routers`, `capacity_factor`, `top_k`, `experts`, `seq_len`, `batch`, `trials`, `seed`, `hidden`, `ffn`, `balance_steps`, `numerics`, `heatmap`, `exploit` (line 1, column 1)
    error: [TMP]/g5.toml: capacity_factor[1]: must be finite and > 0, got -2
    error: [TMP]/g6.toml: heatmap: `mixtral-x` is not one of `routers`
    "#);
}

#[test]
fn the_exploit_column_measures_each_cell_when_the_grid_asks() {
    // A leaky router (expert choice within each sequence) beside a dropless one, exploit sizes
    // the CI can afford: the column carries each cell's verdict, and appears only when asked.
    // A grid names router files inside its own folder (docs/SECURITY.md): a copy beside it.
    let leaky = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/exploit/expert-choice-sequence.toml");
    file("expert-choice-sequence.toml", &std::fs::read_to_string(leaky).unwrap());
    let grid = String::from(
        "routers = [\"mixtral\", \"expert-choice-sequence.toml\"]\ncapacity_factor = [2.0]\ntop_k = [2]\nexperts = [4]\nseq_len = [8]\n\
         batch = [2]\ntrials = 2\nnumerics = false\nheatmap = \"mixtral\"\n\n[exploit]\nseq_len = 2\nsteps = 300\n\
         seeds = 1\neval_batches = 32\ncurve_points = 2\nprobe_batches = 0\n"
    );
    let dir = tmp_dir().join("sweep-exploit");
    let text = stdout(&["sweep", &file("sweep-exploit.toml", &grid), "--output-dir", dir.to_str().unwrap()]);
    let report: moe_audit::sweep::SweepReport =
        serde_json::from_str(&std::fs::read_to_string(dir.join("sweep.json")).unwrap()).unwrap();
    let verdicts: Vec<(&str, Option<bool>)> = report.cells.iter().map(|c| (c.router.as_str(), c.exploited)).collect();
    assert_eq!(verdicts, [("mixtral", Some(false)), ("expert-choice-sequence", Some(true))]);
    let leaky = report.cells[1].exploit.unwrap();
    assert!(leaky.estimate - leaky.half_width > 0.1, "{leaky:?}");
    assert!(report.cells[0].exploit.unwrap().estimate < 0.05);
    let csv = std::fs::read_to_string(dir.join("sweep.csv")).unwrap();
    assert!(csv.lines().next().unwrap().ends_with(",flips_f16,exploit_bits,exploit_half_width,exploited"), "{csv}");
    assert!(csv.lines().nth(2).unwrap().ends_with(",true"), "{csv}");
    assert!(text.contains("| exploit, bits/token below ln V |") && text.contains(" **+"), "{text}");

    // Without `[exploit]`: no column, no field.
    let json = std::fs::read_to_string(a_small_grid_dir().join("sweep.json")).unwrap();
    assert!(!json.contains("exploit"), "sweeps without [exploit] keep their bytes");
    let bad = fail(&["sweep", &file("sweep-exploit-bad.toml", "[exploit]\nseq_len = 1\n")]);
    insta::assert_snapshot!(bad, @"error: [TMP]/sweep-exploit-bad.toml: exploit.seq_len: must be from 2 to 1024, got 1");
}

/// A small grid's outputs, without `[exploit]`.
fn a_small_grid_dir() -> std::path::PathBuf {
    sweep("sweep-no-exploit").1
}

#[test]
fn the_committed_default_sweep_and_the_documented_table_are_current() {
    // `cargo run -- sweep --output-dir docs/sweep` regenerates them.
    let dir = tmp_dir().join("sweep-default");
    let text = stdout(&["sweep", "--output-dir", dir.to_str().unwrap()]);
    let fresh = std::fs::read_to_string(dir.join("sweep.md")).unwrap();
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    assert_eq!(fresh, std::fs::read_to_string(root.join("docs/sweep/sweep.md")).unwrap(), "docs/sweep is stale");
    assert!(text.starts_with(&fresh));
    let table = fresh.split("\nAccumulator swamping").next().unwrap().trim();
    let doc = std::fs::read_to_string(root.join("docs/CHOOSING.md")).unwrap();
    assert!(doc.contains(table), "docs/CHOOSING.md's sweep table is stale");
}

#[test]
fn check_runs_probe_x_only_when_asked() {
    let args = |extra: &[&'static str]| {
        [&["check", "mixtral", "--probes", "X", "--seq-len", "256", "--batch", "4"][..], extra].concat()
    };
    let x = |extra: &[&'static str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_moe-audit")).args(args(extra)).output().unwrap()
    };
    let out = x(&[]);
    let text = String::from_utf8(out.stdout).unwrap();
    // A bf16 near-tie flip is precision drift, not a causality leak: reported, exit 0 by default.
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(
        text.contains("X numerics   drift   T/I           0.6%")
            && text.contains("routing flips: bf16 0.59%, f16 0.10% of tokens")
            && text.contains("no leak found"),
        "the rate is the worse dtype's, never their average: {text}"
    );
    let gated = x(&["--fail-on", "leak,drift"]);
    assert_eq!(gated.status.code(), Some(1), "--fail-on drift gates on it");
    assert_eq!(x(&["--fail-on", "drift", "--format", "json"]).status.code(), Some(1));
    let err = crate::routes::bad(&args(&["--fail-on", "leak,drfit"]));
    assert!(err.contains("unknown verdict `drfit`"), "{err}");
    let default = stdout(&["check", "mixtral", "--seq-len", "8", "--trials", "2"]);
    assert!(!default.contains("numerics"), "X is opt-in: {default}");
}
