//! What `moe-audit routes compare` costs at the size: two records of 32,768 tokens ×
//! 60 layers × top-8 (int32, 63 MB each), the trainer's differing on 10% of decisions.
//! Times reading each format, the comparison (alignment, diagnoses, measures) and the whole run,
//! against reading the same bytes with `std::fs::read` (the floor any reader pays); prints the
//! memory the run took from its `--max-memory` budget.
//!
//! `cargo run --release --example routes_cost [-- --reps 5 --tokens 32768 --layers 60]`

#[path = "common/route_files.rs"]
mod route_files;
#[path = "common/timing.rs"]
mod timing;

use moe_audit::records::{self, Budget, CompareOptions, Layout};
use route_files::*;
use std::time::Instant;
use timing::{flag, median, ms, reps};

fn main() -> Result<(), String> {
    let reps = reps(5)?;
    let num = |name: &str, default: usize| -> Result<usize, String> {
        flag(name)?.map_or(Ok(default), |v| v.parse().map_err(|e| format!("{name} {v}: {e}")))
    };
    let (tokens, layers, k, experts) = (num("--tokens", 32_768)?, num("--layers", 60)?, 8, 256);
    let dir = std::env::temp_dir().join(format!("moe-audit-routes-cost-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let rollout = random_routes(tokens, layers, k, experts, 1);
    let mut trainer = rollout.clone();
    let flipped = flip(&mut trainer, k, experts, 0.1, 2);
    let numbers: Vec<usize> = (0..layers).collect();
    let write = |name: &str, bytes: Vec<u8>| {
        let p = dir.join(name);
        std::fs::write(&p, bytes).map(|_| p).map_err(|e| e.to_string())
    };
    let npy_path = write("rollout.npy", npy("<i4", &[tokens, layers, k], &i32_bytes(&rollout)))?;
    let json_path = write("rollout.json", sglang(&rollout, None).into_bytes())?;
    let g = Generic { routes: &trainer, tokens, layers: &numbers, k, logits: None, input_ids: None, cu_seqlens: None };
    let st_path = write("trainer.safetensors", g.bytes())?;
    let config = serde_json::from_str(&config(layers, 0, experts, k)).map_err(|e| e.to_string())?;
    let layout = Layout::from_json(&config)?;
    let limit = moe_audit::MemoryBudget::new(1 << 30);
    println!(
        "{tokens} tokens x {layers} layers x top-{k} ({} MB per record), {experts} experts, {flipped} decisions flipped; {reps} reps, median",
        tokens * layers * k * 4 / 1_000_000
    );

    let time = |what: &str, f: &mut dyn FnMut() -> Result<(), String>| -> Result<f64, String> {
        let mut runs = Vec::new();
        for _ in 0..reps {
            let start = Instant::now();
            f()?;
            runs.push(start.elapsed());
        }
        let t = ms(median(runs));
        println!("{what:<52} {t:>9.1} ms");
        Ok(t)
    };
    let err = |e: moe_audit::Error| e.to_string();
    time("std::fs::read of rollout.npy (floor)", &mut || {
        std::fs::read(&npy_path).map(drop).map_err(|e| e.to_string())
    })?;
    time("read rollout.npy", &mut || {
        records::load(&npy_path, Some(&layout), None, &mut Budget::new(limit)).map(drop).map_err(err)
    })?;
    time("read trainer.safetensors", &mut || {
        records::load(&st_path, Some(&layout), None, &mut Budget::new(limit)).map(drop).map_err(err)
    })?;
    time("read rollout.json (SGLang, base64)", &mut || {
        records::load(&json_path, Some(&layout), None, &mut Budget::new(limit)).map(drop).map_err(err)
    })?;
    let a = records::load(&npy_path, Some(&layout), None, &mut Budget::new(limit)).map_err(err)?;
    let b = records::load(&st_path, Some(&layout), None, &mut Budget::new(limit)).map_err(err)?;
    let options = CompareOptions { max_disagreement: Some(0.2) };
    let mut used = 0;
    time("compare (align + diagnose + measure)", &mut || {
        let mut budget = Budget::new(limit);
        let c = records::compare(&a, &b, Some(&layout), &options, &mut budget).map_err(err)?;
        assert!((c.measures.decisions_differ - flipped as f64 / (tokens * layers) as f64).abs() < 1e-12);
        used = limit.bytes() - budget.left();
        Ok(())
    })?;
    let mut whole = 0;
    time("read both + compare (what the CLI does)", &mut || {
        let mut budget = Budget::new(limit);
        let a = records::load(&npy_path, Some(&layout), None, &mut budget).map_err(err)?;
        let b = records::load(&st_path, Some(&layout), None, &mut budget).map_err(err)?;
        records::compare(&a, &b, Some(&layout), &options, &mut budget).map_err(err)?;
        whole = limit.bytes() - budget.left();
        Ok(())
    })?;
    println!(
        "budget taken from --max-memory: compare {} MiB, read both + compare {} MiB (32 MiB of it the process allowance)",
        used >> 20,
        whole >> 20
    );
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
