//! A JPEG decoder whose pixels are llama.cpp's.
//!
//! llama.cpp's multimodal tools read image files with stb_image (v2.30, in
//! `mtmd-helper.cpp`). JPEG leaves the decoder free in its inverse DCT, its
//! chroma upsampling and its colour conversion, and decoders differ there:
//! on photos the `image` crate's and stb_image's RGB differ by up to 3 in a
//! quarter of the samples (4:2:0), and by up to 85 in the last column of
//! 4:2:2 images, where stb_image weighs the two nearest chroma samples the
//! other way round. A vision tower sees those differences, so les decodes
//! JPEG with stb_image's arithmetic:
//!
//! - the integer inverse DCT derived from IJG's `jidctint` (12-bit fixed
//!   point constants, 2 extra bits kept between the passes), coefficients
//!   dequantized in 16-bit arithmetic;
//! - chroma upsampled by the "triangle" filters (3:1 weights) for 2x
//!   horizontal, 2x vertical and 2x2, with stb_image's edge cases, and by
//!   replication for other factors;
//! - YCbCr to RGB in 20-bit fixed point with the Cb contribution to green
//!   truncated to 16 bits (stb_image's "reduced precision", the same in its
//!   SIMD and scalar code); Adobe RGB / CMYK / YCCK as stb_image reads them.
//!
//! Entropy decoding is the standard's (baseline and extended Huffman,
//! progressive with spectral selection and successive approximation,
//! restart intervals); a valid file has one set of coefficients. Where the
//! data is not valid this decoder returns an error in the cases stb_image
//! does, and also where stb_image would return a partial image (an unknown
//! marker, the file ending before its end-of-image marker). Arithmetic
//! coding, lossless and 12-bit JPEGs are refused, as stb_image refuses them.
//!
//! Every length is checked against the bytes present, and the image's size
//! ([`super::image::check_dimensions`]) before anything is allocated for it.

use super::image::{check_dimensions, RgbImage};

/// The bytes a decode may allocate for its component planes and progressive
/// coefficients, beyond the output image (a 64 Mpx 4:4:4 progressive photo
/// needs about 576 MiB).
const MAX_WORK_BYTES: u64 = 640 << 20;

/// Natural (row-major) index of the `k`-th coefficient in zigzag order.
const ZIGZAG: [u8; 64] = [
    0, 1, 8, 16, 9, 2, 3, 10, 17, 24, 32, 25, 18, 11, 4, 5, 12, 19, 26, 33, 40, 48, 41, 34, 27, 20,
    13, 6, 7, 14, 21, 28, 35, 42, 49, 56, 57, 50, 43, 36, 29, 22, 15, 23, 30, 37, 44, 51, 58, 59,
    52, 45, 38, 31, 39, 46, 53, 60, 61, 54, 47, 55, 62, 63,
];

/// Decodes a JPEG file to RGB as stb_image does (see the module's doc).
pub fn decode(bytes: &[u8]) -> Result<RgbImage, String> {
    let mut d = Decoder::new(bytes);
    d.read_frame()?;
    d.allocate()?;
    d.read_scans()?;
    d.finish_progressive();
    Ok(d.to_rgb())
}

/// The width and height of a JPEG, from its headers up to the frame's (with
/// the checks [`decode`] makes of them).
pub fn dimensions(bytes: &[u8]) -> Result<(usize, usize), String> {
    let mut d = Decoder::new(bytes);
    d.read_frame()?;
    Ok((d.width, d.height))
}

/// A Huffman table, canonical codes of up to 16 bits.
#[derive(Clone)]
struct Huffman {
    /// For each 9-bit prefix, the symbol index of the code it starts with, if
    /// that code has at most 9 bits (255: longer).
    fast: [u8; 1 << FAST_BITS],
    /// Code length of each symbol index.
    size: [u8; 257],
    /// One past the largest code of each length, shifted to 16 bits (index
    /// 17: a sentinel above every code).
    maxcode: [u32; 18],
    /// Symbol index minus code, for each length.
    delta: [i32; 17],
    /// The symbols, in code order.
    values: [u8; 256],
}

const FAST_BITS: u32 = 9;

impl Huffman {
    /// The table of `counts[i]` codes of length `i + 1` for `values`.
    fn new(counts: &[u8; 16], values: &[u8]) -> Result<Huffman, String> {
        let mut h = Huffman {
            fast: [255; 1 << FAST_BITS],
            size: [0; 257],
            maxcode: [0; 18],
            delta: [0; 17],
            values: [0; 256],
        };
        h.values[..values.len()].copy_from_slice(values);
        let mut k = 0usize;
        for (i, &n) in counts.iter().enumerate() {
            for _ in 0..n {
                h.size[k] = i as u8 + 1;
                k += 1;
            }
        }
        let mut codes = [0u16; 256];
        let mut code = 0u32;
        let mut k = 0usize;
        for j in 1..=16u32 {
            h.delta[j as usize] = k as i32 - code as i32;
            if u32::from(h.size[k]) == j {
                while u32::from(h.size[k]) == j {
                    codes[k] = code as u16;
                    code += 1;
                    k += 1;
                }
                if code > 1 << j {
                    return Err("bad Huffman code lengths".into());
                }
            }
            h.maxcode[j as usize] = code << (16 - j);
            code <<= 1;
        }
        h.maxcode[17] = u32::MAX;
        for (i, &code) in codes[..k].iter().enumerate() {
            let s = u32::from(h.size[i]);
            if s <= FAST_BITS {
                let c = usize::from(code) << (FAST_BITS - s);
                h.fast[c..c + (1 << (FAST_BITS - s))].fill(i as u8);
            }
        }
        Ok(h)
    }
}

/// One image component (Y, Cb, Cr, K or R, G, B).
#[derive(Clone, Default)]
struct Component {
    id: u8,
    /// Sampling factors.
    h: usize,
    v: usize,
    /// Quantization table.
    tq: usize,
    /// Huffman tables of the current scan.
    hd: usize,
    ha: usize,
    dc_pred: i32,
    /// Samples it has (the image's size scaled by its sampling factors).
    x: usize,
    y: usize,
    /// Its plane's stride and rows: whole MCUs.
    w2: usize,
    h2: usize,
    /// Decoded samples, `w2 x h2`.
    data: Vec<u8>,
    /// Progressive only: coefficients of every block, `(w2 / 8) x (h2 / 8)`
    /// blocks of 64.
    coeff: Vec<i16>,
}

/// The file's bytes: segments read by length, and entropy-coded data read
/// bit by bit, most significant first, with stuffed zero bytes dropped.
struct Stream<'a> {
    bytes: &'a [u8],
    pos: usize,
    /// Up to 32 bits, the next one in the top bit.
    code_buffer: u32,
    code_bits: i32,
    /// The marker that ended the entropy-coded data (0: none yet).
    marker: u8,
    /// Past a marker or the file's end: zero bits from then on.
    nomore: bool,
}

impl<'a> Stream<'a> {
    fn u8(&mut self) -> Result<u8, String> {
        let b = *self
            .bytes
            .get(self.pos)
            .ok_or("the JPEG ends inside a segment")?;
        self.pos += 1;
        Ok(b)
    }

