//! Unpacking of the packed 6-bit sub-block scales shared by several K-quants.

/// Scale and min of sub-block `j` (0..8) of a `Q4_K`/`Q5_K` block, from its 12 packed
/// bytes (ggml's `get_scale_min_k4`).
#[inline]
pub fn scale_min_k4(j: usize, s: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// All eight scales and all eight mins of a `Q4_K`/`Q5_K` block at once, byte `j`
/// of each being [`scale_min_k4`]`(j)`: the same unpacking as four-byte word
/// operations (for SIMD kernels, which want the bytes side by side).
#[inline]
pub fn scales_mins_k4(s: &[u8; 12]) -> ([u8; 8], [u8; 8]) {
    const LOW6: u32 = 0x3f3f_3f3f;
    const LOW4: u32 = 0x0f0f_0f0f;
    const TOP2: u32 = 0x0303_0303;
    let word = |i: usize| u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
    let (w0, w1, w2) = (word(0), word(1), word(2));
    // Sub-blocks 0..4: the low six bits of bytes 0..4 (scales) and 4..8 (mins).
    // Sub-blocks 4..8: the nibbles of bytes 8..12 (scales low, mins high) under
    // the top two bits of bytes 0..4 (scales) and 4..8 (mins).
    let scales_hi = (w2 & LOW4) | ((w0 >> 6) & TOP2) << 4;
    let mins_hi = ((w2 >> 4) & LOW4) | ((w1 >> 6) & TOP2) << 4;
    let bytes = |lo: u32, hi: u32| (lo as u64 | (hi as u64) << 32).to_le_bytes();
    (bytes(w0 & LOW6, scales_hi), bytes(w1 & LOW6, mins_hi))
}

/// The sixteen signed 6-bit scales of a `Q3_K` block (already offset by -32).
#[inline]
pub fn scales_q3k(packed: &[u8; 12]) -> [i8; 16] {
    const KMASK1: u32 = 0x0303_0303;
    const KMASK2: u32 = 0x0f0f_0f0f;
    let word = |i: usize| {
        u32::from_le_bytes([
            packed[4 * i],
            packed[4 * i + 1],
            packed[4 * i + 2],
            packed[4 * i + 3],
        ])
    };
    let (a0, a1, tmp) = (word(0), word(1), word(2));
    let aux = [
        (a0 & KMASK2) | ((tmp & KMASK1) << 4),
        (a1 & KMASK2) | (((tmp >> 2) & KMASK1) << 4),
        ((a0 >> 4) & KMASK2) | (((tmp >> 4) & KMASK1) << 4),
        ((a1 >> 4) & KMASK2) | (((tmp >> 6) & KMASK1) << 4),
    ];
    let mut out = [0i8; 16];
    for (i, w) in aux.iter().enumerate() {
        for (k, b) in w.to_le_bytes().iter().enumerate() {
            out[4 * i + k] = (*b as i8).wrapping_sub(32);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn k4_scales_unpack_per_the_format_description() {
        // Sub-blocks 0..4 take the low six bits of bytes 0..8; 4..8 combine the
        // nibbles of bytes 8..12 with the top two bits of bytes 0..8.
        let s = [
            0xc1, 0x02, 0x03, 0x04, 0x45, 0x06, 0x07, 0x08, 0xa9, 0x0a, 0x0b, 0x0c,
        ];
        assert_eq!(scale_min_k4(0, &s), (1, 5));
        assert_eq!(scale_min_k4(4, &s), (0x09 | (3 << 4), 0x0a | (1 << 4)));
        assert_eq!(scale_min_k4(7, &s), (0x0c, 0x00));
    }

    #[test]
    fn k4_scales_all_at_once_equal_one_by_one() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for case in 0..2000 {
            let mut s = [0u8; 12];
            for b in &mut s {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                *b = if case < 2 {
                    [0x00, 0xff][case]
                } else {
                    x as u8
                };
            }
            let (sc, m) = scales_mins_k4(&s);
            for j in 0..8 {
                assert_eq!((sc[j], m[j]), scale_min_k4(j, &s), "{s:02x?} sub-block {j}");
            }
        }
    }

    #[test]
    fn q3k_scales_unpack() {
        // All-zero packing means every 6-bit scale is 0, i.e. -32 after the offset.
        assert_eq!(scales_q3k(&[0; 12]), [-32; 16]);
        // Scale 0 lives in the low nibble of byte 0 and bits 0-1 of byte 8.
        let mut p = [0u8; 12];
        p[0] = 0x0f;
        p[8] = 0x03;
        assert_eq!(scales_q3k(&p)[0], 63 - 32);
        // Scale 8 lives in the high nibble of byte 0 and bits 4-5 of byte 8.
        let mut p = [0u8; 12];
        p[0] = 0xf0;
        p[8] = 0x30;
        assert_eq!(scales_q3k(&p)[8], 63 - 32);
    }
}
