//! Progress of long runs on stderr. An audit at production shapes runs for seconds to minutes, so
//! it says which probe is running and how many of its cases are done; a sweep or an exploit run
//! counts its cells or seeds.
//!
//! The library reports progress through [`Progress`]; the binary draws it as bars on stderr.
//! Progress only observes: nothing reported here changes what an audit computes.

/// What an audit reports as it runs. Cases run on worker threads, so the methods take `&self`
/// and implementations count with atomics.
pub trait Progress: Sync {
    /// A probe starts; `label` names the router and the probe.
    fn probe(&self, label: &str);
    /// `n` more cases of the current probe are planned (a searched probe plans in steps).
    fn plan(&self, n: usize);
    /// `n` more cases of the current probe are done.
    fn done(&self, n: usize);
}

/// Reports nothing.
pub struct Silent;

impl Progress for Silent {
    fn probe(&self, _: &str) {}
    fn plan(&self, _: usize) {}
    fn done(&self, _: usize) {}
}
