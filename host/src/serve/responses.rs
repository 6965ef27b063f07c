//! OpenAI's Responses API (`POST /v1/responses`), as llama-server serves it
//! for clients written against it (the OpenAI SDKs' `responses.create` and
//! the tools built on them): a request is translated to the chat request
//! [`api`] reads (`instructions` as a system message; `input` as a string or
//! a list of items: messages with `input_text` and `input_image` parts,
//! earlier assistant messages, `function_call` and `function_call_output`
//! items; function `tools` as Responses flattens them, `tool_choice`,
//! `max_output_tokens`, `text.format` as `response_format`), and the answer
//! to a `response` object: `reasoning`, `message` and `function_call` output
//! items, `status` (`incomplete` at the token limit), `usage`; streamed as
//! its typed events (`response.created`, `response.output_item.added`,
//! `response.output_text.delta`, ..., `response.completed`), numbered by
//! `sequence_number`. The server keeps no responses: `previous_response_id`
//! is refused, and a client sends the conversation in `input`. Earlier
//! `reasoning` items are accepted and left out of the prompt (the chat
//! templates drop past reasoning too).

use serde_json::{json, Map, Value};

use super::api::{self, ApiError, Completion};
use super::reasoning::Channel;
use super::tools::ToolCall;
use super::{Finished, NamedEvents};

/// Reads a `/v1/responses` body.
pub fn responses_request(body: &[u8]) -> Result<Completion, ApiError> {
    let chat = to_chat(api::object(body)?)?;
    api::chat_request(Value::Object(chat).to_string().as_bytes())
}

/// The OpenAI-style chat request of a Responses one: its other fields
/// (`temperature`, `top_p`, `stream`, llama-server's sampling options) as
/// they are.
fn to_chat(mut obj: Map<String, Value>) -> Result<Map<String, Value>, ApiError> {
    match obj.remove("previous_response_id") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) if s.is_empty() => {}
        Some(_) => {
            return Err(ApiError::bad(
                "'previous_response_id' is not supported: les serve keeps no responses; \
                 send the conversation in 'input'",
            ))
        }
    }
    let mut messages: Vec<Value> = Vec::new();
    match obj.remove("instructions") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => messages.push(json!({"role": "system", "content": s})),
        Some(_) => return Err(ApiError::bad("'instructions' must be a string")),
    }
    match obj.remove("input") {
        Some(Value::String(s)) => messages.push(json!({"role": "user", "content": s})),
        Some(Value::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                input_item(item, i, &mut messages)?;
            }
        }
        None => return Err(ApiError::bad("'input' is required")),
        Some(_) => {
            return Err(ApiError::bad(
                "'input' must be a string or an array of items",
            ))
        }
    }
    obj.insert("messages".into(), Value::Array(messages));
    if let Some(tools) = obj.remove("tools").filter(|t| !t.is_null()) {
        let list = tools
            .as_array()
            .ok_or_else(|| ApiError::bad("'tools' must be an array"))?;
        let mut chat_tools = Vec::new();
        for (i, t) in list.iter().enumerate() {
            match t.get("type").and_then(Value::as_str) {
                Some("function") => {
                    let mut f = t
                        .as_object()
                        .cloned()
                        .ok_or_else(|| ApiError::bad(format!("tools[{i}] must be an object")))?;
                    f.remove("type");
                    chat_tools.push(json!({"type": "function", "function": f}));
                }
                other => {
                    return Err(ApiError::bad(format!(
                        "tools[{i}].type = {other:?}: only function tools are served \
                         (the server runs no built-in tools)"
                    )))
                }
            }
        }
        if !chat_tools.is_empty() {
            obj.insert("tools".into(), Value::Array(chat_tools));
        }
    }
    if let Some(choice) = obj.remove("tool_choice").filter(|c| !c.is_null()) {
        let chat_choice = match &choice {
            Value::String(_) => choice.clone(),
            Value::Object(o) if o.get("type").and_then(Value::as_str) == Some("function") => {
                let name = o
                    .get("name")
                    .and_then(Value::as_str)
                    .ok_or_else(|| ApiError::bad("'tool_choice.name' must be a string"))?;
                json!({"type": "function", "function": {"name": name}})
            }
            _ => {
                return Err(ApiError::bad(
                    "'tool_choice' must be \"auto\", \"none\", \"required\" or \
                     {\"type\": \"function\", \"name\": ...}",
                ))
            }
        };
        obj.insert("tool_choice".into(), chat_choice);
    }
    if let Some(n) = obj.remove("max_output_tokens").filter(|n| !n.is_null()) {
        obj.insert("max_tokens".into(), n);
    }
    if let Some(text) = obj.remove("text").filter(|t| !t.is_null()) {
        if let Some(format) = text.get("format").filter(|f| !f.is_null()) {
            if let Some(rf) = response_format(format)? {
                obj.insert("response_format".into(), rf);
            }
        }
    }
    // Accepted and not acted on: what a stateless local server has no use
    // for, and the reasoning effort (the chat templates' own switch is
    // `chat_template_kwargs`).
    for key in [
        "reasoning",
        "store",
        "include",
        "truncation",
        "metadata",
        "user",
        "service_tier",
        "background",
        "prompt_cache_key",
        "safety_identifier",
    ] {
        obj.remove(key);
    }
    Ok(obj)
}