    fn u16(&mut self) -> Result<u16, String> {
        Ok(u16::from(self.u8()?) << 8 | u16::from(self.u8()?))
    }

    /// The body of a segment whose 16-bit length (counting itself) is next.
    fn segment(&mut self) -> Result<&'a [u8], String> {
        let len = usize::from(self.u16()?);
        let n = len.checked_sub(2).ok_or("bad segment length")?;
        let s = self
            .bytes
            .get(self.pos..self.pos + n)
            .ok_or("the JPEG ends inside a segment")?;
        self.pos += n;
        Ok(s)
    }

    /// The next marker's code: the one the entropy-coded data ended at, or
    /// `0xFF` (repeated as fill) and a code here. With `skip_junk`, bytes
    /// before it that are not a marker are passed over (some files pad
    /// their header segments; stb_image reads past them).
    fn next_marker(&mut self, skip_junk: bool) -> Result<u8, String> {
        if self.marker != 0 {
            return Ok(std::mem::take(&mut self.marker));
        }
        while self.u8()? != 0xFF {
            if !skip_junk {
                return Err("expected a JPEG marker".into());
            }
        }
        loop {
            match self.u8()? {
                0xFF => continue,
                m => return Ok(m),
            }
        }
    }

    /// After a scan: past bytes that are not a marker (some files have
    /// junk there) up to the next marker, unless the data ended at one.
    fn skip_to_marker(&mut self) -> Result<(), String> {
        if self.marker != 0 {
            return Ok(());
        }
        while let Some(&b) = self.bytes.get(self.pos) {
            self.pos += 1;
            if b != 0xFF {
                continue;
            }
            while self.bytes.get(self.pos) == Some(&0xFF) {
                self.pos += 1;
            }
            match self.bytes.get(self.pos) {
                None => break,
                Some(0) => self.pos += 1,
                Some(&m) => {
                    self.pos += 1;
                    self.marker = m;
                    return Ok(());
                }
            }
        }
        Err("the JPEG ends before its end-of-image marker".into())
    }

    /// A new interval of entropy-coded data starts here.
    fn reset_bits(&mut self) {
        self.code_buffer = 0;
        self.code_bits = 0;
        self.marker = 0;
        self.nomore = false;
    }

    /// More than 24 bits in the buffer, or a marker met.
    fn fill(&mut self) {
        while self.code_bits <= 24 {
            let mut b = 0u32;
            if !self.nomore {
                match self.bytes.get(self.pos) {
                    None => self.nomore = true,
                    Some(0xFF) => {
                        let mut p = self.pos + 1;
                        while self.bytes.get(p) == Some(&0xFF) {
                            p += 1;
                        }
                        match self.bytes.get(p) {
                            Some(0) => {
                                b = 0xFF;
                                self.pos = p + 1;
                            }
                            Some(&m) => {
                                self.marker = m;
                                self.nomore = true;
                                self.pos = p + 1;
                                return;
                            }
                            None => {
                                self.nomore = true;
                                self.pos = p;
                            }
                        }
                    }
                    Some(&v) => {
                        b = u32::from(v);
                        self.pos += 1;
                    }
                }
            }
            self.code_buffer |= b << (24 - self.code_bits);
            self.code_bits += 8;
        }
    }

    fn huff_decode(&mut self, h: &Huffman) -> Result<u8, String> {
        if self.code_bits < 16 {
            self.fill();
        }
        let bad = || "bad Huffman code".to_string();
        let k = h.fast[(self.code_buffer >> (32 - FAST_BITS)) as usize];
        if k < 255 {
            let s = i32::from(h.size[usize::from(k)]);
            if s > self.code_bits {
                return Err(bad());
            }
            self.code_buffer <<= s;
            self.code_bits -= s;
            return Ok(h.values[usize::from(k)]);
        }
        let top = self.code_buffer >> 16;
        let k = (FAST_BITS as usize + 1..17)
            .find(|&k| top < h.maxcode[k])
            .ok_or_else(bad)?;
        if k as i32 > self.code_bits {
            return Err(bad());
        }
        let c = (self.code_buffer >> (32 - k)) as i32 + h.delta[k];
        let c = usize::try_from(c)
            .ok()
            .filter(|&c| c < 256)
            .ok_or_else(bad)?;
        self.code_bits -= k as i32;
        self.code_buffer <<= k;
        Ok(h.values[c])
    }

    /// `n` (1..=16) raw bits; zeros where the data has run out.
    fn bits(&mut self, n: u32) -> u32 {
        if self.code_bits < n as i32 {
            self.fill();
        }
        if self.code_bits < n as i32 {
            return 0;
        }
        let k = self.code_buffer >> (32 - n);
        self.code_buffer <<= n;
        self.code_bits -= n as i32;
        k
    }

    /// `n` (1..=15) bits as a signed magnitude (the standard's EXTEND);
    /// zero where the data has run out.
    fn receive_extend(&mut self, n: u32) -> i32 {
        if self.code_bits < n as i32 {
            self.fill();
        }
        if self.code_bits < n as i32 {
            return 0;
        }
        let negative = self.code_buffer >> 31 == 0;
        let v = self.bits(n) as i32;
        if negative {
            v - (1 << n) + 1
        } else {
            v
        }
    }

    fn bit(&mut self) -> bool {
        self.bits(1) != 0
    }
}

/// The most coefficients all scans of a file may visit together, in passes
/// over all of the image's coefficients: a scan costs little in the file and
/// a pass over every block of its band, so a flood of scans could keep a
/// decoder busy for minutes. Real progressive files make 2 to 4 passes
/// (each band refined once or twice).
const MAX_PASSES: u64 = 32;
/// The same bound in coefficients, whatever the image's size (about 20
/// passes of a 64 Mpx 4:4:4 photo).
const MAX_COEFFICIENT_VISITS: u64 = 1 << 32;

/// The decoder's state; fields named after the standard's.
struct Decoder<'a> {
    s: Stream<'a>,
    width: usize,
    height: usize,
    comps: Vec<Component>,
    progressive: bool,
    dequant: [[u16; 64]; 4],
    has_dequant: [bool; 4],
    huff_dc: [Option<Box<Huffman>>; 4],
    huff_ac: [Option<Box<Huffman>>; 4],
    restart_interval: u32,
    jfif: bool,
    /// Adobe APP14's transform (0: RGB or CMYK, 1: YCbCr, 2: YCCK); -1: none.
    app14_transform: i32,
    h_max: usize,
    v_max: usize,
    mcus_x: usize,
    mcus_y: usize,
    /// Coefficients the scans so far went over.
    coefficient_visits: u64,
    // The scan being read.
    order: Vec<usize>,
    spec_start: usize,
    spec_end: usize,
    succ_high: u32,
    succ_low: u32,
    eob_run: u32,
    /// MCUs left before the next restart marker.
    todo: u32,
}

