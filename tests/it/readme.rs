//! Claims of the README and the manual (docs/*.md), checked: every `moe-audit` command in a shell
//! block that states its exit code (`# exit 1: P F N R L leak`) exits so and leaks exactly there,
//! the CI workflow docs/CI.md shows is the file it names and its moe-audit steps exit as the
//! runner would see them exit, and the README's zoo table is what `zoo` prints.

use std::path::Path;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_moe-audit");

fn doc(path: &str) -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(path)).expect(path)
}

fn readme() -> String {
    doc("README.md")
}

/// The README and every document of the manual.
fn all_docs() -> Vec<String> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs");
    let mut paths: Vec<_> = std::fs::read_dir(&dir)
        .expect("docs/")
        .map(|e| e.expect("docs/ entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    paths.sort();
    let mut texts = vec![readme()];
    texts.extend(paths.iter().map(|p| std::fs::read_to_string(p).expect("a doc")));
    texts
}

/// The lines of the README's fenced blocks of `language`.
fn blocks(text: &str, language: &str) -> Vec<Vec<String>> {
    let fence = format!("```{language}");
    let mut blocks = Vec::new();
    let mut current: Option<Vec<String>> = None;
    for line in text.lines() {
        match current.take() {
            None if line.trim_start() == fence => current = Some(Vec::new()),
            None => {}
            Some(lines) if line.trim_start() == "```" => blocks.push(lines),
            Some(mut lines) => {
                lines.push(line.to_string());
                current = Some(lines);
            }
        }
    }
    blocks
}

/// A command the README states the outcome of.
struct Claim {
    command: String,
    exit: i32,
    /// The probes the comment says leak (`None`: it names none).
    leaking: Option<Vec<String>>,
}

fn claims(text: &str) -> Vec<Claim> {
    let mut claims = Vec::new();
    for line in blocks(text, "sh").concat() {
        let Some((command, comment)) = line.split_once("# exit ") else { continue };
        let Some(command) = command.trim().strip_prefix("moe-audit ") else { continue };
        // `# exit N` or `# exit N: P F leak`; other comments (`# exit 0 unchanged, 1 changed`)
        // list the codes a command can give, not what this one gives.
        let (code, rest) = comment.split_once(':').unwrap_or((comment, ""));
        let Ok(exit) = code.trim().parse() else { continue };
        let leaking = rest.trim().strip_suffix("leak").map(|p| p.split_whitespace().map(String::from).collect());
        claims.push(Claim { command: command.trim().to_string(), exit, leaking });
    }
    claims
}

#[test]
fn readme_commands_exit_and_leak_as_their_comments_say() {
    assert!(!claims(&readme()).is_empty(), "the README states no command's exit code");
    let mut claims: Vec<Claim> = all_docs().iter().flat_map(|text| claims(text)).collect();
    // A command shown in two documents runs once (the same claim, or the test fails below).
    claims.sort_by(|a, b| a.command.cmp(&b.command));
    claims.dedup_by(|a, b| a.command == b.command && a.exit == b.exit && a.leaking == b.leaking);
    for claim in claims {
        if claim.command.contains("python") && !crate::external::numpy() {
            continue;
        }
        let out = Command::new("sh")
            .arg("-c")
            .arg(format!("\"{BIN}\" {} --format json", claim.command))
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .envs(crate::external::python_env())
            .output()
            .expect("run moe-audit");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(claim.exit), "`moe-audit {}`: {stderr}", claim.command);
        if let Some(expected) = claim.leaking {
            let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON report");
            let leaking: Vec<String> = report["routers"][0]["findings"]
                .as_array()
                .expect("findings")
                .iter()
                .filter(|f| f["verdict"] == "leak")
                .map(|f| f["probe"].as_str().expect("probe").to_string())
                .collect();
            assert_eq!(leaking, expected, "`moe-audit {}`: the docs' comment names other probes", claim.command);
        }
    }
}

/// The `run:` commands of a workflow's steps that call moe-audit, as (step name, script): a
/// one-line `run:` or a `run: |` block (its lines less the block's indentation).
fn moe_audit_steps(workflow: &[&str]) -> Vec<(String, String)> {
    let indent = |l: &str| l.len() - l.trim_start().len();
    let mut steps = Vec::new();
    let mut name = String::new();
    let mut lines = workflow.iter().peekable();
    while let Some(line) = lines.next() {
        let item = line.trim_start().trim_start_matches("- ");
        if let Some(n) = item.strip_prefix("name: ") {
            name = n.to_string();
        } else if let Some(run) = item.strip_prefix("run: ") {
            let script = if run.trim() == "|" {
                let mut block = Vec::new();
                while let Some(next) = lines.next_if(|l| l.trim().is_empty() || indent(l) > indent(line)) {
                    block.push(next.trim().to_string());
                }
                block.join("\n")
            } else {
                run.to_string()
            };
            if script.starts_with("moe-audit ") {
                steps.push((std::mem::take(&mut name), script));
            }
        } else if item.starts_with("uses: ") {
            name.clear();
        }
    }
    steps
}

