//! The OpenAI-style requests `les serve` takes (llama-server's subset of
//! them), read from JSON into a [`Completion`], and the errors it answers
//! with. What changes the answer and is not supported (`n > 1`, legacy
//! `functions`, probabilities after the samplers) is refused by name; other
//! unknown fields are ignored, as clients send many.

use serde_json::{json, Map, Value};

use super::tools::{ToolChoice, Tools};
use crate::grammar::json_schema_to_gbnf;
use crate::tokenizer::{ChatTemplate, Tokenizer};
use crate::vision::{self, ClipModel, MEDIA_MARKER};

/// Largest image a request may carry, decoded (as `--image` files).
pub const MAX_IMAGE_BYTES: usize = 32 << 20;

/// Images a request may carry.
pub const MAX_IMAGES: usize = 16;

/// Stop strings a request may give (OpenAI allows 4; llama-server more).
pub const MAX_STOPS: usize = 16;

/// Most likely tokens a request may ask the log probabilities of, a
/// position (OpenAI allows 20).
pub const MAX_TOP_LOGPROBS: usize = 100;

/// The most likely tokens reported where a chat request asks for `logprobs`
/// without `top_logprobs` (llama-server's default).
pub const DEFAULT_TOP_LOGPROBS: usize = 20;

/// An error answered as `{"error": {"code", "message", "type"}}`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP status.
    pub status: u16,
    /// One line saying what is wrong.
    pub message: String,
}

impl ApiError {
    /// A 400: the request is wrong.
    pub fn bad(message: impl Into<String>) -> ApiError {
        ApiError {
            status: 400,
            message: message.into(),
        }
    }

    /// The JSON body of the answer (llama-server's and OpenAI's shape).
    pub fn body(&self) -> Value {
        let kind = match self.status {
            404 => "not_found_error",
            400..=499 => "invalid_request_error",
            503 => "unavailable_error",
            _ => "server_error",
        };
        json!({"error": {"code": self.status, "message": self.message, "type": kind}})
    }
}

/// What the prompt is made of.
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    /// `/v1/chat/completions`: messages for the model's chat template.
    Chat(Vec<Message>),
    /// `/v1/completions`: text evaluated as it is (BOS added where the model
    /// adds one).
    Text(String),
    /// Token ids evaluated as they are (no BOS added), as llama-server takes
    /// a `prompt` of numbers.
    Tokens(Vec<u32>),
    /// llama-server's `/infill`: code around a hole, for the model's
    /// fill-in-the-middle tokens.
    Infill(Infill),
}

/// Most `input_extra` chunks an infill request may give.
pub const MAX_EXTRA_CHUNKS: usize = 1024;

/// A fill-in-the-middle request's parts (llama-server's `/infill`).
#[derive(Clone, Debug, PartialEq)]
pub struct Infill {
    /// The code before the hole (`input_prefix`).
    pub prefix: String,
    /// The code after it (`input_suffix`).
    pub suffix: String,
    /// Other files as context (`input_extra`: filename, text).
    pub extra: Vec<(String, String)>,
    /// Text the middle starts with (`prompt`).
    pub prompt: String,
}

/// One chat message: its role and its content, images in it as
/// [`MEDIA_MARKER`]s in order, and what tool calls add.
#[derive(Clone, Debug, PartialEq)]
pub struct Message {
    /// "system", "user", "assistant", "tool", ...
    pub role: String,
    /// Its text, with a marker where each image goes.
    pub content: String,
    /// An assistant's calls (OpenAI's `tool_calls`, as given).
    pub tool_calls: Option<Value>,
    /// A tool's answer: the call it answers (`tool_call_id`).
    pub tool_call_id: Option<String>,
    /// A tool's answer: the tool's name (`name`).
    pub name: Option<String>,
}

impl Message {
    /// A message of `role` saying `content`, no tool fields.
    pub fn text(role: &str, content: &str) -> Message {
        Message {
            role: role.into(),
            content: content.into(),
            tool_calls: None,
            tool_call_id: None,
            name: None,
        }
    }

    /// Whether the message carries a tool call or a tool's answer.
    fn has_tool_fields(&self) -> bool {
        self.tool_calls.is_some() || self.tool_call_id.is_some() || self.role == "tool"
    }

    /// The message as the chat template sees it.
    fn to_json(&self) -> Value {
        let mut m = json!({"role": self.role, "content": self.content});
        if let Some(calls) = &self.tool_calls {
            m["tool_calls"] = calls.clone();
        }
        if let Some(id) = &self.tool_call_id {
            m["tool_call_id"] = json!(id);
        }
        if let Some(name) = &self.name {
            m["name"] = json!(name);
        }
        m
    }
}

