//! Every command's synopsis, written from the clap definition (an option shows its choices, else
//! its default, else its value's name): the README's synopsis block is
//! this text (a test keeps the two equal), so a flag or a value added to clap cannot be missing
//! from the README.

use clap::{Arg, ArgAction, Command};

/// The lines of the README's synopsis block: one entry per command (subcommands of `routes`
/// included), wrapped at `width` columns with continuation lines indented by two spaces.
pub(crate) fn synopsis(cli: &Command, width: usize) -> String {
    let mut out = String::new();
    for command in cli.get_subcommands() {
        let mut path = vec![cli.get_name().to_string(), command.get_name().to_string()];
        if command.has_subcommands() {
            for sub in command.get_subcommands() {
                path.push(sub.get_name().to_string());
                out.push_str(&entry(&path, sub, width));
                path.pop();
            }
        } else {
            out.push_str(&entry(&path, command, width));
        }
    }
    out
}

/// One command's synopsis: its name, positionals, then each option in declaration order. The
/// members of a required group (one of them must be given) are shown together, where the first
/// of them would be: `<ROUTER|--cmd COMMAND>`.
fn entry(path: &[String], command: &Command, width: usize) -> String {
    let visible = |a: &&Arg| !a.is_hide_set() && !matches!(a.get_action(), ArgAction::Help | ArgAction::Version);
    let groups: Vec<Vec<&str>> = command
        .get_groups()
        .filter(|g| g.is_required_set())
        .map(|g| g.get_args().map(|id| id.as_str()).collect())
        .collect();
    let args = command.get_positionals().chain(command.get_arguments().filter(|a| !a.is_positional()));
    let mut words = vec![path.join(" ")];
    for a in args.filter(visible) {
        match groups.iter().find(|g| g.contains(&a.get_id().as_str())) {
            Some(group) if group[0] == a.get_id().as_str() => {
                let member = |id: &&str| command.get_arguments().find(|m| m.get_id() == *id).map(bare);
                words.push(format!("<{}>", group.iter().filter_map(member).collect::<Vec<_>>().join("|")));
            }
            Some(_) => {}
            None if a.is_positional() => words.push(positional(a)),
            None => words.push(option(a)),
        }
    }
    wrap(&words, width)
}

/// The name of an argument's value: clap's value name, else its id in capitals.
fn value_name(a: &Arg) -> String {
    a.get_value_names().and_then(|n| n.first()).map_or(a.get_id().as_str().to_uppercase(), |n| n.to_string())
}

/// A positional or an option as it is written when given: `ROUTERS...`, `--batch 4`.
fn bare(a: &Arg) -> String {
    if a.is_positional() {
        let many = matches!(a.get_action(), ArgAction::Append) || a.get_num_args().is_some_and(|n| n.max_values() > 1);
        return format!("{}{}", value_name(a), if many { "..." } else { "" });
    }
    let long = format!("--{}", a.get_long().expect("options have a long name"));
    if !a.get_action().takes_values() {
        return long;
    }
    let values: Vec<String> =
        a.get_possible_values().iter().filter(|v| !v.is_hide_set()).map(|v| v.get_name().to_string()).collect();
    // The choices, else the default (as `--batch 4`), else the value's name.
    let default = a.get_default_values().first().map(|v| v.to_string_lossy().into_owned());
    let value = if values.is_empty() { default.unwrap_or_else(|| value_name(a)) } else { values.join("|") };
    format!("{long} {value}")
}

fn positional(a: &Arg) -> String {
    let text = bare(a);
    let (name, many) = text.split_at(text.len() - if text.ends_with("...") { 3 } else { 0 });
    if a.is_required_set() {
        format!("<{name}>{many}")
    } else {
        format!("[{name}]{many}")
    }
}

fn option(a: &Arg) -> String {
    if a.is_required_set() {
        bare(a)
    } else {
        format!("[{}]", bare(a))
    }
}

/// Words joined by spaces, a new line (indented two spaces) before a word that would pass `width`.
fn wrap(words: &[String], width: usize) -> String {
    let mut out = String::new();
    let mut line = String::new();
    for word in words {
        if !line.is_empty() && line.len() + 1 + word.len() > width {
            out.push_str(&line);
            out.push('\n');
            line = "  ".into();
        } else if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(word);
    }
    out.push_str(&line);
    out.push('\n');
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    const START: &str = "<!-- synopsis: written from the clap definition; MOE_AUDIT_UPDATE_README=1 cargo test synopsis rewrites it -->\n```\n";
    const END: &str = "```\n<!-- synopsis end -->";

    #[test]
    fn the_readme_synopsis_is_the_clap_definition() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/README.md");
        let readme = std::fs::read_to_string(path).unwrap();
        let start = readme.find(START).expect("the README has a synopsis block") + START.len();
        let end = start + readme[start..].find(END).expect("the synopsis block ends");
        let want = synopsis(&crate::cli::Cli::command(), 100);
        if std::env::var_os("MOE_AUDIT_UPDATE_README").is_some() {
            std::fs::write(path, format!("{}{want}{}", &readme[..start], &readme[end..])).unwrap();
            return;
        }
        assert_eq!(
            &readme[start..end],
            want,
            "README.md's synopsis: rewrite it with MOE_AUDIT_UPDATE_README=1 cargo test synopsis"
        );
    }

    #[test]
    fn options_show_their_values_and_lines_wrap() {
        let text = synopsis(&crate::cli::Cli::command(), 100);
        assert!(text.contains("[--format text|json|markdown|junit|github|html]"), "{text}");
        assert!(text.starts_with("moe-audit presets\nmoe-audit route "), "{text}");
        assert!(text.lines().all(|l| l.len() <= 100 || !l.trim_start().contains(' ')), "{text}");
        assert!(text.contains("\nmoe-audit routes compare "), "{text}");
        // One of a required group: the router, or the model's command.
        assert!(text.contains("\nmoe-audit model <ROUTER|--model-cmd COMMAND> [--timeout 60]"), "{text}");
        assert!(text.contains("\nmoe-audit snapshot check <FILE.snap> "), "{text}");
    }
}