impl<'a> Decoder<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        Decoder {
            s: Stream {
                bytes,
                pos: 0,
                code_buffer: 0,
                code_bits: 0,
                marker: 0,
                nomore: false,
            },
            width: 0,
            height: 0,
            comps: Vec::new(),
            progressive: false,
            dequant: [[0; 64]; 4],
            has_dequant: [false; 4],
            huff_dc: Default::default(),
            huff_ac: Default::default(),
            restart_interval: 0,
            jfif: false,
            app14_transform: -1,
            h_max: 1,
            v_max: 1,
            mcus_x: 0,
            mcus_y: 0,
            coefficient_visits: 0,
            order: Vec::new(),
            spec_start: 0,
            spec_end: 63,
            succ_high: 0,
            succ_low: 0,
            eob_run: 0,
            todo: u32::MAX,
        }
    }

    // ---- Segments.

    /// A table or application segment (before the frame or between scans);
    /// an error on markers that have no place there.
    fn read_segment(&mut self, m: u8) -> Result<(), String> {
        match m {
            0xDD => {
                let seg = self.s.segment()?;
                let [a, b] = seg else {
                    return Err("bad restart interval segment".into());
                };
                self.restart_interval = u32::from(u16::from_be_bytes([*a, *b]));
            }
            0xDB => {
                let mut seg = self.s.segment()?;
                while let Some((&pq, rest)) = seg.split_first() {
                    let (sixteen, t) = (pq >> 4 == 1, usize::from(pq & 15));
                    if pq >> 4 > 1 || t > 3 {
                        return Err("bad quantization table".into());
                    }
                    let n = if sixteen { 128 } else { 64 };
                    let values = rest.get(..n).ok_or("bad quantization table length")?;
                    for (k, &z) in ZIGZAG.iter().enumerate() {
                        self.dequant[t][usize::from(z)] = if sixteen {
                            u16::from_be_bytes([values[2 * k], values[2 * k + 1]])
                        } else {
                            u16::from(values[k])
                        };
                    }
                    self.has_dequant[t] = true;
                    seg = &rest[n..];
                }
            }
            0xC4 => {
                let mut seg = self.s.segment()?;
                while let Some((&tc_th, rest)) = seg.split_first() {
                    let (tc, th) = (tc_th >> 4, usize::from(tc_th & 15));
                    if tc > 1 || th > 3 {
                        return Err("bad Huffman table header".into());
                    }
                    let Some((counts, rest)) = rest.split_first_chunk::<16>() else {
                        return Err("bad Huffman table length".into());
                    };
                    let n: usize = counts.iter().map(|&c| usize::from(c)).sum();
                    if n > 256 {
                        return Err("bad Huffman table header".into());
                    }
                    let values = rest.get(..n).ok_or("bad Huffman table length")?;
                    let table = Some(Box::new(Huffman::new(counts, values)?));
                    if tc == 0 {
                        self.huff_dc[th] = table;
                    } else {
                        self.huff_ac[th] = table;
                    }
                    seg = &rest[n..];
                }
            }
            0xE0..=0xEF | 0xFE => {
                let seg = self.s.segment()?;
                if m == 0xE0 && seg.starts_with(b"JFIF\0") {
                    self.jfif = true;
                } else if m == 0xEE && seg.len() >= 12 && seg.starts_with(b"Adobe\0") {
                    self.app14_transform = i32::from(seg[11]);
                }
            }
            0xC3 | 0xC5..=0xC7 | 0xCB | 0xCD..=0xCF => {
                return Err("lossless and hierarchical JPEGs are not supported".into())
            }
            0xC9 | 0xCA => return Err("arithmetic-coded JPEGs are not supported".into()),
            _ => return Err(format!("unexpected JPEG marker 0xFF{m:02X}")),
        }
        Ok(())
    }

    /// The segments up to and including the frame header.
    fn read_frame(&mut self) -> Result<(), String> {
        if self.s.bytes.get(..2) != Some(&[0xFF, 0xD8]) {
            return Err("not a JPEG (no start-of-image marker)".into());
        }
        self.s.pos = 2;
        let sof = loop {
            match self.s.next_marker(true)? {
                m @ 0xC0..=0xC2 => break m,
                m => self.read_segment(m)?,
            }
        };
        self.progressive = sof == 0xC2;
        let seg = self.s.segment()?;
        let [precision, h1, h0, w1, w0, n, components @ ..] = seg else {
            return Err("bad frame header length".into());
        };
        if *precision != 8 {
            return Err(format!(
                "{precision}-bit JPEGs are not supported (8-bit are)"
            ));
        }
        self.height = usize::from(u16::from_be_bytes([*h1, *h0]));
        self.width = usize::from(u16::from_be_bytes([*w1, *w0]));
        if self.height == 0 {
            return Err("JPEGs whose height comes after the scan (DNL) are not supported".into());
        }
        check_dimensions(self.width as u32, self.height as u32)?;
        if !matches!(n, 1 | 3 | 4) {
            return Err(format!("a JPEG of {n} components (1, 3 or 4 are read)"));
        }
        if components.len() != 3 * usize::from(*n) {
            return Err("bad frame header length".into());
        }
        for c in components.chunks_exact(3) {
            let (h, v, tq) = (
                usize::from(c[1] >> 4),
                usize::from(c[1] & 15),
                usize::from(c[2]),
            );
            if !(1..=4).contains(&h) || !(1..=4).contains(&v) {
                return Err("bad sampling factors".into());
            }
            if tq > 3 {
                return Err("bad quantization table index".into());
            }
            self.comps.push(Component {
                id: c[0],
                h,
                v,
                tq,
                ..Component::default()
            });
        }
        self.h_max = self.comps.iter().map(|c| c.h).max().unwrap_or(1);
        self.v_max = self.comps.iter().map(|c| c.v).max().unwrap_or(1);
        if self
            .comps
            .iter()
            .any(|c| !self.h_max.is_multiple_of(c.h) || !self.v_max.is_multiple_of(c.v))
        {
            return Err("sampling factors that are not integer ratios".into());
        }
        self.mcus_x = self.width.div_ceil(8 * self.h_max);
        self.mcus_y = self.height.div_ceil(8 * self.v_max);
        for c in &mut self.comps {
            c.x = (self.width * c.h).div_ceil(self.h_max);
            c.y = (self.height * c.v).div_ceil(self.v_max);
            c.w2 = self.mcus_x * c.h * 8;
            c.h2 = self.mcus_y * c.v * 8;
        }
        Ok(())
    }

    /// The component planes (and progressive coefficients), within
    /// [`MAX_WORK_BYTES`].
    fn allocate(&mut self) -> Result<(), String> {
        // Samples, and two bytes a coefficient where progressive.
        let per_sample = if self.progressive { 3 } else { 1 };
        let work: u64 = self
            .comps
            .iter()
            .map(|c| (c.w2 * c.h2) as u64 * per_sample)
            .sum();
        if work > MAX_WORK_BYTES {
            return Err(format!(
                "this {}x{} JPEG needs {} MiB to decode (at most {} MiB)",
                self.width,
                self.height,
                work >> 20,
                MAX_WORK_BYTES >> 20
            ));
        }
        for c in &mut self.comps {
            c.data = vec![0; c.w2 * c.h2];
            if self.progressive {
                c.coeff = vec![0; c.w2 * c.h2];
            }
        }
        Ok(())
    }

    /// The scans, and the segments between them, up to the end of the image.
    fn read_scans(&mut self) -> Result<(), String> {
        let mut scans = 0;
        loop {
            match self.s.next_marker(false)? {
                0xD9 => break,
                0xDA => {
                    self.read_scan_header()?;
                    self.read_entropy_coded_data()?;
                    scans += 1;
                    self.s.skip_to_marker()?;
                }
                0xDC => {
                    let seg = self.s.segment()?;
                    if seg.len() != 2
                        || usize::from(u16::from_be_bytes([seg[0], seg[1]])) != self.height
                    {
                        return Err("bad DNL segment".into());
                    }
                }
                // A restart marker after a scan's last interval.
                0xD0..=0xD7 => {}
                m => self.read_segment(m)?,
            }
        }
        if scans == 0 {
            return Err("the JPEG has no scan".into());
        }
        Ok(())
    }

    fn read_scan_header(&mut self) -> Result<(), String> {
        let seg = self.s.segment()?;
        let [n, rest @ ..] = seg else {
            return Err("bad scan header".into());
        };
        let n = usize::from(*n);
        if n == 0 || n > self.comps.len() || rest.len() != 2 * n + 3 {
            return Err("bad scan header".into());
        }
        self.order.clear();
        for c in rest[..2 * n].chunks_exact(2) {
            let which = self
                .comps
                .iter()
                .position(|comp| comp.id == c[0])
                .ok_or("a scan names a component the frame does not have")?;
            let comp = &mut self.comps[which];
            (comp.hd, comp.ha) = (usize::from(c[1] >> 4), usize::from(c[1] & 15));
            if comp.hd > 3 || comp.ha > 3 {
                return Err("bad Huffman table index".into());
            }
            if !self.has_dequant[comp.tq] {
                return Err("a component's quantization table is not defined".into());
            }
            self.order.push(which);
        }
        let [ss, se, a] = rest[2 * n..] else {
            unreachable!("the length was checked");
        };
        (self.spec_start, self.spec_end) = (usize::from(ss), usize::from(se));
        (self.succ_high, self.succ_low) = (u32::from(a >> 4), u32::from(a & 15));
        if self.progressive {
            if self.spec_start > self.spec_end
                || self.spec_end > 63
                || self.succ_high > 13
                || self.succ_low > 13
            {
                return Err("bad progressive scan parameters".into());
            }
            if self.spec_start != 0 && n != 1 {
                return Err("a progressive AC scan of several components".into());
            }
            if self.spec_start == 0 && self.spec_end != 0 {
                return Err("a progressive DC scan with AC coefficients".into());
            }
        } else {
            if self.spec_start != 0 || self.succ_high != 0 || self.succ_low != 0 {
                return Err("bad sequential scan parameters".into());
            }
            self.spec_end = 63;
        }
        // The tables the scan's blocks decode with are defined.
        let dc = !self.progressive || (self.spec_start == 0 && self.succ_high == 0);
        let ac = !self.progressive || self.spec_start != 0;
        for &i in &self.order {
            let c = &self.comps[i];
            if (dc && self.huff_dc[c.hd].is_none()) || (ac && self.huff_ac[c.ha].is_none()) {
                return Err("a scan uses a Huffman table that is not defined".into());
            }
        }
        Ok(())
    }

    // ---- Entropy-coded data.

    fn reset(&mut self) {
        self.s.reset_bits();
        for c in &mut self.comps {
            c.dc_pred = 0;
        }
        self.todo = if self.restart_interval > 0 {
            self.restart_interval
        } else {
            u32::MAX
        };
        self.eob_run = 0;
    }

    /// The DC coefficient (undequantized) of the next block of `comp`.
    fn decode_dc(&mut self, comp: usize) -> Result<i32, String> {
        let c = &mut self.comps[comp];
        let h = self.huff_dc[c.hd].as_deref().ok_or("no DC table")?;
        let t = u32::from(self.s.huff_decode(h)?);
        if t > 15 {
            return Err("bad Huffman code".into());
        }
        let diff = if t > 0 { self.s.receive_extend(t) } else { 0 };
        c.dc_pred = c.dc_pred.checked_add(diff).ok_or("bad DC difference")?;
        Ok(c.dc_pred)
    }

    /// A sequential block, dequantized, in natural order.
    fn decode_block(&mut self, comp: usize) -> Result<[i16; 64], String> {
        let dc = self.decode_dc(comp)?;
        let c = &self.comps[comp];
        let q = &self.dequant[c.tq];
        let h = self.huff_ac[c.ha].as_deref().ok_or("no AC table")?;
        let mut data = [0i16; 64];
        data[0] = checked_i16(dc, i32::from(q[0]))?;
        let mut k = 1;
        while k < 64 {
            let rs = self.s.huff_decode(h)?;
            let (r, s) = (usize::from(rs >> 4), u32::from(rs & 15));
            if s == 0 {
                if rs != 0xF0 {
                    break;
                }
                k += 16;
            } else {
                k += r;
                let z = usize::from(*ZIGZAG.get(k).ok_or("bad AC run")?);
                data[z] = self.s.receive_extend(s).wrapping_mul(i32::from(q[z])) as i16;
                k += 1;
            }
        }
        Ok(data)
    }

    /// A progressive DC scan's part of block `block` of `comp`.
    fn decode_dc_progressive(&mut self, comp: usize, block: usize) -> Result<(), String> {
        if self.succ_high == 0 {
            let v = checked_i16(self.decode_dc(comp)?, 1 << self.succ_low)?;
            let data = &mut self.comps[comp].coeff[64 * block..64 * block + 64];
            data.fill(0);
            data[0] = v;
        } else if self.s.bit() {
            let d = &mut self.comps[comp].coeff[64 * block];
            *d = d.wrapping_add((1i32 << self.succ_low) as i16);
        }
        Ok(())
    }

    /// A progressive AC scan's part of block `block` of `comp`.
    fn decode_ac_progressive(&mut self, comp: usize, block: usize) -> Result<(), String> {
        let c = &mut self.comps[comp];
        let h = self.huff_ac[c.ha].as_deref().ok_or("no AC table")?;
        let data: &mut [i16; 64] = (&mut c.coeff[64 * block..64 * block + 64])
            .try_into()
            .expect("64 coefficients");
        let (band, shift) = (self.spec_start..=self.spec_end, self.succ_low);
        if self.succ_high == 0 {
            ac_first(&mut self.s, h, data, band, shift, &mut self.eob_run)
        } else {
            ac_refine(&mut self.s, h, data, band, shift, &mut self.eob_run)
        }
    }

    /// After each MCU of a scan: at a restart interval's end, the restart
    /// marker resets the decoder; `false` where the data ends there instead.
    fn end_of_mcu(&mut self) -> bool {
        self.todo -= 1;
        if self.todo > 0 {
            return true;
        }
        if self.s.code_bits < 24 {
            self.s.fill();
        }
        if !(0xD0..=0xD7).contains(&self.s.marker) {
            return false;
        }
        self.reset();
        true
    }

    /// The scan's part of block (`bx`, `by`) of component `n`: a sequential
    /// block decoded and transformed into the plane, or a progressive scan's
    /// bits of its coefficients.
    fn decode_unit(&mut self, n: usize, bx: usize, by: usize) -> Result<(), String> {
        let block = bx + by * (self.comps[n].w2 / 8);
        if self.progressive && self.spec_start == 0 {
            self.decode_dc_progressive(n, block)
        } else if self.progressive {
            self.decode_ac_progressive(n, block)
        } else {
            let data = self.decode_block(n)?;
            let c = &mut self.comps[n];
            idct_block(&mut c.data[c.w2 * by * 8 + bx * 8..], c.w2, &data);
            Ok(())
        }
    }

    fn read_entropy_coded_data(&mut self) -> Result<(), String> {
        self.reset();
        if let [n] = self.order[..] {
            // One component: its blocks in raster order, each an MCU.
            let (bw, bh) = (self.comps[n].x.div_ceil(8), self.comps[n].y.div_ceil(8));
            self.visit((bw * bh) as u64)?;
            for by in 0..bh {
                for bx in 0..bw {
                    self.decode_unit(n, bx, by)?;
                    if !self.end_of_mcu() {
                        return Ok(());
                    }
                }
            }
        } else {
            let per_mcu: usize = self
                .order
                .iter()
                .map(|&n| self.comps[n].h * self.comps[n].v)
                .sum();
            self.visit((self.mcus_x * self.mcus_y * per_mcu) as u64)?;
            for j in 0..self.mcus_y {
                for i in 0..self.mcus_x {
                    for k in 0..self.order.len() {
                        let n = self.order[k];
                        let (h, v) = (self.comps[n].h, self.comps[n].v);
                        // Interleaved progressive scans are DC scans (the
                        // scan header refuses others).
                        for y in 0..v {
                            for x in 0..h {
                                self.decode_unit(n, i * h + x, j * v + y)?;
                            }
                        }
                    }
                    if !self.end_of_mcu() {
                        return Ok(());
                    }
                }
            }
        }
        Ok(())
    }

    /// Counts a scan over `blocks` blocks, of its band's coefficients each,
    /// against [`MAX_PASSES`] and [`MAX_COEFFICIENT_VISITS`].
    fn visit(&mut self, blocks: u64) -> Result<(), String> {
        let band = (self.spec_end + 1 - self.spec_start) as u64;
        self.coefficient_visits += blocks * band;
        let image: u64 = self
            .comps
            .iter()
            .map(|c| (c.x.div_ceil(8) * c.y.div_ceil(8) * 64) as u64)
            .sum();
        if self.coefficient_visits > (MAX_PASSES * image).min(MAX_COEFFICIENT_VISITS) {
            return Err("the JPEG has too many scans for its size".into());
        }
        Ok(())
    }

    /// A progressive image's blocks, dequantized and transformed once every
    /// scan is read.
    fn finish_progressive(&mut self) {
        if !self.progressive {
            return;
        }
        for c in &mut self.comps {
            let q = &self.dequant[c.tq];
            let stride = c.w2 / 8;
            for j in 0..c.y.div_ceil(8) {
                for i in 0..c.x.div_ceil(8) {
                    let b = 64 * (i + j * stride);
                    let mut block = [0i16; 64];
                    for ((o, &v), &q) in block.iter_mut().zip(&c.coeff[b..b + 64]).zip(q) {
                        *o = v.wrapping_mul(q as i16);
                    }
                    idct_block(&mut c.data[c.w2 * j * 8 + i * 8..], c.w2, &block);
                }
            }
            c.coeff = Vec::new();
        }
    }

    // ---- Upsampling and colour.

    fn to_rgb(&self) -> RgbImage {
        let (w, h) = (self.width, self.height);
        let n = self.comps.len();
        let is_rgb = n == 3
            && (self.comps.iter().zip(b"RGB").all(|(c, &id)| c.id == id)
                || (self.app14_transform == 0 && !self.jfif));
        let mut upsamplers: Vec<Upsampler> = self
            .comps
            .iter()
            .map(|c| Upsampler::new(self.h_max / c.h, self.v_max / c.v, w))
            .collect();
        let mut out = vec![0u8; w * h * 3];
        let mut rows: [Vec<u8>; 4] = Default::default();
        for o in out.chunks_exact_mut(w * 3) {
            for ((up, c), row) in upsamplers.iter_mut().zip(&self.comps).zip(&mut rows) {
                up.next_row(c, row);
            }
            let [a, b, c, k] = &rows;
            match n {
                3 if is_rgb => {
                    for (i, p) in o.chunks_exact_mut(3).enumerate() {
                        p.copy_from_slice(&[a[i], b[i], c[i]]);
                    }
                }
                4 if self.app14_transform == 0 => {
                    // CMYK as Adobe stores it (inverted): each channel times K.
                    for (i, p) in o.chunks_exact_mut(3).enumerate() {
                        p.copy_from_slice(&[a[i], b[i], c[i]].map(|v| blinn_8x8(v, k[i])));
                    }
                }
                3 | 4 => {
                    ycbcr_to_rgb(o, a, b, c);
                    if n == 4 && self.app14_transform == 2 {
                        // YCCK: the YCbCr part is inverted CMY.
                        for (i, p) in o.chunks_exact_mut(3).enumerate() {
                            for v in p.iter_mut() {
                                *v = blinn_8x8(255 - *v, k[i]);
                            }
                        }
                    }
                }
                _ => {
                    for (p, &v) in o.chunks_exact_mut(3).zip(a.iter()) {
                        p.fill(v);
                    }
                }
            }
        }
        RgbImage {
            width: w,
            height: h,
            data: out,
        }
    }
}

