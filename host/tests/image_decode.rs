//! Image files decode to llama.cpp's pixels: the JPEG fixtures in
//! `tests/data/jpeg` (one layout or coding feature each, written by
//! `scripts/jpeg_fixtures.py`) against the CRCs of what llama.cpp's
//! stb_image gives for them, 16-bit PNGs cut to 8 bits as stb_image cuts
//! them, GIF, BMP and PPM as stb_image reads them, and (ignored: needs llama-cpp-python with its `mtmd` library) all
//! of it against libmtmd itself, also on any files a user adds.

mod common;

use std::path::{Path, PathBuf};

use les::vision::image::load_image;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/jpeg")
        .join(name)
}

/// File, width, height, and the CRC-32 of the RGB bytes llama.cpp 0.3.36
/// reads from it (`mtmd_llama.py decode`: `mtmd_helper_bitmap_init_from_file`,
/// stb_image 2.30 built with SSE2).
const FIXTURES: [(&str, usize, usize, u32); 23] = [
    ("b420.jpg", 45, 31, 0x5b3e_4a47),
    // 4:2:2 of an odd width: stb_image's own weights in the last column.
    ("b422.jpg", 45, 31, 0x5715_9ce3),
    ("b444.jpg", 45, 31, 0x3a87_3ac5),
    // Adobe CMYK (inverted, transform 0).
    ("cmyk.jpg", 61, 47, 0xdf1f_d539),
    ("gray_progressive.jpg", 61, 47, 0xa076_f177),
    ("optimized.jpg", 61, 47, 0xc7d7_7fa5),
    // Spectral selection and successive approximation.
    ("progressive.jpg", 61, 47, 0xeae1_87f4),
    ("progressive_restarts.jpg", 61, 47, 0x638e_2ee6),
    ("q100.jpg", 40, 40, 0xfb0c_1e2e),
    // Coarse quantization: samples clamped.
    ("q5.jpg", 40, 40, 0x5fe4_6348),
    // 16-bit quantization tables (extended sequential).
    ("quant16.jpg", 61, 47, 0x7e85_3204),
    // The same coefficients as progressive.jpg, in restart intervals.
    ("restarts.jpg", 61, 47, 0xeae1_87f4),
    ("tiny_17x1.jpg", 17, 1, 0x239c_bc37),
    ("tiny_1x1.jpg", 1, 1, 0xda3d_6047),
    ("tiny_1x17.jpg", 1, 17, 0x8ff6_3270),
    // Layouts libjpeg does not write (the script's own encoder).
    // RGB without a transform, told by Adobe's APP14 or by the ids R G B.
    ("adobe_rgb.jpg", 41, 23, 0xffc5_25f1),
    ("ids_rgb.jpg", 41, 23, 0xffc5_25f1),
    ("adobe_ycck.jpg", 41, 23, 0xaaad_5caf),
    // Upsampled by replication (stb_image's generic case).
    ("sampling_31.jpg", 41, 23, 0xd18d_ce3c),
    ("sampling_411.jpg", 41, 23, 0xfab9_66cd),
    // 2x vertically only.
    ("sampling_440.jpg", 41, 23, 0x58c1_dd14),
    // Chroma planes of different sizes.
    ("sampling_mixed.jpg", 41, 23, 0x0189_d600),
    // Non-interleaved scans, with restart intervals.
    ("scan_per_component.jpg", 41, 23, 0x2702_5556),
];

#[test]
fn fixtures_decode_to_llama_cpps_pixels() {
    for (name, w, h, crc) in FIXTURES {
        let img = load_image(&fixture(name)).unwrap();
        assert_eq!((img.width, img.height), (w, h), "{name}");
        assert_eq!(crc32fast::hash(&img.data), crc, "{name}");
        let probed = les::vision::probe_image(&fixture(name)).unwrap();
        assert_eq!(probed, (w, h), "{name}");
    }
}

