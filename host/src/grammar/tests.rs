use std::collections::BTreeSet;

use proptest::prelude::*;

use super::*;

fn matcher(text: &str) -> Matcher {
    Matcher::new(Grammar::parse(text).expect("grammar parses")).expect("grammar starts")
}

fn err(text: &str) -> String {
    match Grammar::parse(text) {
        Ok(_) => panic!("{text:?} parsed"),
        Err(e) => e.0,
    }
}

#[test]
fn literals_classes_and_any() {
    let mut m = matcher(r#"root ::= "ab" [0-9] [^x-z] . "\x41\u00e9\t\"\\""#);
    assert!(m.derives("ab5qZAé\t\"\\"));
    assert!(m.derives("ab0aéAé\t\"\\"));
    assert!(!m.derives("ab5yZAé\t\"\\"), "negated class");
    assert!(!m.derives("abxqZAé\t\"\\"), "range");
    assert!(!m.derives("ab5qZAé\t\""), "too short");
    assert!(!m.derives("ab5qZAé\t\"\\!"), "too long");
}

#[test]
fn repetitions() {
    let cases: &[(&str, &[&str], &[&str])] = &[
        (r#"root ::= "a"*"#, &["", "a", "aaaa"], &["b", "ab"]),
        (r#"root ::= "a"+"#, &["a", "aaa"], &[""]),
        (r#"root ::= "a"? "b""#, &["b", "ab"], &["aab", "a"]),
        (r#"root ::= "a"{3}"#, &["aaa"], &["aa", "aaaa"]),
        (r#"root ::= "a"{2,}"#, &["aa", "aaaaa"], &["a"]),
        (r#"root ::= "a"{1,3}"#, &["a", "aa", "aaa"], &["", "aaaa"]),
        (r#"root ::= "a"{0,2} "b""#, &["b", "ab", "aab"], &["aaab"]),
        (
            r#"root ::= ("ab" | "c"){2}"#,
            &["abab", "abc", "cc"],
            &["ab", "abcc"],
        ),
        (r#"root ::= "x"{ 2 , 3 }"#, &["xx", "xxx"], &["x"]),
    ];
    for &(g, yes, no) in cases {
        let mut m = matcher(g);
        for s in yes {
            assert!(m.derives(s), "{g} should derive {s:?}");
        }
        for s in no {
            assert!(!m.derives(s), "{g} should not derive {s:?}");
        }
    }
}

#[test]
fn rules_comments_and_line_breaks() {
    let g = r#"
# a comment
root ::= greeting ws name   # trailing comment
greeting ::= "hi" |
    "hello"
name ::= (
    "bob"
  | "alice"
)
ws ::= [ \t]+
"#;
    let mut m = matcher(g);
    assert!(m.derives("hi bob"));
    assert!(m.derives("hello \talice"));
    assert!(!m.derives("hibob"));
    assert!(!m.derives("hey bob"));
}

#[test]
fn a_rule_defined_again_replaces_the_first_as_in_llama_cpp() {
    let mut m = matcher("root ::= \"a\"\nroot ::= \"b\"\n");
    assert!(m.derives("b"));
    assert!(!m.derives("a"));
}

#[test]
fn parse_errors_are_clear() {
    assert!(err("").contains("no `root` rule"));
    assert!(err("start ::= \"a\"").contains("no `root` rule"));
    assert!(err("root ::= missing").contains("undefined rule `missing`"));
    assert!(err("root ::= root \"a\" | \"b\"").contains("left-recursive"));
    // Through a rule that can be empty.
    assert!(err("root ::= opt root \"a\" | \"b\"\nopt ::= \"x\"?").contains("left-recursive"));
    assert!(err("root ::= (\"\")*").contains("left-recursive"));
    assert!(err("root ::= \"a").contains("end of input"));
    assert!(err("root ::= [a-").contains("end of input"));
    assert!(err("root ::= \"\\q\"").contains("unknown escape"));
    assert!(err("root ::= \"\\x4\"").contains("hex digits"));
    assert!(err("root ::= \"a\"{2001}").contains("2001 repetitions"));
    assert!(err("root ::= \"a\"{99999999999999999999}").contains("repetitions"));
    assert!(err("root ::= \"a\"{3,1}").contains("below the minimum"));
    assert!(err("root ::= \"a\"{x}").contains("expecting an integer"));
    assert!(err("root ::= *").contains("expecting an item"));
    assert!(err("root ::= (\"a\"").contains("expecting ')'"));
    assert!(err("root = \"a\"").contains("expecting ::="));
    assert!(err("root ::= \"a\" )").contains("expecting a line break"));
    let e = err("root ::= \"a\"\nx ::= \"b\" }");
    assert!(e.contains("line 2, column 11"), "{e}");
    let deep = format!("root ::= {}\"a\"{}", "(".repeat(300), ")".repeat(300));
    assert!(err(&deep).contains("nested deeper"));
    // Repetitions that would write out too many symbols.
    // (A group repeats as one rule reference; a literal's code points are
    // copied.)
    let wide = format!("root ::= \"{}\"{{2000}}", "ab".repeat(300));
    assert!(err(&wide).contains("symbols"));
}

#[test]
fn partial_utf8_follows_llama_cpp() {
    let mut m = matcher("root ::= \"é\" \"x\"");
    // é is C3 A9: the first byte alone may still become é.
    assert!(m.allows(&[0xc3]));
    assert!(!m.allows(&[0xc4]), "C4 starts U+0100..U+013F");
    m.accept(&[0xc3]).unwrap();
    assert!(!m.can_end());
    assert!(m.allows(&[0xa9]));
    assert!(m.allows(&[0xa9, b'x']));
    assert!(!m.allows(b"x"), "a continuation byte is due");
    m.accept(&[0xa9, b'x']).unwrap();
    assert!(m.can_end());

    let mut neg = matcher("root ::= [^é]");
    // The partial sequence may complete to é: a negated set refuses it.
    assert!(!neg.allows(&[0xc3]));
    assert!(neg.allows(&[0xc4]));
    assert!(neg.allows("ç".as_bytes()));
    // Invalid UTF-8, an empty piece, a leading NUL: never.
    let mut any = matcher("root ::= .*");
    assert!(!any.allows(&[0x80]));
    assert!(!any.allows(&[]));
    assert!(!any.allows(&[0, b'a']));
    assert!(any.allows(b"a\0b"), "read up to the NUL, as a C string");
    // Bytes inside a sequence must continue it (stricter than llama.cpp),
    // and F8-FF start nothing.
    assert!(!any.allows(&[0xf0, b'A', b'B', b'C']));
    assert!(!any.allows(&[0xe2, 0x82, b'x']));
    assert!(any.allows(&[0xe2, 0x82, 0xac, b'x']));
    assert!(!any.allows(&[0xf8]));
    // Overlong, surrogate and past U+10FFFF, whole or begun.
    assert!(!any.allows(&[0xe0, 0x80, 0x80]));
    assert!(!any.allows(&[0xe0, 0x9f]));
    assert!(!any.allows(&[0xed, 0xa0, 0x80]));
    assert!(!any.allows(&[0xed, 0xa0]));
    assert!(!any.allows(&[0xf4, 0x90]));
    assert!(!any.allows(&[0xf5]));
    assert!(any.allows(&[0xf4, 0x8f]));
    assert!(any.allows("😀".as_bytes()));
    // An overlong two-byte start (C0, C1) cannot complete to anything valid.
    assert!(!any.allows(&[0xc1]));
    assert!(any.allows(&[0xe0]));
    // A four-byte sequence split over tokens.
    any.accept(&[0xf0, 0x9f]).unwrap();
    assert!(!any.allows(b"a"));
    assert!(any.allows(&[0x98, 0x80, b'a']));
}

#[test]
fn accept_refuses_without_changing_the_state() {
    let mut m = matcher("root ::= \"ab\"");
    assert!(m.accept(b"b").is_err());
    m.accept(b"a").unwrap();
    assert!(m.accept(b"c").is_err());
    m.accept(b"b").unwrap();
    assert!(m.can_end());
    assert!(m.accept(b"b").is_err(), "nothing after the end");
}

#[test]
fn deep_nesting_is_an_error_not_a_crash() {
    let mut m = matcher("root ::= \"(\" root \")\" | \"\"");
    assert!(m.derives("((()))"));
    let deep = "(".repeat(MAX_DEPTH + 10);
    let e = m.accept(deep.as_bytes()).unwrap_err();
    assert!(e.0.contains("deeper"), "{e}");
    // The state did not move: it still starts at the beginning.
    assert!(m.allows(b"("));
}

#[test]
fn tokens_end_generation_only_where_the_grammar_may_end() {
    // Tokens: 0 "a", 1 "b", 2 "ab", 3 EOG, 4 "" (empty), 5 "\xc3", 6 "\xa9".
    let pieces: [(&[u8], bool); 7] = [
        (b"a", false),
        (b"b", false),
        (b"ab", false),
        (b"</s>", true),
        (b"", false),
        (&[0xc3], false),
        (&[0xa9], false),
    ];
    let g = Grammar::parse("root ::= \"a\" \"b\"? | \"é\"").unwrap();
    let mut tg = TokenGrammar::from_pieces(g, pieces).unwrap();
    let allowed = |tg: &mut TokenGrammar| (0..8).filter(|&t| tg.allows(t)).collect::<Vec<u32>>();
    assert_eq!(allowed(&mut tg), [0, 2, 5]);
    tg.accept(0).unwrap();
    assert_eq!(allowed(&mut tg), [1, 3]);
    tg.accept(1).unwrap();
    assert_eq!(allowed(&mut tg), [3]);
    tg.accept(3).unwrap();
    tg.reset();
    assert!(tg.accept(3).is_err(), "end before the grammar may end");
    assert!(tg.accept(7).is_err(), "outside the vocabulary");
    tg.accept(5).unwrap();
    assert_eq!(allowed(&mut tg), [6]);
}

// --- Property test: the matcher against a plain reference --------------

/// A regular expression over a small alphabet, written out as GBNF and
/// matched by [`ends`] directly.
#[derive(Clone, Debug)]
enum Re {
    Lit(Vec<char>),
    Class(bool, Vec<(char, char)>),
    Any,
    Seq(Vec<Re>),
    Alt(Vec<Re>),
    Rep(Box<Re>, u32, Option<u32>),
    /// A named rule `r{index}` (defined after the root).
    Named(usize),
}

const ALPHABET: [char; 3] = ['a', 'b', 'é'];

/// Every position `re` can end at starting from `start` in `s`.
fn ends(re: &Re, rules: &[Re], s: &[char], start: usize) -> BTreeSet<usize> {
    match re {
        Re::Lit(cs) => {
            let end = start + cs.len();
            if s.get(start..end) == Some(cs.as_slice()) {
                [end].into()
            } else {
                BTreeSet::new()
            }
        }
        Re::Class(neg, ranges) => match s.get(start) {
            Some(&c) if ranges.iter().any(|&(lo, hi)| lo <= c && c <= hi) != *neg => {
                [start + 1].into()
            }
            _ => BTreeSet::new(),
        },
        Re::Any => match s.get(start) {
            Some(_) => [start + 1].into(),
            None => BTreeSet::new(),
        },
        Re::Seq(items) => {
            let mut at: BTreeSet<usize> = [start].into();
            for item in items {
                at = at.iter().flat_map(|&p| ends(item, rules, s, p)).collect();
            }
            at
        }
        Re::Alt(alts) => alts.iter().flat_map(|a| ends(a, rules, s, start)).collect(),
        Re::Rep(body, min, max) => {
            let mut at: BTreeSet<usize> = [start].into();
            let mut out = BTreeSet::new();
            let mut n = 0u32;
            loop {
                if n >= *min {
                    out.extend(at.iter().copied());
                }
                if max.is_some_and(|m| n >= m) || at.is_empty() || n > s.len() as u32 + min {
                    break;
                }
                at = at.iter().flat_map(|&p| ends(body, rules, s, p)).collect();
                n += 1;
            }
            out
        }
        Re::Named(i) => ends(&rules[*i], rules, s, start),
    }
}

fn nullable(re: &Re, rules: &[Re]) -> bool {
    ends(re, rules, &[], 0).contains(&0)
}

fn gbnf_char(c: char, escape: bool) -> String {
    match c {
        '"' => "\\\"".into(),
        '\\' => "\\\\".into(),
        ']' => "\\]".into(),
        '[' => "\\[".into(),
        c if escape && c as u32 <= 0xff => format!("\\x{:02x}", c as u32),
        c if escape => format!("\\u{:04x}", c as u32),
        c => c.to_string(),
    }
}

fn gbnf(re: &Re, escape: bool) -> String {
    match re {
        Re::Lit(cs) => format!(
            "\"{}\"",
            cs.iter().map(|&c| gbnf_char(c, escape)).collect::<String>()
        ),
        Re::Class(neg, ranges) => format!(
            "[{}{}]",
            if *neg { "^" } else { "" },
            ranges
                .iter()
                .map(|&(lo, hi)| if lo == hi {
                    gbnf_char(lo, escape)
                } else {
                    format!("{}-{}", gbnf_char(lo, escape), gbnf_char(hi, escape))
                })
                .collect::<String>()
        ),
        Re::Any => ".".into(),
        Re::Seq(items) if items.is_empty() => "\"\"".into(),
        Re::Seq(items) => format!(
            "({})",
            items
                .iter()
                .map(|i| gbnf(i, escape))
                .collect::<Vec<_>>()
                .join(" ")
        ),
        Re::Alt(alts) => format!(
            "({})",
            alts.iter()
                .map(|a| gbnf(a, escape))
                .collect::<Vec<_>>()
                .join(" | ")
        ),
        Re::Rep(body, min, max) => {
            let b = gbnf(body, escape);
            match (min, max) {
                (0, None) => format!("{b}*"),
                (1, None) => format!("{b}+"),
                (0, Some(1)) => format!("{b}?"),
                (m, None) => format!("{b}{{{m},}}"),
                (m, Some(x)) if m == x => format!("{b}{{{m}}}"),
                (m, Some(x)) => format!("{b}{{{m},{x}}}"),
            }
        }
        Re::Named(i) => format!("r{i}"),
    }
}

fn alphabet_char() -> impl Strategy<Value = char> {
    prop::sample::select(ALPHABET.to_vec())
}

/// An expression that may name rules `from..n_rules` (rules only name later
/// ones: no recursion).
fn re(from: usize, n_rules: usize) -> impl Strategy<Value = Re> {
    let leaf = prop_oneof![
        prop::collection::vec(alphabet_char(), 0..3).prop_map(Re::Lit),
        (
            any::<bool>(),
            prop::collection::vec((alphabet_char(), alphabet_char()), 1..3)
        )
            .prop_map(|(n, r)| Re::Class(n, r)),
        Just(Re::Any),
        (from..n_rules.max(from + 1)).prop_map(move |i| if i < n_rules {
            Re::Named(i)
        } else {
            Re::Lit(vec!['a'])
        }),
    ];
    leaf.prop_recursive(3, 12, 3, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..3).prop_map(Re::Seq),
            prop::collection::vec(inner.clone(), 1..3).prop_map(Re::Alt),
            (inner, 0u32..3, prop::option::of(0u32..3)).prop_map(|(b, min, extra)| Re::Rep(
                Box::new(b),
                min,
                extra.map(|e| min + e)
            )),
        ]
    })
}

/// Unbounded repetitions of a body that can be empty are left-recursive
/// once rewritten (refused by llama.cpp and here): bound them.
fn bound_empty_loops(re: Re, rules: &[Re]) -> Re {
    match re {
        Re::Seq(items) => Re::Seq(
            items
                .into_iter()
                .map(|i| bound_empty_loops(i, rules))
                .collect(),
        ),
        Re::Alt(alts) => Re::Alt(
            alts.into_iter()
                .map(|a| bound_empty_loops(a, rules))
                .collect(),
        ),
        Re::Rep(body, min, max) => {
            let body = bound_empty_loops(*body, rules);
            let max = match max {
                None if nullable(&body, rules) => Some(min + 2),
                m => m,
            };
            Re::Rep(Box::new(body), min, max)
        }
        other => other,
    }
}

/// Every string over the alphabet up to `len` code points.
fn all_strings(len: usize) -> Vec<Vec<char>> {
    let mut out = vec![Vec::new()];
    let mut last = vec![Vec::new()];
    for _ in 0..len {
        let mut next = Vec::new();
        for s in &last {
            for &c in &ALPHABET {
                let mut t: Vec<char> = s.clone();
                t.push(c);
                next.push(t);
            }
        }
        out.extend(next.iter().cloned());
        last = next;
    }
    out
}

fn grammar_strategy() -> impl Strategy<Value = (Re, Vec<Re>, bool)> {
    (0usize..3).prop_flat_map(|n| {
        let rules: Vec<_> = (0..n).map(|i| re(i + 1, n).boxed()).collect();
        (re(0, n), rules, any::<bool>())
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    /// For every string of up to 4 code points, the matcher derives it iff
    /// the plain reference does; and feeding its bytes one token at a time
    /// (splitting `é`) agrees too, with end of generation allowed exactly at
    /// the end of a derived string.
    #[test]
    fn matcher_agrees_with_a_plain_reference((root, rules, escape) in grammar_strategy()) {
        // Rules only name later rules, so bounding goes back to front.
        let mut fixed = vec![Re::Lit(vec![]); rules.len()];
        for i in (0..rules.len()).rev() {
            fixed[i] = bound_empty_loops(rules[i].clone(), &fixed);
        }
        let root = bound_empty_loops(root, &fixed);
        let mut text = format!("root ::= {}\n", gbnf(&root, escape));
        for (i, r) in fixed.iter().enumerate() {
            text += &format!("r{i} ::= {}\n", gbnf(r, escape));
        }
        let g = Grammar::parse(&text).map_err(|e| TestCaseError::fail(format!("{text}: {e}")))?;
        let mut m = Matcher::new(g.clone()).unwrap();
        let mut bytes: Vec<(Vec<u8>, bool)> = (0..=255u8).map(|b| (vec![b], false)).collect();
        bytes.push((b"<eog>".to_vec(), true));
        let mut tg = TokenGrammar::from_pieces(g, bytes.iter().map(|(p, e)| (p.as_slice(), *e))).unwrap();
        for s in all_strings(4) {
            let want = ends(&root, &fixed, &s, 0).contains(&s.len());
            let string: String = s.iter().collect();
            prop_assert_eq!(m.derives(&string), want, "{}: {:?}", text, string);
            tg.reset();
            let mut fed = true;
            for &b in string.as_bytes() {
                if !tg.allows(u32::from(b)) {
                    fed = false;
                    break;
                }
                tg.accept(u32::from(b)).unwrap();
            }
            let end = fed && tg.allows(256);
            prop_assert_eq!(end, want, "{}: bytes of {:?}", text, string);
        }
    }

    /// Parsing arbitrary text never panics, and a grammar that parses starts.
    #[test]
    fn parsing_anything_is_an_answer(text in "[a-z:= \"|()*+?{},0-9\\[\\]^.\\\\\n#-]{0,60}") {
        if let Ok(g) = Grammar::parse(&text) {
            let mut m = Matcher::new(g).unwrap();
            let _ = m.allows(b"a");
            let _ = m.accept(b"ab");
        }
    }
}

/// The shipped JSON grammar derives JSON objects and nothing else it is
/// shown (checked against serde_json on each example).
#[test]
fn the_json_grammar_derives_json_objects() {
    let mut m = matcher(include_str!("../../../grammars/json.gbnf"));
    let examples = [
        r#"{}"#,
        r#"{"a": 1}"#,
        "{\n  \"a\": [1, -2.5e+3, true, null, \"x\\u00e9\\n\"],\n  \"b\": {\"c\": {}}\n}",
        r#"{"k": "é ☃ 😀", "n": 0.5, "e": [], "f": false} "#,
        r#"{"a": 01}"#,
        r#"{"a": 1,}"#,
        r#"{"a" 1}"#,
        r#"[1, 2]"#,
        r#"{"a": "\q"}"#,
        "{\"a\": \"tab\there\"}",
        r#"{'a': 1}"#,
        r#"{"a": 1e}"#,
        r#"{"a": -}"#,
    ];
    for text in examples {
        let json = serde_json::from_str::<serde_json::Value>(text).is_ok_and(|v| v.is_object());
        assert_eq!(m.derives(text), json, "{text:?}");
    }
}

// --- JSON Schema -------------------------------------------------------

fn schema_matcher(schema: &str) -> Matcher {
    let gbnf = json_schema_to_gbnf(schema).unwrap_or_else(|e| panic!("{schema}: {e}"));
    let g = Grammar::parse(&gbnf).unwrap_or_else(|e| panic!("{schema}:\n{gbnf}\n{e}"));
    Matcher::new(g).unwrap()
}

#[test]
fn json_schemas_become_grammars_of_their_documents() {
    let cases: &[(&str, &[&str], &[&str])] = &[
        (
            r#"{"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"]}"#,
            &[r#"{"name": "x", "age": 3}"#, r#"{"name":"é\n","age":-10}"#],
            &[
                r#"{"age": 3, "name": "x"}"#,
                r#"{"name": "x"}"#,
                r#"{"name": "x", "age": 1.5}"#,
                r#"{"name": "x", "age": 3, "z": 1}"#,
            ],
        ),
        (
            r#"{"properties": {"a": {"type": "integer"}, "b": {"type": "integer"}, "c": {"type": "integer"}}}"#,
            &[
                "{}",
                r#"{"a": 1}"#,
                r#"{"b": 1}"#,
                r#"{"a": 1, "c": 2}"#,
                r#"{"a":1,"b":2,"c":3}"#,
            ],
            &[
                r#"{"c": 1, "a": 2}"#,
                r#"{"a": 1, "a": 1}"#,
                r#"{, "a": 1}"#,
            ],
        ),
        (
            // Required first, then the optional ones, each in schema order.
            r#"{"properties": {"opt": {"type": "boolean"}, "id": {"type": "integer"}}, "required": ["id"]}"#,
            &[r#"{"id": 1}"#, r#"{"id": 1, "opt": true}"#],
            &[r#"{"opt": true, "id": 1}"#, r#"{"opt": true}"#],
        ),
        (
            r#"{"enum": ["red", "green", 1, null]}"#,
            &[r#""red""#, "1", "null"],
            &[r#""blue""#, "2"],
        ),
        (
            r#"{"const": {"a": [1, 2]}}"#,
            &[r#"{"a":[1,2]}"#],
            &[r#"{"a":[1]}"#],
        ),
        (
            r#"{"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 3}"#,
            &["[1]", "[1, 2.5, -3e2]"],
            &["[]", "[1, 2, 3, 4]", r#"["a"]"#],
        ),
        (
            r#"{"type": "array", "items": {"type": "integer"}, "maxItems": 2}"#,
            &["[]", "[1]", "[1,2]"],
            &["[1,2,3]"],
        ),
        (
            r#"{"type": "string", "minLength": 2, "maxLength": 3}"#,
            &[r#""ab""#, r#""a\"c""#, r#""\u00e9zz""#],
            &[r#""a""#, r#""abcd""#],
        ),
        (
            r#"{"type": ["string", "null"]}"#,
            &[r#""x""#, "null"],
            &["1"],
        ),
        (
            r#"{"anyOf": [{"type": "integer"}, {"type": "array", "items": {"type": "boolean"}}]}"#,
            &["7", "[true, false]"],
            &["[1]", "1.5"],
        ),
        (
            r##"{"$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}}, "required": ["v", "next"]}}, "$ref": "#/$defs/node"}"##,
            &[r#"{"v": 1, "next": {"v": 2, "next": null}}"#],
            &[r#"{"v": 1, "next": {"v": 2}}"#],
        ),
        (
            r#"{"properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": true}"#,
            &[r#"{"a": 1}"#, r#"{"a": 1, "x": [1], "y": "z"}"#],
            &[r#"{"x": 1}"#],
        ),
        (
            r#"{"additionalProperties": {"type": "integer"}}"#,
            &["{}", r#"{"k": 1, "j": 2}"#],
            &[r#"{"k": "s"}"#],
        ),
        (
            r#"{"prefixItems": [{"type": "string"}, {"type": "integer"}]}"#,
            &[r#"["a", 1]"#],
            &[r#"["a"]"#, r#"["a", 1, 2]"#],
        ),
        (
            r#"{"title": "anything", "description": "annotations only"}"#,
            &["1", r#"{"a": [null, "x"]}"#, "[]"],
            &["nul", "{"],
        ),
        ("true", &["false", r#""s""#], &["x"]),
        (
            // As pydantic writes a model's schema.
            r##"{"properties": {"name": {"title": "Name", "type": "string"}, "age": {"title": "Age", "type": "integer", "exclusiveMinimum": 0}, "tags": {"items": {"type": "string"}, "title": "Tags", "type": "array"}, "kind": {"$ref": "#/$defs/Kind"}, "note": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": null, "title": "Note"}}, "required": ["name", "age", "tags", "kind"], "title": "Person", "type": "object", "$defs": {"Kind": {"enum": ["a", "b"], "title": "Kind", "type": "string"}}}"##,
            &[
                r#"{"name": "Ann", "age": 31, "tags": [], "kind": "a"}"#,
                r#"{"name": "Bo", "age": 1, "tags": ["x", "y"], "kind": "b", "note": null}"#,
                r#"{"name": "Bo", "age": 1, "tags": ["x"], "kind": "b", "note": "hi"}"#,
            ],
            &[
                r#"{"name": "Ann", "age": 0, "tags": [], "kind": "a"}"#,
                r#"{"name": "Ann", "age": 31, "tags": [], "kind": "c"}"#,
                r#"{"name": "Ann", "age": 31, "kind": "a"}"#,
            ],
        ),
        (
            r#"{"type": "object"}"#,
            &["{}", r#"{"a": [1, {"b": null}]}"#],
            &["[]", "1"],
        ),
        (
            r#"{"type": "object", "additionalProperties": false}"#,
            &["{}"],
            &[r#"{"a": 1}"#],
        ),
        (
            r#"{"type": "string", "format": "date-time"}"#,
            &[
                r#""2024-01-31T12:00:00Z""#,
                r#""1999-12-09T23:59:59.123+02:00""#,
            ],
            &[
                r#""2024-13-01T12:00:00Z""#,
                r#""2024-01-31 12:00:00Z""#,
                r#""2024-01-31T24:00:00Z""#,
            ],
        ),
        (
            r#"{"properties": {"d": {"type": "string", "format": "date"}, "t": {"type": "string", "format": "time"}, "id": {"type": "string", "format": "uuid"}}, "required": ["d", "t", "id"]}"#,
            &[
                r#"{"d": "2024-02-29", "t": "08:30:00-05:00", "id": "123e4567-e89b-12d3-a456-426614174000"}"#,
            ],
            &[
                r#"{"d": "2024-2-29", "t": "08:30:00-05:00", "id": "123e4567-e89b-12d3-a456-426614174000"}"#,
                r#"{"d": "2024-02-29", "t": "08:30:00", "id": "123e4567-e89b-12d3-a456-426614174000"}"#,
                r#"{"d": "2024-02-29", "t": "08:30:00Z", "id": "123e4567e89b12d3a456426614174000"}"#,
            ],
        ),
    ];
    for &(schema, yes, no) in cases {
        let mut m = schema_matcher(schema);
        for doc in yes {
            assert!(m.derives(doc), "{schema} should derive {doc}");
            // Every document derived is JSON.
            serde_json::from_str::<serde_json::Value>(doc).unwrap();
        }
        for doc in no {
            assert!(!m.derives(doc), "{schema} should not derive {doc}");
        }
    }
    // Pretty-printed documents too (a line break and an indent are spaces).
    let mut m = schema_matcher(
        r#"{"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}}}}, "required": ["xs"]}"#,
    );
    let doc = serde_json::json!({"xs": [{"k": "a"}, {}, {"k": "b"}]});
    assert!(m.derives(&serde_json::to_string_pretty(&doc).unwrap()));
}

#[test]
fn json_schema_errors_name_the_keyword_and_place() {
    for (schema, want) in [
        (
            r#"{"type": "number", "multipleOf": 2}"#,
            "unsupported keyword `multipleOf` at /",
        ),
        (
            r#"{"properties": {"id": {"type": "string", "pattern": "(?=a)"}}}"#,
            "`pattern` \"(?=a)\": lookaround assertions are not supported (at character 2) at /properties/id",
        ),
        (
            r#"{"type": "string", "pattern": "^a$", "maxLength": 3}"#,
            "`pattern` with `format`, `minLength` or `maxLength` is not supported",
        ),
        (
            r#"{"properties": {"when": {"type": "string", "format": "email"}}}"#,
            "unsupported `format` \"email\" (date, time, date-time and uuid are) at /properties/when",
        ),
        (
            r#"{"properties": {"when": {"type": "string", "minimum": 3}}}"#,
            "`minimum`/`maximum` are supported for integers only at /properties/when",
        ),
        (
            r#"{"$ref": "https://example.com/s.json"}"#,
            "is not in this schema",
        ),
        (r##"{"$ref": "#/$defs/missing"}"##, "points at nothing"),
        ("false", "allows nothing"),
        (r#"{"allOf": [{}, {}]}"#, "`allOf` of more than one"),
        (
            r#"{"required": ["z"], "properties": {}}"#,
            "required property `z`",
        ),
        (
            r#"{"type": "array", "maxItems": 99999}"#,
            "`maxItems` must be a whole number",
        ),
        (r#"{"type": "date"}"#, "unknown type `date`"),
        (r#"{"enum": []}"#, "empty `enum`"),
        ("{", "not JSON"),
    ] {
        let e = json_schema_to_gbnf(schema).unwrap_err();
        assert!(e.0.contains(want), "{schema}: {e}");
    }
    // A schema that is only a reference to itself is left-recursive.
    let gbnf = json_schema_to_gbnf(r##"{"$ref": "#"}"##).unwrap();
    assert!(Grammar::parse(&gbnf)
        .unwrap_err()
        .0
        .contains("left-recursive"));
}

fn json_value() -> impl Strategy<Value = serde_json::Value> {
    use serde_json::Value as V;
    let leaf = prop_oneof![
        Just(V::Null),
        any::<bool>().prop_map(V::Bool),
        (-1_000_000i64..1_000_000).prop_map(V::from),
        (-4000i32..4000).prop_map(|k| V::from(f64::from(k) / 8.0)),
        "[a-zé\"\\\\\n\t ]{0,6}".prop_map(V::from),
    ];
    leaf.prop_recursive(3, 16, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(V::Array),
            prop::collection::btree_map("[a-z]{1,3}", inner, 0..4)
                .prop_map(|m| V::Object(m.into_iter().collect())),
        ]
    })
}

proptest! {
    /// The schema `{}` derives any JSON document, compact or pretty.
    #[test]
    fn the_empty_schema_derives_any_json(v in json_value()) {
        let mut m = schema_matcher("{}");
        let compact = serde_json::to_string(&v).unwrap();
        let pretty = serde_json::to_string_pretty(&v).unwrap();
        prop_assert!(m.derives(&compact), "{}", compact);
        prop_assert!(m.derives(&pretty), "{}", pretty);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    /// `minimum`/`maximum` (and the exclusive ones) on integers: exactly the
    /// integers within, as JSON writes them.
    #[test]
    fn integer_bounds_allow_exactly_the_integers_within(
        lo in prop::option::of(-3000i64..3000),
        span in 0i64..4000,
        exclusive in any::<bool>(),
        upper in any::<bool>(),
        probes in prop::collection::vec(-5000i64..5000, 20),
    ) {
        let hi = if upper { Some(lo.unwrap_or(-1000) + span) } else { None };
        let (lo_key, hi_key) = if exclusive {
            ("exclusiveMinimum", "exclusiveMaximum")
        } else {
            ("minimum", "maximum")
        };
        let mut schema = String::from(r#"{"type": "integer""#);
        if let Some(lo) = lo {
            schema += &format!(r#", "{lo_key}": {lo}"#);
        }
        if let Some(hi) = hi {
            schema += &format!(r#", "{hi_key}": {hi}"#);
        }
        schema += "}";
        let (min, max) = if exclusive {
            (lo.map(|v| v + 1), hi.map(|v| v - 1))
        } else {
            (lo, hi)
        };
        if min.zip(max).is_some_and(|(a, b)| a > b) {
            prop_assert!(json_schema_to_gbnf(&schema).is_err());
            return Ok(());
        }
        let mut m = schema_matcher(&schema);
        let edges = [min, max].into_iter().flatten().flat_map(|v| [v - 1, v, v + 1]);
        for n in probes.into_iter().chain(edges).chain([0, -1, 1, 9, 10, -10, 99, 100]) {
            let want = min.is_none_or(|a| n >= a) && max.is_none_or(|b| n <= b);
            prop_assert_eq!(m.derives(&n.to_string()), want, "{} on {}", schema, n);
        }
        // Never a leading zero.
        prop_assert!(!m.derives("007"));
    }
}

#[test]
fn integer_bounds_reach_sixteen_digits() {
    let mut m = schema_matcher(r#"{"type": "integer", "minimum": 1e20}"#);
    assert!(m.derives("9999999999999999"));
    assert!(!m.derives("999999999999999"));
    let mut m = schema_matcher(r#"{"type": "integer", "minimum": 0.5, "maximum": 2.5}"#);
    assert!(m.derives("1") && m.derives("2"));
    assert!(!m.derives("0") && !m.derives("3"));
    let e = json_schema_to_gbnf(r#"{"type": "number", "minimum": 0}"#).unwrap_err();
    assert!(e.0.contains("integers only"), "{e}");
    let e = json_schema_to_gbnf(r#"{"type": "integer", "minimum": 3, "maximum": 2}"#).unwrap_err();
    assert!(e.0.contains("no integer"), "{e}");
}

#[test]
fn json_schema_patterns_constrain_the_string_value() {
    let cases: &[(&str, &[&str], &[&str])] = &[
        (
            r#"{"type": "string", "pattern": "^\\d{3}-\\d{4}$"}"#,
            &[r#""555-1234""#],
            &[r#""5551234""#, r#""555-12345""#, r#""x555-1234""#],
        ),
        // Not anchored: anywhere in the string.
        (
            r#"{"pattern": "ab+"}"#,
            &[r#""ab""#, r#""xxabbby""#, r#""\"ab\\""#],
            &[r#""a b""#, r#""""#, "12"],
        ),
        // A quote or a backslash in the value is written escaped; a bare
        // one would end the string.
        (
            r#"{"type": "string", "pattern": "^[^a]*$"}"#,
            &[r#""x\"y\\z\n""#, r#""""#, "\"\\u0001é😀\""],
            &[r#""xay""#, "\"x\"y\"", "\"\u{1}\""],
        ),
        (
            r#"{"type": "string", "pattern": "^(?:[A-Z]{2}|x)-(?<n>[0-9]+)$"}"#,
            &[r#""AB-12""#, r#""x-0""#],
            &[r#""A-1""#, r#""AB-""#, r#""ab-1""#],
        ),
        (
            r#"{"type": "string", "pattern": "^a$|^b"}"#,
            &[r#""a""#, r#""bcd""#],
            &[r#""ab""#, r#""cb""#],
        ),
        // A range that ends next to the surrogates.
        (
            r#"{"type": "string", "pattern": "^[^\\uE000-\\uFFFF]$"}"#,
            &[r#""a""#, "\"😀\"", "\"\u{D7FF}\""],
            &["\"\u{E001}\"", r#""ab""#],
        ),
        (
            r#"{"type": "string", "pattern": "^.$"}"#,
            &[r#""x""#, r#""\"""#, r#""\t""#],
            &[r#""\n""#, r#""\r""#, r#""xy""#],
        ),
    ];
    for &(schema, yes, no) in cases {
        let mut m = schema_matcher(schema);
        for doc in yes {
            assert!(m.derives(doc), "{schema} should derive {doc}");
        }
        for doc in no {
            assert!(!m.derives(doc), "{schema} should not derive {doc}");
        }
    }
    // In an object, as pydantic writes a constrained field.
    let mut m = schema_matcher(
        r#"{"type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}\\d{2}$"}}, "required": ["sku"]}"#,
    );
    assert!(m.derives(r#"{"sku": "ABC12"}"#));
    assert!(!m.derives(r#"{"sku": "ABC1"}"#));
}

/// A regular expression for the pattern oracle: rendered as ECMA-262 text
/// (what the converter reads) and as the `regex` crate's syntax.
#[derive(Clone, Debug)]
enum Rx {
    Lit(char, bool),
    Class(Vec<(char, char)>, Vec<usize>, bool),
    Dot,
    /// `\d \D \w \W \s \S` by index.
    Esc(usize),
    Seq(Vec<Rx>),
    Alt(Vec<Rx>),
    Group(Box<Rx>, usize),
    Repeat(Box<Rx>, u32, Option<u32>, bool),
}

const RX_ALPHABET: &[char] = &[
    'a', 'b', 'Z', '0', '7', '_', ' ', '-', '"', '\\', '\n', '\r', '\t', '\u{1}', 'é', '\u{2028}',
    '😀', '.', '*', '[', ']', '{', '^', '$', '|', '(',
];
const RX_ESCAPES: [&str; 6] = ["d", "D", "w", "W", "s", "S"];
const RX_DIGIT: &str = "0-9";
const RX_WORD: &str = "0-9A-Za-z_";
const RX_SPACE: &str = r"\t\n\x0B\x0C\r \x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000}\x{FEFF}";

fn ecma_char(c: char) -> String {
    if c.is_ascii_alphanumeric() || c == '_' {
        return c.to_string();
    }
    let u = c as u32;
    if u <= 0xFF {
        format!("\\x{u:02x}")
    } else if u <= 0xFFFF {
        format!("\\u{u:04x}")
    } else {
        let v = u - 0x10000;
        format!(
            "\\u{:04x}\\u{:04x}",
            0xD800 + (v >> 10),
            0xDC00 + (v & 0x3FF)
        )
    }
}

fn rust_char(c: char) -> String {
    if c.is_ascii_alphanumeric() || c == '_' {
        c.to_string()
    } else {
        format!("\\x{{{:X}}}", c as u32)
    }
}

impl Rx {
    fn ecma(&self) -> String {
        match self {
            // Unescaped where ECMA-262 allows it.
            Rx::Lit(c, true) if !"\\^$.|?*+()[]{}/".contains(*c) => c.to_string(),
            Rx::Lit(c, _) => ecma_char(*c),
            Rx::Class(ranges, escapes, negated) => {
                let mut s = String::from(if *negated { "[^" } else { "[" });
                for &(lo, hi) in ranges {
                    s += &ecma_char(lo);
                    if hi != lo {
                        s += "-";
                        s += &ecma_char(hi);
                    }
                }
                for &e in escapes {
                    s += "\\";
                    s += RX_ESCAPES[e];
                }
                s + "]"
            }
            Rx::Dot => ".".into(),
            Rx::Esc(e) => format!("\\{}", RX_ESCAPES[*e]),
            Rx::Seq(items) => items
                .iter()
                .map(|i| match i {
                    Rx::Alt(_) => format!("(?:{})", i.ecma()),
                    _ => i.ecma(),
                })
                .collect(),
            Rx::Alt(alts) => alts.iter().map(Rx::ecma).collect::<Vec<_>>().join("|"),
            Rx::Group(inner, kind) => {
                let open = ["(", "(?:", "(?<g>"][*kind % 3];
                format!("{open}{})", inner.ecma())
            }
            Rx::Repeat(inner, min, max, lazy) => {
                let q = match (min, max) {
                    (0, None) => "*".to_string(),
                    (1, None) => "+".to_string(),
                    (0, Some(1)) => "?".to_string(),
                    (m, None) => format!("{{{m},}}"),
                    (m, Some(n)) if m == n => format!("{{{m}}}"),
                    (m, Some(n)) => format!("{{{m},{n}}}"),
                };
                format!("(?:{}){q}{}", inner.ecma(), if *lazy { "?" } else { "" })
            }
        }
    }

    fn rust(&self) -> String {
        let class_of = |e: usize| -> String {
            let body = [RX_DIGIT, RX_WORD, RX_SPACE][e / 2];
            if e.is_multiple_of(2) {
                format!("[{body}]")
            } else {
                format!("[^{body}]")
            }
        };
        match self {
            Rx::Lit(c, _) => rust_char(*c),
            Rx::Class(ranges, escapes, negated) => {
                if ranges.is_empty() && escapes.is_empty() {
                    // ECMA's `[]` matches nothing, `[^]` anything.
                    return if *negated {
                        r"[\s\S]".into()
                    } else {
                        r"[^\s\S]".into()
                    };
                }
                let mut s = String::from(if *negated { "[^" } else { "[" });
                for &(lo, hi) in ranges {
                    s += &rust_char(lo);
                    if hi != lo {
                        s += "-";
                        s += &rust_char(hi);
                    }
                }
                for &e in escapes {
                    s += &class_of(e);
                }
                s + "]"
            }
            Rx::Dot => r"[^\n\r\x{2028}\x{2029}]".into(),
            Rx::Esc(e) => class_of(*e),
            Rx::Seq(items) => items.iter().map(|i| format!("(?:{})", i.rust())).collect(),
            Rx::Alt(alts) => alts
                .iter()
                .map(|a| format!("(?:{})", a.rust()))
                .collect::<Vec<_>>()
                .join("|"),
            Rx::Group(inner, _) => format!("(?:{})", inner.rust()),
            Rx::Repeat(inner, min, max, _) => match max {
                Some(n) => format!("(?:{}){{{min},{n}}}", inner.rust()),
                None => format!("(?:{}){{{min},}}", inner.rust()),
            },
        }
    }
}

impl Rx {
    /// A string the expression matches whole (`None` if it matches none),
    /// choices made by `pick(n)` (a number below `n`).
    fn example(&self, pick: &mut dyn FnMut(usize) -> usize) -> Option<String> {
        match self {
            Rx::Lit(c, _) => Some(c.to_string()),
            Rx::Class(..) | Rx::Dot | Rx::Esc(_) => {
                let one = regex::Regex::new(&format!("^(?:{})$", self.rust())).ok()?;
                let fits: Vec<char> = RX_ALPHABET
                    .iter()
                    .copied()
                    .filter(|c| one.is_match(&c.to_string()))
                    .collect();
                (!fits.is_empty()).then(|| fits[pick(fits.len())].to_string())
            }
            Rx::Seq(items) => items.iter().map(|i| i.example(pick)).collect(),
            Rx::Alt(alts) => {
                let first = pick(alts.len());
                (0..alts.len()).find_map(|k| alts[(first + k) % alts.len()].example(pick))
            }
            Rx::Group(inner, _) => inner.example(pick),
            Rx::Repeat(inner, min, max, _) => {
                let most = max.unwrap_or(min + 2).min(min + 2);
                let n = *min as usize + pick((most - min) as usize + 1);
                (0..n).map(|_| inner.example(pick)).collect()
            }
        }
    }
}

fn rx_char() -> impl Strategy<Value = char> {
    prop::sample::select(RX_ALPHABET)
}

fn rx() -> impl Strategy<Value = Rx> {
    let leaf = prop_oneof![
        4 => (rx_char(), any::<bool>()).prop_map(|(c, raw)| Rx::Lit(c, raw)),
        2 => (
            prop::collection::vec((rx_char(), rx_char()), 0..3),
            prop::collection::vec(0..6usize, 0..2),
            any::<bool>()
        )
            .prop_map(|(pairs, escapes, negated)| {
                let ranges = pairs
                    .into_iter()
                    .map(|(a, b)| if a <= b { (a, b) } else { (b, a) })
                    .collect();
                Rx::Class(ranges, escapes, negated)
            }),
        1 => Just(Rx::Dot),
        1 => (0..6usize).prop_map(Rx::Esc),
    ];
    leaf.prop_recursive(3, 16, 3, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Rx::Seq),
            prop::collection::vec(inner.clone(), 2..4).prop_map(Rx::Alt),
            (inner.clone(), 0..3usize).prop_map(|(r, k)| Rx::Group(Box::new(r), k)),
            (inner, 0..3u32, prop::option::of(0..3u32), any::<bool>()).prop_map(
                |(r, min, extra, lazy)| Rx::Repeat(Box::new(r), min, extra.map(|e| min + e), lazy)
            ),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// A string's JSON text derives from a `pattern` schema exactly when
    /// the `regex` crate finds the same expression in the string.
    #[test]
    fn pattern_grammars_agree_with_the_regex_crate(
        rx in rx(),
        start in any::<bool>(),
        end in any::<bool>(),
        strings in prop::collection::vec(prop::collection::vec(rx_char(), 0..6), 24),
        picks in prop::collection::vec(any::<usize>(), 64),
    ) {
        // Grouped, so that the anchors bind as in the oracle's.
        let pattern = format!("{}(?:{}){}", if start { "^" } else { "" }, rx.ecma(), if end { "$" } else { "" });
        let rust = format!("{}(?:{}){}", if start { "^" } else { "" }, rx.rust(), if end { "$" } else { "" });
        let oracle = regex::Regex::new(&rust).unwrap();
        let schema = serde_json::json!({"type": "string", "pattern": pattern}).to_string();
        let gbnf = json_schema_to_gbnf(&schema).unwrap();
        let mut m = Matcher::new(Grammar::parse(&gbnf).unwrap()).unwrap();
        // Random strings, and strings made to match (with text around them
        // where the pattern is not anchored).
        let mut next = picks.iter().cycle();
        let mut pick = |n: usize| next.next().map_or(0, |p| p % n.max(1));
        let mut made = Vec::new();
        for k in 0..4 {
            if let Some(e) = rx.example(&mut pick) {
                let before = if start || k % 2 == 0 { "" } else { "x\"" };
                let after = if end || k < 2 { "" } else { "\n0" };
                made.push(format!("{before}{e}{after}"));
            }
        }
        for s in strings.into_iter().map(|s| s.into_iter().collect::<String>()).chain(made) {
            let doc = serde_json::to_string(&s).unwrap();
            prop_assert_eq!(m.derives(&doc), oracle.is_match(&s), "{} on {:?}\n{}", pattern, s, gbnf);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(5000))]

    /// Any pattern text gives an error, or a grammar that parses (no
    /// left-recursive repetition of an optional part) and starts.
    #[test]
    fn any_pattern_gives_an_error_or_a_grammar(
        chars in prop::collection::vec(
            prop::sample::select(&[
                'a', 'b', '0', '9', '^', '$', '.', '|', '?', '*', '+', '(', ')', '[', ']', '{',
                '}', '\\', '-', ',', 'd', 'W', 's', 'x', 'u', 'c', 'k', '<', '>', '=', '!',
                ':', '"', 'D', 'é',
            ][..]),
            0..24,
        ),
    ) {
        let pattern: String = chars.into_iter().collect();
        let schema = serde_json::json!({"pattern": pattern}).to_string();
        if let Ok(gbnf) = json_schema_to_gbnf(&schema) {
            let g = Grammar::parse(&gbnf);
            prop_assert!(g.is_ok(), "{:?}: {:?}\n{}", pattern, g.err(), gbnf);
            prop_assert!(Matcher::new(g.unwrap()).is_ok());
        }
    }
}
