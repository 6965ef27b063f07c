//! LES against llama.cpp's own test data, kept in `tests/data/llama.cpp` (see
//! its README): the tokenizer on the vocabularies and inputs of llama.cpp's
//! `test-tokenizer-0` (every id must match), and real models' chat templates
//! from its `models/templates`.

mod common;

use std::io::Read;
use std::path::{Path, PathBuf};

use common::{rewrite_gguf, tmp};
use les::gguf::Gguf;
use les::tokenizer::{ChatTemplate, Tokenizer};

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/llama.cpp")
        .join(name)
}

/// `ggml-vocab-{name}.gguf`, decompressed into the scratch directory.
fn vocab(name: &str) -> PathBuf {
    let gz = data(&format!("ggml-vocab-{name}.gguf.gz"));
    let mut bytes = Vec::new();
    flate2::read::GzDecoder::new(std::fs::File::open(&gz).unwrap())
        .read_to_end(&mut bytes)
        .unwrap();
    let path = tmp(&format!("ggml-vocab-{name}.gguf"));
    std::fs::write(&path, bytes).unwrap();
    path
}

/// The (input, ids) pairs of `test-tokenizer-0` for `name`: inputs split as
/// llama.cpp splits them, outputs one line each.
fn vectors(inp: &str, out: &str) -> Vec<(String, Vec<u32>)> {
    let inp = std::fs::read_to_string(data(inp)).unwrap();
    let out = std::fs::read_to_string(data(out)).unwrap();
    // llama.cpp's reader: pieces between separators, none after a final one.
    let sep = "\n__ggml_vocab_test__\n";
    let mut inputs = Vec::new();
    let mut rest = inp.as_str();
    while !rest.is_empty() {
        match rest.find(sep) {
            Some(i) => {
                inputs.push(rest[..i].to_string());
                rest = &rest[i + sep.len()..];
            }
            None => {
                inputs.push(rest.to_string());
                rest = "";
            }
        }
    }
    let outputs: Vec<Vec<u32>> = out
        .lines()
        .map(|l| l.split_whitespace().map(|t| t.parse().unwrap()).collect())
        .collect();
    assert_eq!(inputs.len(), outputs.len(), "{inp:?}");
    assert!(inputs.len() >= 40);
    inputs.into_iter().zip(outputs).collect()
}

/// Tokenizes every input as `test-tokenizer-0` does (no BOS/EOS, special
/// tokens not parsed) and compares with llama.cpp's ids; byte-level BPE
/// vocabularies must also decode back to the input.
fn check(gguf: &Path, pre: &str, inp: &str, out: &str, byte_level: bool) {
    let g = Gguf::open(gguf).unwrap();
    assert_eq!(g.get_str("tokenizer.ggml.pre").unwrap_or("default"), pre);
    let tok = Tokenizer::from_gguf(&g).unwrap();
    let mut wrong = Vec::new();
    for (text, want) in vectors(inp, out) {
        let got = tok.encode(&text, false, false);
        if got != want {
            wrong.push(format!("{text:?}: llama.cpp {want:?}, les {got:?}"));
        } else if byte_level {
            assert_eq!(tok.decode(&got), text, "{pre}: round trip");
        }
    }
    assert!(
        wrong.is_empty(),
        "{pre}: {} differ:\n{}",
        wrong.len(),
        wrong.join("\n")
    );
}

/// DeepSeek-V2's vocabulary and its six literal-range regexes.
#[test]
fn deepseek_llm_tokenizes_as_llama_cpp() {
    check(
        &vocab("deepseek-llm"),
        "deepseek-llm",
        "ggml-vocab-deepseek-llm.gguf.inp",
        "ggml-vocab-deepseek-llm.gguf.out",
        true,
    );
}

#[test]
fn qwen35_tokenizes_as_llama_cpp() {
    // MiniCPM-V 4.7's language model (Qwen3.5) and its pre-tokenizer.
    check(
        &vocab("qwen35"),
        "qwen35",
        "ggml-vocab-qwen35.gguf.inp",
        "ggml-vocab-qwen35.gguf.out",
        true,
    );
}

#[test]
fn qwen2_tokenizes_as_llama_cpp() {
    // llama.cpp's qwen2 vocabulary is the qwen35 one with the other
    // pre-tokenizer (Qwen2, Qwen3 and Qwen3-MoE models).
    let qwen2 = tmp("ggml-vocab-qwen2.gguf");
    rewrite_gguf(
        &vocab("qwen35"),
        &qwen2,
        |k, v| {
            Some(if k == "tokenizer.ggml.pre" {
                "qwen2".into()
            } else {
                v
            })
        },
        vec![],
    );
    check(
        &qwen2,
        "qwen2",
        "ggml-vocab-gpt-2.gguf.inp",
        "ggml-vocab-qwen2.gguf.out",
        true,
    );
}

