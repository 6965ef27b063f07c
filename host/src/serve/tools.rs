//! Tool calls (OpenAI's `tools`, `tool_choice`), for models whose chat
//! template takes `tools` and whose calls are either Hermes-style blocks,
//! `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen 2.5 and
//! 3, MiniCPM-V, Hermes 2 Pro and 3, and their kin), or gpt-oss's harmony
//! messages to a function, `<|channel|>commentary to=functions.NAME
//! <|constrain|>json<|message|>{...}<|call|>` ([`ToolFormat`]): the tools go
//! to the template, the reply's calls come back as `tool_calls`.
//!
//! `tool_choice: "required"` (or a named function) constrains the reply by a
//! grammar to one call (several with `parallel_tool_calls`) of the tools
//! given, its arguments following their `parameters` schema; `"auto"` lets
//! the model choose, and from the first `<tool_call>` it writes on the same
//! grammar constrains the rest (llama.cpp's lazy grammar; a harmony reply
//! from its recipient, `to=functions.`, on); `"none"` renders no tools and
//! reads no calls.

use serde_json::{json, Map, Value};

use super::api::ApiError;
use crate::grammar::json_schema_to_gbnf;

/// Tools a request may give.
pub const MAX_TOOLS: usize = 128;

/// What a model writes around each call.
pub const OPEN: &str = "<tool_call>";
/// See [`OPEN`].
pub const CLOSE: &str = "</tool_call>";

/// How a model writes its calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolFormat {
    /// `<tool_call>` blocks of JSON.
    Hermes,
    /// gpt-oss's harmony messages to `functions.NAME`.
    Harmony,
}

/// Where an `auto` harmony reply's call starts to be constrained (llama.cpp's
/// lazy grammar for gpt-oss triggers on the recipient).
pub const HARMONY_TRIGGER: &str = "to=functions.";

/// Most bytes of a tool's name (OpenAI's bound; names are `[A-Za-z0-9_-]`).
pub const MAX_NAME: usize = 64;

/// Whether the model may, must or must not call a tool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolChoice {
    /// The model chooses (the default).
    Auto,
    /// No tools: none rendered, no calls read.
    None,
    /// At least one call, to any of the tools.
    Required,
    /// A call to this function.
    Function(String),
}

/// A request's tools.
#[derive(Clone, Debug, PartialEq)]
pub struct Tools {
    /// The tools as given (`{"type": "function", "function": {...}}`), for
    /// the chat template.
    pub list: Vec<Value>,
    /// `tool_choice`.
    pub choice: ToolChoice,
    /// `parallel_tool_calls` (false: at most one call where the grammar
    /// decides).
    pub parallel: bool,
}

/// One call the model made.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolCall {
    /// The function's name.
    pub name: String,
    /// Its arguments, as JSON text (OpenAI's `arguments` is a string).
    pub arguments: String,
}

