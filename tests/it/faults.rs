//! Fault injection on external routers and on the binary itself: a router that stops reading,
//! never ends a line, forks a `setsid` grandchild or exits under a background child; moe-audit
//! sent SIGTERM mid-audit or SIGINT mid-sweep. No hang past the timeout, no surviving process,
//! no partial file.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_moe-audit");

fn handshake(experts: usize) -> String {
    format!(r#"{{"protocol": "moe-audit/1", "name": "sh", "experts": {experts}, "top_k": 1, "input": "logits"}}"#)
}

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("moe-audit-faults-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A marker no other process carries: `sleep <marker>` is how a router's children are found.
fn marker(n: u32) -> String {
    format!("{}.{n}", 9000 + std::process::id() % 1000)
}

/// Processes whose command line holds `sleep` and `marker`.
fn survivors(marker: &str) -> Vec<String> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else { continue };
        let line = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        let zombie = stat.rsplit_once(')').is_some_and(|(_, r)| r.trim_start().starts_with('Z'));
        if line.contains("sleep") && line.contains(marker) && !zombie {
            found.push(line);
        }
    }
    found
}

/// Waits a moment for killed processes to disappear, then lists those left.
fn survivors_after_a_moment(marker: &str) -> Vec<String> {
    let until = Instant::now() + Duration::from_secs(3);
    loop {
        let left = survivors(marker);
        if left.is_empty() || Instant::now() > until {
            return left;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn check(router: &str, extra: &[&str]) -> (Output, Duration) {
    let start = Instant::now();
    let out = Command::new(BIN)
        .args(["check", "--router-cmd", router])
        .args(if extra.contains(&"--probes") { &[][..] } else { &["--probes", "D"][..] })
        .args(extra)
        .env("RAYON_NUM_THREADS", "1")
        .output()
        .expect("run moe-audit");
    (out, start.elapsed())
}

fn one_error_line(out: &Output) -> String {
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.starts_with("error: ") && err.lines().count() == 1 && !err.contains("panicked"), "{err}");
    err
}

#[test]
fn a_router_that_stops_reading_times_out_on_the_write() {
    let m = marker(1);
    // 4 x 512 rows of 8 logits: a request line far over the 64 KiB pipe buffer.
    let router = format!("printf '%s\\n' '{}'; exec sleep {m}", handshake(8));
    let (out, took) = check(&router, &["--batch", "4", "--seq-len", "512", "--timeout", "1"]);
    let err = one_error_line(&out);
    assert!(err.contains("sending request 1") && err.contains("stopped reading"), "{err}");
    assert!(took < Duration::from_secs(20), "took {took:?}");
    assert_eq!(survivors_after_a_moment(&m), Vec::<String>::new());
}

#[test]
fn a_line_without_end_stops_at_the_memory_limit_or_the_timeout() {
    let router = format!("printf '%s\\n' '{}'; read l; yes xxxxxxxxxxxxxxxx | tr -d '\\n'", handshake(2));
    let (out, took) = check(&router, &["--batch", "1", "--seq-len", "1", "--timeout", "30", "--max-memory", "64MiB"]);
    let err = one_error_line(&out);
    assert!(err.contains("a line longer than 16.0 MiB"), "{err}");
    assert!(took < Duration::from_secs(25), "took {took:?}");
    // Slower than the limit: the timeout ends it.
    let router = format!("printf '%s\\n' '{}'; read l; while :; do printf x; sleep 0.01; done", handshake(2));
    let (out, _) = check(&router, &["--batch", "1", "--seq-len", "1", "--timeout", "1"]);
    assert!(one_error_line(&out).contains("timed out after 1 s"));
}

#[test]
fn a_setsid_grandchild_dies_with_the_router() {
    let m = marker(2);
    let router = format!("setsid sleep {m} & printf '%s\\n' '{}'; exec sleep {m}", handshake(2));
    let (out, took) = check(&router, &["--batch", "1", "--seq-len", "2", "--timeout", "1"]);
    assert!(one_error_line(&out).contains("timed out after 1 s"));
    assert!(took < Duration::from_secs(20), "took {took:?}");
    assert_eq!(survivors_after_a_moment(&m), Vec::<String>::new());
}

#[test]
fn the_exit_status_is_reported_while_a_background_child_holds_stdout() {
    let m = marker(3);
    let (out, took) = check(&format!("sleep {m} & exit 3"), &["--timeout", "30"]);
    let err = one_error_line(&out);
    assert!(err.contains("the router exited (exit status: 3) before its handshake"), "{err}");
    assert!(took < Duration::from_secs(15), "took {took:?}");
    assert_eq!(survivors_after_a_moment(&m), Vec::<String>::new());
}

/// Starts `args`, waits until `ready` holds (or a few seconds), sends `signal`, returns the output.
fn interrupt(args: &[&str], signal: i32, ready: impl Fn() -> bool) -> Output {
    let child = Command::new(BIN)
        .args(args)
        .env("RAYON_NUM_THREADS", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run moe-audit");
    let until = Instant::now() + Duration::from_secs(10);
    while !ready() && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20));
    }
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(child.id() as i32, signal) };
    child.wait_with_output().expect("wait")
}

fn files_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> =
        std::fs::read_dir(dir).unwrap().flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    names
}

