//! The GBNF reader: text to [`Grammar`], with llama.cpp's syntax and its
//! rewriting of repetitions into helper rules.

use std::collections::HashMap;

use super::{
    CharSet, Grammar, GrammarError, Sym, MAX_NESTING, MAX_REPETITION, MAX_RULES, MAX_SYMBOLS,
};

/// A rule as it is read: its alternatives, each a sequence of symbols.
type Alternatives = Vec<Vec<Sym>>;

struct Parser<'a> {
    text: &'a str,
    pos: usize,
    /// Rule ids by name (named rules only).
    ids: HashMap<String, u32>,
    names: Vec<String>,
    /// Each rule's alternatives; `None` until defined.
    rules: Vec<Option<Alternatives>>,
    sets: Vec<CharSet>,
    /// Symbols so far, for the size bound.
    n_syms: usize,
}

pub(super) fn parse(text: &str) -> Result<Grammar, GrammarError> {
    let mut p = Parser {
        text,
        pos: 0,
        ids: HashMap::new(),
        names: Vec::new(),
        rules: Vec::new(),
        sets: Vec::new(),
        n_syms: 0,
    };
    p.space(true);
    while p.pos < text.len() {
        p.rule()?;
    }
    p.finish()
}

fn is_word(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'-'
}

impl Parser<'_> {
    fn peek(&self) -> Option<u8> {
        self.text.as_bytes().get(self.pos).copied()
    }

    fn peek_at(&self, ahead: usize) -> Option<u8> {
        self.text.as_bytes().get(self.pos + ahead).copied()
    }

    /// An error at the current position, with its line and column.
    fn error(&self, what: &str) -> GrammarError {
        let before = &self.text[..self.pos.min(self.text.len())];
        let line = before.matches('\n').count() + 1;
        let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
        GrammarError(format!("grammar: {what} at line {line}, column {column}"))
    }

    /// Skips blanks and `#` comments, and line breaks where `newline_ok`.
    fn space(&mut self, newline_ok: bool) {
        while let Some(b) = self.peek() {
            match b {
                b' ' | b'\t' => self.pos += 1,
                b'\r' | b'\n' if newline_ok => self.pos += 1,
                b'#' => {
                    while !matches!(self.peek(), None | Some(b'\r' | b'\n')) {
                        self.pos += 1;
                    }
                }
                _ => break,
            }
        }
    }

    fn name(&mut self) -> Result<&str, GrammarError> {
        let start = self.pos;
        while self.peek().is_some_and(is_word) {
            self.pos += 1;
        }
        if self.pos == start {
            return Err(self.error("expecting a rule name"));
        }
        Ok(&self.text[start..self.pos])
    }

    /// A rule's id by name, new (undefined) if not seen yet.
    fn rule_id(&mut self, name: &str) -> Result<u32, GrammarError> {
        if let Some(&id) = self.ids.get(name) {
            return Ok(id);
        }
        let id = self.new_rule(name.to_string())?;
        self.ids.insert(name.to_string(), id);
        Ok(id)
    }

    /// A generated rule (a group or a repetition) named after `base`.
    fn generated_rule(&mut self, base: &str) -> Result<u32, GrammarError> {
        let name = format!("{base}_{}", self.rules.len());
        self.new_rule(name)
    }

    fn new_rule(&mut self, name: String) -> Result<u32, GrammarError> {
        if self.rules.len() >= MAX_RULES {
            return Err(self.error(&format!("more than {MAX_RULES} rules")));
        }
        self.names.push(name);
        self.rules.push(None);
        Ok((self.rules.len() - 1) as u32)
    }

    /// Counts `n` more symbols against [`MAX_SYMBOLS`].
    fn grow(&mut self, n: usize) -> Result<(), GrammarError> {
        self.n_syms = self.n_syms.saturating_add(n);
        if self.n_syms > MAX_SYMBOLS {
            return Err(self.error(&format!(
                "the grammar grows past {MAX_SYMBOLS} symbols once its repetitions are written out"
            )));
        }
        Ok(())
    }

    fn chars(&mut self, set: CharSet) -> Result<Sym, GrammarError> {
        self.grow(1)?;
        self.sets.push(set);
        Ok(Sym::Chars((self.sets.len() - 1) as u32))
    }

    /// `name ::= alternatives` and the line break after it.
    fn rule(&mut self) -> Result<(), GrammarError> {
        let name = self.name()?.to_string();
        self.space(false);
        if !self.text[self.pos..].starts_with("::=") {
            return Err(self.error("expecting ::="));
        }
        self.pos += 3;
        self.space(true);
        let id = self.rule_id(&name)?;
        let alts = self.alternates(&name, 0)?;
        // As llama.cpp: a rule defined again replaces the earlier definition.
        self.rules[id as usize] = Some(alts);
        match self.peek() {
            Some(b'\r') => {
                self.pos += if self.peek_at(1) == Some(b'\n') { 2 } else { 1 };
            }
            Some(b'\n') => self.pos += 1,
            None => {}
            Some(_) => return Err(self.error("expecting a line break or the end")),
        }
        self.space(true);
        Ok(())
    }

    /// Sequences separated by `|`.
    fn alternates(&mut self, rule: &str, depth: usize) -> Result<Alternatives, GrammarError> {
        let mut alts = vec![self.sequence(rule, depth)?];
        while self.peek() == Some(b'|') {
            self.pos += 1;
            self.space(true);
            alts.push(self.sequence(rule, depth)?);
        }
        self.grow(alts.len())?;
        Ok(alts)
    }

    /// Items up to whatever cannot continue a sequence (`|`, `)`, a line
    /// break outside parentheses, the end).
    fn sequence(&mut self, rule: &str, depth: usize) -> Result<Vec<Sym>, GrammarError> {
        let nested = depth > 0;
        let mut seq: Vec<Sym> = Vec::new();
        // Where the last item starts, once there is one.
        let mut last: Option<usize> = None;
        while let Some(b) = self.peek() {
            match b {
                b'"' => {
                    self.pos += 1;
                    last = Some(seq.len());
                    while self.peek() != Some(b'"') {
                        let c = self.char()?;
                        seq.push(self.chars(CharSet {
                            negated: false,
                            ranges: vec![(c, c)],
                        })?);
                    }
                    self.pos += 1;
                    // An empty literal `""` is an item of no symbols.
                }
                b'[' => {
                    self.pos += 1;
                    let negated = self.peek() == Some(b'^');
                    if negated {
                        self.pos += 1;
                    }
                    let mut ranges = Vec::new();
                    while self.peek() != Some(b']') {
                        let lo = self.char()?;
                        let mut hi = lo;
                        if self.peek() == Some(b'-') && self.peek_at(1) != Some(b']') {
                            self.pos += 1;
                            hi = self.char()?;
                        }
                        ranges.push((lo, hi));
                    }
                    self.pos += 1;
                    last = Some(seq.len());
                    seq.push(self.chars(CharSet { negated, ranges })?);
                }
                b'.' => {
                    self.pos += 1;
                    last = Some(seq.len());
                    seq.push(self.chars(CharSet {
                        negated: false,
                        ranges: vec![(0, u32::MAX)],
                    })?);
                }
                b'(' => {
                    if depth + 1 > MAX_NESTING {
                        return Err(
                            self.error(&format!("parentheses nested deeper than {MAX_NESTING}"))
                        );
                    }
                    self.pos += 1;
                    self.space(true);
                    let id = self.generated_rule(rule)?;
                    let alts = self.alternates(rule, depth + 1)?;
                    self.rules[id as usize] = Some(alts);
                    if self.peek() != Some(b')') {
                        return Err(self.error("expecting ')'"));
                    }
                    self.pos += 1;
                    last = Some(seq.len());
                    self.grow(1)?;
                    seq.push(Sym::Rule(id));
                }
                b'*' | b'+' | b'?' | b'{' => {
                    let (min, max) = self.repetition()?;
                    let Some(last) = last else {
                        return Err(self.error("expecting an item before */+/?/{"));
                    };
                    // `a**` repeats the rewrite, as in llama.cpp.
                    self.repeat(rule, &mut seq, last, min, max)?;
                }
                b if is_word(b) => {
                    let name = self.name()?.to_string();
                    let id = self.rule_id(&name)?;
                    last = Some(seq.len());
                    self.grow(1)?;
                    seq.push(Sym::Rule(id));
                }
                _ => break,
            }
            self.space(nested);
        }
        Ok(seq)
    }

    /// Reads `*`, `+`, `?` or `{m}`, `{m,}`, `{m,n}`: `(min, max)`, `None`
    /// for no maximum.
    fn repetition(&mut self) -> Result<(u32, Option<u32>), GrammarError> {
        let b = self.peek();
        self.pos += 1;
        match b {
            Some(b'*') => return Ok((0, None)),
            Some(b'+') => return Ok((1, None)),
            Some(b'?') => return Ok((0, Some(1))),
            _ => {}
        }
        self.space(true);
        let min = self.count()?;
        self.space(true);
        let max = match self.peek() {
            Some(b'}') => Some(min),
            Some(b',') => {
                self.pos += 1;
                self.space(true);
                let max = match self.peek() {
                    Some(b'0'..=b'9') => Some(self.count()?),
                    _ => None,
                };
                self.space(true);
                if self.peek() != Some(b'}') {
                    return Err(self.error("expecting '}'"));
                }
                max
            }
            _ => return Err(self.error("expecting ',' or '}'")),
        };
        self.pos += 1;
        if let Some(max) = max {
            if max < min {
                return Err(self.error(&format!(
                    "repetition {{{min},{max}}}: the maximum is below the minimum"
                )));
            }
        }
        Ok((min, max))
    }

    /// A repetition count, at most [`MAX_REPETITION`].
    fn count(&mut self) -> Result<u32, GrammarError> {
        let start = self.pos;
        let mut n: u64 = 0;
        while let Some(d @ b'0'..=b'9') = self.peek() {
            n = (n * 10 + u64::from(d - b'0')).min(u64::from(u32::MAX));
            self.pos += 1;
        }
        if self.pos == start {
            return Err(self.error("expecting an integer"));
        }
        if n > u64::from(MAX_REPETITION) {
            self.pos = start;
            return Err(self.error(&format!("{n} repetitions (at most {MAX_REPETITION})")));
        }
        Ok(n as u32)
    }

    /// Rewrites the item `seq[last..]` repeated `min..=max` times (llama.cpp's
    /// scheme): `min` copies in place, then for no maximum a rule
    /// `r ::= item r |`, else `max - min` nested optional rules
    /// `r1 ::= item |`, `r2 ::= item r1 |`, ... referenced from the last.
    fn repeat(
        &mut self,
        rule: &str,
        seq: &mut Vec<Sym>,
        last: usize,
        min: u32,
        max: Option<u32>,
    ) -> Result<(), GrammarError> {
        let item: Vec<Sym> = seq[last..].to_vec();
        let optional = max.map_or(1, |m| m - min) as usize;
        let copies = (min as usize).saturating_sub(1) + optional;
        self.grow(
            item.len()
                .saturating_mul(copies)
                .saturating_add(3 * optional),
        )?;
        if min == 0 {
            seq.truncate(last);
        } else {
            for _ in 1..min {
                seq.extend_from_slice(&item);
            }
        }
        let mut previous: Option<u32> = None;
        for _ in 0..optional {
            let id = self.generated_rule(rule)?;
            let mut body = item.clone();
            match max {
                None => body.push(Sym::Rule(id)),
                Some(_) => body.extend(previous.map(Sym::Rule)),
            }
            self.rules[id as usize] = Some(vec![body, Vec::new()]);
            previous = Some(id);
        }
        seq.extend(previous.map(Sym::Rule));
        Ok(())
    }

    /// One code point of a literal or class: an escape or a UTF-8 character.
    fn char(&mut self) -> Result<u32, GrammarError> {
        let rest = &self.text[self.pos..];
        let mut it = rest.chars();
        match it.next() {
            None => Err(self.error("unexpected end of input")),
            Some('\\') => {
                let e = it
                    .next()
                    .ok_or_else(|| self.error("unexpected end of input"))?;
                let digits = match e {
                    'x' => 2,
                    'u' => 4,
                    'U' => 8,
                    't' | 'r' | 'n' | '\\' | '"' | '[' | ']' => {
                        self.pos += 2;
                        return Ok(match e {
                            't' => '\t',
                            'r' => '\r',
                            'n' => '\n',
                            c => c,
                        } as u32);
                    }
                    _ => return Err(self.error(&format!("unknown escape \\{e}"))),
                };
                let hex = rest
                    .get(2..2 + digits)
                    .filter(|h| h.len() == digits && h.bytes().all(|b| b.is_ascii_hexdigit()));
                let hex = hex.ok_or_else(|| {
                    self.error(&format!("expecting {digits} hex digits after \\{e}"))
                })?;
                self.pos += 2 + digits;
                // At most 8 hex digits: fits u32.
                Ok(u32::from_str_radix(hex, 16).unwrap_or(u32::MAX))
            }
            Some(c) => {
                self.pos += c.len_utf8();
                Ok(c as u32)
            }
        }
    }

    /// Checks references, the root and left recursion, and flattens.
    fn finish(self) -> Result<Grammar, GrammarError> {
        let Parser {
            ids,
            names,
            rules,
            sets,
            ..
        } = self;
        for (id, rule) in rules.iter().enumerate() {
            if rule.is_none() {
                return Err(GrammarError(format!(
                    "grammar: undefined rule `{}`",
                    names[id]
                )));
            }
        }
        let rules: Vec<Alternatives> = rules.into_iter().map(Option::unwrap_or_default).collect();
        let root = *ids
            .get("root")
            .ok_or_else(|| GrammarError("grammar: no `root` rule".into()))?;
        if let Some(r) = left_recursive(&rules) {
            return Err(GrammarError(format!(
                "grammar: rule `{}` is left-recursive (not supported, as in llama.cpp)",
                names[r]
            )));
        }
        let mut syms = Vec::new();
        let mut alts = Vec::with_capacity(rules.len());
        for rule in &rules {
            let mut starts = Vec::with_capacity(rule.len());
            for alt in rule {
                starts.push(syms.len() as u32);
                syms.extend_from_slice(alt);
                syms.push(Sym::End);
            }
            alts.push(starts);
        }
        Ok(Grammar {
            syms,
            alts,
            sets,
            root,
        })
    }
}

