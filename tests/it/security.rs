//! The threat model of docs/SECURITY.md, one test per input kind: moe-audit runs in CI on
//! untrusted pull requests, so every file it reads is data written by a stranger. Each test
//! tries the obvious abuse and checks that it starts no process, writes nothing, reads nothing
//! outside the folder it was pointed at, and ends with one error line (exit 2).

use moe_audit::snapshot::SnapshotFile;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_moe-audit");

/// A fresh directory for one test.
fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("moe-audit-it-security-{}", std::process::id())).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

fn run_in(dir: &Path, args: &[&str]) -> Output {
    Command::new(BIN).args(args).current_dir(dir).envs(crate::external::python_env()).output().expect("run moe-audit")
}

/// Runs, expects exit 2 with one error line, and returns that line.
fn refused(dir: &Path, args: &[&str]) -> String {
    let out = run_in(dir, args);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(2), "{args:?}: {err}{}", String::from_utf8_lossy(&out.stdout));
    assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
    err.trim_end().to_string()
}

fn ok(dir: &Path, args: &[&str]) -> String {
    let out = run_in(dir, args);
    assert_eq!(out.status.code(), Some(0), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A Python router on 4 logits: the best expert, weight 1.
const ROUTER: &str = r#"import numpy as np
from moe_audit import routes_from_arrays, run

def route(data, mode):
    top = np.argsort(-data.reshape(-1, 4), axis=1, kind="stable")[:, :1]
    return routes_from_arrays(top, np.ones(top.shape)), None

run(route, name="r", experts=4, top_k=1, input="logits")
"#;

/// The issue's scenario: a header's command is a record, never run; the header is sealed.
#[test]
fn a_snapshot_header_never_runs_its_command() {
    if !crate::external::numpy() {
        return;
    }
    let dir = tmp("command");
    std::fs::write(dir.join("r.py"), ROUTER).unwrap();
    ok(&dir, &["snapshot", "record", "--router-cmd", "python3 r.py", "--output", "r.snap"]);
    let text = std::fs::read_to_string(dir.join("r.snap")).unwrap();
    assert!(text.contains("command = \"python3 r.py\"\n"), "{text}");
    // Given on the command line, the command runs and the snapshot checks clean.
    assert!(ok(&dir, &["snapshot", "check", "r.snap", "--router-cmd", "python3 r.py"]).starts_with("r.snap: unchanged"));
    // Without it, nothing runs: the header's command is named, not executed.
    let e = refused(&dir, &["snapshot", "check", "r.snap"]);
    assert_eq!(
        e,
        "error: r.snap: [router] command = \"python3 r.py\" is a record for the reader, never run from the file: give the router's command with --router-cmd"
    );
    // A hand-edited command: the seal refuses the header before anything runs, with or without
    // --router-cmd (either command), and --update rewrites nothing.
    let edited = text.replace("command = \"python3 r.py\"", "command = \"touch PWNED; python3 r.py\"");
    std::fs::write(dir.join("r.snap"), &edited).unwrap();
    for args in [
        &["snapshot", "check", "r.snap"][..],
        &["snapshot", "update", "r.snap"],
        &["snapshot", "check", "r.snap", "--router-cmd", "python3 r.py"],
        &["snapshot", "update", "r.snap", "--router-cmd", "python3 r.py"],
        &["snapshot", "check", "r.snap", "--router-cmd", "touch PWNED; python3 r.py"],
    ] {
        let e = refused(&dir, args);
        assert!(e.starts_with("error: r.snap: the header does not match its `header_sha256`"), "{args:?}: {e}");
        assert!(!dir.join("PWNED").exists(), "{args:?} ran the header's command");
    }
    assert_eq!(std::fs::read_to_string(dir.join("r.snap")).unwrap(), edited, "--update rewrote an edited file");
    // Resealed by the stranger: the command is still only named, and a different one given is
    // refused naming both.
    let mut f = SnapshotFile::parse(&text, Path::new("r.snap")).unwrap();
    f.header.router =
        moe_audit::snapshot::RouterSource::Command { command: "touch PWNED; python3 r.py".into(), timeout: 60.0 };
    std::fs::write(dir.join("r.snap"), f.render()).unwrap();
    for flag in ["check", "update"] {
        assert_eq!(
            refused(&dir, &["snapshot", flag, "r.snap"]),
            "error: r.snap: [router] command = \"touch PWNED; python3 r.py\" is a record for the reader, never run from the file: give the router's command with --router-cmd"
        );
        assert_eq!(
            refused(&dir, &["snapshot", flag, "r.snap", "--router-cmd", "python3 r.py"]),
            "error: r.snap: --router-cmd \"python3 r.py\" is not the header's [router] command = \"touch PWNED; python3 r.py\": neither is run"
        );
    }
    assert!(!dir.join("PWNED").exists());
    // --timeout has the bounds of every other router command.
    let e = refused(&dir, &["snapshot", "record", "--router-cmd", "python3 r.py", "--timeout", "1e30"]);
    assert_eq!(e, "error: --timeout must be a number of seconds in (0, 86400], got 1e30");
}

/// Any edit of a header value is refused, never "unchanged"; a resealed header is still bounded.
#[test]
fn an_edited_snapshot_header_is_refused_and_a_resealed_one_is_bounded() {
    let dir = tmp("header");
    ok(&dir, &["snapshot", "record", "megatron-probs", "--output", "m.snap"]);
    let text = std::fs::read_to_string(dir.join("m.snap")).unwrap();
    for (from, to) in [
        ("seed = 0", "seed = 1"),
        ("batch = 2", "batch = 3"),
        ("name = \"megatron-probs\"", "name = \"mixtral\""),
        ("modes = [\"train\", \"inference\"]", "modes = [\"train\"]"),
    ] {
        assert!(text.contains(from), "{from}");
        std::fs::write(dir.join("e.snap"), text.replace(from, to)).unwrap();
        for flag in ["check", "update"] {
            let e = refused(&dir, &["snapshot", flag, "e.snap"]);
            assert!(e.starts_with("error: e.snap: the header does not match its `header_sha256`"), "{to}: {e}");
        }
    }
    // A stranger can reseal (a seal is no signature): what the header may then cause is bounded.
    let stored = SnapshotFile::parse(&text, Path::new("m.snap")).unwrap();
    let write = |name: &str, edit: &dyn Fn(&mut SnapshotFile)| {
        let mut f = stored.clone();
        edit(&mut f);
        std::fs::write(dir.join(name), f.render()).unwrap();
    };
    write("huge.snap", &|f| f.header.input.batch = 1 << 40);
    let e = refused(&dir, &["snapshot", "check", "huge.snap", "--max-memory", "1GiB"]);
    assert!(e.starts_with("error: this snapshot needs about"), "{e}");
    write("wide.snap", &|f| f.header.input.hidden = Some(1 << 40));
    let e = refused(&dir, &["snapshot", "check", "wide.snap", "--max-memory", "1GiB"]);
    assert!(e.starts_with("error: this snapshot needs about"), "{e}");
    // A preset name that is a path is not read.
    write("path.snap", &|f| {
        f.header.router = moe_audit::snapshot::RouterSource::Preset { name: "/etc/hostname".into() }
    });
    assert_eq!(
        refused(&dir, &["snapshot", "check", "path.snap"]),
        "error: path.snap: [router] name = \"/etc/hostname\" is not a preset"
    );
}

/// Files a header names stay inside the working directory: no absolute path, `..` or symlink out.
#[test]
fn snapshot_header_paths_stay_inside_the_working_directory() {
    let dir = tmp("paths");
    let work = dir.join("work");
    std::fs::create_dir_all(&work).unwrap();
    let rows: Vec<Vec<f32>> = (0..16).map(|t| (0..8).map(|e| ((t * 3 + e * 5) % 7) as f32).collect()).collect();
    std::fs::write(work.join("l.json"), serde_json::to_string(&rows).unwrap()).unwrap();
    std::fs::write(dir.join("outside.json"), serde_json::to_string(&rows).unwrap()).unwrap();
    std::os::unix::fs::symlink("../outside.json", work.join("link.json")).unwrap();
    ok(&work, &["snapshot", "record", "mixtral", "--logits", "l.json", "--output", "l.snap"]);
    ok(&work, &["snapshot", "check", "l.snap"]);
    let stored =
        SnapshotFile::parse(&std::fs::read_to_string(work.join("l.snap")).unwrap(), Path::new("l.snap")).unwrap();
    let outside = dir.join("outside.json");
    for (file, want) in [
        (outside.to_str().unwrap(), "[input] file: an absolute path or `..` leads out of the working directory"),
        ("../outside.json", "[input] file: an absolute path or `..` leads out of the working directory"),
        ("link.json", "[input] file: a symlink leads out of the working directory"),
    ] {
        let mut f = stored.clone();
        f.header.input.file = Some(file.into());
        std::fs::write(work.join("p.snap"), f.render()).unwrap();
        let e = refused(&work, &["snapshot", "check", "p.snap"]);
        assert!(e.contains(want), "{file}: {e}");
    }
    // A router TOML named by the header, likewise.
    let mut f = stored.clone();
    f.header.router = moe_audit::snapshot::RouterSource::Config { path: "../r.toml".into(), sha256: String::new() };
    std::fs::write(work.join("c.snap"), f.render()).unwrap();
    assert!(refused(&work, &["snapshot", "check", "c.snap"]).contains("[router] path: an absolute path or `..`"));
}

/// A trace folder's files are its own: a symlink out of it is not followed.
#[test]
fn trace_folder_files_do_not_lead_out_of_the_folder() {
    let dir = tmp("traces");
    let t = dir.join("t");
    let ts = t.to_str().unwrap();
    ok(&dir, &["snapshot", "plan", ts, "--experts", "4", "--top-k", "1", "--seq-len", "2", "--batch", "1"]);
    std::fs::write(dir.join("secret.jsonl"), "{\"id\": 1, \"token\": \"s3cret\"}\n").unwrap();
    std::os::unix::fs::symlink("../secret.jsonl", t.join("decisions.jsonl")).unwrap();
    for args in [&["snapshot", "record", "--traces", ts][..], &["check", "--traces", ts]] {
        let e = refused(&dir, args);
        assert!(e.contains("decisions.jsonl: decisions.jsonl: a symlink leads out of"), "{args:?}: {e}");
        assert!(!e.contains("s3cret"), "{e}");
    }
    std::fs::remove_file(t.join("decisions.jsonl")).unwrap();
    std::fs::rename(t.join("manifest.json"), dir.join("manifest.json")).unwrap();
    std::os::unix::fs::symlink("../manifest.json", t.join("manifest.json")).unwrap();
    let e = refused(&dir, &["check", "--traces", ts]);
    assert!(e.contains("manifest.json: a symlink leads out of"), "{e}");
}

/// A sweep grid names router files inside its own folder only.
#[test]
fn a_sweep_grid_names_no_router_outside_its_folder() {
    let dir = tmp("sweep");
    std::fs::create_dir_all(dir.join("g")).unwrap();
    let router = moe_audit::config::preset("switch").unwrap().toml;
    std::fs::write(dir.join("outside.toml"), router).unwrap();
    for name in ["../outside.toml", dir.join("outside.toml").to_str().unwrap()] {
        let grid = format!("routers = [{name:?}]\nheatmap = {name:?}\n");
        std::fs::write(dir.join("g/grid.toml"), grid).unwrap();
        let e = refused(&dir, &["sweep", "g/grid.toml", "--output-dir", "out", "--max-memory", "1GiB"]);
        assert!(e.contains("routers[0]: an absolute path or `..` leads out of g"), "{name}: {e}");
        assert!(!dir.join("out").exists());
    }
}

/// A router TOML holds a router, nothing to run: an unknown field (a command) is an error.
#[test]
fn a_router_config_runs_nothing() {
    let dir = tmp("toml");
    let router = moe_audit::config::preset("switch").unwrap().toml;
    std::fs::write(dir.join("r.toml"), router.to_string() + "command = \"touch PWNED\"\n").unwrap();
    let e = refused(&dir, &["route", "r.toml"]);
    assert!(e.contains("unknown field `command`"), "{e}");
    assert!(!dir.join("PWNED").exists());
}

/// A witness replays from its own data: its router is a description, never a command, and a
/// witness names no file (a field it does not know is ignored, and the seal covers the rest).
#[test]
fn a_witness_runs_nothing_and_names_no_file() {
    let dir = tmp("witness");
    let args = ["check", "megatron-probs", "--probes", "P", "--seq-len", "8", "--batch", "2", "--witness-dir", "w"];
    let out = run_in(&dir, &args);
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stderr));
    let path = dir.join("w/megatron-probs-P.json");
    let text = std::fs::read_to_string(&path).unwrap();
    // Edited: refused by its seal.
    let mut json: serde_json::Value = serde_json::from_str(&text).unwrap();
    json["router"]["name"] = "touch PWNED".into();
    std::fs::write(&path, json.to_string()).unwrap();
    assert!(refused(&dir, &["replay", "w/megatron-probs-P.json"]).contains("does not match its `sha256`"));
    // Resealed, with a command for a name and a file and command beside: replayed from the data.
    let mut w: moe_audit::analyze::Witness = serde_json::from_str(&text).unwrap();
    w.router.as_mut().expect("a config witness").name = "touch PWNED".into();
    w.seal().unwrap();
    let mut json = serde_json::to_value(&w).unwrap();
    json["command"] = "touch PWNED2".into();
    json["logits_file"] = "/etc/hostname".into();
    std::fs::write(&path, json.to_string()).unwrap();
    let out = run_in(&dir, &["replay", "w/megatron-probs-P.json"]);
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("touch PWNED"));
    assert!(!dir.join("PWNED").exists() && !dir.join("PWNED2").exists());
}

