//! `moe-audit engine` against the fake engine of tests/it/engines/fake_engine.py, which speaks
//! vLLM 0.33's and SGLang 0.5.23's HTTP API around a toy MoE whose routes are causal and
//! batch-invariant, with one defect switched on at a time: the audit finds that axis, the
//! others hold, a witness replays, and every bad server is a one-line error, exit 2.

use super::external::numpy;
use super::protocol2::run;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

const FAKE: &str = "tests/it/engines/fake_engine.py";
const CONFIG: &str = "tests/it/engines/qwen3_moe_tiny.json";

/// A fake engine on a free port, stopped when dropped.
struct Fake {
    child: Child,
    url: String,
}

impl Fake {
    /// The fake engine with `args`.
    fn start(args: &[&str]) -> Fake {
        Fake::python(&[&[FAKE, "--port", "0"], args].concat())
    }

    /// A Python server of tests/it/engines that prints `READY <port>` once listening.
    fn python(args: &[&str]) -> Fake {
        let mut child = Command::new("python3")
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start a test server");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("piped")).read_line(&mut line).expect("read READY");
        let port = line.trim().strip_prefix("READY ").unwrap_or_else(|| panic!("{args:?} said {line:?}"));
        Fake { child, url: format!("http://127.0.0.1:{port}") }
    }
}

