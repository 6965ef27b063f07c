//! A reply's reasoning told from its answer, as llama-server's
//! `reasoning_format` (`auto`) tells them, by the model's own marker tokens:
//!
//! - `<think>` ... `</think>` (Qwen3, DeepSeek-R1, GLM-4.5, MiniMax-M2): a
//!   reply that starts with a thought has it as reasoning, up to the first
//!   `</think>`; the rest is the answer, tags in it included, as llama.cpp
//!   parses it. A prompt whose last tag is `<think>` (a template that opens
//!   the thought itself) starts in the thought.
//! - gpt-oss's harmony messages: `<|channel|>NAME<|message|>TEXT<|end|>`,
//!   the `analysis` channel's text is reasoning, `final`'s (and any other's)
//!   the answer; headers (`<|start|>assistant`, channel names) are neither.
//!   A message whose header names a function as its recipient
//!   (`to=functions.NAME`, before or after `<|channel|>`) is a tool call:
//!   its text is the call's arguments ([`Channel::Call`],
//!   [`Splitter::recipient`]).
//!
//! The markers are told by token id, never by text, so text that merely
//! spells them stays text.

use crate::tokenizer::Tokenizer;

/// Where a token's text goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Channel {
    /// The answer (`content`).
    Content,
    /// The reasoning (`reasoning_content`).
    Reasoning,
    /// Neither: a marker or a header, dropped.
    Hidden,
    /// A harmony tool call's arguments (the function is
    /// [`Splitter::recipient`]).
    Call,
}

/// The marker tokens of a format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Format {
    Think {
        open: u32,
        close: u32,
    },
    Harmony {
        start: u32,
        channel: u32,
        message: u32,
        end: u32,
    },
}

/// Where a harmony reply is.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Harmony {
    /// In a header (`<|start|>` up to `<|channel|>`), its text so far.
    Header(String),
    /// Reading a channel's name (and what follows it in the header), the
    /// header's text before `<|channel|>` first.
    Name(String, String),
    /// In a message of the channel.
    Message(Channel),
}

/// Longest header text kept (a role, a channel, a recipient and a
/// constraint are a few words).
const MAX_HEADER: usize = 256;

/// The function a harmony header sends its message to: the word after
/// `to=functions.` (a name ends at white space or `<`).
fn recipient(header: &str) -> Option<String> {
    let at = header.find("to=functions.")?;
    let name: String = header[at + "to=functions.".len()..]
        .chars()
        .take_while(|c| !c.is_whitespace() && *c != '<')
        .collect();
    (!name.is_empty()).then_some(name)
}

/// Where a `<think>` reply is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Think {
    /// Nothing yet: a thought may open.
    Start,
    /// In the thought.
    Thinking,
    /// In the answer, to the end.
    Answer,
}

/// Routes a reply's tokens to [`Channel`]s.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Splitter {
    format: Format,
    think: Think,
    harmony: Harmony,
    /// The function of the last harmony call message.
    recipient: Option<String>,
}

impl Splitter {
    /// The splitter of `tokenizer`'s format, if its vocabulary has one.
    pub fn of(tokenizer: &Tokenizer) -> Option<Splitter> {
        let id = |t: &str| tokenizer.token_id(t);
        let format = match (
            id("<|start|>"),
            id("<|channel|>"),
            id("<|message|>"),
            id("<|end|>"),
        ) {
            (Some(start), Some(channel), Some(message), Some(end)) => Format::Harmony {
                start,
                channel,
                message,
                end,
            },
            _ => Format::Think {
                open: id("<think>")?,
                close: id("</think>")?,
            },
        };
        Some(Splitter::new(format))
    }

    fn new(format: Format) -> Splitter {
        Splitter {
            format,
            think: Think::Start,
            harmony: Harmony::Header(String::new()),
            recipient: None,
        }
    }

    /// Whether the format is gpt-oss's harmony.
    pub fn is_harmony(&self) -> bool {
        matches!(self.format, Format::Harmony { .. })
    }

    /// The function the reply's last call message went to (harmony).
    pub fn recipient(&self) -> Option<&str> {
        self.recipient.as_deref()
    }

    /// Starts a reply after `prompt` (its tokens; `None` for an image):
    /// inside a thought where the prompt's last think tag opens one; a
    /// harmony reply starts in the assistant's header.
    pub fn start(&mut self, prompt: &[Option<u32>]) {
        self.harmony = Harmony::Header(String::new());
        self.recipient = None;
        let opened = match self.format {
            Format::Think { open, close } => prompt
                .iter()
                .rev()
                .flatten()
                .find(|&&t| t == open || t == close)
                .is_some_and(|&t| t == open),
            Format::Harmony { .. } => false,
        };
        self.think = if opened {
            Think::Thinking
        } else {
            Think::Start
        };
    }

