//! MoE layers run expert-parallel behind `moe-audit/2` (handshake `ranks`, `output`): the
//! per-rank capacity Megatron-Core and DeepSpeed compute leaks where it predicts, a dropless
//! layer passes, outputs are compared, the placement's witness replays, and bad input and
//! failing ranks are one-line errors. The layer is `tests/it/routers/ranked_layer.py` (numpy).

use super::external::numpy;
use super::protocol2::run;
const LAYER: &str = "python3 tests/it/routers/ranked_layer.py";

/// `check --format json` of the layer on a batch of `batch`; (exit code, findings as (probe,
/// verdict, differs, note)).
fn audit(env: &[(&str, &str)], batch: &str) -> (i32, Vec<(String, String, String, String)>) {
    let args =
        ["check", "--router-cmd", LAYER, "--batch", batch, "--seq-len", "16", "--trials", "4", "--format", "json"];
    let out = run(&args, env);
    let code = out.status.code().unwrap();
    assert!(matches!(code, 0 | 1), "{env:?}: {}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let text = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_string();
    let findings = report["routers"][0]["findings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| (text(&f["probe"]), text(&f["verdict"]), text(&f["witness"]["differs"]), text(&f["note"])));
    (code, findings.collect())
}

fn verdicts(findings: &[(String, String, String, String)]) -> Vec<(&str, &str)> {
    findings.iter().map(|(p, v, _, _)| (p.as_str(), v.as_str())).collect()
}

#[test]
fn a_per_rank_capacity_leaks_where_it_predicts() {
    if !numpy() {
        return;
    }
    // Predicted before the run: C = ceil(T_local * k / E) per rank over its own tokens, so a
    // token's drop depends on later tokens (P, F), on the sequences sharing its rank (N, R) and
    // on which those are (L); the layer is deterministic and has one mode (D, S, M pass).
    let (code, findings) = audit(&[], "4");
    let want = [
        ("P", "leak"),
        ("F", "leak"),
        ("N", "leak"),
        ("R", "leak"),
        ("D", "pass"),
        ("S", "pass"),
        ("M", "pass"),
        ("L", "leak"),
    ];
    assert_eq!((code, verdicts(&findings)), (1, want.to_vec()), "{findings:?}");
    // L compares placements and names the ranks and sequences of its witness token: sequences
    // 0 and 1 share rank 0 in the default contiguous placement, 0 and 2 in the strided one.
    let (_, _, differs, note) = &findings[7];
    assert!(differs.contains("kept"), "{differs}");
    assert!(note.contains("default placement contiguous; strided: "), "{note}");
    assert!(note.contains("rank 0 with sequences 0,1 vs rank 0 with sequences 0,2"), "{note}");
}

#[test]
fn the_placement_witness_replays() {
    if !numpy() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("moe-audit-it-ranked-{}", std::process::id()));
    let dir_s = dir.to_str().unwrap();
    let args = ["check", "--router-cmd", LAYER, "--batch", "4", "--seq-len", "8", "--probes", "L"];
    assert_eq!(run(&[&args[..], &["--witness-dir", dir_s]].concat(), &[]).status.code(), Some(1));
    let witness = dir.join("ranked-L.json");
    let stored: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&witness).unwrap()).unwrap();
    assert_eq!(
        (stored["a"]["placement"].clone(), stored["b"]["placement"].clone()),
        (serde_json::json!([0, 0, 1, 1]), serde_json::json!([0, 1, 0, 1]))
    );
    let replay = |env: &[(&str, &str)]| {
        let out = run(&["replay", witness.to_str().unwrap(), "--router-cmd", LAYER], env);
        (out.status.code(), String::from_utf8_lossy(&out.stdout).to_string())
    };
    let (code, text) = replay(&[]);
    assert_eq!(code, Some(1), "{text}");
    assert!(text.starts_with("LEAK reproduced: router ranked, probe L (layout)"), "{text}");
    // The placement is sent again: the same layer dropless routes the token alike under both.
    assert_eq!(replay(&[("VARIANT", "dropless")]).0, Some(0));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_dropless_layer_passes_every_probe() {
    if !numpy() {
        return;
    }
    for (ranks, batch, default) in [("2", "4", "contiguous"), ("4", "8", "strided")] {
        let env = [("VARIANT", "dropless"), ("RANKS", ranks), ("DEFAULT", default)];
        let (code, findings) = audit(&env, batch);
        assert_eq!(code, 0, "{findings:?}");
        assert!(findings.iter().all(|(_, v, _, _)| v == "pass"), "{findings:?}");
        let note = &findings[7].3;
        assert!(note.contains(&format!("default placement {default}")), "{note}");
    }
}

