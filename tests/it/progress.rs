//! Progress reports: every probe announced in order, its cases planned and done counted, and
//! the report the same bits as a silent audit's at any thread count.

use candle_core::{DType, Device};
use moe_audit::analyze::{audit, AuditOptions, Probe, Subject};
use moe_audit::config::preset;
use moe_audit::layer::MoeLayer;
use moe_audit::progress::{Progress, Silent};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// Each probe's label with the cases planned and done while it ran.
#[derive(Default)]
struct Counting {
    probes: Mutex<Vec<(String, usize, usize)>>,
    planned: AtomicUsize,
    done: AtomicUsize,
}

impl Counting {
    fn close(&self) {
        let (planned, done) = (self.planned.swap(0, Ordering::SeqCst), self.done.swap(0, Ordering::SeqCst));
        if let Some(last) = self.probes.lock().unwrap().last_mut() {
            (last.1, last.2) = (planned, done);
        }
    }

    fn finish(self) -> Vec<(String, usize, usize)> {
        self.close();
        self.probes.into_inner().unwrap()
    }
}

impl Progress for Counting {
    fn probe(&self, label: &str) {
        self.close();
        self.probes.lock().unwrap().push((label.to_string(), 0, 0));
    }
    fn plan(&self, n: usize) {
        self.planned.fetch_add(n, Ordering::SeqCst);
    }
    fn done(&self, n: usize) {
        self.done.fetch_add(n, Ordering::SeqCst);
    }
}

#[test]
fn an_audit_reports_each_probe_and_its_cases_without_changing_a_bit() {
    let config = preset("megatron-probs").unwrap().config().unwrap();
    let layer = MoeLayer::seeded(config, 16, 16, 0, DType::F32, &Device::Cpu).unwrap();
    // 99 prefix cases: P is searched (routes fewer than all).
    let options = AuditOptions { batch: 4, seq_len: 100, trials: 6, ..AuditOptions::default() };
    let counting = Counting::default();
    let report = audit(&Subject::layer(&layer), &options, &counting).unwrap();
    let seen = counting.finish();

    let labels: Vec<&str> = seen.iter().map(|(l, _, _)| l.as_str()).collect();
    // Training-mode probes first, then M, then S (which reads the calls around the other mode).
    let order = Probe::DEFAULT.iter().filter(|p| !matches!(p, Probe::M | Probe::S)).chain([&Probe::M, &Probe::S]);
    let want: Vec<String> = order.map(|p| format!("megatron-probs {}", p.name())).collect();
    assert_eq!(labels, want);
    for (label, planned, done) in &seen {
        assert_eq!(planned, done, "{label}: every planned case is done");
    }
    let cases = |p: Probe| seen[Probe::DEFAULT.iter().position(|&q| q == p).unwrap()].2;
    assert_eq!(cases(Probe::F), 6);
    assert_eq!(cases(Probe::N), 6);
    // P counts the prefixes it routed, as its note says.
    let note = &report.finding(Probe::P).unwrap().note;
    let routed = cases(Probe::P);
    assert!(routed > 0 && (note == "99 cases") == (routed == 99), "{note}: {routed} routed");

    let silent = audit(&Subject::layer(&layer), &options, &Silent).unwrap();
    assert_eq!(serde_json::to_string(&report).unwrap(), serde_json::to_string(&silent).unwrap());
    let one_thread = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    let single = one_thread.install(|| audit(&Subject::layer(&layer), &options, &Counting::default()).unwrap());
    assert_eq!(serde_json::to_string(&single).unwrap(), serde_json::to_string(&silent).unwrap());
}