/// A step's script run as the runner runs it (`bash --noprofile --norc -eo pipefail`), in dir
/// (where `python/` is the checkout's), with the built binary first on the PATH as `pip install .`
/// puts it, and `$GITHUB_STEP_SUMMARY` a file there.
fn run_step(dir: &Path, script: &str) -> std::process::Output {
    let bin_dir = Path::new(BIN).parent().expect("the binary's folder");
    let path = std::env::join_paths(
        std::iter::once(bin_dir.to_path_buf())
            .chain(std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())),
    )
    .expect("PATH");
    Command::new("bash")
        .args(["--noprofile", "--norc", "-eo", "pipefail", "-c", script])
        .current_dir(dir)
        .envs(crate::external::python_env())
        .env("PATH", path)
        .env("GITHUB_STEP_SUMMARY", dir.join("summary.md"))
        .output()
        .expect("run bash")
}

#[cfg(unix)]
#[test]
fn the_documented_workflow_is_the_file_it_names_and_its_steps_pass_as_the_runner_runs_them() {
    let text = doc("docs/CI.md");
    assert!(text.contains("(`.github/workflows/moe-audit.yml`)"), "docs/CI.md no longer names the workflow file");
    let file = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(".github/workflows/moe-audit.yml"))
        .expect(".github/workflows/moe-audit.yml");
    let body: Vec<&str> = file.lines().skip_while(|l| l.starts_with('#')).collect();
    let shown = blocks(&text, "yaml").into_iter().find(|b| b.first().is_some_and(|l| l.starts_with("name: moe-audit")));
    assert_eq!(shown.expect("docs/CI.md shows the workflow"), body, "docs/CI.md's workflow differs from the file");
    // Its moe-audit steps, in order: the audit, the snapshot check (of a snapshot committed here),
    // the JUnit report.
    let steps = moe_audit_steps(&body);
    let names: Vec<&str> = steps.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["audit the router", "routing snapshots", "JUnit report"], "{steps:?}");
    if !crate::external::numpy() {
        return;
    }
    // A checkout of its own: the JUnit step writes moe-audit.xml where it runs.
    let dir = std::env::temp_dir().join(format!("moe-audit-it-workflow-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    std::os::unix::fs::symlink(Path::new(env!("CARGO_MANIFEST_DIR")).join("python"), dir.join("python"))
        .expect("link python/");
    let out = |o: &std::process::Output| {
        format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
    };

    // The audit passes the example router: exit 0, no annotation, every probe in the summary.
    let audit = run_step(&dir, &steps[0].1);
    assert_eq!(audit.status.code(), Some(0), "{}", out(&audit));
    assert!(!String::from_utf8_lossy(&audit.stdout).contains("::error"), "{}", out(&audit));
    let summary = std::fs::read_to_string(dir.join("summary.md")).expect("the step summary");
    let rows: Vec<&str> = summary.lines().filter_map(|l| l.strip_prefix("| `mixtral-py` | ")).collect();
    let probes: String = rows.iter().filter_map(|r| r.chars().next()).collect();
    assert_eq!(probes, "PFNRDSML", "{summary}");
    assert!(rows.iter().all(|r| r.contains(" | ✅ pass | ")), "{summary}");
    // The same step fails the job on a leaking router, one annotation per leaking probe.
    let leaking = run_step(&dir, &steps[0].1.replace("mixtral_router.py", "megatron_probs_router.py"));
    assert_eq!(leaking.status.code(), Some(1), "{}", out(&leaking));
    let annotated: Vec<String> = String::from_utf8_lossy(&leaking.stdout)
        .lines()
        .filter(|l| l.starts_with("::error"))
        .map(String::from)
        .collect();
    assert_eq!(annotated.len(), 5, "{annotated:?}");
    for probe in ["P", "F", "N", "R", "L"] {
        assert!(annotated.iter().any(|l| l.contains(&format!("leaks on {probe} "))), "{probe}: {annotated:?}");
    }

    // The snapshot step: the committed snapshot checks clean.
    let snapshot = run_step(&dir, &steps[1].1);
    assert_eq!(snapshot.status.code(), Some(0), "{}", out(&snapshot));

    // The JUnit step (`|| true`: it never fails the job) writes one case per probe, none failed.
    let junit = run_step(&dir, &steps[2].1);
    assert_eq!(junit.status.code(), Some(0), "{}", out(&junit));
    let xml = std::fs::read_to_string(dir.join("moe-audit.xml")).expect("moe-audit.xml");
    assert!(xml.contains("<testsuite") && !xml.contains("<failure"), "{xml}");
    assert!(xml.matches("<testcase").count() >= 8, "{xml}");
    std::fs::remove_dir_all(&dir).expect("remove the temp dir");
}

#[test]
fn the_readme_zoo_table_is_what_zoo_prints() {
    let out = Command::new(BIN).arg("zoo").output().expect("run moe-audit zoo");
    assert_eq!(out.status.code(), Some(0));
    let printed = String::from_utf8(out.stdout).expect("utf-8");
    let table: String = printed.lines().take_while(|l| !l.is_empty()).map(|l| format!("{l}\n")).collect();
    assert!(readme().contains(&table), "README's zoo table is stale: `cargo run -- zoo` prints\n{table}");
}
