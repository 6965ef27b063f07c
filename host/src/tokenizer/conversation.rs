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
///
/// A turn is text to tokenize (the caller splices images where it holds
/// markers) after some lead tokens; the caller reports what it fed with
/// [`fed`](Conversation::fed).
pub struct Conversation<'t> {
    tokenizer: &'t Tokenizer,
    template: ChatTemplate,
    system: Option<String>,
    messages: Vec<(String, String)>,
    /// What the session holds, as text and as tokens (`n_vocab` for an image
    /// position, as the caller fed them).
    held_text: String,
    held: Vec<u32>,
    /// The last reply: its text, its last token when it was sampled but not
    /// evaluated (cut by a length limit), and the end-of-generation token that
    /// ended it.
    reply: String,
    pending: Option<u32>,
    ended_with: Option<u32>,
}

/// The next turn to evaluate: `lead`, then `text` tokenized.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Turn {
    /// Tokens before the text: the last reply's token that was sampled but
    /// not evaluated, and the end-of-generation token where the template
    /// rewrote the replies.
    pub lead: Vec<u32>,
    /// The template's rendering past what the session holds.
    pub text: String,
    /// Whether this turn starts the sequence (the first one, or the first
    /// after [`clear`](Conversation::clear)): its text is the whole rendering,
    /// to tokenize with BOS (and EOS) as the model's flags say.
    pub first: bool,
}

impl Turn {
    /// The turn's tokens, where its text holds no image.
    pub fn tokens(&self, tokenizer: &Tokenizer) -> Vec<u32> {
        let text = tokenizer.encode(&self.text, self.first, true);
        self.lead.iter().copied().chain(text).collect()
    }
}

impl<'t> Conversation<'t> {
    /// An empty conversation in `template`, whose first message (and the
    /// first after each [`clear`](Self::clear)) follows `system`, if given:
    /// as a system message, or, where the template has no system role, before
    /// the user's message in the same message (as llama.cpp does).
    pub fn new(tokenizer: &'t Tokenizer, template: ChatTemplate, system: Option<&str>) -> Self {
        Conversation {
            tokenizer,
            template,
            system: system.map(str::to_string),
            messages: Vec::new(),
            held_text: String::new(),
            held: Vec::new(),
            reply: String::new(),
            pending: None,
            ended_with: None,
        }
    }

    /// Forgets every message: the next [`ask`](Self::ask) starts a new
    /// sequence (the session is to be rewound to its start).
    pub fn clear(&mut self) {
        self.messages.clear();
        self.held_text.clear();
        self.held.clear();
        self.reply.clear();
        self.pending = None;
        self.ended_with = None;
    }

    /// The next turn, the user's `message` (to evaluate after what the
    /// session holds, then generate the reply). Report what was evaluated of
    /// it with [`fed`](Self::fed).
    pub fn ask(&mut self, message: &str) -> Result<Turn, ChatTemplateError> {
        let tk = self.tokenizer;
        if self.messages.is_empty() {
            self.messages = match &self.system {
                Some(system) => self.template.with_system_prompt(system, message).0,
                None => vec![("user".into(), message.to_string())],
            };
            let text = tk.chat_prompt_with(&self.template, &self.messages, true)?;
            self.held_text.clone_from(&text);
            return Ok(Turn {
                lead: Vec::new(),
                text,
                first: true,
            });
        }
        self.messages
            .push(("assistant".into(), std::mem::take(&mut self.reply)));
        self.messages.push(("user".into(), message.to_string()));
        let rendered = tk.chat_prompt_with(&self.template, &self.messages, true)?;
        let mut lead: Vec<u32> = self.pending.take().into_iter().collect();
        let text = match rendered.strip_prefix(self.held_text.as_str()) {
            Some(rest) => rest.to_string(),
            None => {
                let before = &self.messages[..self.messages.len() - 1];
                let past = tk.chat_prompt_with(&self.template, before, false)?;
                lead.extend(self.ended_with);
                rendered
                    .strip_prefix(past.as_str())
                    .unwrap_or(&rendered)
                    .to_string()
            }
        };
        self.held_text = rendered;
        Ok(Turn {
            lead,
            text,
            first: false,
        })
    }

    /// Records what the session evaluated of the last [`ask`](Self::ask)'s
    /// turn (`n_vocab` or more for an image position).
    pub fn fed(&mut self, positions: &[u32]) {
        self.held.extend_from_slice(positions);
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

    /// The tokens the session holds (the turns' as [`fed`](Self::fed), the
    /// replies'), for a drafter.
    pub fn held(&self) -> &[u32] {
        &self.held
    }

    /// The messages so far (the last reply not among them until the next
    /// [`ask`](Self::ask)).
    pub fn messages(&self) -> &[(String, String)] {
        &self.messages
    }
}
