//! A conversation kept in one session (`les run --conversation`): each turn
//! evaluated after the replies so far gives, bit for bit, the logits a fresh
//! session gives for the whole token sequence (the KV cache, and qwen35moe's
//! recurrent state, carry over exactly), and the turns are the template's
//! rendering past what the session holds.

mod cli;
mod common;

use std::path::PathBuf;

use cli::synth_once;

use les::compute::ThreadedMatVec;
use les::engine::{generate_from, Control, Session};
use les::flash::FileDeviceConfig;
use les::model::Model;
use les::sampling::{Sampler, SamplerConfig};
use les::supply::{Schedule, SlotBudget, Supply};
use les::tokenizer::{ChatTemplate, Conversation, Tokenizer};
use les::vision::{self, EncodedImage, MultimodalPrompt, ProjectorType, MEDIA_MARKER};
use les_core::gemv::Isa;

fn synth(arch: &str) -> PathBuf {
    synth_once(
        &format!("conversation-{arch}.gguf"),
        &["--arch", arch, "--preset", "tiny", "--quiet"],
    )
}

/// Greedy tokens after `inputs` (up to `n`, stopping at an end-of-generation
/// token, returned apart) and the bits of the logits each was sampled from.
fn generate(
    session: &mut Session<'_>,
    supply: &mut Supply<'_>,
    tok: &Tokenizer,
    prompt: &MultimodalPrompt,
    n: usize,
) -> (Vec<u32>, Option<u32>, Vec<Vec<u32>>) {
    let inputs = prompt.inputs();
    let mut mv = ThreadedMatVec::new(2, Isa::detect());
    let mut sampler = Sampler::new(SamplerConfig::greedy());
    let (mut tokens, mut eog, mut logits) = (Vec::new(), None, Vec::new());
    generate_from(
        session,
        &mut mv,
        supply,
        None,
        &inputs,
        &prompt.places(),
        None,
        n,
        |l| sampler.sample(l),
        |t, l| {
            logits.push(l.iter().map(|v| v.to_bits()).collect());
            if tok.is_eog(t) {
                eog = Some(t);
                return Control::Stop;
            }
            tokens.push(t);
            Control::Continue
        },
    )
    .unwrap();
    (tokens, eog, logits)
}

fn resident<'m>(model: &'m Model, path: &std::path::Path) -> Supply<'m> {
    Supply::new(
        model,
        path,
        Schedule::Resident,
        SlotBudget::none(FileDeviceConfig::default()),
    )
    .unwrap()
}

/// An image of `n` embeddings for the gemma3 projector (its tokens are text,
/// so any model's vocabulary has them), each a different constant.
fn fake_image(n: usize, n_embd: usize) -> EncodedImage {
    EncodedImage {
        chunks: vec![(0..n * n_embd)
            .map(|i| ((i / n_embd) as f32 + 1.0) * 0.01)
            .collect()],
        grid: (0, 0),
        n_embd,
        chunk_grids: Vec::new(),
    }
}