/// A rule that can reach itself without consuming a code point, if any: the
/// matcher would expand it forever.
fn left_recursive(rules: &[Alternatives]) -> Option<usize> {
    let n = rules.len();
    // Which rules derive the empty string (a fixpoint).
    let mut nullable = vec![false; n];
    loop {
        let mut changed = false;
        for (r, alts) in rules.iter().enumerate() {
            if !nullable[r]
                && alts.iter().any(|alt| {
                    alt.iter()
                        .all(|s| matches!(s, Sym::Rule(x) if nullable[*x as usize]))
                })
            {
                nullable[r] = true;
                changed = true;
            }
        }
        if !changed {
            break;
        }
    }
    // Edges to the rules an alternative can start with.
    let starts = |r: usize| -> Vec<usize> {
        let mut out = Vec::new();
        for alt in &rules[r] {
            for s in alt {
                match *s {
                    Sym::Rule(x) => {
                        out.push(x as usize);
                        if !nullable[x as usize] {
                            break;
                        }
                    }
                    _ => break,
                }
            }
        }
        out
    };
    // Iterative depth-first search for a cycle (0 new, 1 on the path, 2 done).
    let mut state = vec![0u8; n];
    for start in 0..n {
        if state[start] != 0 {
            continue;
        }
        let mut path: Vec<(usize, Vec<usize>, usize)> = vec![(start, starts(start), 0)];
        state[start] = 1;
        while let Some((r, next, i)) = path.last_mut() {
            if let Some(&x) = next.get(*i) {
                *i += 1;
                match state[x] {
                    1 => return Some(x),
                    0 => {
                        state[x] = 1;
                        let e = starts(x);
                        path.push((x, e, 0));
                    }
                    _ => {}
                }
            } else {
                state[*r] = 2;
                path.pop();
            }
        }
    }
    None
}
