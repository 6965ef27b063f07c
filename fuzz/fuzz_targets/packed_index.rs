//! The packed-model index and its metadata on arbitrary bytes: reading it never
//! panics, and an index it accepts only names extents inside the file.
#![no_main]

use les::gguf::Gguf;
use les::pack::PackedIndex;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(g) = Gguf::parse(data) else { return };
    let Ok(Some(index)) = PackedIndex::from_gguf(&g) else {
        return;
    };
    let len = data.len() as u64;
    for layer in index.layers() {
        assert_eq!(layer.checksums.len(), index.n_experts);
        assert!(layer.stride >= layer.expert_bytes);
        assert_eq!(layer.stride % index.alignment, 0);
        for e in 0..=index.n_experts {
            match layer.extent(e) {
                Some(x) => {
                    assert!(e < index.n_experts);
                    assert!(x.offset + x.padded_len <= len, "extent past the file");
                    assert_eq!(x.offset % index.alignment, 0);
                    let bytes = &data[x.offset as usize..(x.offset + x.padded_len) as usize];
                    let _ = layer.verify(e, bytes);
                }
                None => assert_eq!(e, index.n_experts),
            }
        }
        assert!(index.layer(layer.layer).is_some());
    }
    let _ = index.verify_all(&g);
});
