//! Splicing image embeddings into a prompt, with the special tokens each model
//! expects around them (llama.cpp's `mtmd_tokenize`).
//!
//! The prompt text carries one [`MEDIA_MARKER`] per image. The text between
//! markers is tokenized piece by piece (special tokens parsed), the language
//! model's BOS (if it adds one) goes first, and each marker becomes:
//!
//! - MiniCPM-V 4.6 (llama.cpp's MiniCPM-V 2.6 slice template):
//!   `<image>` overview `</image>`, then for each row of slices
//!   `<slice>` slice `</slice>` ... with a `\n` token between rows (none after
//!   the last);
//! - Gemma 3: `<start_of_image>` embeddings `<end_of_image>`;
//! - Qwen3-VL: `<|vision_start|>` embeddings `<|vision_end|>`;
//! - Kimi-VL: `<|media_start|>` embeddings `<|media_end|>`;
//! - Kimi K2.5: `<|media_begin|>` embeddings `<|media_end|>`, or GLM-5.2-V's
//!   `<|begin_of_image|>` embeddings `<|end_of_image|>` where the vocabulary
//!   has those (llama.cpp decides so);
//! - Llama 4: `<|image_start|>`, each tile row by row, the overview,
//!   `<|image_end|>` (llama.cpp's template, without separators);
//! - GLM-4.xV: `<|begin_of_image|>` embeddings `<|end_of_image|>`;
//! - InternVL: `<img>`, each tile row by row, the overview, `</img>`.
//!
//! [`MultimodalPrompt::places`] says where each position sits for language
//! models with M-RoPE sections ([`InputPlace`]).

use les_core::model::forward::TokenInput;

use crate::engine::InputPlace;

use super::clip::ProjectorType;
use super::{ImageLayout, VisionError};
use crate::tokenizer::{Tokenizer, Turn};

/// The text that stands for an image in a prompt (llama.cpp's
/// `mtmd_default_marker()`).
pub const MEDIA_MARKER: &str = "<__media__>";

/// The encoded chunks of one image.
#[derive(Clone, Debug, PartialEq)]
pub struct EncodedImage {
    /// The overview's embeddings first, then each slice's, row by row; each
    /// `tokens * n_embd` values.
    pub chunks: Vec<Vec<f32>>,
    /// Slices per row and rows of slices (`(0, 0)` without slices).
    pub grid: (usize, usize),
    /// Width of one embedding.
    pub n_embd: usize,
    /// Each chunk's embeddings as a grid, per row and rows (llama.cpp's
    /// `clip_n_output_tokens_x` / `_y`: Qwen3-VL's merged patches, Gemma
    /// 3's as one row), where M-RoPE places them as a grid
    /// ([`InputPlace::Image`]); empty where llama.cpp places them in
    /// sequence ([`InputPlace::Sequence`]: MiniCPM-V's overview and slices).
    pub chunk_grids: Vec<(usize, usize)>,
}

impl EncodedImage {
    /// Embeddings in all chunks.
    pub fn n_tokens(&self) -> usize {
        self.chunks.iter().map(|c| c.len() / self.n_embd).sum()
    }

    /// Chunk `c`'s grid, where it is placed as one and the grid holds it.
    pub fn chunk_grid(&self, c: usize) -> Option<(usize, usize)> {
        let n = self
            .chunks
            .get(c)
            .map_or(0, |x| x.len() / self.n_embd.max(1));
        self.chunk_grids
            .get(c)
            .copied()
            .filter(|&(nx, ny)| nx.checked_mul(ny) == Some(n))
    }
}

/// An image chunk placed as a grid in a prompt: its first row in
/// [`MultimodalPrompt::embeddings`], and its grid.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkGrid {
    /// First embedding row.
    pub first: usize,
    /// Embeddings per row.
    pub nx: usize,
    /// Rows.
    pub ny: usize,
}

/// One prompt position.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PromptItem {
    /// A token id.
    Token(u32),
    /// An image embedding: its index in [`MultimodalPrompt::embeddings`] rows.
    Embedding(usize),
}

/// A prompt of tokens and image embeddings.
#[derive(Clone, Debug, Default)]
pub struct MultimodalPrompt {
    /// The positions in order.
    pub items: Vec<PromptItem>,
    /// Image embeddings, `n_embd` values per row.
    pub embeddings: Vec<f32>,
    /// Width of one embedding.
    pub n_embd: usize,
    /// The image chunks' grids, in row order.
    pub grids: Vec<ChunkGrid>,
}