/// The samplers' settings of one request (llama-server's names and defaults).
#[derive(Clone, Debug, PartialEq)]
pub struct Sampling {
    /// `temperature` (0.8; 0 is greedy).
    pub temperature: f32,
    /// `top_k` (40; 0 is off).
    pub top_k: usize,
    /// `top_p` (0.95).
    pub top_p: f32,
    /// `min_p` (0.05).
    pub min_p: f32,
    /// `typical_p` (1: off).
    pub typical_p: f32,
    /// `repeat_penalty` (1: off).
    pub repeat_penalty: f32,
    /// `frequency_penalty` (0).
    pub frequency_penalty: f32,
    /// `presence_penalty` (0).
    pub presence_penalty: f32,
    /// `repeat_last_n` (64).
    pub repeat_last_n: usize,
    /// `seed` (none: a new one each request).
    pub seed: Option<u64>,
    /// `mirostat` (0: off, 1 or 2).
    pub mirostat: u8,
    /// `mirostat_tau` (5).
    pub mirostat_tau: f32,
    /// `mirostat_eta` (0.1).
    pub mirostat_eta: f32,
    /// `logit_bias`: added to a token's logit before the samplers (`-inf`:
    /// never picked), as (token id, bias).
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for Sampling {
    fn default() -> Self {
        Sampling {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            typical_p: 1.0,
            repeat_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            repeat_last_n: 64,
            seed: None,
            mirostat: 0,
            mirostat_tau: 5.0,
            mirostat_eta: 0.1,
            logit_bias: Vec::new(),
        }
    }
}

/// A completion request, read and checked.
#[derive(Clone, Debug, PartialEq)]
pub struct Completion {
    /// The prompt.
    pub prompt: Prompt,
    /// The images of the prompt's markers, in order (encoded files: PNG, JPEG, GIF, BMP, PPM).
    pub images: Vec<Vec<u8>>,
    /// Answer as server-sent events, a chunk a token.
    pub stream: bool,
    /// `max_tokens` / `max_completion_tokens` / `n_predict`: most tokens to
    /// generate (none: until the end of generation or a full context).
    pub max_tokens: Option<usize>,
    /// The samplers.
    pub sampling: Sampling,
    /// Stop strings: the reply ends before the first one.
    pub stop: Vec<String>,
    /// A GBNF grammar the reply follows (from `grammar`, `json_schema` or
    /// `response_format`).
    pub grammar: Option<String>,
    /// Tell the reasoning from the answer where the model marks it (chat
    /// completions unless `reasoning_format` is `none`).
    pub reasoning: bool,
    /// Report each generated token's log probability and those of this many
    /// most likely tokens at its position (`logprobs` with `top_logprobs`,
    /// or a count in `logprobs` / `n_probs`).
    pub logprobs: Option<usize>,
    /// The tools the model may call (chat completions; none with
    /// `tool_choice: "none"`).
    pub tools: Option<Tools>,
    /// `chat_template_kwargs`: variables for the chat template (such as
    /// Qwen3's `enable_thinking`), over the server's `--chat-template-kwargs`.
    pub chat_template_kwargs: Option<Map<String, Value>>,
    /// `return_tokens`: the generated token ids in llama-server's
    /// `/completion` answer.
    pub return_tokens: bool,
}

/// Reads a `/v1/chat/completions` body.
pub fn chat_request(body: &[u8]) -> Result<Completion, ApiError> {
    let obj = object(body)?;
    let messages = obj
        .get("messages")
        .ok_or_else(|| ApiError::bad("'messages' is required"))?
        .as_array()
        .ok_or_else(|| ApiError::bad("'messages' must be an array"))?;
    if messages.is_empty() {
        return Err(ApiError::bad("'messages' is empty"));
    }
    let mut images = Vec::new();
    let mut out = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        let m = m
            .as_object()
            .ok_or_else(|| ApiError::bad(format!("messages[{i}] must be an object")))?;
        let role = m
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| ApiError::bad(format!("messages[{i}].role must be a string")))?;
        let content = match m.get("content") {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => content_parts(parts, i, &mut images)?,
            Some(_) => {
                return Err(ApiError::bad(format!(
                    "messages[{i}].content must be a string or an array of parts"
                )))
            }
        };
        let text = |key: &str| match m.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => Err(ApiError::bad(format!(
                "messages[{i}].{key} must be a string"
            ))),
        };
        let tool_calls = match m.get("tool_calls") {
            None | Some(Value::Null) => None,
            Some(Value::Array(a)) if a.is_empty() => None,
            Some(calls @ Value::Array(a)) if a.iter().all(Value::is_object) => Some(calls.clone()),
            Some(_) => {
                return Err(ApiError::bad(format!(
                    "messages[{i}].tool_calls must be an array of objects"
                )))
            }
        };
        out.push(Message {
            role: role.to_string(),
            content,
            tool_calls,
            tool_call_id: text("tool_call_id")?,
            name: text("name")?,
        });
    }
    let reasoning = match obj.get("reasoning_format") {
        None | Some(Value::Null) => true,
        Some(Value::String(f)) if f == "none" => false,
        Some(Value::String(f)) if matches!(f.as_str(), "auto" | "deepseek" | "deepseek-legacy") => {
            true
        }
        Some(_) => {
            return Err(ApiError::bad(
                "'reasoning_format' must be \"auto\", \"deepseek\" or \"none\"",
            ))
        }
    };
    let mut c = completion(&obj, Prompt::Chat(out), images)?;
    c.reasoning = reasoning;
    c.tools = Tools::read(&obj)?;
    c.chat_template_kwargs = match obj.get("chat_template_kwargs") {
        None | Some(Value::Null) => None,
        Some(Value::Object(m)) => Some(m.clone()),
        Some(_) => return Err(ApiError::bad("'chat_template_kwargs' must be an object")),
    };
    if let Some(t) = &c.tools {
        // The engine constrains a required call by a grammar of the model's
        // call format.
        if t.choice != ToolChoice::Auto && c.grammar.is_some() {
            return Err(ApiError::bad(
                "a grammar (grammar, json_schema, response_format) and a required tool call cannot be combined",
            ));
        }
    }
    Ok(c)
}

/// Reads a `/v1/completions` (or llama-server's `/completion`) body: a
/// `prompt` of text, or of token ids.
pub fn text_request(body: &[u8]) -> Result<Completion, ApiError> {
    let obj = object(body)?;
    let batch = || {
        ApiError::bad(
            "'prompt' must be one string or one array of token ids (batches of prompts are not supported)",
        )
    };
    let prompt = match obj.get("prompt") {
        Some(Value::String(s)) => Prompt::Text(s.clone()),
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
            Prompt::Text(a[0].as_str().unwrap_or_default().to_string())
        }
        Some(Value::Array(a)) if a.iter().all(Value::is_number) => Prompt::Tokens(
            a.iter()
                .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                .collect::<Option<Vec<u32>>>()
                .ok_or_else(|| ApiError::bad("'prompt': token ids are non-negative integers"))?,
        ),
        Some(Value::Array(_)) => return Err(batch()),
        Some(_) => return Err(ApiError::bad("'prompt' must be a string")),
        None => return Err(ApiError::bad("'prompt' is required")),
    };
    completion(&obj, prompt, Vec::new())
}

