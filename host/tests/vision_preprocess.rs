//! Image preprocessing: the llava-uhd slicing MiniCPM-V uses (overview size, grid
//! choice, refined size, slice rectangles) for several sizes and aspect ratios,
//! with the expected values worked out by hand from llama.cpp's
//! `mtmd_image_preprocessor_llava_uhd` (`mtmd-image.cpp`); Qwen3-VL's resize to
//! a token budget, likewise from `mtmd_image_preprocessor_dyn_size` and
//! `calc_size_preserved_ratio`; the resize kernels; image decoding and its
//! limits.

use les::vision::image::{check_dimensions, decode_image, RgbImage};
use les::vision::preprocess::{
    ensure_divide, get_best_grid, get_best_resize, normalize, resize, resize_padded, slice_image,
    slice_instructions, smart_resize, ResizeAlgo, SliceInstructions,
};

/// MiniCPM-V 4.6: 448 slices, patch 14 x merge 4 = 56.
fn minicpmv46(w: usize, h: usize) -> SliceInstructions {
    slice_instructions((w, h), 448, 56, 9)
}

fn slices(cols: usize, rows: usize, w: usize, h: usize) -> Vec<(usize, usize, usize, usize)> {
    let mut out = Vec::new();
    for r in 0..rows {
        for c in 0..cols {
            out.push((c * w, r * h, w, h));
        }
    }
    out
}

#[test]
fn small_images_are_one_square_overview() {
    for (w, h) in [(448, 448), (300, 200), (64, 48), (1, 448), (448, 1)] {
        let inst = minicpmv46(w, h);
        assert_eq!(inst.overview, (448, 448), "{w}x{h}");
        assert_eq!(inst.grid, (0, 0));
        assert_eq!(inst.refined, (0, 0));
        assert!(inst.slices.is_empty());
    }
}

#[test]
fn landscape_4_3_gets_a_2x2_grid() {
    // 1024x768: overview 516x387 scaled to ~448^2 pixels, aligned to 504x392;
    // 786432 / 448^2 = 3.92 -> 4 slices; of the 3/4/5-slice grids 2x2 is closest
    // to ln(4/3); each 512x384 cell resized like the overview.
    let inst = minicpmv46(1024, 768);
    assert_eq!(inst.overview, (504, 392));
    assert_eq!(inst.grid, (2, 2));
    assert_eq!(inst.refined, (1008, 784));
    assert_eq!(inst.slices, slices(2, 2, 504, 392));
}

#[test]
fn wide_panorama_gets_one_row() {
    // 1920x480 (4:1): 4.59 -> 5 slices; 4x1 matches ln 4 exactly.
    let inst = minicpmv46(1920, 480);
    assert_eq!(inst.overview, (896, 224));
    assert_eq!(inst.grid, (4, 1));
    assert_eq!(inst.refined, (1792, 448));
    assert_eq!(inst.slices, slices(4, 1, 448, 448));
}

#[test]
fn tall_image_gets_one_column() {
    // 400x1000: 1.99 -> 2 slices; among 1x2, 2x1, 1x3, 3x1, 1x3 is closest to
    // ln 0.4; the cells are 400x333, resized up to 504x392.
    let inst = minicpmv46(400, 1000);
    assert_eq!(inst.overview, (280, 728));
    assert_eq!(inst.grid, (1, 3));
    assert_eq!(inst.refined, (504, 1176));
    assert_eq!(inst.slices, slices(1, 3, 504, 392));
}

#[test]
fn large_square_is_capped_at_nine_slices() {
    let inst = minicpmv46(2000, 2000);
    assert_eq!(inst.overview, (448, 448));
    assert_eq!(inst.grid, (3, 3));
    assert_eq!(inst.refined, (1344, 1344));
    assert_eq!(inst.slices, slices(3, 3, 448, 448));
}

#[test]
fn demo_image_with_the_synthetic_projector() {
    // The bundled 320x240 image through the synthetic projector (224 slices,
    // align 56): overview 280x168, two 168x280 slices side by side.
    let inst = slice_instructions((320, 240), 224, 56, 9);
    assert_eq!(inst.overview, (280, 168));
    assert_eq!(inst.grid, (2, 1));
    assert_eq!(inst.refined, (336, 280));
    assert_eq!(inst.slices, slices(2, 1, 168, 280));
}