impl Tools {
    /// Reads `tools`, `tool_choice` and `parallel_tool_calls`; `None` without
    /// tools (or with `tool_choice: "none"`).
    pub fn read(obj: &Map<String, Value>) -> Result<Option<Tools>, ApiError> {
        let list = match obj.get("tools") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(a)) => a.clone(),
            Some(_) => return Err(ApiError::bad("'tools' must be an array")),
        };
        if list.len() > MAX_TOOLS {
            return Err(ApiError::bad(format!("more than {MAX_TOOLS} tools")));
        }
        let mut names = Vec::with_capacity(list.len());
        for (i, t) in list.iter().enumerate() {
            if t.get("type").and_then(Value::as_str) != Some("function") {
                return Err(ApiError::bad(format!(
                    "tools[{i}].type must be \"function\""
                )));
            }
            let f = t
                .get("function")
                .and_then(Value::as_object)
                .ok_or_else(|| ApiError::bad(format!("tools[{i}].function must be an object")))?;
            let name = f.get("name").and_then(Value::as_str).ok_or_else(|| {
                ApiError::bad(format!("tools[{i}].function.name must be a string"))
            })?;
            let fine = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-';
            if name.is_empty() || name.len() > MAX_NAME || !name.chars().all(fine) {
                return Err(ApiError::bad(format!(
                    "tools[{i}].function.name must be 1 to {MAX_NAME} of a-z, A-Z, 0-9, _ and -"
                )));
            }
            if names.contains(&name) {
                return Err(ApiError::bad(format!(
                    "tools[{i}]: a second tool named {name:?}"
                )));
            }
            if !matches!(f.get("parameters"), None | Some(Value::Object(_))) {
                return Err(ApiError::bad(format!(
                    "tools[{i}].function.parameters must be a JSON schema object"
                )));
            }
            names.push(name);
        }
        let choice = match obj.get("tool_choice") {
            None | Some(Value::Null) => ToolChoice::Auto,
            Some(Value::String(s)) => match s.as_str() {
                "auto" => ToolChoice::Auto,
                "none" => ToolChoice::None,
                "required" => ToolChoice::Required,
                _ => {
                    return Err(ApiError::bad(
                        "'tool_choice' must be \"auto\", \"none\", \"required\" or a function",
                    ))
                }
            },
            Some(v) => {
                let name = v
                    .get("function")
                    .and_then(|f| f.get("name"))
                    .and_then(Value::as_str)
                    .ok_or_else(|| {
                        ApiError::bad("'tool_choice' must name a function: {\"type\": \"function\", \"function\": {\"name\": ...}}")
                    })?;
                if !names.contains(&name) {
                    return Err(ApiError::bad(format!(
                        "'tool_choice' names {name:?}, which is not among the tools"
                    )));
                }
                ToolChoice::Function(name.to_string())
            }
        };
        let parallel = match obj.get("parallel_tool_calls") {
            None | Some(Value::Null) => false,
            Some(v) => v
                .as_bool()
                .ok_or_else(|| ApiError::bad("'parallel_tool_calls' must be true or false"))?,
        };
        if list.is_empty() {
            return match choice {
                ToolChoice::Auto | ToolChoice::None => Ok(None),
                _ => Err(ApiError::bad(
                    "'tool_choice' asks for a call, but there are no tools",
                )),
            };
        }
        if choice == ToolChoice::None {
            return Ok(None);
        }
        Ok(Some(Tools {
            list,
            choice,
            parallel,
        }))
    }

    /// The grammar a reply in `format` must follow from its start, for a
    /// required or named call ([`calls`](Self::calls),
    /// [`harmony_call`](Self::harmony_call)); `None` for `auto`.
    pub fn grammar(&self, format: ToolFormat) -> Result<Option<String>, ApiError> {
        match (&self.choice, format) {
            (ToolChoice::Auto | ToolChoice::None, _) => Ok(None),
            (_, ToolFormat::Hermes) => self.calls().map(Some),
            (_, ToolFormat::Harmony) => self.harmony_call().map(Some),
        }
    }

    /// The functions a call may go to (the named one only, where
    /// `tool_choice` names one), with their `parameters` (any object where
    /// none are given).
    fn wanted(&self) -> Vec<(&str, Value)> {
        self.list
            .iter()
            .filter_map(|t| t.get("function"))
            .filter_map(|f| Some((f.get("name")?.as_str()?, f)))
            .filter(|(name, _)| match &self.choice {
                ToolChoice::Function(n) => n == name,
                _ => true,
            })
            .map(|(name, f)| {
                let params = f.get("parameters").cloned();
                (name, params.unwrap_or_else(|| json!({"type": "object"})))
            })
            .collect()
    }

    /// The grammar of one harmony call: `<|channel|>commentary
    /// to=functions.NAME <|constrain|>json<|message|>` and arguments
    /// following that function's `parameters`; generation ends after it
    /// (`<|call|>`, an end-of-generation token).
    pub fn harmony_call(&self) -> Result<String, ApiError> {
        self.harmony_grammar(
            "<|channel|>commentary to=functions.",
            " <|constrain|>json<|message|>",
        )
    }

    /// The grammar of a harmony call from [`HARMONY_TRIGGER`] on, for
    /// `auto`: a function's name, then the rest of the header as gpt-oss
    /// writes it (the recipient after the channel: `<|constrain|>json` or
    /// `json` or nothing; or before it: then the commentary channel), then
    /// its arguments.
    pub fn harmony_from_trigger(&self) -> Result<String, ApiError> {
        self.harmony_grammar(
            HARMONY_TRIGGER,
            "(\" <|constrain|>json\" | \" json\")? \
             (\"<|channel|>commentary\" (\" <|constrain|>json\" | \" json\")?)? \"<|message|>\"",
        )
    }

    /// `start` (a literal), then one wanted function's name, `header` (a
    /// literal, or GBNF in parentheses) and its arguments.
    fn harmony_grammar(&self, start: &str, header: &str) -> Result<String, ApiError> {
        let header = if header.starts_with('(') {
            header.to_string()
        } else {
            format!("\"{header}\"")
        };
        let mut rules = String::new();
        let mut alternatives = Vec::new();
        for (i, (name, params)) in self.wanted().into_iter().enumerate() {
            let g = json_schema_to_gbnf(&params.to_string())
                .map_err(|e| ApiError::bad(format!("the parameters of {name:?}: {e}")))?;
            // Each tool's rules apart from the others'.
            let defined: Vec<&str> = g.lines().filter_map(|l| l.split(" ::= ").next()).collect();
            let g = rename_rules(&g, |r| defined.contains(&r).then(|| format!("t{i}-{r}")));
            rules.push_str(&g);
            // Names are [A-Za-z0-9_-]: a literal needs no escapes.
            alternatives.push(format!("\"{name}\" t{i}-header t{i}-root"));
            rules.push_str(&format!("t{i}-header ::= {header}\n"));
        }
        Ok(format!(
            "root ::= \"{start}\" ({})\n{rules}",
            alternatives.join(" | ")
        ))
    }

    /// The grammar of the calls: [`OPEN`] blocks (one, or one or more with
    /// `parallel`) of a tool's name and arguments following its
    /// `parameters` (the named one's only, where `tool_choice` names one).
    /// For `auto` it constrains a reply from its first [`OPEN`] on.
    pub fn calls(&self) -> Result<String, ApiError> {
        // Written out: `name` before `arguments`, as the models write them.
        let calls: Vec<String> = self
            .wanted()
            .into_iter()
            .map(|(name, params)| {
                format!(
                    r#"{{"type":"object","properties":{{"name":{{"const":{}}},"arguments":{params}}},"required":["name","arguments"],"additionalProperties":false}}"#,
                    json!(name)
                )
            })
            .collect();
        let schema = format!(r#"{{"anyOf":[{}]}}"#, calls.join(","));
        let call = json_schema_to_gbnf(&schema)
            .map_err(|e| ApiError::bad(format!("the tools' parameters: {e}")))?;
        let call = rename_rules(&call, |r| (r == "root").then(|| "tool-call".to_string()));
        // The markers need no escapes in a GBNF literal.
        let block = format!("tool-block ::= \"{OPEN}\\n\" tool-call \"\\n{CLOSE}\"");
        let root = if self.parallel {
            "root ::= tool-block (\"\\n\" tool-block)*"
        } else {
            "root ::= tool-block"
        };
        Ok(format!("{root}\n{block}\n{call}"))
    }
}