#[test]
fn an_output_that_sees_batch_mates_leaks_through_the_output() {
    if !numpy() {
        return;
    }
    // Dropless routes, and each output adds its rank's mean hidden row: no route moves, every
    // probe that changes a token's batch-mates sees the output move.
    let (code, findings) = audit(&[("VARIANT", "meanrow")], "4");
    assert_eq!(code, 1);
    for (probe, verdict, differs, _) in &findings {
        let leaks = ["P", "F", "N", "R", "L"].contains(&probe.as_str());
        assert_eq!(verdict, if leaks { "leak" } else { "pass" }, "{findings:?}");
        assert_eq!(differs, if leaks { "output" } else { "" }, "{findings:?}");
    }
}

#[test]
fn bad_ranked_input_is_one_line() {
    if !numpy() {
        return;
    }
    let cases: &[(&str, &str, &str)] = &[
        ("HS", r#"{"ranks": 0}"#, "handshake: ranks 0 is not from 1 to 1024"),
        ("HS", r#"{"protocol": "moe-audit/1", "responses": null}"#, "handshake: `ranks` needs protocol `moe-audit/2`"),
        (
            "HS",
            r#"{"output": "float64"}"#,
            "unknown variant `float64`, expected one of `float32`, `bfloat16`, `float16`",
        ),
        ("HS", r#"{"responses": "json"}"#, "handshake: `output` needs input `hidden` and responses `binary`"),
        ("HS", r#"{"weights": "xyz"}"#, "handshake: weights `xyz` is not a hex string of 1 to 128 digits"),
        ("BAD", "no-placement", "no `placement`: a router with `ranks` names the rank of each sequence"),
        ("BAD", "unbalanced", "placement puts 2 sequences on rank 0, a balanced one 1 of 2 on each of 2 ranks"),
        ("BAD", "other-placement", "placement [0, 0, 1, 1] is not the requested [0, 1, 0, 1]"),
        ("BAD", "slots", "capacity scope `rank` has 2 ranks, slots has 3 entries"),
        ("BAD", "nonfinite", "token 0 (batch 0, position 0): output row is not finite"),
        ("BAD", "short", "2816 bytes, 128 tokens and 256 routes and their output rows of 8 take 6912"),
    ];
    let args = ["check", "--router-cmd", LAYER, "--batch", "4", "--seq-len", "4", "--probes", "L"];
    for &(var, value, want) in cases {
        let out = run(&args, &[(var, value)]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{value}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{value}: {err}");
        assert!(err.contains(want), "{value}: {err}");
    }
    // A batch the ranks do not divide is refused before any probe.
    let out = run(&["check", "--router-cmd", LAYER, "--batch", "3"], &[]);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        "error: --batch 3 is not a multiple of the 2 ranks router `ranked` runs over (each rank takes batch/ranks sequences)\n"
    );
}

#[test]
fn a_failing_rank_is_quoted_before_the_launcher_summary() {
    if !numpy() {
        return;
    }
    // The layer's rank line comes before the launcher's last line; MOE_AUDIT_TIMEOUT carries
    // --timeout in whole seconds (3.5 -> 3).
    let args = ["check", "--router-cmd", LAYER, "--batch", "4", "--seq-len", "4", "--timeout", "3.5"];
    for (fault, want) in [
        ("rank", "its stderr ends: moe-audit: rank 1: RuntimeError: expert 3 overflowed"),
        ("hang", "its stderr ends: moe-audit: rank 1: did not answer call 2 within 3 s"),
    ] {
        let out = run(&args, &[("FAULT", fault)]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{err}");
        assert!(err.contains("before answering request 2") && err.trim_end().ends_with(want), "{fault}: {err}");
    }
}

/// The layer at EP 1, another launch of the same script (same weights, same routing math):
/// `RANKS=1` declares one rank, `RANKS=0` no `ranks` at all (an in-process layer).
const EP1: &str = "RANKS=1 python3 tests/it/routers/ranked_layer.py";
const EP1_UNRANKED: &str = "RANKS=0 python3 tests/it/routers/ranked_layer.py";

/// `check --probes L --format json` of `router` with `layouts`; (exit code, L's finding).
fn layout_audit(router: &str, layouts: &[&str], env: &[(&str, &str)]) -> (i32, serde_json::Value) {
    let mut args = vec!["check", "--router-cmd", router, "--batch", "4", "--seq-len", "16", "--probes", "L"];
    for l in layouts {
        args.extend(["--layout-cmd", l]);
    }
    args.extend(["--format", "json"]);
    let out = run(&args, env);
    let code = out.status.code().unwrap();
    assert!(matches!(code, 0 | 1), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    (code, report["routers"][0]["findings"][0].clone())
}

#[test]
fn a_per_rank_capacity_leaks_across_expert_parallel_sizes() {
    if !numpy() {
        return;
    }
    // Predicted before the run: at EP 1 the capacity is ceil(64 * 2 / 4) = 32 over all 64
    // tokens, at EP 2 ceil(32 * 2 / 4) = 16 per rank over its 32: an expert keeps other routes
    // at the two sizes, so L leaks on the comparison of the launches alone (at EP 1 there is
    // no other placement to compare).
    let (code, l) = layout_audit(EP1, &[LAYER], &[]);
    assert_eq!((code, l["verdict"].as_str()), (1, Some("leak")), "{l}");
    let note = l["note"].as_str().unwrap();
    assert!(note.contains("no other placement of 4 sequences over 1 ranks"), "{note}");
    let across = format!("EP 2 (`{LAYER}`) vs EP 1: {} tokens differ", l["affected"]);
    assert!(l["affected"].as_u64().unwrap() > 0 && note.contains(&across), "{note}");
    assert!(l["witness"]["differs"].as_str().unwrap().contains("kept"), "{l}");
    // Audited at EP 2 with both EP 1 launches: their tokens count with the placements'.
    let (code, l) = layout_audit(LAYER, &[EP1, EP1_UNRANKED], &[]);
    assert_eq!((code, l["verdict"].as_str()), (1, Some("leak")), "{l}");
    let note = l["note"].as_str().unwrap();
    for ep1 in [EP1, EP1_UNRANKED] {
        assert!(note.contains(&format!("EP 1 (`{ep1}`) vs EP 2: ")), "{note}");
    }
    let counted = |what: &str| note.split(&format!("{what}: ")).nth(1).unwrap().split(' ').next().unwrap().to_string();
    // The in-process layer states its capacity for the whole call and no placement: the same
    // decisions as the launch at one rank.
    assert_eq!(counted(&format!("EP 1 (`{EP1}`) vs EP 2")), counted(&format!("EP 1 (`{EP1_UNRANKED}`) vs EP 2")));
}

#[test]
fn a_dropless_layer_passes_at_every_expert_parallel_size() {
    if !numpy() {
        return;
    }
    // Predicted: dropless routing and the output of each token are per token: every probe
    // passes, and L compares the EP 1 launches (one named otherwise: the name may differ).
    let renamed = format!("HS='{{\"name\": \"ranked-ep1\"}}' {EP1}");
    let env = [("VARIANT", "dropless")];
    let args = [
        "check",
        "--router-cmd",
        LAYER,
        "--layout-cmd",
        &renamed,
        "--layout-cmd",
        EP1_UNRANKED,
        "--batch",
        "4",
        "--seq-len",
        "16",
        "--trials",
        "4",
        "--format",
        "json",
    ];
    let out = run(&args, &env);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let findings = report["routers"][0]["findings"].as_array().unwrap();
    assert!(findings.iter().all(|f| f["verdict"] == "pass"), "{findings:?}");
    let note = findings[7]["note"].as_str().unwrap();
    // Both launches compared (a long command is shortened in the note).
    assert_eq!(note.matches("EP 1 (`").count(), 2, "{note}");
    assert_eq!(note.matches(") vs EP 2: 0 tokens differ").count(), 2, "{note}");
}

#[test]
fn the_witness_across_launches_replays_with_both_commands() {
    if !numpy() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("moe-audit-it-layout-{}", std::process::id()));
    let dir_s = dir.to_str().unwrap();
    let args = ["check", "--router-cmd", EP1, "--layout-cmd", LAYER, "--batch", "4", "--seq-len", "8"];
    let out = run(&[&args[..], &["--probes", "L", "--witness-dir", dir_s]].concat(), &[]);
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stderr));
    let witness = dir.join("ranked-L.json");
    let stored: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&witness).unwrap()).unwrap();
    assert_eq!(
        (stored["layout"]["command"].as_str(), &stored["layout"]["handshake"]["ranks"]),
        (Some(LAYER), &2.into())
    );
    let w = witness.to_str().unwrap();
    let replay = |extra: &[&str], env: &[(&str, &str)]| {
        let out = run(&[&["replay", w, "--router-cmd", EP1][..], extra].concat(), env);
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).to_string(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    let (code, text, err) = replay(&["--layout-cmd", LAYER], &[]);
    assert_eq!(code, Some(1), "{text}{err}");
    assert!(text.starts_with("LEAK reproduced: router ranked, probe L (layout)"), "{text}");
    // The same two launches dropless route the token alike.
    assert_eq!(replay(&["--layout-cmd", LAYER], &[("VARIANT", "dropless")]).0, Some(0));
    // The witness names the other launch but never runs it: without --layout-cmd, one line.
    let (code, _, err) = replay(&[], &[]);
    assert_eq!((code, err.lines().count()), (Some(2), 1), "{err}");
    assert!(err.contains(&format!("replay it with --layout-cmd \"{LAYER}\"")), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn layout_launches_of_another_layer_or_without_a_router_are_one_line() {
    if !numpy() {
        return;
    }
    let hs = |json: &str| format!("HS='{json}' {LAYER}");
    let (experts, weights, output) =
        (hs(r#"{"experts": 8}"#), hs(r#"{"weights": "abcd"}"#), hs(r#"{"output": "bfloat16"}"#));
    let ep4 = format!("RANKS=4 {LAYER}");
    let cases = [
        (
            vec!["--router-cmd", LAYER, "--layout-cmd", &experts],
            "the layers differ: `experts` 8 here, 4 in router `ranked`",
        ),
        (
            vec!["--router-cmd", LAYER, "--layout-cmd", &weights],
            r#"the layers differ: `weights` "abcd" here, "00ff" in router `ranked`"#,
        ),
        (vec!["--router-cmd", LAYER, "--layout-cmd", &output], "`output` \"bfloat16\" here, \"float32\""),
        (vec!["mixtral", "--layout-cmd", LAYER], "required arguments were not provided: --router-cmd"),
        (
            vec!["--router-cmd", LAYER, "--layout-cmd", &ep4, "--batch", "6"],
            "--batch 6 is not a multiple of the 4 ranks layout launch `ranked` (`RANKS=4 ",
        ),
        (vec!["--router-cmd", LAYER, "--layout-cmd", EP1, "--probes", "P"], "--layout-cmd feeds the layout probe L"),
    ];
    for (args, want) in &cases {
        let out = run(&[&["check", "--seq-len", "4"][..], args].concat(), &[]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
    }
}
