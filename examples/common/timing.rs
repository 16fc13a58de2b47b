//! What the cost examples share: medians of timings and the flags they take.
#![allow(dead_code)] // each example uses its own part

use std::time::Duration;

pub fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The value after `name` on the command line, if the flag is there.
pub fn flag(name: &str) -> Result<Option<String>, String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.iter().position(|a| a == name) {
        None => Ok(None),
        Some(i) => args.get(i + 1).cloned().map(Some).ok_or_else(|| format!("{name} needs a value")),
    }
}

/// `--reps N`, or `default`.
pub fn reps(default: usize) -> Result<usize, String> {
    flag("--reps")?.map_or(Ok(default), |v| v.parse().map_err(|e| format!("--reps {v}: {e}")))
}
