//! Noise, state and order, on Python routers over the protocol: a random router gets one D
//! finding and inconclusive verdicts elsewhere (all pass with its noise off); a router that
//! overwrites its capacity in an inference call (as HF's NLLB-MoE does) leaks on S, and every
//! verdict and rate is the same whatever `--probes` subset runs.
//!
//! The routers need python3 with numpy (see `external.rs`).

use crate::external::{numpy, python_env};
use moe_audit::analyze::{Finding, Probe, Report, Verdict};
use std::path::{Path, PathBuf};
use std::process::Output;

const BIN: &str = env!("CARGO_BIN_EXE_moe-audit");

/// Top-1 over 8 logits with Gaussian noise from one generator seeded once per process (so a
/// run is reproducible while every call draws fresh noise); `NOISE=0` turns the noise off.
const RANDOM_ROUTER: &str = r#"
import os
import numpy as np
from moe_audit import routes_from_arrays, run

SCALE = float(os.environ.get("NOISE", "1.0"))
RNG = np.random.default_rng(0)

def route(data, mode):
    logits = data.reshape(-1, data.shape[-1])
    if SCALE > 0:
        logits = logits + SCALE * RNG.standard_normal(logits.shape).astype(np.float32)
    top = np.argsort(-logits, axis=1, kind="stable")[:, :1]
    return routes_from_arrays(top, np.ones(top.shape))

run(route, name="random-py", experts=8, top_k=1, input="logits")
"#;

/// Top-1 over 4 logits, each expert keeping the first C tokens of each sequence (causal). C is
/// state: unlimited until an inference call sets it from that call's length (HF's NLLB-MoE
/// router overwrites `self.expert_capacity` in eval); training calls use what was set last.
/// `FIXED=1` computes the inference capacity without storing it (then only M leaks).
const STATEFUL_ROUTER: &str = r#"
import math
import os
import numpy as np
from moe_audit import routes_from_arrays, run

E = 4
FIXED = os.environ.get("FIXED") == "1"

class Router:
    capacity = None

    def route(self, data, mode):
        b, s, _ = data.shape
        capacity = self.capacity
        if mode == "inference":
            capacity = max(1, math.ceil(0.5 * s / E))
            if not FIXED:
                self.capacity = capacity
        top = np.argmax(data, axis=2)  # [b, s], ties to the lowest expert
        kept = np.ones((b, s), dtype=bool)
        if capacity is not None:
            for i in range(b):
                used = [0] * E
                for p in range(s):
                    e = top[i, p]
                    kept[i, p] = used[e] < capacity
                    used[e] += 1
        return routes_from_arrays(top.reshape(-1, 1), np.ones((b * s, 1)), kept.reshape(-1, 1))

run(Router().route, name="stateful-py", experts=E, top_k=1, input="logits")
"#;

fn script(name: &str, text: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("moe-audit-it-noise-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write router");
    path
}

fn check(router: &Path, env: &[(&str, &str)], extra: &[&str]) -> (i32, Report, Output) {
    let cmd = format!("python3 {}", router.display());
    let out = std::process::Command::new(BIN)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .envs(python_env())
        .envs(env.iter().copied())
        .args(["check", "--router-cmd", &cmd, "--format", "json", "--batch", "2", "--seq-len", "32", "--trials", "8"])
        .args(extra)
        .output()
        .expect("run moe-audit");
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    let code = out.status.code().expect("exit code");
    assert!(matches!(code, 0 | 1), "{extra:?}: exit {code}\n{err}");
    (code, serde_json::from_slice(&out.stdout).expect("a JSON report"), out)
}

fn verdicts(report: &Report) -> Vec<(Probe, Verdict)> {
    report.routers.iter().flat_map(moe_audit::analyze::verdicts).collect()
}