/// A progressive AC scan's first pass over `band` of a block: coefficients
/// scaled by `2^shift`, or one block of an end-of-band run.
fn ac_first(
    s: &mut Stream<'_>,
    h: &Huffman,
    data: &mut [i16; 64],
    band: std::ops::RangeInclusive<usize>,
    shift: u32,
    eob_run: &mut u32,
) -> Result<(), String> {
    if *eob_run > 0 {
        *eob_run -= 1;
        return Ok(());
    }
    let mut k = *band.start();
    while k <= *band.end() {
        let rs = s.huff_decode(h)?;
        let (r, size) = (u32::from(rs >> 4), u32::from(rs & 15));
        if size == 0 {
            if r < 15 {
                *eob_run = (1 << r) - 1 + if r > 0 { s.bits(r) } else { 0 };
                break;
            }
            k += 16;
        } else {
            k += r as usize;
            let z = usize::from(*ZIGZAG.get(k).ok_or("bad AC run")?);
            data[z] = s.receive_extend(size).wrapping_mul(1 << shift) as i16;
            k += 1;
        }
    }
    Ok(())
}

/// A progressive AC scan's refinement of `band` of a block: one more bit
/// (`2^shift`) of each coefficient already nonzero, and new coefficients of
/// that magnitude.
fn ac_refine(
    s: &mut Stream<'_>,
    h: &Huffman,
    data: &mut [i16; 64],
    band: std::ops::RangeInclusive<usize>,
    shift: u32,
    eob_run: &mut u32,
) -> Result<(), String> {
    let bit = (1i32 << shift) as i16;
    let refine = |s: &mut Stream<'_>, p: &mut i16| {
        if s.bit() && *p & bit == 0 {
            *p = if *p > 0 {
                p.wrapping_add(bit)
            } else {
                p.wrapping_sub(bit)
            };
        }
    };
    if *eob_run > 0 {
        *eob_run -= 1;
        for k in band {
            let p = &mut data[usize::from(ZIGZAG[k])];
            if *p != 0 {
                refine(s, p);
            }
        }
        return Ok(());
    }
    let (mut k, end) = (*band.start(), *band.end());
    while k <= end {
        let rs = s.huff_decode(h)?;
        let (mut r, size) = (u32::from(rs >> 4), rs & 15);
        let mut value = 0i16;
        if size == 0 {
            if r < 15 {
                *eob_run = (1 << r) - 1 + if r > 0 { s.bits(r) } else { 0 };
                // The rest of the band takes refinement bits only.
                r = 64;
            }
        } else {
            if size != 1 {
                return Err("bad Huffman code".into());
            }
            value = if s.bit() { bit } else { bit.wrapping_neg() };
        }
        while k <= end {
            let p = &mut data[usize::from(ZIGZAG[k])];
            k += 1;
            if *p != 0 {
                refine(s, p);
            } else if r == 0 {
                *p = value;
                break;
            } else {
                r -= 1;
            }
        }
    }
    Ok(())
}

