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
