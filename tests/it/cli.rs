//! The `moe-audit` binary: commands, output, and every bad input giving exit code 2 with one
//! `error: ` line on stderr (no panic, no backtrace).
//!
//! Files live in one fixed directory under the system temp dir; messages are compared with the
//! directory replaced by `[TMP]`. Files are written atomically (write, then rename) so that two
//! test processes running at once never read a half-written file.

use moe_audit::Routing;
use std::path::PathBuf;
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_moe-audit");

pub(crate) fn tmp_dir() -> PathBuf {
    let dir = std::env::temp_dir().join("moe-audit-it-cli");
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// Writes `text` to `name` in the temp dir; returns the path as a string.
pub(crate) fn file(name: &str, text: &str) -> String {
    let dir = tmp_dir();
    let path = dir.join(name);
    // Unique per write: tests run as threads of one process and may write the same name.
    static WRITES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let partial = dir.join(format!(".{name}.{}.{n}", std::process::id()));
    std::fs::write(&partial, text).expect("write temp file");
    std::fs::rename(&partial, &path).expect("rename temp file");
    path.to_str().expect("utf-8 temp path").to_string()
}

fn run(args: &[&str]) -> Output {
    Command::new(BIN).args(args).env("RUST_BACKTRACE", "1").output().expect("run moe-audit")
}

pub(crate) fn stdout(args: &[&str]) -> String {
    let out = run(args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "moe-audit {args:?} failed: {:?}\n{err}", out.status);
    assert!(err.is_empty(), "moe-audit {args:?} wrote to stderr: {err}");
    String::from_utf8(out.stdout).expect("utf-8 stdout")
}

/// Runs a command that must fail: exit code 2, nothing on stdout, one `error: ` line on stderr.
/// Returns that line with the temp dir redacted.
pub(crate) fn fail(args: &[&str]) -> String {
    let err = fail_lines(args);
    assert_eq!(err.lines().count(), 1, "moe-audit {args:?}: stderr is not one line:\n{err}");
    err
}

/// As `fail`, without the one-line rule (clap usage errors, known multi-line messages).
fn fail_lines(args: &[&str]) -> String {
    let out = run(args);
    let err = String::from_utf8(out.stderr).expect("utf-8 stderr");
    assert_eq!(out.status.code(), Some(2), "moe-audit {args:?}: exit status {:?}, stderr:\n{err}", out.status);
    assert!(out.stdout.is_empty(), "moe-audit {args:?}: wrote to stdout on error");
    assert!(err.starts_with("error: "), "moe-audit {args:?}: stderr does not start with `error: `:\n{err}");
    assert!(
        !err.contains("panicked") && !err.contains("stack backtrace") && !err.contains("RUST_BACKTRACE"),
        "panic:\n{err}"
    );
    err.trim_end().replace(tmp_dir().to_str().unwrap(), "[TMP]")
}

/// A valid router file.
const ROUTER: &str = r#"name = "t"
kind = "token-choice"
experts = 8
top_k = 2
score = "softmax-post"

[capacity]
factor = 1.0
policy = "probs"
"#;

// ---------------------------------------------------------------------------------------------
// Commands that work

#[test]
fn presets_lists_all_with_descriptions() {
    let out = stdout(&["presets"]);
    let names: Vec<&str> = out.lines().map(|l| l.split_whitespace().next().unwrap_or("")).collect();
    // The list itself is pinned in invariants.rs (`the_preset_list_is_the_one_these_tests_cover`).
    let want: Vec<&str> = moe_audit::config::presets().iter().map(|p| p.name).collect();
    assert_eq!(names, want);
    for line in out.lines() {
        assert!(line.split_whitespace().count() > 1, "no description: {line:?}");
    }
}

#[test]
fn a_reader_that_closes_stdout_early_ends_the_command_quietly() {
    // `moe-audit presets | head -0`, without the race: the reading end is closed before the start.
    for (args, code) in
        [(&["presets"][..], 0), (&["check", "megatron-probs", "--trials", "2", "--seq-len", "16"][..], 1)]
    {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let out = Command::new(BIN).args(args).stdout(writer).output().unwrap();
        assert_eq!(out.status.code(), Some(code), "{args:?}: the verdict stands");
        assert_eq!(String::from_utf8_lossy(&out.stderr), "", "{args:?}");
    }
}

#[test]
fn route_prints_the_table() {
    let out = stdout(&["route", "megatron-probs"]);
    let mut lines = out.lines();
    assert_eq!(
        lines.next().unwrap(),
        "router megatron-probs | batch 2 x seq 8 | 8 experts, top-2 | scope batch (1 groups), position-major | capacity 4 per expert per group"
    );
    assert_eq!(lines.next().unwrap(), "  b  pos  routes in choice order (x dropped, p padding slot)");
    // 16 token rows, each with two routes.
    let rows: Vec<&str> = out.lines().skip(2).take(16).collect();
    for (i, row) in rows.iter().enumerate() {
        assert!(row.starts_with(&format!("{:>3} {:>4} ", i / 8, i % 8)), "row {i}: {row:?}");
        assert_eq!(row.matches(" e").count(), 2, "row {i}: {row:?}");
    }
    assert!(out.contains("expert  routed  kept  padded"));
    assert!(out.lines().last().unwrap().starts_with("max/mean load "));
}

#[test]
fn route_json_is_a_routing_record_and_repeatable() {
    let out = stdout(&["route", "mixtral", "--format", "json"]);
    let r: Routing = serde_json::from_str(&out).expect("route --format json prints a Routing");
    assert_eq!((r.router.as_str(), r.batch, r.seq_len, r.experts, r.top_k), ("mixtral", 2, 8, 8, Some(2)));
    assert_eq!(r.tokens.len(), 16);
    assert!(r.tokens.iter().all(|t| t.routes.len() == 2 && t.routes.iter().all(|x| x.kept)));
    // D: the same command twice prints the same bytes (seeded weights and inputs).
    assert_eq!(stdout(&["route", "mixtral", "--format", "json"]), out);
    assert_eq!(stdout(&["route", "megatron-probs-pad"]), stdout(&["route", "megatron-probs-pad"]));
}

#[test]
fn route_seed_changes_the_input() {
    let a = stdout(&["route", "mixtral", "--seed", "1"]);
    assert_ne!(a, stdout(&["route", "mixtral", "--seed", "2"]));
    assert_eq!(a, stdout(&["route", "mixtral", "--seed", "1"]));
}

/// 2 sequences x 2 positions, E = 8, k = 2, so C = ceil(4*2/8 * 1.0) = 1 for megatron-*.
/// Rows are sequence-major: (0,0), (0,1), (1,0), (1,1). [S,B] priority: (0,0), (1,0), (0,1), (1,1).
///  (0,0): e0 = 1, e1 = 0        → e0 0.7311, e1 0.2689
///  (0,1): e3 = 2, e4 = 0        → e3 0.8808, e4 0.1192
///  (1,0): e0 = 3, e2 = 0        → e0 0.9526, e2 0.0474
///  (1,1): the same row as (0,1) → exact ties on e3 and e4
const HAND_LOGITS: &str = "[
  [1, 0, -5, -5, -5, -5, -5, -5],
  [-5, -5, -5, 2, 0, -5, -5, -5],
  [3, -5, 0, -5, -5, -5, -5, -5],
  [-5, -5, -5, 2, 0, -5, -5, -5]
]";

