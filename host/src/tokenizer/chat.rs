//! Chat templates: the Jinja template a model ships in `tokenizer.chat_template`,
//! rendered with minijinja the way Hugging Face's `apply_chat_template` renders it
//! (`trim_blocks`, `lstrip_blocks`, Python string methods, `raise_exception`,
//! `strftime_now`, `tojson`, loop controls).

use std::fmt;
use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{ArgType, Enumerator, Kwargs, Object, ObjectRepr, ValueKind, ValueOrKwargs};
use minijinja::{context, Environment, Error, ErrorKind, Value};

/// Jinja2's `iterable` test as Python answers it: `none` is not (minijinja's
/// own says it is, and Qwen3-Coder's template then takes the length of
/// `tools = none`); undefined is, as Jinja2's `Undefined` iterates as empty.
fn is_iterable(value: &Value) -> bool {
    !value.is_none() && value.try_iter().is_ok()
}

/// Jinja2's `namespace`, whose list attributes are Python's lists:
/// `append`, `pop`, `extend` and `insert` change them in place (Kimi K2's
/// template queues its calls' ids in `namespace(ids=[])`; minijinja's own
/// lists cannot change).
fn namespace(defaults: Option<ValueOrKwargs>) -> Result<Value, Error> {
    let Some(defaults) = defaults else {
        return minijinja::functions::namespace(None);
    };
    let value = defaults.into_value();
    let pairs = match value.try_iter() {
        Ok(keys) if value.as_object().is_some() => keys
            .map(|k| {
                let v = value.get_item(&k)?;
                let v = match v.kind() {
                    ValueKind::Seq => Value::from_object(MutableList(std::sync::Mutex::new(
                        v.try_iter()?.collect(),
                    ))),
                    _ => v,
                };
                Ok((k.to_string(), v))
            })
            .collect::<Result<std::collections::BTreeMap<_, _>, Error>>()?,
        _ => return minijinja::functions::namespace(ValueOrKwargs::from_value(Some(&value)).ok()),
    };
    let map = Value::from(pairs);
    minijinja::functions::namespace(Some(ValueOrKwargs::from_value(Some(&map))?))
}

/// A list a template can change ([`namespace`]'s list attributes).
#[derive(Debug)]
struct MutableList(std::sync::Mutex<Vec<Value>>);

impl MutableList {
    fn items(&self) -> std::sync::MutexGuard<'_, Vec<Value>> {
        // A panic while holding it cannot leave the list half-changed.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Object for MutableList {
    fn repr(self: &std::sync::Arc<Self>) -> ObjectRepr {
        ObjectRepr::Seq
    }

    fn get_value(self: &std::sync::Arc<Self>, key: &Value) -> Option<Value> {
        let items = self.items();
        let i = i64::try_from(key.clone()).ok()?;
        let i = if i < 0 { items.len() as i64 + i } else { i };
        items.get(usize::try_from(i).ok()?).cloned()
    }

    fn enumerate(self: &std::sync::Arc<Self>) -> Enumerator {
        Enumerator::Values(self.items().clone())
    }

    fn enumerator_len(self: &std::sync::Arc<Self>) -> Option<usize> {
        Some(self.items().len())
    }

    fn call_method(
        self: &std::sync::Arc<Self>,
        _state: &mut minijinja::State<'_, '_>,
        method: &str,
        args: &[Value],
    ) -> Result<Value, Error> {
        let mut items = self.items();
        let bad = |m: &str| Error::new(ErrorKind::InvalidOperation, m.to_string());
        match (method, args) {
            ("append", [v]) => items.push(v.clone()),
            ("extend", [vs]) => items.extend(vs.try_iter()?),
            ("insert", [at, v]) => {
                let at = i64::try_from(at.clone())?;
                let len = items.len() as i64;
                let at = if at < 0 {
                    (len + at).max(0)
                } else {
                    at.min(len)
                };
                items.insert(at as usize, v.clone());
            }
            ("pop", []) => return items.pop().ok_or_else(|| bad("pop from empty list")),
            ("pop", [at]) => {
                let at = i64::try_from(at.clone())?;
                let len = items.len() as i64;
                let at = if at < 0 { len + at } else { at };
                if !(0..len).contains(&at) {
                    return Err(bad("pop index out of range"));
                }
                return Ok(items.remove(at as usize));
            }
            _ => return Err(Error::from(ErrorKind::UnknownMethod)),
        }
        Ok(Value::from(()))
    }
}