// ---------------------------------------------------------------------------------------------
// What a message quotes of what it read is a short excerpt, escaped: a field of 64 MiB is not
// a message of 64 MiB, and a terminal escape, a newline or a bidirectional override in it
// reaches the terminal as text (docs/SECURITY.md). One case per reader and input kind.

/// What a stranger writes where a short value belongs: a terminal escape, a newline and a
/// right-to-left override, then `len` letters.
fn huge(len: usize) -> String {
    format!("\u{1b}[31m\n\u{202e}{}", "A".repeat(len))
}

/// [`huge`] as a TOML basic string.
fn huge_toml(len: usize) -> String {
    format!("\"\\u001B[31m\\n\\u202E{}\"", "A".repeat(len))
}

/// Runs in `dir` and expects exit 2 with one error line under 1 KiB that holds no control or
/// bidirectional character, says `want` (the start of the huge field, escaped, where the line
/// quotes it) and cuts the field short (`chars in all`). Returns the line.
fn excerpted(dir: &Path, args: &[&str], want: &str) -> String {
    let out = run_in(dir, args);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    let start: String = err.chars().take(600).collect();
    let what = args.iter().map(|a| a.chars().take(80).collect::<String>()).collect::<Vec<_>>();
    assert_eq!(out.status.code(), Some(2), "{what:?}: {start}");
    assert!(err.len() < 1024, "{what:?}: {} bytes on stderr: {start}", err.len());
    assert_eq!(err.lines().count(), 1, "{what:?}: {err}");
    let line = err.trim_end();
    assert!(!line.chars().any(|c| c.is_control() || c == '\u{202e}'), "{what:?}: {line:?}");
    assert!(line.starts_with("error: ") && line.contains(want), "{what:?}: want {want:?}: {line}");
    assert!(line.contains("chars in all]"), "{what:?}: {line}");
    line.to_string()
}

