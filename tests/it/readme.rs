//! Claims of the README and the manual (docs/*.md), checked: every `moe-audit` command in a shell
//! block that states its exit code (`# exit 1: P F N R L leak`) exits so and leaks exactly there,
//! the CI workflow docs/CI.md shows is the file it names, and the README's zoo table is what `zoo`
//! prints.

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

#[test]
fn the_documented_workflow_is_the_file_it_names() {
    let text = doc("docs/CI.md");
    assert!(text.contains("(`.github/workflows/moe-audit.yml`)"), "docs/CI.md no longer names the workflow file");
    let file = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(".github/workflows/moe-audit.yml"))
        .expect(".github/workflows/moe-audit.yml");
    let body: Vec<&str> = file.lines().skip_while(|l| l.starts_with('#')).collect();
    let shown = blocks(&text, "yaml").into_iter().find(|b| b.first().is_some_and(|l| l.starts_with("name: moe-audit")));
    assert_eq!(shown.expect("docs/CI.md shows the workflow"), body, "docs/CI.md's workflow differs from the file");
    // Its snapshot step checks a snapshot committed here, of the example router.
    let checks: Vec<&str> =
        body.iter().filter_map(|l| l.trim().strip_prefix("run: moe-audit snapshot check ")).collect();
    assert!(!checks.is_empty(), "the workflow checks no snapshot");
    if !crate::external::numpy() {
        return;
    }
    for check in checks {
        let file = check.split_whitespace().next().expect("a snapshot file");
        // The step as written (its flags and quoting), run by a shell as CI runs it.
        let out = Command::new("sh")
            .args(["-c", &format!("\"$0\" snapshot check {check}"), BIN])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .envs(crate::external::python_env())
            .output()
            .expect("run moe-audit");
        assert_eq!(out.status.code(), Some(0), "{file}: {}", String::from_utf8_lossy(&out.stdout));
    }
}

#[test]
fn the_readme_zoo_table_is_what_zoo_prints() {
    let out = Command::new(BIN).arg("zoo").output().expect("run moe-audit zoo");
    assert_eq!(out.status.code(), Some(0));
    let printed = String::from_utf8(out.stdout).expect("utf-8");
    let table: String = printed.lines().take_while(|l| !l.is_empty()).map(|l| format!("{l}\n")).collect();
    assert!(readme().contains(&table), "README's zoo table is stale: `cargo run -- zoo` prints\n{table}");
}
