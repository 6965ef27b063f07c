//! JSON Schema's `pattern`: an ECMA-262 regular expression, as GBNF over the
//! JSON text of the strings it matches.
//!
//! A schema's pattern constrains a string's *value*; the grammar constrains
//! the text the model writes, escapes included. Each character the pattern
//! allows becomes its JSON text: itself, or `\"`, `\\`, `\b` `\f` `\n` `\r`
//! `\t`, or `\u00XX` for the other control characters and DEL (the forms the
//! `char` rule of a plain string uses). So every document the grammar allows
//! is valid JSON whose string matches the pattern. (llama.cpp copies the
//! pattern's characters into the grammar as they are, so its `.` or `[^a]`
//! can write a bare `"` that ends the string early.)
//!
//! As in JSON Schema, a pattern matches anywhere in the string unless it is
//! anchored: `abc` allows any string containing `abc`, `^abc$` only `abc`.
//! (llama.cpp refuses patterns that are not anchored at both ends.)
//!
//! Supported: literals, `.` (anything but a line terminator), classes
//! `[...]` and `[^...]` with ranges, the escapes `\d \D \w \W \s \S`, `\t \n
//! \r \f \v \0 \cX \xHH \uHHHH` (a surrogate pair as one character), any
//! escaped punctuation, groups `(...)`, `(?:...)` and `(?<name>...)`,
//! alternation `|`, the quantifiers `* + ? {n} {n,} {n,m}` (greedy or lazy:
//! the same strings), and `^`/`$` at the ends of the pattern or of its
//! top-level alternatives. Refused with an error: back-references,
//! lookaround, word boundaries, Unicode property escapes, anchors anywhere
//! else, counts above [`MAX_REPETITION`] and nesting deeper than
//! [`MAX_NESTING`]. Characters are Unicode code points (as with ECMA-262's
//! `u` flag, and as most JSON Schema validators match), so `.` matches one
//! emoji, not half of its UTF-16 pair.

use std::collections::HashMap;

use super::json_schema::literal;
use super::{MAX_NESTING, MAX_REPETITION};

/// The largest code point.
const MAX_CHAR: u32 = 0x10_FFFF;

/// A set of code points as sorted, disjoint, non-adjacent inclusive ranges.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Set(Vec<(u32, u32)>);

impl Set {
    fn of(ranges: impl IntoIterator<Item = (u32, u32)>) -> Set {
        let mut r: Vec<(u32, u32)> = ranges.into_iter().collect();
        r.sort_unstable();
        let mut out: Vec<(u32, u32)> = Vec::with_capacity(r.len());
        for (lo, hi) in r {
            match out.last_mut() {
                Some(last) if lo <= last.1.saturating_add(1) => last.1 = last.1.max(hi),
                _ => out.push((lo, hi)),
            }
        }
        Set(out)
    }

    fn char(c: u32) -> Set {
        Set(vec![(c, c)])
    }

    fn all() -> Set {
        Set(vec![(0, MAX_CHAR)])
    }

    fn complement(&self) -> Set {
        let mut out = Vec::new();
        let mut next = 0u32;
        for &(lo, hi) in &self.0 {
            if lo > next {
                out.push((next, lo - 1));
            }
            next = hi.saturating_add(1);
        }
        if next <= MAX_CHAR {
            out.push((next, MAX_CHAR));
        }
        Set(out)
    }

    fn union(&self, other: &Set) -> Set {
        Set::of(self.0.iter().chain(&other.0).copied())
    }

    fn minus(&self, other: &Set) -> Set {
        // A \ B = complement(complement(A) | B).
        self.complement().union(other).complement()
    }

    fn contains(&self, c: u32) -> bool {
        self.0.iter().any(|&(lo, hi)| lo <= c && c <= hi)
    }

    /// The one character of a set of one (a scalar value, not a surrogate).
    fn single(&self) -> Option<u32> {
        match self.0.as_slice() {
            [(lo, hi)] if lo == hi && char::from_u32(*lo).is_some() => Some(*lo),
            _ => None,
        }
    }
}