/// `a * b` as a 16-bit coefficient, an error where it does not fit.
fn checked_i16(a: i32, b: i32) -> Result<i16, String> {
    i16::try_from(i64::from(a) * i64::from(b)).map_err(|_| "bad DC coefficient".to_string())
}

/// 0..255 x 0..255 / 255, rounded (stb_image's `blinn_8x8`).
fn blinn_8x8(x: u8, y: u8) -> u8 {
    let t = u32::from(x) * u32::from(y) + 128;
    ((t + (t >> 8)) >> 8) as u8
}

/// One component's rows brought to the image's resolution, one at a time,
/// as stb_image steps through them: each output row takes its nearest
/// component row and, for 2x vertical factors, the one on its other side.
struct Upsampler {
    hs: usize,
    vs: usize,
    w_lores: usize,
    ystep: usize,
    ypos: usize,
    /// Offsets of the two component rows in use.
    line0: usize,
    line1: usize,
}

impl Upsampler {
    fn new(hs: usize, vs: usize, width: usize) -> Self {
        Upsampler {
            hs,
            vs,
            w_lores: width.div_ceil(hs),
            ystep: vs >> 1,
            ypos: 0,
            line0: 0,
            line1: 0,
        }
    }

    /// The next output row into `out` (at least the image's width).
    fn next_row(&mut self, c: &Component, out: &mut Vec<u8>) {
        let y_bot = self.ystep >= self.vs >> 1;
        let (near, far) = if y_bot {
            (self.line1, self.line0)
        } else {
            (self.line0, self.line1)
        };
        let w = self.w_lores;
        let near = &c.data[near..near + w];
        let far = &c.data[far..far + w];
        out.clear();
        out.resize(w * self.hs, 0);
        match (self.hs, self.vs) {
            (1, 1) => out.copy_from_slice(near),
            (1, 2) => {
                for ((o, &a), &b) in out.iter_mut().zip(near).zip(far) {
                    *o = ((3 * u32::from(a) + u32::from(b) + 2) >> 2) as u8;
                }
            }
            (2, 1) => upsample_h2(out, near),
            (2, 2) => upsample_hv2(out, near, far),
            (hs, _) => {
                for (o, &v) in out.chunks_exact_mut(hs).zip(near) {
                    o.fill(v);
                }
            }
        }
        self.ystep += 1;
        if self.ystep >= self.vs {
            self.ystep = 0;
            self.line0 = self.line1;
            self.ypos += 1;
            if self.ypos < c.y {
                self.line1 += c.w2;
            }
        }
    }
}

