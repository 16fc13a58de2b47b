//! Reductions on the communicator against hand-derived IEEE results and exact sums, and the
//! `collectives` command (figures, exit codes, charts, bad input).

use half::f16;
use moe_audit::parallel::reduce::{all_gather, all_reduce, chunk, reduce_scatter, Algorithm, Precision, ReducePlan};
use moe_audit::parallel::{run_ranks, Communicator};
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_moe-audit");

fn plan(algorithm: Algorithm, wire: Precision, accumulate: Precision) -> ReducePlan {
    ReducePlan { algorithm, wire, accumulate, domain: 4 }
}

/// Rank 0 holds 1024 in every element, every other rank 0.5 (the swamping payload); the result
/// rank 0 sees.
fn swamp(ranks: usize, p: ReducePlan) -> Vec<f32> {
    let mut out = run_ranks(ranks, |c| {
        let x = vec![if c.rank() == 0 { 1024.0 } else { 0.5 }; ranks];
        all_reduce(c, &x, p)
    })
    .unwrap();
    assert!(out.windows(2).all(|w| w[0].values == w[1].values), "every rank holds the same result");
    out.swap_remove(0).values
}

/// The ring in f16, worked by hand from IEEE rules. With R elements, element j is chunk j, whose
/// partial sum starts at rank j+1 and travels j+1, …, R−1, 0, 1, …, j. The 0.5s of ranks
/// j+1..R−1 sum exactly to s = (R−1−j)/2; adding 1024 gives 1024 + s, a tie when s is a half
/// (f16 spacing in [1024, 2048) is 1), rounded to the even neighbour. Every later 0.5 makes
/// another tie: an odd value goes up to the even one, an even value stays. So the result is
/// m = 1024 + ⌊s⌋, moved up to the next even number when m is odd and some 0.5 still followed.
fn ring_f16_by_hand(ranks: usize, j: usize) -> f32 {
    let halves_before = ranks - 1 - j;
    let m = 1024 + halves_before / 2;
    let another_half = halves_before % 2 == 1 || j >= 1;
    (if m % 2 == 1 && another_half { m + 1 } else { m }) as f32
}

#[test]
fn the_f16_ring_swamps_the_small_values_as_ieee_says() {
    for ranks in [16, 64] {
        let got = swamp(ranks, plan(Algorithm::Ring, Precision::F16, Precision::F16));
        let want: Vec<f32> = (0..ranks).map(|j| ring_f16_by_hand(ranks, j)).collect();
        assert_eq!(got, want, "{ranks} ranks");
        // The element whose ring starts at the 1024 loses every 0.5: 1024 instead of 1024 + (R−1)/2.
        assert_eq!(got[ranks - 1], 1024.0);
        // Most elements lose their 0.5s: the mean error is negative, a bias, not noise.
        let exact = 1024.0 + 0.5 * (ranks - 1) as f32;
        assert!(got.iter().map(|&v| v - exact).sum::<f32>() < -0.2 * ranks as f32);
    }
}

#[test]
fn f32_accumulation_fixes_the_sum_only_where_partial_sums_stay_local() {
    let ranks = 64;
    let exact = 1024.0 + 0.5 * (ranks - 1) as f64; // 1055.5
                                                   // f32 everywhere: exact.
    assert_eq!(swamp(ranks, plan(Algorithm::Ring, Precision::F32, Precision::F32)), vec![exact as f32; ranks]);
    // f16 on the wire, f32 in the accumulator, summed where the contributions arrive: the exact
    // sum rounded once to f16 (1055.5 is a tie between 1055 and 1056: even 1056).
    let once = f16::from_f64(exact).to_f32();
    assert_eq!(once, 1056.0);
    assert_eq!(swamp(ranks, plan(Algorithm::Direct, Precision::F16, Precision::F32)), vec![once; ranks]);
    // In the ring the partial sum travels on the wire, rounded to f16 at every hop: the wider
    // accumulator changes nothing.
    assert_eq!(
        swamp(ranks, plan(Algorithm::Ring, Precision::F16, Precision::F32)),
        swamp(ranks, plan(Algorithm::Ring, Precision::F16, Precision::F16))
    );
    // The direct sum in an f16 accumulator swamps (rank 0's 1024 comes first).
    assert_eq!(swamp(ranks, plan(Algorithm::Direct, Precision::F16, Precision::F16)), vec![1024.0; ranks]);
}