/// `\d`.
fn digits() -> Set {
    Set::of([(0x30, 0x39)])
}

/// `\w`.
fn word() -> Set {
    Set::of([(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)])
}

/// `\s`: ECMA-262's WhiteSpace and LineTerminator.
fn space() -> Set {
    Set::of([
        (0x09, 0x0D),
        (0x20, 0x20),
        (0xA0, 0xA0),
        (0x1680, 0x1680),
        (0x2000, 0x200A),
        (0x2028, 0x2029),
        (0x202F, 0x202F),
        (0x205F, 0x205F),
        (0x3000, 0x3000),
        (0xFEFF, 0xFEFF),
    ])
}

/// `.`: anything but a line terminator.
fn dot() -> Set {
    Set::of([(0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029)]).complement()
}

/// A pattern, parsed.
#[derive(Clone, Debug)]
enum Node {
    /// One character of a set.
    Chars(Set),
    Seq(Vec<Node>),
    Alt(Vec<Node>),
    /// At least `min`, at most `max` (unbounded if `None`) of the node.
    Repeat(Box<Node>, u32, Option<u32>),
}

struct Parser {
    chars: Vec<char>,
    pos: usize,
    depth: usize,
}

impl Parser {
    fn peek(&self) -> Option<char> {
        self.chars.get(self.pos).copied()
    }

    fn peek_at(&self, ahead: usize) -> Option<char> {
        self.chars.get(self.pos + ahead).copied()
    }

