//! Tool calls (OpenAI's `tools`, `tool_choice`), for models whose chat
//! template takes `tools` and whose calls are in one of the formats llama.cpp
//! reads ([`ToolFormat`], told from the template's source as llama.cpp tells
//! them, [`template_format`]):
//!
//! - Hermes-style blocks, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
//!   (Qwen 2.5 and 3, MiniCPM-V, Hermes 2 Pro and 3, and their kin);
//! - Qwen3-Coder's XML blocks, `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call>`
//!   (Qwen3-Coder, Qwen3.5, Nemotron 3 Nano);
//! - GLM-4.5's, `<tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>\n</tool_call>`;
//! - MiniMax-M2's, `<minimax:tool_call>\n<invoke name="NAME">\n<parameter name="KEY">VALUE</parameter>\n</invoke>\n</minimax:tool_call>`;
//! - Kimi K2's, `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:N<|tool_call_argument_begin|>{...}<|tool_call_end|><|tool_calls_section_end|>`;
//! - gpt-oss's harmony messages to a function, `<|channel|>commentary
//!   to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`.
//!
//! The tools go to the template; the reply's calls come back as
//! `tool_calls` ([`Tools::read_reply`]), a tagged value typed by its
//! parameter's schema. `tool_choice: "required"` (or a named function)
//! constrains the reply by a grammar to one call (several with
//! `parallel_tool_calls`) of the tools given, its arguments following their
//! `parameters` schema ([`Tools::grammar`]); `"auto"` lets the model choose,
//! and from where it starts a call the same grammar constrains the rest
//! (llama.cpp's lazy grammar, [`Tools::lazy`]; a harmony reply from its
//! recipient, `to=functions.`, on); `"none"` renders no tools and reads no
//! calls.

use serde_json::{json, Map, Value};

use super::api::ApiError;
use crate::grammar::{json_schema_to_gbnf, literal};

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
    /// Qwen3-Coder's `<tool_call>` blocks of XML: a [`FUNCTION_OPEN`] line,
    /// then each argument as a [`PARAMETER_OPEN`] line, its value and
    /// [`PARAMETER_CLOSE`], then [`FUNCTION_CLOSE`]. A value is its text
    /// where the parameter's schema allows a string, else JSON (llama.cpp's
    /// reading). Qwen3.5's and Nemotron 3 Nano's templates write them too.
    Xml {
        /// The first call may come without its `<tool_call>` line, as
        /// Qwen3-Coder (a template without reasoning) sometimes writes it;
        /// llama.cpp then also starts the lazy grammar at `<function=NAME>`.
        bare: bool,
    },
    /// GLM-4.5's `<tool_call>` blocks: the function's name, then each
    /// argument as `<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>`
    /// (values typed as [`Xml`](Self::Xml)'s).
    Glm {
        /// A newline after the name and after each key and value (GLM-4.5
        /// and 4.6; GLM-4.7 writes none).
        newlines: bool,
    },
    /// MiniMax-M2's `<minimax:tool_call>` blocks, each of one or more
    /// `<invoke name="NAME">` elements of `<parameter name="KEY">VALUE</parameter>`
    /// lines (values typed as [`Xml`](Self::Xml)'s).
    MiniMax,
    /// Kimi K2's section of calls, each
    /// `<|tool_call_begin|>functions.NAME:N<|tool_call_argument_begin|>{...}<|tool_call_end|>`
    /// (`N` counting the conversation's calls), in
    /// `<|tool_calls_section_begin|>` and `<|tool_calls_section_end|>`.
    Kimi,
}

/// Kimi K2's markers: a section of calls, a call, its arguments, its end.
pub const KIMI_SECTION_BEGIN: &str = "<|tool_calls_section_begin|>";
/// See [`KIMI_SECTION_BEGIN`].
pub const KIMI_SECTION_END: &str = "<|tool_calls_section_end|>";
/// See [`KIMI_SECTION_BEGIN`].
pub const KIMI_CALL_BEGIN: &str = "<|tool_call_begin|>";
/// See [`KIMI_SECTION_BEGIN`].
pub const KIMI_ARGUMENTS_BEGIN: &str = "<|tool_call_argument_begin|>";
/// See [`KIMI_SECTION_BEGIN`].
pub const KIMI_CALL_END: &str = "<|tool_call_end|>";

/// How a format with tagged arguments writes one argument, for reading it
/// back ([`Tools::read_tagged_calls`]): `key_open` KEY `key_close`, then
/// `value_open` (after any whitespace) where there is one, VALUE and
/// `value_close`; the arguments end at `end`.
struct ArgumentSyntax {
    key_open: &'static str,
    key_close: &'static str,
    value_open: Option<&'static str>,
    value_close: &'static str,
    /// The value is on lines of its own: one newline before and after it
    /// is not the value's.
    value_lines: bool,
    end: &'static str,
}

/// Qwen3-Coder's XML arguments.
const XML_ARGUMENTS: ArgumentSyntax = ArgumentSyntax {
    key_open: PARAMETER_OPEN,
    key_close: ">",
    value_open: None,
    value_close: "</parameter>",
    value_lines: true,
    end: "</function>",
};

/// GLM-4.5's arguments.
const GLM_ARGUMENTS: ArgumentSyntax = ArgumentSyntax {
    key_open: "<arg_key>",
    key_close: "</arg_key>",
    value_open: Some("<arg_value>"),
    value_close: "</arg_value>",
    value_lines: false,
    end: CLOSE,
};

/// MiniMax-M2's arguments.
const MINIMAX_ARGUMENTS: ArgumentSyntax = ArgumentSyntax {
    key_open: "<parameter name=\"",
    key_close: "\">",
    value_open: None,
    value_close: "</parameter>",
    value_lines: false,
    end: "</invoke>",
};

/// What opens a MiniMax-M2 block of calls.
pub const MINIMAX_OPEN: &str = "<minimax:tool_call>";
/// What closes it.
pub const MINIMAX_CLOSE: &str = "</minimax:tool_call>";

