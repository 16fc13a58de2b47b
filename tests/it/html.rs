//! `--format html`: the three reports (a router audit, a whole-model audit, a records
//! comparison) as self-contained pages. Their structure is asserted here (every verdict and
//! number of the JSON report on the page, text escaped, nothing fetched, the size at default
//! sizes), then a real browser opens each: headless Chromium (Debian's `chromium`) must log no
//! console error, lay out every chart with each of its marks, draw as many lane cells of each
//! kind as the records hold, draw a screenshot that is not blank, and hold the verdicts in its DOM.

use super::routes::route_files::*;
use moe_audit::records::LANES;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_moe-audit");
/// A router that passes, one with a capacity shared by the batch, one balanced over the batch
/// (its M witness routes one call twice).
const ROUTERS: &[&str] = &["check", "mixtral", "megatron-probs", "sinkhorn"];
/// "A few MB at the default sizes": each page stays well under.
const MAX_BYTES: usize = 2 << 20;

fn dir(test: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("moe-audit-it-html-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

/// Runs `args` with `--format html --output <d>/<name>.html` (nothing on stdout) and with
/// `--format json`; returns the exit code, the page and the JSON report.
fn both(d: &Path, name: &str, args: &[&str]) -> (i32, String, Value) {
    let page = d.join(format!("{name}.html"));
    let mut html_args = args.to_vec();
    html_args.extend(["--format", "html", "--output", page.to_str().expect("utf-8")]);
    let out = Command::new(BIN).args(&html_args).output().expect("run moe-audit");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(matches!(out.status.code(), Some(0 | 1)), "{html_args:?}: {:?} {err}", out.status);
    assert!(out.stdout.is_empty(), "{html_args:?} wrote to stdout");
    let html = std::fs::read_to_string(&page).expect("the page");
    let mut json_args = args.to_vec();
    json_args.extend(["--format", "json"]);
    let json = Command::new(BIN).args(&json_args).output().expect("run moe-audit");
    assert_eq!(json.status.code(), out.status.code(), "{json_args:?}");
    let report = serde_json::from_slice(&json.stdout).expect("a json report");
    (out.status.code().expect("an exit code"), html, report)
}

/// One document, nothing fetched or run: no script, no link, no source, no URL at all.
fn self_contained(html: &str) {
    assert!(html.starts_with("<!DOCTYPE html>\n<html lang=\"en\">"), "{}", &html[..80.min(html.len())]);
    assert!(html.ends_with("</body>\n</html>\n"));
    assert!(html.len() < MAX_BYTES, "{} bytes", html.len());
    let lower = html.to_ascii_lowercase();
    for banned in ["http", "<script", "<link", "src=", "url(", "@import", "<img", "<iframe", "<object"] {
        assert!(!lower.contains(banned), "the page holds `{banned}`");
    }
    assert_eq!(html.matches("<svg").count(), html.matches("</svg>").count());
    assert_eq!(html.matches("<table").count(), html.matches("</table>").count());
}

fn pct(x: &Value, digits: usize) -> String {
    format!("{:.digits$}%", 100.0 * x.as_f64().expect("a share"))
}

/// Words of the text report's verdicts.
fn word(verdict: &Value) -> &'static str {
    match verdict.as_str().expect("a verdict") {
        "pass" => "pass",
        "leak" => "LEAK",
        "not-applicable" => "n/a",
        "inconclusive" => "inconclusive",
        "drift" => "drift",
        v => panic!("verdict {v}"),
    }
}

/// A page of the browser test: what its DOM holds, and the lane cells it draws (near-tie, real).
struct Page {
    kind: &'static str,
    path: PathBuf,
    texts: Vec<String>,
    lane_cells: (usize, usize),
}

/// The three pages of the browser test, written once.
fn pages() -> &'static [Page] {
    static PAGES: std::sync::OnceLock<Vec<Page>> = std::sync::OnceLock::new();
    PAGES.get_or_init(|| {
        let d = dir("pages");
        let (_, _, report) = both(&d, "check", ROUTERS);
        let (_, _, model_report) = both(&d, "model", &["model", "switch", "--non-causal", "2"]);
        let (routes, _, flips) = routes_pair(&d);
        let mut expect_check = vec!["megatron-probs".to_string(), "LEAK".into(), "Load balance against leaks".into()];
        expect_check.push(pct(&report["routers"][1]["findings"][0]["rate"], 1));
        expect_check.push("M mode: witness".into());
        let expect_model = vec![
            "leaks under probe".to_string(),
            format!("{}", model_report["findings"][0]["cases"]),
            "layer 3".into(),
        ];
        vec![
            Page { kind: "check", path: d.join("check.html"), texts: expect_check, lane_cells: (0, 0) },
            Page { kind: "model", path: d.join("model.html"), texts: expect_model, lane_cells: (0, 0) },
            Page {
                kind: "routes",
                path: routes,
                texts: vec!["Flips per token".into(), "near-tie".into(), "one row short".into()],
                lane_cells: (flips.lane_near, flips.lane_real),
            },
        ]
    })
}

