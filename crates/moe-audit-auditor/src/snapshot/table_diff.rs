//! Comparing two routing texts as values, not as bytes: every token's experts, their order, kept
//! flags and weights, the call's capacity and scope, the loads and the load figures.
//!
//! Weights are printed rounded, so float noise in the last bit can move a printed weight by one
//! unit of its last decimal (0.44815 - 1 ulp prints 0.4481, + 1 ulp prints 0.4482). A printed
//! value may therefore move by one unit (1e-4 for weights, 1e-3 for the load figures) without
//! counting as a change; two units or more always count.

use moe_audit_core::error::excerpt;
use std::collections::BTreeMap;
use std::fmt::Write;

/// How many changed tokens a diff shows per mode (the summary counts them all).
const SHOWN: usize = 20;

/// Kept, dropped, or a padding slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mark {
    Kept,
    Dropped,
    Padding,
}

impl Mark {
    fn name(self) -> &'static str {
        match self {
            Mark::Kept => "kept",
            Mark::Dropped => "dropped",
            Mark::Padding => "padding",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
struct Cell {
    expert: usize,
    weight: f64,
    mark: Mark,
}

#[derive(Debug, Clone)]
struct TokenLine {
    batch: usize,
    pos: usize,
    routes: Vec<Cell>,
    line: String,
}

/// A routing text ([`render_table`](moe_audit_core::routing::render_table)) read back.
#[derive(Debug, Clone)]
struct Table {
    header: String,
    tokens: Vec<TokenLine>,
    /// Per expert shown: routed, kept, padded.
    loads: BTreeMap<usize, [usize; 3]>,
    stats: Vec<(String, f64)>,
}

fn parse_table(text: &str) -> Result<Table, String> {
    let mut lines = text.lines().enumerate();
    let mut next = |what: &str| lines.next().ok_or_else(|| format!("the routing text ends before {what}"));
    let (_, header) = next("its header")?;
    if !header.starts_with("router ") {
        return Err(format!("line 1 of the routing text is not `router ...`: `{}`", excerpt(header)));
    }
    next("the column names")?;
    let mut tokens = Vec::new();
    let mut loads = BTreeMap::new();
    let stats_line = loop {
        let (i, line) = next("the load figures")?;
        let at = |m: &str| format!("line {} of the routing text: {m}: `{}`", i + 1, excerpt(line));
        let words: Vec<&str> = line.split_whitespace().collect();
        if line.starts_with("expert  routed") || line.starts_with('(') {
            continue;
        }
        if line.starts_with("max/mean load") {
            break line;
        }
        let num = |w: &str| w.parse::<usize>().map_err(|_| at("expected a number"));
        if line.contains(" e") || words.get(2) == Some(&"-") {
            // A token: batch, position, then `eN WEIGHT[x|p]` pairs (or `-`).
            let (Some(b), Some(p)) = (words.first(), words.get(1)) else { return Err(at("expected a token")) };
            let mut routes = Vec::new();
            for pair in words[2..].chunks(2) {
                if pair == ["-"] {
                    break;
                }
                let [e, w] = pair else { return Err(at("a route without its weight")) };
                let expert = e.strip_prefix('e').ok_or_else(|| at("expected `eN`")).and_then(num)?;
                let (w, mark) = match w.strip_suffix('x') {
                    Some(w) => (w, Mark::Dropped),
                    None => match w.strip_suffix('p') {
                        Some(w) => (w, Mark::Padding),
                        None => (*w, Mark::Kept),
                    },
                };
                let weight = w.parse::<f64>().map_err(|_| at("expected a weight"))?;
                routes.push(Cell { expert, weight, mark });
            }
            tokens.push(TokenLine { batch: num(b)?, pos: num(p)?, routes, line: line.to_string() });
        } else {
            let [e, r, k, p] = words[..] else { return Err(at("expected `expert routed kept padded`")) };
            loads.insert(num(e)?, [num(r)?, num(k)?, num(p)?]);
        }
    };
    let mut stats = Vec::new();
    for part in stats_line.split(" | ") {
        let (name, value) =
            part.rsplit_once(' ').ok_or_else(|| format!("a load figure without a value: `{}`", excerpt(part)))?;
        let value = value
            .parse::<f64>()
            .map_err(|_| format!("load figure `{}` is not a number: `{}`", excerpt(name), excerpt(value)))?;
        stats.push((name.to_string(), value));
    }
    Ok(Table { header: header.to_string(), tokens, loads, stats })
}

/// The changes of one token.
#[derive(Debug, Clone)]
struct TokenChange {
    batch: usize,
    pos: usize,
    what: Vec<String>,
    old: String,
    new: String,
}

/// How one routing text differs from another.
#[derive(Debug, Clone, Default)]
pub struct TableDiff {
    /// Parts of the call's header line that changed (sizes, scope, capacity).
    header: Vec<String>,
    compared: usize,
    tokens: Vec<TokenChange>,
    /// Tokens with changed experts, order, kept flags, weights.
    counts: [usize; 4],
    other: Vec<String>,
}

impl TableDiff {
    /// Whether anything changed beyond the tolerance.
    pub fn changed(&self) -> bool {
        !(self.header.is_empty() && self.tokens.is_empty() && self.other.is_empty())
    }

    /// Tokens whose routing changed.
    pub fn moved(&self) -> usize {
        self.tokens.len()
    }

    /// One line: how many tokens moved, and how.
    pub fn summary(&self) -> String {
        let [e, o, k, w] = self.counts;
        let mut s = format!(
            "{} of {} tokens moved (experts {e}, order {o}, kept flag {k}, weight {w})",
            self.tokens.len(),
            self.compared
        );
        if !self.header.is_empty() {
            s.push_str("; the call changed (sizes, scope or capacity)");
        }
        s
    }

    /// Every change, a token's old and new line under its description.
    pub fn details(&self) -> String {
        let mut out = String::new();
        for h in &self.header {
            let _ = writeln!(out, "  call: {h}");
        }
        for t in self.tokens.iter().take(SHOWN) {
            let _ = writeln!(out, "  batch {} pos {}: {}", t.batch, t.pos, t.what.join("; "));
            let _ = writeln!(out, "    - {}", t.old);
            let _ = writeln!(out, "    + {}", t.new);
        }
        if self.tokens.len() > SHOWN {
            let _ = writeln!(out, "  ... and {} more tokens", self.tokens.len() - SHOWN);
        }
        for o in &self.other {
            let _ = writeln!(out, "  {o}");
        }
        out
    }
}

fn ids(routes: &[Cell]) -> String {
    routes.iter().map(|c| format!("e{}", c.expert)).collect::<Vec<_>>().join(" ")
}

/// [`diff_tables`] under its name before 0.3.0.
#[deprecated(since = "0.3.0", note = "renamed `diff_tables` (`compare` is `routes compare`'s)")]
pub fn compare(old: &str, new: &str, weight_decimals: u32) -> Result<TableDiff, String> {
    diff_tables(old, new, weight_decimals)
}

/// Compares the stored text `old` with the new `new`. Printed weights (`weight_decimals`
/// decimals) and load figures (3 decimals) may differ by one unit of their last decimal. The
/// error says what in `old` cannot be read (`new` is always this moe-audit's rendering).
pub fn diff_tables(old: &str, new: &str, weight_decimals: u32) -> Result<TableDiff, String> {
    let old = parse_table(old)?;
    let new = parse_table(new).expect("moe-audit reads its own rendering");
    let weight_tol = 1.5 * 10f64.powi(-(weight_decimals as i32));
    let stat_tol = 1.5e-3;
    let mut diff = TableDiff::default();
    if old.header != new.header {
        let (a, b): (Vec<&str>, Vec<&str>) = (old.header.split(" | ").collect(), new.header.split(" | ").collect());
        if a.len() == b.len() {
            diff.header = a.iter().zip(&b).filter(|(x, y)| x != y).map(|(x, y)| format!("{x} -> {y}")).collect();
        } else {
            diff.header = vec![format!("{} -> {}", old.header, new.header)];
        }
    }
    if old.tokens.len() != new.tokens.len() {
        diff.other.push(format!("{} tokens -> {}", old.tokens.len(), new.tokens.len()));
    }
    diff.compared = old.tokens.len().min(new.tokens.len());
    for (a, b) in old.tokens.iter().zip(&new.tokens) {
        let mut what = Vec::new();
        let mut kinds = [false; 4];
        if (a.batch, a.pos) != (b.batch, b.pos) {
            what.push(format!("token batch {} pos {} -> batch {} pos {}", a.batch, a.pos, b.batch, b.pos));
            kinds[0] = true;
        }
        let mut sa: Vec<usize> = a.routes.iter().map(|c| c.expert).collect();
        let mut sb: Vec<usize> = b.routes.iter().map(|c| c.expert).collect();
        if sa != sb {
            sa.sort_unstable();
            sb.sort_unstable();
            let kind = if sa == sb { 1 } else { 0 };
            let name = if kind == 1 { "order" } else { "experts" };
            what.push(format!("{name} {} -> {}", ids(&a.routes), ids(&b.routes)));
            kinds[kind] = true;
        }
        for ca in &a.routes {
            let Some(cb) = b.routes.iter().find(|c| c.expert == ca.expert) else { continue };
            if ca.mark != cb.mark {
                what.push(format!("e{} {} -> {}", ca.expert, ca.mark.name(), cb.mark.name()));
                kinds[2] = true;
            }
            if (ca.weight - cb.weight).abs() > weight_tol {
                let d = weight_decimals as usize;
                what.push(format!("e{} weight {:.d$} -> {:.d$}", ca.expert, ca.weight, cb.weight));
                kinds[3] = true;
            }
        }
        if !what.is_empty() {
            for (count, hit) in diff.counts.iter_mut().zip(kinds) {
                *count += usize::from(hit);
            }
            diff.tokens.push(TokenChange {
                batch: a.batch,
                pos: a.pos,
                what,
                old: a.line.clone(),
                new: b.line.clone(),
            });
        }
    }
    let experts: std::collections::BTreeSet<usize> = old.loads.keys().chain(new.loads.keys()).copied().collect();
    for e in experts {
        let (la, lb) = (old.loads.get(&e).unwrap_or(&[0; 3]), new.loads.get(&e).unwrap_or(&[0; 3]));
        if la != lb {
            let show = |l: &[usize; 3]| format!("routed {} kept {} padded {}", l[0], l[1], l[2]);
            diff.other.push(format!("expert {e} load: {} -> {}", show(la), show(lb)));
        }
    }
    for ((na, va), (nb, vb)) in old.stats.iter().zip(&new.stats) {
        if na != nb {
            diff.other.push(format!("load figure `{na}` -> `{nb}`"));
        } else if (va - vb).abs() > stat_tol {
            diff.other.push(format!("{na} {va:.3} -> {vb:.3}"));
        }
    }
    Ok(diff)
}

#[cfg(test)]
mod tests {
    use super::*;

    const OLD: &str = "\
router r | batch 1 x seq 3 | 4 experts, top-2 | scope batch (1 groups), sequence-major | capacity 2 per expert per group
  b  pos  routes in choice order (x dropped, p padding slot)
  0    0  e0   0.7311  e1   0.2689
  0    1  e1   0.6000  e2   0.4000x
  0    2  -
expert  routed  kept  padded
     0       1     1       0
     1       2     2       0
     2       1     0       0
(1 idle experts not shown)
max/mean load 1.333 | load cv 0.471 | drop rate 0.250 | aux loss 1.100
";

    fn diff(new: &str) -> TableDiff {
        diff_tables(OLD, new, 4).unwrap()
    }

    #[test]
    fn the_same_text_is_unchanged() {
        let d = diff(OLD);
        assert!(!d.changed());
        assert_eq!(d.summary(), "0 of 3 tokens moved (experts 0, order 0, kept flag 0, weight 0)");
    }

    #[test]
    fn one_unit_of_the_last_decimal_is_noise_two_are_a_change() {
        assert!(!diff(&OLD.replace("0.7311", "0.7312").replace("1.100", "1.101")).changed());
        let d = diff(&OLD.replace("0.7311", "0.7313"));
        assert_eq!(d.summary(), "1 of 3 tokens moved (experts 0, order 0, kept flag 0, weight 1)");
        assert!(d.details().contains("  batch 0 pos 0: e0 weight 0.7311 -> 0.7313\n"), "{}", d.details());
        assert!(diff(&OLD.replace("1.100", "1.102")).details().contains("aux loss 1.100 -> 1.102"));
    }

    #[test]
    fn every_kind_of_change_is_named() {
        let d = diff(&OLD.replace("e1   0.6000  e2   0.4000x", "e2   0.4000  e1   0.6000"));
        assert_eq!(d.summary(), "1 of 3 tokens moved (experts 0, order 1, kept flag 1, weight 0)");
        assert!(d.details().contains("batch 0 pos 1: order e1 e2 -> e2 e1; e2 dropped -> kept"), "{}", d.details());
        let d = diff(&OLD.replace("e0   0.7311  e1", "e3   0.7311  e1"));
        assert!(d.details().contains("experts e0 e1 -> e3 e1"), "{}", d.details());
        let d = diff(&OLD.replace("capacity 2 per", "capacity 3 per"));
        assert_eq!(
            d.summary(),
            "0 of 3 tokens moved (experts 0, order 0, kept flag 0, weight 0); the call changed (sizes, scope or capacity)"
        );
        assert!(d.details().contains("  call: capacity 2 per expert per group -> capacity 3 per expert per group\n"));
        let d = diff(&OLD.replace("     2       1     0       0\n", "     2       1     1       0\n"));
        assert!(
            d.changed() && d.details().contains("expert 2 load: routed 1 kept 0 padded 0 -> routed 1 kept 1 padded 0")
        );
    }

    #[test]
    fn an_unreadable_stored_text_is_an_error() {
        assert!(diff_tables("hello\n", OLD, 4).unwrap_err().contains("is not `router ...`"));
        let broken = OLD.replace("e1   0.2689", "e1   zero");
        assert!(diff_tables(&broken, OLD, 4).unwrap_err().starts_with("line 3 of the routing text: expected a weight"));
        assert!(diff_tables(&OLD[..200], OLD, 4).unwrap_err().contains("ends before"));
    }
}
