//! JSON Schema to GBNF (`les run --json-schema`), as llama.cpp's
//! `json-schema-to-grammar` does it for the keywords most schemas use.
//!
//! Supported: `type` (one or a list), `properties` (required ones first,
//! then the optional ones, each in the order the schema lists them, as
//! llama.cpp orders them), `required`, `additionalProperties` (with
//! properties, absent or `false`: none; `true` or a schema: further members
//! of any key after the listed ones; an object schema without properties
//! takes any object unless it is `false` or a schema), `items`, `prefixItems`, `minItems`, `maxItems`, `minLength`,
//! `maxLength`, `format` of strings (`date`, `time`, `date-time` as RFC 3339
//! has them, `uuid`), `pattern` of strings (an ECMA-262 regular expression,
//! matched anywhere unless anchored, its characters written as the JSON text
//! they need; see [`super::pattern`]), `minimum`, `maximum`, `exclusiveMinimum` and
//! `exclusiveMaximum` of integers (a grammar of the digit strings in range),
//! `enum`, `const`, `anyOf`, `oneOf`, `allOf` of one schema, and `$ref` to
//! `#` or `#/...` (recursive schemas included). Annotations
//! (`title`, `description`, `default`, `examples`, `$schema`, `$id`,
//! `$comment`, `deprecated`, `readOnly`, `writeOnly`, `$defs`, `definitions`)
//! are ignored. Any other keyword (`multipleOf`, `patternProperties`, bounds of
//! non-integers, ...) is an
//! error naming it and where it is, rather than a grammar that silently
//! allows more than the schema.
//!
//! The text is JSON with llama.cpp's spacing (a blank, or a line break and up
//! to 20 spaces or tabs, after each token); numbers have at most 16 integer
//! and 16 fraction digits, as in llama.cpp.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};

use super::pattern::pattern_to_gbnf;
use super::{GrammarError, MAX_REPETITION};

/// A JSON value whose objects keep their members in order (a schema's
/// property order decides the generated text's).
#[derive(Clone, Debug, PartialEq)]
pub enum Json {
    /// `null`.
    Null,
    /// `true` or `false`.
    Bool(bool),
    /// A number, as serde_json reads it.
    Number(serde_json::Number),
    /// A string.
    String(String),
    /// An array.
    Array(Vec<Json>),
    /// An object, members in order (a repeated key keeps its first place and
    /// its last value).
    Object(Vec<(String, Json)>),
}

impl Json {
    /// Reads JSON text (serde_json's nesting limit applies).
    pub fn parse(text: &str) -> Result<Json, GrammarError> {
        serde_json::from_str(text).map_err(|e| GrammarError(format!("the schema is not JSON: {e}")))
    }

    fn get(&self, key: &str) -> Option<&Json> {
        match self {
            Json::Object(members) => members.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    /// Compact JSON text.
    fn to_text(&self) -> String {
        let mut out = String::new();
        self.write(&mut out);
        out
    }

    fn write(&self, out: &mut String) {
        match self {
            Json::Null => out.push_str("null"),
            Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Json::Number(n) => out.push_str(&n.to_string()),
            Json::String(s) => out.push_str(&serde_json::Value::from(s.as_str()).to_string()),
            Json::Array(items) => {
                out.push('[');
                for (i, v) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    v.write(out);
                }
                out.push(']');
            }
            Json::Object(members) => {
                out.push('{');
                for (i, (k, v)) in members.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    out.push_str(&serde_json::Value::from(k.as_str()).to_string());
                    out.push(':');
                    v.write(out);
                }
                out.push('}');
            }
        }
    }
}