#[test]
fn a_router_audit_holds_every_verdict_rate_witness_and_load_figure() {
    let d = dir("check");
    let (code, html, report) = both(&d, "check", ROUTERS);
    assert_eq!(code, 1, "megatron-probs leaks");
    self_contained(&html);
    assert!(html.contains("<div class=\"summary leak\">2 of 3 router(s) leak: megatron-probs, sinkhorn</div>"));
    for r in report["routers"].as_array().expect("routers") {
        let name = r["router"].as_str().expect("a name");
        assert!(html.contains(&format!(">{name}</h2>")), "{name}");
        assert!(html.contains(&format!("={:.3}", r["load"]["max_over_mean_load"].as_f64().unwrap()).replace('=', ">")));
        assert!(html.contains(&format!(">{}<", pct(&r["load"]["drop_rate"], 1))));
        for f in r["findings"].as_array().expect("findings") {
            assert!(html.contains(&format!(">{}</span>", word(&f["verdict"]))), "{name} {}", f["probe"]);
            if f["verdict"] != "not-applicable" {
                assert!(html.contains(&format!(">{}<", pct(&f["rate"], 1))), "{name} {} rate", f["probe"]);
            }
            if let Some(fix) = f["explain"]["fix"].as_str() {
                assert!(html.contains(&crate_xml(fix)), "{name} {} fix", f["probe"]);
            }
            if let Some(w) = f["witness"].as_object() {
                let header = format!("witness (sequence {}, position {};", w["token_a"]["batch"], w["token_a"]["pos"]);
                assert!(html.contains(&header), "{header}");
                // The token's first expert before and after, in its table.
                for side in ["before", "after"] {
                    let e = &w[side]["routes"][0]["expert"];
                    assert!(html.contains(&format!("<td class=\"n\">{e}</td>")), "{side} expert {e}");
                }
            }
        }
    }
    // Two token strips per witness (D and M route one call twice: one strip).
    let findings = report["routers"].as_array().unwrap().iter().flat_map(|r| r["findings"].as_array().unwrap());
    let witnesses = findings.filter(|f| f["witness"].is_object());
    let strips: usize = witnesses.map(|f| if matches!(f["probe"].as_str(), Some("D" | "M")) { 1 } else { 2 }).sum();
    assert!(strips >= 4);
    assert_eq!(html.matches("(sequence ").count() - html.matches(": witness (sequence").count(), strips);
}

/// What the page's text holds as the escaped string (`names::xml`).
fn crate_xml(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;").replace('\'', "&apos;")
}

#[test]
fn names_and_notes_are_escaped() {
    let d = dir("escape");
    let toml = d.join("evil.toml");
    std::fs::write(
        &toml,
        "name = \"<script>alert(1)</script> & 'q' \\\"r\\\"\"\nkind = \"token-choice\"\nexperts = 8\ntop_k = 2\nscore = \"softmax-post\"\n[capacity]\nfactor = 1.0\n",
    )
    .expect("write");
    let (_, html, _) = both(&d, "evil", &["check", toml.to_str().unwrap(), "--probes", "P,F", "--seq-len", "16"]);
    self_contained(&html);
    assert!(html.contains("&lt;script&gt;alert(1)&lt;/script&gt; &amp; &apos;q&apos; &quot;r&quot;"), "{html}");
}

