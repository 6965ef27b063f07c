//! `les serve`'s request bodies (and `les batch`'s request lines) from
//! arbitrary bytes: every endpoint's JSON
//! readers (messages, content parts, base64 images, samplers, stop strings,
//! response formats turned into grammars) and the helpers' give a request or
//! a one-line 400, never a panic, hang or huge allocation; a request read
//! keeps its bounds (images, stop strings, log probabilities, tools), a
//! required tool call's grammar parses, and a chat request's markers
//! match its images; the tool-call readers of every format take any text.
#![no_main]

use les::grammar::Grammar;
use les::serve::api::{self, Prompt, MAX_IMAGES, MAX_IMAGE_BYTES, MAX_STOPS, MAX_TOP_LOGPROBS};
use les::serve::tools::{self, ToolChoice, ToolFormat, MAX_TOOLS};
use les::vision::MEDIA_MARKER;
use libfuzzer_sys::fuzz_target;

/// Every format les reads calls in.
const FORMATS: [ToolFormat; 8] = [
    ToolFormat::Hermes,
    ToolFormat::Harmony,
    ToolFormat::Xml { bare: false },
    ToolFormat::Xml { bare: true },
    ToolFormat::Glm { newlines: true },
    ToolFormat::Glm { newlines: false },
    ToolFormat::MiniMax,
    ToolFormat::Kimi,
];

fuzz_target!(|data: &[u8]| {
    // As a line of `les batch`: a request (streaming off), read once per id,
    // or a line error.
    let mut seen = std::collections::HashSet::new();
    match les::serve::batch::read_request(data, &mut seen) {
        Ok(r) => {
            assert!(seen.contains(&r.custom_id));
            assert!(r.completion.as_ref().is_ok_and(|c| !c.stream) || r.completion.is_err());
            assert!(les::serve::batch::read_request(data, &mut seen).is_err());
        }
        Err(e) => assert!(!e.message.is_empty()),
    }
    for read in [
        api::chat_request,
        api::text_request,
        api::infill_request,
        les::serve::anthropic::messages_request,
        les::serve::responses::responses_request,
    ] {
        match read(data) {
            Ok(c) => {
                assert!(c.images.len() <= MAX_IMAGES);
                assert!(c.images.iter().all(|i| i.len() <= MAX_IMAGE_BYTES + 3));
                assert!(c.stop.len() <= MAX_STOPS && c.stop.iter().all(|s| !s.is_empty()));
                assert!(c.logprobs.is_none_or(|n| n <= MAX_TOP_LOGPROBS));
                if let Some(t) = &c.tools {
                    assert!(!t.list.is_empty() && t.list.len() <= MAX_TOOLS);
                    for format in FORMATS {
                        // A required call's grammar and an auto reply's
                        // lazy one parse, where the parameters are a
                        // schema les converts.
                        if let Ok(Some(g)) = t.grammar(format) {
                            assert!(t.choice != ToolChoice::Auto);
                            if let Err(e) = Grammar::parse(&g) {
                                panic!("{e}\n{g}");
                            }
                        }
                        if let Ok((g, starts)) = t.lazy(format) {
                            assert!(!starts.is_empty());
                            if let Err(e) = Grammar::parse(&g) {
                                panic!("{e}\n{g}");
                            }
                        }
                        // A reply of the request's own text reads.
                        if let Ok(text) = std::str::from_utf8(data) {
                            let (content, _) = t.read_reply(text, format);
                            assert!(content.len() <= text.len());
                        }
                    }
                }
                if let Prompt::Chat(messages) = &c.prompt {
                    // Markers the text spells itself count too: never fewer.
                    let markers: usize = messages
                        .iter()
                        .map(|m| m.content.matches(MEDIA_MARKER).count())
                        .sum();
                    assert!(markers >= c.images.len());
                }
            }
            Err(e) => {
                assert_eq!(e.status, 400);
                assert!(!e.message.contains('\n'), "{}", e.message);
            }
        }
    }
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = api::base64(text);
        let _ = api::data_url(text);
        let (content, calls) = tools::read_calls(text);
        assert!(content.len() <= text.len() && calls.len() <= text.matches(tools::OPEN).count());
        for format in FORMATS.into_iter().filter_map(|f| f.call_starts()) {
            let n = tools::before_calls(text, format);
            assert!(n <= text.len() && text.is_char_boundary(n));
            let n = tools::streamable(text, format);
            assert!(n <= text.len() && text.is_char_boundary(n));
        }
    }
});