#[test]
fn route_hand_written_logits_megatron_probs() {
    let logits = file("hand.json", HAND_LOGITS);
    let out = stdout(&["route", "megatron-probs", "--logits", &logits, "--batch", "2"]);
    // probs: (1,0)'s stronger gate on e0 evicts the earlier (0,0); on e3 and e4 the gates tie
    // exactly and the lower [S,B] index (0,1) keeps both, so (1,1) loses both routes.
    let want = "\
router megatron-probs | batch 2 x seq 2 | 8 experts, top-2 | scope batch (1 groups), position-major | capacity 1 per expert per group
  b  pos  routes in choice order (x dropped, p padding slot)
  0    0  e0   0.7311x e1   0.2689
  0    1  e3   0.8808  e4   0.1192
  1    0  e0   0.9526  e2   0.0474
  1    1  e3   0.8808x e4   0.1192x
expert  routed  kept  padded
     0       2     1       0
     1       1     1       0
     2       1     1       0
     3       2     1       0
     4       2     1       0
(3 idle experts not shown)
";
    let (got_head, _) = out.split_once("max/mean").expect("stats line");
    assert_eq!(got_head, want);
    assert!(out.contains("drop rate 0.375"), "3 of 8 routes dropped:\n{out}");
}

#[test]
fn route_hand_written_logits_megatron_position() {
    let logits = file("hand.json", HAND_LOGITS);
    let out = stdout(&["route", "megatron-position", "--logits", &logits, "--batch", "2"]);
    // position: on e0 the first route in [S,B] order, (0,0), keeps its slot despite the weaker gate.
    let rows: Vec<&str> = out.lines().skip(2).take(4).collect();
    assert_eq!(
        rows,
        [
            "  0    0  e0   0.7311  e1   0.2689",
            "  0    1  e3   0.8808  e4   0.1192",
            "  1    0  e0   0.9526x e2   0.0474",
            "  1    1  e3   0.8808x e4   0.1192x",
        ]
    );
}