/// Routing records: every reader of `routes compare`, a huge field where each reads a short one.
#[test]
fn a_routing_record_is_quoted_in_a_short_escaped_excerpt() {
    use crate::routes::route_files::{config, npy, npz, random_routes, safetensors, Generic, Tensor};
    let dir = tmp("excerpt-records");
    let put = |name: &str, bytes: &[u8]| {
        std::fs::write(dir.join(name), bytes).unwrap();
        name.to_string()
    };
    let routes = random_routes(4, 2, 1, 8, 1);
    let g =
        Generic { routes: &routes, tokens: 4, layers: &[0, 1], k: 1, logits: None, input_ids: None, cu_seqlens: None };
    let good = put("good.safetensors", &g.bytes());
    let c = put("config.json", config(2, 0, 8, 1).as_bytes());
    let compare = |file: &str, want: &str| excerpted(&dir, &["routes", "compare", file, &good, "--config", &c], want);
    // The issue's case: a Megatron trace line whose `block` is 64 MiB.
    let line = serde_json::json!({"step": 0, "stage": "pre_dispatch", "block": huge(64 << 20), "layer": 0,
        "rank": 0, "num_tokens": 1, "topk": 1, "top_indices": [[0]]});
    let f = put("router_trace_rank0.jsonl", format!("{line}\n").as_bytes());
    let e = compare(&f, "line 1: `block` is \"\\u001b[31m\\n\\u{202e}AAAA");
    assert!(e.ends_with("AAAA\", not \"decoder\" or \"mtp\""), "{e}");
    // A `.npy` header (version 2: a 4-byte length) with a dtype of 4 MiB.
    let header = format!("{{'descr': '{}', 'fortran_order': False, 'shape': (1,), }}\n", huge(4 << 20));
    let mut v2 = b"\x93NUMPY\x02\x00".to_vec();
    v2.extend_from_slice(&(header.len() as u32).to_le_bytes());
    v2.extend_from_slice(header.as_bytes());
    compare(&put("descr.npy", &v2), "dtype '\\u{1b}[31m\\n\\u{202e}AAAA");
    // An `.npz` entry name of 60 KB (a zip name holds at most 64 KiB), among 2000 others.
    let long = format!("{}.npy", huge(60_000));
    let array = npy("<i4", &[1], &[0; 4]);
    let mut entries: Vec<(String, Vec<u8>)> = (0..2000).map(|i| (format!("x{i}.npy"), array.clone())).collect();
    entries.insert(0, (long, array.clone()));
    let entries: Vec<(&str, Vec<u8>)> = entries.iter().map(|(n, b)| (n.as_str(), b.clone())).collect();
    let e = compare(&put("names.npz", &npz(&entries)), "no routing array (found: \\u{1b}[31m\\n\\u{202e}AAAA");
    assert!(e.contains("(2001 in all)"), "{e}");
    // safetensors: a tensor name, a dtype, the metadata's format, a shape of a million dimensions.
    fn one<'a>(name: &'a str, dtype: &'a str, shape: Vec<usize>) -> Tensor<'a> {
        Tensor { name, dtype, shape, data: vec![0; 4] }
    }
    let name = huge(4 << 20);
    let f = put("name.safetensors", &safetensors(&[one(&name, "I32", vec![1])], &Default::default()));
    compare(&f, "no routing array (found: \\u{1b}[31m\\n\\u{202e}AAAA");
    let dtype = huge(4 << 20);
    let f = put("dtype.safetensors", &safetensors(&[one("experts", &dtype, vec![1])], &Default::default()));
    let e = compare(&f, "not a safetensors file: invalid JSON in header: unknown variant `\\u{1b}[31m\\n\\u{202e}AAAA");
    assert_eq!(e.matches("unknown variant").count(), 1, "{e}");
    let meta = std::collections::BTreeMap::from([("format", huge(4 << 20))]);
    let f = put("meta.safetensors", &safetensors(&[one("experts", "I32", vec![1, 1, 1])], &meta));
    compare(&f, "metadata format `\\u{1b}[31m\\n\\u{202e}AAAA");
    let f = put("rank.safetensors", &safetensors(&[one("experts", "I32", vec![1; 1 << 20])], &Default::default()));
    let e = excerpted(&dir, &["routes", "compare", &f, &good], "`experts` has shape [1, 1, 1");
    assert!(e.contains("expected [tokens, layers, top_k]"), "{e}");
    // JSON responses: SGLang's dtype, a NeMo-RL envelope's dtype, a config.json field.
    let sglang = serde_json::json!({"meta_info": {"routed_experts": "AAAA", "routed_experts_dtype": huge(4 << 20)}});
    compare(&put("sglang.json", sglang.to_string().as_bytes()), "`routed_experts_dtype` \"\\u001b[31m");
    let envelope = format!("nrlre1:{}:1x1x1:AAAA", huge(4 << 20));
    let nemo = serde_json::json!({"choices": [{"routed_experts": envelope}]});
    compare(&put("nemo.json", nemo.to_string().as_bytes()), "dtype `\\u{1b}[31m\\n\\u{202e}AAAA");
    let bad_config =
        serde_json::json!({"num_hidden_layers": huge(4 << 20), "num_experts": 8, "num_experts_per_tok": 1});
    let bc = put("bad-config.json", bad_config.to_string().as_bytes());
    excerpted(&dir, &["routes", "compare", &good, &good, "--config", &bc], "`num_hidden_layers` must be");
}

