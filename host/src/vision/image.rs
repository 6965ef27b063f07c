//! Decoding image files (PNG, JPEG) into 8-bit RGB, with the dimensions bounded
//! before any pixel is decoded.

use std::io::{Cursor, Read};
use std::path::Path;

use image::{ImageFormat, ImageReader, Limits};

use super::VisionError;

/// The longest side accepted, in pixels.
pub const MAX_SIDE: u32 = 16384;
/// The most pixels accepted (64 Mpx: 192 MiB as RGB).
pub const MAX_PIXELS: u64 = 64 << 20;

/// An 8-bit RGB image, rows top to bottom, pixels `[r, g, b]` left to right.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RgbImage {
    /// Width in pixels.
    pub width: usize,
    /// Height in pixels.
    pub height: usize,
    /// `width * height * 3` bytes.
    pub data: Vec<u8>,
}

impl RgbImage {
    /// A `width` x `height` image filled with `color`.
    pub fn filled(width: usize, height: usize, color: [u8; 3]) -> Self {
        RgbImage {
            width,
            height,
            data: color.repeat(width * height),
        }
    }

    /// The pixel at (`x`, `y`).
    #[inline]
    pub fn pixel(&self, x: usize, y: usize) -> [u8; 3] {
        let i = 3 * (y * self.width + x);
        [self.data[i], self.data[i + 1], self.data[i + 2]]
    }

    /// Sets the pixel at (`x`, `y`).
    #[inline]
    pub fn set_pixel(&mut self, x: usize, y: usize, p: [u8; 3]) {
        let i = 3 * (y * self.width + x);
        self.data[i..i + 3].copy_from_slice(&p);
    }
}

/// Checks that a `width` x `height` image is within [`MAX_SIDE`] and
/// [`MAX_PIXELS`] and not empty.
pub fn check_dimensions(width: u32, height: u32) -> Result<(), String> {
    if width == 0 || height == 0 {
        return Err(format!("empty image ({width}x{height})"));
    }
    if width > MAX_SIDE || height > MAX_SIDE || u64::from(width) * u64::from(height) > MAX_PIXELS {
        return Err(format!(
            "image of {width}x{height} pixels is too large (at most {MAX_SIDE} per side and {} Mpx)",
            MAX_PIXELS >> 20
        ));
    }
    Ok(())
}

/// The largest image file read, in bytes.
pub const MAX_FILE_BYTES: u64 = 256 << 20;

/// Whether the JPEG in `bytes` reaches its end-of-image marker: its segments
/// are walked by their lengths (an embedded thumbnail's markers are skipped),
/// and each scan's entropy-coded data up to the next marker. The decoder fills
/// a truncated file's missing pixels with gray and reports nothing.
pub fn jpeg_is_complete(bytes: &[u8]) -> bool {
    if !bytes.starts_with(&[0xFF, 0xD8]) {
        return false;
    }
    let mut i = 2;
    loop {
        // A marker: 0xFF (fill bytes 0xFF may repeat), then its code.
        if bytes.get(i) != Some(&0xFF) {
            return false;
        }
        while bytes.get(i) == Some(&0xFF) {
            i += 1;
        }
        let Some(&code) = bytes.get(i) else {
            return false;
        };
        i += 1;
        match code {
            0xD9 => return true,
            // Markers without a length.
            0x01 | 0xD0..=0xD7 => continue,
            _ => {}
        }
        let Some(len) = bytes.get(i..i + 2) else {
            return false;
        };
        let len = usize::from(u16::from_be_bytes([len[0], len[1]]));
        if len < 2 {
            return false;
        }
        i += len;
        if code == 0xDA {
            // Entropy-coded data: 0xFF is followed by 0x00 (a stuffed byte) or
            // a restart marker inside it; anything else is the next marker.
            loop {
                match bytes.get(i..i + 2) {
                    None => return false,
                    Some([0xFF, next]) if *next != 0x00 && !(0xD0..=0xD7).contains(next) => break,
                    Some(_) => i += 1,
                }
            }
        }
    }
}