/// The reply's calls: each `<tool_call>` block whose JSON is an object with
/// a string `name` and `arguments` (an object, or a string of JSON), and
/// the text around them as the content (trimmed; as it is without calls). A
/// block that is not such a call, and all after it, stays content.
pub fn read_calls(text: &str) -> (String, Vec<ToolCall>) {
    let mut calls = Vec::new();
    let mut content = String::new();
    let mut rest = text;
    while let Some(at) = rest.find(OPEN) {
        let inner = &rest[at + OPEN.len()..];
        let (body, after) = match inner.find(CLOSE) {
            Some(end) => (&inner[..end], &inner[end + CLOSE.len()..]),
            // A reply cut short (max_tokens) may lack the close.
            None => (inner, ""),
        };
        let Some(call) = call_of(body.trim()) else {
            break;
        };
        content.push_str(&rest[..at]);
        calls.push(call);
        rest = after;
    }
    if calls.is_empty() {
        return (text.to_string(), calls);
    }
    content.push_str(rest);
    (content.trim().to_string(), calls)
}

/// The text before the first call's [`OPEN`] (all of it without one).
pub fn before_calls(text: &str) -> usize {
    text.find(OPEN).unwrap_or(text.len())
}

/// How much of `text`, a reply as it is generated, can be no part of a
/// call: up to the first [`OPEN`], or else all but an end that may be the
/// start of one.
pub fn streamable(text: &str) -> usize {
    if let Some(at) = text.find(OPEN) {
        return at;
    }
    let partial = (1..OPEN.len())
        .rev()
        .find(|&k| text.ends_with(&OPEN[..k]))
        .unwrap_or(0);
    text.len() - partial
}