#[test]
fn every_algorithm_and_precision_sums_integers_that_fit_exactly() {
    // Sums stay below 256: every integer up to it is exact in bf16 and f16.
    for ranks in [1, 2, 3, 4, 5, 7, 8, 12, 16] {
        for algorithm in Algorithm::ALL {
            if algorithm == Algorithm::Hierarchical && ranks % 4 != 0 {
                continue;
            }
            for wire in Precision::ALL {
                for accumulate in Precision::ALL {
                    let n = 37;
                    let value = |r: usize, i: usize| ((r * 7 + i * 3) % 16) as f32;
                    let out = run_ranks(ranks, |c| {
                        let x: Vec<f32> = (0..n).map(|i| value(c.rank(), i)).collect();
                        all_reduce(c, &x, plan(algorithm, wire, accumulate))
                    })
                    .unwrap();
                    let want: Vec<f32> = (0..n).map(|i| (0..ranks).map(|r| value(r, i)).sum()).collect();
                    for o in out {
                        assert_eq!(o.values, want, "{algorithm:?} {wire:?}/{accumulate:?} on {ranks} ranks");
                    }
                }
            }
        }
    }
}

#[test]
fn reduce_scatter_then_all_gather_is_the_all_reduce() {
    for algorithm in [Algorithm::Ring, Algorithm::Direct] {
        let out = run_ranks(6, |c| {
            let x: Vec<f32> = (0..50).map(|i| ((i * 31 + c.rank() * 17) % 97) as f32 * 0.013).collect();
            let p = plan(algorithm, Precision::Bf16, Precision::F32);
            let whole = all_reduce(c, &x, p)?;
            let share = reduce_scatter(c, &x, p)?;
            assert_eq!(share.range, chunk(50, 6, c.rank()));
            let gathered = all_gather(c, &share.values, 50, Precision::Bf16)?;
            Ok((whole.values, gathered.values, share.bytes_sent + gathered.bytes_sent, whole.bytes_sent))
        })
        .unwrap();
        for (whole, gathered, split_bytes, bytes) in out {
            assert_eq!(whole, gathered, "{algorithm:?}");
            assert_eq!(split_bytes, bytes);
        }
    }
}

#[test]
fn traffic_meets_the_standard_formulas() {
    // B = 64 f16 values = 128 bytes, divisible into every chunk: all-reduce 2·B·(R−1)/R per rank.
    for (algorithm, ranks) in
        [(Algorithm::Ring, 8), (Algorithm::Direct, 8), (Algorithm::Hierarchical, 8), (Algorithm::Halving, 8)]
    {
        let out =
            run_ranks(ranks, |c| all_reduce(c, &[1.0; 64], plan(algorithm, Precision::F16, Precision::F32))).unwrap();
        for o in out {
            assert_eq!(o.bytes_sent, 2 * 128 * 7 / 8, "{algorithm:?}");
        }
    }
    // Halving on 6 ranks: 2 ranks fold their whole buffer into a partner and get it back.
    let out =
        run_ranks(6, |c| all_reduce(c, &[1.0; 64], plan(Algorithm::Halving, Precision::F32, Precision::F32))).unwrap();
    let sent: Vec<u64> = out.iter().map(|o| o.bytes_sent).collect();
    assert_eq!(sent, vec![256, 256 + 2 * 256 * 3 / 4, 256, 256 + 2 * 256 * 3 / 4, 2 * 256 * 3 / 4, 2 * 256 * 3 / 4]);
    assert!(out.iter().all(|o| o.values == vec![6.0; 64]));
}

#[test]
fn a_hierarchical_domain_that_does_not_divide_the_ranks_is_an_error() {
    let err = run_ranks(6, |c| all_reduce(c, &[1.0], plan(Algorithm::Hierarchical, Precision::F32, Precision::F32)))
        .unwrap_err();
    assert_eq!(err.to_string(), "rank 0 failed: domain size 4 does not divide 6 ranks (hierarchical reduction)");
}