#[test]
fn every_slice_tiles_the_refined_image_in_aligned_sizes() {
    for (w, h) in [
        (449, 449),
        (640, 480),
        (480, 640),
        (1280, 720),
        (720, 1280),
        (3000, 500),
        (500, 3000),
        (4096, 4096),
        (900, 450),
        (1000, 1001),
    ] {
        let inst = minicpmv46(w, h);
        let (cols, rows) = inst.grid;
        assert!(
            cols * rows >= 2 && cols * rows <= 9,
            "{w}x{h}: {:?}",
            inst.grid
        );
        assert_eq!(inst.slices.len(), cols * rows);
        assert_eq!(inst.overview.0 % 56, 0);
        assert_eq!(inst.overview.1 % 56, 0);
        let (sw, sh) = (inst.refined.0 / cols, inst.refined.1 / rows);
        assert_eq!((sw % 56, sh % 56), (0, 0), "{w}x{h}");
        assert_eq!(inst.slices, slices(cols, rows, sw, sh), "{w}x{h}");
        // The grid's shape follows the aspect ratio.
        if w >= 2 * h {
            assert!(cols > rows, "{w}x{h}: {:?}", inst.grid);
        }
        if h >= 2 * w {
            assert!(rows > cols, "{w}x{h}: {:?}", inst.grid);
        }
    }
}

/// Qwen3-VL (patch 16, 2x2 merge): sides in multiples of 32, between 8 and
/// 4096 merged tokens (`clip.cpp`: `set_limit_image_tokens(8, 4096)` times a
/// merged token's 32² pixels).
fn qwen3vl(w: usize, h: usize) -> (usize, usize) {
    smart_resize((w, h), 32, 8 * 32 * 32, 4096 * 32 * 32)
}

#[test]
fn qwen3vl_sizes_follow_llama_cpps_smart_resize() {
    // llama.cpp's `calc_size_preserved_ratio`: each side rounded to the
    // nearest multiple of 32 (at least 32), in f32 with `std::round`.
    // 300x200: 9.375 -> 9, 6.25 -> 6.
    assert_eq!(qwen3vl(300, 200), (288, 192));
    // 97x411: 3.03 -> 3, 12.84 -> 13; 96 x 416 = 39936 pixels, in budget.
    assert_eq!(qwen3vl(97, 411), (96, 416));
    // Already multiples of 32: unchanged, however thin (5000x20: 156.25 ->
    // 156, 0.625 -> 1; 159744 pixels, 156 tokens of 1 row).
    assert_eq!(qwen3vl(256, 256), (256, 256));
    assert_eq!(qwen3vl(5000, 20), (4992, 32));
    assert_eq!(qwen3vl(20, 5000), (32, 4992));
    // Under 8192 pixels (8 tokens): scaled by sqrt(8192 / (w h)), each side
    // rounded up: 64x64 -> 90.5 -> 96; 1x1: at least 32 a side first (1024
    // pixels), then 1 x 90.5 -> 96; 90x91 rounds to 96x96 = 9216, in budget.
    assert_eq!(qwen3vl(64, 64), (96, 96));
    assert_eq!(qwen3vl(1, 1), (96, 96));
    assert_eq!(qwen3vl(32, 32), (96, 96));
    assert_eq!(qwen3vl(90, 91), (96, 96));
    // Over 4194304 pixels (4096 tokens): rounded to 2208 x 2016 = 4451328, so
    // scaled by 1 / sqrt(2200 x 2000 / 4194304) = 1 / 1.02423, each side
    // rounded down: 2147.96 -> 2144 (67 x 32), 1952.69 -> 1952 (61 x 32).
    assert_eq!(qwen3vl(2200, 2000), (2144, 1952));
    // 4000x3000: 4000 x 3008 is over; beta = sqrt(12e6 / 4194304) = 1.69146:
    // 2364.85 -> 2336, 1773.64 -> 1760 (73 x 55 = 4015 tokens).
    assert_eq!(qwen3vl(4000, 3000), (2336, 1760));
    // 16384² is 64 times the budget: beta 8, 2048 a side (64 x 64 tokens).
    assert_eq!(qwen3vl(16384, 16384), (2048, 2048));
    // Exactly the budget is kept (the test is "more than").
    assert_eq!(qwen3vl(2048, 2048), (2048, 2048));
    for (w, h) in [(1, 1), (333, 777), (1023, 1025), (6000, 4000), (16384, 1)] {
        let (rw, rh) = qwen3vl(w, h);
        assert!(rw % 32 == 0 && rh % 32 == 0 && rw > 0 && rh > 0, "{w}x{h}");
        let tokens = (rw / 32) * (rh / 32);
        assert!((8..=4096).contains(&tokens), "{w}x{h}: {tokens} tokens");
    }
    // Qwen2-VL's patch 14 (a merged token 28 pixels a side): 1024x768 ->
    // 36.57 -> 37, 27.43 -> 27.
    assert_eq!(
        smart_resize((1024, 768), 28, 8 * 28 * 28, 4096 * 28 * 28),
        (1036, 756)
    );
    assert_eq!(smart_resize((0, 10), 32, 0, 0), (0, 0));
}