/// A call's JSON: `{"name": "...", "arguments": {...} or "..."}`.
fn call_of(json: &str) -> Option<ToolCall> {
    let v: Value = serde_json::from_str(json).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let arguments = match v.get("arguments") {
        Some(Value::String(s)) => s.clone(),
        Some(a @ Value::Object(_)) => a.to_string(),
        None | Some(Value::Null) => "{}".into(),
        Some(_) => return None,
    };
    Some(ToolCall { name, arguments })
}

/// How a chat template's model writes tool calls, if the template renders
/// the tools it is given (`probe`: the template rendered with a tool of a
/// probe's name): gpt-oss's harmony where the vocabulary has harmony's
/// markers (`harmony`) and the source sends messages `to=functions`,
/// Hermes-style where the source spells [`OPEN`].
pub fn template_format(
    source: &str,
    harmony: bool,
    probe: impl FnOnce(&Value) -> Option<String>,
) -> Option<ToolFormat> {
    const NAME: &str = "les_tool_probe";
    let format = if harmony && source.contains("to=functions") {
        ToolFormat::Harmony
    } else if source.contains(OPEN) {
        ToolFormat::Hermes
    } else {
        return None;
    };
    let tool = json!([{"type": "function", "function": {"name": NAME,
        "description": "probe", "parameters": {"type": "object", "properties": {}}}}]);
    probe(&tool)
        .is_some_and(|text| text.contains(NAME))
        .then_some(format)
}

