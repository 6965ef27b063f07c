//! [`Conversation`]: the turns of a chat kept in one session (`les run
//! --conversation`), each new turn evaluated after what the session holds.

use super::{ChatTemplate, ChatTemplateError, Tokenizer};

/// A chat whose turns are evaluated one after another in one session: only
/// each new turn's tokens are fed, after the replies so far (llama-cli's
/// conversation mode).
///
/// It tracks what the session holds as text (the template's rendering up to
/// the last reply, then the reply as generated) and as tokens. A new user
/// message renders the whole conversation again; where that rendering starts
/// with the text held (the template keeps replies as generated), the rest is
/// the new turn. Where the template rewrites past replies (some drop their
/// reasoning), the turn is, as llama.cpp makes it, the end-of-generation token
/// the reply ended with, then what the new message adds to the rendering of
/// the conversation before it.
pub struct Conversation<'t> {
    tokenizer: &'t Tokenizer,
    template: ChatTemplate,
    messages: Vec<(String, String)>,
    /// What the session holds, as text and as tokens (`n_vocab` for an image
    /// position).
    held_text: String,
    held: Vec<u32>,
    /// The last reply: its text, its last token when it was sampled but not
    /// evaluated (cut by a length limit), and the end-of-generation token that
    /// ended it.
    reply: String,
    pending: Option<u32>,
    ended_with: Option<u32>,
}

impl<'t> Conversation<'t> {
    /// A conversation whose first `messages` (a system message, if any, and
    /// the first user message) the session evaluated as `prompt` (rendered
    /// by [`Tokenizer::chat_prompt_with`] as `prompt_text`).
    pub fn new(
        tokenizer: &'t Tokenizer,
        template: ChatTemplate,
        messages: Vec<(String, String)>,
        prompt_text: String,
        prompt: Vec<u32>,
    ) -> Self {
        Conversation {
            tokenizer,
            template,
            messages,
            held_text: prompt_text,
            held: prompt,
            reply: String::new(),
            pending: None,
            ended_with: None,
        }
    }

    /// Records the reply just generated: its tokens (without the
    /// end-of-generation token), its text, and the end-of-generation token
    /// that ended it (`None`: cut by a length limit, so its last token was
    /// sampled but not evaluated).
    pub fn replied(&mut self, tokens: &[u32], text: &str, ended_with: Option<u32>) {
        self.pending = None;
        match (ended_with, tokens.split_last()) {
            (None, Some((last, rest))) => {
                self.held.extend_from_slice(rest);
                self.pending = Some(*last);
            }
            _ => self.held.extend_from_slice(tokens),
        }
        self.held_text.push_str(text);
        self.reply = text.to_string();
        self.ended_with = ended_with;
    }

    /// The tokens of the next turn, the user's `message` (to evaluate after
    /// what the session holds, then generate the reply).
    pub fn ask(&mut self, message: &str) -> Result<Vec<u32>, ChatTemplateError> {
        self.messages
            .push(("assistant".into(), std::mem::take(&mut self.reply)));
        self.messages.push(("user".into(), message.to_string()));
        let tk = self.tokenizer;
        let rendered = tk.chat_prompt_with(&self.template, &self.messages, true)?;
        let turn = match rendered.strip_prefix(self.held_text.as_str()) {
            Some(rest) => tk.encode(rest, false, true),
            None => {
                let before = &self.messages[..self.messages.len() - 1];
                let past = tk.chat_prompt_with(&self.template, before, false)?;
                let rest = rendered.strip_prefix(past.as_str()).unwrap_or(&rendered);
                self.ended_with
                    .into_iter()
                    .chain(tk.encode(rest, false, true))
                    .collect()
            }
        };
        let feed: Vec<u32> = self.pending.take().into_iter().chain(turn).collect();
        self.held.extend_from_slice(&feed);
        self.held_text = rendered;
        Ok(feed)
    }

    /// The tokens the session holds once the last [`ask`](Self::ask)'s turn is
    /// evaluated (the prompt's, the replies', the turns'), for a drafter.
    pub fn held(&self) -> &[u32] {
        &self.held
    }

    /// The messages so far (the last reply not among them until the next
    /// [`ask`](Self::ask)).
    pub fn messages(&self) -> &[(String, String)] {
        &self.messages
    }
}
