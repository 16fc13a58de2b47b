//! Resource limits: runs estimate their memory before allocating and refuse, at once, to go
//! over `--max-memory` (default: half of physical memory).
//!
//! A test binary of its own: a child's peak resident set includes its parent's at the moment it
//! was spawned (the child shares or copies the parent's memory until `exec`), so the peaks
//! measured here need a parent that holds little, not one running the `it` tests beside them.

use moe_audit::analyze::AuditOptions;
use moe_audit::memory::physical_memory;
use moe_audit::MemoryBudget;
use std::process::Command;
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_moe-audit");

/// Runs the binary; returns (exit code, stderr, wall time).
fn run(args: &[&str]) -> (Option<i32>, String, Duration) {
    let start = Instant::now();
    // One worker thread: the estimate counts routing records per thread.
    let out = Command::new(BIN).args(args).env("RAYON_NUM_THREADS", "1").output().expect("run moe-audit");
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned(), start.elapsed())
}

#[test]
fn a_sequence_of_a_billion_tokens_fails_before_allocating() {
    for args in
        [&["check", "megatron-probs", "--seq-len", "1000000000"][..], &["route", "mixtral", "--seq-len", "1000000000"]]
    {
        let (code, err, took) = run(args);
        assert_eq!(code, Some(2), "{args:?}: {err}");
        assert!(err.starts_with("error: ") && err.contains("TiB of memory, over the limit of"), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        // Generous: an attempt to allocate terabytes would take far longer or be killed.
        assert!(took < Duration::from_secs(10), "{args:?} took {took:?}");
    }
}

#[test]
fn max_memory_is_honoured_both_ways() {
    let (code, err, _) = run(&["check", "mixtral", "--seq-len", "16", "--trials", "4", "--max-memory", "1MiB"]);
    assert_eq!(code, Some(2));
    insta::assert_snapshot!(err.trim_end(), @"error: the audit of `mixtral` needs about 41.0 MiB of memory, over the limit of 1.0 MiB (--max-memory; the default is half of physical memory): use smaller sizes or raise the limit");
    let (code, err, _) = run(&["check", "mixtral", "--seq-len", "16", "--trials", "4", "--max-memory", "1GiB"]);
    assert_eq!(code, Some(0), "{err}");
}

#[test]
fn the_default_limit_is_half_of_physical_memory_and_estimates_grow_with_size() {
    // What the binary enforces without --max-memory, read from its refusal: half of the
    // physical memory /proc/meminfo reports (not the library's own arithmetic restated).
    if let Some(total) = physical_memory() {
        assert!(total > 1 << 20, "{total} bytes of physical memory");
        let (code, err, _) = run(&["route", "mixtral", "--seq-len", "1000000000"]);
        assert_eq!(code, Some(2), "{err}");
        let half = bytesize::ByteSize(total / 2).display().iec().to_string();
        assert!(err.contains(&format!("over the limit of {half} (")), "half of {total} bytes is {half}: {err}");
    }
    // An explicit limit is taken as given.
    assert_eq!(MemoryBudget::from_request(Some(bytesize::ByteSize::mib(3))).bytes(), 3 << 20);
    let small = AuditOptions::default().memory_estimate(8, 2, 64, 128);
    let long = AuditOptions { seq_len: 1 << 20, ..AuditOptions::default() }.memory_estimate(8, 2, 64, 128);
    assert!(small < 64 << 20, "default audit estimate {small}");
    assert!(long > 1000 * small / 8 && long > 4 << 30, "{long}");
}

/// Runs the binary on one worker thread and returns (exit code, peak resident bytes), the peak
/// read from the kernel's accounting of that one child (`wait4`, which also reaps it).
#[allow(clippy::zombie_processes)]
fn peak_of(args: &[&str]) -> (i32, u64) {
    let child = Command::new(BIN)
        .args(args)
        .env("RAYON_NUM_THREADS", "1")
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("run moe-audit");
    let (mut status, mut usage) = (0, unsafe { std::mem::zeroed::<libc::rusage>() });
    // SAFETY: waits for our own child by pid, writing into the two locals.
    let pid = unsafe { libc::wait4(child.id() as libc::pid_t, &mut status, 0, &mut usage) };
    assert_eq!(pid, child.id() as libc::pid_t, "wait4");
    (libc::WEXITSTATUS(status), usage.ru_maxrss as u64 * 1024)
}

#[test]
fn the_estimate_holds_at_the_largest_shape_ci_affords() {
    // 4 × 2048 tokens at E = 256, k = 8: DeepSeek-V3's routing dropless, and under Megatron
    // capacity (every probe leaks, so witnesses are shrunk too). The peak grows with T·E, and
    // stays under the estimate `check` refuses to exceed.
    let capacity = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/routers/megatron-probs-e256.toml");
    for (router, leaks) in [("deepseek-v3", 0), (capacity, 1)] {
        let (code, peak) = peak_of(&["check", router, "--batch", "4", "--seq-len", "2048"]);
        assert_eq!(code, leaks, "{router}");
        let estimate =
            AuditOptions { batch: 4, seq_len: 2048, ..AuditOptions::default() }.memory_estimate(256, 8, 64, 128);
        assert!(peak <= estimate, "{router}: peak {peak} over the estimate {estimate}");
        assert!(peak > estimate / 4, "{router}: peak {peak}, estimate {estimate}: the estimate is no bound if far off");
        // The estimate holds F's and N's 32 cases at once, as a stateful router needs; a
        // config's routing is pure, so they are made on demand and the peak is about half.
        assert!(peak < estimate / 3 * 2, "{router}: peak {peak}, estimate {estimate}: F and N's cases held at once?");
    }
}
