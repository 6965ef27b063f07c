//! Anthropic's Messages API (`POST /v1/messages`), as llama-server serves
//! it for clients written against Anthropic's (Claude Code and the like):
//! a request is translated to the OpenAI-style chat request [`api`] reads
//! (system prompt, text and base64 image blocks, `tool_use` and
//! `tool_result` blocks, tools with their `input_schema`, `tool_choice`,
//! `stop_sequences`), and the answer to Anthropic's message: `thinking`,
//! `text` and `tool_use` content blocks, `stop_reason`, `usage`; streamed
//! as its named events (`message_start`, `content_block_start` /
//! `_delta` / `_stop`, `message_delta`, `message_stop`).

use serde_json::{json, Map, Value};

use super::api::{self, ApiError, Completion};
use super::reasoning::Channel;
use super::tools::ToolCall;
use super::{Finished, NamedEvents};

/// Reads a `/v1/messages` body.
pub fn messages_request(body: &[u8]) -> Result<Completion, ApiError> {
    let chat = to_chat(&api::object(body)?)?;
    api::chat_request(chat.to_string().as_bytes())
}

/// The OpenAI-style chat request of an Anthropic one.
fn to_chat(obj: &Map<String, Value>) -> Result<Value, ApiError> {
    let mut messages = Vec::new();
    match obj.get("system") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => messages.push(json!({"role": "system", "content": s})),
        Some(Value::Array(blocks)) => {
            let text = blocks
                .iter()
                .map(|b| b.get("text").and_then(Value::as_str))
                .collect::<Option<Vec<&str>>>()
                .ok_or_else(|| ApiError::bad("'system' blocks must be text blocks"))?;
            messages.push(json!({"role": "system", "content": text.join("\n")}));
        }
        Some(_) => return Err(ApiError::bad("'system' must be a string or text blocks")),
    }
    let list = obj
        .get("messages")
        .and_then(Value::as_array)
        .ok_or_else(|| ApiError::bad("'messages' must be an array"))?;
    for (i, m) in list.iter().enumerate() {
        let role = m
            .get("role")
            .and_then(Value::as_str)
            .filter(|r| matches!(*r, "user" | "assistant"))
            .ok_or_else(|| {
                ApiError::bad(format!(
                    "messages[{i}].role must be \"user\" or \"assistant\""
                ))
            })?;
        let blocks = match m.get("content") {
            Some(Value::String(s)) => vec![json!({"type": "text", "text": s})],
            Some(Value::Array(b)) => b.clone(),
            _ => {
                return Err(ApiError::bad(format!(
                    "messages[{i}].content must be a string or an array of blocks"
                )))
            }
        };
        let (mut parts, mut calls) = (Vec::new(), Vec::new());
        for (j, b) in blocks.iter().enumerate() {
            let at = format!("messages[{i}].content[{j}]");
            let field = |k: &str| {
                b.get(k)
                    .ok_or_else(|| ApiError::bad(format!("{at}.{k} is required")))
            };
            match b.get("type").and_then(Value::as_str) {
                Some("text") => parts.push(json!({"type": "text", "text": field("text")?})),
                Some("image") => {
                    let source = field("source")?;
                    if source.get("type").and_then(Value::as_str) != Some("base64") {
                        return Err(ApiError::bad(format!(
                            "{at}: images must be base64 sources (the server fetches nothing)"
                        )));
                    }
                    let media = source.get("media_type").and_then(Value::as_str).unwrap_or("image/png");
                    let data = source.get("data").and_then(Value::as_str).unwrap_or_default();
                    let url = format!("data:{media};base64,{data}");
                    parts.push(json!({"type": "image_url", "image_url": {"url": url}}));
                }
                Some("tool_use") => calls.push(json!({"id": field("id")?, "type": "function",
                    "function": {"name": field("name")?, "arguments": field("input")?.to_string()}})),
                Some("tool_result") => {
                    let content = match b.get("content") {
                        None | Some(Value::Null) => String::new(),
                        Some(Value::String(s)) => s.clone(),
                        Some(Value::Array(inner)) => inner
                            .iter()
                            .filter_map(|x| x.get("text").and_then(Value::as_str))
                            .collect::<Vec<_>>()
                            .join("\n"),
                        Some(_) => return Err(ApiError::bad(format!("{at}.content must be text"))),
                    };
                    messages.push(json!({"role": "tool", "tool_call_id": field("tool_use_id")?,
                        "content": content}));
                }
                // Earlier thinking is not shown to the model again.
                Some("thinking" | "redacted_thinking") => {}
                other => {
                    return Err(ApiError::bad(format!(
                        "{at}: blocks of type {other:?} are not supported (text, image, tool_use, tool_result)"
                    )))
                }
            }
        }
        if parts.is_empty() && calls.is_empty() {
            continue;
        }
        let mut message = json!({"role": role, "content": parts});
        if !calls.is_empty() {
            message["tool_calls"] = json!(calls);
        }
        messages.push(message);
    }
    let mut chat = json!({ "messages": messages });
    for (from, to) in [
        ("max_tokens", "max_tokens"),
        ("stop_sequences", "stop"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("top_k", "top_k"),
        ("stream", "stream"),
    ] {
        if let Some(v) = obj.get(from) {
            chat[to] = v.clone();
        }
    }
    if let Some(tools) = obj.get("tools").filter(|t| !t.is_null()) {
        let tools = tools
            .as_array()
            .ok_or_else(|| ApiError::bad("'tools' must be an array"))?;
        let tools: Vec<Value> = tools
            .iter()
            .map(|t| {
                let mut f = json!({"name": t.get("name").cloned().unwrap_or(Value::Null)});
                if let Some(d) = t.get("description") {
                    f["description"] = d.clone();
                }
                if let Some(s) = t.get("input_schema") {
                    f["parameters"] = s.clone();
                }
                json!({"type": "function", "function": f})
            })
            .collect();
        chat["tools"] = json!(tools);
    }
    if let Some(choice) = obj.get("tool_choice").filter(|c| !c.is_null()) {
        chat["tool_choice"] = match choice.get("type").and_then(Value::as_str) {
            Some("auto") => json!("auto"),
            Some("any") => json!("required"),
            Some("none") => json!("none"),
            Some("tool") => json!({"type": "function", "function": {"name": choice.get("name")}}),
            _ => {
                return Err(ApiError::bad(
                    "'tool_choice' must be {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}",
                ))
            }
        };
    }
    Ok(chat)
}