/// 2x horizontally, 3:1 weights. At the right edge stb_image puts the 3 on
/// the second-to-last sample (kept: llama.cpp's pixels).
fn upsample_h2(out: &mut [u8], input: &[u8]) {
    let w = input.len();
    let x = |i: usize| u32::from(input[i]);
    if w == 1 {
        out[0] = input[0];
        out[1] = input[0];
        return;
    }
    out[0] = input[0];
    out[1] = ((x(0) * 3 + x(1) + 2) >> 2) as u8;
    for i in 1..w - 1 {
        let n = 3 * x(i) + 2;
        out[2 * i] = ((n + x(i - 1)) >> 2) as u8;
        out[2 * i + 1] = ((n + x(i + 1)) >> 2) as u8;
    }
    let i = w - 1;
    out[2 * i] = ((x(w - 2) * 3 + x(w - 1) + 2) >> 2) as u8;
    out[2 * i + 1] = input[w - 1];
}

/// 2x2, 3:1 weights in both directions (9:3:3:1).
fn upsample_hv2(out: &mut [u8], near: &[u8], far: &[u8]) {
    let w = near.len();
    let col = |i: usize| 3 * u32::from(near[i]) + u32::from(far[i]);
    if w == 1 {
        let v = ((col(0) + 2) >> 2) as u8;
        out[0] = v;
        out[1] = v;
        return;
    }
    let mut t1 = col(0);
    out[0] = ((t1 + 2) >> 2) as u8;
    for i in 1..w {
        let t0 = t1;
        t1 = col(i);
        out[2 * i - 1] = ((3 * t0 + t1 + 8) >> 4) as u8;
        out[2 * i] = ((3 * t1 + t0 + 8) >> 4) as u8;
    }
    out[2 * w - 1] = ((t1 + 2) >> 2) as u8;
}

// YCbCr to RGB constants: 12-bit fixed point (`(int)(x * 4096 + 0.5)`),
// then 8 bits more.
const CR_R: i32 = 5743 << 8;
const CR_G: i32 = 2925 << 8;
const CB_G: i32 = 1410 << 8;
const CB_B: i32 = 7258 << 8;

/// YCbCr to RGB, stb_image's reduced precision (the same in its SIMD and
/// scalar code).
fn ycbcr_to_rgb(out: &mut [u8], y: &[u8], cb: &[u8], cr: &[u8]) {
    for (i, p) in out.chunks_exact_mut(3).enumerate() {
        let y_fixed = (i32::from(y[i]) << 20) + (1 << 19);
        let cr = i32::from(cr[i]) - 128;
        let cb = i32::from(cb[i]) - 128;
        let r = y_fixed + cr * CR_R;
        let g = y_fixed + cr * -CR_G + ((cb * -CB_G) & !0xFFFF);
        let b = y_fixed + cb * CB_B;
        p[0] = (r >> 20).clamp(0, 255) as u8;
        p[1] = (g >> 20).clamp(0, 255) as u8;
        p[2] = (b >> 20).clamp(0, 255) as u8;
    }
}