/// Reads a `/infill` body (llama-server's): `input_prefix` and
/// `input_suffix` (required), `input_extra` (`[{"filename", "text"}]`),
/// `prompt`, and the completion fields.
pub fn infill_request(body: &[u8]) -> Result<Completion, ApiError> {
    let obj = object(body)?;
    let text = |key: &str, required: bool| match obj.get(key) {
        Some(Value::String(s)) => Ok(s.clone()),
        None | Some(Value::Null) if !required => Ok(String::new()),
        None | Some(Value::Null) => Err(ApiError::bad(format!("'{key}' is required"))),
        Some(_) => Err(ApiError::bad(format!("'{key}' must be a string"))),
    };
    let extra = match obj.get("input_extra") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(chunks)) if chunks.len() <= MAX_EXTRA_CHUNKS => chunks
            .iter()
            .map(|c| {
                let text = c
                    .get("text")
                    .and_then(Value::as_str)
                    .ok_or_else(|| ApiError::bad("'input_extra' chunks need a string \"text\""))?;
                let filename = match c.get("filename") {
                    None | Some(Value::Null) => "tmp",
                    Some(Value::String(f)) => f,
                    Some(_) => {
                        return Err(ApiError::bad(
                            "'input_extra' chunks' \"filename\" must be a string",
                        ))
                    }
                };
                Ok((filename.to_string(), text.to_string()))
            })
            .collect::<Result<_, _>>()?,
        Some(Value::Array(_)) => {
            return Err(ApiError::bad(format!(
                "more than {MAX_EXTRA_CHUNKS} 'input_extra' chunks"
            )))
        }
        Some(_) => {
            return Err(ApiError::bad(
                "'input_extra' must be an array of {\"filename\": string, \"text\": string}",
            ))
        }
    };
    let infill = Infill {
        prefix: text("input_prefix", true)?,
        suffix: text("input_suffix", true)?,
        extra,
        prompt: text("prompt", false)?,
    };
    completion(&obj, Prompt::Infill(infill), Vec::new())
}

/// Most tokens `/detokenize` takes.
pub const MAX_DETOKENIZE: usize = 1 << 20;

/// `/tokenize`: `content` (a string) as token ids, with the model's BOS
/// where `add_special` (default false) and special tokens spelled in the
/// text read as such unless `parse_special` is false; with `with_pieces`,
/// each id with its text.
pub fn tokenize(body: &[u8], tokenizer: &Tokenizer) -> Result<Value, ApiError> {
    let obj = object(body)?;
    let content = obj
        .get("content")
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::bad("'content' must be a string"))?;
    let flag = |key: &str, default: bool| match obj.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => v
            .as_bool()
            .ok_or_else(|| ApiError::bad(format!("'{key}' must be true or false"))),
    };
    let ids = tokenizer.encode(
        content,
        flag("add_special", false)?,
        flag("parse_special", true)?,
    );
    let tokens: Vec<Value> = if flag("with_pieces", false)? {
        ids.iter()
            .map(|&id| json!({"id": id, "piece": tokenizer.decode(&[id])}))
            .collect()
    } else {
        ids.iter().map(|&id| json!(id)).collect()
    };
    Ok(json!({ "tokens": tokens }))
}

/// `/detokenize`: `tokens` (ids in the vocabulary) as text.
pub fn detokenize(body: &[u8], tokenizer: &Tokenizer) -> Result<Value, ApiError> {
    let obj = object(body)?;
    let tokens = obj
        .get("tokens")
        .and_then(Value::as_array)
        .ok_or_else(|| ApiError::bad("'tokens' must be an array of token ids"))?;
    if tokens.len() > MAX_DETOKENIZE {
        return Err(ApiError::bad(format!("more than {MAX_DETOKENIZE} tokens")));
    }
    let n_vocab = tokenizer.n_vocab() as u64;
    let ids = tokens
        .iter()
        .map(|t| t.as_u64().filter(|&id| id < n_vocab).map(|id| id as u32))
        .collect::<Option<Vec<u32>>>()
        .ok_or_else(|| ApiError::bad(format!("'tokens' must be ids below {n_vocab}")))?;
    Ok(json!({ "content": tokenizer.decode(&ids) }))
}

/// `/apply-template`: `messages` through the model's chat template, as a
/// chat completion would evaluate them (images as their markers).
pub fn apply_template(body: &[u8], tokenizer: &Tokenizer) -> Result<Value, ApiError> {
    let prompt = templated(&chat_request(body)?, tokenizer)?;
    Ok(json!({ "prompt": prompt }))
}

/// The chat completion `c`'s messages through the model's chat template.
fn templated(c: &Completion, tokenizer: &Tokenizer) -> Result<String, ApiError> {
    let Prompt::Chat(messages) = &c.prompt else {
        return Err(ApiError::bad("'messages' is required"));
    };
    let template = tokenizer
        .chat_template()
        .map_err(|e| ApiError::bad(format!("the model's chat template: {e}")))?;
    chat_text(
        tokenizer,
        &template,
        messages,
        c.tools.as_ref(),
        c.chat_template_kwargs.as_ref(),
    )
}