#[test]
fn route_hand_written_logits_json_and_seq_len() {
    let logits = file("hand.json", HAND_LOGITS);
    let out = stdout(&["route", "mixtral", "--logits", &logits, "--batch", "2", "--seq-len", "2", "--format", "json"]);
    let r: Routing = serde_json::from_str(&out).unwrap();
    assert_eq!((r.batch, r.seq_len), (2, 2));
    let ids: Vec<Vec<usize>> = r.tokens.iter().map(|t| t.routes.iter().map(|x| x.expert).collect()).collect();
    assert_eq!(ids, [vec![0, 1], vec![3, 4], vec![0, 2], vec![3, 4]]);
    // One sequence of four tokens instead: same rows, another shape.
    let out = stdout(&["route", "mixtral", "--logits", &logits, "--batch", "1", "--format", "json"]);
    let r: Routing = serde_json::from_str(&out).unwrap();
    assert_eq!((r.batch, r.seq_len), (1, 4));
}

#[test]
fn route_accepts_a_router_file() {
    let path = file("ok.toml", ROUTER);
    let logits = file("hand.json", HAND_LOGITS);
    let out = stdout(&["route", &path, "--logits", &logits, "--batch", "2"]);
    assert!(out.starts_with("router t | batch 2 x seq 2 | 8 experts, top-2 |"), "{out}");
    // The file is megatron-probs under another name (the default scope is the batch in [S,B]
    // order): the same decisions.
    let preset = stdout(&["route", "megatron-probs", "--logits", &logits, "--batch", "2"]);
    assert_eq!(out.lines().skip(1).collect::<Vec<_>>(), preset.lines().skip(1).collect::<Vec<_>>());
}

// ---------------------------------------------------------------------------------------------
// Bad inputs: the catalogue is tests/bad_input.rs; the cases here need a command's context.

/// Runs `check` (or `zoo`) and returns (exit code, stdout); stderr must be empty (no terminal,
/// so no progress bar).
fn check(args: &[&str]) -> (i32, String) {
    let out = run(args);
    assert!(out.stderr.is_empty(), "moe-audit {args:?} wrote to stderr: {}", String::from_utf8_lossy(&out.stderr));
    (out.status.code().expect("exit code"), String::from_utf8(out.stdout).expect("utf-8 stdout"))
}

const SMALL: [&str; 6] = ["--seq-len", "16", "--trials", "8", "--batch", "3"];