/// Three turns (the second with an image), replies cut at 5 tokens (their
/// last token then waits for the next turn) or ended by the model: each
/// turn's logits equal a fresh session's over everything fed so far.
#[test]
fn each_turn_continues_the_session_exactly() {
    for arch in ["qwen3moe", "qwen35moe"] {
        let path = synth(arch);
        let model = Model::open(&path).unwrap();
        let n_embd = model.hp.n_embd;
        let n_vocab = model.hp.n_vocab as u32;
        let tok = Tokenizer::from_gguf(model.gguf()).unwrap();
        let mut supply = resident(&model, &path);
        let mut session = Session::new(&model, 512).unwrap();
        let mut conv = Conversation::new(&tok, tok.chat_template().unwrap(), None);
        // Everything fed and kept, as a fresh session would take it.
        let mut all = MultimodalPrompt::from_tokens(Vec::new(), n_embd);
        let messages = [
            ("Hello there".to_string(), 0),
            (format!("{MEDIA_MARKER}What is this?"), 3),
            ("And then?".to_string(), 0),
        ];
        for (turn_no, (message, image)) in messages.iter().enumerate() {
            let turn = conv.ask(message).unwrap();
            assert_eq!(turn.first, turn_no == 0);
            let images: Vec<_> = (*image > 0)
                .then(|| fake_image(*image, n_embd))
                .into_iter()
                .collect();
            let prompt =
                vision::build_turn(&tok, Some(ProjectorType::Gemma3), &turn, &images, n_embd)
                    .unwrap();
            assert_eq!(prompt.n_image_tokens(), *image, "{arch} turn {turn_no}");
            if turn_no == 0 {
                let text =
                    tok.chat_prompt_with(&tok.chat_template().unwrap(), conv.messages(), true);
                assert_eq!(
                    prompt.token_ids(n_vocab),
                    tok.encode(&text.unwrap(), true, true)
                );
            } else if *image == 0 {
                assert_eq!(prompt.token_ids(n_vocab), turn.tokens(&tok));
            }
            // Only the sequence's start has a BOS.
            let bos = tok.bos().filter(|_| tok.add_bos());
            let n_bos = prompt
                .token_ids(n_vocab)
                .iter()
                .filter(|&&t| Some(t) == bos)
                .count();
            assert_eq!(
                n_bos,
                usize::from(turn_no == 0 && bos.is_some()),
                "{arch} turn {turn_no}"
            );
            let held_before = conv.held().len();
            conv.fed(&prompt.token_ids(n_vocab));
            assert_eq!(conv.held().len(), held_before + prompt.len());
            all.append(&prompt);
            let (tokens, eog, logits) = generate(&mut session, &mut supply, &tok, &prompt, 5);
            let mut fresh = Session::new(&model, 512).unwrap();
            let (t2, e2, l2) = generate(&mut fresh, &mut supply, &tok, &all, 5);
            assert_eq!((&t2, e2), (&tokens, eog), "{arch} turn {turn_no}");
            assert!(l2 == logits, "{arch} turn {turn_no}: logits differ");
            let reply = tok.decode(&tokens);
            conv.replied(&tokens, &reply, eog);
            // What the session holds: the reply, less a cut reply's last token
            // (it leads the next turn).
            let kept = match eog {
                Some(_) => &tokens[..],
                None => &tokens[..tokens.len().saturating_sub(1)],
            };
            all.append(&MultimodalPrompt::from_tokens(kept.to_vec(), n_embd));
            assert_eq!(conv.held(), &all.token_ids(n_vocab)[..]);
            if eog.is_none() && turn_no + 1 < messages.len() {
                let mut probe = Conversation::new(&tok, tok.chat_template().unwrap(), None);
                probe.ask("x").unwrap();
                probe.replied(&tokens, &reply, None);
                assert_eq!(probe.ask("y").unwrap().lead.first(), tokens.last());
            }
        }
        assert_eq!(conv.messages().len(), 5);
    }
}

#[test]
fn a_template_that_rewrites_replies_gets_llama_cpps_turn() {
    let path = synth("qwen3moe");
    let model = Model::open(&path).unwrap();
    let tok = Tokenizer::from_gguf(model.gguf()).unwrap();
    // Past replies are rendered in brackets: never as generated.
    let source = "{% for m in messages %}<{{ m.role }}>\
                  {% if m.role == 'assistant' %}[{{ m.content }}]{% else %}{{ m.content }}{% endif %}\
                  </{{ m.role }}>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}";
    let template = ChatTemplate::new(source, "", "").unwrap();
    let mut conv = Conversation::new(&tok, template, None);
    let first = conv.ask("hi").unwrap();
    assert_eq!(first.text, "<user>hi</user><assistant>");
    conv.fed(&[1, 2]);
    let eog = tok.eos().unwrap();
    conv.replied(&[40, 41], "ab", Some(eog));
    let turn = conv.ask("more").unwrap();
    // The end-of-generation token, then what the new message adds to the
    // rendering of the conversation before it.
    assert_eq!(turn.lead, [eog]);
    assert_eq!(turn.text, "<user>more</user><assistant>");
    let mut want = vec![eog];
    want.extend(tok.encode("<user>more</user><assistant>", false, true));
    assert_eq!(turn.tokens(&tok), want);
    conv.fed(&want);
    assert_eq!(conv.held(), &[&[1, 2, 40, 41][..], &want].concat()[..]);
}