#[test]
fn gpt2_and_llama3_tokenize_as_llama_cpp() {
    check(
        &vocab("gpt-2"),
        "gpt-2",
        "ggml-vocab-gpt-2.gguf.inp",
        "ggml-vocab-gpt-2.gguf.out",
        true,
    );
    check(
        &vocab("llama-bpe"),
        "llama-bpe",
        "ggml-vocab-llama-bpe.gguf.inp",
        "ggml-vocab-llama-bpe.gguf.out",
        true,
    );
}

#[test]
fn sentencepiece_vocabularies_tokenize_as_llama_cpp() {
    // Llama 2 / Mixtral and Phi-3.
    for name in ["llama-spm", "phi-3"] {
        let g = vocab(name);
        let inp = format!("ggml-vocab-{name}.gguf.inp");
        let out = format!("ggml-vocab-{name}.gguf.out");
        check(&g, "default", &inp, &out, false);
    }
}

/// Every real template in the data renders a conversation with all its
/// messages; the Qwen3.5, Gemma 2, MiniCPM and GLM ones exactly as Hugging
/// Face renders them.
#[test]
fn real_chat_templates_render() {
    let conversation = [
        ("system", "You are helpful."),
        ("user", "Hello"),
        ("assistant", "Hi there"),
        ("user", "How are you?"),
    ];
    let mut seen = 0;
    for entry in std::fs::read_dir(data("templates")).unwrap() {
        let path = entry.unwrap().path();
        let src = std::fs::read_to_string(&path).unwrap();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let t = ChatTemplate::new(&src, "<s>", "</s>").unwrap_or_else(|e| panic!("{name}: {e}"));
        // Gemma 2 refuses a system message; it then goes into the first user
        // message, as `les run --system-prompt` and llama.cpp do.
        let folded;
        let messages: &[(&str, &str)] = if t.supports_system_role() {
            &conversation
        } else {
            assert_eq!(name, "google-gemma-2-2b-it.jinja");
            folded = [
                ("user", "You are helpful.\nHello"),
                conversation[2],
                conversation[3],
            ];
            &folded
        };
        let text = t
            .apply(messages, true)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        // (Some move the system message: Mistral's into the last user turn.)
        for (_, content) in conversation {
            assert!(
                text.contains(content),
                "{name}: {content:?} missing: {text}"
            );
        }
        let want = match name.as_str() {
            "Qwen3.5-4B.jinja" => Some(
                "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n\
                 <|im_start|>assistant\nHi there<|im_end|>\n<|im_start|>user\nHow are you?<|im_end|>\n\
                 <|im_start|>assistant\n<think>\n",
            ),
            "google-gemma-2-2b-it.jinja" => Some(
                "<s><start_of_turn>user\nYou are helpful.\nHello<end_of_turn>\n\
                 <start_of_turn>model\nHi there<end_of_turn>\n\
                 <start_of_turn>user\nHow are you?<end_of_turn>\n<start_of_turn>model\n",
            ),
            // GLM-4.5 / 4.6 (glm4moe), as jinja2 renders it for Hugging Face.
            "GLM-4.6.jinja" => Some(
                "[gMASK]<sop><|system|>\nYou are helpful.<|user|>\nHello<|assistant|>\n\
                 <think></think>\nHi there<|user|>\nHow are you?<|assistant|>",
            ),
            "openbmb-MiniCPM5-1B.jinja" => Some(
                "<s><|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n\
                 <|im_start|>assistant\nHi there<|im_end|>\n<|im_start|>user\nHow are you?<|im_end|>\n\
                 <|im_start|>assistant\n",
            ),
            _ => None,
        };
        if let Some(want) = want {
            assert_eq!(text, want, "{name}");
        }
        seen += 1;
    }
    assert!(seen >= 10, "{seen} templates");
}

/// The vocabulary file's own chat template, through the tokenizer as `les run
/// --chat` uses it: the prompt then tokenizes with its special tokens parsed.
#[test]
fn a_vocabulary_files_chat_template_makes_the_prompt() {
    let g = Gguf::open(vocab("qwen35")).unwrap();
    let tok = Tokenizer::from_gguf(&g).unwrap();
    let prompt = tok.chat_prompt(&[("user", "Hello")], true).unwrap();
    // Qwen2.5's template, which adds a default system message.
    assert_eq!(
        prompt,
        "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n\
         <|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    );
    let ids = tok.encode(&prompt, true, true);
    let im_start = tok.token_id("<|im_start|>").unwrap();
    assert_eq!(ids[0], im_start);
    assert_eq!(ids.iter().filter(|&&t| t == im_start).count(), 3);
}