    fn eat(&mut self, c: char) -> bool {
        if self.peek() == Some(c) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    fn err<T>(&self, what: &str) -> Result<T, String> {
        Err(format!("{what} (at character {})", self.pos))
    }

    /// The whole pattern: top-level alternatives, each anchored or matched
    /// anywhere in the string.
    fn pattern(&mut self) -> Result<Node, String> {
        let mut alts = Vec::new();
        loop {
            let start = self.eat('^');
            let seq = self.sequence(true)?;
            if self.peek() == Some(')') {
                return self.err("unmatched `)`");
            }
            let end = self.eat('$');
            if !(self.peek().is_none() || self.peek() == Some('|')) {
                return self.err("`$` may only end the pattern or a top-level alternative");
            }
            let anywhere = || Node::Repeat(Box::new(Node::Chars(Set::all())), 0, None);
            let mut parts = Vec::new();
            if !start {
                parts.push(anywhere());
            }
            parts.push(seq);
            if !end {
                parts.push(anywhere());
            }
            alts.push(Node::Seq(parts));
            if !self.eat('|') {
                break;
            }
        }
        Ok(alternation(alts))
    }

    /// Alternatives inside a group, up to its `)`.
    fn alternatives(&mut self) -> Result<Node, String> {
        let mut alts = vec![self.sequence(false)?];
        while self.eat('|') {
            alts.push(self.sequence(false)?);
        }
        Ok(alternation(alts))
    }

    /// Quantified atoms up to `|`, `)`, the end, or (at the top level) a
    /// final `$`.
    fn sequence(&mut self, top: bool) -> Result<Node, String> {
        let mut items = Vec::new();
        while let Some(c) = self.peek() {
            match c {
                '|' | ')' => break,
                '$' if top => break,
                '^' | '$' => {
                    return self.err(
                        "`^` and `$` are supported only at the ends of the pattern \
                         or of its top-level alternatives",
                    )
                }
                _ => {}
            }
            let atom = self.atom()?;
            items.push(self.quantified(atom)?);
        }
        Ok(Node::Seq(items))
    }

    fn atom(&mut self) -> Result<Node, String> {
        let Some(c) = self.peek() else {
            return self.err("unexpected end");
        };
        self.pos += 1;
        Ok(match c {
            '.' => Node::Chars(dot()),
            '[' => Node::Chars(self.class()?),
            '(' => {
                if self.depth >= MAX_NESTING {
                    return self.err(&format!("groups nest deeper than {MAX_NESTING}"));
                }
                if self.eat('?') {
                    if self.eat(':') {
                    } else if self.peek() == Some('<')
                        && !matches!(self.peek_at(1), Some('=' | '!'))
                    {
                        // A named group: skip the name.
                        while let Some(c) = self.peek() {
                            self.pos += 1;
                            if c == '>' {
                                break;
                            }
                        }
                    } else if matches!(self.peek(), Some('=' | '!' | '<')) {
                        return self.err("lookaround assertions are not supported");
                    } else {
                        return self
                            .err("groups `(?` other than `(?:` and `(?<name>` are not supported");
                    }
                }
                self.depth += 1;
                let inner = self.alternatives()?;
                self.depth -= 1;
                if !self.eat(')') {
                    return self.err("unclosed group");
                }
                inner
            }
            '*' | '+' | '?' => return self.err("nothing to repeat"),
            '{' if self.counts(self.pos).is_some() => return self.err("nothing to repeat"),
            '\\' => match self.escape(false)? {
                Escaped::Char(c) => Node::Chars(Set::char(c)),
                Escaped::Class(s) => Node::Chars(s),
            },
            c => Node::Chars(Set::char(c as u32)),
        })
    }

    /// The counts of `{n}`, `{n,}` or `{n,m}` whose `{` is just before
    /// `from`, and how many characters after the `{` they take; `None` if
    /// the text there is not one (then `{` is a literal).
    fn counts(&self, from: usize) -> Option<(usize, u64, Option<u64>)> {
        let mut i = from;
        let number = |i: &mut usize| -> Option<u64> {
            let start = *i;
            let mut v: u64 = 0;
            while let Some(d) = self.chars.get(*i).and_then(|c| c.to_digit(10)) {
                v = v.saturating_mul(10).saturating_add(u64::from(d));
                *i += 1;
            }
            (*i > start).then_some(v)
        };
        let min = number(&mut i)?;
        let max = if self.chars.get(i) == Some(&',') {
            i += 1;
            number(&mut i)
        } else {
            Some(min)
        };
        (self.chars.get(i) == Some(&'}')).then_some((i + 1 - from, min, max))
    }

    fn quantified(&mut self, atom: Node) -> Result<Node, String> {
        let (min, max) = match self.peek() {
            Some('*') => (0, None),
            Some('+') => (1, None),
            Some('?') => (0, Some(1)),
            Some('{') => match self.counts(self.pos + 1) {
                Some((len, min, max)) => {
                    self.pos += len;
                    (min, max)
                }
                // A literal `{`: the next atom.
                None => return Ok(atom),
            },
            _ => return Ok(atom),
        };
        // The quantifier's first character (`*`, `+`, `?` or `{`).
        self.pos += 1;
        // Lazy: the same strings.
        self.eat('?');
        if matches!(self.peek(), Some('*' | '+' | '?')) {
            return self.err("nothing to repeat");
        }
        let limit = u64::from(MAX_REPETITION);
        if min > limit || max.is_some_and(|m| m > limit) {
            return self.err(&format!("repetition counts above {MAX_REPETITION}"));
        }
        if max.is_some_and(|m| m < min) {
            return self.err("numbers out of order in a `{n,m}` quantifier");
        }
        // Both fit in u32: they are at most MAX_REPETITION.
        let min = min as u32;
        Ok(Node::Repeat(Box::new(atom), min, max.map(|m| m as u32)))
    }

    /// A class, after its `[`.
    fn class(&mut self) -> Result<Set, String> {
        let negated = self.eat('^');
        let mut set = Set(Vec::new());
        loop {
            let Some(c) = self.peek() else {
                return self.err("unclosed character class");
            };
            if c == ']' {
                self.pos += 1;
                break;
            }
            let lo = self.class_atom()?;
            // A range, unless `-` is last or either end is a class escape.
            if self.peek() == Some('-') && self.peek_at(1).is_some_and(|n| n != ']') {
                if let Escaped::Char(a) = lo {
                    let save = self.pos;
                    self.pos += 1;
                    match self.class_atom()? {
                        Escaped::Char(b) => {
                            if b < a {
                                return self.err("range out of order in character class");
                            }
                            set = set.union(&Set::of([(a, b)]));
                            continue;
                        }
                        Escaped::Class(_) => self.pos = save,
                    }
                }
            }
            set = set.union(&match lo {
                Escaped::Char(c) => Set::char(c),
                Escaped::Class(s) => s,
            });
        }
        Ok(if negated { set.complement() } else { set })
    }

    fn class_atom(&mut self) -> Result<Escaped, String> {
        let Some(c) = self.peek() else {
            return self.err("unclosed character class");
        };
        self.pos += 1;
        if c == '\\' {
            self.escape(true)
        } else {
            Ok(Escaped::Char(c as u32))
        }
    }

    /// An escape, after its `\`.
    fn escape(&mut self, in_class: bool) -> Result<Escaped, String> {
        let Some(c) = self.peek() else {
            return self.err("`\\` at the end of the pattern");
        };
        self.pos += 1;
        let class = |s: Set| Ok(Escaped::Class(s));
        let char = |c: u32| Ok(Escaped::Char(c));
        match c {
            'd' => class(digits()),
            'D' => class(digits().complement()),
            'w' => class(word()),
            'W' => class(word().complement()),
            's' => class(space()),
            'S' => class(space().complement()),
            't' => char(0x09),
            'n' => char(0x0A),
            'v' => char(0x0B),
            'f' => char(0x0C),
            'r' => char(0x0D),
            'b' if in_class => char(0x08),
            'b' | 'B' => self.err("word boundaries (`\\b`, `\\B`) are not supported"),
            '0' if !self.peek().is_some_and(|d| d.is_ascii_digit()) => char(0),
            '1'..='9' | 'k' => self.err("back-references are not supported"),
            'p' | 'P' => self.err("Unicode property escapes are not supported"),
            'c' => match self.peek() {
                Some(l) if l.is_ascii_alphabetic() => {
                    self.pos += 1;
                    char(l as u32 % 32)
                }
                _ => self.err("`\\c` must be followed by a letter"),
            },
            'x' => char(self.hex(2)?),
            'u' => {
                let hi = self.hex(4)?;
                if (0xD800..0xDC00).contains(&hi)
                    && self.peek() == Some('\\')
                    && self.peek_at(1) == Some('u')
                {
                    let save = self.pos;
                    self.pos += 2;
                    let lo = self.hex(4)?;
                    if (0xDC00..0xE000).contains(&lo) {
                        return char(0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00));
                    }
                    self.pos = save;
                }
                if (0xD800..0xE000).contains(&hi) {
                    return self.err("a lone surrogate cannot be in a JSON string's text");
                }
                char(hi)
            }
            c if c.is_ascii_alphanumeric() => self.err(&format!("unsupported escape `\\{c}`")),
            c => char(c as u32),
        }
    }

