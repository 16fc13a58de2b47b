//! MPI ranks (cargo feature `mpi`): `mpirun -np 4` on the built binary gives exactly what
//! in-process ranks give, and a failing rank stops them all with exit code 2. A test binary of
//! its own, so that `cargo test --features mpi --test mpi` builds only it beside the binary.
#![cfg(feature = "mpi")]

use std::process::Command;

fn mpirun(args: &[&str]) -> (i32, String, String) {
    let out = Command::new("mpirun")
        .args(["-np", "4", "--oversubscribe", env!("CARGO_BIN_EXE_moe-audit")])
        .args(args)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .output()
        .expect("mpirun (OpenMPI) on PATH");
    (out.status.code().unwrap_or(-1), String::from_utf8(out.stdout).unwrap(), String::from_utf8(out.stderr).unwrap())
}

/// `err` without Open MPI's own MPI_ABORT notice (a block between two lines of dashes), which
/// mpirun forwards in whatever pieces it read: it was seen inside a rank's one-line error, cut at
/// a byte no write of the rank ends at (1 run in 150).
fn without_abort_notice(err: &str) -> String {
    let rule = "-".repeat(74);
    let mut out = err.to_string();
    while let Some(start) = out.find(&rule) {
        let Some(len) = out[start + rule.len()..].find(&rule) else { break };
        let end = start + rule.len() + len + rule.len();
        let end = if out[end..].starts_with('\n') { end + 1 } else { end };
        out.replace_range(start..end, "");
    }
    out
}

fn in_process(args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_moe-audit")).args(args).output().unwrap();
    (out.status.code().unwrap_or(-1), String::from_utf8(out.stdout).unwrap())
}

/// `args` under `mpirun -np 4 ... --comm mpi` and on 4 in-process ranks: both exit with `code`
/// and print the same; returns what they printed.
fn same_as_in_process(args: &[&str], code: i32) -> String {
    let (mpi_code, mpi, err) = mpirun(&[args, &["--comm", "mpi"]].concat());
    assert_eq!(mpi_code, code, "{err}");
    let (local_code, local) = in_process(&[args, &["--ranks", "4"]].concat());
    assert_eq!(local_code, code);
    assert_eq!(mpi, local);
    mpi
}

#[test]
fn mpi_forward_equals_in_process_forward_exactly() {
    let mpi = same_as_in_process(&["ep", "megatron-probs", "--seq-len", "64", "--format", "json"], 0);
    assert!(mpi.contains("\"equals_single_device\": true"), "{mpi}");
}

#[test]
fn mpi_check_prints_the_in_process_report() {
    let args = ["check", "megatron-probs", "mixtral", "--probes", "N,L", "--seq-len", "32", "--format", "json"];
    let mpi = same_as_in_process(&args, 1);
    assert!(mpi.contains("expert-parallel layer on 4 ranks"), "{mpi}");
}

#[test]
fn a_failing_mpi_rank_stops_every_rank_with_exit_2() {
    // Sequence 2 (rank 2's) holds a value beyond f32: its scores are infinite, the others' fine.
    let mut rows: Vec<Vec<f64>> =
        (0..4 * 64).map(|i| (0..16).map(|j| ((i * 16 + j) as f64 * 0.37).sin()).collect()).collect();
    rows[2 * 64 + 5][3] = 1e39;
    let path = std::env::temp_dir().join("moe-audit-mpi-bad-input.json");
    std::fs::write(&path, serde_json::to_string(&rows).unwrap()).unwrap();
    let args = ["ep", "mixtral", "--hidden", "16", "--input", path.to_str().unwrap()];
    let (code, out, err) = mpirun(&[&args[..], &["--comm", "mpi"]].concat());
    assert_eq!(code, 2, "{err}");
    assert!(out.is_empty(), "no partial report: {out}");
    assert!(
        without_abort_notice(&err)
            .contains("error: rank 2 failed: non-finite score -inf at batch 2, position 5, expert 0\n"),
        "{err}"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_moe-audit")).args(args).args(["--ranks", "4"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        String::from_utf8(out.stderr).unwrap(),
        "error: rank 2 failed: non-finite score -inf at batch 2, position 5, expert 0\n"
    );
}

#[test]
fn mpi_reductions_give_the_in_process_bits() {
    // Every algorithm × wire × accumulator: the JSON carries each result's checksum.
    let args = ["collectives", "--elements", "1000", "--ranges", "10,10000", "--format", "json"];
    let (code, mpi, err) = mpirun(&[&args[..], &["--ranks", "4", "--comm", "mpi"]].concat());
    assert_eq!(code, 0, "{err}");
    let (local_code, local) = in_process(&[&args[..], &["--ranks", "4"]].concat());
    assert_eq!(local_code, 0);
    assert_eq!(mpi, local);
    assert_eq!(mpi.matches("\"checksum\"").count(), 2 * 4 * 3 * 3, "{mpi}");
}