/// `grammar` with its rules (defined and referenced) renamed where
/// `rename` gives a new name: rule names outside string literals and
/// character classes.
fn rename_rules(grammar: &str, rename: impl Fn(&str) -> Option<String>) -> String {
    let mut out = String::with_capacity(grammar.len());
    let mut chars = grammar.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        match c {
            '"' | '[' => {
                let close = if c == '"' { '"' } else { ']' };
                out.push(c);
                while let Some((_, d)) = chars.next() {
                    out.push(d);
                    if d == '\\' {
                        if let Some((_, e)) = chars.next() {
                            out.push(e);
                        }
                    } else if d == close {
                        break;
                    }
                }
            }
            c if c.is_ascii_alphanumeric() || c == '-' || c == '_' => {
                let mut end = i + c.len_utf8();
                while let Some(&(j, d)) = chars.peek() {
                    if d.is_ascii_alphanumeric() || d == '-' || d == '_' {
                        end = j + d.len_utf8();
                        chars.next();
                    } else {
                        break;
                    }
                }
                let word = &grammar[i..end];
                match rename(word) {
                    Some(new) => out.push_str(&new),
                    None => out.push_str(word),
                }
            }
            _ => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grammar::Grammar;

    fn tools(extra: Value) -> Result<Option<Tools>, ApiError> {
        let mut body = json!({"tools": [
            {"type": "function", "function": {"name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                    "required": ["city"]}}},
            {"type": "function", "function": {"name": "now"}}
        ]});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        Tools::read(body.as_object().unwrap())
    }

    #[test]
    fn tools_and_the_choice_are_read_and_checked() {
        let t = tools(json!({})).unwrap().unwrap();
        assert_eq!(
            (t.list.len(), &t.choice, t.parallel),
            (2, &ToolChoice::Auto, false)
        );
        assert!(tools(json!({"tool_choice": "none"})).unwrap().is_none());
        let named = json!({"tool_choice": {"type": "function", "function": {"name": "now"}}});
        assert_eq!(
            tools(named).unwrap().unwrap().choice,
            ToolChoice::Function("now".into())
        );
        let err = |v: Value| tools(v).unwrap_err().message;
        let other = json!({"tool_choice": {"type": "function", "function": {"name": "x"}}});
        assert!(err(other).contains("not among the tools"));
        assert!(err(json!({"tool_choice": "sometimes"})).contains("'tool_choice'"));
        assert!(err(json!({"tools": [{"type": "code"}]})).contains("tools[0].type"));
        assert!(err(json!({"tools": [{"type": "function", "function": {}}]})).contains("name"));
        let bad_params = json!({"tools": [{"type": "function",
            "function": {"name": "f", "parameters": 3}}]});
        assert!(err(bad_params).contains("parameters"));
        let many =
            json!({"tools": vec![json!({"type": "function", "function": {"name": "f"}}); 129]});
        assert!(err(many).contains("more than 128"));
        let twice =
            json!({"tools": vec![json!({"type": "function", "function": {"name": "f"}}); 2]});
        assert!(err(twice).contains("a second tool"));
        let odd = json!({"tools": [{"type": "function", "function": {"name": "a b"}}]});
        assert!(err(odd).contains("a-z"));
        let none = json!({"tools": [], "tool_choice": "required"});
        assert!(err(none).contains("no tools"));
        assert!(Tools::read(&Map::new()).unwrap().is_none());
    }

    #[test]
    fn calls_are_read_from_their_blocks_and_the_rest_is_content() {
        let (content, calls) = read_calls(
            "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>{\"name\":\"now\",\"arguments\":\"{}\"}</tool_call>",
        );
        assert_eq!(content, "Let me look.");
        assert_eq!(
            calls,
            [
                ToolCall {
                    name: "get_weather".into(),
                    arguments: r#"{"city":"Paris"}"#.into()
                },
                ToolCall {
                    name: "now".into(),
                    arguments: "{}".into()
                },
            ]
        );
        // Cut short before its close: still a call.
        let (_, calls) = read_calls("<tool_call>{\"name\": \"now\", \"arguments\": {}}");
        assert_eq!(calls.len(), 1);
        // Not a call's JSON: everything from it is content.
        let text = "a <tool_call>{\"name\": 3}</tool_call> b";
        assert_eq!(read_calls(text), (text.to_string(), vec![]));
        assert_eq!(read_calls(" plain "), (" plain ".to_string(), vec![]));
    }

    #[test]
    fn text_is_streamable_up_to_what_may_be_a_call() {
        assert_eq!(streamable("Hello"), 5);
        assert_eq!(streamable("Hello <tool"), 6);
        assert_eq!(streamable("Hello <"), 6);
        assert_eq!(streamable("a <tool_call>{\"name\""), 2);
        assert_eq!(streamable("a <b> c"), 7);
        assert_eq!(before_calls("x <tool_call> y"), 2);
        assert_eq!(before_calls("x"), 1);
    }

    #[test]
    fn a_required_call_is_a_grammar_of_the_tools() {
        let t = tools(json!({"tool_choice": "required"})).unwrap().unwrap();
        let g = t.grammar(ToolFormat::Hermes).unwrap().unwrap();
        Grammar::parse(&g).unwrap_or_else(|e| panic!("{e}\n{g}"));
        assert!(g.starts_with("root ::= tool-block\n"), "{g}");
        assert!(
            g.contains("tool-call ::= ") && !g.contains("\nroot ::= "),
            "{g}"
        );
        assert!(g.contains("get_weather") && g.contains("now"), "{g}");
        // `name` before `arguments`, as the models write them.
        let (name, args) = (
            g.find("name\\\"").unwrap(),
            g.find("arguments\\\"").unwrap(),
        );
        assert!(name < args, "{g}");
        let named = json!({"tool_choice": {"type": "function", "function": {"name": "now"}},
            "parallel_tool_calls": true});
        let g = tools(named)
            .unwrap()
            .unwrap()
            .grammar(ToolFormat::Hermes)
            .unwrap()
            .unwrap();
        assert!(
            !g.contains("get_weather") && g.contains("(\"\\n\" tool-block)*"),
            "{g}"
        );
        let auto = tools(json!({})).unwrap().unwrap();
        assert_eq!(auto.grammar(ToolFormat::Hermes).unwrap(), None);
        assert_eq!(auto.grammar(ToolFormat::Harmony).unwrap(), None);
    }

    #[test]
    fn rules_are_renamed_outside_literals_and_classes() {
        let root = |r: &str| (r == "root").then(|| "call".to_string());
        let g = "root ::= \"root\" [root] root-x root\nx ::= root";
        assert_eq!(
            rename_rules(g, root),
            "call ::= \"root\" [root] root-x call\nx ::= call"
        );
        assert_eq!(
            rename_rules("a ::= \"\\\"root\"", root),
            "a ::= \"\\\"root\""
        );
    }

    #[test]
    fn a_required_harmony_call_is_a_grammar_of_the_tools() {
        let t = tools(json!({"tool_choice": "required"})).unwrap().unwrap();
        let g = t.grammar(ToolFormat::Harmony).unwrap().unwrap();
        let parsed = Grammar::parse(&g).unwrap_or_else(|e| panic!("{e}\n{g}"));
        let mut m = crate::grammar::Matcher::new(parsed).unwrap();
        let head = "<|channel|>commentary to=functions.";
        for (text, ok) in [
            (
                r#"get_weather <|constrain|>json<|message|>{"city": "Paris"}"#,
                true,
            ),
            (r#"now <|constrain|>json<|message|>{}"#, true),
            (r#"get_weather <|constrain|>json<|message|>{}"#, false),
            (r#"other <|constrain|>json<|message|>{}"#, false),
        ] {
            assert_eq!(m.derives(&format!("{head}{text}")), ok, "{text}");
        }
        let named = json!({"tool_choice": {"type": "function", "function": {"name": "now"}}});
        let g = tools(named)
            .unwrap()
            .unwrap()
            .grammar(ToolFormat::Harmony)
            .unwrap()
            .unwrap();
        assert!(!g.contains("get_weather"), "{g}");
        // Auto: from the recipient on, the header's forms as gpt-oss writes them.
        let auto = tools(json!({})).unwrap().unwrap();
        let g = auto.harmony_from_trigger().unwrap();
        let mut m = crate::grammar::Matcher::new(Grammar::parse(&g).unwrap()).unwrap();
        for (text, ok) in [
            (r#"to=functions.now <|constrain|>json<|message|>{}"#, true),
            (r#"to=functions.now json<|message|>{}"#, true),
            (r#"to=functions.now<|message|>{}"#, true),
            (
                r#"to=functions.now<|channel|>commentary <|constrain|>json<|message|>{}"#,
                true,
            ),
            (
                r#"to=functions.now<|channel|>commentary<|message|>{}"#,
                true,
            ),
            (
                r#"to=functions.get_weather<|message|>{"city": "Rome"}"#,
                true,
            ),
            (r#"to=functions.get_weather<|message|>{}"#, false),
            (r#"to=functions.nope<|message|>{}"#, false),
        ] {
            assert_eq!(m.derives(text), ok, "{text}");
        }
    }

    #[test]
    fn templates_are_told_by_their_tools_and_call_syntax() {
        let echo = |t: &Value| Some(t.to_string());
        let src = "{{ tools }} <tool_call>";
        assert_eq!(template_format(src, false, echo), Some(ToolFormat::Hermes));
        assert_eq!(template_format("{{ tools }}", false, echo), None);
        assert_eq!(template_format(src, false, |_| Some(String::new())), None);
        assert_eq!(template_format(src, false, |_| None), None);
        let harmony = "{{ tools }} <|start|>assistant to=functions.";
        assert_eq!(
            template_format(harmony, true, echo),
            Some(ToolFormat::Harmony)
        );
        // Harmony's syntax without its markers in the vocabulary: none.
        assert_eq!(template_format(harmony, false, echo), None);
    }
}