// The inverse DCT's constants in 12-bit fixed point, as stb_image rounds
// them (`(int)(x * 4096 + 0.5)`, so toward zero for the negative ones).
const C0_541: i32 = 2217;
const C1_848: i32 = -7567;
const C0_765: i32 = 3135;
const C1_176: i32 = 4816;
const C0_299: i32 = 1223;
const C2_053: i32 = 8410;
const C3_073: i32 = 12586;
const C1_501: i32 = 6149;
const C0_900: i32 = -3685;
const C2_563: i32 = -10497;
const C1_962: i32 = -8034;
const C0_390: i32 = -1597;

/// One 8-point inverse DCT (IJG's `jidctint` rotations): the even part's
/// `x0..x3` and the odd part's `t0..t3`, output `k` being `x[k] + t[3 - k]`
/// and output `7 - k` being `x[k] - t[3 - k]`. Wrapping, as C's `int`
/// arithmetic is in practice (only corrupt coefficients get near it).
#[inline(always)]
fn idct_1d(s: [i32; 8]) -> ([i32; 4], [i32; 4]) {
    let w = |a: i32, c: i32| a.wrapping_mul(c);
    let (p2, p3) = (s[2], s[6]);
    let p1 = w(p2.wrapping_add(p3), C0_541);
    let t2 = p1.wrapping_add(w(p3, C1_848));
    let t3 = p1.wrapping_add(w(p2, C0_765));
    let t0 = s[0].wrapping_add(s[4]).wrapping_mul(4096);
    let t1 = s[0].wrapping_sub(s[4]).wrapping_mul(4096);
    let x = [
        t0.wrapping_add(t3),
        t1.wrapping_add(t2),
        t1.wrapping_sub(t2),
        t0.wrapping_sub(t3),
    ];
    let (t0, t1, t2, t3) = (s[7], s[5], s[3], s[1]);
    let p3 = t0.wrapping_add(t2);
    let p4 = t1.wrapping_add(t3);
    let p1 = t0.wrapping_add(t3);
    let p2 = t1.wrapping_add(t2);
    let p5 = w(p3.wrapping_add(p4), C1_176);
    let t0 = w(t0, C0_299);
    let t1 = w(t1, C2_053);
    let t2 = w(t2, C3_073);
    let t3 = w(t3, C1_501);
    let p1 = p5.wrapping_add(w(p1, C0_900));
    let p2 = p5.wrapping_add(w(p2, C2_563));
    let p3 = w(p3, C1_962);
    let p4 = w(p4, C0_390);
    let t = [
        t0.wrapping_add(p1).wrapping_add(p3),
        t1.wrapping_add(p2).wrapping_add(p4),
        t2.wrapping_add(p2).wrapping_add(p3),
        t3.wrapping_add(p1).wrapping_add(p4),
    ];
    (x, t)
}