impl Drop for Fake {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Small audits: 3 mates, 4 generated tokens, prompts of 20 to 40 tokens (3 probes unless told).
const SMALL: [&str; 6] = ["--mates", "3", "--generate", "4", "--prompt-len", "20..40"];

/// `engine` on `url` with the small sizes and `extra`: (exit code, stdout, stderr).
fn audit(url: &str, extra: &[&str]) -> (i32, String, String) {
    let mut args = vec!["engine", url, "--run-id", "test"];
    args.extend_from_slice(&SMALL);
    if !extra.contains(&"--prompts") {
        args.extend_from_slice(&["--prompts", "3"]);
    }
    args.extend_from_slice(extra);
    let out = run(&args, &[]);
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

/// The JSON report's axes: name → (decisions, changed, diverged).
fn axes(json: &str) -> std::collections::BTreeMap<String, (u64, u64, usize)> {
    let v: serde_json::Value = serde_json::from_str(json).expect("a JSON report");
    v["axes"]
        .as_array()
        .expect("axes")
        .iter()
        .map(|a| {
            let n = |k: &str| a[k].as_u64().expect(k);
            (
                a["axis"].as_str().expect("axis").to_string(),
                (n("decisions"), n("changed"), a["diverged"].as_array().expect("diverged").len()),
            )
        })
        .collect()
}

#[test]
fn a_causal_batch_invariant_engine_holds_on_every_axis() {
    if !numpy() {
        return;
    }
    for engine in ["vllm", "sglang"] {
        let details: &[&str] = if engine == "vllm" { &["--enable-prompt-tokens-details"] } else { &[] };
        let fake = Fake::start(&[&["--engine", engine], details].concat());
        let config: &[&str] = if engine == "sglang" { &["--config", CONFIG] } else { &[] };
        let (code, out, err) = audit(&fake.url, &[config, &["--format", "json"]].concat());
        assert_eq!(code, 0, "{engine}: {err}{out}");
        let found = axes(&out);
        let names: Vec<&str> = found.keys().map(String::as_str).collect();
        assert_eq!(names, ["batch", "cache", "continuation", "decode", "repeat", "stale"], "{engine}");
        for (axis, (decisions, changed, diverged)) in &found {
            assert!(*decisions > 0, "{engine} {axis}: nothing compared");
            assert_eq!((*changed, *diverged), (0, 0), "{engine} {axis}");
        }
        // 3 probes: alone, repeat, continuation, decode, 4 in the batch, fill, hit, recompute.
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["requests"], 3 * 11, "{engine}");
    }
}

#[test]
fn each_defect_changes_its_own_axis() {
    if !numpy() {
        return;
    }
    // (fault, the axis it must change); repeat perturbs every other request, so it shows on
    // other axes too and is checked on its own axis only.
    let cases = [
        ("batch", "batch"),
        ("stale", "stale"),
        ("cache", "cache"),
        ("decode", "decode"),
        ("continuation", "continuation"),
        ("repeat", "repeat"),
    ];
    for (fault, axis) in cases {
        let fake = Fake::start(&["--engine", "vllm", "--enable-prompt-tokens-details", "--fault", fault]);
        let (code, out, err) = audit(&fake.url, &["--format", "json", "--must-hold", axis, "--prompts", "6"]);
        assert_eq!(code, 1, "--fault {fault}: {err}{out}");
        let found = axes(&out);
        assert!(found[axis].1 > 0, "--fault {fault}: {axis} did not change: {found:?}");
        if fault != "repeat" {
            // Stale rows are also what the cache axis compares (the hit's whole rows).
            let also: &[&str] = if fault == "stale" { &["cache"] } else { &[] };
            for (other, (_, changed, _)) in &found {
                if other != axis && !also.contains(&other.as_str()) {
                    assert_eq!(*changed, 0, "--fault {fault} changed {other}");
                }
            }
        }
    }
}

#[test]
fn a_second_server_with_another_prefill_chunk_is_compared() {
    if !numpy() {
        return;
    }
    let a = Fake::start(&["--engine", "sglang"]);
    let b = Fake::start(&["--engine", "sglang", "--fault", "chunk", "--chunk", "64"]);
    let (code, out, err) = audit(
        &a.url,
        &["--config", CONFIG, "--against", &b.url, "--axes", "against", "--must-hold", "against", "--long-len", "128"],
    );
    assert_eq!(code, 1, "{err}{out}");
    assert!(out.contains("against: sglang"), "{out}");
    let row = out.lines().find(|l| l.starts_with("against ")).expect("the against row");
    assert!(row.ends_with("CHANGED (must hold)"), "{row}");
    // The chunk fault perturbs positions 64 and on: every change is there.
    for line in out.lines().filter(|l| l.contains(" position ")) {
        let pos: usize = line.split(" position ").nth(1).unwrap().split(' ').next().unwrap().parse().unwrap();
        assert!(pos >= 64, "{line}");
    }
}

#[test]
fn a_witness_replays_until_the_defect_is_gone() {
    if !numpy() {
        return;
    }
    let bad = Fake::start(&["--engine", "vllm", "--fault", "decode"]);
    let dir = std::env::temp_dir().join(format!("moe-audit-engine-witness-{}", std::process::id()));
    let witnesses = dir.to_str().unwrap();
    let (code, out, err) = audit(&bad.url, &["--must-hold", "decode", "--prompts", "6", "--witness-dir", witnesses]);
    assert_eq!(code, 1, "{err}{out}");
    let witness = dir.join("engine-decode.json");
    let w = witness.to_str().unwrap();
    let replayed = run(&["replay", w], &[]);
    assert_eq!(replayed.status.code(), Some(1), "{}", String::from_utf8_lossy(&replayed.stderr));
    assert!(String::from_utf8_lossy(&replayed.stdout).contains("the change reproduces"));
    let good = Fake::start(&["--engine", "vllm"]);
    let fixed = run(&["replay", w, "--url", &good.url], &[]);
    assert_eq!(fixed.status.code(), Some(0), "{}", String::from_utf8_lossy(&fixed.stderr));
    assert!(String::from_utf8_lossy(&fixed.stdout).contains("the change is gone"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_report_is_the_same_whatever_the_run() {
    if !numpy() {
        return;
    }
    let fake = Fake::start(&["--engine", "vllm", "--fault", "batch"]);
    let first = run(&["engine", &fake.url, "--run-id", "one", "--prompts", "4", "--format", "json"], &[]);
    let second = run(&["engine", &fake.url, "--run-id", "two", "--prompts", "4", "--format", "json"], &[]);
    assert_eq!(first.stdout, second.stdout);
    assert_eq!(first.status.code(), second.status.code());
    // The page: one section per axis, each the records comparison of `routes compare`.
    let page = run(
        &["engine", &fake.url, "--run-id", "three", "--prompts", "4", "--format", "html", "--must-hold", "batch"],
        &[],
    );
    assert_eq!(page.status.code(), Some(1));
    let page = String::from_utf8_lossy(&page.stdout);
    for axis in ["batch", "cache", "stale", "decode", "continuation", "repeat"] {
        assert!(page.contains(&format!("<h2>{axis}: ")), "{axis}");
    }
    assert!(page.contains("<div class=\"summary leak\">an axis that must hold changed</div>"));
}

#[test]
fn bad_servers_are_one_line_errors() {
    if !numpy() {
        return;
    }
    let no_routes = Fake::start(&["--engine", "vllm", "--no-routes"]);
    let dense = Fake::start(&["--engine", "vllm", "--dense"]);
    let slow = Fake::start(&["--engine", "vllm", "--slow", "5"]);
    let dropped = Fake::start(&["--engine", "vllm", "--drop"]);
    let sglang_off = Fake::start(&["--engine", "sglang", "--no-routes"]);
    let sglang = Fake::start(&["--engine", "sglang"]);
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec![&no_routes.url], "--enable-return-routed-experts"),
        (vec![&dense.url], "not an MoE model"),
        (vec![&slow.url, "--timeout", "1"], "no answer within 1 s"),
        (vec![&dropped.url], "/v1/completions: io: Peer disconnected"),
        (vec![&sglang_off.url, "--config", CONFIG], "started without --enable-return-routed-experts"),
        (vec![&sglang.url], "give the model's config.json"),
        (vec![&sglang.url, "--engine", "vllm", "--config", CONFIG], "not vLLM"),
        (vec![&no_routes.url, "--vocab", "100000"], "HTTP 400"),
        (vec!["https://127.0.0.1:1"], "https is not supported"),
        (vec![&sglang.url, "--config", CONFIG, "--vocab", "1000"], "over the model's vocab_size 256"),
        (vec!["http://127.0.0.1:1"], "http://127.0.0.1:1/version"),
        (vec![&sglang.url, "--config", CONFIG, "--concurrency", "3"], "over the concurrency limit 3"),
    ];
    for (args, says) in cases {
        let (code, out, err) = audit(args[0], &args[1..]);
        assert_eq!(code, 2, "{args:?}: {out}{err}");
        assert!(out.is_empty(), "{args:?}: {out}");
        assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
    }
}

/// A recorded transcript served again (tests/it/engines/transcript_server.py), stopped when dropped.
fn replayed(transcript: &str) -> Fake {
    Fake::python(&["tests/it/engines/transcript_server.py", "serve", transcript, "--port", "0"])
}

/// The recorded responses of a real engine: vLLM 0.28.0's CPU build (bf16, eager, prefix
/// caching on, `--enable-prompt-tokens-details`) with moe_audit.vllm_cpu_capture on the tiny
/// Qwen3-MoE of python/bench/engine_model.py, and the same server compiled (the default mode)
/// for `--against`; recorded through transcript_server.py by the commands below (docs/ENGINES.md).
const RECORDED_CONFIG: &str = "tests/it/engines/vllm_cpu_tiny_moe.json";

#[test]
fn a_real_vllm_engine_holds_on_every_axis_as_recorded() {
    if !numpy() {
        return;
    }
    let engine = replayed("tests/it/engines/recorded/vllm-0.28-cpu-bf16-eager.jsonl");
    let args =
        ["engine", &engine.url, "--config", RECORDED_CONFIG, "--run-id", "rec", "--prompts", "3", "--format", "json"];
    let out = run(&args, &[]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let found = axes(&String::from_utf8_lossy(&out.stdout));
    let expected =
        [("batch", 776), ("cache", 3348), ("continuation", 692), ("decode", 84), ("repeat", 776), ("stale", 3072)];
    let got: Vec<(&str, u64)> = found.iter().map(|(a, (d, _, _))| (a.as_str(), *d)).collect();
    assert_eq!(got, expected);
    assert!(found.values().all(|&(_, changed, diverged)| changed == 0 && diverged == 0), "{found:?}");
}

#[test]
fn a_real_vllm_engine_compiled_routes_otherwise_than_eager_as_recorded() {
    if !numpy() {
        return;
    }
    let eager = replayed("tests/it/engines/recorded/vllm-0.28-cpu-bf16-eager.jsonl");
    let compiled = replayed("tests/it/engines/recorded/vllm-0.28-cpu-bf16-compiled.jsonl");
    let args = [
        "engine",
        &eager.url,
        "--against",
        &compiled.url,
        "--axes",
        "against",
        "--must-hold",
        "against",
        "--config",
        RECORDED_CONFIG,
        "--run-id",
        "rec-against",
        "--prompts",
        "3",
        "--long-prompts",
        "1",
        "--format",
        "json",
    ];
    let out = run(&args, &[]);
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let against = &v["axes"][0];
    assert_eq!((against["decisions"].as_u64(), against["changed"].as_u64()), (Some(3008), Some(22)));
    // Every change swaps one expert of the two: the shape of a near-tie (bf16 inductor kernels
    // against eager ones), and two probes' greedy tokens part.
    assert_eq!(against["one_slot"], 22);
    assert_eq!(against["diverged"].as_array().unwrap().len(), 2);
}