/// The prompt positions chat completion `c` would evaluate, counted as its
/// answer's `prompt_tokens` counts them (llama-server's `input_tokens` /
/// `count_tokens` endpoints): its tokens, and its images' embeddings as the
/// vision projector `clip` lays them out, from their sizes alone.
pub fn count_tokens(
    c: &Completion,
    tokenizer: &Tokenizer,
    clip: Option<&ClipModel>,
) -> Result<usize, ApiError> {
    let text = templated(c, tokenizer)?;
    if c.images.is_empty() {
        return Ok(tokenizer.encode(&text, true, true).len());
    }
    let clip = clip.ok_or_else(no_projector)?;
    image_markers(&text, c.images.len())?;
    let layouts = c
        .images
        .iter()
        .enumerate()
        .map(|(i, bytes)| {
            vision::image::image_size(bytes)
                .map(|size| vision::image_layout(clip, size))
                .map_err(|e| ApiError::bad(format!("image {}: {e}", i + 1)))
        })
        .collect::<Result<Vec<_>, _>>()?;
    vision::prompt_positions(tokenizer, clip.hp.projector, &text, true, &layouts)
        .map_err(|e| ApiError::bad(e.to_string()))
}

/// The error of images without a vision projector.
pub fn no_projector() -> ApiError {
    ApiError::bad("images need a vision projector: start les serve with --mmproj")
}

/// Checks that the templated `text` holds one [`MEDIA_MARKER`] per image.
pub fn image_markers(text: &str, n_images: usize) -> Result<(), ApiError> {
    let markers = text.matches(MEDIA_MARKER).count();
    if markers != n_images {
        return Err(ApiError::bad(format!(
            "the prompt has {markers} image marker(s) {MEDIA_MARKER} for {n_images} image(s)"
        )));
    }
    Ok(())
}

/// `messages` (and `tools`, and `kwargs` for the template) through
/// `template`, ready for the assistant's reply. As llama.cpp does, a
/// template without a system role gets the system prompt before the first
/// user message.
pub fn chat_text(
    tokenizer: &Tokenizer,
    template: &ChatTemplate,
    messages: &[Message],
    tools: Option<&Tools>,
    kwargs: Option<&Map<String, Value>>,
) -> Result<String, ApiError> {
    let mut messages = messages.to_vec();
    if messages.len() > 1
        && messages[0].role == "system"
        && messages[1].role == "user"
        && !template.supports_system_role()
    {
        let system = messages.remove(0).content;
        messages[0].content = format!("{system}\n{}", messages[0].content);
    }
    let rendered =
        if tools.is_some() || kwargs.is_some() || messages.iter().any(Message::has_tool_fields) {
            let mut msgs: Vec<Value> = messages.iter().map(Message::to_json).collect();
            if messages.iter().any(|m| m.tool_calls.is_some()) && template.takes_object_arguments()
            {
                object_arguments(&mut msgs)?;
            }
            let tools = tools.map(|t| t.list.as_slice());
            tokenizer.chat_prompt_json(template, &msgs, tools, true, kwargs)
        } else {
            let msgs: Vec<(&str, &str)> = messages
                .iter()
                .map(|m| (m.role.as_str(), m.content.as_str()))
                .collect();
            tokenizer.chat_prompt_with(template, &msgs, true)
        };
    rendered.map_err(|e| ApiError::bad(format!("the chat template: {e}")))
}

/// Each call's `arguments` in `messages` as the object its string of JSON
/// reads as, for templates that take objects
/// ([`ChatTemplate::takes_object_arguments`]); a string that is not JSON is
/// refused, as llama.cpp refuses it.
fn object_arguments(messages: &mut [Value]) -> Result<(), ApiError> {
    for (i, m) in messages.iter_mut().enumerate() {
        let Some(Value::Array(calls)) = m.get_mut("tool_calls") else {
            continue;
        };
        for (j, call) in calls.iter_mut().enumerate() {
            if let Some(args) = call
                .get_mut("function")
                .and_then(|f| f.get_mut("arguments"))
            {
                if let Value::String(text) = args {
                    *args = serde_json::from_str(text).map_err(|e| {
                        ApiError::bad(format!(
                            "messages[{i}].tool_calls[{j}].function.arguments is not JSON: {e}"
                        ))
                    })?;
                }
            }
        }
    }
    Ok(())
}

/// A request body's JSON object.
pub(super) fn object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(o)) => Ok(o),
        Ok(_) => Err(ApiError::bad("the body must be a JSON object")),
        Err(e) => Err(ApiError::bad(format!("the body is not JSON: {e}"))),
    }
}

/// A message's content parts as text, an image marker where each image is.
fn content_parts(parts: &[Value], i: usize, images: &mut Vec<Vec<u8>>) -> Result<String, ApiError> {
    let mut text = String::new();
    for (j, part) in parts.iter().enumerate() {
        let at = format!("messages[{i}].content[{j}]");
        let kind = part
            .get("type")
            .and_then(Value::as_str)
            .ok_or_else(|| ApiError::bad(format!("{at}.type must be a string")))?;
        match kind {
            "text" => text.push_str(
                part.get("text")
                    .and_then(Value::as_str)
                    .ok_or_else(|| ApiError::bad(format!("{at}.text must be a string")))?,
            ),
            "image_url" => {
                let url = part
                    .get("image_url")
                    .and_then(|u| u.get("url").or(Some(u)))
                    .and_then(Value::as_str)
                    .ok_or_else(|| ApiError::bad(format!("{at}.image_url.url must be a string")))?;
                if images.len() == MAX_IMAGES {
                    return Err(ApiError::bad(format!(
                        "more than {MAX_IMAGES} images in one request"
                    )));
                }
                images.push(data_url(url).map_err(|e| ApiError::bad(format!("{at}: {e}")))?);
                text.push_str(MEDIA_MARKER);
            }
            other => {
                return Err(ApiError::bad(format!(
                    "{at}: content parts of type {other:?} are not supported (text, image_url)"
                )))
            }
        }
    }
    Ok(text)
}