    fn hex(&mut self, n: usize) -> Result<u32, String> {
        let mut v = 0;
        for _ in 0..n {
            match self.peek().and_then(|c| c.to_digit(16)) {
                Some(d) => {
                    v = v * 16 + d;
                    self.pos += 1;
                }
                None => return self.err(&format!("expected {n} hex digits")),
            }
        }
        Ok(v)
    }
}

/// One alternative as itself, several as a [`Node::Alt`].
fn alternation(mut alts: Vec<Node>) -> Node {
    if alts.len() == 1 {
        alts.pop().unwrap_or(Node::Seq(Vec::new()))
    } else {
        Node::Alt(alts)
    }
}

/// What an escape stands for.
enum Escaped {
    Char(u32),
    Class(Set),
}

/// Whether `n` matches the empty string.
fn nullable(n: &Node) -> bool {
    match n {
        Node::Chars(_) => false,
        Node::Seq(items) => items.iter().all(nullable),
        Node::Alt(alts) => alts.iter().any(nullable),
        Node::Repeat(inner, min, max) => *min == 0 || *max == Some(0) || nullable(inner),
    }
}

/// Most nodes [`nonempty`] may build: its rewrite of a sequence of optional
/// parts is quadratic in their number, and nests.
const MAX_NODES: usize = 1 << 16;

