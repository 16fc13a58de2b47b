//! The exit codes of every command, named in one place: 0 the command did what it was asked
//! and its check passed, 1 its check failed (a leak, a changed snapshot, a routing defect, a bias
//! over its limit, a trained exploit), 2 nothing was judged (bad input or usage, an I/O failure,
//! an internal error). A signal ends the process with 128 + its number (`runtime.rs`).

/// Done, and the check passed.
pub(crate) const OK: u8 = 0;
/// The check failed: what the command looks for was found.
pub(crate) const FAILED: u8 = 1;
/// Nothing was judged: bad input or usage, an I/O failure, an internal error, a panic.
pub(crate) const ERROR: u8 = 2;

/// [`FAILED`] when `failed`, else [`OK`].
pub(crate) fn failed_if(failed: bool) -> u8 {
    if failed {
        FAILED
    } else {
        OK
    }
}