/// PNGs of every sample layout the `image` crate writes.
fn pngs() -> Vec<PathBuf> {
    use image::{ImageBuffer, Luma, LumaA, Rgb, Rgba};
    let (w, h) = (29, 13);
    let v = |x: u32, y: u32, c: u32| {
        (x.wrapping_mul(2_654_435_761) ^ y.wrapping_mul(40_503) ^ c.wrapping_mul(9_973))
            .wrapping_mul(2_246_822_519)
            >> 16
    };
    let path = |name: &str| common::tmp(&format!("image_decode_{name}.png"));
    let out = vec![
        path("rgb16"),
        path("rgba16"),
        path("gray16"),
        path("graya16"),
        path("rgba8"),
        path("graya8"),
    ];
    ImageBuffer::from_fn(w, h, |x, y| Rgb([0, 1, 2].map(|c| v(x, y, c) as u16)))
        .save(&out[0])
        .unwrap();
    ImageBuffer::from_fn(w, h, |x, y| Rgba([0, 1, 2, 3].map(|c| v(x, y, c) as u16)))
        .save(&out[1])
        .unwrap();
    ImageBuffer::from_fn(w, h, |x, y| Luma([v(x, y, 0) as u16]))
        .save(&out[2])
        .unwrap();
    ImageBuffer::from_fn(w, h, |x, y| LumaA([0, 1].map(|c| v(x, y, c) as u16)))
        .save(&out[3])
        .unwrap();
    ImageBuffer::from_fn(w, h, |x, y| Rgba([0, 1, 2, 3].map(|c| v(x, y, c) as u8)))
        .save(&out[4])
        .unwrap();
    ImageBuffer::from_fn(w, h, |x, y| LumaA([0, 1].map(|c| v(x, y, c) as u8)))
        .save(&out[5])
        .unwrap();
    out
}

/// A GIF (four colours, one of them transparent), a BMP and a PPM of the
/// same picture, written by the `image` crate; and the picture.
fn lossless_others() -> (Vec<PathBuf>, image::RgbaImage) {
    let colours = [
        [200, 30, 40, 255],
        [10, 220, 90, 255],
        [0, 0, 0, 0],
        [250, 250, 5, 255],
    ];
    let img = image::RgbaImage::from_fn(23, 11, |x, y| {
        image::Rgba(colours[((x * 7 + y * 3 + x * y) % 4) as usize])
    });
    let path = |ext: &str| common::tmp(&format!("image_decode_other.{ext}"));
    let files = vec![path("gif"), path("bmp"), path("ppm")];
    img.save(&files[0]).unwrap();
    image::DynamicImage::ImageRgba8(img.clone())
        .to_rgb8()
        .save(&files[1])
        .unwrap();
    // Binary (P6), the PNM stb_image reads.
    let rgb = image::DynamicImage::ImageRgba8(img.clone()).to_rgb8();
    let mut ppm = format!("P6\n# les\n{} {}\n255\n", rgb.width(), rgb.height()).into_bytes();
    ppm.extend_from_slice(rgb.as_raw());
    std::fs::write(&files[2], ppm).unwrap();
    (files, img)
}

#[test]
fn gif_bmp_and_ppm_decode_as_stb_image_reads_them() {
    let (files, img) = lossless_others();
    for path in &files {
        let ours = load_image(path).unwrap();
        assert_eq!((ours.width, ours.height), (23, 11));
        let gif = path.extension().unwrap() == "gif";
        for (i, p) in img.pixels().enumerate() {
            // stb_image's GIF canvas starts black: a transparent pixel is
            // (0, 0, 0) whatever its palette colour.
            let want = if gif && p[3] == 0 {
                [0; 3]
            } else {
                [p[0], p[1], p[2]]
            };
            assert_eq!(
                ours.data[3 * i..3 * i + 3],
                want,
                "{} pixel {i}",
                path.display()
            );
        }
    }
    let tga = common::tmp("image_decode.tga");
    std::fs::write(
        &tga,
        [
            0u8, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 1, 0, 24, 0, 1, 2, 3,
        ],
    )
    .unwrap();
    let e = load_image(&tga).unwrap_err().to_string();
    assert!(
        e.contains("not a PNG, JPEG, GIF, BMP or PPM/PGM image"),
        "{e}"
    );
    // PNM files stb_image does not read (ASCII; other maxima) are refused.
    let pnm = common::tmp("image_decode_refused.ppm");
    for (file, why) in [
        (&b"P3\n1 1\n255\n1 2 3\n"[..], "binary"),
        (&b"P6 1 1 100\n\x01\x02\x03"[..], "maximum value 100"),
    ] {
        std::fs::write(&pnm, file).unwrap();
        let e = load_image(&pnm).unwrap_err().to_string();
        assert!(e.contains(why), "{e}");
    }
}