#[test]
fn a_whole_model_audit_holds_its_heatmaps_drift_and_generation_per_layer() {
    let d = dir("model");
    let (code, html, report) = both(&d, "model", &["model", "switch", "--non-causal", "2"]);
    assert_eq!(code, 1, "a non-causal layer leaks");
    self_contained(&html);
    for f in report["findings"].as_array().expect("findings") {
        let probe = f["probe"].as_str().unwrap();
        assert!(html.contains(&format!("id=\"probe-{probe}\"")) || f["verdict"] == "not-applicable", "{probe}");
        for t in f["layers"].as_array().unwrap() {
            if f["verdict"] != "not-applicable" {
                assert!(html.contains(&format!(">{}<", pct(&t["rate"], 2))), "{probe} layer {}", t["layer"]);
            }
        }
        let first: u64 = f["layers"].as_array().unwrap().iter().map(|t| t["first"].as_u64().unwrap()).sum();
        let carried: u64 = f["layers"].as_array().unwrap().iter().map(|t| t["inherited"].as_u64().unwrap()).sum();
        // The heatmaps' cells hold what the per-layer counts hold, position by position.
        if f["verdict"] == "leak" && first > 0 {
            let section = html.split(&format!("id=\"probe-{probe}\"")).nth(1).unwrap().split("<h2").next().unwrap();
            let count = |what: &str| -> u64 {
                section
                    .split(&format!(" token(s) {what}"))
                    .filter_map(|s| s.rsplit(": ").next()?.parse::<u64>().ok())
                    .sum()
            };
            assert_eq!(count("changed first here"), first, "{probe}");
            assert_eq!(count("carried a change from before"), carried, "{probe}");
        }
    }
    assert!(html.contains("Output drift per position"));
    assert!(html.contains("Generation against training, per layer"));
    assert!(html.contains("Witness: sequence "));
}

/// The flips of a records comparison, counted from the arrays it compares: all of them, and
/// those its lanes draw.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Flips {
    /// Decisions that differ, and how many of them are near-ties.
    all: usize,
    near: usize,
    /// Tokens that differ in at least one layer.
    tokens: usize,
    /// The lanes: the first `LANES` tokens that differ (aligned order), every flip of each,
    /// near-tie or real.
    lanes: usize,
    lane_near: usize,
    lane_real: usize,
}