fn run(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(BIN).arg("collectives").args(args).output().unwrap();
    (out.status.code().unwrap_or(-1), String::from_utf8(out.stdout).unwrap(), String::from_utf8(out.stderr).unwrap())
}

const SMALL: [&str; 6] = ["--ranks", "4,8", "--elements", "512", "--ranges", "100,10000"];

#[test]
fn collectives_reports_every_configuration_and_is_deterministic() {
    let (code, json, err) = run(&[&SMALL[..], &["--format", "json"]].concat());
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    let results = v["results"].as_array().unwrap();
    assert_eq!(results.len(), 2 * 2 * 4 * 3 * 3, "ranges × ranks × algorithms × wire × accumulator");
    // f32 throughout is close to exact; bf16 in a ring loses small values systematically.
    let find = |alg: &str, wire: &str, acc: &str, ranks: u64, range: f64| {
        results
            .iter()
            .find(|f| {
                f["algorithm"] == alg
                    && f["wire"] == wire
                    && f["accumulate"] == acc
                    && f["ranks"] == ranks
                    && f["range"].as_f64() == Some(range)
            })
            .unwrap()
    };
    assert!(find("ring", "f32", "f32", 8, 10000.0)["relative_error"].as_f64().unwrap() < 1e-6);
    let bf16 = find("ring", "bf16", "bf16", 8, 10000.0);
    assert!(bf16["bias"].as_f64().unwrap() < -1e-4, "{bf16}");
    assert!(bf16["swamped_share"].as_f64().unwrap() > 0.01, "{bf16}");
    assert_eq!(bf16["max_bytes_sent"], 2 * 512 * 2 * 7 / 8);
    // Same command, same bytes, whatever the thread count.
    let out = Command::new(BIN)
        .arg("collectives")
        .args(SMALL)
        .args(["--format", "json"])
        .env("RAYON_NUM_THREADS", "1")
        .output()
        .unwrap();
    assert_eq!(String::from_utf8(out.stdout).unwrap(), json);
}

#[test]
fn max_bias_gates_like_check() {
    let (code, text, _) = run(&[&SMALL[..], &["--max-bias", "1e-3"]].concat());
    assert_eq!(code, 1);
    assert!(text.contains("|bias| over --max-bias 0.001: "), "{text}");
    assert!(text.contains("ring wire f32 accumulate bf16;"), "{text}");
    let (code, text, _) = run(&[&SMALL[..], &["--wire", "f32", "--accumulate", "f32", "--max-bias", "1e-3"]].concat());
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("every configuration's |bias| is within --max-bias 0.001"), "{text}");
}