/// Anthropic's `stop_reason` of `f`.
fn stop_reason(f: &Finished) -> &'static str {
    match (f.finish_reason, &f.stopping_word) {
        ("tool_calls", _) => "tool_use",
        ("length", _) => "max_tokens",
        (_, Some(_)) => "stop_sequence",
        _ => "end_turn",
    }
}

/// A call's `tool_use` block (its arguments as JSON; an object where they
/// do not parse).
fn tool_use(id: &str, call: &ToolCall) -> Value {
    let input: Value = serde_json::from_str(&call.arguments)
        .ok()
        .filter(Value::is_object)
        .unwrap_or_else(|| json!({}));
    json!({"type": "tool_use", "id": id, "name": call.name, "input": input})
}

/// The whole message of `f` (`stream: false`); `id` names it and its calls.
pub fn message(id: &str, model: &str, f: &Finished) -> Value {
    let mut content = Vec::new();
    if !f.reasoning.is_empty() {
        content.push(json!({"type": "thinking", "thinking": f.reasoning, "signature": ""}));
    }
    if !f.text.is_empty() || f.tool_calls.is_empty() {
        content.push(json!({"type": "text", "text": f.text}));
    }
    for (i, call) in f.tool_calls.iter().enumerate() {
        content.push(tool_use(&format!("toolu_{id}_{i}"), call));
    }
    json!({
        "id": format!("msg_{id}"),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason(f),
        "stop_sequence": f.stopping_word,
        "usage": usage(f),
    })
}