#[test]
fn qwen3vl_preprocessing_is_one_padded_chunk() {
    use les::synth::{write_mmproj, MmprojConfig};
    use les::vision::{image_layout, merged_grid, preprocess_image, ClipModel, ProjectorType};
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("pre_q3vl.gguf");
    write_mmproj(&MmprojConfig::tiny(ProjectorType::Qwen3Vl, 32, 1), &path).unwrap();
    let m = ClipModel::open(&path).unwrap();
    assert_eq!(m.row_width(), 32 * 4);
    // 97x411 -> 96x416: scaled by 96 / 97 to 96 x 407 (rounded up), centred
    // on black (llama.cpp's default PAD_CEIL): 4 rows above, 5 below.
    let img = RgbImage::filled(97, 411, [255, 255, 255]);
    let pre = preprocess_image(&m, &img);
    assert_eq!(pre.grid, (0, 0));
    assert_eq!(pre.chunks.len(), 1);
    let c = &pre.chunks[0];
    assert_eq!((c.width, c.height), (96, 416));
    // Normalised with mean 0.5, std 0.5: black is -1, white 1.
    let at = |x: usize, y: usize| c.data[3 * (y * c.width + x)];
    for y in [0, 3, 411, 415] {
        assert_eq!(at(50, y), -1.0, "row {y}");
    }
    for y in [4, 200, 410] {
        assert_eq!(at(50, y), 1.0, "row {y}");
    }
    assert_eq!(merged_grid(&m, 97, 411), (3, 13));
    assert_eq!(image_layout(&m, (97, 411)).chunk_tokens, [39]);
    assert_eq!(merged_grid(&m, 2200, 2000), (67, 61));
}

#[test]
fn grid_choice_and_rounding_helpers() {
    // Ties keep the first candidate: (1, 2) before (2, 1) for a square image.
    assert_eq!(get_best_grid(9, 2, 0.0), (1, 2));
    assert_eq!(get_best_grid(9, 4, 0.0), (2, 2));
    assert_eq!(get_best_grid(9, 9, 0.0), (3, 3));
    assert_eq!(get_best_grid(9, 6, (3.0f32 / 2.0).ln()), (3, 2));
    // 1 is never a grid; 9 is the cap.
    assert_eq!(get_best_grid(9, 1, 0.0), (1, 2));
    assert_eq!(get_best_grid(9, 9, 10.0), (9, 1));
    assert_eq!(ensure_divide(516, 56), 504);
    assert_eq!(ensure_divide(10, 56), 56);
    assert_eq!(ensure_divide(1000, 3), 999);
    assert_eq!(get_best_resize((300, 200), 448, 56, false), (280, 224));
    assert_eq!(get_best_resize((300, 200), 448, 56, true), (560, 392));
}

fn gradient(w: usize, h: usize) -> RgbImage {
    let mut img = RgbImage::filled(w, h, [0; 3]);
    for y in 0..h {
        for x in 0..w {
            img.set_pixel(
                x,
                y,
                [
                    (x * 7 % 256) as u8,
                    (y * 5 % 256) as u8,
                    ((x + y) % 256) as u8,
                ],
            );
        }
    }
    img
}

