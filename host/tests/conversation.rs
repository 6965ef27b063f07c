//! A conversation kept in one session (`les run --conversation`): each turn
//! evaluated after the replies so far gives, bit for bit, the logits a fresh
//! session gives for the whole token sequence (the KV cache, and qwen35moe's
//! recurrent state, carry over exactly), and the turns are the template's
//! rendering past what the session holds.

mod cli;

use std::path::PathBuf;

use cli::synth_once;

use les::compute::ThreadedMatVec;
use les::engine::{generate_from, Control, Session};
use les::flash::FileDeviceConfig;
use les::model::Model;
use les::sampling::{Sampler, SamplerConfig};
use les::supply::{Schedule, SlotBudget, Supply};
use les::tokenizer::{ChatTemplate, Conversation, Tokenizer};
use les_core::gemv::Isa;
use les_core::model::forward::TokenInput;

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
    inputs: &[u32],
    n: usize,
) -> (Vec<u32>, Option<u32>, Vec<Vec<u32>>) {
    let mut mv = ThreadedMatVec::new(2, Isa::detect());
    let inputs: Vec<TokenInput<'_>> = inputs.iter().map(|&t| TokenInput::Token(t)).collect();
    let mut sampler = Sampler::new(SamplerConfig::greedy());
    let (mut tokens, mut eog, mut logits) = (Vec::new(), None, Vec::new());
    generate_from(
        session,
        &mut mv,
        supply,
        None,
        &inputs,
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

#[test]
fn each_turn_continues_the_session_exactly() {
    for arch in ["qwen3moe", "qwen35moe"] {
        let path = synth(arch);
        let model = Model::open(&path).unwrap();
        let tok = Tokenizer::from_gguf(model.gguf()).unwrap();
        let template = tok.chat_template().unwrap();
        let messages = vec![("user".to_string(), "Hello there".to_string())];
        let text = tok.chat_prompt_with(&template, &messages, true).unwrap();
        let prompt = tok.encode(&text, true, true);
        let mut supply = Supply::new(
            &model,
            &path,
            Schedule::Resident,
            SlotBudget::none(FileDeviceConfig::default()),
        )
        .unwrap();
        let mut session = Session::new(&model, 512).unwrap();
        let mut conv = Conversation::new(&tok, template, messages, text, prompt.clone());
        let mut inputs = prompt;
        // Three turns, replies cut at 5 tokens (their last token then waits
        // for the next turn) or ended by the model.
        for (turn, message) in ["", "Tell me more", "And then?"].iter().enumerate() {
            if turn > 0 {
                let held_before = conv.held().len();
                inputs = conv.ask(message).unwrap();
                assert_eq!(conv.held().len(), held_before + inputs.len());
            }
            let (tokens, eog, logits) = generate(&mut session, &mut supply, &tok, &inputs, 5);
            // A fresh session over everything held gives the same logits.
            let mut fresh = Session::new(&model, 512).unwrap();
            let (t2, e2, l2) = generate(&mut fresh, &mut supply, &tok, conv.held(), 5);
            assert_eq!((&t2, e2), (&tokens, eog), "{arch} turn {turn}");
            assert!(l2 == logits, "{arch} turn {turn}: logits differ");
            let reply = tok.decode(&tokens);
            conv.replied(&tokens, &reply, eog);
            if eog.is_none() {
                let feed_next = {
                    let mut probe = Conversation::new(
                        &tok,
                        tok.chat_template().unwrap(),
                        conv.messages().to_vec(),
                        String::new(),
                        Vec::new(),
                    );
                    probe.replied(&tokens, &reply, None);
                    probe.ask("x").unwrap()
                };
                // A cut reply's last token leads the next turn.
                assert_eq!(feed_next.first(), tokens.last(), "{arch} turn {turn}");
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
    let messages = vec![("user".to_string(), "hi".to_string())];
    let text = tok.chat_prompt_with(&template, &messages, true).unwrap();
    assert_eq!(text, "<user>hi</user><assistant>");
    let mut conv = Conversation::new(&tok, template, messages, text, vec![1, 2]);
    let eog = tok.eos().unwrap();
    conv.replied(&[40, 41], "ab", Some(eog));
    let feed = conv.ask("more").unwrap();
    // The end-of-generation token, then what the new message adds to the
    // rendering of the conversation before it.
    let mut want = vec![eog];
    want.extend(tok.encode("<user>more</user><assistant>", false, true));
    assert_eq!(feed, want);
    assert_eq!(conv.held(), &[&[1, 2, 40, 41][..], &want].concat()[..]);
}