/// Longest template source accepted (bytes).
pub const MAX_TEMPLATE_LEN: usize = 1 << 20;

/// Instructions one render may run: far more than any real template takes for
/// a long conversation, and a bound on one from an untrusted file (nested
/// loops of a million would otherwise hang the run).
pub const RENDER_FUEL: u64 = 20_000_000;

/// The longest rendered prompt, in bytes (as `-f`'s prompt files).
pub const MAX_RENDERED_LEN: usize = 64 << 20;

/// A compiled chat template together with the BOS and EOS strings it may use.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    /// Variables every render sees (`--chat-template-kwargs`), under the
    /// ones a render sets.
    kwargs: serde_json::Map<String, serde_json::Value>,
}

impl fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

/// Why a chat template could not be used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ChatTemplateError {
    /// The model has no `tokenizer.chat_template`.
    Missing,
    /// The source is longer than [`MAX_TEMPLATE_LEN`].
    TooLarge(usize),
    /// The source does not parse.
    Syntax(String),
    /// Rendering failed (including the template's own `raise_exception`).
    Render(String),
}

impl fmt::Display for ChatTemplateError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Missing => write!(f, "the model has no chat template"),
            Self::TooLarge(n) => write!(
                f,
                "chat template is {n} bytes, more than the {MAX_TEMPLATE_LEN} allowed"
            ),
            Self::Syntax(e) => write!(f, "chat template does not parse: {e}"),
            Self::Render(e) => write!(f, "chat template failed: {e}"),
        }
    }
}

impl std::error::Error for ChatTemplateError {}

/// A JSON value as a template value (objects keep their keys' order).
fn from_json(v: &serde_json::Value) -> Value {
    use serde_json::Value as Json;
    match v {
        Json::Null => Value::from(()),
        Json::Bool(b) => Value::from(*b),
        Json::Number(n) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => Value::from(i),
            (_, Some(u)) => Value::from(u),
            _ => Value::from(n.as_f64().unwrap_or(f64::NAN)),
        },
        Json::String(s) => Value::from(s.as_str()),
        Json::Array(a) => Value::from(a.iter().map(from_json).collect::<Vec<_>>()),
        Json::Object(o) => Value::from_pairs(o.iter().map(|(k, v)| (k.as_str(), from_json(v)))),
    }
}

/// Full message of a minijinja error, including its causes.
fn describe(e: &Error) -> String {
    let mut s = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        s.push_str(": ");
        s.push_str(&cause.to_string());
        source = cause.source();
    }
    s
}

