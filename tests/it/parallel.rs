//! Expert parallelism: the EP layer against the single-device layer (bit for bit), traffic
//! accounting, failure propagation, and the layout probe.

use candle_core::{DType, Device, Tensor};
use moe_audit::analyze::{audit, AuditOptions, Probe, Subject, Verdict};
use moe_audit::config::{preset, Flatten, RouterConfig, ScopeConfig, ScopeGroup};
use moe_audit::layer::{MoeLayer, Seeded};
use moe_audit::parallel::{forward_in_process, run_ranks, Communicator, ExpertParallel};
use moe_audit::progress::Silent;

const H: usize = 16;
const F: usize = 32;
const B: usize = 4;
/// 64 tokens per sequence: every rank routes more than 32 tokens (see `parallel::ep`: candle's CPU
/// gate matmul takes another kernel, with other last bits, for 32 rows or fewer).
const S: usize = 64;

fn config(name: &str, scope: ScopeConfig) -> RouterConfig {
    let mut c = preset(name).unwrap().config().unwrap();
    c.scope = scope;
    c
}

fn layer(config: RouterConfig) -> MoeLayer {
    MoeLayer::seeded(config, H, F, 3, DType::F32, &Device::Cpu).unwrap()
}

fn input() -> Tensor {
    Seeded::new(5).normal(&[B, S, H], &Device::Cpu).unwrap()
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap().into_iter().map(f32::to_bits).collect()
}

/// With the routing scope equal to the per-rank split (one group per rank's sequences, or one
/// per sequence), the EP layer equals `MoeLayer::forward` bit for bit, routing record included.
#[test]
fn expert_parallel_equals_single_device_bit_for_bit() {
    let x = input();
    let presets = [
        "mixtral",
        "deepseek-v3",
        "switch",
        "megatron-probs",
        "megatron-probs-pad",
        "deepspeed-top2",
        "deepspeed-topk-probs",
        "expert-choice",
    ];
    for ranks in [1, 2, 4] {
        let per_rank = ScopeConfig { group: ScopeGroup::Tokens(B / ranks * S), flatten: Flatten::SequenceMajor };
        let per_sequence = ScopeConfig { group: ScopeGroup::Sequence, flatten: Flatten::PositionMajor };
        for name in presets {
            for scope in [per_rank, per_sequence] {
                let layer = layer(config(name, scope));
                let (y, routing) = layer.forward(&x).unwrap();
                let ep = forward_in_process(&layer, &x, ranks).unwrap();
                assert_eq!(bits(&ep.y), bits(&y), "{name}, {ranks} ranks, scope {:?}", scope.group);
                assert_eq!(ep.routing, routing, "{name}, {ranks} ranks");
            }
        }
    }
    // The capacity presets really drop at these sizes, so the comparison covers dropping.
    let layer =
        layer(config("megatron-probs", ScopeConfig { group: ScopeGroup::Tokens(S), flatten: Flatten::SequenceMajor }));
    assert!(layer.forward(&x).unwrap().1.stats.drop_rate > 0.0);
}

/// Whatever the scope, EP equals the single-device dispatch and combine on the routing the
/// ranks made (each its own tokens), bit for bit.
#[test]
fn expert_parallel_equals_single_device_apply_on_its_routing() {
    let x = input();
    let layer = layer(preset("megatron-probs").unwrap().config().unwrap());
    for ranks in [2, 4] {
        let ep = forward_in_process(&layer, &x, ranks).unwrap();
        assert_eq!(bits(&ep.y), bits(&layer.apply(&x, &ep.routing).unwrap()));
        // Per-rank capacity: the routing differs from the whole-batch routing (scenario 10).
        assert_ne!(ep.routing, layer.forward(&x).unwrap().1);
    }
}

/// Rows and bytes per rank and exchange, against the routing they came from.
#[test]
fn traffic_matches_the_routing() {
    let x = input();
    let layer = layer(preset("megatron-probs").unwrap().config().unwrap());
    let ranks = 4;
    let ep = forward_in_process(&layer, &x, ranks).unwrap();
    let m = 8 / ranks;
    let row_bytes = H * 4;
    let (mut sent, mut received) = (0, 0);
    for t in &ep.traffic {
        // Off-rank routes of this rank's tokens, counted from the record.
        let mine = ep.routing.tokens.iter().filter(|tok| tok.batch / (B / ranks) == t.rank);
        let routes: Vec<usize> = mine.flat_map(|tok| tok.routes.iter().filter(|r| r.kept).map(|r| r.expert)).collect();
        let off = routes.iter().filter(|&&e| e / m != t.rank).count();
        assert_eq!(t.dispatch.rows_sent, off);
        assert_eq!(t.dispatch.bytes_sent, off * row_bytes);
        assert_eq!(t.dispatch.rows_local, routes.len() - off);
        assert_eq!(t.payload_bytes, routes.len() * row_bytes);
        assert_eq!(t.combine.rows_received, t.dispatch.rows_sent);
        assert_eq!(t.combine.rows_sent, t.dispatch.rows_received);
        assert!((t.uniform_bytes_sent - t.payload_bytes as f64 * 3.0 / 4.0).abs() < 1e-9);
        // Seeded routing is near uniform: within 25% of (N-1)/N of the payload.
        assert!((t.vs_uniform() - 1.0).abs() < 0.25, "{}", t.vs_uniform());
        sent += t.dispatch.rows_sent;
        received += t.dispatch.rows_received;
    }
    assert_eq!(sent, received);
    let one = forward_in_process(&layer, &x, 1).unwrap();
    assert_eq!(one.traffic[0].dispatch.bytes_sent, 0);
    assert_eq!(one.traffic[0].uniform_bytes_sent, 0.0);
}