#[test]
fn collectives_draws_one_chart_per_range() {
    let dir = std::env::temp_dir().join(format!("moe-audit-collectives-chart-{}", std::process::id()));
    let (code, _, err) = run(&[&SMALL[..], &["--chart", dir.to_str().unwrap()]].concat());
    assert_eq!(code, 0, "{err}");
    for range in ["100", "10000"] {
        for ext in ["svg", "png"] {
            let path = dir.join(format!("collectives-range-{range}.{ext}"));
            assert!(std::fs::metadata(&path).map(|m| m.len() > 1000).unwrap_or(false), "{}", path.display());
        }
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn collectives_reads_real_gradients_from_safetensors() {
    use candle_core::{Device, Tensor};
    let dir = std::env::temp_dir().join(format!("moe-audit-collectives-grads-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // Two tensors, 4 ranks: rank 0 holds 1024s, the others 0.5s, in f16.
    let rows: Vec<f32> = (0..4).flat_map(|r| vec![if r == 0 { 1024.0 } else { 0.5 }; 6]).collect();
    let a = Tensor::from_vec(rows.clone(), (4, 6), &Device::Cpu).unwrap().to_dtype(candle_core::DType::F16).unwrap();
    let b = Tensor::from_vec(rows, (4, 3, 2), &Device::Cpu).unwrap();
    let path = dir.join("grads.safetensors");
    candle_core::safetensors::save(&std::collections::HashMap::from([("a", a), ("b", b)]), &path).unwrap();
    let args = ["--gradients", path.to_str().unwrap(), "--ranks", "4", "--format", "json"];
    let ring = ["--algorithms", "ring", "--wire", "f16", "--accumulate", "f16", "--tolerance", "1e-3"];
    let (code, json, err) = run(&[&args[..], &ring[..]].concat());
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["elements"], 12);
    // 12 elements over 4 ranks: chunk c = elements 3c..3c+3, its ring starting at rank c+1. Chunk 0:
    // 0.5·3 + 1024 = 1025.5, a tie, to 1026. Chunk 1: 1 + 1024 = 1025, + 0.5 = 1025.5 → 1026.
    // Chunk 2: 0.5 + 1024 = 1024.5 → 1024, and so twice more; chunk 3 starts at 1024: 1024. Exact
    // 1025.5 everywhere: errors +0.5 (6 elements) and −1.5 (6 elements, over 1e-3 relative).
    let f = &v["results"][0];
    assert_eq!(f["swamped_share"].as_f64(), Some(0.5));
    assert_eq!(f["bias"].as_f64(), Some((6.0 * 0.5 - 6.0 * 1.5) / (12.0 * 1025.5)));
    let bad = dir.join("bad.safetensors");
    std::fs::write(&bad, b"not safetensors").unwrap();
    let (code, _, err) = run(&["--gradients", bad.to_str().unwrap(), "--ranks", "4"]);
    assert_eq!(code, 2);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.starts_with(&format!("error: {}: not a safetensors file", bad.display())), "{err}");
    let eight: Vec<&str> = args.iter().map(|a| if *a == "4" { "8" } else { a }).collect();
    let err = crate::routes::bad(&[&["collectives"][..], &eight].concat());
    assert!(err.contains("holds gradients of 4 ranks"), "{err}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn bad_collectives_input_is_one_line_and_exit_2() {
    for (args, message) in [
        (&["--ranks", "0"][..], "error: --ranks must be between 1 and 1024, got 0"),
        (&["--ranks", "6", "--domain", "4"][..], "error: --domain 4 does not divide 6 ranks (hierarchical reduction)"),
        (&["--elements", "0"][..], "error: --elements must be at least 1"),
        (&["--ranges", "0.5"][..], "error: --ranges must be finite numbers ≥ 1, got 0.5"),
        (&["--tolerance=-1"][..], "error: --tolerance must be a positive number, got -1"),
        (&["--elements", "1000000000000", "--max-memory", "1GiB"][..], "error: this reduction needs about"),
    ] {
        let (code, out, err) = run(args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(out.is_empty());
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(err.starts_with(message), "{args:?}: {err}");
    }
}

#[test]
fn ep_combine_in_low_precision_is_measured_against_the_f32_combine() {
    let ep = |extra: &[&str]| {
        let out = Command::new(BIN)
            .args(["ep", "mixtral", "--seq-len", "32", "--ranks", "2", "--format", "json"])
            .args(extra)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let f32 = ep(&[]);
    assert_eq!(f32["equals_single_device"], true);
    assert!(f32.get("low_precision_combine").is_none());
    let error = |v: &serde_json::Value| v["low_precision_combine"]["relative_error"].as_f64().unwrap();
    let bf16 = ep(&["--combine-wire", "bf16", "--combine-accumulate", "bf16"]);
    let f16 = ep(&["--combine-wire", "f16", "--combine-accumulate", "f32"]);
    assert_eq!(bf16["equals_single_device"], false);
    // bf16 keeps 8 significand bits, f16 11: errors near 2^-9 and 2^-12 of the values.
    assert!(error(&bf16) > 5e-4 && error(&bf16) < 1e-2, "{bf16}");
    assert!(error(&f16) > 5e-5 && error(&f16) < error(&bf16) / 4.0, "{f16}");
    // The combine's bytes on the wire halve; the dispatch's stay f32.
    let (t32, t16) = (&f32["traffic"][0], &f16["traffic"][0]);
    assert_eq!(t16["combine"]["bytes_sent"].as_u64().unwrap() * 2, t32["combine"]["bytes_sent"].as_u64().unwrap());
    assert_eq!(t16["dispatch"], t32["dispatch"]);
}