#[test]
fn check_exits_0_without_a_leak_and_1_with_one() {
    let (code, text) = check(&[&["check", "mixtral", "deepseek-v3"], &SMALL[..]].concat());
    assert_eq!(code, 0, "{text}");
    assert!(text.ends_with("no leak found in 2 router(s)\n"), "{text}");
    let (code, text) = check(&[&["check", "mixtral", "megatron-probs"], &SMALL[..]].concat());
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("megatron-probs         F future     LEAK    C-content"), "{text}");
    assert!(text.ends_with("1 of 2 router(s) leak: megatron-probs\n"), "{text}");
}

#[test]
fn check_json_is_the_report_and_byte_identical_across_runs() {
    let args = [&["check", "expert-choice", "--format", "json"], &SMALL[..]].concat();
    let (code, first) = check(&args);
    assert_eq!(code, 1);
    assert_eq!(check(&args).1, first, "same command, same bytes");
    let report: moe_audit::analyze::Report = serde_json::from_str(&first).unwrap();
    assert_eq!(report.routers[0].router, "expert-choice");
    assert_eq!(report.routers[0].findings.len(), 8);
}

#[test]
fn json_is_byte_identical_across_thread_counts() {
    // Probe cases run on rayon's pool: the report must not depend on how many threads it has.
    let args = [&["check", "mixtral", "megatron-probs", "expert-choice", "--format", "json"], &SMALL[..]].concat();
    let with_threads = |n: &str| {
        let out = Command::new(BIN).args(&args).env("RAYON_NUM_THREADS", n).output().expect("run moe-audit");
        assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stderr));
        out.stdout
    };
    let one = with_threads("1");
    assert_eq!(one, with_threads("2"), "1 vs 2 threads");
    assert_eq!(one, with_threads("4"), "1 vs 4 threads");
}

#[test]
fn json_is_byte_identical_across_kernels() {
    // The layer's kernels (MOE_AUDIT_KERNEL) give the same bits, so an AVX2-only machine writes
    // what an AVX-512 one does; a kernel this CPU lacks, or a misspelt one, is refused.
    let args = [&["check", "mixtral", "megatron-probs", "--format", "json"], &SMALL[..]].concat();
    let with_kernel =
        |k: &str| Command::new(BIN).args(&args).env("MOE_AUDIT_KERNEL", k).output().expect("run moe-audit");
    let auto = with_kernel("auto");
    assert_eq!(auto.status.code(), Some(1), "{}", String::from_utf8_lossy(&auto.stderr));
    for kernel in moe_audit::layer::Kernel::ALL {
        let out = with_kernel(kernel.name());
        if kernel.available() {
            assert_eq!(out.stdout, auto.stdout, "{} vs auto", kernel.name());
        } else {
            assert_eq!(out.status.code(), Some(2));
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(err, format!("error: MOE_AUDIT_KERNEL={0}: this CPU has no {0} instructions\n", kernel.name()));
        }
    }
    let out = with_kernel("avx3");
    assert_eq!(out.status.code(), Some(2));
    insta::assert_snapshot!(String::from_utf8_lossy(&out.stderr), @"error: MOE_AUDIT_KERNEL must be auto, avx512, avx2 or portable, got \"avx3\"");
}

#[test]
fn check_markdown_and_output_file() {
    let out = tmp_dir().join("report.md");
    let out = out.to_str().unwrap();
    let (code, text) =
        check(&[&["check", "megatron-position", "--format", "markdown", "--output", out], &SMALL[..]].concat());
    assert_eq!((code, text.as_str()), (1, ""), "the report goes to the file only");
    let md = std::fs::read_to_string(out).unwrap();
    assert!(md.starts_with("## moe-audit\n"), "{md}");
    assert!(md.contains("| `megatron-position` | P prefix | ❌ leak | C-length |"), "{md}");
    assert!(md.contains("| `megatron-position` | F future | ✅ pass | C-content |"), "{md}");
    // The fix is written in full once per router, then "as above".
    let fixes: Vec<&str> = md.split("<br>fix: ").skip(1).map(|rest| rest.split(" |").next().unwrap()).collect();
    let full: Vec<&&str> = fixes.iter().filter(|f| **f != "as above").collect();
    assert!(fixes.len() > full.len() && full.iter().all(|f| fixes.iter().filter(|g| g == f).count() == 1), "{md}");
}