/// Router TOML, sweep grids, rows files, snapshots (header, section, a resealed command),
/// witnesses and trace folders (manifest, decisions): a huge field each.
#[test]
fn a_config_snapshot_witness_or_trace_folder_is_quoted_in_a_short_escaped_excerpt() {
    let dir = tmp("excerpt-files");
    let big = 4 << 20;
    let write = |name: &str, text: &str| std::fs::write(dir.join(name), text).unwrap();
    // A router TOML with a key of 4 MiB; a grid whose heatmap is 4 MiB.
    let router = moe_audit::config::preset("switch").unwrap().toml;
    write("r.toml", &format!("{router}{} = 1\n", huge_toml(big)));
    excerpted(&dir, &["route", "r.toml"], "unknown field `\\u{1b}[31m");
    write("g.toml", &format!("routers = [\"switch\"]\nheatmap = {}\n", huge_toml(big)));
    excerpted(
        &dir,
        &["sweep", "g.toml", "--output-dir", "out", "--max-memory", "1GiB"],
        "heatmap: `\\u{1b}[31m\\n\\u{202e}AAAA",
    );
    // Logit rows that are not numbers.
    write("l.json", &serde_json::json!([[huge(big)]]).to_string());
    let e = excerpted(
        &dir,
        &["route", "mixtral", "--logits", "l.json"],
        "rows of numbers: invalid type: string \"\\u{1b}[31m\\n\\u{202e}AAAA",
    );
    assert!(e.ends_with("AAAA\", expected f64 at line 1 column 4194323"), "{e}");
    // A snapshot: its header's format, a section's name, a command resealed into its header.
    ok(&dir, &["snapshot", "record", "megatron-probs", "--output", "m.snap"]);
    let text = std::fs::read_to_string(dir.join("m.snap")).unwrap();
    let format = "format = \"moe-audit-snapshot/2\"";
    assert!(text.contains(format), "{text}");
    write("format.snap", &text.replacen(format, &format!("format = {}", huge_toml(big)), 1));
    excerpted(&dir, &["snapshot", "check", "format.snap"], "format `\\u{1b}[31m");
    write("section.snap", &format!("{text}=== \u{1b}[31m{} ===\n", "A".repeat(big)));
    excerpted(&dir, &["snapshot", "check", "section.snap"], "unknown section `=== \\u{1b}[31m");
    let mut f = SnapshotFile::parse(&text, Path::new("m.snap")).unwrap();
    f.header.router = moe_audit::snapshot::RouterSource::Command { command: huge(big), timeout: 60.0 };
    write("command.snap", &f.render());
    let e = excerpted(&dir, &["snapshot", "check", "command.snap"], "[router] command = \"\\u{1b}[31m\\n\\u{202e}AAA");
    assert!(
        e.ends_with("is a record for the reader, never run from the file: give the router's command with --router-cmd")
    );
    // A path a header names, absolute and 4 MiB long: named in 256 characters at most.
    let mut f = SnapshotFile::parse(&text, Path::new("m.snap")).unwrap();
    f.header.input.file = Some(format!("/{}", huge(big)));
    write("path.snap", &f.render());
    let e = excerpted(&dir, &["snapshot", "check", "path.snap"], "error: /\\u{1b}[31m\\n\\u{202e}AAAA");
    assert!(e.contains("AAAA: [input] file: an absolute path or `..` leads out of the working directory"), "{e}");
    // A witness's format.
    let args = ["check", "megatron-probs", "--probes", "P", "--seq-len", "8", "--batch", "2", "--witness-dir", "w"];
    assert_eq!(run_in(&dir, &args).status.code(), Some(1));
    let path = dir.join("w/megatron-probs-P.json");
    let mut w: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    w["format"] = huge(big).into();
    std::fs::write(&path, w.to_string()).unwrap();
    excerpted(&dir, &["replay", "w/megatron-probs-P.json"], "format `\\u{1b}[31m");
    // A trace folder: a response line, the manifest's format.
    ok(&dir, &["snapshot", "plan", "t", "--experts", "4", "--top-k", "1", "--seq-len", "2", "--batch", "1"]);
    write("t/decisions.jsonl", &format!("{}\n", serde_json::json!({"id": huge(big)})));
    let e = excerpted(
        &dir,
        &["check", "--traces", "t"],
        "decisions.jsonl: line 1: not a response (invalid type: string \"\\u{1b}[31m\\n\\u{202e}AAAA",
    );
    assert!(e.contains("expected u64 at line 1 column"), "{e}");
    let manifest = dir.join("t/manifest.json");
    let mut m: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&manifest).unwrap()).unwrap();
    m["format"] = huge(big).into();
    std::fs::write(&manifest, m.to_string()).unwrap();
    excerpted(&dir, &["check", "--traces", "t"], "manifest.json: format `\\u{1b}[31m");
}

