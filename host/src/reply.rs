//! A reply as it is generated, for `les run` and `les serve`: its tokens and
//! text, cut at an end-of-generation token or a stop string, streamed as it
//! comes less what may still turn out to be the start of a stop string.

use std::io::Write;

use crate::engine::Control;
use crate::tokenizer::Tokenizer;

/// A reply as it is generated: its tokens and text up to an
/// end-of-generation token (kept apart) or a stop string (`--stop`: the text
/// from it on kept apart), each token's text streamed to an output as it
/// comes, less what may be the start of a stop string.
pub struct Reply<'t> {
    tokenizer: &'t Tokenizer,
    decoder: crate::tokenizer::StreamDecoder<'t>,
    /// The reply's tokens (not the end-of-generation one).
    pub tokens: Vec<u32>,
    /// Their text, cut where a stop string starts.
    pub text: String,
    /// The end-of-generation token that ended the reply, if one did.
    pub eog: Option<u32>,
    stops: Vec<String>,
    /// Bytes of `text` written to the output (or, without one, passed).
    written: usize,
    /// The stop string that ended the reply (its index in `stops`), and the
    /// text cut from it on.
    pub stopped: Option<(usize, String)>,
    /// The first error writing the reply (or anything else the caller
    /// stopped generating for), returned by [`finish`](Self::finish).
    pub write_err: Option<std::io::Error>,
}

impl<'t> Reply<'t> {
    /// A reply of `tokenizer`'s tokens that ends at any of `stops`.
    pub fn new(tokenizer: &'t Tokenizer, stops: &[String]) -> Self {
        Reply {
            tokenizer,
            decoder: tokenizer.stream_decoder(false),
            tokens: Vec::new(),
            text: String::new(),
            eog: None,
            stops: stops.to_vec(),
            written: 0,
            stopped: None,
            write_err: None,
        }
    }

    /// Writes out the text of `ids` even where they are control tokens (a
    /// tool-call format's markers, which the reply's text must keep).
    pub fn show(&mut self, ids: impl IntoIterator<Item = u32>) {
        self.decoder.show(ids);
    }

    /// Takes the sampled token `t`, writing its text to `out` if given; stops
    /// at an end-of-generation token, a stop string or a write error.
    pub fn take(&mut self, t: u32, out: Option<&mut dyn Write>) -> Control {
        if self.tokenizer.is_eog(t) {
            self.eog = Some(t);
            return Control::Stop;
        }
        self.tokens.push(t);
        let piece = self.decoder.decode_piece(t);
        let from = self.text.len();
        self.text.push_str(&piece);
        let stopped = self.cut_at_stop(from);
        let end = if stopped {
            self.text.len()
        } else {
            self.text.len() - held_back(&self.text, &self.stops)
        };
        if let (Some(out), true) = (out, end > self.written) {
            let new = &self.text.as_bytes()[self.written..end];
            if let Err(e) = out.write_all(new).and_then(|()| out.flush()) {
                self.write_err = Some(e);
                return Control::Stop;
            }
        }
        self.written = self.written.max(end);
        if stopped {
            Control::Stop
        } else {
            Control::Continue
        }
    }

    /// Where a stop string ends in `text` past byte `from` (text before it
    /// was searched already), cuts `text` where the earliest such one starts.
    fn cut_at_stop(&mut self, from: usize) -> bool {
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        let mut start = from.saturating_sub(longest.saturating_sub(1));
        while !self.text.is_char_boundary(start) {
            start -= 1;
        }
        let found = self
            .stops
            .iter()
            .enumerate()
            .filter_map(|(i, stop)| {
                self.text[start..]
                    .find(stop.as_str())
                    .map(|at| (start + at, i))
            })
            .min();
        match found {
            Some((at, i)) => {
                let cut = self.text.split_off(at);
                self.stopped = Some((i, cut));
                true
            }
            None => false,
        }
    }

    /// Bytes of [`text`](Self::text) passed on so far (written to the
    /// output, or passed without one): what may still turn out to be the
    /// start of a stop string is not.
    pub fn written(&self) -> usize {
        self.written
    }

    /// The text not yet written (what the decoder still held, and what was
    /// held back as the possible start of a stop string; the caller writes
    /// it), or the error that stopped the reply.
    pub fn finish(&mut self) -> Result<String, std::io::Error> {
        if let Some(e) = self.write_err.take() {
            return Err(e);
        }
        let tail = self.decoder.finish();
        let from = self.text.len();
        self.text.push_str(&tail);
        if self.stopped.is_none() {
            self.cut_at_stop(from);
        }
        let rest = self.text[self.written.min(self.text.len())..].to_string();
        self.written = self.text.len();
        Ok(rest)
    }
}

/// How many bytes at the end of `text` are the start of some stop string
/// (held back from the output until the next token tells).
fn held_back(text: &str, stops: &[String]) -> usize {
    stops
        .iter()
        .flat_map(|stop| {
            (1..stop.len())
                .filter(|&k| stop.is_char_boundary(k) && text.ends_with(&stop[..k]))
                .max()
        })
        .max()
        .unwrap_or(0)
}