/// The chat's `response_format` of a Responses `text.format` (`None` for
/// plain text).
fn response_format(format: &Value) -> Result<Option<Value>, ApiError> {
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(json!({"type": "json_object"}))),
        Some("json_schema") => {
            let schema = format
                .get("schema")
                .ok_or_else(|| ApiError::bad("'text.format.schema' is required"))?;
            let mut js = json!({"schema": schema});
            for key in ["name", "strict", "description"] {
                if let Some(v) = format.get(key) {
                    js[key] = v.clone();
                }
            }
            Ok(Some(json!({"type": "json_schema", "json_schema": js})))
        }
        other => Err(ApiError::bad(format!(
            "'text.format.type' = {other:?} (text, json_object or json_schema)"
        ))),
    }
}

/// Appends the chat messages of input item `i` to `messages`: function calls
/// and reasoning join the assistant message before them, as llama-server
/// merges them.
fn input_item(item: &Value, i: usize, messages: &mut Vec<Value>) -> Result<(), ApiError> {
    let at = format!("input[{i}]");
    let o = item
        .as_object()
        .ok_or_else(|| ApiError::bad(format!("{at} must be an object")))?;
    let kind = o.get("type").and_then(Value::as_str);
    let role = o.get("role").and_then(Value::as_str);
    let field = |k: &str| {
        o.get(k)
            .ok_or_else(|| ApiError::bad(format!("{at}.{k} is required")))
    };
    let string = |k: &str| {
        field(k)?
            .as_str()
            .ok_or_else(|| ApiError::bad(format!("{at}.{k} must be a string")))
    };
    let last_assistant = |messages: &mut Vec<Value>| -> usize {
        if messages.last().and_then(|m| m["role"].as_str()) != Some("assistant") {
            messages.push(json!({"role": "assistant", "content": ""}));
        }
        messages.len() - 1
    };
    match (kind, role) {
        (None | Some("message"), Some(role @ ("user" | "system" | "developer"))) => {
            let content = match field("content")? {
                Value::String(s) => Value::String(s.clone()),
                Value::Array(parts) => Value::Array(
                    parts
                        .iter()
                        .enumerate()
                        .map(|(j, p)| input_part(p, &format!("{at}.content[{j}]")))
                        .collect::<Result<_, _>>()?,
                ),
                _ => {
                    return Err(ApiError::bad(format!(
                        "{at}.content must be a string or an array of parts"
                    )))
                }
            };
            messages.push(json!({"role": role, "content": content}));
        }
        (None | Some("message"), Some("assistant")) => {
            let key = |ty: &str| match ty {
                "output_text" | "input_text" => Some("text"),
                "refusal" => Some("refusal"),
                _ => None,
            };
            let text = joined_text(field("content")?, &at, "content", PARTS, key)?;
            let m = last_assistant(messages);
            let before = messages[m]["content"].as_str().unwrap_or_default();
            messages[m]["content"] = json!(format!("{before}{text}"));
        }
        (Some("message"), other) | (None, other @ Some(_)) => {
            return Err(ApiError::bad(format!(
                "{at}.role = {other:?} (user, system, developer or assistant)"
            )))
        }
        (Some("function_call"), _) => {
            let call = json!({"id": string("call_id")?, "type": "function",
                "function": {"name": string("name")?, "arguments": string("arguments")?}});
            let m = last_assistant(messages);
            match messages[m]["tool_calls"].as_array_mut() {
                Some(calls) => calls.push(call),
                None => messages[m]["tool_calls"] = json!([call]),
            }
        }
        (Some("function_call_output"), _) => {
            let key = |ty: &str| matches!(ty, "input_text" | "output_text").then_some("text");
            let output = joined_text(field("output")?, &at, "output", TOOL_PARTS, key)?;
            messages.push(json!({"role": "tool", "tool_call_id": string("call_id")?,
                "content": output}));
        }
        (Some("reasoning"), _) => {}
        (Some(other), _) => {
            return Err(ApiError::bad(format!(
                "{at}.type = {other:?} (message, function_call, function_call_output or reasoning)"
            )))
        }
        (None, None) => return Err(ApiError::bad(format!("{at} has neither a type nor a role"))),
    }
    Ok(())
}