/// The bytes of a base64 `data:` URL (`data:image/png;base64,...`); other
/// URLs are refused (the server fetches nothing).
pub fn data_url(url: &str) -> Result<Vec<u8>, String> {
    let rest = url
        .strip_prefix("data:")
        .ok_or("images must be data: URLs (base64); the server fetches nothing")?;
    let (meta, data) = rest
        .split_once(',')
        .ok_or("a data: URL without a ',' before its data")?;
    if !meta.ends_with(";base64") {
        return Err("a data: URL that is not base64".into());
    }
    if data.len() / 4 * 3 > MAX_IMAGE_BYTES + 3 {
        return Err(format!("an image over {} MiB", MAX_IMAGE_BYTES >> 20));
    }
    base64(data)
}

/// Standard base64 (RFC 4648, `+/`, padding optional; whitespace skipped).
pub fn base64(text: &str) -> Result<Vec<u8>, String> {
    let mut out = Vec::with_capacity(text.len() / 4 * 3 + 3);
    let (mut acc, mut bits) = (0u32, 0u32);
    let mut padding = 0;
    for (i, c) in text.bytes().enumerate() {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' | b'-' => 62,
            b'/' | b'_' => 63,
            b'=' => {
                padding += 1;
                continue;
            }
            b' ' | b'\n' | b'\r' | b'\t' => continue,
            _ => return Err(format!("invalid base64 at byte {i}")),
        };
        if padding > 0 {
            return Err(format!("base64 data after its padding at byte {i}"));
        }
        acc = (acc << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    if bits >= 6 || padding > 2 {
        return Err("truncated base64".into());
    }
    Ok(out)
}

/// The fields both endpoints share.
fn completion(
    obj: &Map<String, Value>,
    prompt: Prompt,
    images: Vec<Vec<u8>>,
) -> Result<Completion, ApiError> {
    for (key, what) in [
        ("functions", "legacy function calls (use tools)"),
        (
            "post_sampling_probs",
            "probabilities after the samplers (log probabilities are the model's, before them)",
        ),
        ("echo", "echoing the prompt"),
        ("suffix", "suffixes"),
        ("best_of", "best_of"),
    ] {
        match obj.get(key) {
            None | Some(Value::Null) | Some(Value::Bool(false)) => {}
            Some(Value::Array(a)) if a.is_empty() => {}
            Some(Value::Number(n)) if n.as_f64() == Some(0.0) => {}
            Some(_) => return Err(ApiError::bad(format!("'{key}': {what} are not supported"))),
        }
    }
    if let Some(n) = obj.get("n").filter(|v| !v.is_null()) {
        if n.as_u64() != Some(1) {
            return Err(ApiError::bad("'n': one choice a request (n = 1) only"));
        }
    }
    let d = Sampling::default();
    let sampling = Sampling {
        temperature: float(obj, "temperature", d.temperature, 0.0..=100.0)?,
        top_k: count(obj, "top_k")?.unwrap_or(d.top_k),
        top_p: float(obj, "top_p", d.top_p, 0.0..=1.0)?,
        min_p: float(obj, "min_p", d.min_p, 0.0..=1.0)?,
        typical_p: float(obj, "typical_p", d.typical_p, 0.0..=1.0)?,
        repeat_penalty: float(obj, "repeat_penalty", d.repeat_penalty, 0.0..=100.0)?,
        frequency_penalty: float(obj, "frequency_penalty", d.frequency_penalty, -2.0..=2.0)?,
        presence_penalty: float(obj, "presence_penalty", d.presence_penalty, -2.0..=2.0)?,
        repeat_last_n: count(obj, "repeat_last_n")?.unwrap_or(d.repeat_last_n),
        mirostat: match count(obj, "mirostat")? {
            None => d.mirostat,
            Some(v) if v <= 2 => v as u8,
            Some(_) => return Err(ApiError::bad("'mirostat' must be 0, 1 or 2")),
        },
        mirostat_tau: float(obj, "mirostat_tau", d.mirostat_tau, 0.0..=100.0)?,
        mirostat_eta: float(obj, "mirostat_eta", d.mirostat_eta, 0.0..=10.0)?,
        logit_bias: logit_bias(obj)?,
        seed: match obj.get("seed") {
            None | Some(Value::Null) => None,
            // llama-server's -1: a new seed.
            Some(v) if v.as_i64() == Some(-1) => None,
            Some(v) => Some(
                v.as_u64()
                    .ok_or_else(|| ApiError::bad("'seed' must be a non-negative integer"))?,
            ),
        },
    };
    let mut max_tokens = None;
    for key in ["max_tokens", "max_completion_tokens", "n_predict"] {
        match obj.get(key) {
            None | Some(Value::Null) => {}
            Some(v) if v.as_i64() == Some(-1) => {}
            Some(v) => {
                max_tokens = Some(v.as_u64().ok_or_else(|| {
                    ApiError::bad(format!("'{key}' must be a non-negative integer"))
                })? as usize)
            }
        }
    }
    let stop = match obj.get("stop") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| v.as_str().map(str::to_string))
            .collect::<Option<Vec<String>>>()
            .ok_or_else(|| ApiError::bad("'stop' must be a string or an array of strings"))?,
        Some(_) => {
            return Err(ApiError::bad(
                "'stop' must be a string or an array of strings",
            ))
        }
    };
    if stop.len() > MAX_STOPS {
        return Err(ApiError::bad(format!("more than {MAX_STOPS} stop strings")));
    }
    if stop.iter().any(String::is_empty) {
        return Err(ApiError::bad("'stop' has an empty string"));
    }
    Ok(Completion {
        prompt,
        images,
        stream: match obj.get("stream") {
            None | Some(Value::Null) => false,
            Some(v) => v
                .as_bool()
                .ok_or_else(|| ApiError::bad("'stream' must be true or false"))?,
        },
        max_tokens,
        sampling,
        stop,
        grammar: grammar(obj)?,
        reasoning: false,
        logprobs: logprobs(obj)?,
        tools: None,
        chat_template_kwargs: None,
        return_tokens: match obj.get("return_tokens") {
            None | Some(Value::Null) => false,
            Some(v) => v
                .as_bool()
                .ok_or_else(|| ApiError::bad("'return_tokens' must be true or false"))?,
        },
    })
}