/// Takes one node from `budget`, or fails when it is spent.
fn spend(budget: &mut usize) -> Result<(), String> {
    *budget = budget
        .checked_sub(1)
        .ok_or("the pattern is too complex (its optional parts nest too deeply)")?;
    Ok(())
}

/// A node for `n`'s strings other than the empty one (`None` if it has no
/// other).
fn nonempty(n: &Node, budget: &mut usize) -> Result<Option<Node>, String> {
    spend(budget)?;
    Ok(match n {
        Node::Chars(_) => Some(n.clone()),
        Node::Seq(items) if !items.iter().all(nullable) => Some(n.clone()),
        // All parts optional: the first non-empty part, then the rest.
        Node::Seq(items) => {
            let mut alts = Vec::new();
            for (i, item) in items.iter().enumerate() {
                if let Some(first) = nonempty(item, budget)? {
                    let mut seq = vec![first];
                    for rest in &items[i + 1..] {
                        spend(budget)?;
                        seq.push(rest.clone());
                    }
                    alts.push(Node::Seq(seq));
                }
            }
            (!alts.is_empty()).then_some(Node::Alt(alts))
        }
        Node::Alt(alts) => {
            let mut out = Vec::new();
            for a in alts {
                out.extend(nonempty(a, budget)?);
            }
            (!out.is_empty()).then_some(Node::Alt(out))
        }
        Node::Repeat(_, _, Some(0)) => None,
        Node::Repeat(inner, min, max) => {
            if nullable(inner) {
                // Each repetition is empty or not, and the empty ones can go.
                nonempty(inner, budget)?.map(|x| Node::Repeat(Box::new(x), 1, *max))
            } else {
                Some(Node::Repeat(inner.clone(), (*min).max(1), *max))
            }
        }
    })
}

/// `n` with no repetition of a node that matches the empty string (GBNF
/// repeats `x*` as `r ::= x r |`, left-recursive where `x` may be empty):
/// `x{m,n}` with such an `x` matches what `x'{0,n}` does, `x'` being `x`
/// without the empty string.
fn without_empty_loops(n: Node, budget: &mut usize) -> Result<Node, String> {
    spend(budget)?;
    Ok(match n {
        Node::Chars(_) => n,
        Node::Seq(items) => Node::Seq(
            items
                .into_iter()
                .map(|i| without_empty_loops(i, budget))
                .collect::<Result<_, _>>()?,
        ),
        Node::Alt(alts) => Node::Alt(
            alts.into_iter()
                .map(|a| without_empty_loops(a, budget))
                .collect::<Result<_, _>>()?,
        ),
        Node::Repeat(inner, min, max) => {
            let inner = without_empty_loops(*inner, budget)?;
            if nullable(&inner) {
                match nonempty(&inner, budget)? {
                    Some(x) => Node::Repeat(Box::new(x), 0, max),
                    None => Node::Seq(Vec::new()),
                }
            } else {
                Node::Repeat(Box::new(inner), min, max)
            }
        }
    })
}

/// Characters a JSON string cannot hold as they are: controls, `"`, `\`
/// (and DEL, which the `char` rule also escapes).
fn escaped_chars() -> Set {
    Set::of([(0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C), (0x7F, 0x7F)])
}

/// The characters JSON escapes with a backslash and a letter (or
/// themselves), and that escape.
const SHORT_ESCAPES: [(u32, &str); 7] = [
    (0x22, "\\\""),
    (0x5C, "\\\\"),
    (0x08, "\\b"),
    (0x09, "\\t"),
    (0x0A, "\\n"),
    (0x0C, "\\f"),
    (0x0D, "\\r"),
];