/// What [`joined_text`] takes: the parts of an assistant message.
const PARTS: [&str; 2] = ["parts", " (output_text or refusal)"];
/// What [`joined_text`] takes: the parts of a tool's output.
const TOOL_PARTS: [&str; 2] = ["text parts", ": a tool's output must be text"];

/// The text of `v`, `field` of input item `at`: a string, or its parts'
/// texts joined, each under the key `key` gives for its type (`None`: a type
/// not taken). The errors name the parts and the types taken as
/// [`PARTS`] or [`TOOL_PARTS`] say.
fn joined_text(
    v: &Value,
    at: &str,
    field: &str,
    [parts_are, types_are]: [&str; 2],
    key: impl Fn(&str) -> Option<&'static str>,
) -> Result<String, ApiError> {
    let parts = match v {
        Value::String(s) => return Ok(s.clone()),
        Value::Array(parts) => parts,
        _ => {
            return Err(ApiError::bad(format!(
                "{at}.{field} must be a string or an array of {parts_are}"
            )))
        }
    };
    let mut text = String::new();
    for (j, p) in parts.iter().enumerate() {
        let ty = p.get("type").and_then(Value::as_str);
        let k = ty
            .and_then(&key)
            .ok_or_else(|| ApiError::bad(format!("{at}.{field}[{j}].type = {ty:?}{types_are}")))?;
        text.push_str(
            p.get(k)
                .and_then(Value::as_str)
                .ok_or_else(|| ApiError::bad(format!("{at}.{field}[{j}].{k} must be a string")))?,
        );
    }
    Ok(text)
}

/// The chat content part of a Responses input part.
fn input_part(p: &Value, at: &str) -> Result<Value, ApiError> {
    match p.get("type").and_then(Value::as_str) {
        Some("input_text") => {
            let text = p
                .get("text")
                .and_then(Value::as_str)
                .ok_or_else(|| ApiError::bad(format!("{at}.text must be a string")))?;
            Ok(json!({"type": "text", "text": text}))
        }
        Some("input_image") => {
            let url = p.get("image_url").and_then(Value::as_str).ok_or_else(|| {
                ApiError::bad(format!(
                    "{at}.image_url must be a string (a data: URL; the server \
                         fetches nothing and keeps no files)"
                ))
            })?;
            Ok(json!({"type": "image_url", "image_url": {"url": url}}))
        }
        Some("input_file") => Err(ApiError::bad(format!("{at}: files are not supported"))),
        other => Err(ApiError::bad(format!(
            "{at}.type = {other:?} (input_text or input_image)"
        ))),
    }
}

/// `completed`, or `incomplete` where the answer reached the token limit.
fn status(f: &Finished) -> (&'static str, Value) {
    match f.finish_reason {
        "length" => ("incomplete", json!({"reason": "max_output_tokens"})),
        _ => ("completed", Value::Null),
    }
}