#[test]
fn sigterm_mid_audit_kills_the_router_tree_and_leaves_no_file() {
    let m = marker(4);
    let d = dir("sigterm");
    let report = d.join("report.txt");
    // The router answers its handshake, starts a setsid grandchild, and never answers a request.
    let router = format!("setsid sleep {m} & printf '%s\\n' '{}'; exec sleep {m}", handshake(2));
    let out = interrupt(
        &[
            "check",
            "--router-cmd",
            &router,
            "--probes",
            "D",
            "--batch",
            "1",
            "--seq-len",
            "2",
            "--timeout",
            "60",
            "--output",
            report.to_str().unwrap(),
        ],
        libc::SIGTERM,
        || survivors(&m).len() >= 2,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(128 + libc::SIGTERM), "{err}");
    assert_eq!(err.trim_end(), "error: interrupted by SIGTERM: the external router killed, no partial output left");
    assert_eq!(survivors_after_a_moment(&m), Vec::<String>::new());
    assert_eq!(files_in(&d), Vec::<String>::new());
}

#[test]
fn sigint_mid_sweep_leaves_the_previous_set_whole() {
    let d = dir("sigint");
    let grid = d.join("grid.toml");
    std::fs::write(
        &grid,
        "routers = [\"megatron-probs\", \"switch\"]\nheatmap = \"switch\"\ncapacity_factor = [1.0, 2.0]\ntop_k = [1]\nexperts = [4]\nseq_len = [16]\nbatch = [2]\ntrials = 2\nhidden = 8\nffn = 8\n",
    )
    .unwrap();
    let out_dir = d.join("out");
    let args = ["sweep", grid.to_str().unwrap(), "--output-dir", out_dir.to_str().unwrap(), "--max-memory", "4GiB"];
    let first = Command::new(BIN).args(args).env("RAYON_NUM_THREADS", "1").output().unwrap();
    assert_eq!(first.status.code(), Some(0), "{}", String::from_utf8_lossy(&first.stderr));
    let before: Vec<(String, Vec<u8>)> =
        files_in(&out_dir).into_iter().map(|n| (n.clone(), std::fs::read(out_dir.join(&n)).unwrap())).collect();
    assert_eq!(before.len(), 7, "{before:?}");
    // Interrupted at different moments: the folder holds the previous set, or the new one (the
    // same bytes: the sweep is deterministic), never a partial file.
    for delay_ms in [0u64, 150, 400] {
        let start = Instant::now();
        let out = interrupt(&args, libc::SIGINT, || start.elapsed() > Duration::from_millis(delay_ms));
        // 130: interrupted; 0: finished first; none: killed before the handler was installed.
        assert!(matches!(out.status.code(), Some(0) | Some(130) | None), "{:?}", out.status);
        if out.status.code() == Some(130) {
            // A preset-only run starts no router: the message does not speak of one.
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(err.trim_end(), "error: interrupted by SIGINT: no partial output left");
        }
        let after: Vec<(String, Vec<u8>)> =
            files_in(&out_dir).into_iter().map(|n| (n.clone(), std::fs::read(out_dir.join(&n)).unwrap())).collect();
        assert_eq!(after, before, "after SIGINT at {delay_ms} ms");
    }
}

#[test]
fn an_expert_choice_router_may_leave_a_token_unrouted() {
    // Hidden rows, top_k null, some tokens with no expert: a valid answer, audited like any.
    let (out, _) =
        check(&n_tokens_router(), &["--batch", "2", "--seq-len", "8", "--probes", "P,F,N,D", "--timeout", "20"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(matches!(out.status.code(), Some(0) | Some(1)), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// An expert-choice router in Python: expert 0 takes every other token, the rest stay unrouted.
fn n_tokens_router() -> String {
    let script = [
        "import json,sys",
        "print(json.dumps({'protocol':'moe-audit/1','name':'ec','experts':4,'top_k':None,'input':'hidden','hidden_size':8}),flush=True)",
        "for line in sys.stdin:",
        "    r=json.loads(line); n=r['batch']*r['seq_len']",
        "    t=[[{'expert':0,'weight':1.0,'kept':True}] if i%2==0 else [] for i in range(n)]",
        "    print(json.dumps({'id':r['id'],'tokens':t,'capacity':None}),flush=True)",
    ]
    .join("\n");
    let path = dir("ec").join("ec.py");
    std::fs::write(&path, script).unwrap();
    format!("python3 {}", path.display())
}

/// An output that is a FIFO (or a device: `/dev/null`, `/dev/stdout`) is written through, not
/// renamed over: the node stays what it was, its reader gets the report, no temporary is left.
#[test]
fn an_output_fifo_is_written_through_and_stays_a_fifo() {
    use std::os::unix::fs::FileTypeExt;
    let d = dir("fifo-out");
    let path = d.join("report.txt");
    assert!(Command::new("mkfifo").arg(&path).status().unwrap().success());
    let reader = Command::new("cat").arg(&path).stdout(Stdio::piped()).spawn().unwrap();
    let out = Command::new(BIN)
        .args(["check", "mixtral", "--batch", "1", "--seq-len", "2", "--probes", "D", "--output"])
        .arg(&path)
        .env("RAYON_NUM_THREADS", "1")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let read = reader.wait_with_output().unwrap();
    assert!(String::from_utf8_lossy(&read.stdout).contains("mixtral"), "{read:?}");
    assert!(std::fs::metadata(&path).unwrap().file_type().is_fifo());
    assert_eq!(files_in(&d), ["report.txt"]);
}