#[test]
fn bad_layouts_are_clear_errors() {
    let x = input();
    let layer = layer(preset("mixtral").unwrap().config().unwrap());
    let err = forward_in_process(&layer, &x, 3).unwrap_err().to_string();
    assert_eq!(err, "8 experts do not split evenly over 3 ranks");
    let err = forward_in_process(&layer, &x.narrow(0, 0, 2).unwrap(), 4).unwrap_err().to_string();
    assert_eq!(err, "setting `ranks` 4: the batch of 2 sequences must split evenly over the ranks");
}

/// A rank that fails (here: NaN in its tokens only) stops every rank with its error.
#[test]
fn a_failing_rank_stops_every_rank() {
    let layer = layer(preset("mixtral").unwrap().config().unwrap());
    let ep = ExpertParallel::new(&layer);
    let x = input();
    let err = run_ranks(4, |comm| {
        let mine = x.narrow(0, comm.rank(), 1)?;
        let mine = if comm.rank() == 2 { (mine * f64::NAN)? } else { mine };
        ep.forward(comm, &mine)
    })
    .unwrap_err();
    assert!(err.to_string().starts_with("rank 2 failed: non-finite score NaN at batch 0, position 0"), "{err}");
    let err =
        run_ranks(2, |comm| ep.forward(comm, &x.narrow(2, 0, if comm.rank() == 0 { H } else { H - 1 })?.contiguous()?))
            .unwrap_err();
    assert!(err.to_string().starts_with("rank 1 failed: shape mismatch in expert-parallel layer on rank 1"), "{err}");
}

fn layout(name: &str, ranks: usize) -> moe_audit::analyze::Finding {
    let layer = layer(preset(name).unwrap().config().unwrap());
    let options =
        AuditOptions { probes: vec![Probe::L], batch: B, seq_len: 32, trials: 4, seed: 0, ranks, exhaustive: false };
    let report = audit(&Subject::layer(&layer), &options, &Silent).unwrap();
    report.finding(Probe::L).unwrap().clone()
}

/// Scenario 10: per-rank capacity leaks under L with a witness that replays; dropless and
/// per-sequence routers pass, and the EP layer's outputs agree with the single-device layer.
#[test]
fn layout_probe_verdicts() {
    for name in ["megatron-probs", "deepspeed-top1", "expert-choice"] {
        let f = layout(name, 2);
        assert_eq!(f.verdict, Verdict::Leak, "{name}: {}", f.note);
        assert_eq!(f.output_leaks, 0, "{name}");
        let w = f.witness.expect("a witness");
        let dir = std::env::temp_dir().join(format!("moe-audit-layout-{name}.json"));
        std::fs::write(&dir, serde_json::to_string(&w).unwrap()).unwrap();
        assert!(moe_audit::analyze::Witness::read(&dir).unwrap().replay(&dir).unwrap().reproduces(), "{name}");
    }
    for name in ["mixtral", "switch", "deepseek-v3"] {
        for ranks in [2, 4] {
            let f = layout(name, ranks);
            assert_eq!((f.verdict, f.affected, f.output_leaks), (Verdict::Pass, 0, 0), "{name}: {}", f.note);
            assert!(f.compared > 0);
        }
    }
    let f = layout("mixtral", 4);
    assert!(f.note.contains("expert-parallel layer on 4 ranks: dispatch sent"), "{}", f.note);
    // megatron-position only flips on flattening when the batch scope holds several sequences.
    assert!(layout("megatron-position", 2).note.contains("flattening"));
    assert_eq!(layout("mixtral", 3).verdict, Verdict::Pass, "3 ranks do not split 4 sequences: flattening only");
}

fn cli(args: &[&str]) -> (Option<i32>, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_moe-audit")).args(args).output().unwrap();
    (out.status.code(), String::from_utf8(out.stdout).unwrap(), String::from_utf8(out.stderr).unwrap())
}

#[test]
fn cli_ranks_and_comm() {
    let (code, out, _) = cli(&["check", "megatron-probs", "--probes", "L", "--ranks", "4", "--seq-len", "32"]);
    assert_eq!(code, Some(1), "{out}");
    let (code, _, err) = cli(&["check", "mixtral", "--ranks", "3"]);
    assert_eq!(
        (code, err.as_str()),
        (Some(2), "error: --ranks 3: the batch of 4 sequences must split evenly over the ranks\n")
    );
    // ep says the same, without blaming a rank for a usage error.
    let (code, _, err) = cli(&["ep", "mixtral", "--ranks", "3"]);
    assert_eq!(
        (code, err.as_str()),
        (Some(2), "error: --ranks 3: the batch of 4 sequences must split evenly over the ranks\n")
    );
    let (code, _, err) = cli(&["ep", "mixtral", "--ranks", "3", "--batch", "3"]);
    assert_eq!((code, err.as_str()), (Some(2), "error: 8 experts do not split evenly over 3 ranks\n"));
    let (code, out, _) = cli(&["ep", "megatron-probs", "--ranks", "4", "--seq-len", "64"]);
    assert_eq!(code, Some(0));
    assert!(
        out.starts_with("router megatron-probs | 4 ranks | batch 4 x seq 64, hidden 64 | 8 experts, 2 per rank\n"),
        "{out}"
    );
    assert!(out.contains("equal to the single-device layer on the ranks' routing, bit for bit: yes"), "{out}");
    #[cfg(not(feature = "mpi"))]
    {
        let (code, _, err) = cli(&["check", "mixtral", "--comm", "mpi"]);
        assert_eq!(
            (code, err.as_str()),
            (Some(2), "error: --comm mpi: this moe-audit was built without MPI (cargo build --features mpi)\n")
        );
    }
}