/// A router over the protocol (`--router-cmd`, `model --cmd`): a huge line before its
/// handshake, in its handshake, in a response, and on its stderr.
#[test]
fn what_a_router_says_is_quoted_in_a_short_escaped_excerpt() {
    let dir = tmp("excerpt-router");
    // 4 MiB of `A` on stdout, without a newline.
    let a = "head -c 4194304 /dev/zero | tr '\\0' A";
    let hs = r#"{"protocol": "moe-audit/1", "name": "sh", "experts": 4, "top_k": 1, "input": "logits"}"#;
    let check = |router: &str, want: &str| {
        let args = ["check", "--router-cmd", router, "--probes", "D", "--batch", "1", "--seq-len", "1"];
        excerpted(&dir, &args, want)
    };
    check(&format!("printf '\\033[31m'; {a}; echo"), "wrote `\\u{1b}[31mAAAA");
    check(
        &format!(
            r#"printf '%s' '{{"protocol": "moe-audit/1", "name": "sh", "experts": "\u001b[31m'; {a}; printf '"}}\n'"#
        ),
        "bad handshake (invalid type: string \"\\u{1b}[31mAAAA",
    );
    let e = check(
        &format!(r#"printf '%s\n' '{hs}'; read line; printf '%s' '{{"id": "\u001b[31m'; {a}; printf '"}}\n'"#),
        "): not a response (invalid type: string \"\\u{1b}[31mAAAA",
    );
    assert!(e.contains("expected u64 at line 1 column 4194"), "{e}");
    // Its stderr's last line: 100 KB, the escape near its end.
    let e = check(
        "{ head -c 100000 /dev/zero | tr '\\0' B; printf '\\033[31mBBBB'; } >&2; exit 3",
        "before its handshake; its stderr ends: BBBB",
    );
    assert!(e.ends_with("BBBB\\u{1b}[31mBBBB"), "{e}");
    // A model's handshake (`moe-audit/3`) with a protocol of 4 MiB.
    let model = format!(
        r#"printf '%s' '{{"protocol": "\u001b[31m'; {a}; printf '%s\n' '", "name": "m", "vocab": 8, "layers": [{{"layer": 0, "kind": "moe", "experts": 4, "top_k": 1}}]}}'"#
    );
    excerpted(&dir, &["model", "--cmd", &model, "--batch", "1", "--seq-len", "2"], "handshake: protocol `\\u{1b}[31m");
}

/// Values given on the command line are quoted as short as values read from files.
#[test]
fn a_command_line_value_is_quoted_in_a_short_escaped_excerpt() {
    let dir = tmp("excerpt-cli");
    // At most 128 KiB fit in one argument (Linux's MAX_ARG_STRLEN).
    let value = huge(100_000);
    // clap quotes the value (without its terminal escapes), then the parser's message.
    excerpted(&dir, &["check", "mixtral", "--max-memory", &value], "error: invalid value '");
    excerpted(&dir, &["route", &value], "unknown router `\\u{1b}[31m");
    excerpted(&dir, &["check", "mixtral", "--batch", &value], "error: invalid value '");
}