/// A rollout one row short (a note) against a trainer with logits whose flips are near-ties on
/// half the flipped rows and real on the others; the page, the JSON report and its flips.
fn routes_pair(d: &Path) -> (PathBuf, Value, Flips) {
    let (t, l, k, e) = (256, 6, 4, 32);
    let r = random_routes(t, l, k, e, 17);
    let mut tr = r.clone();
    flip(&mut tr, k, e, 0.05, 18);
    let mut logits = logits_for(&tr, k, e, 19);
    let differs = |row: usize| r[row * k..][..k] != tr[row * k..][..k];
    // Near-ties on every other flipped row: margin 0.001, against 0.8 to 2.7 for any other row
    // (`logits_for`), so the tenth of the median margin, the report's threshold, parts them.
    let near_rows: Vec<usize> = (0..t * l).filter(|&row| differs(row)).step_by(2).collect();
    for &row in &near_rows {
        near_tie(&mut logits[row * e..(row + 1) * e], &tr[row * k..(row + 1) * k]);
    }
    // The comparison sees the rollout's t - 1 rows; a token's flips are its rows that differ.
    let tokens: Vec<Vec<bool>> = (0..t - 1)
        .map(|tok| (tok * l..(tok + 1) * l).filter(|&row| differs(row)).map(|row| near_rows.contains(&row)).collect())
        .filter(|flips: &Vec<bool>| !flips.is_empty())
        .collect();
    let count = |tokens: &[Vec<bool>], near: bool| tokens.iter().flatten().filter(|&&n| n == near).count();
    let lanes = &tokens[..tokens.len().min(LANES)];
    let flips = Flips {
        all: tokens.iter().map(Vec::len).sum(),
        near: count(&tokens, true),
        tokens: tokens.len(),
        lanes: lanes.len(),
        lane_near: count(lanes, true),
        lane_real: count(lanes, false),
    };
    // The rollout as an engine records it: rows [0, seqlen-1), one short of the trainer's
    // (sgl-project/sglang@v0.5.10: python/sglang/srt/layers/moe/routed_experts_capturer.py:78,
    // :211; tests/it/routes_writers.rs builds SGLang's own format), here as a bare int32 npy.
    let a = d.join("rollout.npy");
    std::fs::write(&a, npy("<i4", &[t - 1, l, k], &i32_bytes(&r[..(t - 1) * l * k]))).expect("write");
    let layers: Vec<usize> = (0..l).collect();
    let g = Generic {
        routes: &tr,
        tokens: t,
        layers: &layers,
        k,
        logits: Some((&logits, e)),
        input_ids: None,
        cu_seqlens: None,
    };
    let b = d.join("trainer.safetensors");
    std::fs::write(&b, g.bytes()).expect("write");
    let (code, html, report) = both(d, "routes", &["routes", "compare", a.to_str().unwrap(), b.to_str().unwrap()]);
    assert_eq!(code, 0);
    std::fs::write(d.join("routes.html"), &html).expect("write");
    (d.join("routes.html"), report, flips)
}

#[test]
fn a_records_comparison_shows_diagnoses_layers_and_flips_per_token() {
    let d = dir("routes");
    let (page, report, flips) = routes_pair(&d);
    let html = std::fs::read_to_string(page).expect("the page");
    self_contained(&html);
    let m = &report["measures"];
    // Diagnoses first, then the headline, the layers, the lanes.
    let at = |s: &str| html.find(s).unwrap_or_else(|| panic!("{s} missing"));
    assert!(at("<h2>Diagnoses</h2>") < at("<h2>Disagreement</h2>"));
    assert!(at("<h2>Disagreement</h2>") < at("<h3>Per layer") && at("<h3>Per layer") < at("<h2>Flips per token</h2>"));
    for diag in report["diagnoses"].as_array().unwrap() {
        assert!(html.contains(&crate_xml(diag["found"].as_str().unwrap())), "{diag}");
    }
    assert!(html.contains(&format!(">{}<", pct(&m["decisions_differ"], 2))));
    assert!(html.contains(&format!(">{}<", pct(&m["tokens_differ"], 2))));
    for layer in m["layers"].as_array().unwrap() {
        assert!(html.contains(&format!(">{}<", pct(&layer["differ"], 2))), "{layer}");
    }
    // The report counts the fixture's flips and near-ties; more tokens differ than lanes hold,
    // so the lanes are the first of them.
    let near = (m["margins"]["near_ties"].as_f64().unwrap() * flips.all as f64).round() as usize;
    assert_eq!((m["margins"]["flips"].as_u64(), near), (Some(flips.all as u64), flips.near));
    assert!(flips.tokens > LANES && flips.lane_near > 0 && flips.lane_real > 0, "{flips:?}");
    // Lanes: one per drawn token, a near-tie cell per near-tie among their flips, the rest real.
    assert_eq!(html.matches("<text x=\"0\" y=").count(), flips.lanes);
    let cells = |kind: &str| html.matches(&format!(": {kind}, margin ")).count();
    assert_eq!((cells("near-tie"), cells("real flip")), (flips.lane_near, flips.lane_real));
}