fn usage(f: &Finished) -> Value {
    json!({
        "input_tokens": f.prompt_tokens - f.cached_tokens,
        "cache_read_input_tokens": f.cached_tokens,
        "output_tokens": f.completion_tokens,
    })
}

/// A message's stream as Anthropic's named events: what to write for each
/// piece and at the end, keeping which content block is open.
pub struct Stream<'a> {
    id: &'a str,
    model: &'a str,
    /// The open block: its index and whether it is thinking.
    open: Option<(usize, bool)>,
    /// Blocks started so far.
    blocks: usize,
}

impl<'a> Stream<'a> {
    /// A stream of message `id` by `model`.
    pub fn new(id: &'a str, model: &'a str) -> Self {
        Stream {
            id,
            model,
            open: None,
            blocks: 0,
        }
    }

    fn close(&mut self) -> Vec<(&'static str, Value)> {
        match self.open.take() {
            Some((i, _)) => vec![(
                "content_block_stop",
                json!({"type": "content_block_stop", "index": i}),
            )],
            None => Vec::new(),
        }
    }
}

impl NamedEvents for Stream<'_> {
    /// The first event.
    fn start(&mut self) -> Vec<(&'static str, Value)> {
        let message = json!({"id": format!("msg_{}", self.id), "type": "message",
            "role": "assistant", "model": self.model, "content": [], "stop_reason": null,
            "stop_sequence": null, "usage": {"input_tokens": 0, "output_tokens": 0}});
        vec![(
            "message_start",
            json!({"type": "message_start", "message": message}),
        )]
    }

    /// The events of a piece of text of the answer or its reasoning.
    fn piece(&mut self, to: Channel, text: &str) -> Vec<(&'static str, Value)> {
        let thinking = to == Channel::Reasoning;
        let mut out = Vec::new();
        let index = match self.open {
            Some((i, t)) if t == thinking => i,
            _ => {
                out.extend(self.close());
                let i = self.blocks;
                self.blocks += 1;
                self.open = Some((i, thinking));
                let block = if thinking {
                    json!({"type": "thinking", "thinking": ""})
                } else {
                    json!({"type": "text", "text": ""})
                };
                out.push((
                    "content_block_start",
                    json!({"type": "content_block_start", "index": i, "content_block": block}),
                ));
                i
            }
        };
        let delta = if thinking {
            json!({"type": "thinking_delta", "thinking": text})
        } else {
            json!({"type": "text_delta", "text": text})
        };
        out.push((
            "content_block_delta",
            json!({"type": "content_block_delta", "index": index, "delta": delta}),
        ));
        out
    }

    /// The last events: the open block closed, the calls as `tool_use`
    /// blocks, the stop reason and usage, the end.
    fn finish(&mut self, f: &Finished) -> Vec<(&'static str, Value)> {
        let mut out = self.close();
        for (n, call) in f.tool_calls.iter().enumerate() {
            let i = self.blocks;
            self.blocks += 1;
            let mut block = tool_use(&format!("toolu_{}_{n}", self.id), call);
            let input = std::mem::replace(&mut block["input"], json!({}));
            out.push((
                "content_block_start",
                json!({"type": "content_block_start", "index": i, "content_block": block}),
            ));
            out.push((
                "content_block_delta",
                json!({"type": "content_block_delta", "index": i,
                "delta": {"type": "input_json_delta", "partial_json": input.to_string()}}),
            ));
            out.push((
                "content_block_stop",
                json!({"type": "content_block_stop", "index": i}),
            ));
        }
        out.push((
            "message_delta",
            json!({"type": "message_delta",
            "delta": {"stop_reason": stop_reason(f), "stop_sequence": f.stopping_word},
            "usage": usage(f)}),
        ));
        out.push(("message_stop", json!({"type": "message_stop"})));
        out
    }
}