/// Most `logit_bias` entries a request may give.
pub const MAX_LOGIT_BIAS: usize = 4096;

/// `logit_bias`: OpenAI's `{"token id": bias}` or llama-server's `[[id,
/// bias], ...]`, a bias of `false` banning the token (ids are checked
/// against the vocabulary by the engine).
fn logit_bias(obj: &Map<String, Value>) -> Result<Vec<(u32, f32)>, ApiError> {
    let entries: Vec<(Value, &Value)> = match obj.get("logit_bias") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Object(m)) => m.iter().map(|(k, v)| (json!(k), v)).collect(),
        Some(Value::Array(a)) => a
            .iter()
            .map(|e| match e.as_array().map(Vec::as_slice) {
                Some([id, bias]) => Ok((id.clone(), bias)),
                _ => Err(ApiError::bad(
                    "'logit_bias' entries must be [token id, bias]",
                )),
            })
            .collect::<Result<_, _>>()?,
        Some(_) => {
            return Err(ApiError::bad(
                "'logit_bias' must be an object of token ids or an array of [token id, bias]",
            ))
        }
    };
    if entries.len() > MAX_LOGIT_BIAS {
        return Err(ApiError::bad(format!(
            "more than {MAX_LOGIT_BIAS} 'logit_bias' entries"
        )));
    }
    entries
        .into_iter()
        .map(|(id, bias)| {
            let id = match &id {
                Value::Number(n) => n.as_u64(),
                Value::String(s) => s.parse().ok(),
                _ => None,
            }
            .and_then(|id| u32::try_from(id).ok())
            .ok_or_else(|| {
                ApiError::bad(format!(
                    "'logit_bias': {id} is not a token id (biases by text are not supported: see /tokenize)"
                ))
            })?;
            let bias = match bias {
                Value::Bool(false) => f32::NEG_INFINITY,
                v => v
                    .as_f64()
                    .map(|b| b as f32)
                    .filter(|b| b.is_finite())
                    .ok_or_else(|| {
                        ApiError::bad(format!("'logit_bias': token {id}'s bias must be a number or false"))
                    })?,
            };
            Ok((id, bias))
        })
        .collect()
}

/// How many most likely tokens' log probabilities a request asks for at
/// each position, if it asks for log probabilities: chat's `logprobs: true`
/// with `top_logprobs` (20 without it, as llama-server), or a count in
/// `logprobs` (completions) or `n_probs` (llama-server's), where 0 asks for
/// none.
fn logprobs(obj: &Map<String, Value>) -> Result<Option<usize>, ApiError> {
    let bounded = |key: &str| match count(obj, key)? {
        Some(n) if n > MAX_TOP_LOGPROBS => Err(ApiError::bad(format!(
            "'{key}' = {n}: at most {MAX_TOP_LOGPROBS} tokens a position"
        ))),
        n => Ok(n),
    };
    let top = bounded("top_logprobs")?;
    let asked = match obj.get("logprobs") {
        Some(Value::Bool(true)) => Some(top.unwrap_or(DEFAULT_TOP_LOGPROBS)),
        Some(Value::Number(_)) => bounded("logprobs")?.filter(|&n| n > 0),
        None | Some(Value::Null) | Some(Value::Bool(false)) => None,
        Some(_) => {
            return Err(ApiError::bad(
                "'logprobs' must be true, false or a number of tokens",
            ))
        }
    };
    if top.is_some() && obj.get("logprobs") != Some(&Value::Bool(true)) {
        return Err(ApiError::bad("'top_logprobs' needs 'logprobs': true"));
    }
    Ok(asked.or(bounded("n_probs")?.filter(|&n| n > 0)))
}

/// A float field in `range`, `default` where absent or null.
fn float(
    obj: &Map<String, Value>,
    key: &str,
    default: f32,
    range: std::ops::RangeInclusive<f32>,
) -> Result<f32, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => {
            let x = v
                .as_f64()
                .ok_or_else(|| ApiError::bad(format!("'{key}' must be a number")))?
                as f32;
            if !range.contains(&x) {
                return Err(ApiError::bad(format!(
                    "'{key}' = {x} is outside {}..={}",
                    range.start(),
                    range.end()
                )));
            }
            Ok(x)
        }
    }
}

/// A non-negative integer field, if present and not null.
fn count(obj: &Map<String, Value>, key: &str) -> Result<Option<usize>, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .map(|x| Some(x.min(usize::MAX as u64) as usize))
            .ok_or_else(|| ApiError::bad(format!("'{key}' must be a non-negative integer"))),
    }
}