/// `format` if it is one LES decodes (PNG, JPEG); `None` is an unknown one.
fn supported(format: Option<ImageFormat>) -> Result<ImageFormat, String> {
    match format {
        Some(f @ (ImageFormat::Png | ImageFormat::Jpeg)) => Ok(f),
        Some(f) => Err(format!("unsupported image format {f:?} (PNG and JPEG are)")),
        None => Err("not a PNG or JPEG image".into()),
    }
}

fn decode(bytes: &[u8]) -> Result<RgbImage, String> {
    let format = supported(image::guess_format(bytes).ok())?;
    // Before decoding: the decoder would fill a cut file with gray.
    if format == ImageFormat::Jpeg && !jpeg_is_complete(bytes) {
        return Err("the JPEG ends before its end-of-image marker (a truncated file?)".into());
    }
    // The header alone first, to bound the size before decoding.
    let (w, h) = ImageReader::with_format(Cursor::new(bytes), format)
        .into_dimensions()
        .map_err(|e| e.to_string())?;
    check_dimensions(w, h)?;
    let mut reader = ImageReader::with_format(Cursor::new(bytes), format);
    let mut limits = Limits::default();
    limits.max_image_width = Some(MAX_SIDE);
    limits.max_image_height = Some(MAX_SIDE);
    limits.max_alloc = Some(MAX_PIXELS * 8);
    reader.limits(limits);
    let rgb = reader.decode().map_err(|e| e.to_string())?.to_rgb8();
    let (w, h) = rgb.dimensions();
    check_dimensions(w, h)?;
    Ok(RgbImage {
        width: w as usize,
        height: h as usize,
        data: rgb.into_raw(),
    })
}

/// `path` opened for reading, if it is a regular file of at most
/// [`MAX_FILE_BYTES`]; reads from it stop one byte past that bound.
fn open_bounded(path: &Path) -> Result<std::io::Take<std::fs::File>, String> {
    let meta = std::fs::metadata(path).map_err(|e| e.to_string())?;
    // A pipe or a device has no length to check, and may never end.
    if !meta.is_file() {
        return Err("not a regular file".into());
    }
    if meta.len() > MAX_FILE_BYTES {
        return Err(format!(
            "{} bytes is too large for an image file",
            meta.len()
        ));
    }
    // Bounded even if the file grows after the check.
    let file = std::fs::File::open(path).map_err(|e| e.to_string())?;
    Ok(file.take(MAX_FILE_BYTES + 1))
}

/// The width and height of the PNG or JPEG file at `path`, from its header
/// alone (the same checks as [`load_image`] on the file and the dimensions):
/// what an image will cost is known before it is decoded.
pub fn probe_image(path: &Path) -> Result<(usize, usize), VisionError> {
    let err = |m: String| VisionError::Image(format!("{}: {m}", path.display()));
    let file = open_bounded(path).map_err(err)?;
    let reader = ImageReader::new(std::io::BufReader::new(file))
        .with_guessed_format()
        .map_err(|e| err(e.to_string()))?;
    supported(reader.format()).map_err(err)?;
    let (w, h) = reader.into_dimensions().map_err(|e| err(e.to_string()))?;
    check_dimensions(w, h).map_err(err)?;
    Ok((w as usize, h as usize))
}

/// Reads and decodes the PNG or JPEG file at `path` (format from its content).
pub fn load_image(path: &Path) -> Result<RgbImage, VisionError> {
    let err = |m: String| VisionError::Image(format!("{}: {m}", path.display()));
    let mut bytes = Vec::new();
    open_bounded(path)
        .map_err(err)?
        .read_to_end(&mut bytes)
        .map_err(|e| err(e.to_string()))?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(err("too large for an image file".into()));
    }
    decode(&bytes).map_err(err)
}