fn usage(f: &Finished) -> Value {
    json!({
        "input_tokens": f.prompt_tokens,
        "input_tokens_details": {"cached_tokens": f.cached_tokens},
        "output_tokens": f.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": f.prompt_tokens + f.completion_tokens,
    })
}

/// A finished reasoning item.
fn reasoning_item(id: &str, text: &str) -> Value {
    json!({"id": format!("rs_{id}"), "type": "reasoning", "summary": [],
        "content": [{"type": "reasoning_text", "text": text}], "status": "completed"})
}

/// A finished message's one text part.
fn text_part(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

/// A finished message item.
fn message_item(id: &str, text: &str) -> Value {
    json!({"id": format!("msg_{id}"), "type": "message", "role": "assistant",
        "status": "completed", "content": [text_part(text)]})
}

/// Call `n`'s item, its arguments as given (`""` while they stream).
fn call_item(id: &str, n: usize, call: &ToolCall, arguments: &str, status: &str) -> Value {
    json!({"id": format!("fc_{id}_{n}"), "type": "function_call", "status": status,
        "call_id": format!("call_{id}_{n}"), "name": call.name, "arguments": arguments})
}

/// The response object around `output`.
fn response_object(id: &str, model: &str, created: u64, f: &Finished, output: Vec<Value>) -> Value {
    let (status, incomplete) = status(f);
    json!({
        "id": format!("resp_{id}"),
        "object": "response",
        "created_at": created,
        "status": status,
        "incomplete_details": incomplete,
        "error": null,
        "model": model,
        "output": output,
        "usage": usage(f),
    })
}

/// The whole response of `f` (`stream: false`); `id` names it, its items
/// and its calls.
pub fn response(id: &str, model: &str, created: u64, f: &Finished) -> Value {
    let mut output = Vec::new();
    if !f.reasoning.is_empty() {
        output.push(reasoning_item(id, &f.reasoning));
    }
    if !f.text.is_empty() || f.tool_calls.is_empty() {
        output.push(message_item(id, &f.text));
    }
    for (n, call) in f.tool_calls.iter().enumerate() {
        output.push(call_item(id, n, call, &call.arguments, "completed"));
    }
    response_object(id, model, created, f, output)
}

/// A response's stream as its typed events: what to write for each piece
/// and at the end, keeping which output item is open.
pub struct Stream<'a> {
    id: &'a str,
    model: &'a str,
    created: u64,
    /// The next event's `sequence_number`.
    seq: u64,
    /// The output items done so far.
    done: Vec<Value>,
    /// The open item: whether it is the reasoning, and its text so far.
    open: Option<(bool, String)>,
}

