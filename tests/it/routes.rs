//! `moe-audit routes`: every diagnosis named on files built here, a clean pair passing, the
//! measures exact against counts taken from the arrays, every format and the chart, and bad
//! input (exit 2, one line, nothing written), plus the threat model of routing records (a
//! record reads nothing it does not name; its memory and time are bounded).

#[path = "../../examples/common/route_files.rs"]
pub(crate) mod route_files;

use route_files::*;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_moe-audit");
const T: usize = 256;
const L: usize = 6;
const K: usize = 4;
const E: usize = 32;

pub(crate) fn dir(test: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("moe-audit-it-routes-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

pub(crate) fn put(d: &Path, name: &str, bytes: impl AsRef<[u8]>) -> String {
    let p = d.join(name);
    std::fs::write(&p, bytes).expect("write");
    p.to_str().expect("utf-8").to_string()
}

fn run(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().expect("run moe-audit")
}

/// `routes compare ... --format json`: the exit code and the report.
pub(crate) fn compare(args: &[&str]) -> (i32, Value) {
    let mut all = vec!["routes", "compare"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--format", "json"]);
    let out = run(&all);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(matches!(out.status.code(), Some(0 | 1)), "{args:?}: {:?} {err}", out.status);
    (out.status.code().unwrap(), serde_json::from_slice(&out.stdout).expect("json report"))
}

/// A command that must fail on bad input: exit 2, one `error:` line, nothing on stdout.
pub(crate) fn bad(args: &[&str]) -> String {
    let out = run(args);
    let err = String::from_utf8(out.stderr).expect("utf-8");
    assert_eq!(out.status.code(), Some(2), "{args:?}: {:?}\n{err}", out.status);
    assert!(out.stdout.is_empty(), "{args:?} wrote to stdout");
    assert!(err.starts_with("error: ") && err.lines().count() == 1, "{args:?}: {err}");
    assert!(!err.contains("panicked"), "{err}");
    err
}

fn kinds(report: &Value) -> Vec<(String, bool)> {
    report["diagnoses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| (d["kind"].as_str().unwrap().to_string(), d["defect"].as_bool().unwrap()))
        .collect()
}

/// The texts of every diagnosis of `kind` (a defect or a note), joined; panics when there is none.
fn has(report: &Value, kind: &str, defect: bool) -> String {
    let found: Vec<String> = report["diagnoses"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|d| d["kind"] == kind && d["defect"] == defect)
        .map(|d| format!("{} {}", d["found"].as_str().unwrap(), d["change"].as_str().unwrap()))
        .collect();
    assert!(!found.is_empty(), "no {kind} (defect {defect}) in {:?}", kinds(report));
    found.join("\n")
}

fn defects(report: &Value) -> Vec<String> {
    kinds(report).into_iter().filter(|k| k.1).map(|k| k.0).collect()
}

fn generic(d: &Path, name: &str, routes: &[i32], tokens: usize, layers: &[usize]) -> String {
    let g = Generic { routes, tokens, layers, k: K, logits: None, input_ids: None, cu_seqlens: None };
    put(d, name, g.bytes())
}

fn layers(n: usize) -> Vec<usize> {
    (0..n).collect()
}

#[test]
fn a_clean_pair_passes_a_replay_check() {
    let d = dir("clean");
    let r = random_routes(T, L, K, E, 1);
    let a = generic(&d, "a.safetensors", &r, T, &layers(L));
    let b = generic(&d, "b.safetensors", &r, T, &layers(L));
    let (code, rep) = compare(&[&a, &b, "--max-disagreement", "0"]);
    assert_eq!(code, 0, "{:?}", kinds(&rep));
    assert!(defects(&rep).is_empty());
    assert_eq!(rep["measures"]["decisions_differ"], 0.0);
    assert_eq!(rep["measures"]["tokens_differ"], 0.0);
    assert_eq!(rep["measures"]["decisions"], T * L);
    assert_eq!(rep["measures"]["overlap"], 1.0);
}

#[test]
fn the_headline_numbers_are_exact_counts() {
    let d = dir("exact");
    let r = random_routes(T, L, K, E, 2);
    let mut t = r.clone();
    let changed = flip(&mut t, K, E, 0.1, 3);
    let rows_differ =
        |tok: usize| (0..L).filter(|&l| r[(tok * L + l) * K..][..K] != t[(tok * L + l) * K..][..K]).count();
    let tokens_differ = (0..T).filter(|&tok| rows_differ(tok) > 0).count();
    let a = generic(&d, "a.safetensors", &r, T, &layers(L));
    let b = generic(&d, "b.safetensors", &t, T, &layers(L));
    let (code, rep) = compare(&[&a, &b]);
    assert_eq!(code, 0);
    let m = &rep["measures"];
    assert_eq!(m["decisions_differ"].as_f64().unwrap(), changed as f64 / (T * L) as f64);
    assert_eq!(m["tokens_differ"].as_f64().unwrap(), tokens_differ as f64 / T as f64);
    // One slot of K changed in each flipped row.
    let overlap = 1.0 - changed as f64 / (T * L * K) as f64;
    assert!((m["overlap"].as_f64().unwrap() - overlap).abs() < 1e-12);
    let first: u64 = m["layers"].as_array().unwrap().iter().map(|l| l["first_differing"].as_u64().unwrap()).sum();
    assert_eq!(first as usize, tokens_differ);
    // The gate: over and under the threshold.
    let share = changed as f64 / (T * L) as f64;
    assert_eq!(compare(&[&a, &b, "--max-disagreement", &format!("{}", share * 0.9)]).0, 1);
    assert_eq!(compare(&[&a, &b, "--max-disagreement", &format!("{}", share * 1.1)]).0, 0);
}

#[test]
fn dense_layers_in_one_record_only_are_a_layer_mapping_defect_without_a_config() {
    let d = dir("mapping");
    let moe = random_routes(T, L, K, E, 4);
    // The engine reports every layer (2 dense, -1); the trainer only its MoE layers, unnumbered.
    let all = with_dense(&moe, T, L, 2, K);
    let a = put(&d, "rollout.npy", npy("<i4", &[T, L + 2, K], &i32_bytes(&all)));
    let b = put(&d, "trainer.npy", npy("<i4", &[T, L, K], &i32_bytes(&moe)));
    let (code, rep) = compare(&[&a, &b]);
    assert_eq!(code, 1);
    let text = has(&rep, "layer-mapping", true);
    assert!(text.contains("trainer layer i matches rollout layer i+2 on at least 100.0%"), "{text}");
    assert!(text.contains("6 of 6 routed trainer layers"), "{text}");
    // Measured on the corrected pairing: no disagreement.
    assert_eq!(rep["measures"]["decisions_differ"], 0.0);
    // With the config, both are numbered right: a note, no defect.
    let config = put(&d, "config.json", config(L + 2, 2, E, K));
    let (code, rep) = compare(&[&a, &b, "--config", &config]);
    assert_eq!(code, 0, "{:?}", kinds(&rep));
    assert!(has(&rep, "layer-numbers", false).contains("its 6 layers are the MoE layers (2 to 7)"));
    assert!(has(&rep, "unpaired", false).contains("rollout layers with no route at all (dense): 0 to 1"));
}

#[test]
fn a_replay_indexed_by_moe_layer_order_is_named_with_its_shift() {
    let d = dir("moe-order");
    let moe = random_routes(T, L, K, E, 5);
    let all = with_dense(&moe, T, L, 2, K);
    // Trainer MoE layer m (global m + 2) replayed rollout row m: layers 4.. carry layer g - 2's
    // routes; layers 2, 3 got dense rows and routed on their own.
    let own = random_routes(T, 2, K, E, 6);
    let mut trainer = Vec::new();
    for t in 0..T {
        trainer.extend_from_slice(&own[t * 2 * K..(t + 1) * 2 * K]);
        trainer.extend_from_slice(&all[(t * (L + 2) + 2) * K..(t * (L + 2) + L) * K]);
    }
    let config = put(&d, "config.json", config(L + 2, 2, E, K));
    let a = put(&d, "rollout.json", sglang(&all, None));
    let b = generic(&d, "trainer.safetensors", &trainer, T, &(2..L + 2).collect::<Vec<_>>());
    let (code, rep) = compare(&[&a, &b, "--config", &config]);
    assert_eq!(code, 1);
    let text = has(&rep, "layer-mapping", true);
    assert!(text.contains("rollout layer i-2") && text.contains("4 of 6"), "{text}");
}

#[test]
fn a_token_offset_of_one_is_a_defect_and_seqlen_minus_one_is_not() {
    let d = dir("offset");
    let r = random_routes(T, L, K, E, 7);
    // Rollout rows [0, T-1), as SGLang reports; the trainer has T rows.
    let a = put(&d, "rollout.npy", npy("<i4", &[T - 1, L, K], &i32_bytes(&r[..(T - 1) * L * K])));
    let b = generic(&d, "good.safetensors", &r, T, &layers(L));
    let (code, rep) = compare(&[&a, &b, "--max-disagreement", "0"]);
    assert_eq!(code, 0, "{:?}", kinds(&rep));
    // Engines write seqlen-1 rows: one row short per request is their convention, a note.
    assert!(has(&rep, "one-row-short", false).contains("ends one position before the trainer"));
    // The trainer replayed row t + 1 at token t.
    let mut shifted = r[L * K..].to_vec();
    shifted.extend(random_routes(1, L, K, E, 8));
    let b = generic(&d, "shifted.safetensors", &shifted, T, &layers(L));
    let (code, rep) = compare(&[&a, &b]);
    assert_eq!(code, 1);
    let text = has(&rep, "token-offset", true);
    assert!(text.contains("rollout token t matches trainer token t-1 on at least 100.0%"), "{text}");
    assert_eq!(rep["measures"]["decisions_differ"], 0.0);
}

#[test]
fn a_start_length_is_aligned_by_position() {
    let d = dir("start");
    let r = random_routes(T, L, K, E, 9);
    let config = put(&d, "config.json", config(L, 0, E, K));
    // Positions [5, T - 1).
    let a = put(&d, "rollout.json", sglang(&r[5 * L * K..(T - 1) * L * K], Some(5)));
    let b = generic(&d, "trainer.safetensors", &r, T, &layers(L));
    let (code, rep) = compare(&[&a, &b, "--config", &config, "--max-disagreement", "0"]);
    assert_eq!(code, 0, "{:?}", kinds(&rep));
    assert!(has(&rep, "length", false).contains("rollout from position 5, trainer from 0"));
    assert_eq!(rep["alignment"]["tokens"], T - 6);
}

#[test]
fn padding_rows_are_aligned_past() {
    let d = dir("padding");
    let r = random_routes(T, L, K, E, 10);
    let mut padded = vec![-1; 3 * L * K];
    padded.extend_from_slice(&r);
    padded.extend(vec![-1; 2 * L * K]);
    let a = generic(&d, "rollout.safetensors", &r, T, &layers(L));
    let b = generic(&d, "trainer.safetensors", &padded, T + 5, &layers(L));
    let (code, rep) = compare(&[&a, &b, "--max-disagreement", "0"]);
    assert_eq!(code, 0, "{:?}", kinds(&rep));
    assert!(has(&rep, "padding", false).contains("trainer sequence 0: 3 left, 2 right"));
}

#[test]
fn packed_sequences_shifted_by_their_padding_are_a_packing_defect() {
    let d = dir("packing");
    let lens = [40usize, 50, 60];
    let padded = [48usize, 64, 64];
    let n: usize = lens.iter().sum();
    let r = random_routes(n, L, K, E, 11);
    let cu = |v: &[usize]| -> Vec<i64> {
        std::iter::once(0)
            .chain(v.iter().scan(0, |s, &x| {
                *s += x;
                Some(*s as i64)
            }))
            .collect()
    };
    // The replay indexed the padded layout with unpadded row numbers: trainer row i got rollout
    // row i (random past the rollout's end).
    let m: usize = padded.iter().sum();
    let mut t = r.clone();
    t.extend(random_routes(m - n, L, K, E, 12));
    let a = put(
        &d,
        "rollout.safetensors",
        Generic {
            routes: &r,
            tokens: n,
            layers: &layers(L),
            k: K,
            logits: None,
            input_ids: None,
            cu_seqlens: Some(&cu(&lens)),
        }
        .bytes(),
    );
    let b = put(
        &d,
        "trainer.safetensors",
        Generic {
            routes: &t,
            tokens: m,
            layers: &layers(L),
            k: K,
            logits: None,
            input_ids: None,
            cu_seqlens: Some(&cu(&padded)),
        }
        .bytes(),
    );
    let (code, rep) = compare(&[&a, &b]);
    assert_eq!(code, 1);
    let text = has(&rep, "packing", true);
    assert!(
        text.contains("2 of 3 packed sequences")
            && text.contains("sequence 1 at -8")
            && text.contains("sequence 2 at -22"),
        "{text}"
    );
}

#[test]
fn an_mtp_layer_with_the_backbones_routes_is_aliasing() {
    let d = dir("alias");
    let r = random_routes(T, L + 1, K, E, 13);
    let mut t = r.clone();
    for tok in 0..T {
        let row = tok * (L + 1) * K;
        let first: Vec<i32> = t[row..row + K].to_vec();
        t[row + L * K..row + (L + 1) * K].copy_from_slice(&first);
    }
    let a = generic(&d, "rollout.safetensors", &r, T, &layers(L + 1));
    let b = generic(&d, "trainer.safetensors", &t, T, &layers(L + 1));
    let (code, rep) = compare(&[&a, &b]);
    assert_eq!(code, 1);
    assert!(has(&rep, "aliasing", true).contains("trainer: layer 6 repeats layer 0 on 100.0%"));
    // Not taken for a mapping: the aliased layer stays paired with its own number and differs.
    assert!(!defects(&rep).contains(&"layer-mapping".to_string()));
    let last = &rep["measures"]["layers"][L];
    assert_eq!((last["trainer"].as_u64(), last["rollout"].as_u64()), (Some(L as u64), Some(L as u64)));
}

#[test]
fn the_same_sets_in_another_order_are_not_a_disagreement() {
    let d = dir("order");
    let r = random_routes(T, L, K, E, 14);
    let mut t = r.clone();
    t.chunks_exact_mut(K).for_each(|row| row.reverse());
    let a = generic(&d, "rollout.safetensors", &r, T, &layers(L));
    let b = generic(&d, "trainer.safetensors", &t, T, &layers(L));
    let (code, rep) = compare(&[&a, &b, "--max-disagreement", "0"]);
    assert_eq!(code, 0);
    assert!(has(&rep, "order", false).contains(&format!("{} of {} (token, layer) pairs", T * L, T * L)));
}

#[test]
fn a_replay_that_misses_layers_is_named() {
    let d = dir("replay");
    let r = random_routes(T, L, K, E, 15);
    // Layers 3..5 route on their own: as two routers of one model do, they differ on about
    // 10% of tokens (independent random routes there would be no pair of one model at all).
    let mut t = r.clone();
    let mut own = r.clone();
    flip(&mut own, K, E, 0.1, 16);
    for tok in 0..T {
        let at = (tok * L + 3) * K;
        t[at..at + 3 * K].copy_from_slice(&own[at..at + 3 * K]);
    }
    let a = generic(&d, "rollout.safetensors", &r, T, &layers(L));
    let b = generic(&d, "trainer.safetensors", &t, T, &layers(L));
    let (code, rep) = compare(&[&a, &b, "--max-disagreement", "0"]);
    assert_eq!(code, 1);
    let text = has(&rep, "replay-not-applied", true);
    assert!(text.contains("3 of 6 layers differ") && text.contains("layers from 3 on"), "{text}");
    assert!(!defects(&rep).contains(&"not-paired".to_string()));
    // Without a replay check the same pair is a measurement, not a defect.
    assert_eq!(compare(&[&a, &b]).0, 0);
}

#[test]
fn flips_at_near_ties_are_told_from_real_differences() {
    let d = dir("margins");
    let r = random_routes(T, L, K, E, 17);
    let mut t = r.clone();
    let changed = flip(&mut t, K, E, 0.05, 18);
    let mut logits = logits_for(&t, K, E, 19);
    for (row, (x, y)) in r.chunks_exact(K).zip(t.chunks_exact(K)).enumerate() {
        if x != y {
            near_tie(&mut logits[row * E..(row + 1) * E], y);
        }
    }
    let a = generic(&d, "rollout.safetensors", &r, T, &layers(L));
    let g = Generic {
        routes: &t,
        tokens: T,
        layers: &layers(L),
        k: K,
        logits: Some((&logits, E)),
        input_ids: None,
        cu_seqlens: None,
    };
    let b = put(&d, "trainer.safetensors", g.bytes());
    let (_, rep) = compare(&[&a, &b]);
    let m = &rep["measures"]["margins"];
    assert_eq!(m["side"], "trainer");
    assert_eq!(m["flips"].as_u64().unwrap() as usize, changed);
    assert_eq!(m["near_ties"], 1.0);
    assert!((m["median_flip"].as_f64().unwrap() - 0.001).abs() < 1e-4, "{m}");
    assert!(m["median_all"].as_f64().unwrap() > 0.5, "{m}");
    let text = String::from_utf8(run(&["routes", "compare", &a, &b]).stdout).unwrap();
    assert!(text.contains("flips sit at near-ties: numerics"), "{text}");
}

#[test]
fn every_format_and_the_chart() {
    let d = dir("formats");
    let r = random_routes(T, L, K, E, 20);
    let mut t = r.clone();
    flip(&mut t, K, E, 0.2, 21);
    let a = generic(&d, "rollout.safetensors", &r, T, &layers(L));
    let b = generic(&d, "trainer.safetensors", &t, T, &layers(L));
    let out = |fmt: &str| {
        let o = run(&["routes", "compare", &a, &b, "--max-disagreement", "0.01", "--format", fmt]);
        assert_eq!(o.status.code(), Some(1));
        String::from_utf8(o.stdout).unwrap()
    };
    let text = out("text");
    assert!(
        text.contains("router decisions that differ") && text.contains("~10.00%") && text.contains("FAIL ("),
        "{text}"
    );
    assert!(out("markdown").contains("| router decisions that differ |"));
    let junit = out("junit");
    assert!(junit.contains("<testcase name=\"max disagreement\">") && junit.contains("failures=\"1\""), "{junit}");
    assert!(out("github").starts_with("::error file="));
    // The same bytes every run.
    assert_eq!(out("json"), out("json"));
    for ext in ["png", "svg"] {
        let chart = d.join(format!("layers.{ext}"));
        let o = run(&["routes", "compare", &a, &b, "--chart", chart.to_str().unwrap()]);
        assert_eq!(o.status.code(), Some(0));
        assert!(std::fs::metadata(&chart).unwrap().len() > 1000);
    }
}

#[test]
fn show_summarises_load_per_layer() {
    let d = dir("show");
    let moe = random_routes(T, L, K, E, 22);
    let all = with_dense(&moe, T, L, 2, K);
    let config = put(&d, "config.json", config(L + 2, 2, E, K));
    let a = put(&d, "rollout.json", sglang(&all, None));
    let o = run(&["routes", "show", &a, "--config", &config]);
    assert_eq!(o.status.code(), Some(0));
    let text = String::from_utf8(o.stdout).unwrap();
    assert!(text.contains("     0        0         0   no routes (dense)"), "{text}");
    // The header, what was inferred (writer, dtype, layers, padding, missing, dense placeholders), the table.
    assert!(text.contains("writer: SGLang routed_experts") && text.contains("dtype: int32"), "{text}");
    assert_eq!(text.lines().count(), 2 + 5 + L + 2);
    let o = run(&["routes", "show", &a, "--config", &config, "--format", "json"]);
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    let load: u64 = v["layers"][2]["load"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).sum();
    assert_eq!(load as usize, T * K);
}

#[test]
fn npz_records_read_as_the_generic_one() {
    let d = dir("formats-in");
    let r = random_routes(T, L, K, E, 23);
    let a = generic(&d, "rollout.safetensors", &r, T, &layers(L));
    let z = put(
        &d,
        "record.npz",
        npz(&[("experts.npy", npy("<i8", &[T, L, K], &i64_bytes(&r.iter().map(|&x| x as i64).collect::<Vec<_>>())))]),
    );
    let (code, rep) = compare(&[&a, &z, "--max-disagreement", "0"]);
    assert_eq!(code, 0, "{z}: {:?}", kinds(&rep));
    assert_eq!(rep["measures"]["decisions"], T * L);
}

#[test]
fn bad_input_is_one_line_exit_2_and_nothing_written() {
    let d = dir("bad");
    let r = random_routes(T, L, K, E, 24);
    let good = generic(&d, "good.safetensors", &r, T, &layers(L));
    let config = put(&d, "config.json", config(L, 0, E, K));
    let chart = d.join("chart.png");
    let c = chart.to_str().unwrap();
    let full = npy("<i4", &[T, L, K], &i32_bytes(&r));
    let cases: Vec<(String, &str)> = vec![
        (
            put(&d, "truncated.npy", &full[..full.len() - 10]),
            "truncated: shape (256, 6, 4) of int32 needs 24576 bytes of data, the file has 24566",
        ),
        (
            put(&d, "float.npy", npy("<f4", &[T, L, K], &f32_bytes(&vec![1.0; T * L * K]))),
            "dtype float32 is not an integer type",
        ),
        (put(&d, "not64.json", r#"{"meta_info": {"routed_experts": "@@@@"}}"#), "`routed_experts` is not base64"),
        (
            put(&d, "short.json", sglang(&r[..7], None)),
            "28 bytes of int32 do not divide into rows of 6 layers x top-k 4",
        ),
        (
            put(&d, "big-id.npy", npy("<i4", &[1, L, K], &i32_bytes(&[70; L * K]))),
            "expert id 70 at token 0, layer index 0 is not below the config's 32 experts (nor a physical slot",
        ),
        (
            put(&d, "k2.npy", npy("<i4", &[T, L, 2], &i32_bytes(&r[..T * L * 2]))),
            "the config contradicts the record: top-k 4 in the config, 2 in the record",
        ),
        (
            put(&d, "layers.npy", npy("<i4", &[T, 5, K], &i32_bytes(&r[..T * 5 * K]))),
            "the config contradicts the record: 5 layers in the record; the config has 6 decoder layers, 6 of them MoE,",
        ),
        (
            put(&d, "neg.npy", npy("<i4", &[1, L, K], &i32_bytes(&[-7; L * K]))),
            "value -7 at flat index 0 is not an expert id or -1",
        ),
    ];
    for (path, want) in &cases {
        let err = bad(&["routes", "compare", path, &good, "--config", &config, "--chart", c]);
        assert!(err.contains(want), "{path}: {err}");
        assert!(!chart.exists(), "{path}: the chart was written");
    }
    // Tokens that differ between the records.
    let ids: Vec<i64> = (0..T as i64).collect();
    let mut other = ids.clone();
    other[17] = 999;
    let with = |name: &str, ids: &[i64]| {
        put(
            &d,
            name,
            Generic {
                routes: &r,
                tokens: T,
                layers: &layers(L),
                k: K,
                logits: None,
                input_ids: Some(ids),
                cu_seqlens: None,
            }
            .bytes(),
        )
    };
    let (a, b) = (with("ids-a.safetensors", &ids), with("ids-b.safetensors", &other));
    let err = bad(&["routes", "compare", &a, &b, "--chart", c]);
    assert!(
        err.contains("tokens do not match")
            && err.contains("position 17: token id 17 in the rollout, 999 in the trainer"),
        "{err}"
    );
    assert!(bad(&["routes", "compare", &good, &good, "--max-disagreement", "1.5"]).contains("between 0 and 1"));
    assert!(bad(&["routes", "compare", &good, &good, "--chart", "x.gif"]).contains(".png or .svg"));
    let sg = put(&d, "flat.json", sglang(&r, None));
    assert!(bad(&["routes", "show", &sg]).contains("give the model's config.json"));
    assert!(!chart.exists());
}

// ---------------------------------------------------------------------------------------------
// The threat model of routing records (docs/SECURITY.md): a record is read from the path given
// and nothing else; what it declares cannot make the reader allocate beyond --max-memory or
// wait without end.

/// Runs to completion within 20 s (every case here is refused in well under a second).
fn bounded(args: &[&str]) -> String {
    let start = std::time::Instant::now();
    let err = bad(args);
    assert!(start.elapsed().as_secs() < 20, "{args:?} took {:?}", start.elapsed());
    err
}

#[test]
fn threat_model_npy() {
    let d = dir("sec-npy");
    let good = generic(&d, "good.safetensors", &random_routes(4, L, K, E, 25), 4, &layers(L));
    // A header claiming 10^12 rows in a small file: refused by its length, nothing allocated.
    let huge = put(&d, "huge.npy", npy("<i4", &[1_000_000_000_000, L, K], &[0; 64]));
    assert!(bounded(&["routes", "compare", &huge, &good]).contains("truncated"));
    // A shape whose byte count overflows.
    let over = put(&d, "over.npy", npy("<i8", &[usize::MAX / 2, 4, 1], &[]));
    assert!(bounded(&["routes", "compare", &over, &good]).contains("overflows"));
    // A real array larger than the memory limit is read in place, a chunk at a time: compared
    // within the limit; a limit below what the comparison itself holds is refused in one line.
    let routes = random_routes(40_000, 60, 8, E, 26);
    let big = put(&d, "big.npy", npy("<i4", &[40_000, 60, 8], &i32_bytes(&routes)));
    let big_too = put(&d, "big-too.npy", npy("<i4", &[40_000, 60, 8], &i32_bytes(&routes)));
    let (code, report) = compare(&[&big, &big_too, "--max-memory", "64MiB"]);
    assert_eq!((code, report["measures"]["decisions_differ"].as_f64()), (0, Some(0.0)));
    assert!(
        bounded(&["routes", "compare", &big, &big_too, "--max-memory", "33MiB"]).contains("over the limit of 33.0 MiB")
    );
    // A file that never ends.
    assert!(bounded(&["routes", "compare", "/dev/zero", &good, "--max-memory", "64MiB"]).contains("larger than"));
}

#[test]
fn threat_model_npz() {
    let d = dir("sec-npz");
    let good = generic(&d, "good.safetensors", &random_routes(4, L, K, E, 26), 4, &layers(L));
    // Entry names are names inside the archive, never paths: a sibling `experts.npy` is not read.
    put(&d, "experts.npy", npy("<i4", &[4, L, K], &i32_bytes(&random_routes(4, L, K, E, 26))));
    let z = put(&d, "escape.npz", npz(&[("../experts.npy", npy("<i4", &[1], &[0; 4]))]));
    assert!(bounded(&["routes", "compare", &z, &good]).contains("no routing array (found: ../experts)"));
    // A compressed entry is refused by name, not inflated.
    let mut packed = npz(&[("experts.npy", npy("<i4", &[4, L, K], &i32_bytes(&random_routes(4, L, K, E, 26))))]);
    for sig in [&b"PK\x03\x04"[..], &b"PK\x01\x02"[..]] {
        let at = packed.windows(4).position(|w| w == sig).unwrap();
        let field = if sig[2] == 3 { at + 8 } else { at + 10 };
        packed[field] = 8;
    }
    let z = put(&d, "deflated.npz", packed);
    assert!(bounded(&["routes", "compare", &z, &good]).contains("np.savez, not np.savez_compressed"));
    // An entry declaring more than the memory limit is refused before it is read: 40 MiB of
    // its size in the central directory, over the 32 MiB that 64 MiB leaves to records. Under
    // a limit it fits, it is read, and refused for the 512 bytes it holds.
    let mut lying = npz(&[("experts.npy", npy("<i4", &[4, L, K], &i32_bytes(&random_routes(4, L, K, E, 26))))]);
    let at = lying.windows(4).position(|w| w == b"PK\x01\x02").unwrap();
    lying[at + 24..at + 28].copy_from_slice(&(40u32 << 20).to_le_bytes());
    let z = put(&d, "lying.npz", lying);
    assert_eq!(
        bounded(&["routes", "compare", &z, &good, "--max-memory", "64MiB"]),
        format!("error: reading {z} needs about 72.0 MiB of memory, over the limit of 64.0 MiB (--max-memory; the default is half of physical memory): use smaller sizes or raise the limit\n")
    );
    assert_eq!(
        bounded(&["routes", "compare", &z, &good, "--max-memory", "128MiB"]),
        format!("error: {z}: entry `experts.npy` declares {} bytes but holds only {}\n", 40 << 20, 128 + 4 * L * K * 4)
    );
}

#[test]
fn threat_model_safetensors() {
    let d = dir("sec-st");
    let good = generic(&d, "good.safetensors", &random_routes(4, L, K, E, 27), 4, &layers(L));
    // Metadata is data: a `layers` that names a file is not a list of layers.
    let t =
        Tensor { name: "experts", dtype: "I32", shape: vec![4, L, K], data: i32_bytes(&random_routes(4, L, K, E, 27)) };
    let meta = std::collections::BTreeMap::from([("layers", "/etc/passwd".to_string())]);
    let f = put(&d, "meta.safetensors", safetensors(&[t], &meta));
    assert!(bounded(&["routes", "compare", &f, &good]).contains("metadata `layers` is not a JSON list"));
    // Offsets past the data, and a header length beyond the file.
    let t = Tensor { name: "experts", dtype: "I32", shape: vec![1 << 40, L, K], data: vec![0; 16] };
    let f = put(&d, "offsets.safetensors", safetensors(&[t], &Default::default()));
    assert!(bounded(&["routes", "compare", &f, &good]).contains("not a safetensors file"));
    let mut header = (u64::MAX / 2).to_le_bytes().to_vec();
    header.extend_from_slice(b"{}");
    let f = put(&d, "header.safetensors", header);
    assert!(bounded(&["routes", "compare", &f, &good]).contains("not a safetensors file"));
    // Array names are names, never paths: an unknown name is no routing array.
    let routes = i32_bytes(&random_routes(4, 1, K, E, 28));
    let tensors = [
        Tensor { name: "layer.0", dtype: "I32", shape: vec![4, K], data: routes.clone() },
        Tensor { name: "layer.../../etc", dtype: "I32", shape: vec![4, K], data: routes },
    ];
    let f = put(&d, "megatron.safetensors", safetensors(&tensors, &Default::default()));
    assert!(bounded(&["routes", "compare", &f, &good]).contains("no routing array (found: layer.../../etc, layer.0)"));
}

#[test]
fn threat_model_sglang_and_config() {
    let d = dir("sec-json");
    let config = put(&d, "config.json", config(L, 0, E, K));
    let good = generic(&d, "good.safetensors", &random_routes(4, L, K, E, 30), 4, &layers(L));
    // A payload that names a file is not base64 of routes.
    let f = put(&d, "path.json", r#"{"meta_info": {"routed_experts": "file:///etc/passwd"}}"#);
    assert!(bounded(&["routes", "compare", &f, &good, "--config", &config]).contains("not base64"));
    // A response larger than the memory limit is refused while it is read.
    let big = sglang(&random_routes(40_000, L, K, E, 31), None);
    let f = put(&d, "big.json", big);
    assert!(bounded(&["routes", "compare", &f, &good, "--config", &config, "--max-memory", "40MiB"]).contains("limit"));
    // A config is data too: a path where a config object should be is not followed.
    let c = put(&d, "text.json", r#"{"text_config": "/etc/passwd", "num_hidden_layers": 2}"#);
    assert!(bounded(&["routes", "compare", &good, &good, "--config", &c]).contains("no expert count"));
    // A FIFO nobody writes reads as empty at once.
    let fifo = d.join("fifo.json");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    assert!(bounded(&["routes", "compare", fifo.to_str().unwrap(), &good, "--config", &config]).contains("error"));
}

#[test]
fn threat_model_trace_folder() {
    let d = dir("sec-trace");
    let good = generic(&d, "good.safetensors", &random_routes(4, L, K, E, 32), 4, &layers(L));
    // A rank file that is a symlink out of the folder is refused, its target never read.
    let folder = d.join("traces");
    std::fs::create_dir_all(&folder).unwrap();
    let secret = put(&d, "secret.txt", "TOP-SECRET");
    std::os::unix::fs::symlink(&secret, folder.join("router_trace_rank0.jsonl")).unwrap();
    let err = bounded(&["routes", "compare", &good, folder.to_str().unwrap()]);
    assert!(err.contains("a symlink in a trace folder is not followed") && !err.contains("TOP-SECRET"), "{err}");
    // A folder with no trace file names nothing else.
    let empty = d.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    put(&empty, "experts.npy", npy("<i4", &[4, L, K], &i32_bytes(&random_routes(4, L, K, E, 33))));
    assert!(bounded(&["routes", "compare", &good, empty.to_str().unwrap()])
        .contains("router_trace_rank{r}.jsonl files: none here"));
    // A trace larger than the memory limit is refused before it is parsed, though it is valid
    // JSON: the keys of NVIDIA/Megatron-LM@core_v0.19.0
    // megatron/core/transformer/moe/router_trace.py:291-305, ids ascending (:353), the first
    // line padded with JSON whitespace to 48 MiB in all, over the 8 MiB that 40 MiB leaves to
    // records.
    let routes = random_routes(4, L, K, E, 32);
    let lines: Vec<String> = (0..L)
        .map(|l| {
            let row = |t: usize| {
                let mut r = routes[(t * L + l) * K..][..K].to_vec();
                r.sort_unstable();
                r
            };
            let rows: Vec<Vec<i32>> = (0..4).map(row).collect();
            serde_json::json!({"step": 0, "stage": "pre_dispatch", "block": "decoder", "layer": l, "rank": 0,
                "num_tokens": 4, "topk": K, "top_indices": rows})
            .to_string()
                + "\n"
        })
        .collect();
    let size = 48 << 20;
    let pad = " ".repeat(size - lines.concat().len());
    let trace = lines[0].replacen("\"top_indices\":", &format!("\"top_indices\":{pad}"), 1) + &lines[1..].concat();
    assert_eq!(trace.len(), size);
    let f = put(&d, "router_trace_rank0.jsonl", trace);
    assert_eq!(
        bounded(&["routes", "compare", &good, &f, "--max-memory", "40MiB"]),
        format!("error: reading {f} needs about 80.0 MiB of memory, over the limit of 40.0 MiB (--max-memory; the default is half of physical memory): use smaller sizes or raise the limit\n")
    );
    // Under a limit that holds it, it is read, and it is the rollout's routing.
    let (code, report) = compare(&[&good, &f, "--max-memory", "256MiB"]);
    assert_eq!((code, report["measures"]["decisions_differ"].as_f64()), (0, Some(0.0)));
}

/// The same rollout read in place from an int8 `.npy` (a chunk at a time, its mapped pages
/// given back) and decoded whole from an int64 one (the path of JSON and wide types): the same
/// comparison, whatever the thread count. Padding rows, a zero-filled layer, a missing route
/// and flips span several chunks of every pass.
#[test]
fn a_record_read_in_place_in_chunks_equals_it_decoded_whole() {
    let d = dir("in-place");
    let t = 5000;
    let mut r = random_routes(t, L, K, E, 40);
    for tok in 0..t {
        r[tok * L * K..][..K].fill(0); // layer 0: dense, zero-filled
    }
    r[1000 * L * K..1040 * L * K].fill(0); // padding rows
    r[(3000 * L + 3) * K..][..K].fill(-1); // a missing route
    let mut trainer = r.clone();
    flip(&mut trainer, K, E, 0.05, 41);
    let b = generic(&d, "b.safetensors", &trainer, t, &layers(L));
    let narrow: Vec<u8> = r.iter().map(|&e| e as u8).collect();
    let wide: Vec<i64> = r.iter().map(|&e| e as i64).collect();
    let in_place = put(&d, "in-place.npy", npy("|i1", &[t, L, K], &narrow));
    let whole = put(&d, "whole.npy", npy("<i8", &[t, L, K], &i64_bytes(&wide)));
    let (code_a, mut a) = compare(&[&in_place, &b]);
    let (code_w, mut w) = compare(&[&whole, &b]);
    assert_eq!(code_a, code_w);
    assert_eq!(a["rollout"]["found"]["padding"]["all-zero"], 40);
    assert!(a["measures"]["decisions_differ"].as_f64().unwrap() > 0.04);
    for report in [&mut a, &mut w] {
        let found = report["rollout"]["found"].as_object_mut().unwrap();
        found.remove("dtype");
        report["rollout"].as_object_mut().unwrap().remove("path");
    }
    assert_eq!(a, w);
    let threads = |n: &str| {
        let out = Command::new(BIN)
            .args(["routes", "compare", &in_place, &b, "--format", "json"])
            .env("RAYON_NUM_THREADS", n)
            .output()
            .expect("run moe-audit");
        out.stdout
    };
    assert_eq!(threads("1"), threads("3"));
}