#[test]
fn sixteen_bit_pngs_keep_their_high_bytes() {
    let files = pngs();
    for (path, channels) in files.iter().zip([3, 4, 1, 2]) {
        let img = load_image(path).unwrap();
        let raw: Vec<u16> = match image::open(path).unwrap() {
            image::DynamicImage::ImageRgb16(i) => i.into_raw(),
            image::DynamicImage::ImageRgba16(i) => i.into_raw(),
            image::DynamicImage::ImageLuma16(i) => i.into_raw(),
            image::DynamicImage::ImageLumaA16(i) => i.into_raw(),
            other => panic!("{}: {:?}", path.display(), other.color()),
        };
        for (i, px) in raw.chunks_exact(channels).enumerate() {
            // Gray repeated, alpha dropped.
            let want = match channels {
                1 | 2 => [px[0]; 3],
                _ => [px[0], px[1], px[2]],
            }
            .map(|v| (v >> 8) as u8);
            assert_eq!(
                img.data[3 * i..3 * i + 3],
                want,
                "{} pixel {i}",
                path.display()
            );
        }
    }
}

/// The decode of every JPEG fixture, of PNGs of each sample layout, of a
/// GIF with transparency, a BMP and a PPM, and of every JPEG, PNG, GIF, BMP,
/// PPM or PGM in the directory `LES_IMAGE_DIR` if set (your own pictures),
/// byte for byte against llama.cpp's: set `MTMD_CPP_LIB` and
/// `LLAMA_CPP_LIB_PATH` as for the other libmtmd comparisons (README,
/// "Against llama.cpp").
#[test]
#[ignore = "needs llama-cpp-python's mtmd library"]
fn images_decode_as_llama_cpps() {
    let mut files: Vec<PathBuf> = FIXTURES.iter().map(|f| fixture(f.0)).collect();
    files.extend(pngs());
    files.extend(lossless_others().0);
    if let Ok(dir) = std::env::var("LES_IMAGE_DIR") {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            let ext = p.extension().and_then(|x| x.to_str()).unwrap_or("");
            let exts = ["jpg", "jpeg", "png", "gif", "bmp", "ppm", "pgm"];
            if exts.iter().any(|x| ext.eq_ignore_ascii_case(x)) {
                files.push(p);
            }
        }
    }
    // Any model and projector: libmtmd wants a context to read files.
    let model = common::tmp("image_decode_text.gguf");
    let status = std::process::Command::new(env!("CARGO_BIN_EXE_les"))
        .args([
            "synth", "--quiet", "--arch", "qwen3moe", "--preset", "tiny", "-o",
        ])
        .arg(&model)
        .status()
        .unwrap();
    assert!(status.success());
    let n_embd = les::gguf::Gguf::open(&model)
        .unwrap()
        .get_u64("qwen3moe.embedding_length")
        .unwrap();
    let mmproj = common::tmp("image_decode_mmproj.gguf");
    let cfg = les::synth::MmprojConfig::tiny(les::vision::ProjectorType::Gemma3, n_embd, 3);
    les::synth::write_mmproj(&cfg, &mmproj).unwrap();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/scripts/mtmd_llama.py");
    let out = std::process::Command::new("python3")
        .arg(script)
        .arg("decode")
        .args([&model, &mmproj])
        .args(&files)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let theirs: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    let mut failures = Vec::new();
    for (path, t) in files.iter().zip(&theirs) {
        let ours = load_image(path);
        let what = path.display();
        match (ours, t.get("rgb")) {
            (Ok(img), Some(rgb)) => {
                let rgb = unhex(rgb.as_str().unwrap());
                let size = (t["width"].as_u64().unwrap(), t["height"].as_u64().unwrap());
                let worst = img
                    .data
                    .iter()
                    .zip(&rgb)
                    .map(|(&a, &b)| a.abs_diff(b))
                    .max()
                    .unwrap_or(0);
                eprintln!("{what}: {}x{}, largest difference {worst}", size.0, size.1);
                if (img.width as u64, img.height as u64) != size || img.data != rgb {
                    failures.push(format!("{what}: differs by up to {worst}"));
                }
            }
            (Err(e), None) => eprintln!("{what}: refused by both ({e})"),
            (Err(e), Some(_)) => failures.push(format!("{what}: les refuses it: {e}")),
            (Ok(_), None) => failures.push(format!("{what}: llama.cpp refuses it")),
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}