#[test]
fn witnesses_are_written_and_replay_with_exit_1() {
    let dir = tmp_dir().join("witnesses");
    let _ = std::fs::remove_dir_all(&dir);
    let dir_s = dir.to_str().unwrap();
    let (code, text) =
        check(&[&["check", "megatron-probs", "--probes", "F,N", "--witness-dir", dir_s], &SMALL[..]].concat());
    assert_eq!(code, 1);
    let witness = dir.join("megatron-probs-F.json");
    assert!(text.contains(&format!("[witness {}]", witness.display())), "{text}");
    let (code, text) = check(&["replay", witness.to_str().unwrap()]);
    assert_eq!(code, 1, "{text}");
    assert!(
        text.starts_with("LEAK reproduced: router megatron-probs, probe F (future), property C-content: token "),
        "{text}"
    );
    // The routes as the report writes them, not JSON.
    let routes = text.lines().skip(1).map(|l| l.split_once(": ").map_or(l, |(label, _)| label)).collect::<Vec<_>>();
    assert_eq!(routes, ["  before", "  after"], "{text}");
    assert!(text.contains("\n  before: [e") && text.contains("\n  after:  [e") && !text.contains('{'), "{text}");
    assert!(dir.join("megatron-probs-N.json").is_file());
}

#[test]
fn a_drift_witness_replays_as_drift_and_fails_only_on_drift() {
    let dir = tmp_dir().join("drift-witnesses");
    let _ = std::fs::remove_dir_all(&dir);
    let args = ["check", "mixtral", "--probes", "X", "--seq-len", "256", "--witness-dir", dir.to_str().unwrap()];
    assert_eq!(check(&args).0, 0, "drift is reported, not failed");
    let witness = dir.join("mixtral-X.json");
    let witness = witness.to_str().unwrap();
    let (code, text) = check(&["replay", witness]);
    assert_eq!(code, 0, "{text}");
    assert!(text.starts_with("DRIFT reproduced: router mixtral, probe X (numerics), property T/I: token "), "{text}");
    let (code, text) = check(&["replay", witness, "--fail-on", "leak,drift"]);
    assert_eq!(code, 1, "{text}");
}

#[test]
fn replay_of_a_file_that_is_not_a_witness() {
    let path = file("not_a_witness.json", "{\"format\": \"moe-audit-witness/1\"}");
    let err = fail(&["replay", &path]);
    assert!(err.starts_with("error: [TMP]/not_a_witness.json: not a witness: missing field"), "{err}");
}

#[test]
fn check_rejects_bad_probes_and_sizes() {
    insta::assert_snapshot!(fail(&["check", "mixtral", "--probes", "P,Q"]), @"error: --probes: unknown probe `Q`, expected some of P,F,N,R,D,S,M,L,X");
    insta::assert_snapshot!(fail(&["check", "mixtral", "--seq-len", "0"]), @"error: --seq-len must be at least 1");
    insta::assert_snapshot!(fail(&["check", "no-such-router"]), @"error: unknown router `no-such-router`: not a preset (mixtral, deepseek-v3, switch, megatron-probs, megatron-position, megatron-probs-pad, deepspeed-top1, deepspeed-top2, deepspeed-topk-probs, expert-choice, aux-loss-free, causal-capacity, sinkhorn, batch-prioritized, expert-choice-tc-serve, expert-threshold, null-experts) and not a file");
}

