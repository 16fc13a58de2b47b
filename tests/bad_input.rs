//! The bad-input catalogue: router configs, sweep grids, CLI flags, the environment, logits
//! files, safetensors, protocol messages, trace directories and witness files, including files
//! that never end (`/dev/zero`), sizes that overflow, names that would break a report. Every case runs through the binary
//! and must exit 2 with exactly one `error: ` line on stderr that names the problem and where,
//! nothing on stdout, and no panic. The messages are one inline snapshot, so a change to any of
//! them is reviewed.

use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_moe-audit");

fn tmp_dir() -> PathBuf {
    // Per process: other checkouts on the machine run this catalogue too.
    let dir = std::env::temp_dir().join(format!("moe-audit-bad-input-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// Writes `text` to `name` in the temp dir (atomically); returns the path.
fn file(name: &str, text: &str) -> String {
    let (dir, partial) = (tmp_dir(), tmp_dir().join(format!(".{name}.{}", std::process::id())));
    std::fs::write(&partial, text).expect("write temp file");
    std::fs::rename(&partial, dir.join(name)).expect("rename temp file");
    dir.join(name).to_str().expect("utf-8 path").to_string()
}

/// A FIFO at `name` in the temp dir that nothing holds open; returns its path.
fn fifo(name: &str) -> String {
    let path = tmp_dir().join(name);
    let _ = std::fs::remove_file(&path);
    let made = Command::new("mkfifo").arg(&path).status().expect("run mkfifo");
    assert!(made.success(), "mkfifo {}", path.display());
    path.to_str().expect("utf-8 path").to_string()
}

/// A safetensors file whose header names `gate` twice (the loader would keep one silently).
fn twice_named() -> String {
    let entry = r#""gate":{"dtype":"F32","shape":[8,4],"data_offsets":[0,128]}"#;
    let header = format!("{{{entry},{entry}}}");
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(&[0; 128]);
    let path = tmp_dir().join("twice.safetensors");
    std::fs::write(&path, bytes).expect("write safetensors");
    path.to_str().expect("utf-8 path").to_string()
}

/// A valid router file; the bad ones are this with one change.
const ROUTER: &str = "name = \"t\"\nkind = \"token-choice\"\nexperts = 8\ntop_k = 2\nscore = \"softmax-post\"\n\n[capacity]\nfactor = 1.0\npolicy = \"probs\"\n";

fn router_with(name: &str, from: &str, to: &str) -> String {
    assert!(ROUTER.contains(from), "{from:?} is not in the base router");
    file(name, &ROUTER.replacen(from, to, 1))
}

fn safetensors(name: &str, tensors: &[(&str, Tensor)]) -> String {
    let path = tmp_dir().join(name);
    let map: HashMap<String, Tensor> = tensors.iter().map(|(n, t)| (n.to_string(), t.clone())).collect();
    candle_core::safetensors::save(&map, &path).expect("write safetensors");
    path.to_str().unwrap().to_string()
}

/// A router in sh that sends `handshake`, then answers every request with `answer`.
fn sh_router(handshake: &str, answer: &str) -> String {
    format!("printf '%s\\n' '{handshake}'; while read -r line; do printf '%s\\n' '{answer}'; done")
}

const HANDSHAKE: &str = r#"{"protocol": "moe-audit/1", "name": "sh", "experts": 2, "top_k": 1, "input": "logits"}"#;

/// A valid witness file as JSON, from a real leak.
fn witness() -> serde_json::Value {
    let dir = tmp_dir().join("witnesses");
    let out = Command::new(BIN)
        .args([
            "check",
            "megatron-probs",
            "--probes",
            "P",
            "--seq-len",
            "8",
            "--batch",
            "2",
            "--witness-dir",
            dir.to_str().unwrap(),
        ])
        .output()
        .expect("run moe-audit");
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_str(&std::fs::read_to_string(dir.join("megatron-probs-P.json")).unwrap()).unwrap()
}

fn witness_with(name: &str, change: impl FnOnce(&mut serde_json::Value)) -> String {
    let mut w = witness();
    change(&mut w);
    file(name, &w.to_string())
}

/// `plan` of a tiny audit into the temp dir; `extra` flags replace the defaults they name.
fn plan(extra: &[&str]) -> Vec<String> {
    let defaults = [
        ("--experts", "2"),
        ("--top-k", "1"),
        ("--batch", "1"),
        ("--seq-len", "2"),
        ("--trials", "1"),
        ("--probes", "D"),
    ];
    let mut args = vec!["plan".to_string(), "--output".into(), tmp_dir().join("plan").to_str().unwrap().into()];
    for (flag, value) in defaults.iter().filter(|(f, _)| !extra.contains(f)) {
        args.extend([flag.to_string(), value.to_string()]);
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

/// A planned trace directory whose manifest `change` edits; returns its path.
fn traces_with(name: &str, change: impl FnOnce(&mut serde_json::Value)) -> String {
    let dir = tmp_dir().join(name);
    let out = Command::new(BIN)
        .args([
            "plan",
            "--experts",
            "2",
            "--top-k",
            "1",
            "--batch",
            "1",
            "--seq-len",
            "2",
            "--trials",
            "1",
            "--probes",
            "D",
        ])
        .arg("--output")
        .arg(&dir)
        .output()
        .expect("run moe-audit");
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let path = dir.join("manifest.json");
    let mut manifest: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    change(&mut manifest);
    std::fs::write(&path, manifest.to_string()).unwrap();
    dir.to_str().unwrap().to_string()
}

/// A planned trace directory whose `decisions.jsonl` is a FIFO that nothing writes.
fn traces_fifo() -> String {
    let dir = traces_with("t_fifo", |_| {});
    fifo("t_fifo/decisions.jsonl");
    dir
}

/// A router that answers its handshake, then a line of 20 MB.
fn sh_line_router() -> String {
    format!("printf '%s\\n' '{HANDSHAKE}'; read -r line; head -c 20000000 /dev/zero | tr '\\0' x; echo")
}

const ROW: &str = "[1, 2, 3, 4, 5, 6, 7, 8]";

/// (what, arguments) of every bad input.
fn catalogue() -> Vec<(&'static str, Vec<String>)> {
    let gate = Tensor::ones((8, 16), DType::F32, &Device::Cpu).unwrap();
    let weights = safetensors(
        "weights.safetensors",
        &[
            ("gate", gate.clone()),
            ("ids", Tensor::zeros((8, 16), DType::U32, &Device::Cpu).unwrap()),
            ("wide", Tensor::ones((4, 16), DType::F32, &Device::Cpu).unwrap()),
        ],
    );
    let nan_gate = safetensors("nan.safetensors", &[("gate", (gate.clone() * f64::NAN).unwrap())]);
    let big_gate = safetensors("big.safetensors", &[("gate", (gate * 1e5).unwrap())]);
    let empty_gate =
        safetensors("empty.safetensors", &[("gate", Tensor::zeros((8, 0), DType::F32, &Device::Cpu).unwrap())]);
    let route = |extra: &[&str]| [&["route"], extra].concat().iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let check = |extra: &[&str]| [&["check"], extra].concat().iter().map(|s| s.to_string()).collect::<Vec<_>>();
    // An explicit --max-memory: the default depends on the machine.
    let sweep = |path: String| {
        vec![
            "sweep".to_string(),
            path,
            "--max-memory".into(),
            "8GiB".into(),
            "--output-dir".into(),
            tmp_dir().join("sweep").to_str().unwrap().into(),
        ]
    };
    let external = |command: String| {
        check(&["--router-cmd", &command, "--batch", "1", "--seq-len", "1", "--probes", "D", "--timeout", "5"])
    };
    let replay = |path: String| vec!["replay".to_string(), path];
    let external_timeout = |t: &str| check(&["--router-cmd", "true", "--timeout", t]);
    vec![
        // Router configs
        ("unknown preset", route(&["no-such-router"])),
        ("TOML syntax", route(&[&file("syntax.toml", "name = \"t\"\nexperts = \n")])),
        ("top_k > experts", route(&[&router_with("top_k.toml", "top_k = 2", "top_k = 9")])),
        ("capacity factor 0", route(&[&router_with("factor.toml", "factor = 1.0", "factor = 0")])),
        ("zero experts", route(&[&router_with("experts.toml", "experts = 8", "experts = 0")])),
        (
            "expert_bias length",
            route(&[&router_with("bias.toml", "top_k = 2\n", "top_k = 2\nexpert_bias = [0.0, 1.0]\n")]),
        ),
        (
            "expert_bias NaN",
            route(&[&router_with(
                "bias_nan.toml",
                "top_k = 2\n",
                "top_k = 2\nexpert_bias = [0.0, 0.0, 0.0, nan, 0.0, 0.0, 0.0, 0.0]\n",
            )]),
        ),
        ("unknown policy", route(&[&router_with("policy.toml", "policy = \"probs\"", "policy = \"fifo\"")])),
        ("unknown field", route(&[&router_with("field.toml", "top_k = 2\n", "top_k = 2\ncolor = 1\n")])),
        ("factor and fixed", route(&[&router_with("both.toml", "factor = 1.0\n", "factor = 1.0\nfixed = 4\n")])),
        (
            "group_limit not dividing",
            route(&[&router_with(
                "groups.toml",
                "top_k = 2\n",
                "top_k = 2\ngroup_limit = { groups = 3, top_groups = 1 }\n",
            )]),
        ),
        ("router file is a directory", route(&[tmp_dir().to_str().unwrap()])),
        // Sweep grids
        ("sweep: missing file", sweep(tmp_dir().join("no-grid.toml").to_str().unwrap().into())),
        ("sweep: TOML syntax", sweep(file("g_syntax.toml", "top_k = [1,\n"))),
        ("sweep: top_k 0", sweep(file("g_topk.toml", "top_k = [1, 0]\n"))),
        ("sweep: unknown router", sweep(file("g_router.toml", "routers = [\"nope\"]\nheatmap = \"nope\"\n"))),
        ("sweep: unknown field", sweep(file("g_field.toml", "routerz = 1\n"))),
        ("sweep: too large", sweep(file("g_large.toml", "seq_len = [1000000000]\n"))),
        // CLI flags
        ("--batch 0", route(&["mixtral", "--batch", "0"])),
        ("--seq-len 0", check(&["mixtral", "--seq-len", "0"])),
        ("--hidden 0", route(&["mixtral", "--hidden", "0"])),
        ("unknown probe", check(&["mixtral", "--probes", "P,Q"])),
        ("--max-memory not a size", check(&["mixtral", "--max-memory", "lots"])),
        ("over --max-memory", check(&["mixtral", "--max-memory", "1KiB"])),
        ("--ranks not dividing the batch", check(&["mixtral", "--ranks", "3"])),
        ("unknown flag", route(&["mixtral", "--frobnicate"])),
        ("unknown command", vec!["frobnicate".into()]),
        ("missing router", check(&[])),
        ("--format unknown", check(&["mixtral", "--format", "yaml"])),
        // Logits files
        ("logits: missing file", route(&["megatron-probs", "--logits", tmp_dir().join("none.json").to_str().unwrap()])),
        ("logits: not JSON", route(&["megatron-probs", "--logits", &file("not.json", "not json")])),
        ("logits: empty", route(&["megatron-probs", "--logits", &file("empty.json", "[]")])),
        (
            "logits: short row",
            route(&["megatron-probs", "--logits", &file("short.json", &format!("[{ROW}, [1, 2]]")), "--batch", "1"]),
        ),
        (
            "logits: rows vs batch",
            route(&[
                "megatron-probs",
                "--logits",
                &file("three.json", &format!("[{ROW}, {ROW}, {ROW}]")),
                "--batch",
                "2",
            ]),
        ),
        (
            "logits: overflow to inf",
            route(&["megatron-probs", "--logits", &file("huge.json", "[[1, 2, 3, 1e40, 5, 6, 7, 8]]"), "--batch", "1"]),
        ),
        (
            "logits: null",
            route(&["megatron-probs", "--logits", &file("null.json", "[[1, 2, 3, null, 5, 6, 7, 8]]"), "--batch", "1"]),
        ),
        // Safetensors
        (
            "weights: missing file",
            check(&["mixtral", "--weights", tmp_dir().join("none.safetensors").to_str().unwrap(), "--gate", "gate"]),
        ),
        (
            "weights: not safetensors",
            check(&["mixtral", "--weights", &file("garbage.safetensors", "garbage"), "--gate", "gate"]),
        ),
        ("weights: no such tensor", check(&["mixtral", "--weights", &weights, "--gate", "nope"])),
        ("weights: integer dtype", check(&["mixtral", "--weights", &weights, "--gate", "ids"])),
        ("weights: wrong expert count", check(&["mixtral", "--weights", &weights, "--gate", "wide"])),
        ("weights: NaN gate", check(&["mixtral", "--weights", &nan_gate, "--gate", "gate"])),
        // Protocol messages
        ("protocol: handshake not JSON", external("echo hello".into())),
        ("protocol: wrong version", external(format!("echo '{}'", HANDSHAKE.replace("moe-audit/1", "moe-audit/3")))),
        // Found by fuzzing: rows were allocated from the declared size before it was checked.
        (
            "protocol: absurd expert count",
            external(format!("echo '{}'", HANDSHAKE.replace("\"experts\": 2", "\"experts\": 433333333333333"))),
        ),
        (
            // 64 experts x 16 pool rows x 4096 hidden values: 16 MiB of pool, checked against the flag.
            "protocol: hidden-row pool over --max-memory",
            [
                external(format!(
                    "echo '{}'",
                    HANDSHAKE
                        .replace("\"experts\": 2", "\"experts\": 64")
                        .replace("\"input\": \"logits\"", "\"input\": \"hidden\", \"hidden_size\": 4096")
                )),
                vec!["--max-memory".into(), "1MiB".into()],
            ]
            .concat(),
        ),
        ("protocol: response not JSON", external(sh_router(HANDSHAKE, "garbage"))),
        (
            "protocol: wrong id",
            external(sh_router(
                HANDSHAKE,
                r#"{"id": 9, "tokens": [[{"expert": 0, "weight": 1.0, "kept": true}]], "capacity": null}"#,
            )),
        ),
        (
            "protocol: expert out of range",
            external(sh_router(
                HANDSHAKE,
                r#"{"id": 1, "tokens": [[{"expert": 5, "weight": 1.0, "kept": true}]], "capacity": null}"#,
            )),
        ),
        (
            "protocol: unknown field",
            external(sh_router(HANDSHAKE, r#"{"id": 1, "tokens": [], "capacity": null, "extra": 1}"#)),
        ),
        ("protocol: router crashes", external("exit 3".into())),
        // Trace directories
        (
            "plan: too large",
            vec![
                "plan".into(),
                "--experts".into(),
                "8".into(),
                "--seq-len".into(),
                "100000000".into(),
                "--max-memory".into(),
                "8GiB".into(),
                "--output".into(),
                tmp_dir().join("plan").to_str().unwrap().into(),
            ],
        ),
        ("traces: no manifest", check(&["--traces", tmp_dir().join("no-traces").to_str().unwrap()])),
        // Witness files
        ("witness: missing file", replay(tmp_dir().join("none-witness.json").to_str().unwrap().into())),
        ("witness: not JSON", replay(file("w_garbage.json", "{"))),
        (
            "witness: wrong format",
            replay(witness_with("w_format.json", |w| w["format"] = "moe-audit-witness/0".into())),
        ),
        ("witness: invalid router", replay(witness_with("w_router.json", |w| w["router"]["top_k"] = 99.into()))),
        (
            "witness: ragged logits",
            replay(witness_with("w_rows.json", |w| w["a"]["logits"][0] = serde_json::json!([1.0]))),
        ),
        ("witness: token outside", replay(witness_with("w_token.json", |w| w["token_a"]["pos"] = 999.into()))),
        (
            "witness: logit beyond f32",
            replay(witness_with("w_huge.json", |w| w["b"]["logits"][0][0] = serde_json::json!(1e40))),
        ),
        // Reliability II. Flags
        ("--trials 0", check(&["mixtral", "--trials", "0"])),
        ("plan --trials 0", plan(&["--trials", "0"])),
        (
            "plan --experts 0",
            vec![
                "plan".into(),
                "--experts".into(),
                "0".into(),
                "--output".into(),
                tmp_dir().join("plan0").to_str().unwrap().into(),
            ],
        ),
        ("plan --top-k over --experts", plan(&["--top-k", "3"])),
        ("plan --name with a newline", plan(&["--name", "a\nb"])),
        ("--timeout NaN", external_timeout("NaN")),
        ("--timeout negative", external_timeout("-1")),
        ("--timeout 1e300", external_timeout("1e300")),
        ("--max-memory negative", check(&["mixtral", "--max-memory", "-1GiB"])),
        ("--max-memory 0", check(&["mixtral", "--max-memory", "0"])),
        ("an argument with a newline", route(&["no\nsuch"])),
        // Names
        ("router name with a newline", route(&[&router_with("name_nl.toml", "name = \"t\"", "name = \"a\\nb\"")])),
        (
            "router name too long",
            route(&[&router_with("name_long.toml", "name = \"t\"", &format!("name = \"{}\"", "n".repeat(201)))]),
        ),
        ("two routers named alike", check(&[&file("twin_a.toml", ROUTER), &file("twin_b.toml", ROUTER)])),
        ("the same preset twice", check(&["mixtral", "mixtral"])),
        (
            "protocol: handshake name with a control character",
            external(format!("echo '{}'", HANDSHAKE.replace("\"sh\"", "\"a\\u0007b\""))),
        ),
        // Reads bounded by the memory limit
        ("logits: /dev/zero", route(&["megatron-probs", "--logits", "/dev/zero", "--max-memory", "1MiB"])),
        (
            "logits: over --max-memory once parsed",
            route(&[
                "megatron-probs",
                "--logits",
                &file("many.json", &format!("[{}{ROW}]", format!("{ROW},").repeat(20000))),
                "--batch",
                "1",
                "--max-memory",
                "1MiB",
            ]),
        ),
        (
            "ep --input: the file's sizes over --max-memory",
            vec![
                "ep".into(),
                "mixtral".into(),
                "--hidden".into(),
                "4".into(),
                "--ffn".into(),
                "4".into(),
                "--batch".into(),
                "2".into(),
                "--input".into(),
                file("hidden.json", &format!("[{}[1, 2, 3, 4]]", "[1, 2, 3, 4],".repeat(199_999))),
                "--max-memory".into(),
                "100MiB".into(),
            ],
        ),
        ("witness: /dev/zero", vec!["replay".into(), "/dev/zero".into(), "--max-memory".into(), "64MiB".into()]),
        ("sweep: grid is /dev/zero", sweep("/dev/zero".into())),
        (
            "weights: /dev/zero",
            check(&["mixtral", "--weights", "/dev/zero", "--gate", "gate", "--max-memory", "64MiB"]),
        ),
        (
            "plan: targeted calls over the E passes",
            [
                "plan",
                "--experts",
                "128",
                "--max-memory",
                "1GiB",
                "--output",
                tmp_dir().join("plan128").to_str().unwrap(),
            ]
            .iter()
            .map(|s| s.to_string())
            .collect(),
        ),
        (
            "protocol: a line over a quarter of --max-memory",
            [external(sh_line_router()), vec!["--max-memory".into(), "48MiB".into()]].concat(),
        ),
        // Sizes from files, checked
        (
            "witness: batch x seq_len overflows",
            replay(witness_with("w_overflow.json", |w| {
                w["a"]["batch"] = (u64::MAX / 2).into();
                w["a"]["seq_len"] = 4.into();
            })),
        ),
        // Accepted silently before
        (
            "traces: no probes",
            check(&["--traces", &traces_with("t_probes", |m| m["options"]["probes"] = serde_json::json!([]))]),
        ),
        ("traces: batch 0", check(&["--traces", &traces_with("t_batch", |m| m["options"]["batch"] = 0.into())])),
        (
            "traces: a call id twice",
            check(&["--traces", &traces_with("t_dup", |m| m["calls"][1]["id"] = m["calls"][0]["id"].clone())]),
        ),
        ("weights: gate of shape [8, 0]", check(&["mixtral", "--weights", &empty_gate, "--gate", "gate"])),
        (
            "witness: stored routing on an expert out of range",
            replay(witness_with("w_stored.json", |w| w["after"]["routes"][0]["expert"] = 99.into())),
        ),
        ("capacity factor 1e308", route(&[&router_with("factor_huge.toml", "factor = 1.0", "factor = 1e308")])),
        // Unclear before
        (
            "X: f16 overflows a finite gate",
            check(&[
                "mixtral",
                "--weights",
                &big_gate,
                "--gate",
                "gate",
                "--probes",
                "X",
                "--batch",
                "1",
                "--seq-len",
                "4",
            ]),
        ),
        // Reliability II, leftovers: witnesses carry a content hash; a grid's factors are checked.
        (
            "witness: a logit edited (content hash)",
            replay(witness_with("w_edited.json", |w| w["b"]["logits"][0][0] = serde_json::json!(0.25))),
        ),
        (
            "witness: stored routing edited (content hash)",
            replay(witness_with("w_weight.json", |w| w["after"]["routes"][0]["weight"] = serde_json::json!(0.123))),
        ),
        ("witness: no content hash", replay(witness_with("w_nohash.json", |w| w["sha256"] = "".into()))),
        (
            "witness: the format before content hashes",
            replay(witness_with("w_old.json", |w| w["format"] = "moe-audit-witness/1".into())),
        ),
        ("sweep: capacity factor 1e308", sweep(file("g_cf.toml", "capacity_factor = [1.0, 1e308]\n"))),
        (
            "weights: a tensor named twice in the header",
            check(&["mixtral", "--weights", &twice_named(), "--gate", "gate"]),
        ),
        // Files that are not files: a FIFO never blocks the open, a device is read bounded.
        ("witness: a FIFO with no writer", replay(fifo("w_fifo.json"))),
        ("traces: decisions.jsonl a FIFO with no writer", check(&["--traces", &traces_fifo()])),
        (
            "snapshot check /dev/zero",
            vec!["snapshot".into(), "check".into(), "/dev/zero".into(), "--max-memory".into(), "64MiB".into()],
        ),
        (
            "--output: a FIFO with no reader",
            check(&["mixtral", "--batch", "1", "--seq-len", "2", "--probes", "D", "--output", &fifo("out_fifo.txt")]),
        ),
    ]
}

/// The environment is input too: a thread count that is not a number is an error, an absurd one
/// is capped (the run finishes, quickly, with the same output).
#[test]
fn the_environment_is_checked() {
    let run = |threads: &str| {
        Command::new(BIN).args(["route", "mixtral"]).env("RAYON_NUM_THREADS", threads).output().expect("run moe-audit")
    };
    for bad in ["lots", "-1", "1.5"] {
        let out = run(bad);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{bad}: {err}");
        assert!(
            err.starts_with("error: RAYON_NUM_THREADS must be a whole number") && err.lines().count() == 1,
            "{err}"
        );
    }
    let (one, huge) = (run("1"), run("1000000"));
    assert_eq!(huge.status.code(), Some(0), "{}", String::from_utf8_lossy(&huge.stderr));
    assert_eq!(one.stdout, huge.stdout);
}

#[test]
fn every_bad_input_exits_2_with_one_line_and_no_panic() {
    let tmp = tmp_dir().to_str().unwrap().to_string();
    let mut report = String::new();
    let cases = catalogue();
    assert!(cases.len() >= 30, "the catalogue has {} cases", cases.len());
    for (what, args) in cases {
        let out = Command::new(BIN)
            .args(&args)
            .env("RUST_BACKTRACE", "1")
            .env("RAYON_NUM_THREADS", "1")
            .output()
            .expect("run moe-audit");
        let err = String::from_utf8(out.stderr).expect("utf-8 stderr");
        assert!(!err.contains("panicked") && !err.contains("backtrace"), "{what}: panic:\n{err}");
        assert_eq!(out.status.code(), Some(2), "{what}: {args:?}: exit {:?}, stderr:\n{err}", out.status);
        assert!(out.stdout.is_empty(), "{what}: wrote to stdout");
        assert!(err.starts_with("error: ") && err.lines().count() == 1, "{what}: not one `error: ` line:\n{err}");
        report.push_str(&format!("{what}\n  {}\n", err.trim_end().replace(&tmp, "[TMP]")));
    }
    insta::assert_snapshot!(report, @r##"
    unknown preset
      error: unknown router `no-such-router`: not a preset (mixtral, deepseek-v3, switch, megatron-probs, megatron-position, megatron-probs-pad, deepspeed-top1, deepspeed-top2, deepspeed-topk-probs, expert-choice, aux-loss-free, causal-capacity, sinkhorn, batch-prioritized, expert-choice-tc-serve, expert-threshold, null-experts) and not a file
    TOML syntax
      error: [TMP]/syntax.toml: line 2, column 11: invalid string expected `"`, `'`
    top_k > experts
      error: [TMP]/top_k.toml: top_k: 9 exceeds experts = 8
    capacity factor 0
      error: [TMP]/factor.toml: capacity.factor: must be finite and > 0, got 0
    zero experts
      error: [TMP]/experts.toml: experts: must be at least 1, got 0
    expert_bias length
      error: [TMP]/bias.toml: expert_bias: has 2 entries, expected one per expert (8)
    expert_bias NaN
      error: [TMP]/bias_nan.toml: expert_bias: entry 3 is NaN, must be finite
    unknown policy
      error: [TMP]/policy.toml: capacity.policy: unknown variant `fifo`, expected one of `probs`, `position`, `choice-rank`, `batch-priority`, `causal` (line 9, column 10)
    unknown field
      error: [TMP]/field.toml: color: unknown field `color`, expected one of `name`, `description`, `kind`, `experts`, `top_k`, `score`, `normalize`, `expert_bias`, `group_limit`, `routed_scaling`, `selection`, `bias_update_rate`, `capacity`, `scope`, `padding_mask`, `threshold`, `null_experts`, `inference` (line 5, column 1)
    factor and fixed
      error: [TMP]/both.toml: capacity: set either `factor` or `fixed`, not both
    group_limit not dividing
      error: [TMP]/groups.toml: group_limit.groups: 3 does not divide experts = 8
    router file is a directory
      error: unknown router `[TMP]`: not a preset (mixtral, deepseek-v3, switch, megatron-probs, megatron-position, megatron-probs-pad, deepspeed-top1, deepspeed-top2, deepspeed-topk-probs, expert-choice, aux-loss-free, causal-capacity, sinkhorn, batch-prioritized, expert-choice-tc-serve, expert-threshold, null-experts) and not a file
    sweep: missing file
      error: [TMP]/no-grid.toml: cannot read: No such file or directory (os error 2)
    sweep: TOML syntax
      error: [TMP]/g_syntax.toml: line 2, column 1: invalid array expected `]`
    sweep: top_k 0
      error: [TMP]/g_topk.toml: top_k[1]: must be at least 1, got 0
    sweep: unknown router
      error: [TMP]/g_router.toml: routers[0]: unknown router `nope`: not a preset (mixtral, deepseek-v3, switch, megatron-probs, megatron-position, megatron-probs-pad, deepspeed-top1, deepspeed-top2, deepspeed-topk-probs, expert-choice, aux-loss-free, causal-capacity, sinkhorn, batch-prioritized, expert-choice-tc-serve, expert-threshold, null-experts) and not a file
    sweep: unknown field
      error: [TMP]/g_field.toml: routerz: unknown field `routerz`, expected one of `routers`, `capacity_factor`, `top_k`, `experts`, `seq_len`, `batch`, `trials`, `seed`, `hidden`, `ffn`, `balance_steps`, `numerics`, `heatmap`, `exploit` (line 1, column 1)
    sweep: too large
      error: [TMP]/g_large.toml: the cell mixtral (batch 4 x seq_len 1000000000, 8 experts) needs about 3.9 TiB of memory, over the limit of 8.0 GiB (--max-memory; the default is half of physical memory): use smaller sizes or raise the limit
    --batch 0
      error: --batch must be at least 1
    --seq-len 0
      error: --seq-len must be at least 1
    --hidden 0
      error: --hidden must be at least 1
    unknown probe
      error: --probes: unknown probe `Q`, expected some of P,F,N,R,D,S,M,L,X
    --max-memory not a size
      error: invalid value 'lots' for '--max-memory <SIZE>': `lots` is not a size: use a positive number of bytes with a unit, e.g. 512MiB or 4GiB (see --help)
    over --max-memory
      error: the audit of `mixtral` needs about 42.1 MiB of memory, over the limit of 1.0 KiB (--max-memory; the default is half of physical memory): use smaller sizes or raise the limit
    --ranks not dividing the batch
      error: --ranks 3: the batch of 4 sequences must split evenly over the ranks
    unknown flag
      error: unexpected argument '--frobnicate' found (see --help)
    unknown command
      error: unrecognized subcommand 'frobnicate' (see --help)
    missing router
      error: the following required arguments were not provided: <ROUTERS|--router-cmd <COMMAND>|--traces <DIR>> (see --help)
    --format unknown
      error: invalid value 'yaml' for '--format <FORMAT>' [possible values: text, json, markdown, junit, html] (see --help)
    logits: missing file
      error: [TMP]/none.json: cannot read: No such file or directory (os error 2)
    logits: not JSON
      error: [TMP]/not.json: expected a JSON array of rows of numbers: expected ident at line 1 column 2
    logits: empty
      error: [TMP]/empty.json: 0 rows cannot be split into --batch 2 sequences
    logits: short row
      error: [TMP]/short.json: row 1 has 2 values, the router has 8 experts
    logits: rows vs batch
      error: [TMP]/three.json: 3 rows cannot be split into --batch 2 sequences
    logits: overflow to inf
      error: non-finite score inf at batch 0, position 0, expert 3
    logits: null
      error: [TMP]/null.json: expected a JSON array of rows of numbers: invalid type: null, expected f64 at line 1 column 15
    weights: missing file
      error: [TMP]/none.safetensors: cannot read: No such file or directory (os error 2)
    weights: not safetensors
      error: [TMP]/garbage.safetensors: cannot load safetensors: header too small
    weights: no such tensor
      error: [TMP]/weights.safetensors: no tensor `nope`; it has gate, ids, wide
    weights: integer dtype
      error: [TMP]/weights.safetensors: tensor `ids` is U32, expected a float dtype (f16, bf16, f32, f64)
    weights: wrong expert count
      error: [TMP]/weights.safetensors: tensor `wide` has 4 rows (experts), router `mixtral` has 8 experts
    weights: NaN gate
      error: [TMP]/nan.safetensors: tensor `gate` has a non-finite value NaN at flat index 0
    protocol: handshake not JSON
      error: router `echo hello`: wrote `hello` on stdout before its handshake: stdout carries the protocol only; print to stderr instead (Python: print(..., file=sys.stderr))
    protocol: wrong version
      error: router `echo '{"protocol": "moe-audit/3", "name": "sh", "experts": 2, "top_k": 1, "input": "logits"}'`: bad handshake (handshake: protocol `moe-audit/3`, expected `moe-audit/1` or `moe-audit/2`): `{"protocol": "moe-audit/3", "name": "sh", "experts": 2, "top_k": 1, "input": "logits"}`
    protocol: absurd expert count
      error: router `echo '{"protocol": "moe-audit/1", "name": "sh", "experts": 433333333333333, "top_k": 1, "input": "logits"}'`: bad handshake (handshake: experts 433333333333333 is not from 1 to 1048576): `{"protocol": "moe-audit/1", "name": "sh", "experts": 433333333333333, "top_k": 1, "input": "logits"}`
    protocol: hidden-row pool over --max-memory
      error: the targeted-row pool of router `sh` needs about 16.0 MiB of memory, over the limit of 1.0 MiB (--max-memory; the default is half of physical memory): use smaller sizes or raise the limit
    protocol: response not JSON
      error: router `printf '%s\n' '{"protocol": "moe-audit/1", "name": "sh", "experts": 2, "top_k": 1, "input": "logits"}'; while read -r line; do printf '%s\n' 'garbage'; done`: request 1 (train, batch 1 x seq_len 1): not a response (expected value at line 1 column 1): `garbage`
    protocol: wrong id
      error: router `printf '%s\n' '{"protocol": "moe-audit/1", "name": "sh", "experts": 2, "top_k": 1, "input": "logits"}'; while read -r line; do printf '%s\n' '{"id": 9, "tokens": [[{"expert": 0, "weight": 1.0, "kept": true}]], "capacity": null}'; done`: request 1 (train, batch 1 x seq_len 1): response id 9 does not match
    protocol: expert out of range
      error: router `printf '%s\n' '{"protocol": "moe-audit/1", "name": "sh", "experts": 2, "top_k": 1, "input": "logits"}'; while read -r line; do printf '%s\n' '{"id": 1, "tokens": [[{"expert": 5, "weight": 1.0, "kept": true}]], "capacity": null}'; done`: request 1 (train, batch 1 x seq_len 1): token 0 (batch 0, position 0): expert 5 is out of range 0 to 1
    protocol: unknown field
      error: router `printf '%s\n' '{"protocol": "moe-audit/1", "name": "sh", "experts": 2, "top_k": 1, "input": "logits"}'; while read -r line; do printf '%s\n' '{"id": 1, "tokens": [], "capacity": null, "extra": 1}'; done`: request 1 (train, batch 1 x seq_len 1): not a response (unknown field `extra`, expected one of `id`, `tokens`, `capacity` at line 1 column 49): `{"id": 1, "tokens": [], "capacity": null, "extra": 1}`
    protocol: router crashes
      error: router `exit 3`: the router exited (exit status: 3) before its handshake
    plan: too large
      error: this plan needs about 2.8 EiB of memory, over the limit of 8.0 GiB (--max-memory; the default is half of physical memory): use smaller sizes or raise the limit
    traces: no manifest
      error: [TMP]/no-traces/manifest.json: cannot read (write it with `moe-audit plan`): No such file or directory (os error 2)
    witness: missing file
      error: [TMP]/none-witness.json: cannot read: No such file or directory (os error 2)
    witness: not JSON
      error: [TMP]/w_garbage.json: not a witness: EOF while parsing an object at line 1 column 1
    witness: wrong format
      error: [TMP]/w_format.json: format `moe-audit-witness/0` is not `moe-audit-witness/2`
    witness: invalid router
      error: [TMP]/w_router.json: router.top_k: 99 exceeds experts = 8
    witness: ragged logits
      error: [TMP]/w_rows.json: call `a`: expected 4 rows of equal length
    witness: token outside
      error: [TMP]/w_token.json: the witness token lies outside its calls
    witness: logit beyond f32
      error: [TMP]/w_huge.json: not a witness: number out of range at line 1 column 606
    --trials 0
      error: --trials must be at least 1
    plan --trials 0
      error: --trials must be at least 1
    plan --experts 0
      error: --experts must be from 1 to 1048576, got 0
    plan --top-k over --experts
      error: --top-k must be from 1 to 2 (--experts), got 3
    plan --name with a newline
      error: --name holds the control character '\n': names appear in one-line reports
    --timeout NaN
      error: --timeout must be a number of seconds in (0, 86400], got NaN
    --timeout negative
      error: --timeout must be a number of seconds in (0, 86400], got -1.0
    --timeout 1e300
      error: --timeout must be a number of seconds in (0, 86400], got 1e300
    --max-memory negative
      error: invalid value '-1GiB' for '--max-memory <SIZE>': `-1GiB` is not a size: use a positive number of bytes with a unit, e.g. 512MiB or 4GiB (see --help)
    --max-memory 0
      error: invalid value '0' for '--max-memory <SIZE>': a limit of 0 bytes lets nothing run: use a positive size, e.g. 512MiB (see --help)
    an argument with a newline
      error: unknown router `no\nsuch`: not a preset (mixtral, deepseek-v3, switch, megatron-probs, megatron-position, megatron-probs-pad, deepspeed-top1, deepspeed-top2, deepspeed-topk-probs, expert-choice, aux-loss-free, causal-capacity, sinkhorn, batch-prioritized, expert-choice-tc-serve, expert-threshold, null-experts) and not a file
    router name with a newline
      error: [TMP]/name_nl.toml: name: holds the control character '\n': names appear in one-line reports
    router name too long
      error: [TMP]/name_long.toml: name: has 201 characters, at most 200 are allowed
    two routers named alike
      error: two routers are named `t`: give each router of a run its own name
    the same preset twice
      error: two routers are named `mixtral`: give each router of a run its own name
    protocol: handshake name with a control character
      error: router `echo '{"protocol": "moe-audit/1", "name": "a\u0007b", "experts": 2, "top_k": 1, "input": "logits"}'`: bad handshake (handshake: name holds the control character '\u{7}': names appear in one-line reports): `{"protocol": "moe-audit/1", "name": "a\u0007b", "experts": 2, "top_k": 1, "input": "logits"}`
    logits: /dev/zero
      error: /dev/zero: larger than 1.0 MiB (--max-memory); it may never end
    logits: over --max-memory once parsed
      error: reading [TMP]/many.json needs about 4.4 MiB of memory, over the limit of 1.0 MiB (--max-memory; the default is half of physical memory): use smaller sizes or raise the limit
    ep --input: the file's sizes over --max-memory
      error: this forward needs about 187.6 MiB of memory, over the limit of 100.0 MiB (--max-memory; the default is half of physical memory): use smaller sizes or raise the limit
    witness: /dev/zero
      error: /dev/zero: larger than 16.0 MiB (a quarter of --max-memory); it may never end
    sweep: grid is /dev/zero
      error: /dev/zero: larger than 16.0 MiB (the most a sweep grid may hold); it may never end
    weights: /dev/zero
      error: /dev/zero: larger than 32.0 MiB (half of --max-memory); it may never end
    plan: targeted calls over the E passes
      error: this plan needs about 5.2 GiB of memory, over the limit of 1.0 GiB (--max-memory; the default is half of physical memory): use smaller sizes or raise the limit
    protocol: a line over a quarter of --max-memory
      error: router `printf '%s\n' '{"protocol": "moe-audit/1", "name": "sh", "experts": 2, "top_k": 1, "input": "logits"}'; read -r line; head -c 20000000 /dev/zero | tr '\0' x; echo`: reading the answer to request 1 (train, batch 1 x seq_len 1): a line longer than 12.0 MiB (--max-memory)
    witness: batch x seq_len overflows
      error: [TMP]/w_overflow.json: call `a`: batch 9223372036854775807 x seq_len 4 overflows
    traces: no probes
      error: [TMP]/t_probes/manifest.json: options.probes: is empty: an audit that runs no probe cannot pass
    traces: batch 0
      error: [TMP]/t_batch/manifest.json: options.batch: must be at least 1, got 0
    traces: a call id twice
      error: [TMP]/t_dup/manifest.json: calls: id 1 appears twice (every call has its own id)
    weights: gate of shape [8, 0]
      error: [TMP]/empty.safetensors: tensor `gate` has shape [8, 0]: a gate needs a hidden size of at least 1
    witness: stored routing on an expert out of range
      error: [TMP]/w_stored.json: `after` routes to expert 99 twice or out of range 0 to 7
    capacity factor 1e308
      error: [TMP]/factor_huge.toml: capacity.factor: 1e308 is over 1000000.0: no token is dropped long before; use a fixed capacity or a smaller factor
    X: f16 overflows a finite gate
      error: probe X: f16 overflows at batch 0, position 0, expert 0: the logit 621724.3 (f32) becomes inf in f16 (largest finite 65504); scale the gate down or leave X out
    witness: a logit edited (content hash)
      error: [TMP]/w_edited.json: the content does not match its `sha256` (edited or corrupted): write the witness again with --witness-dir
    witness: stored routing edited (content hash)
      error: [TMP]/w_weight.json: the content does not match its `sha256` (edited or corrupted): write the witness again with --witness-dir
    witness: no content hash
      error: [TMP]/w_nohash.json: no `sha256` content hash to check
    witness: the format before content hashes
      error: [TMP]/w_old.json: format `moe-audit-witness/1` has no content hash to check: write the witness again with --witness-dir
    sweep: capacity factor 1e308
      error: [TMP]/g_cf.toml: capacity_factor[1]: 1e308 is over 1000000.0: no token is dropped long before; use a smaller factor
    weights: a tensor named twice in the header
      error: [TMP]/twice.safetensors: the header names tensor `gate` twice
    witness: a FIFO with no writer
      error: [TMP]/w_fifo.json: not a witness: EOF while parsing a value at line 1 column 0
    traces: decisions.jsonl a FIFO with no writer
      error: [TMP]/t_fifo/decisions.jsonl: no response for call 1 (train, tensor `call.0`)
    snapshot check /dev/zero
      error: /dev/zero: larger than 16.0 MiB (a quarter of --max-memory); it may never end
    --output: a FIFO with no reader
      error: [TMP]/out_fifo.txt: cannot write: No such device or address (os error 6)
    "##);
}