/// The JSON text of one character.
fn json_text(c: u32) -> String {
    if let Some(&(_, e)) = SHORT_ESCAPES.iter().find(|&&(x, _)| x == c) {
        return e.into();
    }
    match c {
        c if c < 0x20 || c == 0x7F => format!("\\u{c:04x}"),
        c => char::from_u32(c).map(String::from).unwrap_or_default(),
    }
}

/// A GBNF class of `set`'s ranges (not empty), every bound escaped.
fn class(set: &Set) -> String {
    let mut out = String::from("[");
    let esc = |c: u32| {
        if c <= 0xFF {
            format!("\\x{c:02X}")
        } else if c <= 0xFFFF {
            format!("\\u{c:04X}")
        } else {
            format!("\\U{c:08X}")
        }
    };
    for &(lo, hi) in &set.0 {
        let single = |c: u32| match char::from_u32(c) {
            Some(ch) if ch.is_ascii_alphanumeric() => ch.to_string(),
            _ => esc(c),
        };
        out.push_str(&single(lo));
        if hi > lo {
            out.push('-');
            out.push_str(&single(hi));
        }
    }
    out.push(']');
    out
}

/// GBNF for a hex digit of any case whose value is in `nibbles`.
fn hex_class(nibbles: &[u32]) -> String {
    let mut chars: Vec<u32> = Vec::new();
    for &n in nibbles {
        if n < 10 {
            chars.push(0x30 + n);
        } else {
            chars.push(0x61 + n - 10);
            chars.push(0x41 + n - 10);
        }
    }
    class(&Set::of(chars.into_iter().map(|c| (c, c))))
}

/// Writes the GBNF of a pattern, naming a rule for each set of more than a
/// few alternatives (once per distinct set) through `define`.
struct Writer<'a> {
    define: &'a mut dyn FnMut(String) -> String,
    named: HashMap<Set, String>,
}

impl Writer<'_> {
    /// The expression for one character of `set`, as JSON text.
    fn chars(&mut self, set: &Set) -> String {
        if let Some(c) = set.single() {
            return literal(&json_text(c));
        }
        if let Some(name) = self.named.get(set) {
            return name.clone();
        }
        let plain = set.minus(&escaped_chars());
        let mut alts = Vec::new();
        if !plain.0.is_empty() {
            alts.push(class(&plain));
        }
        for &(c, e) in &SHORT_ESCAPES {
            if set.contains(c) {
                alts.push(literal(e));
            }
        }
        // The other controls and DEL, as `\u00XX` (by high nibble).
        for high in [0u32, 1, 7] {
            let lows: Vec<u32> = (0..16)
                .filter(|&low| {
                    let c = high * 16 + low;
                    set.contains(c)
                        && match high {
                            7 => c == 0x7F,
                            _ => !SHORT_ESCAPES.iter().any(|&(x, _)| x == c),
                        }
                })
                .collect();
            if !lows.is_empty() {
                alts.push(format!("\"\\\\u00{high}\" {}", hex_class(&lows)));
            }
        }
        let body = match alts.len() {
            0 => return "[^\\x00-\\U0010FFFF]".into(),
            1 => return alts.pop().unwrap_or_default(),
            _ => alts.join(" | "),
        };
        let name = (self.define)(body);
        self.named.insert(set.clone(), name.clone());
        name
    }

    fn node(&mut self, n: &Node) -> String {
        match n {
            Node::Chars(s) => self.chars(s),
            Node::Seq(items) => {
                let mut parts = Vec::new();
                // Runs of single characters as one literal.
                let mut run = String::new();
                for item in items {
                    if let Node::Chars(s) = item {
                        if let Some(c) = s.single() {
                            run.push_str(&json_text(c));
                            continue;
                        }
                    }
                    if !run.is_empty() {
                        parts.push(literal(&std::mem::take(&mut run)));
                    }
                    parts.push(self.node(item));
                }
                if !run.is_empty() || parts.is_empty() {
                    parts.push(literal(&run));
                }
                if parts.len() == 1 {
                    parts.pop().unwrap_or_default()
                } else {
                    format!("({})", parts.join(" "))
                }
            }
            Node::Alt(alts) => {
                let alts: Vec<String> = alts.iter().map(|a| self.node(a)).collect();
                format!("({})", alts.join(" | "))
            }
            Node::Repeat(inner, min, max) => {
                let inner = self.node(inner);
                let q = match (min, max) {
                    (0, None) => "*".to_string(),
                    (1, None) => "+".to_string(),
                    (0, Some(1)) => "?".to_string(),
                    (m, None) => format!("{{{m},}}"),
                    (m, Some(n)) if m == n => format!("{{{m}}}"),
                    (m, Some(n)) => format!("{{{m},{n}}}"),
                };
                format!("({inner}){q}")
            }
        }
    }
}