#[test]
fn text_formats_are_unchanged_by_the_output_flag_of_routes_compare() {
    let d = dir("routes-output");
    let (a, b) = (d.join("a.npy"), d.join("b.npy"));
    let r = random_routes(64, 2, 2, 8, 3);
    std::fs::write(&a, npy("<i4", &[64, 2, 2], &i32_bytes(&r))).unwrap();
    std::fs::write(&b, npy("<i4", &[64, 2, 2], &i32_bytes(&r))).unwrap();
    let args = ["routes", "compare", a.to_str().unwrap(), b.to_str().unwrap()];
    let stdout = Command::new(BIN).args(args).output().unwrap();
    let file = d.join("report.txt");
    let written = Command::new(BIN).args(args).args(["--output", file.to_str().unwrap()]).output().unwrap();
    assert!(written.stdout.is_empty());
    assert_eq!(std::fs::read(file).unwrap(), stdout.stdout);
}

/// Headless Chromium, or why not: skipped (with a line saying so) only outside CI.
fn chromium() -> Option<&'static str> {
    let found = ["chromium", "chromium-browser", "google-chrome"]
        .into_iter()
        .find(|b| Command::new(b).arg("--version").output().is_ok_and(|o| o.status.success()));
    if found.is_none() {
        assert!(std::env::var_os("CI").is_none(), "CI is set and no chromium is installed (apt-get install chromium)");
        eprintln!("skipped: no chromium on PATH (Debian: apt-get install chromium); CI=1 makes this a failure");
    }
    found
}

/// A headless browser driven over the DevTools protocol on a pipe (`--remote-debugging-pipe`:
/// commands on its fd 3, answers and events on its fd 4, each a JSON message ending in NUL).
/// Unlike `--enable-logging`, whose console lines carry no level and omit failed loads, the
/// protocol reports every log entry and console call with its level.
struct Browser {
    child: std::process::Child,
    to: std::io::PipeWriter,
    from: std::io::BufReader<std::io::PipeReader>,
    next: u64,
    /// Events seen while waiting for answers.
    events: Vec<Value>,
}