    /// Where text goes now (before the next marker).
    pub fn channel(&self) -> Channel {
        match (&self.format, &self.harmony) {
            (Format::Think { .. }, _) if self.think == Think::Thinking => Channel::Reasoning,
            (Format::Harmony { .. }, Harmony::Message(to)) => *to,
            _ => Channel::Content,
        }
    }

    /// Ends a thought in progress: what comes next is the answer (a tool
    /// call started inside the thought, which some formats take as its end).
    pub fn end_thought(&mut self) {
        if self.think == Think::Thinking {
            self.think = Think::Answer;
        }
    }

    /// Where token `t` goes; `text` is its text (a harmony channel's name is
    /// read from it).
    pub fn route(&mut self, t: u32, text: &str) -> Channel {
        match self.format {
            Format::Think { open, close } => match self.think {
                Think::Start if t == open => {
                    self.think = Think::Thinking;
                    Channel::Hidden
                }
                Think::Thinking if t == close => {
                    self.think = Think::Answer;
                    Channel::Hidden
                }
                Think::Thinking => Channel::Reasoning,
                Think::Start | Think::Answer => {
                    self.think = Think::Answer;
                    Channel::Content
                }
            },
            Format::Harmony {
                start,
                channel,
                message,
                end,
            } => {
                if t == start || t == end {
                    self.harmony = Harmony::Header(String::new());
                    return Channel::Hidden;
                }
                if t == channel {
                    let before = match &mut self.harmony {
                        Harmony::Header(h) => std::mem::take(h),
                        _ => String::new(),
                    };
                    self.harmony = Harmony::Name(before, String::new());
                    return Channel::Hidden;
                }
                if t == message {
                    let (before, name) = match &self.harmony {
                        Harmony::Name(before, name) => (before.as_str(), name.as_str()),
                        Harmony::Header(h) => (h.as_str(), ""),
                        Harmony::Message(_) => ("", ""),
                    };
                    let to = match recipient(&format!("{before} {name}")) {
                        Some(f) => {
                            self.recipient = Some(f);
                            Channel::Call
                        }
                        None if name.trim().starts_with("analysis") => Channel::Reasoning,
                        None => Channel::Content,
                    };
                    self.harmony = Harmony::Message(to);
                    return Channel::Hidden;
                }
                match &mut self.harmony {
                    Harmony::Header(h) | Harmony::Name(_, h) => {
                        // A header is a few words; longer is not one.
                        if h.len() < MAX_HEADER {
                            h.push_str(text);
                        }
                        Channel::Hidden
                    }
                    Harmony::Message(to) => *to,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Routes `tokens` (id, text) after `prompt`: the reasoning and the answer.
    fn split(s: &mut Splitter, prompt: &[Option<u32>], tokens: &[(u32, &str)]) -> (String, String) {
        s.start(prompt);
        let (mut reasoning, mut content) = (String::new(), String::new());
        for &(t, text) in tokens {
            match s.route(t, text) {
                Channel::Reasoning => reasoning.push_str(text),
                Channel::Content => content.push_str(text),
                Channel::Hidden | Channel::Call => {}
            }
        }
        (reasoning, content)
    }

    const OPEN: u32 = 900;
    const CLOSE: u32 = 901;

    fn think() -> Splitter {
        Splitter::new(Format::Think {
            open: OPEN,
            close: CLOSE,
        })
    }

    #[test]
    fn think_tags_split_reasoning_from_the_answer() {
        let mut s = think();
        let reply = [
            (OPEN, "<think>"),
            (1, "Let me "),
            (2, "see."),
            (CLOSE, "</think>"),
            (3, "Four."),
        ];
        assert_eq!(
            split(&mut s, &[Some(5)], &reply),
            ("Let me see.".into(), "Four.".into())
        );
        // Text that spells a tag is text.
        assert_eq!(
            split(&mut s, &[], &[(7, "<think>"), (8, "hi")]),
            (String::new(), "<think>hi".into())
        );
        // Only a thought the reply starts with; tags after it are the answer's.
        let later = [(1, "a"), (OPEN, "<think>"), (2, "b"), (CLOSE, "</think>")];
        assert_eq!(
            split(&mut s, &[], &later),
            (String::new(), "a<think>b</think>".into())
        );
        let twice = [
            (OPEN, "<think>"),
            (1, "a"),
            (CLOSE, "</think>"),
            (2, "b"),
            (CLOSE, "</think>"),
        ];
        assert_eq!(split(&mut s, &[], &twice), ("a".into(), "b</think>".into()));
        // No tags: all answer.
        assert_eq!(
            split(&mut s, &[], &[(1, "a"), (2, "b")]),
            (String::new(), "ab".into())
        );
    }

    #[test]
    fn a_prompt_that_opens_the_thought_starts_in_it() {
        let mut s = think();
        let reply = [(1, "hmm"), (CLOSE, "</think>"), (3, "yes")];
        let opened = [Some(5), Some(OPEN), Some(6)];
        assert_eq!(split(&mut s, &opened, &reply), ("hmm".into(), "yes".into()));
        // A thought the prompt closed again (thinking off): the answer.
        let closed = [Some(OPEN), Some(6), Some(CLOSE), None];
        assert_eq!(
            split(&mut s, &closed, &[(1, "a")]),
            (String::new(), "a".into())
        );
    }

    fn harmony(start: u32, channel: u32, message: u32, end: u32) -> Splitter {
        Splitter::new(Format::Harmony {
            start,
            channel,
            message,
            end,
        })
    }

    #[test]
    fn harmony_channels_split_analysis_from_final() {
        let (start, channel, message, end) = (10, 11, 12, 13);
        let mut s = harmony(start, channel, message, end);
        // The prompt ends with "<|start|>assistant"; the reply goes on.
        let reply = [
            (channel, "<|channel|>"),
            (1, "analysis"),
            (message, "<|message|>"),
            (2, "User wants "),
            (3, "a sum."),
            (end, "<|end|>"),
            (start, "<|start|>"),
            (4, "assistant"),
            (channel, "<|channel|>"),
            (5, "final"),
            (message, "<|message|>"),
            (6, "It is 4."),
        ];
        let prompt = [Some(start), Some(4)];
        assert_eq!(
            split(&mut s, &prompt, &reply),
            ("User wants a sum.".into(), "It is 4.".into())
        );
        // A commentary channel's preamble is part of the answer.
        let commentary = [
            (channel, "<|channel|>"),
            (7, "commentary"),
            (message, "<|message|>"),
            (8, "Checking."),
        ];
        assert_eq!(
            split(&mut s, &prompt, &commentary),
            (String::new(), "Checking.".into())
        );
        assert_eq!(s.recipient(), None);
    }

    #[test]
    fn harmony_messages_to_a_function_are_calls() {
        let (start, channel, message, end) = (10, 11, 12, 13);
        let mut s = harmony(start, channel, message, end);
        assert!(s.is_harmony());
        let prompt = [Some(start), Some(4)];
        // The recipient after the channel's name, a constraint after it.
        let after = [
            (channel, "<|channel|>"),
            (1, "commentary to=functions.get"),
            (2, "_weather <|constrain|>json"),
            (message, "<|message|>"),
            (3, "{\"city\": "),
            (4, "\"Paris\"}"),
        ];
        s.start(&prompt);
        let mut call = String::new();
        for &(t, text) in &after {
            if s.route(t, text) == Channel::Call {
                call.push_str(text);
            }
        }
        assert_eq!(
            (call.as_str(), s.recipient()),
            ("{\"city\": \"Paris\"}", Some("get_weather"))
        );
        // The recipient before `<|channel|>`, after thinking.
        let before = [
            (channel, "<|channel|>"),
            (1, "analysis"),
            (message, "<|message|>"),
            (2, "Look it up."),
            (end, "<|end|>"),
            (start, "<|start|>"),
            (3, "assistant to=functions.now"),
            (channel, "<|channel|>"),
            (4, "commentary json"),
            (message, "<|message|>"),
            (5, "{}"),
        ];
        s.start(&prompt);
        let routed: Vec<Channel> = before.iter().map(|&(t, x)| s.route(t, x)).collect();
        assert_eq!(routed[3], Channel::Reasoning);
        assert_eq!(routed[10], Channel::Call);
        assert_eq!(s.recipient(), Some("now"));
        // A new reply forgets it; a recipient that is not a function is none.
        s.start(&prompt);
        assert_eq!(s.recipient(), None);
        assert_eq!(recipient("to=browser.search"), None);
        assert_eq!(recipient("to=functions."), None);
        assert_eq!(
            recipient("x to=functions.a_b-c<|constrain|>"),
            Some("a_b-c".into())
        );
    }
}