/// One event: its type (the SSE event name) and its data.
pub type Event = (&'static str, Value);

impl<'a> Stream<'a> {
    /// A stream of response `id` by `model`, created at `created`.
    pub fn new(id: &'a str, model: &'a str, created: u64) -> Self {
        Stream {
            id,
            model,
            created,
            seq: 0,
            done: Vec::new(),
            open: None,
        }
    }

    /// Event `kind` with `data`'s fields, numbered.
    fn event(&mut self, kind: &'static str, mut data: Value) -> Event {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.seq);
        self.seq += 1;
        (kind, data)
    }

    /// The response while in progress.
    fn in_progress(&self) -> Value {
        json!({"id": format!("resp_{}", self.id), "object": "response",
            "created_at": self.created, "status": "in_progress", "model": self.model,
            "output": []})
    }

    /// The open item's last events.
    fn close(&mut self) -> Vec<Event> {
        let Some((reasoning, text)) = self.open.take() else {
            return Vec::new();
        };
        let (id, index) = (self.id, self.done.len());
        let mut out = Vec::new();
        let item = if reasoning {
            out.push(self.event(
                "response.reasoning_text.done",
                json!({"item_id": format!("rs_{id}"), "output_index": index,
                    "content_index": 0, "text": text}),
            ));
            reasoning_item(id, &text)
        } else {
            let item_id = format!("msg_{id}");
            out.push(self.event(
                "response.output_text.done",
                json!({"item_id": item_id, "output_index": index, "content_index": 0,
                    "text": text, "logprobs": []}),
            ));
            out.push(self.event(
                "response.content_part.done",
                json!({"item_id": item_id, "output_index": index, "content_index": 0,
                    "part": text_part(&text)}),
            ));
            message_item(id, &text)
        };
        out.push(self.event(
            "response.output_item.done",
            json!({"output_index": index, "item": item}),
        ));
        self.done.push(item);
        out
    }
}

impl NamedEvents for Stream<'_> {
    /// The first events.
    fn start(&mut self) -> Vec<Event> {
        let r = self.in_progress();
        vec![
            self.event("response.created", json!({"response": r})),
            self.event("response.in_progress", json!({"response": r})),
        ]
    }

    /// The events of a piece of text of the answer or its reasoning.
    fn piece(&mut self, to: Channel, text: &str) -> Vec<Event> {
        let reasoning = to == Channel::Reasoning;
        let mut out = Vec::new();
        if self.open.as_ref().is_some_and(|(r, _)| *r != reasoning) {
            out.extend(self.close());
        }
        let index = self.done.len();
        let id = self.id;
        if self.open.is_none() {
            self.open = Some((reasoning, String::new()));
            if reasoning {
                let item = json!({"id": format!("rs_{id}"), "type": "reasoning",
                    "summary": [], "content": [], "status": "in_progress"});
                out.push(self.event(
                    "response.output_item.added",
                    json!({"output_index": index, "item": item}),
                ));
            } else {
                let item = json!({"id": format!("msg_{id}"), "type": "message",
                    "role": "assistant", "status": "in_progress", "content": []});
                out.push(self.event(
                    "response.output_item.added",
                    json!({"output_index": index, "item": item}),
                ));
                let part = json!({"type": "output_text", "text": "", "annotations": []});
                out.push(self.event(
                    "response.content_part.added",
                    json!({"item_id": format!("msg_{id}"), "output_index": index,
                        "content_index": 0, "part": part}),
                ));
            }
        }
        if let Some((_, so_far)) = &mut self.open {
            so_far.push_str(text);
        }
        if reasoning {
            out.push(self.event(
                "response.reasoning_text.delta",
                json!({"item_id": format!("rs_{id}"), "output_index": index,
                    "content_index": 0, "delta": text}),
            ));
        } else {
            out.push(self.event(
                "response.output_text.delta",
                json!({"item_id": format!("msg_{id}"), "output_index": index,
                    "content_index": 0, "delta": text, "logprobs": []}),
            ));
        }
        out
    }

    /// The last events: the open item done, the calls as `function_call`
    /// items (their arguments in one delta), the whole response.
    fn finish(&mut self, f: &Finished) -> Vec<Event> {
        let said = self.open.as_ref().is_some_and(|(r, _)| !r)
            || self.done.iter().any(|i| i["type"] == "message");
        let mut out = Vec::new();
        if !said && f.tool_calls.is_empty() {
            // No text and no call: an empty message, as the whole answer has.
            out.extend(self.piece(Channel::Content, ""));
        }
        out.extend(self.close());
        let id = self.id;
        for (n, call) in f.tool_calls.iter().enumerate() {
            let index = self.done.len();
            let item_id = format!("fc_{id}_{n}");
            let added = call_item(id, n, call, "", "in_progress");
            out.push(self.event(
                "response.output_item.added",
                json!({"output_index": index, "item": added}),
            ));
            out.push(self.event(
                "response.function_call_arguments.delta",
                json!({"item_id": item_id, "output_index": index, "delta": call.arguments}),
            ));
            out.push(self.event(
                "response.function_call_arguments.done",
                json!({"item_id": item_id, "output_index": index, "name": call.name,
                    "arguments": call.arguments}),
            ));
            let item = call_item(id, n, call, &call.arguments, "completed");
            out.push(self.event(
                "response.output_item.done",
                json!({"output_index": index, "item": item}),
            ));
            self.done.push(item);
        }
        let output = std::mem::take(&mut self.done);
        let r = response_object(id, self.model, self.created, f, output);
        let kind = match status(f).0 {
            "incomplete" => "response.incomplete",
            _ => "response.completed",
        };
        out.push(self.event(kind, json!({"response": r})));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve::api::Prompt;

    fn chat_of(body: Value) -> Result<Value, ApiError> {
        to_chat(body.as_object().unwrap().clone()).map(Value::Object)
    }

    #[test]
    fn a_request_becomes_the_chat_request_it_means() {
        let body = json!({
            "model": "m", "instructions": "Be brief.", "temperature": 0,
            "max_output_tokens": 9, "store": false, "stream": true,
            "input": [
                {"role": "developer", "content": "Use tools."},
                {"type": "message", "role": "user", "content": [
                    {"type": "input_text", "text": "Weather "},
                    {"type": "input_text", "text": "in Paris?"}]},
                {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
                {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{\"city\":\"Paris\"}"},
                {"type": "function_call_output", "call_id": "c1", "output": "21 C"},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "21 C."}]},
                {"role": "user", "content": "Thanks"}],
            "tools": [{"type": "function", "name": "w", "description": "weather",
                "parameters": {"type": "object"}, "strict": true}],
            "tool_choice": {"type": "function", "name": "w"},
            "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "integer"}}}
        });
        let chat = chat_of(body).unwrap();
        assert_eq!(
            chat["messages"],
            json!([
                {"role": "system", "content": "Be brief."},
                {"role": "developer", "content": "Use tools."},
                {"role": "user", "content": [{"type": "text", "text": "Weather "},
                    {"type": "text", "text": "in Paris?"}]},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "c1",
                    "type": "function", "function": {"name": "w",
                    "arguments": "{\"city\":\"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "21 C"},
                {"role": "assistant", "content": "21 C."},
                {"role": "user", "content": "Thanks"}
            ])
        );
        assert_eq!(
            chat["tools"],
            json!([{"type": "function", "function": {"name": "w", "description": "weather",
                "parameters": {"type": "object"}, "strict": true}}])
        );
        assert_eq!(
            chat["tool_choice"],
            json!({"type": "function", "function": {"name": "w"}})
        );
        assert_eq!(chat["max_tokens"], 9);
        assert_eq!(
            chat["response_format"],
            json!({"type": "json_schema", "json_schema": {"schema": {"type": "integer"}, "name": "n"}})
        );
        for gone in [
            "input",
            "instructions",
            "max_output_tokens",
            "text",
            "store",
        ] {
            assert!(chat.get(gone).is_none(), "{gone}");
        }
        assert_eq!(
            (chat["temperature"].clone(), chat["stream"].clone()),
            (json!(0), json!(true))
        );
        // The chat reader takes it.
        let c = responses_request(&serde_json::to_vec(&json!({"input": "Hi"})).unwrap()).unwrap();
        assert!(matches!(c.prompt, Prompt::Chat(ref m) if m.len() == 1));
    }

    #[test]
    fn what_cannot_be_served_is_refused_by_name() {
        for (body, says) in [
            (json!({}), "'input' is required"),
            (json!({"input": 3}), "'input' must be"),
            (
                json!({"input": "x", "previous_response_id": "resp_1"}),
                "previous_response_id",
            ),
            (
                json!({"input": [{"role": "robot", "content": "x"}]}),
                "input[0].role",
            ),
            (
                json!({"input": [{"type": "item_reference", "id": "x"}]}),
                "input[0].type",
            ),
            (
                json!({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}),
                "files",
            ),
            (
                json!({"input": [{"type": "function_call", "name": "w"}]}),
                "input[0].call_id",
            ),
            (
                json!({"input": "x", "tools": [{"type": "web_search"}]}),
                "function tools",
            ),
            (
                json!({"input": "x", "tool_choice": {"type": "mcp"}}),
                "'tool_choice'",
            ),
            (
                json!({"input": "x", "text": {"format": {"type": "xml"}}}),
                "text.format.type",
            ),
            (
                json!({"input": [{"role": "assistant", "content": [{"type": "image"}]}]}),
                "input[0].content[0].type = Some(\"image\") (output_text or refusal)",
            ),
            (
                json!({"input": [{"role": "assistant", "content": [{"type": "refusal"}]}]}),
                "input[0].content[0].refusal must be a string",
            ),
            (
                json!({"input": [{"type": "function_call_output", "call_id": "c",
                    "output": [{"type": "input_image"}]}]}),
                "input[0].output[0].type = Some(\"input_image\"): a tool's output must be text",
            ),
            (
                json!({"input": [{"type": "function_call_output", "call_id": "c", "output": 3}]}),
                "input[0].output must be a string or an array of text parts",
            ),
        ] {
            let e = chat_of(body.clone()).unwrap_err();
            assert_eq!(e.status, 400);
            assert!(e.message.contains(says), "{body}: {}", e.message);
        }
    }

    /// An answer with `calls` calls `f0`, `f1`, ... (arguments `{"i":N}`).
    fn finished(text: &str, reasoning: &str, calls: usize, reason: &'static str) -> Finished {
        let calls = (0..calls)
            .map(|i| ToolCall {
                name: format!("f{i}"),
                arguments: format!("{{\"i\":{i}}}"),
            })
            .collect();
        Finished::for_test(text, reasoning, calls, reason)
    }

    #[test]
    fn an_answer_becomes_a_response_whole_or_streamed() {
        let f = finished("Hello.", "Thinking", 1, "tool_calls");
        let whole = response("x", "m", 7, &f);
        assert_eq!(whole["id"], "resp_x");
        assert_eq!(whole["status"], "completed");
        let types: Vec<&str> = whole["output"]
            .as_array()
            .unwrap()
            .iter()
            .map(|o| o["type"].as_str().unwrap())
            .collect();
        assert_eq!(types, ["reasoning", "message", "function_call"]);
        assert_eq!(whole["output"][1]["content"][0]["text"], "Hello.");
        assert_eq!(whole["output"][2]["call_id"], "call_x_0");
        assert_eq!(whole["output"][2]["arguments"], "{\"i\":0}");
        assert_eq!(
            whole["usage"],
            json!({"input_tokens": 10, "input_tokens_details": {"cached_tokens": 4},
                "output_tokens": 6, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": 16})
        );
        // Streamed in pieces: the same items at the end, the deltas adding up,
        // the events numbered from 0.
        let mut s = Stream::new("x", "m", 7);
        let mut events = s.start();
        events.extend(s.piece(Channel::Reasoning, "Think"));
        events.extend(s.piece(Channel::Reasoning, "ing"));
        events.extend(s.piece(Channel::Content, "Hel"));
        events.extend(s.piece(Channel::Content, "lo."));
        events.extend(s.finish(&f));
        for (i, (kind, v)) in events.iter().enumerate() {
            assert_eq!(v["sequence_number"], i, "{kind}");
            assert_eq!(v["type"], *kind);
        }
        let (last, done) = events.last().unwrap();
        assert_eq!(*last, "response.completed");
        assert_eq!(done["response"]["output"], whole["output"]);
        let deltas = |kind: &str| -> String {
            events
                .iter()
                .filter(|(k, _)| *k == kind)
                .map(|(_, v)| v["delta"].as_str().unwrap())
                .collect()
        };
        assert_eq!(deltas("response.output_text.delta"), "Hello.");
        assert_eq!(deltas("response.reasoning_text.delta"), "Thinking");
        assert_eq!(
            deltas("response.function_call_arguments.delta"),
            "{\"i\":0}"
        );
        // At the token limit: incomplete, said so.
        let cut = response("y", "m", 7, &finished("a", "", 0, "length"));
        assert_eq!(
            (
                cut["status"].as_str(),
                cut["incomplete_details"]["reason"].as_str()
            ),
            (Some("incomplete"), Some("max_output_tokens"))
        );
        let mut s = Stream::new("y", "m", 7);
        let mut events = s.start();
        events.extend(s.finish(&finished("", "", 0, "length")));
        assert_eq!(events.last().unwrap().0, "response.incomplete");
        let output = &events.last().unwrap().1["response"]["output"];
        assert_eq!(output[0]["content"][0]["text"], "", "{output}");
    }
}