/// Decodes a PNG or JPEG image held in memory.
pub fn decode_image(bytes: &[u8]) -> Result<RgbImage, VisionError> {
    decode(bytes).map_err(VisionError::Image)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn jpeg(width: u32, height: u32) -> Vec<u8> {
        let pixels = (0..width * height * 3)
            .map(|i| (i * 7 % 251) as u8)
            .collect();
        let mut out = Vec::new();
        image::RgbImage::from_raw(width, height, pixels)
            .unwrap()
            .write_to(&mut Cursor::new(&mut out), ImageFormat::Jpeg)
            .unwrap();
        out
    }

    #[test]
    fn a_jpeg_is_complete_only_up_to_its_end_marker() {
        let full = jpeg(40, 30);
        assert!(jpeg_is_complete(&full));
        decode(&full).unwrap();
        // Trailing bytes after the end are ignored, as decoders do.
        let mut trailing = full.clone();
        trailing.extend_from_slice(b"\0\0junk\xff");
        assert!(jpeg_is_complete(&trailing));
        // Every cut after the header is caught.
        let sos = full.windows(2).position(|w| w == [0xFF, 0xDA]).unwrap();
        for cut in [
            2,
            3,
            sos,
            sos + 20,
            full.len() / 2,
            full.len() - 2,
            full.len() - 1,
        ] {
            assert!(!jpeg_is_complete(&full[..cut]), "cut at {cut}");
        }
        let e = decode(&full[..full.len() - 2]).unwrap_err();
        assert!(e.contains("end-of-image marker"), "{e}");
        // An end marker inside an earlier segment (a thumbnail's, in APP1)
        // does not count: segments are skipped by their lengths.
        let mut app1 = full[..2].to_vec();
        app1.extend_from_slice(&[0xFF, 0xE1, 0x00, 0x06, 0xFF, 0xD9, 0xFF, 0xD9]);
        app1.extend_from_slice(&full[2..full.len() - 2]);
        assert!(!jpeg_is_complete(&app1));
        app1.extend_from_slice(&[0xFF, 0xD9]);
        assert!(jpeg_is_complete(&app1));
        // A scan's stuffed 0xFF 0x00 and restart markers are data.
        let mut scan = vec![0xFF, 0xD8, 0xFF, 0xDA, 0x00, 0x02];
        scan.extend_from_slice(&[0x12, 0xFF, 0x00, 0x34, 0xFF, 0xD3, 0x56]);
        assert!(!jpeg_is_complete(&scan));
        scan.extend_from_slice(&[0xFF, 0xFF, 0xD9]);
        assert!(jpeg_is_complete(&scan));
        assert!(!jpeg_is_complete(b"\xff\xd8\xff\xe0\x00\x01"));
        assert!(!jpeg_is_complete(b""));
    }

    proptest::proptest! {
        /// No input makes the walk panic, and no strict prefix of a JPEG is
        /// complete (here with random pixels, so the scan has stuffed bytes).
        #[test]
        fn any_bytes_are_walked_and_prefixes_are_incomplete(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512),
            seed in 0u32..1000,
            cut in 0.0f64..1.0,
        ) {
            let _ = jpeg_is_complete(&bytes);
            let mut with_soi = vec![0xFF, 0xD8];
            with_soi.extend_from_slice(&bytes);
            let _ = jpeg_is_complete(&with_soi);
            let pixels = (0..24 * 16 * 3u32)
                .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed) >> 13) as u8)
                .collect();
            let mut full = Vec::new();
            image::RgbImage::from_raw(24, 16, pixels)
                .unwrap()
                .write_to(&mut Cursor::new(&mut full), ImageFormat::Jpeg)
                .unwrap();
            proptest::prop_assert!(jpeg_is_complete(&full));
            let n = (cut * full.len() as f64) as usize;
            proptest::prop_assert!(!jpeg_is_complete(&full[..n]));
        }
    }
}
