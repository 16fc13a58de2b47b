//! What the binary sets up before it runs a command: the thread pool and the signals.
//!
//! SIGINT, SIGTERM and SIGHUP end a run cleanly: a thread waits for them (they are blocked in
//! every other thread, and child processes start with them unblocked again), kills every
//! external router's process tree, removes temporary outputs (no partial file is left and the
//! previous run's files stay whole), and exits with 128 + the signal number, as a shell does.
//! `RAYON_NUM_THREADS` is capped, so a typo (`1000000`) cannot stall the machine spawning
//! threads; results do not depend on the thread count anyway.

use moe_audit::error::{Error, Result};

/// Threads per core the pool may have at most (`RAYON_NUM_THREADS` above it is capped).
pub(crate) const THREADS_PER_CORE: usize = 4;

/// Installs the signal thread and sizes the global thread pool. Call first in `main`, before any
/// other thread starts (they inherit the blocked signals).
pub(crate) fn init() -> Result<()> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = threads(std::env::var_os("RAYON_NUM_THREADS").as_deref(), cores)?;
    moe_audit::layer::kernel::check_setting().map_err(|e| Error::usage(e.to_string()))?;
    // candle sizes every matmul by `RAYON_NUM_THREADS` and, when it is unset, counts physical
    // cores by reading /proc/cpuinfo on each call (15/16 of `exploit`'s CPU time went there).
    // Said once, here, while this is the only thread: the pool's own size.
    std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
    watch_signals();
    // Fails only when a pool exists already (a library user built one): keep theirs.
    let _ = rayon::ThreadPoolBuilder::new().num_threads(threads).build_global();
    Ok(())
}

/// The pool size for `RAYON_NUM_THREADS = value` (unset or 0: one per core), capped at
/// [`THREADS_PER_CORE`] per core.
pub(crate) fn threads(value: Option<&std::ffi::OsStr>, cores: usize) -> Result<usize> {
    let cap = cores.max(1).saturating_mul(THREADS_PER_CORE);
    let Some(value) = value else {
        return Ok(cores.max(1));
    };
    let text = value.to_str().map(str::trim).unwrap_or("");
    match text {
        _ if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) => match text.trim_start_matches('0') {
            "" => Ok(cores.max(1)),
            n => Ok(n.parse::<usize>().unwrap_or(usize::MAX).min(cap)),
        },
        _ => Err(Error::usage(format!(
            "RAYON_NUM_THREADS must be a whole number of threads (0 for one per core), got {:?}",
            value.to_string_lossy()
        ))),
    }
}

#[cfg(unix)]
fn watch_signals() {
    const SIGNALS: [libc::c_int; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];
    // SAFETY: the set is initialised by sigemptyset before use; pthread_sigmask only changes
    // this thread's mask (inherited by threads spawned later).
    let set = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in SIGNALS {
            libc::sigaddset(&mut set, s);
        }
        if libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) != 0 {
            return;
        }
        set
    };
    std::thread::spawn(move || loop {
        let mut signal: libc::c_int = 0;
        // SAFETY: `set` is a valid, initialised signal set; `signal` is a valid out pointer.
        if unsafe { libc::sigwait(&set, &mut signal) } == 0 {
            interrupted(signal);
        }
    });
}

#[cfg(not(unix))]
fn watch_signals() {}

static INTERRUPTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether a signal is ending the process: errors it causes (a router killed under a running
/// audit) are not reported, the signal thread reports and exits.
pub(crate) fn interrupted_by_signal() -> bool {
    INTERRUPTED.load(std::sync::atomic::Ordering::SeqCst)
}

/// Kills the external routers and removes temporary outputs: every way out of the process that
/// skips destructors (a signal, a panic) goes through here. How many routers were killed.
pub(crate) fn clean_up() -> usize {
    let killed = moe_audit::external::process::kill_all();
    moe_audit::files::abandon_partial_files();
    killed
}

/// Ends the process after a signal: routers killed, temporary outputs removed.
fn interrupted(signal: libc::c_int) -> ! {
    INTERRUPTED.store(true, std::sync::atomic::Ordering::SeqCst);
    let killed = clean_up();
    let name = match signal {
        libc::SIGINT => "SIGINT",
        libc::SIGTERM => "SIGTERM",
        _ => "SIGHUP",
    };
    // Routers are named only when there were some (a preset-only run starts none).
    let routers = match killed {
        0 => String::new(),
        1 => "the external router killed, ".into(),
        n => format!("{n} external routers killed, "),
    };
    error_line(&format!("error: interrupted by {name}: {routers}no partial output left"));
    std::process::exit(128 + signal)
}

/// Writes `line` and its newline to stderr in one write: `eprintln!` writes each piece of its
/// format on its own (stderr is unbuffered), so processes sharing the pipe (MPI ranks) could
/// interleave inside a line.
pub(crate) fn error_line(line: &str) {
    use std::io::Write;
    let _ = std::io::stderr().write_all(format!("{line}\n").as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsStr;

    #[test]
    fn the_thread_count_is_capped_and_checked() {
        assert_eq!(threads(None, 2).unwrap(), 2);
        assert_eq!(threads(Some(OsStr::new("0")), 2).unwrap(), 2);
        assert_eq!(threads(Some(OsStr::new("3")), 2).unwrap(), 3);
        assert_eq!(threads(Some(OsStr::new("1000000")), 2).unwrap(), 8);
        assert_eq!(threads(Some(OsStr::new("99999999999999999999999")), 2).unwrap(), 8);
        for bad in ["-1", "lots", "", "1.5"] {
            let e = threads(Some(OsStr::new(bad)), 2).unwrap_err().to_string();
            assert!(e.starts_with("RAYON_NUM_THREADS must be"), "{e}");
        }
    }
}