#[test]
fn a_random_router_gets_one_d_finding_and_inconclusive_verdicts_elsewhere() {
    if !numpy() {
        return;
    }
    let router = script("random.py", RANDOM_ROUTER);
    let (code, report, _) = check(&router, &[], &[]);
    assert_eq!(code, 1);
    let r = &report.routers[0];
    let d = r.finding(Probe::D).unwrap();
    assert_eq!(d.verdict, Verdict::Leak);
    assert!(d.note.starts_with("random router (or one that every call changes): "), "{}", d.note);
    // Random in both modes; its adapter (a route function) offers no seed_calls, so the fix
    // names only the seed every request carries.
    let fix = &d.explain.as_ref().expect("D leaks: explained").fix;
    assert_eq!(
        fix,
        "random in both modes: seed every request's random draws from the `seed` moe-audit/2 sends, or route without random selection or sampling"
    );
    for f in r.findings.iter().filter(|f| f.probe != Probe::D) {
        assert!(
            matches!(f.verdict, Verdict::Inconclusive | Verdict::Pass),
            "{:?}: {:?} {}",
            f.probe,
            f.verdict,
            f.note
        );
    }
    let inconclusive: Vec<&Finding> = r.findings.iter().filter(|f| f.verdict == Verdict::Inconclusive).collect();
    assert!(inconclusive.len() >= 5, "{:?}", verdicts(&report));
    assert!(inconclusive.iter().all(|f| f.note.starts_with("inconclusive: random ")), "{inconclusive:#?}");

    // Without D the router still fails the gate (exit 1), inconclusive.
    let (code, report, _) = check(&router, &[], &["--probes", "P,F"]);
    assert_eq!(code, 1);
    assert_eq!(verdicts(&report), [(Probe::P, Verdict::Inconclusive), (Probe::F, Verdict::Inconclusive)]);

    // The text report says so, with the fix.
    let cmd = format!("python3 {}", router.display());
    let out = std::process::Command::new(BIN)
        .envs(python_env())
        .args(["check", "--router-cmd", &cmd, "--batch", "2", "--seq-len", "16", "--trials", "4"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("D repeat     LEAK") && text.contains("random router (or one that every call changes): "),
        "{text}"
    );
    assert!(
        text.contains(" inconclusive ") && text.contains("1 router(s) random, verdicts inconclusive: random-py"),
        "{text}"
    );
    assert!(!text.contains(" noise "), "one word for the verdict, as in JSON: {text}");

    // With the noise off, every probe passes.
    let (code, report, _) = check(&router, &[("NOISE", "0")], &[]);
    assert_eq!(code, 0, "{:?}", verdicts(&report));
    assert_eq!(verdicts(&report), Probe::DEFAULT.iter().map(|&p| (p, Verdict::Pass)).collect::<Vec<_>>());
}

/// What must not depend on which probes ran: everything a finding reports.
fn essence(f: &Finding) -> (Probe, Verdict, usize, usize, bool, String) {
    (f.probe, f.verdict, f.compared, f.affected, f.capacity_changed, f.note.clone())
}

#[test]
fn capacity_overwritten_in_an_inference_call_leaks_on_s_whatever_the_probes() {
    if !numpy() {
        return;
    }
    let router = script("stateful.py", STATEFUL_ROUTER);
    let (code, full, _) = check(&router, &[], &[]);
    assert_eq!(code, 1);
    let leaks: Vec<Probe> =
        full.routers[0].findings.iter().filter(|f| f.verdict == Verdict::Leak).map(|f| f.probe).collect();
    // S: the capacity an inference call stored; M: training (as before any inference call:
    // no capacity) against inference (a capacity); P F N R L: per-sequence first come first served.
    assert_eq!(leaks, [Probe::S, Probe::M], "{:?}", verdicts(&full));
    let s = full.routers[0].finding(Probe::S).unwrap();
    assert!(s.note.contains("after an inference call"), "{}", s.note);
    // Every subset, in any order on the command line, reports the same findings.
    for probes in ["L", "M,L", "L,M", "S", "L,S,M,D", "R,P", "F,N"] {
        let (_, part, _) = check(&router, &[], &["--probes", probes]);
        for f in &part.routers[0].findings {
            assert_eq!(essence(f), essence(full.routers[0].finding(f.probe).unwrap()), "--probes {probes}");
        }
    }
    // The capacity computed but not stored: stateless, and serving a rule training never used.
    let (_, fixed, _) = check(&router, &[("FIXED", "1")], &[]);
    let leaks: Vec<Probe> =
        fixed.routers[0].findings.iter().filter(|f| f.verdict == Verdict::Leak).map(|f| f.probe).collect();
    assert_eq!(leaks, [Probe::M], "{:?}", verdicts(&fixed));
}

#[test]
fn an_external_routers_witness_replays_against_the_live_router() {
    if !numpy() {
        return;
    }
    let router = script("stateful-witness.py", STATEFUL_ROUTER);
    let dir = router.with_file_name("witnesses");
    let (code, report, _) = check(&router, &[], &["--probes", "S", "--witness-dir", dir.to_str().unwrap()]);
    assert_eq!(code, 1);
    // The JSON report carries the witness too: both calls, the handshake, the modes.
    let w = report.routers[0].finding(Probe::S).unwrap().witness.as_ref().expect("a witness");
    assert_eq!(w.handshake.as_ref().unwrap()["name"], "stateful-py");
    assert!(w.router.is_none() && w.differs == "kept", "{}", w.differs);
    let file = dir.join("stateful-py-S.json");
    let replay = |env: &[(&str, &str)], with_router: bool| {
        let cmd = format!("python3 {}", router.display());
        let mut args = vec!["replay", file.to_str().unwrap()];
        if with_router {
            args.extend(["--router-cmd", &cmd]);
        }
        let out = std::process::Command::new(BIN).envs(python_env()).envs(env.iter().copied()).args(&args).output();
        let out = out.unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr))
    };
    let (code, text) = replay(&[], true);
    assert_eq!(code, Some(1), "{text}");
    assert!(text.starts_with("LEAK reproduced: router stateful-py, probe S"), "{text}");
    // Fixed (the inference capacity no longer stored): the witness no longer reproduces.
    let (code, text) = replay(&[("FIXED", "1")], true);
    assert_eq!(code, Some(0), "{text}");
    // Without the router: a one-line error that says how to replay it.
    let (code, text) = replay(&[], false);
    assert_eq!(code, Some(2), "{text}");
    assert!(text.contains("replay it with --router-cmd") && text.lines().count() == 1, "{text}");
}