impl ToolFormat {
    /// What may start a call in a text format's reply (`None` for harmony,
    /// whose calls are told by markers).
    pub fn call_starts(self) -> Option<&'static [&'static str]> {
        match self {
            ToolFormat::Hermes | ToolFormat::Xml { bare: false } | ToolFormat::Glm { .. } => {
                Some(&[OPEN])
            }
            ToolFormat::Xml { bare: true } => Some(&[OPEN, FUNCTION_OPEN]),
            ToolFormat::MiniMax => Some(&[MINIMAX_OPEN]),
            ToolFormat::Kimi => Some(&[KIMI_SECTION_BEGIN, KIMI_CALL_BEGIN]),
            ToolFormat::Harmony => None,
        }
    }

    /// Whether a call started inside the reasoning ends it, as llama.cpp
    /// reads these formats: Qwen3-Coder's XML from templates that reason
    /// (Qwen3.5, Nemotron 3 Nano: `<tool_call>` is one of the thought's end
    /// tags) and Kimi K2's (its calls' markers end the thought).
    pub fn call_ends_reasoning(self) -> bool {
        matches!(self, ToolFormat::Xml { bare: false } | ToolFormat::Kimi)
    }

    /// The markers a reply's text must keep for its calls to be read (its
    /// tokens written out where the vocabulary makes them control tokens,
    /// as llama.cpp's "preserved tokens").
    pub fn markers(self) -> &'static [&'static str] {
        match self {
            ToolFormat::Hermes | ToolFormat::Xml { .. } => &[OPEN, CLOSE],
            ToolFormat::Glm { .. } => &[
                OPEN,
                CLOSE,
                "<arg_key>",
                "</arg_key>",
                "<arg_value>",
                "</arg_value>",
            ],
            ToolFormat::MiniMax => &[MINIMAX_OPEN, MINIMAX_CLOSE],
            ToolFormat::Kimi => &[
                KIMI_SECTION_BEGIN,
                KIMI_SECTION_END,
                KIMI_CALL_BEGIN,
                KIMI_ARGUMENTS_BEGIN,
                KIMI_CALL_END,
            ],
            ToolFormat::Harmony => &[],
        }
    }

    /// The tags of a format whose arguments are tagged text.
    fn tags(self) -> Option<Tags> {
        Some(match self {
            ToolFormat::Xml { bare } => Tags {
                open: "<tool_call>\n",
                close: CLOSE,
                calls_per_block: false,
                head: (FUNCTION_OPEN, ">\n"),
                key: (PARAMETER_OPEN, ">\n"),
                value_end: PARAMETER_CLOSE,
                function_end: FUNCTION_CLOSE,
                bare,
            },
            ToolFormat::Glm { newlines } => Tags {
                open: OPEN,
                close: CLOSE,
                calls_per_block: false,
                head: ("", if newlines { "\n" } else { "" }),
                key: (
                    "<arg_key>",
                    if newlines {
                        "</arg_key>\n<arg_value>"
                    } else {
                        "</arg_key><arg_value>"
                    },
                ),
                value_end: if newlines {
                    "</arg_value>\n"
                } else {
                    "</arg_value>"
                },
                function_end: "",
                bare: false,
            },
            ToolFormat::MiniMax => Tags {
                open: "<minimax:tool_call>\n",
                close: MINIMAX_CLOSE,
                head: ("<invoke name=\"", "\">\n"),
                key: ("<parameter name=\"", "\">"),
                value_end: "</parameter>\n",
                function_end: "</invoke>\n",
                bare: false,
                calls_per_block: true,
            },
            ToolFormat::Hermes | ToolFormat::Harmony | ToolFormat::Kimi => return None,
        })
    }
}

/// How a format with tagged arguments writes a call (see
/// [`Tools::tagged_calls`]): `open`, then `head.0` NAME `head.1`, then for
/// each argument `key.0` KEY `key.1` VALUE `value_end`, then
/// `function_end` and `close`.
struct Tags {
    open: &'static str,
    close: &'static str,
    /// A block holds all the calls (parallel ones included) between its
    /// `open` and `close`, not one each.
    calls_per_block: bool,
    head: (&'static str, &'static str),
    key: (&'static str, &'static str),
    value_end: &'static str,
    function_end: &'static str,
    /// The first block may leave out `open`.
    bare: bool,
}