impl<'de> Deserialize<'de> for Json {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Json, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Json;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON value")
            }
            fn visit_unit<E>(self) -> Result<Json, E> {
                Ok(Json::Null)
            }
            fn visit_bool<E>(self, b: bool) -> Result<Json, E> {
                Ok(Json::Bool(b))
            }
            fn visit_i64<E>(self, n: i64) -> Result<Json, E> {
                Ok(Json::Number(n.into()))
            }
            fn visit_u64<E>(self, n: u64) -> Result<Json, E> {
                Ok(Json::Number(n.into()))
            }
            fn visit_f64<E: de::Error>(self, n: f64) -> Result<Json, E> {
                serde_json::Number::from_f64(n)
                    .map(Json::Number)
                    .ok_or_else(|| E::custom("a number that is not finite"))
            }
            fn visit_str<E>(self, s: &str) -> Result<Json, E> {
                Ok(Json::String(s.to_string()))
            }
            fn visit_string<E>(self, s: String) -> Result<Json, E> {
                Ok(Json::String(s))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Json, A::Error> {
                let mut items = Vec::new();
                while let Some(v) = seq.next_element()? {
                    items.push(v);
                }
                Ok(Json::Array(items))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Json, A::Error> {
                let mut members: Vec<(String, Json)> = Vec::new();
                while let Some((k, v)) = map.next_entry::<String, Json>()? {
                    match members.iter_mut().find(|(key, _)| *key == k) {
                        Some(m) => m.1 = v,
                        None => members.push((k, v)),
                    }
                }
                Ok(Json::Object(members))
            }
        }
        d.deserialize_any(V)
    }
}

/// Keywords that only annotate a schema.
const ANNOTATIONS: &[&str] = &[
    "title",
    "description",
    "default",
    "examples",
    "$schema",
    "$id",
    "$comment",
    "deprecated",
    "readOnly",
    "writeOnly",
    "$defs",
    "definitions",
];

/// Keywords this converter reads.
const HANDLED: &[&str] = &[
    "type",
    "properties",
    "required",
    "additionalProperties",
    "items",
    "prefixItems",
    "minItems",
    "maxItems",
    "minLength",
    "maxLength",
    "pattern",
    "enum",
    "const",
    "anyOf",
    "oneOf",
    "allOf",
    "$ref",
    "format",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
];

/// The bounds of integers.
const BOUNDS: [&str; 4] = ["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"];

/// The largest magnitude `integral-part` writes (16 digits).
const MAX_INTEGER: i64 = 9_999_999_999_999_999;

/// RFC 3339 `full-date`, with months 01-12 and days 01-31.
const DATE: &str =
    r#"[0-9]{4} "-" ("0" [1-9] | "1" [0-2]) "-" ("0" [1-9] | [12] [0-9] | "3" [01])"#;
/// RFC 3339 `full-time`: hours 00-23, a fraction optional, an offset.
const TIME: &str = r#"([01] [0-9] | "2" [0-3]) ":" [0-5] [0-9] ":" [0-5] [0-9] ("." [0-9]{1,9})? ("Z" | [+-] ([01] [0-9] | "2" [0-3]) ":" [0-5] [0-9])"#;
/// A UUID in its 8-4-4-4-12 hex form.
const UUID: &str = r#"[0-9a-fA-F]{8} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{12}"#;