/// The GBNF expression for the text between a JSON string's quotes whose
/// value `pattern` matches. `define` adds a rule with the body it is given
/// and returns its name.
pub(super) fn pattern_to_gbnf(
    pattern: &str,
    define: &mut dyn FnMut(String) -> String,
) -> Result<String, String> {
    let mut p = Parser {
        chars: pattern.chars().collect(),
        pos: 0,
        depth: 0,
    };
    let node = without_empty_loops(p.pattern()?, &mut MAX_NODES.clone())?;
    let mut w = Writer {
        define,
        named: HashMap::new(),
    };
    Ok(w.node(&node))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sets_complement_and_subtract() {
        let s = Set::of([(5, 9), (0, 2), (3, 3), (20, 30)]);
        assert_eq!(s.0, vec![(0, 3), (5, 9), (20, 30)]);
        let c = s.complement();
        assert_eq!(c.0, vec![(4, 4), (10, 19), (31, MAX_CHAR)]);
        assert_eq!(c.complement(), s);
        assert_eq!(
            s.minus(&Set::of([(2, 6)])).0,
            vec![(0, 1), (7, 9), (20, 30)]
        );
        assert_eq!(Set::all().complement().0, vec![]);
        assert!(!dot().contains(0x0A));
        assert!(dot().contains(0x22) && dot().contains(0x10FFFF));
    }

    fn gbnf(pattern: &str) -> Result<String, String> {
        let mut n = 0;
        pattern_to_gbnf(pattern, &mut |_| {
            n += 1;
            format!("r{n}")
        })
    }

    #[test]
    fn literals_merge_and_escape() {
        assert_eq!(gbnf("^ab\"c$").unwrap(), r#""ab\\\"c""#);
        assert_eq!(gbnf("^a\\.b$").unwrap(), r#""a.b""#);
        assert_eq!(gbnf("^\\n$").unwrap(), r#""\\n""#);
        assert_eq!(gbnf("^$").unwrap(), r#""""#);
    }

    #[test]
    fn errors_name_what_is_unsupported() {
        for (p, want) in [
            ("(a", "unclosed group"),
            ("a)", "unmatched"),
            ("[a", "unclosed character class"),
            ("*a", "nothing to repeat"),
            ("a**", "nothing to repeat"),
            ("(a)\\1", "back-references"),
            ("(?=a)", "lookaround"),
            ("(?<!a)b", "lookaround"),
            ("(?i)a", "other than"),
            ("\\bword", "word boundaries"),
            ("a^b", "`^` and `$`"),
            ("(a$)", "`^` and `$`"),
            ("a$b", "`$` may only end"),
            ("a{3,2}", "out of order"),
            ("a{2001}", "above 2000"),
            ("[z-a]", "range out of order"),
            ("\\p{L}", "property"),
            ("\\q", "unsupported escape"),
            ("\\x4", "hex digits"),
            ("\\uD800", "lone surrogate"),
            ("\\", "at the end"),
        ] {
            let e = gbnf(p).unwrap_err();
            assert!(e.contains(want), "{p}: {e}");
        }
        let deep = "(".repeat(MAX_NESTING + 1) + &")".repeat(MAX_NESTING + 1);
        assert!(gbnf(&deep).unwrap_err().contains("nest deeper"));
    }
}