/// The grammar a request asks for: `grammar` (GBNF), `json_schema`, or
/// `response_format` (`json_object`: any JSON object; `json_schema`: its
/// `schema`), at most one of them.
fn grammar(obj: &Map<String, Value>) -> Result<Option<String>, ApiError> {
    let schema_gbnf = |schema: &Value, from: &str| {
        json_schema_to_gbnf(&schema.to_string()).map_err(|e| ApiError::bad(format!("{from}: {e}")))
    };
    let mut found: Vec<String> = Vec::new();
    if let Some(g) = obj.get("grammar").filter(|v| !v.is_null()) {
        found.push(
            g.as_str()
                .ok_or_else(|| ApiError::bad("'grammar' must be a string"))?
                .to_string(),
        );
    }
    if let Some(s) = obj.get("json_schema").filter(|v| !v.is_null()) {
        found.push(schema_gbnf(s, "json_schema")?);
    }
    if let Some(rf) = obj.get("response_format").filter(|v| !v.is_null()) {
        let kind = rf
            .get("type")
            .and_then(Value::as_str)
            .ok_or_else(|| ApiError::bad("'response_format.type' must be a string"))?;
        match kind {
            "text" => {}
            "json_object" => {
                let schema = rf
                    .get("schema")
                    .cloned()
                    .unwrap_or_else(|| json!({"type": "object"}));
                found.push(schema_gbnf(&schema, "response_format")?);
            }
            "json_schema" => {
                let schema = rf
                    .get("json_schema")
                    .and_then(|j| j.get("schema"))
                    .or_else(|| rf.get("schema"))
                    .ok_or_else(|| {
                        ApiError::bad("'response_format.json_schema.schema' is required")
                    })?;
                found.push(schema_gbnf(schema, "response_format")?);
            }
            other => {
                return Err(ApiError::bad(format!(
                    "'response_format.type' = {other:?} (text, json_object or json_schema)"
                )))
            }
        }
    }
    match found.len() {
        0 | 1 => Ok(found.pop()),
        _ => Err(ApiError::bad(
            "give one of 'grammar', 'json_schema' and 'response_format'",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chat_request_reads_its_messages_and_samplers() {
        let c = chat_request(
            br#"{"model":"x","messages":[{"role":"system","content":"Be brief."},
                {"role":"user","content":[{"type":"text","text":"Hi "},{"type":"text","text":"there"}]}],
                "temperature":0,"max_tokens":5,"seed":7,"stop":"\n","stream":true,"user":"ignored"}"#,
        )
        .unwrap();
        assert_eq!(
            c.prompt,
            Prompt::Chat(vec![
                Message::text("system", "Be brief."),
                Message::text("user", "Hi there"),
            ])
        );
        assert_eq!(c.sampling.temperature, 0.0);
        assert_eq!(c.sampling.seed, Some(7));
        assert_eq!(c.sampling.top_k, 40);
        assert_eq!((c.max_tokens, c.stream), (Some(5), true));
        assert_eq!(c.stop, ["\n"]);
        assert_eq!(c.grammar, None);
    }

    #[test]
    fn tool_calls_and_answers_are_kept_in_their_messages() {
        let c = chat_request(
            br#"{"messages":[{"role":"user","content":"Weather?"},
                {"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function",
                    "function":{"name":"w","arguments":"{}"}}]},
                {"role":"tool","tool_call_id":"c1","name":"w","content":"sunny"}],
                "tools":[{"type":"function","function":{"name":"w"}}],"tool_choice":"required"}"#,
        )
        .unwrap();
        let Prompt::Chat(m) = &c.prompt else {
            panic!("a chat")
        };
        assert_eq!(m[1].content, "");
        assert_eq!(
            m[1].tool_calls.as_ref().unwrap()[0]["function"]["name"],
            "w"
        );
        assert_eq!(
            (m[2].tool_call_id.as_deref(), m[2].name.as_deref()),
            (Some("c1"), Some("w"))
        );
        assert_eq!(m[1].to_json()["tool_calls"][0]["id"], "c1");
        assert_eq!(m[2].to_json()["tool_call_id"], "c1");
        assert!(m[2].has_tool_fields() && !m[0].has_tool_fields());
        // A required call is the engine's grammar to make, none given.
        assert_eq!(c.grammar, None);
        assert_eq!(c.tools.unwrap().choice, ToolChoice::Required);
        let err = |b: &str| chat_request(b.as_bytes()).unwrap_err().message;
        let m = r#""messages":[{"role":"assistant","content":"x","tool_calls":"#;
        assert!(err(&format!("{{{m}3}}]}}")).contains("tool_calls must be an array"));
        assert!(
            err(r#"{"messages":[{"role":"tool","content":"x","tool_call_id":1}]}"#)
                .contains("tool_call_id must be a string")
        );
        assert!(
            err(r#"{"messages":[{"role":"user","content":"x"}],"functions":[{}]}"#)
                .contains("legacy function calls")
        );
    }

    #[test]
    fn images_come_as_base64_data_urls_in_place() {
        let png = [0x89, b'P', b'N', b'G', 0, 255, 7];
        let url = format!("data:image/png;base64,{}", encode(&png));
        let body = json!({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is "},
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "?"}]}]});
        let c = chat_request(body.to_string().as_bytes()).unwrap();
        assert_eq!(c.images, vec![png.to_vec()]);
        let Prompt::Chat(m) = c.prompt else {
            panic!("chat")
        };
        assert_eq!(m[0].content, format!("What is {MEDIA_MARKER}?"));
        let remote = json!({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]});
        let e = chat_request(remote.to_string().as_bytes()).unwrap_err();
        assert!(e.message.contains("data: URLs"), "{e:?}");
    }

    /// Test-only encoder (the server only decodes).
    fn encode(bytes: &[u8]) -> String {
        const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        let mut out = String::new();
        for c in bytes.chunks(3) {
            let n = (u32::from(c[0]) << 16)
                | (u32::from(*c.get(1).unwrap_or(&0)) << 8)
                | u32::from(*c.get(2).unwrap_or(&0));
            for k in 0..4 {
                if k <= c.len() {
                    out.push(A[(n >> (18 - 6 * k) & 63) as usize] as char);
                } else {
                    out.push('=');
                }
            }
        }
        out
    }

    #[test]
    fn base64_round_trips_and_refuses_what_is_not() {
        for len in 0..40usize {
            let bytes: Vec<u8> = (0..len).map(|i| (i * 37 + 11) as u8).collect();
            assert_eq!(base64(&encode(&bytes)).unwrap(), bytes, "{len}");
            let unpadded = encode(&bytes).trim_end_matches('=').to_string();
            assert_eq!(base64(&unpadded).unwrap(), bytes, "{len}");
        }
        assert_eq!(base64("aGk=\n").unwrap(), b"hi");
        assert!(base64("a").is_err());
        assert!(base64("aGk=aGk=").is_err());
        assert!(base64("a*Gk").is_err());
    }

    #[test]
    fn logit_biases_are_read_in_both_shapes() {
        let text = |extra: &str| text_request(format!("{{\"prompt\":\"x\"{extra}}}").as_bytes());
        let bias = |extra: &str| text(extra).unwrap().sampling.logit_bias;
        assert_eq!(bias(""), []);
        assert_eq!(
            bias(",\"logit_bias\":{\"15\":2.5,\"3\":-100}"),
            [(15, 2.5), (3, -100.0)]
        );
        assert_eq!(
            bias(",\"logit_bias\":[[7,false],[8,1]]"),
            [(7, f32::NEG_INFINITY), (8, 1.0)]
        );
        let err = |extra: &str| text(extra).unwrap_err().message;
        assert!(err(",\"logit_bias\":{\"hello\":1}").contains("not a token id"));
        assert!(err(",\"logit_bias\":[[\"hello\",1]]").contains("not a token id"));
        assert!(err(",\"logit_bias\":{\"1\":\"x\"}").contains("a number or false"));
        assert!(err(",\"logit_bias\":[[1]]").contains("[token id, bias]"));
        assert!(err(",\"logit_bias\":3").contains("must be"));
        assert!(err(",\"logit_bias\":{\"99999999999\":1}").contains("not a token id"));
    }

    #[test]
    fn log_probabilities_are_asked_as_openai_and_llama_server_ask() {
        let m = r#""messages":[{"role":"user","content":"x"}]"#;
        let chat = |extra: &str| chat_request(format!("{{{m}{extra}}}").as_bytes());
        let text = |extra: &str| text_request(format!("{{\"prompt\":\"x\"{extra}}}").as_bytes());
        assert_eq!(chat("").unwrap().logprobs, None);
        assert_eq!(chat(",\"logprobs\":false").unwrap().logprobs, None);
        assert_eq!(chat(",\"logprobs\":true").unwrap().logprobs, Some(20));
        let top = ",\"logprobs\":true,\"top_logprobs\":3";
        assert_eq!(chat(top).unwrap().logprobs, Some(3));
        let none = ",\"logprobs\":true,\"top_logprobs\":0";
        assert_eq!(chat(none).unwrap().logprobs, Some(0));
        assert_eq!(chat(",\"n_probs\":4").unwrap().logprobs, Some(4));
        assert_eq!(text(",\"logprobs\":5").unwrap().logprobs, Some(5));
        assert_eq!(text(",\"logprobs\":0").unwrap().logprobs, None);
        assert_eq!(text(",\"n_probs\":2").unwrap().logprobs, Some(2));
        let err = |r: Result<Completion, ApiError>| r.unwrap_err().message;
        assert!(err(chat(",\"top_logprobs\":3")).contains("needs 'logprobs': true"));
        let many = ",\"logprobs\":true,\"top_logprobs\":101";
        assert!(err(chat(many)).contains("at most 100"));
        assert!(err(text(",\"logprobs\":1000")).contains("at most 100"));
        assert!(err(text(",\"logprobs\":\"yes\"")).contains("'logprobs' must be"));
        assert!(err(text(",\"logprobs\":-1")).contains("non-negative"));
    }

    #[test]
    fn what_is_wrong_or_unsupported_is_named() {
        let err = |body: &str| chat_request(body.as_bytes()).unwrap_err().message;
        assert!(err("[").contains("not JSON"));
        assert!(err("[]").contains("JSON object"));
        assert!(err("{}").contains("'messages' is required"));
        assert!(err(r#"{"messages":[]}"#).contains("empty"));
        assert!(err(r#"{"messages":[{"content":"x"}]}"#).contains("role"));
        let m = r#""messages":[{"role":"user","content":"x"}]"#;
        assert!(err(&format!("{{{m},\"n\":2}}")).contains("'n'"));
        assert!(
            err(&format!("{{{m},\"post_sampling_probs\":true}}")).contains("after the samplers")
        );
        assert!(err(&format!("{{{m},\"tools\":[{{}}]}}")).contains("tools[0].type"));
        assert!(err(&format!("{{{m},\"temperature\":\"hot\"}}")).contains("'temperature'"));
        assert!(err(&format!("{{{m},\"top_p\":2}}")).contains("outside"));
        assert!(err(&format!("{{{m},\"max_tokens\":-3}}")).contains("max_tokens"));
        assert!(err(&format!("{{{m},\"stop\":[1]}}")).contains("'stop'"));
        assert!(err(&format!(
            "{{{m},\"grammar\":\"root ::= \\\"a\\\"\",\"json_schema\":{{}}}}"
        ))
        .contains("one of"));
        // What does not change the answer is ignored, as clients send it.
        let ok =
            chat_request(format!("{{{m},\"n\":1,\"logprobs\":false,\"tools\":[]}}").as_bytes());
        assert!(ok.is_ok());
        let e = text_request(br#"{"prompt":["a","b"]}"#).unwrap_err();
        assert!(e.message.contains("one string"));
        assert_eq!(e.body()["error"]["code"], 400);
    }

    #[test]
    fn response_formats_become_grammars() {
        let m = r#""messages":[{"role":"user","content":"x"}]"#;
        let g = |extra: &str| {
            chat_request(format!("{{{m},{extra}}}").as_bytes())
                .unwrap()
                .grammar
        };
        assert!(g(r#""response_format":{"type":"json_object"}"#).is_some());
        let s = g(r#""response_format":{"type":"json_schema","json_schema":{"name":"a","schema":{"type":"integer"}}}"#)
            .unwrap();
        assert!(s.contains("root"), "{s}");
        assert_eq!(g(r#""response_format":{"type":"text"}"#), None);
        assert_eq!(
            g(r#""grammar":"root ::= \"yes\"""#).as_deref(),
            Some("root ::= \"yes\"")
        );
        let c = text_request(br#"{"prompt":"Once","max_tokens":3}"#).unwrap();
        assert_eq!(c.prompt, Prompt::Text("Once".into()));
    }
}