/// The rules every grammar may use, by name.
const PRIMITIVES: &[(&str, &str)] = &[
    ("space", r#"| " " | "\n" [ \t]{0,20}"#),
    ("boolean", r#"("true" | "false") space"#),
    ("null", r#""null" space"#),
    (
        "char",
        r#"[^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4})"#,
    ),
    ("string", r#""\"" char* "\"" space"#),
    ("integral-part", r#""0" | [1-9] [0-9]{0,15}"#),
    ("decimal-part", r#"[0-9]{1,16}"#),
    (
        "number",
        r#""-"? integral-part ("." decimal-part)? ([eE] [-+]? integral-part)? space"#,
    ),
    ("integer", r#""-"? integral-part space"#),
    (
        "value",
        r#"object | array | string | number | boolean | null"#,
    ),
    (
        "object",
        r#""{" space (string ":" space value ("," space string ":" space value)*)? "}" space"#,
    ),
    (
        "array",
        r#""[" space (value ("," space value)*)? "]" space"#,
    ),
];

/// Which primitives a primitive uses.
fn primitive_uses(name: &str) -> &'static [&'static str] {
    match name {
        "boolean" | "null" => &["space"],
        "string" => &["char", "space"],
        "number" => &["integral-part", "decimal-part", "space"],
        "integer" => &["integral-part", "space"],
        "value" => &["object", "array", "string", "number", "boolean", "null"],
        "object" => &["string", "value", "space"],
        "array" => &["value", "space"],
        _ => &[],
    }
}

struct Converter<'a> {
    root: &'a Json,
    /// Rules in the order they are written: `root` first.
    rules: Vec<(String, String)>,
    /// Names taken (the primitives' included, so no schema rule takes one).
    taken: HashSet<String>,
    /// Primitives in use.
    used: HashSet<&'static str>,
    /// Rules for `$ref` targets, by reference.
    refs: HashMap<String, String>,
}

/// GBNF for `schema` (JSON Schema text); the start rule is `root`.
pub fn json_schema_to_gbnf(schema: &str) -> Result<String, GrammarError> {
    let root = Json::parse(schema)?;
    let mut c = Converter {
        root: &root,
        rules: Vec::new(),
        taken: PRIMITIVES
            .iter()
            .map(|(n, _)| n.to_string())
            .chain(["date", "time", "uuid"].map(String::from))
            .collect(),
        used: HashSet::new(),
        refs: HashMap::new(),
    };
    c.taken.insert("root".into());
    c.rules.push(("root".into(), String::new()));
    let body = c.visit(&root, "root", "")?;
    c.rules[0].1 = body;
    let mut out = String::new();
    for (name, body) in &c.rules {
        let _ = writeln!(out, "{name} ::= {body}");
    }
    // Primitives in a fixed order, with what they use.
    let mut need: Vec<&str> = c.used.iter().copied().collect();
    while let Some(p) = need.pop() {
        for &dep in primitive_uses(p) {
            if c.used.insert(dep) {
                need.push(dep);
            }
        }
    }
    for (name, body) in PRIMITIVES {
        if c.used.contains(name) {
            let _ = writeln!(out, "{name} ::= {body}");
        }
    }
    Ok(out)
}

/// `text` as a GBNF string literal.
pub fn literal(text: &str) -> String {
    let mut out = String::from("\"");
    for ch in text.chars() {
        match ch {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

impl Converter<'_> {
    fn prim(&mut self, name: &'static str) -> String {
        self.used.insert(name);
        name.to_string()
    }

    /// A new rule name from `hint` (only letters, digits and `-`), unique.
    fn name(&mut self, hint: &str) -> String {
        let mut base: String = hint
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
            .collect();
        if base.is_empty() {
            base = "rule".into();
        }
        let mut name = base.clone();
        let mut n = 1;
        while self.taken.contains(&name) {
            name = format!("{base}-{n}");
            n += 1;
        }
        self.taken.insert(name.clone());
        name
    }

    /// A rule named after `hint` with `body`; its name.
    fn rule(&mut self, hint: &str, body: String) -> String {
        let name = self.name(hint);
        self.rules.push((name.clone(), body));
        name
    }

    fn unsupported(path: &str, what: &str) -> GrammarError {
        let at = if path.is_empty() { "/" } else { path };
        GrammarError(format!("json schema: {what} at {at}"))
    }

    fn count(s: &Json, key: &str, path: &str) -> Result<Option<u32>, GrammarError> {
        match s.get(key) {
            None => Ok(None),
            Some(Json::Number(n)) => match n.as_u64() {
                Some(v) if v <= u64::from(MAX_REPETITION) => Ok(Some(v as u32)),
                _ => Err(Self::unsupported(
                    path,
                    &format!("`{key}` must be a whole number up to {MAX_REPETITION}"),
                )),
            },
            Some(_) => Err(Self::unsupported(path, &format!("`{key}` is not a number"))),
        }
    }

    /// The strings of `key`'s list, or an error naming it.
    fn strings<'j>(list: &'j [Json], key: &str, path: &str) -> Result<Vec<&'j str>, GrammarError> {
        list.iter()
            .map(|v| match v {
                Json::String(v) => Ok(v.as_str()),
                _ => Err(Self::unsupported(
                    path,
                    &format!("`{key}` lists a non-string"),
                )),
            })
            .collect()
    }

    /// [`visit`](Self::visit) of each schema in `list` (at `path/i`).
    fn visit_each(
        &mut self,
        list: &[Json],
        hint: &str,
        path: &str,
    ) -> Result<Vec<String>, GrammarError> {
        let mut out = Vec::with_capacity(list.len());
        for (i, sub) in list.iter().enumerate() {
            out.push(self.visit(sub, &format!("{hint}-{i}"), &format!("{path}/{i}"))?);
        }
        Ok(out)
    }

    /// An expression (usable in a sequence) for the text `s` allows.
    fn visit(&mut self, s: &Json, hint: &str, path: &str) -> Result<String, GrammarError> {
        let members = match s {
            Json::Bool(true) => return Ok(self.prim("value")),
            Json::Bool(false) => {
                return Err(Self::unsupported(path, "the schema `false` allows nothing"))
            }
            Json::Object(m) => m,
            _ => {
                return Err(Self::unsupported(
                    path,
                    "a schema must be an object or a boolean",
                ))
            }
        };
        for (k, _) in members {
            if !HANDLED.contains(&k.as_str()) && !ANNOTATIONS.contains(&k.as_str()) {
                return Err(Self::unsupported(
                    path,
                    &format!("unsupported keyword `{k}`"),
                ));
            }
        }
        if let Some(v) = s.get("const") {
            return Ok(format!("{} {}", literal(&v.to_text()), self.prim("space")));
        }
        if let Some(e) = s.get("enum") {
            let Json::Array(values) = e else {
                return Err(Self::unsupported(path, "`enum` is not an array"));
            };
            if values.is_empty() {
                return Err(Self::unsupported(path, "an empty `enum` allows nothing"));
            }
            let alts: Vec<String> = values.iter().map(|v| literal(&v.to_text())).collect();
            return Ok(format!("({}) {}", alts.join(" | "), self.prim("space")));
        }
        if let Some(r) = s.get("$ref") {
            let Json::String(r) = r else {
                return Err(Self::unsupported(path, "`$ref` is not a string"));
            };
            return self.reference(r, path);
        }
        for key in ["anyOf", "oneOf"] {
            if let Some(list) = s.get(key) {
                let Json::Array(list) = list else {
                    return Err(Self::unsupported(path, &format!("`{key}` is not an array")));
                };
                if list.is_empty() {
                    return Err(Self::unsupported(path, &format!("an empty `{key}`")));
                }
                let alts = self.visit_each(list, hint, &format!("{path}/{key}"))?;
                return Ok(format!("({})", alts.join(" | ")));
            }
        }
        if let Some(list) = s.get("allOf") {
            return match list {
                Json::Array(list) if list.len() == 1 => {
                    self.visit(&list[0], hint, &format!("{path}/allOf/0"))
                }
                _ => Err(Self::unsupported(
                    path,
                    "`allOf` of more than one schema is not supported",
                )),
            };
        }
        let types: Vec<&str> = match s.get("type") {
            None => {
                if s.get("properties").is_some() || s.get("additionalProperties").is_some() {
                    vec!["object"]
                } else if s.get("items").is_some() || s.get("prefixItems").is_some() {
                    vec!["array"]
                } else if ["minLength", "maxLength", "pattern"]
                    .iter()
                    .any(|k| s.get(k).is_some())
                {
                    vec!["string"]
                } else {
                    return Ok(self.prim("value"));
                }
            }
            Some(Json::String(t)) => vec![t.as_str()],
            Some(Json::Array(ts)) => {
                let out = Self::strings(ts, "type", path)?;
                if out.is_empty() {
                    return Err(Self::unsupported(
                        path,
                        "an empty `type` list allows nothing",
                    ));
                }
                out
            }
            Some(_) => return Err(Self::unsupported(path, "`type` is not a string or a list")),
        };
        if types != ["integer"] && BOUNDS.iter().any(|b| s.get(b).is_some()) {
            return Err(Self::unsupported(
                path,
                "`minimum`/`maximum` are supported for integers only",
            ));
        }
        let mut alts = Vec::new();
        for t in types {
            alts.push(self.typed(s, t, hint, path)?);
        }
        Ok(if alts.len() == 1 {
            alts.pop().unwrap_or_default()
        } else {
            format!("({})", alts.join(" | "))
        })
    }

    /// The expression for `s` read as type `t`.
    fn typed(&mut self, s: &Json, t: &str, hint: &str, path: &str) -> Result<String, GrammarError> {
        match t {
            "null" => Ok(self.prim("null")),
            "boolean" => Ok(self.prim("boolean")),
            "integer" => self.integer(s, path),
            "number" => Ok(self.prim("number")),
            "string" => {
                if let Some(p) = s.get("pattern") {
                    return self.pattern(p, s, hint, path);
                }
                if let Some(f) = s.get("format") {
                    return self.format(f, s, path);
                }
                let min = Self::count(s, "minLength", path)?;
                let max = Self::count(s, "maxLength", path)?;
                if min.is_none() && max.is_none() {
                    return Ok(self.prim("string"));
                }
                let min = min.unwrap_or(0);
                if max.is_some_and(|m| m < min) {
                    return Err(Self::unsupported(path, "`maxLength` below `minLength`"));
                }
                let reps = match max {
                    Some(m) => format!("{{{min},{m}}}"),
                    None => format!("{{{min},}}"),
                };
                let (ch, sp) = (self.prim("char"), self.prim("space"));
                Ok(format!("\"\\\"\" {ch}{reps} \"\\\"\" {sp}"))
            }
            "array" => self.array(s, hint, path),
            "object" => self.object(s, hint, path),
            other => Err(Self::unsupported(path, &format!("unknown type `{other}`"))),
        }
    }

    /// An integer within the schema's `minimum`, `maximum`,
    /// `exclusiveMinimum` and `exclusiveMaximum` (numbers; at most 16
    /// digits either way, as `integral-part`).
    fn integer(&mut self, s: &Json, path: &str) -> Result<String, GrammarError> {
        if BOUNDS.iter().all(|b| s.get(b).is_none()) {
            return Ok(self.prim("integer"));
        }
        let bound = |key: &str| -> Result<Option<f64>, GrammarError> {
            match s.get(key) {
                None => Ok(None),
                Some(Json::Number(n)) => Ok(n.as_f64()),
                Some(_) => Err(Self::unsupported(path, &format!("`{key}` is not a number"))),
            }
        };
        // `as` saturates at i64's bounds; the clamp is then exact.
        let clamp = |v: f64| (v as i64).clamp(-MAX_INTEGER, MAX_INTEGER);
        let mut lo = -MAX_INTEGER;
        let mut hi = MAX_INTEGER;
        if let Some(v) = bound("minimum")? {
            lo = lo.max(clamp(v.ceil()));
        }
        if let Some(v) = bound("exclusiveMinimum")? {
            lo = lo.max(clamp(v.floor()).saturating_add(1));
        }
        if let Some(v) = bound("maximum")? {
            hi = hi.min(clamp(v.floor()));
        }
        if let Some(v) = bound("exclusiveMaximum")? {
            hi = hi.min(clamp(v.ceil()).saturating_sub(1));
        }
        if lo > hi {
            return Err(Self::unsupported(path, "the bounds leave no integer"));
        }
        Ok(format!("{} {}", integer_range(lo, hi), self.prim("space")))
    }

    /// A string of a `format`: `date`, `time`, `date-time` (RFC 3339) or
    /// `uuid`, as llama.cpp supports them.
    fn format(&mut self, f: &Json, s: &Json, path: &str) -> Result<String, GrammarError> {
        let Json::String(f) = f else {
            return Err(Self::unsupported(path, "`format` is not a string"));
        };
        if s.get("minLength").is_some() || s.get("maxLength").is_some() {
            return Err(Self::unsupported(
                path,
                "`minLength`/`maxLength` with `format` are not supported",
            ));
        }
        let body = match f.as_str() {
            "date" | "time" | "date-time" => {
                self.define_once("date", DATE);
                self.define_once("time", TIME);
                match f.as_str() {
                    "date" => "date",
                    "time" => "time",
                    _ => "date \"T\" time",
                }
                .to_string()
            }
            "uuid" => {
                self.define_once("uuid", UUID);
                "uuid".to_string()
            }
            other => {
                return Err(Self::unsupported(
                    path,
                    &format!("unsupported `format` {other:?} (date, time, date-time and uuid are)"),
                ))
            }
        };
        Ok(format!("\"\\\"\" {body} \"\\\"\" {}", self.prim("space")))
    }

    /// A string whose value `pattern` (an ECMA-262 regular expression)
    /// matches, anywhere unless anchored ([`super::pattern`]).
    fn pattern(
        &mut self,
        p: &Json,
        s: &Json,
        hint: &str,
        path: &str,
    ) -> Result<String, GrammarError> {
        let Json::String(p) = p else {
            return Err(Self::unsupported(path, "`pattern` is not a string"));
        };
        if ["format", "minLength", "maxLength"]
            .iter()
            .any(|k| s.get(k).is_some())
        {
            return Err(Self::unsupported(
                path,
                "`pattern` with `format`, `minLength` or `maxLength` is not supported",
            ));
        }
        let hint = format!("{hint}-char");
        let body = pattern_to_gbnf(p, &mut |body| self.rule(&hint, body))
            .map_err(|e| Self::unsupported(path, &format!("`pattern` {p:?}: {e}")))?;
        Ok(format!("\"\\\"\" {body} \"\\\"\" {}", self.prim("space")))
    }

    /// Adds rule `name` (a reserved name) with `body` unless it is there.
    fn define_once(&mut self, name: &str, body: &str) {
        if !self.rules.iter().any(|(n, _)| n == name) {
            self.rules.push((name.to_string(), body.to_string()));
        }
    }

    fn array(&mut self, s: &Json, hint: &str, path: &str) -> Result<String, GrammarError> {
        let sp = self.prim("space");
        let prefix: Vec<String> = match s.get("prefixItems") {
            None => Vec::new(),
            Some(Json::Array(items)) => {
                self.visit_each(items, hint, &format!("{path}/prefixItems"))?
            }
            Some(_) => return Err(Self::unsupported(path, "`prefixItems` is not an array")),
        };
        let item = match s.get("items") {
            Some(Json::Bool(false)) => None,
            None if !prefix.is_empty() => None,
            None => Some(self.prim("value")),
            Some(schema) => {
                let e = self.visit(schema, &format!("{hint}-item"), &format!("{path}/items"))?;
                Some(self.rule(&format!("{hint}-item"), e))
            }
        };
        let min = Self::count(s, "minItems", path)?.unwrap_or(0);
        let max = Self::count(s, "maxItems", path)?;
        if max.is_some_and(|m| m < min) {
            return Err(Self::unsupported(path, "`maxItems` below `minItems`"));
        }
        if !prefix.is_empty() {
            if s.get("minItems").is_some() || s.get("maxItems").is_some() {
                return Err(Self::unsupported(
                    path,
                    "`minItems`/`maxItems` with `prefixItems` are not supported",
                ));
            }
            let mut body = format!("\"[\" {sp} {}", prefix.join(&format!(" \",\" {sp} ")));
            if let Some(item) = item {
                let _ = write!(body, " (\",\" {sp} {item})*");
            }
            let _ = write!(body, " \"]\" {sp}");
            return Ok(format!("({body})"));
        }
        let Some(item) = item else {
            return Ok(format!("(\"[\" {sp} \"]\" {sp})"));
        };
        let more = |lo: u32, hi: Option<u32>| match hi {
            None => format!("(\",\" {sp} {item}){{{lo},}}"),
            Some(hi) => format!("(\",\" {sp} {item}){{{lo},{hi}}}"),
        };
        let inner = match (min, max) {
            (_, Some(0)) => String::new(),
            (0, max) => format!("({item} {})?", more(0, max.map(|m| m - 1))),
            (min, max) => format!("{item} {}", more(min - 1, max.map(|m| m - 1))),
        };
        Ok(format!("(\"[\" {sp} {inner} \"]\" {sp})"))
    }

    fn object(&mut self, s: &Json, hint: &str, path: &str) -> Result<String, GrammarError> {
        // No properties named and other ones not refused: any object (as
        // llama.cpp reads `{"type": "object"}`). With properties, others are
        // refused unless `additionalProperties` allows them (llama.cpp's
        // reading too, stricter than JSON Schema's default).
        if s.get("properties").is_none()
            && s.get("required").is_none()
            && matches!(s.get("additionalProperties"), None | Some(Json::Bool(true)))
        {
            return Ok(self.prim("object"));
        }
        let sp = self.prim("space");
        let props: &[(String, Json)] = match s.get("properties") {
            None => &[],
            Some(Json::Object(m)) => m,
            Some(_) => return Err(Self::unsupported(path, "`properties` is not an object")),
        };
        let required: Vec<&str> = match s.get("required") {
            None => Vec::new(),
            Some(Json::Array(r)) => Self::strings(r, "required", path)?,
            Some(_) => return Err(Self::unsupported(path, "`required` is not an array")),
        };
        for k in &required {
            if !props.iter().any(|(p, _)| p == k) {
                return Err(Self::unsupported(
                    path,
                    &format!("required property `{k}` is not in `properties`"),
                ));
            }
        }
        // Each member as `"key" space ":" space value`, a rule of its own.
        let member = |c: &mut Self, key: &str, schema: &Json| -> Result<String, GrammarError> {
            let sub = format!("{hint}-{key}");
            let value = c.visit(schema, &sub, &format!("{path}/properties/{key}"))?;
            let key_text = serde_json::Value::from(key).to_string();
            Ok(c.rule(
                &format!("{sub}-kv"),
                format!("{} {sp} \":\" {sp} {value}", literal(&key_text)),
            ))
        };
        let mut req = Vec::new();
        let mut opt = Vec::new();
        for (k, schema) in props {
            if required.contains(&k.as_str()) {
                req.push(member(self, k, schema)?);
            }
        }
        for (k, schema) in props {
            if !required.contains(&k.as_str()) {
                opt.push(member(self, k, schema)?);
            }
        }
        let extra = match s.get("additionalProperties") {
            None | Some(Json::Bool(false)) => None,
            Some(Json::Bool(true)) => {
                let (st, v) = (self.prim("string"), self.prim("value"));
                Some(self.rule(
                    &format!("{hint}-additional-kv"),
                    format!("{st} \":\" {sp} {v}"),
                ))
            }
            Some(schema) => {
                let st = self.prim("string");
                let v = self.visit(
                    schema,
                    &format!("{hint}-additional"),
                    &format!("{path}/additionalProperties"),
                )?;
                Some(self.rule(
                    &format!("{hint}-additional-kv"),
                    format!("{st} \":\" {sp} {v}"),
                ))
            }
        };
        // After the required members, any subset of the optional ones in
        // order, then any number of extra ones.
        let comma = format!("\",\" {sp}");
        let optional_after = |from: usize| -> String {
            let mut t = String::new();
            for o in &opt[from..] {
                let _ = write!(t, " ({comma} {o})?");
            }
            if let Some(x) = &extra {
                let _ = write!(t, " ({comma} {x})*");
            }
            t
        };
        let body = if !req.is_empty() {
            format!("{}{}", req.join(&format!(" {comma} ")), optional_after(0))
        } else {
            // No member is sure to come: one alternative per first member
            // present (no comma before it), or none at all.
            let mut alts: Vec<String> = (0..opt.len())
                .map(|i| format!("{}{}", opt[i], optional_after(i + 1)))
                .collect();
            if let Some(x) = &extra {
                alts.push(format!("{x} ({comma} {x})*"));
            }
            if alts.is_empty() {
                String::new()
            } else {
                format!("({})?", alts.join(" | "))
            }
        };
        Ok(format!("(\"{{\" {sp} {body} \"}}\" {sp})"))
    }

    /// The rule for `$ref` `r` (`#` or a JSON pointer `#/...` into the
    /// schema), converted once.
    fn reference(&mut self, r: &str, path: &str) -> Result<String, GrammarError> {
        if let Some(name) = self.refs.get(r) {
            return Ok(name.clone());
        }
        let Some(pointer) = r.strip_prefix('#') else {
            return Err(Self::unsupported(
                path,
                &format!("`$ref` {r:?} is not in this schema"),
            ));
        };
        let mut target = self.root;
        for token in pointer.split('/').skip(1) {
            let token = token.replace("~1", "/").replace("~0", "~");
            target = match target {
                Json::Object(_) => target.get(&token),
                Json::Array(items) => token.parse::<usize>().ok().and_then(|i| items.get(i)),
                _ => None,
            }
            .ok_or_else(|| Self::unsupported(path, &format!("`$ref` {r:?} points at nothing")))?;
        }
        // The rule takes the pointer's last name.
        let last = r.rsplit('/').next().unwrap_or("ref").to_string();
        if pointer.is_empty() || pointer == "/" {
            // The whole schema: its rule is `root`.
            self.refs.insert(r.to_string(), "root".into());
            return Ok("root".into());
        }
        let name = self.name(&last);
        self.refs.insert(r.to_string(), name.clone());
        // Reserve the rule's place, then fill it (it may refer to itself).
        let at = self.rules.len();
        self.rules.push((name.clone(), String::new()));
        let target = target.clone();
        let body = self.visit(&target, &name, pointer)?;
        self.rules[at].1 = body;
        Ok(name)
    }
}

/// GBNF for the integers in `lo..=hi` (|both| <= [`MAX_INTEGER`]) written
/// as JSON writes them: no leading zeros, `-` before negatives, no `-0`.
fn integer_range(lo: i64, hi: i64) -> String {
    let mut alts = Vec::new();
    if lo < 0 {
        let from = if hi < 0 { -hi } else { 1 };
        alts.push(format!(
            "\"-\" {}",
            natural_range(from as u64, lo.unsigned_abs())
        ));
    }
    if hi >= 0 {
        alts.push(natural_range(lo.max(0) as u64, hi as u64));
    }
    format!("({})", alts.join(" | "))
}

/// GBNF for the whole numbers in `a..=b` without leading zeros: one
/// alternative per digit count.
fn natural_range(a: u64, b: u64) -> String {
    let digits = |v: u64| v.to_string().len() as u32;
    let mut alts = Vec::new();
    for len in digits(a)..=digits(b) {
        let floor = if len == 1 { 0 } else { 10u64.pow(len - 1) };
        let ceil = 10u64.pow(len) - 1;
        let (x, y) = (a.max(floor), b.min(ceil));
        if x <= y {
            alts.push(same_length(
                x.to_string().as_bytes(),
                y.to_string().as_bytes(),
            ));
        }
    }
    format!("({})", alts.join(" | "))
}

/// GBNF for the digit strings of `x.len()` digits from `x` to `y`
/// (`x <= y`, leading zeros allowed past the first call's first digit), of
/// size quadratic in the length: a full range of the rest is one class.
fn same_length(x: &[u8], y: &[u8]) -> String {
    let digit = |lo: u8, hi: u8| {
        if lo == hi {
            format!("\"{}\"", lo as char)
        } else {
            format!("[{}-{}]", lo as char, hi as char)
        }
    };
    let (Some((&a, xr)), Some((&b, yr))) = (x.split_first(), y.split_first()) else {
        return String::new();
    };
    let n = xr.len();
    let any = |n: usize| {
        if n == 0 {
            String::new()
        } else {
            format!(" [0-9]{{{n}}}")
        }
    };
    let zeros = xr.iter().all(|&d| d == b'0');
    let nines = yr.iter().all(|&d| d == b'9');
    if a == b {
        if zeros && nines {
            return format!("{}{}", digit(a, a), any(n));
        }
        return format!("{} {}", digit(a, a), same_length(xr, yr));
    }
    let mut alts = Vec::new();
    // The first digits whose every continuation is in the range.
    let from = if zeros { a } else { a + 1 };
    let to = if nines { b } else { b - 1 };
    if !zeros {
        alts.push(format!(
            "{} {}",
            digit(a, a),
            same_length(xr, &vec![b'9'; n])
        ));
    }
    if from <= to {
        alts.push(format!("{}{}", digit(from, to), any(n)));
    }
    if !nines {
        alts.push(format!(
            "{} {}",
            digit(b, b),
            same_length(&vec![b'0'; n], yr)
        ));
    }
    format!("({})", alts.join(" | "))
}