/// The inverse DCT of a dequantized block (natural order) into 8x8 samples
/// at `out` with rows `stride` apart: columns first, keeping 2 bits more
/// than 8, then rows, rounded, shifted to 0..255 and clamped.
fn idct_block(out: &mut [u8], stride: usize, data: &[i16; 64]) {
    let mut v = [0i32; 64];
    for i in 0..8 {
        let d = |r: usize| i32::from(data[8 * r + i]);
        if (1..8).all(|r| d(r) == 0) {
            let dc = d(0) * 4;
            for r in 0..8 {
                v[8 * r + i] = dc;
            }
            continue;
        }
        let (x, t) = idct_1d([d(0), d(1), d(2), d(3), d(4), d(5), d(6), d(7)]);
        let x = x.map(|x| x.wrapping_add(512));
        for r in 0..4 {
            v[8 * r + i] = x[r].wrapping_add(t[3 - r]) >> 10;
            v[8 * (7 - r) + i] = x[r].wrapping_sub(t[3 - r]) >> 10;
        }
    }
    for (r, row) in v.chunks_exact(8).enumerate() {
        let (x, t) = idct_1d(row.try_into().expect("8 values"));
        let x = x.map(|x| x.wrapping_add(65536 + (128 << 17)));
        let o = &mut out[r * stride..r * stride + 8];
        for k in 0..4 {
            o[k] = (x[k].wrapping_add(t[3 - k]) >> 17).clamp(0, 255) as u8;
            o[7 - k] = (x[k].wrapping_sub(t[3 - k]) >> 17).clamp(0, 255) as u8;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    /// The inverse DCT in `f64`, level-shifted, rounded and clamped.
    fn float_idct(data: &[i16; 64]) -> [u8; 64] {
        let c = |u: usize| {
            if u == 0 {
                std::f64::consts::FRAC_1_SQRT_2
            } else {
                1.0
            }
        };
        let mut out = [0u8; 64];
        for y in 0..8 {
            for x in 0..8 {
                let mut s = 0.0;
                for v in 0..8 {
                    for u in 0..8 {
                        let cos = |p: usize, f: usize| {
                            ((2 * p + 1) as f64 * f as f64 * std::f64::consts::PI / 16.0).cos()
                        };
                        s += c(u) * c(v) * f64::from(data[8 * v + u]) * cos(x, u) * cos(y, v);
                    }
                }
                out[8 * y + x] = (s / 4.0 + 128.0).round().clamp(0.0, 255.0) as u8;
            }
        }
        out
    }

    proptest::proptest! {
        /// The integer inverse DCT is within one of the exact one, for the
        /// sparse, mostly small coefficients of real blocks.
        #[test]
        fn idct_is_within_one_of_the_exact_transform(
            coeffs in proptest::collection::vec((0usize..64, -600i16..600), 1..12),
            dc in -1000i16..1000,
        ) {
            let mut data = [0i16; 64];
            data[0] = dc;
            for (k, v) in coeffs {
                data[usize::from(ZIGZAG[k])] = v;
            }
            let mut out = [0u8; 64];
            idct_block(&mut out, 8, &data);
            let want = float_idct(&data);
            for i in 0..64 {
                proptest::prop_assert!(
                    (i32::from(out[i]) - i32::from(want[i])).abs() <= 1,
                    "sample {}: {} against {}", i, out[i], want[i]
                );
            }
        }

        /// Any bytes after a start-of-image marker, and any cut or changed
        /// byte of a real JPEG, give an image or an error: never a panic.
        #[test]
        fn bad_input_is_an_error_not_a_panic(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..600),
            seed in 0u32..1000,
            cut in 0.0f64..1.0,
            flips in proptest::collection::vec((0.0f64..1.0, 1u8..=255), 0..4),
            progressive in proptest::prelude::any::<bool>(),
        ) {
            let _ = decode(&bytes);
            let mut with_soi = vec![0xFF, 0xD8];
            with_soi.extend_from_slice(&bytes);
            let _ = decode(&with_soi);
            let full = if progressive {
                PROGRESSIVE.to_vec()
            } else {
                sample_jpeg(24, 16, seed)
            };
            let n = (cut * full.len() as f64) as usize;
            proptest::prop_assert!(decode(&full[..n]).is_err());
            let mut changed = full.clone();
            for (at, x) in flips {
                let i = (at * changed.len() as f64) as usize;
                changed[i] ^= x;
            }
            if let Ok(img) = decode(&changed) {
                proptest::prop_assert_eq!(img.data.len(), img.width * img.height * 3);
            }
        }
    }

    /// A progressive JPEG with successive approximation (libjpeg's).
    const PROGRESSIVE: &[u8] = include_bytes!("../../tests/data/jpeg/progressive.jpg");

    /// A `w` x `h` JPEG of noisy gradients, encoded by the `image` crate
    /// (baseline 4:2:0).
    fn sample_jpeg(w: u32, h: u32, seed: u32) -> Vec<u8> {
        let pixels = (0..w * h * 3)
            .map(|i| {
                let noise = (i.wrapping_mul(2_654_435_761).wrapping_add(seed) >> 27) as u8;
                ((i / 3 % w) * 5 + (i / 3 / w) * 3 + (i % 3) * 40) as u8 ^ noise
            })
            .collect();
        let mut out = Vec::new();
        image::RgbImage::from_raw(w, h, pixels)
            .unwrap()
            .write_to(&mut Cursor::new(&mut out), image::ImageFormat::Jpeg)
            .unwrap();
        out
    }

    /// A baseline JPEG's pixels, decoded by the `image` crate.
    fn image_crate_decode(bytes: &[u8]) -> Vec<u8> {
        image::load_from_memory(bytes).unwrap().to_rgb8().into_raw()
    }

    #[test]
    fn decodes_what_another_decoder_decodes_within_rounding() {
        for (w, h) in [(1, 1), (7, 5), (16, 16), (37, 23), (64, 9)] {
            let jpeg = sample_jpeg(w, h, w * h);
            let ours = decode(&jpeg).unwrap();
            assert_eq!((ours.width, ours.height), (w as usize, h as usize));
            let theirs = image_crate_decode(&jpeg);
            let worst = ours
                .data
                .iter()
                .zip(&theirs)
                .map(|(&a, &b)| (i32::from(a) - i32::from(b)).abs())
                .max()
                .unwrap();
            // Upsampling and colour conversion differ between the two; on
            // these images by a few levels (stb_image's right-edge weights
            // are not in play: 4:2:0 uses the 2x2 filter).
            assert!(worst <= 6, "{w}x{h}: {worst}");
            assert_eq!(dimensions(&jpeg).unwrap(), (w as usize, h as usize));
        }
    }

    #[test]
    fn upsampling_keeps_stb_images_weights() {
        // 2x horizontally: 3:1 weights, but the last pair's first sample
        // weighs the second-to-last input by 3 (stb_image's; 80 elsewhere).
        let mut out = [0u8; 6];
        upsample_h2(&mut out, &[10, 50, 90]);
        assert_eq!(out, [10, 20, 40, 60, 60, 90]);
        let mut out = [0u8; 2];
        upsample_h2(&mut out, &[77]);
        assert_eq!(out, [77, 77]);
        // 2x2: 9:3:3:1 inside, 3:1 vertically only at the row's ends.
        let mut out = [0u8; 4];
        upsample_hv2(&mut out, &[0, 160], &[80, 0]);
        assert_eq!(out, [20, 45, 95, 120]);
        let mut out = [0u8; 2];
        upsample_hv2(&mut out, &[100], &[0]);
        assert_eq!(out, [75, 75]);
    }

    #[test]
    fn colour_conversion_is_stb_images_fixed_point() {
        let mut out = [0u8; 3 * 4];
        ycbcr_to_rgb(
            &mut out,
            &[100, 0, 255, 128],
            &[128, 128, 128, 0],
            &[128, 255, 0, 255],
        );
        assert_eq!(out[..3], [100, 100, 100]);
        for (i, (y, cb, cr)) in [(0, 128, 255), (255, 128, 0), (128, 0, 255)]
            .into_iter()
            .enumerate()
        {
            let (y, cb, cr) = (f64::from(y), f64::from(cb) - 128.0, f64::from(cr) - 128.0);
            let want = [
                y + 1.402 * cr,
                y - 0.344_14 * cb - 0.714_14 * cr,
                y + 1.772 * cb,
            ];
            for (c, w) in want.iter().enumerate() {
                let got = f64::from(out[3 * (i + 1) + c]);
                assert!(
                    (got - w.round().clamp(0.0, 255.0)).abs() <= 1.0,
                    "{i} {c}: {got} {w}"
                );
            }
        }
        assert_eq!(blinn_8x8(255, 255), 255);
        assert_eq!(blinn_8x8(255, 0), 0);
        assert_eq!(blinn_8x8(128, 128), 64);
    }

    #[test]
    fn a_flood_of_scans_is_refused() {
        // The progressive fixture's last scan again and again before the end.
        let eoi = PROGRESSIVE.len() - 2;
        let last_sos = PROGRESSIVE
            .windows(2)
            .rposition(|w| w == [0xFF, 0xDA])
            .unwrap();
        let scan = &PROGRESSIVE[last_sos..eoi];
        let with = |copies: usize| {
            let mut f = PROGRESSIVE[..eoi].to_vec();
            for _ in 0..copies {
                f.extend_from_slice(scan);
            }
            f.extend_from_slice(&PROGRESSIVE[eoi..]);
            decode(&f)
        };
        with(3).unwrap();
        let e = with(200).unwrap_err();
        assert!(e.contains("too many scans"), "{e}");
    }

    #[test]
    fn a_huffman_table_with_too_many_codes_is_refused() {
        let mut counts = [0u8; 16];
        counts[0] = 3; // three 1-bit codes
        assert!(Huffman::new(&counts, &[1, 2, 3]).is_err());
        counts[0] = 2;
        assert!(Huffman::new(&counts, &[1, 2]).is_ok());
    }

    #[test]
    fn refused_files_say_why() {
        let jpeg = sample_jpeg(8, 8, 1);
        let sof = jpeg.windows(2).position(|w| w == [0xFF, 0xC0]).unwrap();
        let with = |at: usize, b: u8| {
            let mut j = jpeg.clone();
            j[at] = b;
            decode(&j).unwrap_err()
        };
        assert!(with(sof + 1, 0xC9).contains("arithmetic"));
        assert!(with(sof + 1, 0xC3).contains("lossless"));
        assert!(with(sof + 4, 12).contains("12-bit"));
        // Width 0xFFxx: past the longest side accepted.
        assert!(with(sof + 7, 0xFF).contains("too large"));
        assert!(with(sof + 9, 2).contains("components"));
        assert!(decode(b"\xFF\xD8\xFF\xD9")
            .unwrap_err()
            .contains("unexpected"));
        assert!(decode(b"GIF89a").unwrap_err().contains("not a JPEG"));
        let e = decode(&jpeg[..jpeg.len() - 2]).unwrap_err();
        assert!(e.contains("end-of-image"), "{e}");
        // Trailing bytes after the end are ignored, as decoders do.
        let mut trailing = jpeg.clone();
        trailing.extend_from_slice(b"\0\0junk\xff");
        assert_eq!(decode(&trailing).unwrap(), decode(&jpeg).unwrap());
    }
}