#[test]
fn resizing_keeps_flat_colours_and_shapes() {
    let flat = RgbImage::filled(37, 23, [10, 200, 77]);
    for algo in [ResizeAlgo::Bicubic, ResizeAlgo::Bilinear] {
        for (w, h) in [(64, 64), (5, 3), (37, 23), (100, 11)] {
            let r = resize(&flat, w, h, algo);
            assert_eq!((r.width, r.height, r.data.len()), (w, h, w * h * 3));
            assert!(
                r.data.chunks(3).all(|p| p == [10, 200, 77]),
                "{algo:?} {w}x{h}"
            );
        }
    }
    // Same size: a copy.
    let g = gradient(30, 20);
    assert_eq!(resize(&g, 30, 20, ResizeAlgo::Bicubic), g);
}

/// The test image of [`resizing_is_pillows`] (and of the script there).
fn pattern(w: usize, h: usize) -> RgbImage {
    let mut img = RgbImage::filled(w, h, [0; 3]);
    for y in 0..h {
        for x in 0..w {
            let v = |c: usize| {
                ((x * 7 + y * 13 + c * 29 + (x * y) % 17 + ((x ^ y) & 8) * 9) % 256) as u8
            };
            img.set_pixel(x, y, [v(0), v(1), v(2)]);
        }
    }
    img
}

/// Resizing is Pillow's, byte for byte, as llama.cpp's `mtmd` (`resize_pillow`)
/// makes it: the CRC-32 of each output below is Pillow 11.3.0's, from
///
/// ```python
/// from PIL import Image; import zlib
/// src = Image.frombytes("RGB", (sw, sh), bytes(pattern))  # as `pattern` here
/// zlib.crc32(src.resize((dw, dh), Image.BILINEAR or Image.BICUBIC).tobytes())
/// ```
///
/// Shrinking widens the filter (antialiasing) and growing does not; one
/// axis alone, both, to one pixel and from one.
#[test]
fn resizing_is_pillows() {
    let cases = [
        ((64, 48), (30, 20), ResizeAlgo::Bilinear, 0x6e90c183),
        ((64, 48), (30, 20), ResizeAlgo::Bicubic, 0x4abc7107),
        ((64, 48), (17, 61), ResizeAlgo::Bilinear, 0xb2996313),
        ((64, 48), (17, 61), ResizeAlgo::Bicubic, 0x5dae9447),
        ((37, 23), (90, 51), ResizeAlgo::Bilinear, 0x8fdb3524),
        ((37, 23), (90, 51), ResizeAlgo::Bicubic, 0xecc1b68b),
        ((100, 80), (100, 33), ResizeAlgo::Bilinear, 0xffea1622),
        ((100, 80), (100, 33), ResizeAlgo::Bicubic, 0x28fcf543),
        ((100, 80), (41, 80), ResizeAlgo::Bilinear, 0xeec1cf50),
        ((100, 80), (41, 80), ResizeAlgo::Bicubic, 0x0718baff),
        ((13, 9), (448, 448), ResizeAlgo::Bilinear, 0x947502ce),
        ((13, 9), (448, 448), ResizeAlgo::Bicubic, 0x9c8f78b9),
        ((640, 480), (448, 336), ResizeAlgo::Bilinear, 0xae33a5ef),
        ((640, 480), (448, 336), ResizeAlgo::Bicubic, 0xd11703d1),
        ((333, 517), (224, 224), ResizeAlgo::Bilinear, 0xbeb2d2e1),
        ((333, 517), (224, 224), ResizeAlgo::Bicubic, 0x0f375f7c),
        ((5, 3), (1, 1), ResizeAlgo::Bilinear, 0x3b19f31f),
        ((5, 3), (1, 1), ResizeAlgo::Bicubic, 0x3b19f31f),
        ((1, 1), (7, 5), ResizeAlgo::Bilinear, 0x08435188),
        ((1, 1), (7, 5), ResizeAlgo::Bicubic, 0x08435188),
        ((300, 200), (560, 392), ResizeAlgo::Bilinear, 0xbd439507),
        ((300, 200), (560, 392), ResizeAlgo::Bicubic, 0xd0c5c711),
    ];
    for ((sw, sh), (dw, dh), algo, want) in cases {
        let r = resize(&pattern(sw, sh), dw, dh, algo);
        assert_eq!((r.width, r.height), (dw, dh));
        assert_eq!(crc32(&r.data), want, "{sw}x{sh} -> {dw}x{dh} {algo:?}");
    }
}