/// Each mode is a subcommand, and the flags that do not go together are refused by the parser,
/// before anything runs: one line, exit 2.
#[test]
fn flags_that_do_not_go_together_are_refused_by_the_parser() {
    let cases: [(&[&str], &str); 11] = [
        (&["check"], "required arguments were not provided: <ROUTERS|--router-cmd <COMMAND>|--traces <DIR>>"),
        (&["check", "mixtral", "--mode", "inference"], "required arguments were not provided: --router-cmd <COMMAND>"),
        (
            &["check", "--router-cmd", "true", "--traces", "t"],
            "'--router-cmd <COMMAND>' cannot be used with '--traces <DIR>'",
        ),
        (
            &["check", "--router-cmd", "true", "--weights", "w.safetensors", "--gate", "g"],
            "required arguments were not provided: <ROUTERS>",
        ),
        (&["check", "mixtral", "--replay", "w.json"], "unexpected argument '--replay' found"),
        (&["model"], "required arguments were not provided: <ROUTER|--model-cmd <COMMAND>>"),
        // The old spelling `--cmd` is still accepted, and named as the flag it is now.
        (&["model", "mixtral", "--cmd", "true"], "'[ROUTER]' cannot be used with '--model-cmd <COMMAND>'"),
        (
            &["model", "--model-cmd", "true", "--layers", "3"],
            "'--model-cmd <COMMAND>' cannot be used with '--layers <LAYERS>'",
        ),
        (
            &["model", "mixtral", "--replay", "w.json", "--format", "json"],
            "'--replay <WITNESS.json>' cannot be used with '--format <FORMAT>'",
        ),
        (&["replay", "w.json", "--mode", "inference"], "required arguments were not provided: --router-cmd <COMMAND>"),
        (
            &["snapshot", "record", "--router-cmd", "true", "--weights", "w.safetensors", "--gate", "g"],
            "'--router-cmd <COMMAND>' cannot be used with '--weights <FILE.safetensors>'",
        ),
    ];
    for (args, want) in cases {
        let err = fail(args);
        assert!(err.starts_with("error: ") && err.contains(want) && err.ends_with("(see --help)"), "{args:?}: {err}");
    }
    // Formats of one mode are not offered by another.
    assert!(fail(&["model", "mixtral", "--format", "junit"]).contains("invalid value 'junit' for '--format <FORMAT>'"));
}
#[test]
fn zoo_runs_the_probes_given_one_column_each() {
    // Issue 45's walk: `zoo --probes`, lower case accepted, columns in the registry's order.
    let (code, text) = check(&["zoo", "--probes", "d,F"]);
    assert_eq!(code, 0, "{text}");
    assert!(text.starts_with("router                 F     D     max/mean   drop\n"), "{text}");
    assert!(text.contains("\nmixtral                pass  pass "), "{text}");
    assert!(text.contains("\nmegatron-probs         LEAK  pass "), "{text}");
    assert_eq!(text.lines().filter(|l| l.ends_with('%')).count(), moe_audit::config::presets().len(), "{text}");
    assert_eq!(
        fail(&["zoo", "--probes", "P,Q"]),
        "error: --probes: unknown probe `Q`, expected some of P,F,N,R,D,S,M,L,X"
    );
}

#[test]
fn zoo_prints_every_preset_with_verdicts_and_load() {
    let (code, text) = check(&["zoo"]);
    assert_eq!(code, 0, "{text}");
    assert!(
        text.starts_with("router                 P     F     N     R     D     S     M     L     max/mean   drop\n"),
        "{text}"
    );
    for p in moe_audit::config::presets() {
        assert!(text.lines().any(|l| l.starts_with(&format!("{:<22} ", p.name))), "{} missing:\n{text}", p.name);
    }
    assert!(text.contains("\nmegatron-position      LEAK  pass  LEAK  LEAK  pass  pass  n/a   LEAK "), "{text}");
    assert!(text.ends_with("10 of 17 presets leak. LEAK = the probe changed some token's routing; see `moe-audit check <preset>` for rates and witnesses.\n"), "{text}");
}