/// After `clear` the next message starts a sequence again, with the system
/// prompt, as the first message of a new conversation does.
#[test]
fn a_cleared_conversation_starts_over() {
    let path = synth("qwen3moe");
    let model = Model::open(&path).unwrap();
    let tok = Tokenizer::from_gguf(model.gguf()).unwrap();
    let system = Some("Be brief.");
    let mut conv = Conversation::new(&tok, tok.chat_template().unwrap(), system);
    let first = conv.ask("Hello").unwrap();
    assert!(first.first && first.lead.is_empty());
    assert!(first.text.contains("Be brief."), "{}", first.text);
    conv.fed(&first.tokens(&tok));
    conv.replied(&[40, 41], "ab", None);
    assert!(!conv.ask("Go on").unwrap().first);
    conv.clear();
    assert!(conv.held().is_empty() && conv.messages().is_empty());
    let again = conv.ask("Hi").unwrap();
    let mut fresh = Conversation::new(&tok, tok.chat_template().unwrap(), system);
    assert_eq!(again, fresh.ask("Hi").unwrap());
    assert_eq!(conv.messages(), fresh.messages());
}

/// With a model that adds BOS, only a turn that starts the sequence gets it,
/// image or not, and a turn's lead tokens come before its text.
#[test]
fn only_a_first_turn_gets_a_bos() {
    let src = synth("qwen3moe");
    let path = common::tmp("conversation-bos.gguf");
    common::rewrite_gguf(
        &src,
        &path,
        |k, v| {
            Some(if k == "tokenizer.ggml.add_bos_token" {
                true.into()
            } else {
                v
            })
        },
        vec![],
    );
    let model = Model::open(&path).unwrap();
    let tok = Tokenizer::from_gguf(model.gguf()).unwrap();
    let bos = tok.bos().unwrap();
    let (n_embd, n_vocab) = (model.hp.n_embd, model.hp.n_vocab as u32);
    let g3 = Some(ProjectorType::Gemma3);
    for images in [vec![], vec![fake_image(2, n_embd)]] {
        let markers = MEDIA_MARKER.repeat(images.len());
        let mut conv = Conversation::new(&tok, tok.chat_template().unwrap(), None);
        let first = conv.ask(&format!("{markers}Hi")).unwrap();
        let ids = vision::build_turn(&tok, g3, &first, &images, n_embd)
            .unwrap()
            .token_ids(n_vocab);
        assert_eq!(ids[0], bos);
        assert_eq!(ids.iter().filter(|&&t| t == bos).count(), 1);
        conv.fed(&ids);
        conv.replied(&[40, 41], "ab", None);
        let turn = conv.ask(&format!("{markers}More")).unwrap();
        let p = vision::build_turn(&tok, g3, &turn, &images, n_embd).unwrap();
        let ids = p.token_ids(n_vocab);
        assert!(!ids.contains(&bos), "{ids:?}");
        assert_eq!(ids[0], 41, "the cut reply's last token leads");
        assert_eq!(p.n_image_tokens(), 2 * images.len());
    }
    // Images without a projector are an error, not dropped.
    let mut conv = Conversation::new(&tok, tok.chat_template().unwrap(), None);
    let turn = conv.ask(MEDIA_MARKER).unwrap();
    let e = vision::build_turn(&tok, None, &turn, &[fake_image(1, n_embd)], n_embd).unwrap_err();
    assert!(e.to_string().contains("projector"), "{e}");
}