/// `source` with transformers' `{% generation %}` and `{% endgeneration %}`
/// tags (they mark an assistant's turn for training masks and render their
/// body unchanged; llama.cpp's Jinja parser ignores them) rewritten as
/// `{% if true %}` and `{% endif %}`, which minijinja knows: still statements,
/// so `trim_blocks`, `lstrip_blocks` and `-` trim around them as before.
fn generation_blocks_as_if(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        let Some(end) = tag.find("%}") else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let (open, inner) = match inner.strip_prefix(['-', '+']) {
            Some(i) => (&inner[..1], i),
            None => ("", inner),
        };
        let (inner, close) = match inner.strip_suffix(['-', '+']) {
            Some(i) => (i, &inner[inner.len() - 1..]),
            None => (inner, ""),
        };
        match inner.trim() {
            "generation" => out.push_str(&format!("{{%{open} if true {close}%}}")),
            "endgeneration" => out.push_str(&format!("{{%{open} endif {close}%}}")),
            _ => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

impl ChatTemplate {
    /// Compiles `source`; `bos_token` and `eos_token` are what the template sees as
    /// `bos_token` and `eos_token`.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, ChatTemplateError> {
        if source.len() > MAX_TEMPLATE_LEN {
            return Err(ChatTemplateError::TooLarge(source.len()));
        }
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| ChatTemplateError::Syntax(describe(&e)))?;
        env.set_syntax(syntax);
        env.set_fuel(Some(RENDER_FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_test("iterable", is_iterable);
        env.add_function("namespace", namespace);
        env.add_template_owned("chat", generation_blocks_as_if(source))
            .map_err(|e| ChatTemplateError::Syntax(describe(&e)))?;
        Ok(Self {
            env,
            bos_token: bos_token.to_owned(),
            eos_token: eos_token.to_owned(),
            kwargs: serde_json::Map::new(),
        })
    }

    /// This template with `kwargs` as variables of every render
    /// (llama.cpp's `--chat-template-kwargs`, such as Qwen3's
    /// `enable_thinking`); a render's own variables (`messages`, `tools`,
    /// `add_generation_prompt`) win.
    pub fn with_kwargs(mut self, kwargs: serde_json::Map<String, serde_json::Value>) -> Self {
        self.kwargs = kwargs;
        self
    }

    /// `vars` over `extra` over this template's kwargs, as one context.
    fn context(
        &self,
        extra: Option<&serde_json::Map<String, serde_json::Value>>,
        vars: impl IntoIterator<Item = (&'static str, Value)>,
    ) -> Value {
        let kwargs = self.kwargs.iter().chain(extra.into_iter().flatten());
        Value::from_pairs(
            kwargs
                .map(|(k, v)| (Value::from(k.as_str()), from_json(v)))
                .chain(vars.into_iter().map(|(k, v)| (Value::from(k), v))),
        )
    }

    /// Renders `messages` (role, content) in order; with `add_generation_prompt` the
    /// output ends with the header of the assistant's next turn.
    pub fn apply<R: AsRef<str>, C: AsRef<str>>(
        &self,
        messages: &[(R, C)],
        add_generation_prompt: bool,
    ) -> Result<String, ChatTemplateError> {
        let messages: Vec<Value> = messages
            .iter()
            .map(|(role, content)| context! { role => role.as_ref(), content => content.as_ref() })
            .collect();
        self.render(self.context(
            None,
            [
                ("messages", Value::from(messages)),
                ("add_generation_prompt", Value::from(add_generation_prompt)),
            ],
        ))
    }

    /// Renders `messages` given as JSON objects (`role`, `content` and what
    /// else they carry, such as `tool_calls`), with `tools` where given and
    /// `kwargs` over the template's own (a request's `chat_template_kwargs`).
    pub fn apply_json(
        &self,
        messages: &[serde_json::Value],
        tools: Option<&[serde_json::Value]>,
        add_generation_prompt: bool,
        kwargs: Option<&serde_json::Map<String, serde_json::Value>>,
    ) -> Result<String, ChatTemplateError> {
        let list = |items: &[serde_json::Value]| items.iter().map(from_json).collect::<Vec<_>>();
        let tools = tools.map_or(Value::from(()), |t| Value::from(list(t)));
        self.render(self.context(
            kwargs,
            [
                ("messages", Value::from(list(messages))),
                ("tools", tools),
                ("add_generation_prompt", Value::from(add_generation_prompt)),
            ],
        ))
    }

    /// Whether a system message shows in what the template renders. Some
    /// templates refuse one (Gemma's raise an error) or drop it; llama.cpp
    /// probes the same way and then folds the system prompt into the first
    /// user message ([`with_system_prompt`](Self::with_system_prompt)).
    pub fn supports_system_role(&self) -> bool {
        const PROBE: &str = "les system prompt probe";
        self.apply(&[("system", PROBE), ("user", "user message")], false)
            .is_ok_and(|text| text.contains(PROBE))
    }

    /// Whether the template reads a tool call's `arguments` as an object
    /// (Qwen3-Coder's, Qwen3.5's and GLM's iterate its items), where OpenAI
    /// gives a string of JSON: rendered with an object, a probe argument's
    /// name shows, and with that object as a string it does not (llama.cpp
    /// probes its templates' `supports_object_arguments` alike, then parses
    /// the strings).
    pub fn takes_object_arguments(&self) -> bool {
        const KEY: &str = "les_argument_probe";
        let render = |arguments: serde_json::Value| {
            let messages = [
                serde_json::json!({"role": "user", "content": "user message"}),
                serde_json::json!({"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "tool", "arguments": arguments}}]}),
            ];
            self.apply_json(&messages, None, false, None)
                .is_ok_and(|text| text.contains(KEY))
        };
        let object = serde_json::json!({ KEY: "value" });
        render(object.clone()) && !render(serde_json::Value::String(object.to_string()))
    }

    /// The conversation that starts with `system` and one user message
    /// `user`: two messages where the template has a system role, else one
    /// user message of `system`, a newline and `user` (llama.cpp's
    /// workaround). The second value says whether the system prompt was folded.
    pub fn with_system_prompt(&self, system: &str, user: &str) -> (Vec<(String, String)>, bool) {
        if self.supports_system_role() {
            let msgs = vec![
                ("system".into(), system.into()),
                ("user".into(), user.into()),
            ];
            (msgs, false)
        } else {
            (vec![("user".into(), format!("{system}\n{user}"))], true)
        }
    }

    /// Renders with a caller-built context (for tools, `enable_thinking` and the
    /// like); `bos_token` and `eos_token` are added unless the context sets them.
    pub fn render(&self, ctx: Value) -> Result<String, ChatTemplateError> {
        let ctx = context! {
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
            ..ctx
        };
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| ChatTemplateError::Render(describe(&e)))?;
        let mut out = Capped(Vec::new());
        tmpl.render_captured_to(ctx, &mut out)
            .map_err(|e| ChatTemplateError::Render(describe(&e)))?;
        String::from_utf8(out.0)
            .map_err(|_| ChatTemplateError::Render("the rendered text is not UTF-8".into()))
    }
}

/// The rendered text, refused past [`MAX_RENDERED_LEN`].
struct Capped(Vec<u8>);

impl std::io::Write for Capped {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.0.len() + buf.len() > MAX_RENDERED_LEN {
            return Err(std::io::Error::other(format!(
                "the rendered prompt is longer than {} MiB",
                MAX_RENDERED_LEN >> 20
            )));
        }
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `tojson` as Hugging Face defines it for chat templates: Python's
/// `json.dumps(value, ensure_ascii=False, indent=..., separators=..., sort_keys=...)`
/// (keyword arguments as there; `ensure_ascii` may be turned on). Unlike minijinja's
/// own filter nothing is HTML-escaped.
fn tojson(value: &Value, indent: Option<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let indent = match indent {
        Some(i) => Some(i),
        None => kwargs.get::<Option<Value>>("indent")?,
    };
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(match v.as_str() {
            Some(s) => s.to_owned(),
            None => " ".repeat(usize::try_from(v)?.min(64)),
        }),
    };
    let ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    let (item_sep, key_sep) = match kwargs.get::<Option<Value>>("separators")? {
        Some(seps) if !seps.is_none() => {
            let item = seps.get_item_by_index(0)?;
            let key = seps.get_item_by_index(1)?;
            match (item.as_str(), key.as_str()) {
                (Some(i), Some(k)) => (i.to_owned(), k.to_owned()),
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson separators must be two strings",
                    ))
                }
            }
        }
        _ if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        _ => (", ".to_owned(), ": ".to_owned()),
    };
    kwargs.assert_all_used()?;
    let json = Json {
        indent,
        item_sep,
        key_sep,
        ensure_ascii,
        sort_keys,
    };
    let mut out = String::new();
    json.write(&mut out, value, 0)?;
    Ok(Value::from_safe_string(out))
}

/// Options of one `tojson` call.
struct Json {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    ensure_ascii: bool,
    sort_keys: bool,
}

/// Deepest nesting `tojson` writes.
const MAX_JSON_DEPTH: usize = 128;

impl Json {
    fn write(&self, out: &mut String, v: &Value, depth: usize) -> Result<(), Error> {
        use minijinja::value::ValueKind;
        if depth > MAX_JSON_DEPTH {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: value nested too deeply",
            ));
        }
        match v.kind() {
            ValueKind::Undefined | ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number if v.is_integer() => out.push_str(&v.to_string()),
            ValueKind::Number => out.push_str(&py_float(f64::try_from(v.clone())?)),
            ValueKind::String | ValueKind::Bytes | ValueKind::Plain => {
                self.write_str(out, &v.to_string());
            }
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = v.try_iter()?.collect();
                self.write_container(out, '[', ']', items.len(), depth, |out, i| {
                    self.write(out, &items[i], depth + 1)
                })?;
            }
            ValueKind::Map => {
                let mut entries = Vec::new();
                for key in v.try_iter()? {
                    let item = v.get_item(&key)?;
                    let key = match key.as_str() {
                        Some(s) => s.to_owned(),
                        None if key.is_none() => "null".to_owned(),
                        None => {
                            let mut k = String::new();
                            self.write(&mut k, &key, depth + 1)?;
                            k
                        }
                    };
                    entries.push((key, item));
                }
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(&b.0));
                }
                self.write_container(out, '{', '}', entries.len(), depth, |out, i| {
                    self.write_str(out, &entries[i].0);
                    out.push_str(&self.key_sep);
                    self.write(out, &entries[i].1, depth + 1)
                })?;
            }
            ValueKind::Invalid => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: invalid value",
                ));
            }
            // ValueKind is non-exhaustive.
            _ => self.write_str(out, &v.to_string()),
        }
        Ok(())
    }

    fn write_container(
        &self,
        out: &mut String,
        open: char,
        close: char,
        len: usize,
        depth: usize,
        mut item: impl FnMut(&mut String, usize) -> Result<(), Error>,
    ) -> Result<(), Error> {
        out.push(open);
        if len == 0 {
            out.push(close);
            return Ok(());
        }
        for i in 0..len {
            if i > 0 {
                out.push_str(&self.item_sep);
            }
            if let Some(ind) = &self.indent {
                out.push('\n');
                out.push_str(&ind.repeat(depth + 1));
            }
            item(out, i)?;
        }
        if let Some(ind) = &self.indent {
            out.push('\n');
            out.push_str(&ind.repeat(depth));
        }
        out.push(close);
        Ok(())
    }

    fn write_str(&self, out: &mut String, s: &str) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ensure_ascii && !c.is_ascii()) => {
                    let mut units = [0u16; 2];
                    for u in c.encode_utf16(&mut units) {
                        out.push_str(&format!("\\u{u:04x}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// A float as Python's `repr` writes it (close enough for templates: shortest
/// round-trip digits, `.0` on integral values, `e+XX` exponents).
fn py_float(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let s = format!("{x:?}");
    match s.split_once('e') {
        Some((mantissa, exp)) => {
            let (sign, digits) = match exp.strip_prefix('-') {
                Some(d) => ('-', d),
                None => ('+', exp),
            };
            format!("{mantissa}e{sign}{digits:0>2}")
        }
        None => s,
    }
}

/// `strftime_now(format)`: the current UTC time formatted with the common
/// `strftime` directives (`%Y %y %m %d %e %H %I %M %S %p %j %b %B %a %A %%`);
/// others are copied as written.
fn strftime_now(format: String) -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    strftime(&format, secs)
}

pub(crate) fn strftime(format: &str, unix_secs: u64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
    ];
    let days = unix_secs / 86_400;
    let sod = unix_secs % 86_400;
    let (hour, minute, second) = (sod / 3600, sod / 60 % 60, sod % 60);
    let (year, month, day) = civil_from_days(days);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    const CUM: [u64; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = CUM[(month - 1) as usize] + day + u64::from(leap && month > 2);
    let weekday = DAYS[(days % 7) as usize];
    let month_name = MONTHS[(month - 1) as usize];
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };

    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year % 100)),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:2}")),
            Some('H') => out.push_str(&format!("{hour:02}")),
            Some('I') => out.push_str(&format!("{hour12:02}")),
            Some('M') => out.push_str(&format!("{minute:02}")),
            Some('S') => out.push_str(&format!("{second:02}")),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('b') => out.push_str(&month_name[..3]),
            Some('B') => out.push_str(month_name),
            Some('a') => out.push_str(&weekday[..3]),
            Some('A') => out.push_str(weekday),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// (year, month 1..=12, day 1..=31) of a day count since 1970-01-01