impl MultimodalPrompt {
    /// A prompt of tokens only.
    pub fn from_tokens(tokens: Vec<u32>, n_embd: usize) -> Self {
        MultimodalPrompt {
            items: tokens.into_iter().map(PromptItem::Token).collect(),
            embeddings: Vec::new(),
            n_embd,
            grids: Vec::new(),
        }
    }

    /// Appends `other`'s positions (of embeddings as wide) after these.
    pub fn append(&mut self, other: &MultimodalPrompt) {
        let base = self.embeddings.len() / self.n_embd.max(1);
        self.embeddings.extend_from_slice(&other.embeddings);
        self.items.extend(other.items.iter().map(|i| match *i {
            PromptItem::Embedding(r) => PromptItem::Embedding(base + r),
            t => t,
        }));
        self.grids.extend(other.grids.iter().map(|g| ChunkGrid {
            first: base + g.first,
            ..*g
        }));
    }

    /// Where each position sits ([`InputPlace`]): text, an embedding of its
    /// image chunk's grid, or (a chunk without one) in sequence.
    pub fn places(&self) -> Vec<InputPlace> {
        self.items
            .iter()
            .map(|&i| match i {
                PromptItem::Token(_) => InputPlace::Text,
                PromptItem::Embedding(r) => {
                    // The last chunk starting at or before row `r`.
                    let at = self.grids.partition_point(|g| g.first <= r);
                    match at.checked_sub(1).map(|c| self.grids[c]) {
                        Some(g) if r - g.first < g.nx * g.ny => InputPlace::Image {
                            k: (r - g.first) as u32,
                            nx: g.nx as u32,
                            ny: g.ny as u32,
                        },
                        _ => InputPlace::Sequence,
                    }
                }
            })
            .collect()
    }

    /// Its token ids, `image_id` at each image position (a drafter's history,
    /// where `n_vocab` stands for an embedding).
    pub fn token_ids(&self, image_id: u32) -> Vec<u32> {
        self.items
            .iter()
            .map(|i| match *i {
                PromptItem::Token(t) => t,
                PromptItem::Embedding(_) => image_id,
            })
            .collect()
    }

    /// Its tokens, `None` at each image position.
    pub fn tokens(&self) -> Vec<Option<u32>> {
        self.items
            .iter()
            .map(|i| match *i {
                PromptItem::Token(t) => Some(t),
                PromptItem::Embedding(_) => None,
            })
            .collect()
    }

    /// Positions.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Whether the prompt is empty.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Positions that are image embeddings.
    pub fn n_image_tokens(&self) -> usize {
        self.items
            .iter()
            .filter(|i| matches!(i, PromptItem::Embedding(_)))
            .count()
    }

    /// The forward pass's input for each position.
    pub fn inputs(&self) -> Vec<TokenInput<'_>> {
        self.items
            .iter()
            .map(|&i| match i {
                PromptItem::Token(t) => TokenInput::Token(t),
                PromptItem::Embedding(r) => {
                    TokenInput::Embedding(&self.embeddings[r * self.n_embd..(r + 1) * self.n_embd])
                }
            })
            .collect()
    }

    fn push_tokens(&mut self, ids: impl IntoIterator<Item = u32>) {
        self.items.extend(ids.into_iter().map(PromptItem::Token));
    }

    fn push_chunk(&mut self, chunk: &[f32], grid: Option<(usize, usize)>) {
        let first = self.embeddings.len() / self.n_embd.max(1);
        let n = chunk.len() / self.n_embd.max(1);
        if let Some((nx, ny)) = grid {
            self.grids.push(ChunkGrid { first, nx, ny });
        }
        self.embeddings.extend_from_slice(chunk);
        self.items
            .extend((first..first + n).map(PromptItem::Embedding));
    }
}

/// The id of the first token whose text (special tokens written out) is `text`,
/// as llama.cpp's `lookup_token` finds it.
pub fn lookup_token(tok: &Tokenizer, text: &str) -> Option<u32> {
    if let Some(id) = tok.token_id(text) {
        if tok.piece(id, true) == text.as_bytes() {
            return Some(id);
        }
    }
    (0..tok.n_vocab() as u32).find(|&id| tok.piece(id, true) == text.as_bytes())
}

fn require_token(tok: &Tokenizer, text: &str) -> Result<u32, VisionError> {
    lookup_token(tok, text).ok_or_else(|| {
        VisionError::Prompt(format!(
            "the language model's vocabulary has no {text:?} token, which this projector needs"
        ))
    })
}

/// One image as a prompt lays it out: an [`EncodedImage`], or an
/// [`ImageLayout`] before encoding.
trait ImageChunks {
    /// Slices per row and rows of slices (`(0, 0)` without slices).
    fn grid(&self) -> (usize, usize);
    /// Overview and slices.
    fn n_chunks(&self) -> usize;
}