impl Browser {
    fn start(binary: &str, profile: &Path) -> Browser {
        use std::os::fd::AsRawFd;
        use std::os::unix::process::CommandExt;
        let (ours_from, theirs_to) = std::io::pipe().expect("a pipe");
        let (theirs_from, ours_to) = std::io::pipe().expect("a pipe");
        let (read_fd, write_fd) = (theirs_from.as_raw_fd(), theirs_to.as_raw_fd());
        let mut command = Command::new(binary);
        command
            .args(["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars"])
            .args(["--remote-debugging-pipe", "--disable-extensions", "--mute-audio"])
            .arg(format!("--user-data-dir={}", profile.display()))
            .arg("about:blank")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        // SAFETY: fcntl and dup2 are async-signal-safe. The ends are first copied above 10, so
        // that neither is overwritten when one already is fd 3 or 4, then placed at 3 and 4
        // (dup2 clears close-on-exec).
        unsafe {
            command.pre_exec(move || {
                let (r, w) = (libc::fcntl(read_fd, libc::F_DUPFD, 10), libc::fcntl(write_fd, libc::F_DUPFD, 10));
                if r < 0 || w < 0 || libc::dup2(r, 3) < 0 || libc::dup2(w, 4) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = command.spawn().expect("start the browser");
        drop((theirs_from, theirs_to));
        Browser { child, to: ours_to, from: std::io::BufReader::new(ours_from), next: 0, events: Vec::new() }
    }

    /// Sends `method` (to `session`, when given) and returns its result; events that arrive
    /// meanwhile are kept.
    fn call(&mut self, session: Option<&str>, method: &str, params: Value) -> Value {
        use std::io::{BufRead, Write};
        self.next += 1;
        let mut message = serde_json::json!({"id": self.next, "method": method, "params": params});
        if let Some(s) = session {
            message["sessionId"] = s.into();
        }
        let mut bytes = serde_json::to_vec(&message).expect("json");
        bytes.push(0);
        self.to.write_all(&bytes).expect("write to the browser");
        loop {
            let mut raw = Vec::new();
            let n = self.from.read_until(0, &mut raw).expect("read from the browser");
            assert!(n > 0, "the browser closed its pipe during {method}");
            raw.pop();
            let answer: Value = serde_json::from_slice(&raw).expect("a protocol message");
            if answer["id"] == self.next {
                assert!(answer["error"].is_null(), "{method}: {}", answer["error"]);
                return answer["result"].clone();
            }
            self.events.push(answer);
        }
    }

    /// Opens `page` in a new tab of `width` × `height` and waits until it has loaded; returns
    /// the tab's session.
    fn open(&mut self, page: &Path, (width, height): (u32, u32)) -> String {
        let target = self.call(None, "Target.createTarget", serde_json::json!({"url": "about:blank"}));
        let attached = self.call(
            None,
            "Target.attachToTarget",
            serde_json::json!({"targetId": target["targetId"], "flatten": true}),
        );
        let session = attached["sessionId"].as_str().expect("a session").to_string();
        let s = Some(session.as_str());
        for domain in ["Log.enable", "Runtime.enable", "Page.enable"] {
            self.call(s, domain, serde_json::json!({}));
        }
        let metrics = serde_json::json!({"width": width, "height": height, "deviceScaleFactor": 1, "mobile": false});
        self.call(s, "Emulation.setDeviceMetricsOverride", metrics);
        self.events.clear();
        self.call(s, "Page.navigate", serde_json::json!({"url": format!("file://{}", page.display())}));
        while !self.events.iter().any(|e| e["method"] == "Page.loadEventFired" && e["sessionId"] == session) {
            // Any call returns once the events before its answer are read.
            self.call(s, "Runtime.evaluate", serde_json::json!({"expression": "1"}));
        }
        session
    }

    /// Error-level log entries, console errors and exceptions seen so far.
    fn errors(&self) -> Vec<String> {
        let error = |e: &&Value| match e["method"].as_str() {
            Some("Log.entryAdded") => e["params"]["entry"]["level"] == "error",
            Some("Runtime.consoleAPICalled") => matches!(e["params"]["type"].as_str(), Some("error" | "assert")),
            Some("Runtime.exceptionThrown") => true,
            _ => false,
        };
        self.events.iter().filter(error).map(|e| e["params"].to_string()).collect()
    }

    fn dom(&mut self, session: &str) -> String {
        let doc = self.call(Some(session), "DOM.getDocument", serde_json::json!({}));
        let html = self.call(Some(session), "DOM.getOuterHTML", serde_json::json!({"nodeId": doc["root"]["nodeId"]}));
        html["outerHTML"].as_str().expect("html").to_string()
    }

    /// What the browser laid out. For each `<svg>` (every chart, heatmap, strip and lane grid):
    /// its box, its marks (the elements that carry a `<title>`: a bar, a cell, a point, a flip)
    /// and how many of them have a non-empty box inside the chart's, visible. Then the lanes'
    /// cells so laid out, near-ties and real flips.
    fn layout(&mut self, session: &str) -> Value {
        let expression = r#"(() => {
            const box = e => e.getBoundingClientRect();
            const laid = (e, o) => {
                const b = box(e);
                return b.width > 0 && b.height > 0 && b.left < o.right && b.right > o.left && b.top < o.bottom
                    && b.bottom > o.top && getComputedStyle(e).visibility === "visible";
            };
            const charts = [...document.querySelectorAll("svg")].map(s => {
                const o = box(s), marks = [...s.querySelectorAll("title")].map(t => t.parentElement);
                return {width: o.width, height: o.height, marks: marks.length, laid: marks.filter(m => laid(m, o)).length};
            });
            const cells = kind => [...document.querySelectorAll("svg rect > title")]
                .filter(t => t.textContent.includes(`: ${kind}, margin `) && laid(t.parentElement, box(t.closest("svg"))))
                .length;
            return {charts, near: cells("near-tie"), real: cells("real flip")};
        })()"#;
        let answer = self.call(
            Some(session),
            "Runtime.evaluate",
            serde_json::json!({"expression": expression, "returnByValue": true}),
        );
        assert!(answer["exceptionDetails"].is_null(), "{}", answer["exceptionDetails"]);
        answer["result"]["value"].clone()
    }

    fn screenshot(&mut self, session: &str) -> Vec<u8> {
        use base64::Engine;
        let shot = self.call(Some(session), "Page.captureScreenshot", serde_json::json!({"format": "png"}));
        base64::engine::general_purpose::STANDARD.decode(shot["data"].as_str().expect("data")).expect("base64")
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Distinct colours of a PNG's pixels.
fn colours(png_bytes: &[u8]) -> usize {
    let mut reader = png::Decoder::new(std::io::Cursor::new(png_bytes)).read_info().expect("a png");
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).expect("a frame");
    let px = info.color_type.samples();
    let set: std::collections::HashSet<&[u8]> = buf[..info.buffer_size()].chunks_exact(px).collect();
    set.len()
}

/// The charts of a `Browser::layout` that show nothing: no box, no mark, or a mark not laid
/// out inside the chart.
fn blank(layout: &Value) -> Vec<String> {
    let charts = layout["charts"].as_array().expect("charts");
    let shown = |c: &Value| c["width"].as_f64() > Some(0.0) && c["height"].as_f64() > Some(0.0);
    let drawn = |c: &Value| c["marks"].as_u64() > Some(0) && c["laid"] == c["marks"];
    charts.iter().enumerate().filter(|(_, c)| !shown(c) || !drawn(c)).map(|(i, c)| format!("svg {i}: {c}")).collect()
}

#[test]
fn a_browser_opens_each_report_without_error_and_draws_it() {
    let Some(binary) = chromium() else { return };
    let d = dir("browser");
    let mut browser = Browser::start(binary, &d.join("profile"));
    // The harness sees an error where there is one: a console error and a failed load; and a
    // chart that shows nothing: one empty, one with no box, one with a mark outside it, one
    // with a mark of no size (the last chart is drawn).
    let bad = d.join("bad.html");
    std::fs::write(
        &bad,
        concat!(
            "<!DOCTYPE html><body><script>console.error('broken')</script><img src=\"gone.png\">",
            "<svg width=\"200\" height=\"100\"></svg>",
            "<svg width=\"0\" height=\"100\"><rect width=\"10\" height=\"10\"><title>a</title></rect></svg>",
            "<svg width=\"100\" height=\"100\"><rect x=\"200\" width=\"10\" height=\"10\"><title>b</title></rect></svg>",
            "<svg width=\"100\" height=\"100\"><rect width=\"0\" height=\"10\"><title>c</title></rect></svg>",
            "<svg width=\"100\" height=\"100\"><rect width=\"10\" height=\"10\"><title>d</title></rect></svg>",
        ),
    )
    .unwrap();
    let session = browser.open(&bad, (400, 300));
    assert!(browser.errors().len() >= 2, "{:?}", browser.errors());
    let laid_out = browser.layout(&session);
    let flagged: Vec<String> = blank(&laid_out).iter().map(|b| b.split(':').next().unwrap().to_string()).collect();
    assert_eq!(flagged, ["svg 0", "svg 1", "svg 2", "svg 3"], "{laid_out}");
    for page in pages() {
        let kind = page.kind;
        let session = browser.open(&page.path, (1280, 1600));
        assert!(browser.errors().is_empty(), "{kind}: {:?}", browser.errors());
        let dom = browser.dom(&session);
        for e in &page.texts {
            assert!(dom.contains(e.as_str()), "{kind}: the DOM lacks {e:?}");
        }
        // Every chart is laid out with its marks; the lanes' cells are the first differing tokens' flips.
        let laid_out = browser.layout(&session);
        assert!(!laid_out["charts"].as_array().unwrap().is_empty(), "{kind}: no chart");
        assert_eq!(blank(&laid_out), Vec::<String>::new(), "{kind}");
        let cells = (laid_out["near"].as_u64().unwrap() as usize, laid_out["real"].as_u64().unwrap() as usize);
        assert_eq!(cells, page.lane_cells, "{kind}: lane cells (near-tie, real)");
        let shot = browser.screenshot(&session);
        let n = colours(&shot);
        assert!(n >= 16, "{kind}: the screenshot has {n} colours");
        assert!(browser.errors().is_empty(), "{kind}: {:?}", browser.errors());
    }
}