/// (Howard Hinnant's `civil_from_days`).
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespace_lists_change_in_place() {
        let src = "{% set ns = namespace(ids=[], n=0) %}\
                   {% set _ = ns.ids.append('a') %}{% set _ = ns.ids.extend(['b', 'c']) %}\
                   {% set _ = ns.ids.insert(0, 'z') %}{% set ns.n = ns.ids | length %}\
                   {{ ns.n }} {{ ns.ids | join(',') }} {{ ns.ids[-1] }} {{ ns.ids.pop(0) }} \
                   {{ ns.ids.pop() }} {{ ns.ids | tojson }} {% if ns.ids %}full{% endif %}\
                   {% set _ = ns.ids.pop() %}{% set _ = ns.ids.pop() %}\
                   {% if not ns.ids %} empty{% endif %}";
        let t = ChatTemplate::new(src, "", "").unwrap();
        assert_eq!(
            t.render(context! {}).unwrap(),
            "4 z,a,b,c c z c [\"a\", \"b\"] full empty"
        );
        let t =
            ChatTemplate::new("{% set ns = namespace(l=[]) %}{{ ns.l.pop() }}", "", "").unwrap();
        let e = t.render(context! {}).unwrap_err().to_string();
        assert!(e.contains("pop from empty list"), "{e}");
        // A namespace without lists, or of a dict, as before.
        let t = ChatTemplate::new(
            "{% set a = namespace() %}{% set a.x = 1 %}{% set b = namespace({'y': 2}) %}{{ a.x }}{{ b.y }}",
            "",
            "",
        )
        .unwrap();
        assert_eq!(t.render(context! {}).unwrap(), "12");
    }

    #[test]
    fn iterable_is_pythons() {
        let src = "{% for v in [none, 1, 'ab', [1], {'a': 1}, missing] %}\
                   {{ v is iterable }} {% endfor %}";
        let t = ChatTemplate::new(src, "", "").unwrap();
        let text = t.render(context! {}).unwrap();
        assert_eq!(text, "False False True True True True ");
        // As Qwen3-Coder's template asks it, with no tools given.
        let src = "{% if tools is iterable and tools | length > 0 %}tools{% endif %}ok";
        let t = ChatTemplate::new(src, "", "").unwrap();
        assert_eq!(t.apply_json(&[], None, false, None).unwrap(), "ok");
    }

    #[test]
    fn kwargs_are_variables_under_the_renders_own() {
        let src =
            "{% if enable_thinking is defined and not enable_thinking %}[no think]{% endif %}\
                   {{ messages | length }}{{ extra | default('-') }}";
        let kw = |v: serde_json::Value| v.as_object().unwrap().clone();
        let t = ChatTemplate::new(src, "", "").unwrap();
        assert_eq!(t.apply(&[("user", "hi")], true).unwrap(), "1-");
        let t = t.with_kwargs(kw(
            serde_json::json!({"enable_thinking": false, "messages": []}),
        ));
        // The template's kwargs are seen; they cannot replace `messages`.
        assert_eq!(t.apply(&[("user", "hi")], true).unwrap(), "[no think]1-");
        let msgs = [serde_json::json!({"role": "user", "content": "hi"})];
        assert_eq!(
            t.apply_json(&msgs, None, true, None).unwrap(),
            "[no think]1-"
        );
        // A render's kwargs go over the template's.
        let over = kw(serde_json::json!({"enable_thinking": true, "extra": 7}));
        assert_eq!(t.apply_json(&msgs, None, true, Some(&over)).unwrap(), "17");
    }

    #[test]
    fn system_prompts_fold_into_the_user_message_where_the_template_has_no_system_role() {
        let chatml = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}";
        let refuses = "{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}\
                       {% for m in messages %}[{{ m.content }}]{% endfor %}";
        let ignores = "{% for m in messages %}{% if m.role == 'user' %}[{{ m.content }}]{% endif %}{% endfor %}";
        let t = ChatTemplate::new(chatml, "", "").unwrap();
        assert!(t.supports_system_role());
        let (msgs, folded) = t.with_system_prompt("Be brief.", "Hi");
        assert!(!folded);
        assert_eq!(
            t.apply(&msgs, false).unwrap(),
            "<|system|>Be brief.\n<|user|>Hi\n"
        );
        for src in [refuses, ignores] {
            let t = ChatTemplate::new(src, "", "").unwrap();
            assert!(!t.supports_system_role(), "{src}");
            let (msgs, folded) = t.with_system_prompt("Be brief.", "Hi");
            assert!(folded);
            assert_eq!(t.apply(&msgs, false).unwrap(), "[Be brief.\nHi]");
        }
    }

    /// `{% generation %}` blocks (LFM2.5's and Laguna's templates) render their
    /// body, with the whitespace control of any other statement.
    #[test]
    fn generation_blocks_render_their_body() {
        let src = "{% for m in messages %}\n{%- if m.role == 'assistant' -%}\n  {%- generation -%}\n  [{{ m.content }}]\n  {%- endgeneration -%}\n{% else %}{{ m.content }}{% endif %}\n{% endfor %}";
        let plain = src
            .replace("{%- generation -%}", "{%- if true -%}")
            .replace("{%- endgeneration -%}", "{%- endif -%}");
        let msgs = [("user", "hi"), ("assistant", "yo"), ("user", "ok")];
        let got = ChatTemplate::new(src, "", "")
            .unwrap()
            .apply(&msgs, false)
            .unwrap();
        let want = ChatTemplate::new(&plain, "", "")
            .unwrap()
            .apply(&msgs, false)
            .unwrap();
        assert_eq!(got, want);
        assert!(got.contains("[yo]"), "{got:?}");
        // Tags of every trim flavour, and none; other statements and text untouched.
        assert_eq!(
            generation_blocks_as_if("a{%generation%}b{%+ endgeneration -%}c{% if x %}{{ '{%' }}"),
            "a{% if true %}b{%+ endif -%}c{% if x %}{{ '{%' }}"
        );
        assert_eq!(generation_blocks_as_if("x {% unclosed"), "x {% unclosed");
    }

    /// A template from an untrusted file cannot hang the run nor fill memory:
    /// its instructions and its output are bounded.
    #[test]
    fn runaway_templates_stop_with_an_error() {
        let hi = [("user", "hi")];
        let looping =
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}";
        let t = ChatTemplate::new(looping, "", "").unwrap();
        let start = std::time::Instant::now();
        let err = t.apply(&hi, true).unwrap_err().to_string();
        assert!(err.contains("fuel"), "{err}");
        assert!(start.elapsed() < std::time::Duration::from_secs(60));
        let long = "{% for i in range(100) %}{{ 'x' * 1000000 }}{% endfor %}";
        let err = ChatTemplate::new(long, "", "")
            .unwrap()
            .apply(&hi, true)
            .unwrap_err();
        assert!(err.to_string().contains("longer than 64 MiB"), "{err}");
        // A real conversation's worth of work still renders.
        let ok = "{% for m in messages %}{% for i in range(1000) %}{{ m.content }}{% endfor %}{% endfor %}";
        assert_eq!(
            ChatTemplate::new(ok, "", "")
                .unwrap()
                .apply(&hi, true)
                .unwrap()
                .len(),
            2000
        );
    }

    #[test]
    fn strftime_known_instants() {
        // 2024-07-26 13:05:09 UTC, a Friday.
        let t = 1_721_999_109;
        assert_eq!(
            strftime("%d %b %Y %H:%M:%S %a %j %I%p %y %B %A %% %Q", t),
            "26 Jul 2024 13:05:09 Fri 208 01PM 24 July Friday % %Q"
        );
        assert_eq!(strftime("%Y-%m-%d %e", 0), "1970-01-01  1");
        // 2000-02-29 (leap day) and 2100-03-01.
        assert_eq!(strftime("%Y-%m-%d %j", 951_782_400), "2000-02-29 060");
        assert_eq!(strftime("%Y-%m-%d", 4_107_542_400), "2100-03-01");
    }
}