/// An XML call's function line: `<function=NAME>` and a newline.
pub const FUNCTION_OPEN: &str = "<function=";
/// An XML call's parameter line: `<parameter=KEY>` and a newline.
pub const PARAMETER_OPEN: &str = "<parameter=";
/// What ends an XML call's parameter value: a line of its own.
pub const PARAMETER_CLOSE: &str = "\n</parameter>\n";
/// What ends an XML call's function.
pub const FUNCTION_CLOSE: &str = "</function>\n";
/// Required parameters an XML call may write in any order, up to this many
/// (llama.cpp's `COMMON_CHAT_MAX_PERMUTE`); more go in the schema's order.
const MAX_PERMUTE: usize = 6;

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
            (_, ToolFormat::Xml { .. } | ToolFormat::Glm { .. } | ToolFormat::MiniMax) => {
                self.tagged_calls(format).map(Some)
            }
            (_, ToolFormat::Kimi) => self.kimi_calls(false).map(Some),
        }
    }

    /// For `auto`: the grammar that constrains a reply in `format` from
    /// where it starts a call, and the texts that start one (the grammar
    /// starts with each): [`OPEN`], harmony's [`HARMONY_TRIGGER`], and for a
    /// bare XML format also `<function=NAME>` of each tool, as llama.cpp
    /// triggers.
    pub fn lazy(&self, format: ToolFormat) -> Result<(String, Vec<String>), ApiError> {
        Ok(match format {
            ToolFormat::Hermes => (self.calls()?, vec![OPEN.to_string()]),
            ToolFormat::Harmony => (
                self.harmony_from_trigger()?,
                vec![HARMONY_TRIGGER.to_string()],
            ),
            ToolFormat::MiniMax => (self.tagged_calls(format)?, vec![MINIMAX_OPEN.to_string()]),
            ToolFormat::Kimi => (self.kimi_calls(true)?, vec![KIMI_CALL_BEGIN.to_string()]),
            ToolFormat::Xml { .. } | ToolFormat::Glm { .. } => {
                let mut starts = vec![OPEN.to_string()];
                if format == (ToolFormat::Xml { bare: true }) {
                    starts.extend(
                        self.wanted()
                            .iter()
                            .map(|(name, _)| format!("{FUNCTION_OPEN}{name}>")),
                    );
                }
                (self.tagged_calls(format)?, starts)
            }
        })
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
            // Each tool's rules apart from the others'.
            rules.push_str(&parameters_rules(&params, &format!("t{i}"), name)?);
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

    /// The grammar of Kimi K2's calls ([`ToolFormat::Kimi`]), as llama.cpp's
    /// for Kimi K2 has it: one call (one or more with `parallel`) of a wanted
    /// function, `<|tool_call_begin|>functions.NAME:N<|tool_call_argument_begin|>`
    /// and arguments following its `parameters`, each call's end marker and
    /// the section's end optional. From the section's start (`lazy`: from
    /// the first call's marker, which starts the grammar of an `auto` reply).
    pub fn kimi_calls(&self, lazy: bool) -> Result<String, ApiError> {
        let mut rules = String::new();
        let mut alternatives = Vec::new();
        for (i, (name, params)) in self.wanted().into_iter().enumerate() {
            rules.push_str(&parameters_rules(&params, &format!("t{i}"), name)?);
            // Names are [A-Za-z0-9_-]: the literal needs no escapes.
            alternatives.push(format!(
                "\"{name}:\" [0-9]{{1,9}} {} t{i}-root ({})?",
                literal(KIMI_ARGUMENTS_BEGIN),
                literal(KIMI_CALL_END)
            ));
        }
        let calls = if self.parallel {
            "kimi-call+"
        } else {
            "kimi-call"
        };
        let section = if lazy {
            String::new()
        } else {
            format!("({})? ", literal(KIMI_SECTION_BEGIN))
        };
        Ok(format!(
            "root ::= {section}{calls} ({})?\nkimi-call ::= {} ({})\n{rules}",
            literal(KIMI_SECTION_END),
            literal(&format!("{KIMI_CALL_BEGIN}functions.")),
            alternatives.join(" | ")
        ))
    }

    /// The calls of a reply in a text `format` (not harmony's, whose calls
    /// are told by markers: none) and the text around them as the content.
    pub fn read_reply(&self, text: &str, format: ToolFormat) -> (String, Vec<ToolCall>) {
        match format {
            ToolFormat::Hermes => read_calls(text),
            ToolFormat::Kimi => self.read_kimi_calls(text),
            ToolFormat::Xml { .. } | ToolFormat::Glm { .. } | ToolFormat::MiniMax => {
                self.read_tagged_calls(text, format)
            }
            ToolFormat::Harmony => (text.to_string(), Vec::new()),
        }
    }

    /// The reply's Kimi K2 calls ([`ToolFormat::Kimi`]) and the text before
    /// them as the content (trimmed; as it is without calls): each call from
    /// its `<|tool_call_begin|>` whose id names a function
    /// (`functions.NAME:N`) and whose arguments are a JSON object; the
    /// section's markers are not content. A call that does not read, and
    /// all after it, stays content.
    pub fn read_kimi_calls(&self, text: &str) -> (String, Vec<ToolCall>) {
        let (content, calls) = read_blocks(text, &[KIMI_CALL_BEGIN], |from| {
            kimi_call(&from[KIMI_CALL_BEGIN.len()..]).map(|(call, after)| (vec![call], after))
        });
        if calls.is_empty() {
            return (content, calls);
        }
        let content = content
            .replace(KIMI_SECTION_BEGIN, "")
            .replace(KIMI_SECTION_END, "");
        (content.trim().to_string(), calls)
    }

    /// The grammar of calls in a format with tagged arguments
    /// ([`ToolFormat::Xml`], [`ToolFormat::Glm`], [`ToolFormat::MiniMax`];
    /// any other is refused): blocks of calls (one, or one or more with
    /// `parallel`; MiniMax's in one block) of a wanted function's name, its
    /// required arguments in any order (up to six, llama.cpp's
    /// `COMMON_CHAT_MAX_PERMUTE`), then any of its optional ones, as
    /// llama.cpp's grammar for Qwen3-Coder has them. A value is text up to
    /// its close where the schema allows a string (one of the strings where
    /// it is an enum or const of strings only), else JSON following the
    /// parameter's schema. A bare XML format's first block may leave out
    /// its `<tool_call>` line.
    pub fn tagged_calls(&self, format: ToolFormat) -> Result<String, ApiError> {
        let t = format
            .tags()
            .ok_or_else(|| ApiError::bad("tool calls of this format have no tagged arguments"))?;
        let mut rules = String::new();
        let mut functions = Vec::new();
        let mut needs_text = false;
        for (i, (name, params)) in self.wanted().into_iter().enumerate() {
            let props = params.get("properties").and_then(Value::as_object);
            let required: Vec<&str> = params
                .get("required")
                .and_then(Value::as_array)
                .map(|r| r.iter().filter_map(Value::as_str).collect())
                .unwrap_or_default();
            let mut required_rules = Vec::new();
            let mut optional_rules = Vec::new();
            for (j, (key, schema)) in props.into_iter().flatten().enumerate() {
                let rule = format!("t{i}-p{j}");
                let value = match string_choices(schema) {
                    Some(choices) => format!(
                        "({}) {}",
                        choices
                            .iter()
                            .map(|c| literal(c))
                            .collect::<Vec<_>>()
                            .join(" | "),
                        literal(t.value_end)
                    ),
                    None if types_of(schema, 0) & STRING != 0 => {
                        needs_text = true;
                        "tc-text".to_string()
                    }
                    None => {
                        let g = schema_rules(schema, &rule).map_err(|e| {
                            ApiError::bad(format!("the parameter {key:?} of {name:?}: {e}"))
                        })?;
                        rules.push_str(&g);
                        format!("{rule}-root {}", literal(t.value_end))
                    }
                };
                rules.push_str(&format!(
                    "{rule} ::= {} {value}\n",
                    literal(&format!("{}{key}{}", t.key.0, t.key.1))
                ));
                if required.contains(&key.as_str()) {
                    required_rules.push(rule);
                } else {
                    optional_rules.push(rule);
                }
            }
            let mut args = permutation(&format!("t{i}-req"), &required_rules, &mut rules);
            if !optional_rules.is_empty() {
                rules.push_str(&format!("t{i}-opt ::= {}\n", optional_rules.join(" | ")));
                args.push_str(&format!(" t{i}-opt*"));
            }
            // Names are [A-Za-z0-9_-]: they need no escapes.
            rules.push_str(&format!(
                "t{i} ::= {} {args} {}\n",
                literal(&format!("{}{name}{}", t.head.0, t.head.1)),
                literal(t.function_end)
            ));
            functions.push(format!("t{i}"));
        }
        if needs_text {
            rules.push_str(&text_through("tc-text", t.value_end));
        }
        let open = literal(t.open);
        let first = if t.bare {
            format!("tc-first ::= ({open})? tc-body")
        } else {
            "tc-first ::= tc-call".to_string()
        };
        let (root, body) = match (self.parallel, t.calls_per_block) {
            (true, false) => ("root ::= tc-first (tc-space tc-call)* tc-space", "tc-fn"),
            (true, true) => ("root ::= tc-first tc-space", "tc-fn+"),
            (false, _) => ("root ::= tc-first tc-space", "tc-fn"),
        };
        Ok(format!(
            "{root}\n{first}\ntc-call ::= {open} tc-body\n\
             tc-body ::= {body} {}\ntc-fn ::= {}\n\
             tc-space ::= | \" \" | \"\\n\"{{1,2}} [ \\t]{{0,20}}\n{rules}",
            literal(t.close),
            functions.join(" | "),
        ))
    }

    /// The reply's calls in a format with tagged arguments
    /// ([`ToolFormat::Xml`], [`ToolFormat::Glm`]; none in any other) and the
    /// text around them as the content (trimmed; as it is without calls):
    /// each block from a `<tool_call>` (or, bare, a [`FUNCTION_OPEN`]) whose
    /// function and arguments read, each value typed by its parameter's
    /// schema (see [`ToolFormat::Xml`]). A block that does not read, and all
    /// after it, stays content; a block cut short (`max_tokens`) is a call
    /// of what it has.
    pub fn read_tagged_calls(&self, text: &str, format: ToolFormat) -> (String, Vec<ToolCall>) {
        read_blocks(
            text,
            format.call_starts().unwrap_or(&[]),
            |from| match format {
                ToolFormat::Xml { .. } => self
                    .xml_call(from.strip_prefix(OPEN).unwrap_or(from))
                    .map(|(call, after)| (vec![call], after)),
                ToolFormat::Glm { .. } => self
                    .glm_call(&from[OPEN.len()..])
                    .map(|(call, after)| (vec![call], after)),
                ToolFormat::MiniMax => self.minimax_calls(&from[MINIMAX_OPEN.len()..]),
                ToolFormat::Hermes | ToolFormat::Harmony | ToolFormat::Kimi => None,
            },
        )
    }

    /// A MiniMax-M2 block's calls after its [`MINIMAX_OPEN`] (at least
    /// one), and the text after its close.
    fn minimax_calls<'t>(&self, text: &'t str) -> Option<(Vec<ToolCall>, &'t str)> {
        let mut calls = Vec::new();
        let mut rest = text;
        loop {
            let line = rest.trim_start();
            if let Some(p) = line.strip_prefix("<invoke name=\"") {
                let (name, body) = p.split_once("\">")?;
                let (call, after) = self.call_of(name, body, &MINIMAX_ARGUMENTS)?;
                calls.push(call);
                rest = after;
            } else if let Some(after) = line.strip_prefix(MINIMAX_CLOSE) {
                rest = after;
                break;
            } else if line.is_empty() {
                rest = line;
                break;
            } else {
                return None;
            }
        }
        (!calls.is_empty()).then_some((calls, rest))
    }

    /// One GLM call after its `<tool_call>`, and the text after it.
    fn glm_call<'t>(&self, text: &'t str) -> Option<(ToolCall, &'t str)> {
        let end = text.find(['\n', '<']).unwrap_or(text.len());
        self.call_of(text[..end].trim(), &text[end..], &GLM_ARGUMENTS)
    }

    /// One XML call from its function line on, and the text after it (and
    /// after its `</tool_call>`).
    fn xml_call<'t>(&self, text: &'t str) -> Option<(ToolCall, &'t str)> {
        let rest = text.trim_start().strip_prefix(FUNCTION_OPEN)?;
        let (name, body) = rest.split_once('>')?;
        let (call, rest) = self.call_of(name, body, &XML_ARGUMENTS)?;
        let rest = rest.trim_start().strip_prefix(CLOSE).unwrap_or(rest);
        Some((call, rest))
    }

    /// The call to `name` whose tagged arguments (in `syntax`) `text` starts
    /// with, each value typed by its parameter's schema, and the text after
    /// them: after `syntax.end`, or nothing where the text ends first (a
    /// reply cut short). `None` where the name is not a tool's name's shape
    /// or the text holds something else.
    fn call_of<'t>(
        &self,
        name: &str,
        text: &'t str,
        syntax: &ArgumentSyntax,
    ) -> Option<(ToolCall, &'t str)> {
        if name.is_empty() || name.len() > MAX_NAME || name.contains(['\n', '<', '>']) {
            return None;
        }
        let types = self.parameter_types(name);
        let mut args = Map::new();
        let mut rest = text;
        loop {
            let line = rest.trim_start();
            if let Some(k) = line.strip_prefix(syntax.key_open) {
                let (key, value) = k.split_once(syntax.key_close)?;
                if key.contains('\n') {
                    return None;
                }
                let value = match syntax.value_open {
                    Some(open) => value.trim_start().strip_prefix(open)?,
                    None => value,
                };
                let (mut raw, after) = value.split_once(syntax.value_close).unwrap_or((value, ""));
                if syntax.value_lines {
                    raw = raw.strip_prefix('\n').unwrap_or(raw);
                    raw = raw.strip_suffix('\n').unwrap_or(raw);
                }
                let allowed = types
                    .iter()
                    .find(|(k, _)| k == key)
                    .map_or(ANY, |&(_, t)| t);
                args.insert(key.to_string(), typed_value(raw, allowed));
                rest = after;
            } else if let Some(after) = line.strip_prefix(syntax.end) {
                rest = after;
                break;
            } else if line.is_empty() {
                rest = line;
                break;
            } else {
                return None;
            }
        }
        let call = ToolCall {
            name: name.to_string(),
            arguments: Value::Object(args).to_string(),
        };
        Some((call, rest))
    }

    /// The JSON types each parameter of `function` takes (from its schema).
    fn parameter_types(&self, function: &str) -> Vec<(String, u8)> {
        self.list
            .iter()
            .filter_map(|t| t.get("function"))
            .find(|f| f.get("name").and_then(Value::as_str) == Some(function))
            .and_then(|f| f.get("parameters")?.get("properties")?.as_object())
            .map(|props| {
                props
                    .iter()
                    .map(|(k, schema)| (k.clone(), types_of(schema, 0)))
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// JSON types as bits ([`types_of`]).
const STRING: u8 = 1;
const NUMBER: u8 = 2;
const BOOLEAN: u8 = 4;
const NULL: u8 = 8;
const OBJECT: u8 = 16;
const ARRAY: u8 = 32;
const ANY: u8 = 63;

/// The JSON types a schema's values may have, as bits: from `type` (a name
/// or a list), else `const` or `enum`, else the branches of `anyOf` or
/// `oneOf`; any type where the schema says none of these (or nests past 16).
fn types_of(schema: &Value, depth: u32) -> u8 {
    let of_value = |v: &Value| match v {
        Value::String(_) => STRING,
        Value::Number(_) => NUMBER,
        Value::Bool(_) => BOOLEAN,
        Value::Null => NULL,
        Value::Object(_) => OBJECT,
        Value::Array(_) => ARRAY,
    };
    let of_name = |n: &Value| match n.as_str() {
        Some("string") => STRING,
        Some("number" | "integer") => NUMBER,
        Some("boolean") => BOOLEAN,
        Some("null") => NULL,
        Some("object") => OBJECT,
        Some("array") => ARRAY,
        _ => 0,
    };
    let Some(s) = schema.as_object().filter(|_| depth < 16) else {
        return ANY;
    };
    let bits = if let Some(t) = s.get("type") {
        match t {
            Value::Array(names) => names.iter().map(of_name).fold(0, |a, b| a | b),
            name => of_name(name),
        }
    } else if let Some(c) = s.get("const") {
        of_value(c)
    } else if let Some(Value::Array(values)) = s.get("enum") {
        values.iter().map(of_value).fold(0, |a, b| a | b)
    } else if let Some(Value::Array(branches)) = s.get("anyOf").or_else(|| s.get("oneOf")) {
        branches
            .iter()
            .map(|b| types_of(b, depth + 1))
            .fold(0, |a, b| a | b)
    } else {
        ANY
    };
    if bits == 0 {
        ANY
    } else {
        bits
    }
}

/// The strings a schema allows where it is a `const` or `enum` of strings
/// only (and has no other `type` than string).
fn string_choices(schema: &Value) -> Option<Vec<&str>> {
    let s = schema.as_object()?;
    if s.get("type").is_some_and(|t| t.as_str() != Some("string")) {
        return None;
    }
    let values: Vec<&Value> = match (s.get("const"), s.get("enum")) {
        (Some(c), _) => vec![c],
        (None, Some(Value::Array(v))) if !v.is_empty() => v.iter().collect(),
        _ => return None,
    };
    values.into_iter().map(Value::as_str).collect()
}

/// An XML value as its parameter takes it (`allowed`: its JSON types): text
/// where only strings are allowed; else JSON where the text reads as a
/// value of an allowed type, else the text (llama.cpp's typing of values).
fn typed_value(raw: &str, allowed: u8) -> Value {
    if allowed == STRING {
        return Value::String(raw.to_string());
    }
    match serde_json::from_str::<Value>(raw.trim()) {
        Ok(v) if allowed & STRING == 0 || types_of(&json!({"const": v}), 0) & allowed != 0 => v,
        _ => Value::String(raw.to_string()),
    }
}

/// One Kimi K2 call after its `<|tool_call_begin|>`, and the text after it
/// (and after its end marker).
fn kimi_call(text: &str) -> Option<(ToolCall, &str)> {
    let (id, rest) = text.split_once(KIMI_ARGUMENTS_BEGIN)?;
    let id = id.trim();
    let name = id.strip_prefix("functions.").unwrap_or(id);
    let name = name.rsplit_once(':').map_or(name, |(n, _)| n);
    if name.is_empty() || name.len() > MAX_NAME || name.contains(['\n', '<']) {
        return None;
    }
    let (json, after) = match rest.find(KIMI_CALL_END) {
        Some(end) => (&rest[..end], &rest[end + KIMI_CALL_END.len()..]),
        None => match rest.find(KIMI_SECTION_END) {
            Some(end) => (&rest[..end], &rest[end..]),
            // Cut short (max_tokens).
            None => (rest, ""),
        },
    };
    let args: Value = serde_json::from_str(json.trim()).ok()?;
    if !args.is_object() {
        return None;
    }
    let call = ToolCall {
        name: name.to_string(),
        arguments: args.to_string(),
    };
    Some((call, after))
}

/// Rules `name` (and `name-NN`) deriving any text up to and including the
/// first `end` (non-empty): a right-linear grammar of the automaton that
/// finds `end` (each state: how much of `end` the text's last characters
/// are), as llama.cpp's grammars read "up to a delimiter".
fn text_through(name: &str, end: &str) -> String {
    let end: Vec<char> = end.chars().collect();
    let state = |i: usize| {
        if i == 0 {
            name.to_string()
        } else {
            format!("{name}-{i:02}")
        }
    };
    // After `i` characters of `end` and then `c`: how many are matched.
    let next = |i: usize, c: char| {
        (0..=i + 1)
            .rev()
            .find(|&k| {
                k == 0 || {
                    let seen: Vec<char> = end[..i].iter().copied().chain([c]).collect();
                    seen.ends_with(&end[..k])
                }
            })
            .unwrap_or(0)
    };
    let mut alphabet: Vec<char> = end.clone();
    alphabet.sort_unstable();
    alphabet.dedup();
    let mut out = String::new();
    for i in 0..end.len() {
        let mut alternatives = Vec::new();
        // Characters that move to a state other than the start, by target.
        let mut targets: Vec<(usize, Vec<char>)> = Vec::new();
        for &c in &alphabet {
            match next(i, c) {
                0 => {}
                k => match targets.iter_mut().find(|(t, _)| *t == k) {
                    Some((_, cs)) => cs.push(c),
                    None => targets.push((k, vec![c])),
                },
            }
        }
        for (k, cs) in &targets {
            if *k == end.len() {
                alternatives.push(char_class(cs, false));
            } else {
                alternatives.push(format!("{} {}", char_class(cs, false), state(*k)));
            }
        }
        let specific: Vec<char> = targets
            .iter()
            .flat_map(|(_, cs)| cs.iter().copied())
            .collect();
        alternatives.push(format!("{} {}", char_class(&specific, true), state(0)));
        out.push_str(&format!("{} ::= {}\n", state(i), alternatives.join(" | ")));
    }
    out
}

/// A GBNF character class of `chars` (`negated`: all but them).
fn char_class(chars: &[char], negated: bool) -> String {
    let mut out = String::from(if negated { "[^" } else { "[" });
    for &c in chars {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\\' | ']' | '[' | '^' | '-' => {
                out.push('\\');
                out.push(c);
            }
            c => out.push(c),
        }
    }
    out.push(']');
    out
}

/// Rules for `items` (rule names) in any order, named `name-MASK` by the
/// items still to come, added to `rules` (up to [`MAX_PERMUTE`] items; more,
/// or one, in order); the expression that derives them.
fn permutation(name: &str, items: &[String], rules: &mut String) -> String {
    if items.len() <= 1 || items.len() > MAX_PERMUTE {
        return items.join(" ");
    }
    let full = (1u32 << items.len()) - 1;
    for mask in 1..=full {
        let alternatives: Vec<String> = (0..items.len())
            .filter(|&b| mask & (1 << b) != 0)
            .map(|b| match mask & !(1 << b) {
                0 => items[b].clone(),
                left => format!("{} {name}-{left}", items[b]),
            })
            .collect();
        rules.push_str(&format!("{name}-{mask} ::= {}\n", alternatives.join(" | ")));
    }
    format!("{name}-{full}")
}

/// Where the first of `starts` is in `text`.
fn first_of(text: &str, starts: &[&str]) -> Option<usize> {
    starts.iter().filter_map(|s| text.find(s)).min()
}

/// The reply's calls: each `<tool_call>` block whose JSON is an object with
/// a string `name` and `arguments` (an object, or a string of JSON), and
/// the text around them as the content (trimmed; as it is without calls). A
/// block that is not such a call, and all after it, stays content.
pub fn read_calls(text: &str) -> (String, Vec<ToolCall>) {
    read_blocks(text, &[OPEN], |from| {
        let inner = &from[OPEN.len()..];
        let (body, after) = match inner.find(CLOSE) {
            Some(end) => (&inner[..end], &inner[end + CLOSE.len()..]),
            // A reply cut short (max_tokens) may lack the close.
            None => (inner, ""),
        };
        call_of(body.trim()).map(|call| (vec![call], after))
    })
}

/// The calls of the blocks of `text` that start at any of `starts`, each
/// read by `block` (given the text from its start; its calls and the text
/// after it), and the text around them as the content (trimmed; as it is
/// without calls). A block that does not read, and all after it, stays
/// content.
fn read_blocks<'t>(
    text: &'t str,
    starts: &[&str],
    mut block: impl FnMut(&'t str) -> Option<(Vec<ToolCall>, &'t str)>,
) -> (String, Vec<ToolCall>) {
    let mut calls = Vec::new();
    let mut content = String::new();
    let mut rest = text;
    while let Some(at) = first_of(rest, starts) {
        let Some((found, after)) = block(&rest[at..]) else {
            break;
        };
        content.push_str(&rest[..at]);
        calls.extend(found);
        rest = after;
    }
    if calls.is_empty() {
        return (text.to_string(), calls);
    }
    content.push_str(rest);
    (content.trim().to_string(), calls)
}