impl ImageChunks for EncodedImage {
    fn grid(&self) -> (usize, usize) {
        self.grid
    }
    fn n_chunks(&self) -> usize {
        self.chunks.len()
    }
}

impl ImageChunks for ImageLayout {
    fn grid(&self) -> (usize, usize) {
        self.grid
    }
    fn n_chunks(&self) -> usize {
        self.chunk_tokens.len()
    }
}

/// A run of a prompt's positions, in order.
enum Piece<'a, I> {
    Tokens(&'a [u32]),
    /// Chunk `1` of image `0` (0 is the overview).
    Chunk(&'a I, usize),
}

/// Walks the prompt of `text` and `images` in order, handing each run of
/// tokens and each image chunk to `sink`: the one layout [`build_prompt`] and
/// [`prompt_positions`] share.
fn lay_out<I: ImageChunks>(
    tok: &Tokenizer,
    projector: ProjectorType,
    text: &str,
    add_special: bool,
    images: &[I],
    sink: &mut dyn FnMut(Piece<'_, I>),
) -> Result<(), VisionError> {
    let parts: Vec<&str> = text.split(MEDIA_MARKER).collect();
    if parts.len() - 1 != images.len() {
        return Err(VisionError::Prompt(format!(
            "the prompt has {} image marker(s) {MEDIA_MARKER} for {} image(s)",
            parts.len() - 1,
            images.len()
        )));
    }
    if let Some(img) = images.iter().find(|i| {
        let (cols, rows) = i.grid();
        i.n_chunks() != cols.saturating_mul(rows).saturating_add(1)
    }) {
        return Err(VisionError::Prompt(format!(
            "an image of {} chunks does not fill its grid of {:?} slices",
            img.n_chunks(),
            img.grid()
        )));
    }
    if let Some(bos) = tok.bos().filter(|_| add_special && tok.add_bos()) {
        sink(Piece::Tokens(&[bos]));
    }
    // MiniCPM-V's overview and slices in their tokens, or the others'
    // chunks between a start and an end text (llama.cpp's `img_beg` /
    // `img_end`).
    let minicpm = match projector {
        ProjectorType::MiniCpmV46 => Some((
            require_token(tok, "<image>")?,
            require_token(tok, "</image>")?,
            require_token(tok, "<slice>")?,
            require_token(tok, "</slice>")?,
            require_token(tok, "\n")?,
        )),
        ProjectorType::Gemma3
        | ProjectorType::Qwen3Vl
        | ProjectorType::KimiVl
        | ProjectorType::KimiK25
        | ProjectorType::Llama4
        | ProjectorType::Glm4v
        | ProjectorType::InternVl
        | ProjectorType::Lfm2 => None,
    };
    let (begin, end) = match projector {
        ProjectorType::Qwen3Vl => ("<|vision_start|>", "<|vision_end|>"),
        ProjectorType::KimiVl => ("<|media_start|>", "<|media_end|>"),
        ProjectorType::KimiK25 if lookup_token(tok, "<|begin_of_image|>").is_some() => {
            ("<|begin_of_image|>", "<|end_of_image|>")
        }
        ProjectorType::KimiK25 => ("<|media_begin|>", "<|media_end|>"),
        ProjectorType::Llama4 => ("<|image_start|>", "<|image_end|>"),
        ProjectorType::Glm4v => ("<|begin_of_image|>", "<|end_of_image|>"),
        ProjectorType::InternVl => ("<img>", "</img>"),
        ProjectorType::Lfm2 => ("<|image_start|>", "<|image_end|>"),
        _ => ("<start_of_image>", "<end_of_image>"),
    };
    for (i, part) in parts.iter().enumerate() {
        if !part.is_empty() {
            sink(Piece::Tokens(&tok.encode(part, false, true)));
        }
        let Some(img) = images.get(i) else { break };
        match minicpm {
            Some((im, im_end, sl, sl_end, row_end)) => {
                sink(Piece::Tokens(&[im]));
                sink(Piece::Chunk(img, 0));
                sink(Piece::Tokens(&[im_end]));
                let (cols, rows) = img.grid();
                for y in 0..rows {
                    for x in 0..cols {
                        sink(Piece::Tokens(&[sl]));
                        sink(Piece::Chunk(img, 1 + y * cols + x));
                        sink(Piece::Tokens(&[sl_end]));
                    }
                    if y + 1 != rows {
                        sink(Piece::Tokens(&[row_end]));
                    }
                }
            }
            None => {
                sink(Piece::Tokens(&tok.encode(begin, false, true)));
                if projector == ProjectorType::Lfm2 && img.n_chunks() > 1 {
                    // LFM2's tiles, each after its `<|img_row_R_col_C|>`,
                    // then `<|img_thumbnail|>` and the overview (chunk 0);
                    // an untiled image is its overview alone.
                    let (cols, rows) = img.grid();
                    for y in 0..rows {
                        for x in 0..cols {
                            let marker = format!("<|img_row_{}_col_{}|>", y + 1, x + 1);
                            sink(Piece::Tokens(&tok.encode(&marker, false, true)));
                            sink(Piece::Chunk(img, 1 + y * cols + x));
                        }
                    }
                    sink(Piece::Tokens(&tok.encode("<|img_thumbnail|>", false, true)));
                    sink(Piece::Chunk(img, 0));
                    sink(Piece::Tokens(&tok.encode(end, false, true)));
                    continue;
                }
                // Llama 4's and InternVL's overview (chunk 0) goes after
                // their tiles.
                let n = img.n_chunks();
                let order: Vec<usize> =
                    if matches!(projector, ProjectorType::Llama4 | ProjectorType::InternVl) {
                        (1..n).chain(0..n.min(1)).collect()
                    } else {
                        (0..n).collect()
                    };
                for c in order {
                    sink(Piece::Chunk(img, c));
                }
                sink(Piece::Tokens(&tok.encode(end, false, true)));
            }
        }
    }
    if let Some(eos) = tok.eos().filter(|_| add_special && tok.add_eos()) {
        sink(Piece::Tokens(&[eos]));
    }
    Ok(())
}

/// Builds the prompt from `text` (already chat-templated, holding one
/// [`MEDIA_MARKER`] per image) and the encoded `images`, in order. With
/// `add_special`, BOS and EOS are added as the model's flags say (a sequence's
/// start; not for a turn that continues one).
pub fn build_prompt(
    tok: &Tokenizer,
    projector: ProjectorType,
    text: &str,
    add_special: bool,
    images: &[EncodedImage],
    n_embd: usize,
) -> Result<MultimodalPrompt, VisionError> {
    if let Some(img) = images.iter().find(|i| i.n_embd != n_embd) {
        return Err(VisionError::Prompt(format!(
            "the projector's embeddings are {} wide, the language model's {n_embd}",
            img.n_embd
        )));
    }
    let mut p = MultimodalPrompt {
        n_embd,
        ..MultimodalPrompt::default()
    };
    lay_out(
        tok,
        projector,
        text,
        add_special,
        images,
        &mut |piece| match piece {
            Piece::Tokens(t) => p.push_tokens(t.iter().copied()),
            Piece::Chunk(img, c) => p.push_chunk(&img.chunks[c], img.chunk_grid(c)),
        },
    )?;
    Ok(p)
}

/// The prompt of a conversation's `turn`: its lead tokens, then its text
/// with `images` (through `projector`) where the text holds markers. BOS and
/// EOS are added only to a turn that starts the sequence. Without images the
/// text is tokenized as it is.
pub fn build_turn(
    tok: &Tokenizer,
    projector: Option<ProjectorType>,
    turn: &Turn,
    images: &[EncodedImage],
    n_embd: usize,
) -> Result<MultimodalPrompt, VisionError> {
    let mut p = match (projector, images) {
        (_, []) => MultimodalPrompt::from_tokens(tok.encode(&turn.text, turn.first, true), n_embd),
        (Some(projector), _) => {
            build_prompt(tok, projector, &turn.text, turn.first, images, n_embd)?
        }
        (None, _) => return Err(VisionError::Prompt("images need a vision projector".into())),
    };
    p.items
        .splice(0..0, turn.lead.iter().map(|&t| PromptItem::Token(t)));
    Ok(p)
}

/// The positions [`build_prompt`] will make of `text` and images of these
/// layouts: the prompt's length before any image is encoded.
pub fn prompt_positions(
    tok: &Tokenizer,
    projector: ProjectorType,
    text: &str,
    add_special: bool,
    images: &[ImageLayout],
) -> Result<usize, VisionError> {
    let mut n = 0usize;
    lay_out(tok, projector, text, add_special, images, &mut |piece| {
        n = n.saturating_add(match piece {
            Piece::Tokens(t) => t.len(),
            Piece::Chunk(img, c) => img.chunk_tokens[c],
        })
    })?;
    Ok(n)
}

/// Puts one [`MEDIA_MARKER`] per image before `prompt` unless it already has
/// markers (then they say where the images go).
pub fn place_markers(prompt: &str, n_images: usize) -> String {
    if n_images == 0 || prompt.contains(MEDIA_MARKER) {
        prompt.to_string()
    } else {
        MEDIA_MARKER.repeat(n_images) + prompt
    }
}
