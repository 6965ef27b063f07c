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