/// Where the first call of `text` starts, a call starting at any of
/// `starts`.
pub fn first_call(text: &str, starts: &[&str]) -> Option<usize> {
    first_of(text, starts)
}

/// The text before the first call (all of it without one), a call
/// starting at any of `starts` ([`ToolFormat::call_starts`]).
pub fn before_calls(text: &str, starts: &[&str]) -> usize {
    first_of(text, starts).unwrap_or(text.len())
}

/// How much of `text`, a reply as it is generated, can be no part of a
/// call (one starting at any of `starts`): up to the first call, or else
/// all but an end that may be the start of one.
pub fn streamable(text: &str, starts: &[&str]) -> usize {
    if let Some(at) = first_of(text, starts) {
        return at;
    }
    let partial = starts
        .iter()
        .filter_map(|s| {
            (1..s.len())
                .rev()
                .find(|&k| s.is_char_boundary(k) && text.ends_with(&s[..k]))
        })
        .max()
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
/// probe's name), told by the template's source as llama.cpp tells them:
/// gpt-oss's harmony where the vocabulary has harmony's markers (`harmony`)
/// and the source sends messages `to=functions`; Qwen3-Coder's XML where it
/// spells `<tool_call>`, `<function=` and `<parameter=` (not a variant
/// without newlines between the tags, which les does not read), bare where
/// it has no `<think>`; GLM's where it spells `<tool_call>`, `<arg_key>` and
/// `<arg_value>` (without newlines where a key's close meets a value's open);
/// Kimi K2's where it spells its section's and a call's markers; MiniMax-M2's
/// where it spells [`MINIMAX_OPEN`] and `<invoke name=`
/// (MiniMax-M3's namespaced ones are refused); else Hermes-style where it
/// spells [`OPEN`].
pub fn template_format(
    source: &str,
    harmony: bool,
    probe: impl FnOnce(&Value) -> Option<String>,
) -> Option<ToolFormat> {
    const NAME: &str = "les_tool_probe";
    let has = |s: &str| source.contains(s);
    let format = if harmony && has("to=functions") {
        ToolFormat::Harmony
    } else if has(OPEN) && has(FUNCTION_OPEN) && has(PARAMETER_OPEN) {
        if has("'<tool_call><function=' ~ tool_call.name ~ '>'") {
            return None;
        }
        ToolFormat::Xml {
            bare: !has("<think>"),
        }
    } else if has(KIMI_SECTION_BEGIN) && has(KIMI_CALL_BEGIN) {
        ToolFormat::Kimi
    } else if has(MINIMAX_OPEN) && has("<invoke name=") {
        ToolFormat::MiniMax
    } else if has("]<]minimax[>[") {
        // MiniMax-M3's namespaced calls: not read.
        return None;
    } else if has(OPEN) && has("<arg_key>") && has("<arg_value>") {
        ToolFormat::Glm {
            newlines: !has("</arg_key><arg_value>"),
        }
    } else if has(OPEN) {
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

/// The grammar of `schema`'s documents with every rule it defines named
/// `{prefix}-{rule}` (its start `{prefix}-root`), apart from other rules.
fn schema_rules(schema: &Value, prefix: &str) -> Result<String, crate::grammar::GrammarError> {
    let g = json_schema_to_gbnf(&schema.to_string())?;
    let defined: Vec<&str> = g.lines().filter_map(|l| l.split(" ::= ").next()).collect();
    Ok(rename_rules(&g, |r| {
        defined.contains(&r).then(|| format!("{prefix}-{r}"))
    }))
}

/// [`schema_rules`] of a tool's `parameters`, an error naming the tool.
fn parameters_rules(params: &Value, prefix: &str, name: &str) -> Result<String, ApiError> {
    schema_rules(params, prefix)
        .map_err(|e| ApiError::bad(format!("the parameters of {name:?}: {e}")))
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
        assert_eq!(streamable("Hello", &[OPEN]), 5);
        assert_eq!(streamable("Hello <tool", &[OPEN]), 6);
        assert_eq!(streamable("Hello <", &[OPEN]), 6);
        assert_eq!(streamable("a <tool_call>{\"name\"", &[OPEN]), 2);
        assert_eq!(streamable("a <b> c", &[OPEN]), 7);
        assert_eq!(before_calls("x <tool_call> y", &[OPEN]), 2);
        assert_eq!(before_calls("x", &[OPEN]), 1);
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

    /// A matcher over `grammar`.
    fn matcher(grammar: &str) -> crate::grammar::Matcher {
        let parsed = Grammar::parse(grammar).unwrap_or_else(|e| panic!("{e}\n{grammar}"));
        crate::grammar::Matcher::new(parsed).unwrap()
    }

    /// Tools whose parameters take each kind of value.
    fn xml_tools(extra: Value) -> Tools {
        let mut body = json!({"tools": [
            {"type": "function", "function": {"name": "get_weather",
                "parameters": {"type": "object", "properties": {
                    "city": {"type": "string"}, "unit": {"enum": ["c", "f"]},
                    "days": {"type": "integer"}, "hourly": {"type": ["boolean", "string"]}},
                    "required": ["city", "unit"]}}},
            {"type": "function", "function": {"name": "now"}}
        ]});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        Tools::read(body.as_object().unwrap()).unwrap().unwrap()
    }

    fn xml_call(params: &[(&str, &str)]) -> String {
        let mut s = String::from("<tool_call>\n<function=get_weather>\n");
        for (k, v) in params {
            s.push_str(&format!("<parameter={k}>\n{v}\n</parameter>\n"));
        }
        s + "</function>\n</tool_call>"
    }

    #[test]
    fn a_required_xml_call_is_a_grammar_of_the_tools() {
        let t = xml_tools(json!({"tool_choice": "required"}));
        let g = t.grammar(ToolFormat::Xml { bare: false }).unwrap().unwrap();
        let mut m = matcher(&g);
        let ok = |m: &mut crate::grammar::Matcher, text: &str| m.derives(text);
        // Required parameters in either order, then optional ones; text
        // values may hold anything but their close, on lines of their own.
        for (text, want) in [
            (xml_call(&[("city", "Paris"), ("unit", "c")]), true),
            (xml_call(&[("unit", "f"), ("city", "Rome")]), true),
            (
                xml_call(&[("city", "Paris"), ("unit", "c"), ("days", "3")]),
                true,
            ),
            (
                xml_call(&[("city", "a\n</param\n<b>\n</parameter>x"), ("unit", "c")]),
                true,
            ),
            (
                xml_call(&[("city", "x"), ("unit", "c"), ("hourly", "true")]),
                true,
            ),
            (
                xml_call(&[("city", "x"), ("unit", "c"), ("hourly", "every hour")]),
                true,
            ),
            // A required one missing, an optional one first, an enum's
            // other value, an integer's text, an unknown parameter.
            (xml_call(&[("city", "Paris")]), false),
            (
                xml_call(&[("days", "3"), ("city", "Paris"), ("unit", "c")]),
                false,
            ),
            (xml_call(&[("city", "Paris"), ("unit", "k")]), false),
            (
                xml_call(&[("city", "Paris"), ("unit", "c"), ("days", "three")]),
                false,
            ),
            (
                xml_call(&[("city", "Paris"), ("unit", "c"), ("x", "1")]),
                false,
            ),
            (
                "<tool_call>\n<function=now>\n</function>\n</tool_call>".to_string(),
                true,
            ),
            (
                "<tool_call>\n<function=later>\n</function>\n</tool_call>".to_string(),
                false,
            ),
            // Not bare: the block's line is needed; one call only.
            (
                "<function=now>\n</function>\n</tool_call>".to_string(),
                false,
            ),
            (
                format!(
                    "{}\n{}",
                    xml_call(&[("city", "P"), ("unit", "c")]),
                    xml_call(&[("city", "R"), ("unit", "f")])
                ),
                false,
            ),
        ] {
            assert_eq!(ok(&mut m, &text), want, "{text:?}\n{g}");
        }
        // Parallel and bare: several calls, the first one's line optional.
        let t = xml_tools(json!({"tool_choice": "required", "parallel_tool_calls": true}));
        let g = t.grammar(ToolFormat::Xml { bare: true }).unwrap().unwrap();
        let mut m = matcher(&g);
        let two = format!(
            "{}\n{}\n",
            xml_call(&[("city", "P"), ("unit", "c")]),
            xml_call(&[("city", "R"), ("unit", "f")])
        );
        assert!(m.derives(&two), "{g}");
        assert!(m.derives("<function=now>\n</function>\n</tool_call>"));
        // Named: that function only.
        let named =
            xml_tools(json!({"tool_choice": {"type": "function", "function": {"name": "now"}}}));
        let g = named
            .grammar(ToolFormat::Xml { bare: false })
            .unwrap()
            .unwrap();
        assert!(!g.contains("get_weather"), "{g}");
        // Auto: the same grammar from `<tool_call>` on, and bare, from each
        // tool's function line too.
        let auto = xml_tools(json!({}));
        assert_eq!(auto.grammar(ToolFormat::Xml { bare: true }).unwrap(), None);
        let (g, starts) = auto.lazy(ToolFormat::Xml { bare: true }).unwrap();
        assert_eq!(
            starts,
            ["<tool_call>", "<function=get_weather>", "<function=now>"]
        );
        let mut m = matcher(&g);
        assert!(m.derives("<tool_call>\n<function=now>\n</function>\n</tool_call>"));
        assert!(m.derives("<function=now>\n</function>\n</tool_call>"));
        let (_, starts) = auto.lazy(ToolFormat::Xml { bare: false }).unwrap();
        assert_eq!(starts, ["<tool_call>"]);
        assert_eq!(auto.lazy(ToolFormat::Hermes).unwrap().1, ["<tool_call>"]);
        assert_eq!(auto.lazy(ToolFormat::Harmony).unwrap().1, [HARMONY_TRIGGER]);
    }

    #[test]
    fn required_parameters_come_in_any_order_up_to_six() {
        let props: Map<String, Value> = (0..7)
            .map(|i| (format!("p{i}"), json!({"type": "integer"})))
            .collect();
        let tools_of = |n: usize| {
            let required: Vec<String> = (0..n).map(|i| format!("p{i}")).collect();
            let props: Map<String, Value> = props
                .iter()
                .take(n)
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            let body = json!({"tools": [{"type": "function", "function": {"name": "f",
                "parameters": {"type": "object", "properties": props, "required": required}}}],
                "tool_choice": "required"});
            Tools::read(body.as_object().unwrap()).unwrap().unwrap()
        };
        let call = |order: &[usize]| {
            let mut s = String::from("<tool_call>\n<function=f>\n");
            for i in order {
                s.push_str(&format!("<parameter=p{i}>\n{i}\n</parameter>\n"));
            }
            s + "</function>\n</tool_call>"
        };
        let g = tools_of(6)
            .grammar(ToolFormat::Xml { bare: false })
            .unwrap()
            .unwrap();
        let mut m = matcher(&g);
        assert!(m.derives(&call(&[5, 3, 1, 0, 2, 4])));
        assert!(m.derives(&call(&[0, 1, 2, 3, 4, 5])));
        assert!(!m.derives(&call(&[0, 1, 2, 3, 4])));
        assert!(!m.derives(&call(&[0, 1, 2, 3, 4, 5, 5])));
        // Seven: in the schema's order only.
        let g = tools_of(7)
            .grammar(ToolFormat::Xml { bare: false })
            .unwrap()
            .unwrap();
        let mut m = matcher(&g);
        assert!(m.derives(&call(&[0, 1, 2, 3, 4, 5, 6])));
        assert!(!m.derives(&call(&[1, 0, 2, 3, 4, 5, 6])));
    }

    #[test]
    fn text_through_its_end_matches_up_to_the_first_end() {
        for end in ["\n</parameter>\n", "aab", "abab", "x"] {
            let g = format!("root ::= t\n{}", text_through("t", end));
            let mut m = matcher(&g);
            // Brute force over short strings of the end's characters and one other.
            let mut alphabet: Vec<char> = end.chars().collect();
            alphabet.push('z');
            alphabet.dedup();
            let mut texts = vec![String::new()];
            for _ in 0..6 {
                let longer: Vec<String> = texts
                    .iter()
                    .flat_map(|t| alphabet.iter().map(move |c| format!("{t}{c}")))
                    .collect();
                texts.extend(longer);
                texts.sort();
                texts.dedup();
            }
            for body in &texts {
                let text = format!("{body}{end}");
                let first = text.find(end).unwrap() + end.len() == text.len();
                assert_eq!(m.derives(&text), first, "{end:?}: {text:?}");
            }
        }
    }

    #[test]
    fn xml_calls_are_read_and_their_values_typed() {
        let t = xml_tools(json!({}));
        let read = |text: &str, bare| t.read_tagged_calls(text, ToolFormat::Xml { bare });
        let text = format!(
            "Let me check.\n{}\n{}",
            xml_call(&[
                ("city", "New York"),
                ("unit", "c"),
                ("days", "3"),
                ("hourly", "true")
            ]),
            "<tool_call>\n<function=now>\n</function>\n</tool_call>"
        );
        let (content, calls) = t.read_tagged_calls(&text, ToolFormat::Xml { bare: false });
        assert_eq!(content, "Let me check.");
        assert_eq!(
            calls,
            [
                ToolCall {
                    name: "get_weather".into(),
                    arguments: r#"{"city":"New York","unit":"c","days":3,"hourly":true}"#.into()
                },
                ToolCall {
                    name: "now".into(),
                    arguments: "{}".into()
                }
            ]
        );
        // A string parameter keeps text that reads as JSON; one of several
        // types keeps text that is none of its others; a value's own lines.
        let (_, calls) = read(
            &xml_call(&[
                ("city", "42"),
                ("unit", "c"),
                ("hourly", "[1]"),
                ("days", "x"),
            ]),
            false,
        );
        assert_eq!(
            calls[0].arguments,
            r#"{"city":"42","unit":"c","hourly":"[1]","days":"x"}"#
        );
        let (_, calls) = t.read_tagged_calls(
            &xml_call(&[("city", "a\n\nb")]),
            ToolFormat::Xml { bare: false },
        );
        assert_eq!(calls[0].arguments, r#"{"city":"a\n\nb"}"#);
        // Bare: a call without its block's line; not bare, that is content.
        let bare = "Sure.\n<function=now>\n</function>\n</tool_call>";
        assert_eq!(
            t.read_tagged_calls(bare, ToolFormat::Xml { bare: true })
                .1
                .len(),
            1
        );
        assert_eq!(
            t.read_tagged_calls(bare, ToolFormat::Xml { bare: false }),
            (bare.to_string(), vec![])
        );
        // Cut short: a call of what it has.
        let (_, calls) = read(
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
            false,
        );
        assert_eq!(calls[0].arguments, r#"{"city":"Par"}"#);
        // Not a call: everything from it is content.
        let odd = "a <tool_call>\n{\"name\": \"now\"}\n</tool_call> b";
        assert_eq!(
            t.read_tagged_calls(odd, ToolFormat::Xml { bare: false }),
            (odd.to_string(), vec![])
        );
    }

    #[test]
    fn glm_calls_are_a_grammar_and_read_back() {
        let glm_call = |newlines: bool, params: &[(&str, &str)]| {
            let nl = if newlines { "\n" } else { "" };
            let mut s = format!("<tool_call>get_weather{nl}");
            for (k, v) in params {
                s.push_str(&format!(
                    "<arg_key>{k}</arg_key>{nl}<arg_value>{v}</arg_value>{nl}"
                ));
            }
            s + "</tool_call>"
        };
        let t = xml_tools(json!({"tool_choice": "required"}));
        for newlines in [true, false] {
            let format = ToolFormat::Glm { newlines };
            let g = t.grammar(format).unwrap().unwrap();
            let mut m = matcher(&g);
            for (params, want) in [
                (&[("city", "Paris"), ("unit", "c")][..], true),
                (&[("unit", "f"), ("city", "a</arg_val>b")][..], true),
                (&[("city", "Paris"), ("unit", "c"), ("days", "3")][..], true),
                (&[("city", "Paris")][..], false),
                (
                    &[("city", "Paris"), ("unit", "c"), ("days", "x")][..],
                    false,
                ),
            ] {
                assert!(
                    m.derives(&glm_call(newlines, params)) == want,
                    "{params:?}\n{g}"
                );
                // The other spacing is not this format's.
                assert!(!m.derives(&glm_call(!newlines, params)), "{params:?}");
            }
            let nl = if newlines { "\n" } else { "" };
            assert!(m.derives(&format!("<tool_call>now{nl}</tool_call>")));
            let text = format!(
                "Checking. {}",
                glm_call(newlines, &[("city", "Paris"), ("unit", "c"), ("days", "3")])
            );
            let (content, calls) = t.read_tagged_calls(&text, format);
            assert_eq!(content, "Checking.");
            assert_eq!(calls.len(), 1);
            assert_eq!(calls[0].name, "get_weather");
            assert_eq!(
                calls[0].arguments,
                r#"{"city":"Paris","unit":"c","days":3}"#
            );
            assert_eq!(t.lazy(format).unwrap().1, ["<tool_call>"]);
        }
        // Hermes JSON in a block is not a GLM call.
        let hermes = "<tool_call>\n{\"name\": \"now\"}\n</tool_call>";
        let (content, calls) = t.read_tagged_calls(hermes, ToolFormat::Glm { newlines: true });
        assert_eq!((content.as_str(), calls.len()), (hermes, 0));
    }

    proptest::proptest! {
        /// Replies of call fragments in any order: reading never panics,
        /// keeps a reply without calls whole, and gives object arguments.
        #[test]
        fn tagged_replies_read_without_panics(
            parts in proptest::collection::vec(0usize..18, 0..24),
            bare in proptest::bool::ANY,
        ) {
            const FRAGMENTS: [&str; 18] = [
                "<tool_call>", "\n", "<function=now>", "<function=get_weather>",
                "<parameter=city>", "</parameter>", "</function>", "</tool_call>",
                "<arg_key>", "city", "</arg_key>", "<arg_value>", "</arg_value>", "é",
                "<minimax:tool_call>", "<invoke name=\"now\">", "<parameter name=\"city\">",
                "</invoke>",
            ];
            let text: String = parts.iter().map(|&i| FRAGMENTS[i]).collect();
            let t = xml_tools(json!({}));
            for format in [ToolFormat::Xml { bare }, ToolFormat::Glm { newlines: bare }, ToolFormat::MiniMax] {
                let (content, calls) = t.read_tagged_calls(&text, format);
                if calls.is_empty() {
                    proptest::prop_assert_eq!(&content, &text);
                }
                for call in &calls {
                    let args: Value = serde_json::from_str(&call.arguments).unwrap();
                    proptest::prop_assert!(args.is_object());
                }
                let _ = streamable(&text, format.call_starts().unwrap());
            }
        }
    }

    #[test]
    fn minimax_calls_are_a_grammar_and_read_back() {
        let invoke = |name: &str, params: &[(&str, &str)]| {
            let mut s = format!("<invoke name=\"{name}\">\n");
            for (k, v) in params {
                s.push_str(&format!("<parameter name=\"{k}\">{v}</parameter>\n"));
            }
            s + "</invoke>\n"
        };
        let block = |invokes: &[String]| {
            format!(
                "<minimax:tool_call>\n{}</minimax:tool_call>",
                invokes.concat()
            )
        };
        let weather = invoke(
            "get_weather",
            &[("city", "Paris"), ("unit", "c"), ("days", "2")],
        );
        let now = invoke("now", &[]);
        let t = xml_tools(json!({"tool_choice": "required"}));
        let g = t.grammar(ToolFormat::MiniMax).unwrap().unwrap();
        let mut m = matcher(&g);
        assert!(m.derives(&block(std::slice::from_ref(&weather))), "{g}");
        assert!(m.derives(&block(std::slice::from_ref(&now))));
        assert!(
            !m.derives(&block(&[weather.clone(), now.clone()])),
            "one call"
        );
        assert!(!m.derives(&block(&[invoke("get_weather", &[("city", "Paris")])])));
        // Parallel: several invokes in one block.
        let p = xml_tools(json!({"tool_choice": "required", "parallel_tool_calls": true}));
        let mut m = matcher(&p.grammar(ToolFormat::MiniMax).unwrap().unwrap());
        assert!(m.derives(&block(&[weather.clone(), now.clone()])));
        assert!(!m.derives(&block(&[])));
        // Read back, two calls of one block, values typed.
        let text = format!("Let me see. {}", block(&[weather, now]));
        let (content, calls) = t.read_tagged_calls(&text, ToolFormat::MiniMax);
        assert_eq!(content, "Let me see.");
        assert_eq!(
            calls,
            [
                ToolCall {
                    name: "get_weather".into(),
                    arguments: r#"{"city":"Paris","unit":"c","days":2}"#.into()
                },
                ToolCall {
                    name: "now".into(),
                    arguments: "{}".into()
                }
            ]
        );
        let (_, starts) = t.lazy(ToolFormat::MiniMax).unwrap();
        assert_eq!(starts, [MINIMAX_OPEN]);
        // An empty block is no call.
        let empty = "<minimax:tool_call>\n</minimax:tool_call>";
        assert_eq!(t.read_tagged_calls(empty, ToolFormat::MiniMax).1, vec![]);
    }

    #[test]
    fn kimi_calls_are_a_grammar_and_read_back() {
        let call = |name: &str, n: u32, args: &str| {
            format!("<|tool_call_begin|>functions.{name}:{n}<|tool_call_argument_begin|>{args}<|tool_call_end|>")
        };
        let section = |calls: &[String]| {
            format!(
                "<|tool_calls_section_begin|>{}<|tool_calls_section_end|>",
                calls.concat()
            )
        };
        let weather = call("get_weather", 0, r#"{"city": "Paris", "unit": "c"}"#);
        let now = call("now", 1, "{}");
        let t = xml_tools(json!({"tool_choice": "required"}));
        let g = t.grammar(ToolFormat::Kimi).unwrap().unwrap();
        let mut m = matcher(&g);
        assert!(m.derives(&section(std::slice::from_ref(&weather))), "{g}");
        assert!(m.derives(&weather), "the section's markers are optional");
        assert!(
            !m.derives(&section(&[weather.clone(), now.clone()])),
            "one call"
        );
        assert!(!m.derives(&call("get_weather", 0, r#"{"city": "Paris"}"#)));
        assert!(!m.derives(&call("later", 0, "{}")));
        let p = xml_tools(json!({"tool_choice": "required", "parallel_tool_calls": true}));
        let mut m = matcher(&p.grammar(ToolFormat::Kimi).unwrap().unwrap());
        assert!(m.derives(&section(&[weather.clone(), now.clone()])));
        // Auto: from the first call's marker on.
        let (g, starts) = xml_tools(json!({})).lazy(ToolFormat::Kimi).unwrap();
        assert_eq!(starts, [KIMI_CALL_BEGIN]);
        let mut m = matcher(&g);
        assert!(m.derives(&format!("{now}<|tool_calls_section_end|>")));
        assert!(!m.derives(&section(std::slice::from_ref(&now))));
        // Read back: ids name the functions, markers are not content.
        let text = format!("Checking.{}", section(&[weather, now]));
        let (content, calls) = t.read_reply(&text, ToolFormat::Kimi);
        assert_eq!(content, "Checking.");
        assert_eq!(
            calls,
            [
                ToolCall {
                    name: "get_weather".into(),
                    arguments: r#"{"city":"Paris","unit":"c"}"#.into()
                },
                ToolCall {
                    name: "now".into(),
                    arguments: "{}".into()
                }
            ]
        );
        // Arguments that are not an object: not a call.
        let odd = section(&[call("now", 0, "[1]")]);
        assert_eq!(t.read_reply(&odd, ToolFormat::Kimi), (odd.clone(), vec![]));
        // Cut short: a call of what it has, if that reads.
        let cut = "<|tool_call_begin|>functions.now:0<|tool_call_argument_begin|>{}";
        assert_eq!(t.read_reply(cut, ToolFormat::Kimi).1.len(), 1);
    }

    #[test]
    fn xml_text_is_streamable_up_to_what_may_be_a_call() {
        let bare = ToolFormat::Xml { bare: true }.call_starts().unwrap();
        assert_eq!(streamable("Hi <func", bare), 3);
        assert_eq!(streamable("Hi <tool", bare), 3);
        assert_eq!(streamable("Hi <function=now>", bare), 3);
        assert_eq!(streamable("Hi <functional>", bare), 15);
        let plain = ToolFormat::Xml { bare: false }.call_starts().unwrap();
        assert_eq!(streamable("Hi <function=now>", plain), 17);
        assert_eq!(before_calls("a <function=x> <tool_call>", bare), 2);
        assert_eq!(before_calls("a <function=x> <tool_call>", plain), 15);
        assert_eq!(ToolFormat::Harmony.call_starts(), None);
    }

    #[test]
    fn real_templates_are_told_by_their_call_syntax() {
        use crate::tokenizer::ChatTemplate;
        let dir = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/data/llama.cpp/templates/"
        );
        for (file, want) in [
            ("Qwen3-Coder.jinja", Some(ToolFormat::Xml { bare: true })),
            ("Qwen3.5-4B.jinja", Some(ToolFormat::Xml { bare: false })),
            (
                "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja",
                Some(ToolFormat::Xml { bare: false }),
            ),
            ("Qwen-Qwen3-0.6B.jinja", Some(ToolFormat::Hermes)),
            ("GLM-4.6.jinja", Some(ToolFormat::Glm { newlines: true })),
            (
                "GLM-4.7-Flash.jinja",
                Some(ToolFormat::Glm { newlines: false }),
            ),
            ("openai-gpt-oss-120b.jinja", None),
            ("google-gemma-2-2b-it.jinja", None),
        ] {
            let source = std::fs::read_to_string(format!("{dir}{file}")).unwrap();
            let t = ChatTemplate::new(&source, "", "").unwrap();
            let got = template_format(&source, false, |tool| {
                let user = [json!({"role": "user", "content": "hi"})];
                t.apply_json(&user, tool.as_array().map(Vec::as_slice), true, None)
                    .ok()
            });
            assert_eq!(got, want, "{file}");
            // The XML and GLM templates iterate a call's arguments: objects.
            let xml = matches!(
                want,
                Some(ToolFormat::Xml { .. } | ToolFormat::Glm { .. } | ToolFormat::MiniMax)
            );

            assert_eq!(t.takes_object_arguments(), xml, "{file}");
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