#[test]
fn padded_resize_centres_the_image() {
    // 40x20 into 30x30: scaled to 30x15, centred with 7 rows of padding above.
    let img = RgbImage::filled(40, 20, [255, 255, 255]);
    let r = resize_padded(&img, 30, 30, ResizeAlgo::Bilinear, [0, 0, 0]);
    assert_eq!((r.width, r.height), (30, 30));
    for y in 0..30 {
        let inside = (7..22).contains(&y);
        assert_eq!(
            r.pixel(15, y),
            if inside { [255; 3] } else { [0; 3] },
            "row {y}"
        );
    }
}

#[test]
fn slicing_and_normalisation() {
    let img = gradient(1024, 768);
    let inst = minicpmv46(1024, 768);
    let s = slice_image(&img, &inst);
    assert_eq!((s.overview.width, s.overview.height), (504, 392));
    assert_eq!(s.slices.len(), 4);
    assert!(s.slices.iter().all(|i| (i.width, i.height) == (504, 392)));
    let n = normalize(&s.overview, [0.5; 3], [0.5; 3]);
    assert_eq!(n.data.len(), 504 * 392 * 3);
    assert!(n.data.iter().all(|v| (-1.0..=1.0).contains(v)));
    let p = s.overview.pixel(3, 4);
    assert_eq!(
        n.data[3 * (4 * 504 + 3)],
        (f32::from(p[0]) / 255.0 - 0.5) / 0.5
    );
}

#[test]
fn image_decoding_and_limits() {
    let png = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../assets/test-image.png"
    ))
    .expect("the bundled test image");
    let img = decode_image(&png).unwrap();
    assert_eq!((img.width, img.height), (320, 240));
    assert_eq!(img.pixel(0, 0), [110, 170, 235]); // sky
    assert_eq!(img.pixel(255, 50), [250, 210, 40]); // sun
    assert_eq!(img.pixel(130, 180), [90, 55, 25]); // door

    // JPEG, through the image crate's encoder.
    let mut jpeg = Vec::new();
    let buf = image::RgbImage::from_raw(320, 240, img.data.clone()).unwrap();
    buf.write_to(
        &mut std::io::Cursor::new(&mut jpeg),
        image::ImageFormat::Jpeg,
    )
    .unwrap();
    let j = decode_image(&jpeg).unwrap();
    assert_eq!((j.width, j.height), (320, 240));
    let sky = j.pixel(10, 10);
    assert!(
        sky.iter()
            .zip([110, 170, 235])
            .all(|(a, b)| a.abs_diff(b) < 12),
        "{sky:?}"
    );

    // A PNG header claiming 100000 x 100000 pixels is refused before decoding.
    let mut huge = png[..33].to_vec();
    huge[16..20].copy_from_slice(&100_000u32.to_be_bytes());
    huge[20..24].copy_from_slice(&100_000u32.to_be_bytes());
    let crc = crc32(&huge[12..29]);
    huge[29..33].copy_from_slice(&crc.to_be_bytes());
    huge.extend_from_slice(&png[33..]);
    let e = decode_image(&huge).unwrap_err().to_string();
    assert!(e.contains("too large"), "{e}");
    assert!(check_dimensions(0, 5).is_err());
    assert!(check_dimensions(16384, 4096).is_ok());
    assert!(check_dimensions(16385, 1).is_err());

    // A format llama.cpp's stb_image does not read either (WebP), and a GIF
    // whose header is garbage.
    let e = decode_image(b"RIFF\0\0\0\0WEBPVP8 ")
        .unwrap_err()
        .to_string();
    assert!(e.contains("unsupported image format WebP"), "{e}");
    let e = decode_image(b"GIF89a not really").unwrap_err().to_string();
    assert!(!e.is_empty());
    let e = decode_image(&png[..100]).unwrap_err().to_string();
    assert!(!e.is_empty());
}

fn crc32(data: &[u8]) -> u32 {
    let mut c = !0u32;
    for &b in data {
        c ^= u32::from(b);
        for _ in 0..8 {
            c = if c & 1 != 0 {
                0xEDB8_8320 ^ (c >> 1)
            } else {
                c >> 1
            };
        }
    }
    !c
}