/// Anthropic's error body of `e`.
pub fn error_body(e: &ApiError) -> Value {
    let kind = match e.status {
        400 => "invalid_request_error",
        401 => "authentication_error",
        404 => "not_found_error",
        503 => "overloaded_error",
        _ => "api_error",
    };
    json!({"type": "error", "error": {"type": kind, "message": e.message}})
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve::api::Prompt;

    #[test]
    fn a_request_becomes_the_chat_request_it_means() {
        let body = json!({
            "model": "m", "max_tokens": 64, "system": "Be brief.",
            "stop_sequences": ["END"], "temperature": 0.5,
            "tools": [{"name": "get_weather", "description": "w",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
            "tool_choice": {"type": "any"},
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm"},
                    {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "21C"},
                    {"type": "text", "text": "And Rome?"}]}
            ]
        });
        let c = messages_request(body.to_string().as_bytes()).unwrap();
        let Prompt::Chat(m) = &c.prompt else {
            panic!("a chat")
        };
        let roles: Vec<&str> = m.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "tool", "user"]);
        assert_eq!(m[0].content, "Be brief.");
        let call = &m[2].tool_calls.as_ref().unwrap()[0];
        assert_eq!(call["function"]["arguments"], r#"{"city":"Paris"}"#);
        assert_eq!(
            (m[3].tool_call_id.as_deref(), m[3].content.as_str()),
            (Some("t1"), "21C")
        );
        assert_eq!(m[4].content, "And Rome?");
        assert_eq!(
            (c.max_tokens, c.stop.clone()),
            (Some(64), vec!["END".to_string()])
        );
        assert_eq!(c.sampling.temperature, 0.5);
        let t = c.tools.unwrap();
        assert_eq!(t.choice, crate::serve::tools::ToolChoice::Required);
        assert_eq!(t.list[0]["function"]["parameters"]["type"], "object");
        let err = |b: Value| {
            messages_request(b.to_string().as_bytes())
                .unwrap_err()
                .message
        };
        assert!(err(json!({"messages": [{"role": "system", "content": "x"}]})).contains("role"));
        let url = json!({"messages": [{"role": "user", "content": [{"type": "image",
            "source": {"type": "url", "url": "http://x"}}]}]});
        assert!(err(url).contains("base64"));
        assert!(
            err(json!({"messages": [], "tool_choice": {"type": "maybe"}})).contains("tool_choice")
        );
    }

    #[test]
    fn an_answer_becomes_a_message_whole_or_streamed() {
        let call = ToolCall {
            name: "get_weather".into(),
            arguments: r#"{"city":"Rome"}"#.into(),
        };
        let f = Finished::for_test("", "Think.", vec![call], "tool_calls");
        let m = message("x", "model", &f);
        assert_eq!(m["stop_reason"], "tool_use");
        assert_eq!(m["content"][0]["type"], "thinking");
        assert_eq!(m["content"][1]["input"]["city"], "Rome");
        assert_eq!(m["usage"]["input_tokens"], 6);
        let mut s = Stream::new("x", "model");
        let mut events: Vec<&str> = s.start().iter().map(|e| e.0).collect();
        for (to, t) in [
            (Channel::Reasoning, "Th"),
            (Channel::Reasoning, "ink."),
            (Channel::Content, "Hi"),
        ] {
            events.extend(s.piece(to, t).iter().map(|e| e.0));
        }
        let end = s.finish(&f);
        events.extend(end.iter().map(|e| e.0));
        assert_eq!(
            events,
            [
                "message_start",
                "content_block_start",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop",
            ]
        );
        assert_eq!(end[2].1["delta"]["partial_json"], r#"{"city":"Rome"}"#);
        assert_eq!(end[1].1["index"], 2);
        assert_eq!(end[4].1["delta"]["stop_reason"], "tool_use");
        let plain = message("y", "m", &Finished::for_test("Hello", "", vec![], "length"));
        assert_eq!(
            (
                plain["content"][0]["text"].as_str(),
                plain["stop_reason"].as_str()
            ),
            (Some("Hello"), Some("max_tokens"))
        );
    }
}
