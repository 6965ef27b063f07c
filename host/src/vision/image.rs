//! Decoding image files (PNG, JPEG, GIF, BMP, PPM/PGM) into 8-bit RGB, the
//! pixels llama.cpp's stb_image gives, with the dimensions bounded before any
//! pixel is decoded.

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

/// `format` if it is one LES decodes (PNG, JPEG, GIF, BMP, PNM); `None` is an
/// unknown one.
fn supported(format: Option<ImageFormat>) -> Result<ImageFormat, String> {
    use ImageFormat::*;
    match format {
        Some(f @ (Png | Jpeg | Gif | Bmp | Pnm)) => Ok(f),
        Some(f) => Err(format!(
            "unsupported image format {f:?} (PNG, JPEG, GIF, BMP and PPM/PGM are)"
        )),
        None => Err("not a PNG, JPEG, GIF, BMP or PPM/PGM image".into()),
    }
}

fn decode(bytes: &[u8]) -> Result<RgbImage, String> {
    let format = supported(image::guess_format(bytes).ok())?;
    // JPEG as llama.cpp decodes it (stb_image's arithmetic), which also
    // refuses a file cut short (decoders fill its missing pixels with gray).
    if format == ImageFormat::Jpeg {
        return super::jpeg::decode(bytes);
    }
    if format == ImageFormat::Pnm {
        check_pnm(bytes)?;
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
    let img = reader.decode().map_err(|e| e.to_string())?;
    let (w, h) = (img.width(), img.height());
    check_dimensions(w, h)?;
    Ok(RgbImage {
        width: w as usize,
        height: h as usize,
        data: if format == ImageFormat::Gif {
            gif_rgb_as_stb_image(img)
        } else {
            to_rgb8_as_stb_image(img)
        },
    })
}

/// The PNM files stb_image reads: binary graymaps and pixmaps (`P5`, `P6`)
/// of 8 or 16 bits (a maximum value of 255 or 65535; stb_image does not
/// rescale other maxima, the `image` crate does, so they are refused).
fn check_pnm(bytes: &[u8]) -> Result<(), String> {
    if !(bytes.starts_with(b"P5") || bytes.starts_with(b"P6")) {
        return Err("only binary PGM and PPM files (P5, P6) are read".into());
    }
    // Three numbers after the magic, separated by whitespace and comments.
    let mut numbers = Vec::new();
    let mut i = 2;
    while numbers.len() < 3 {
        match bytes.get(i) {
            Some(b'#') => {
                while bytes.get(i).is_some_and(|&b| b != b'\n') {
                    i += 1;
                }
            }
            Some(b) if b.is_ascii_whitespace() => i += 1,
            Some(b) if b.is_ascii_digit() => {
                let start = i;
                while bytes.get(i).is_some_and(u8::is_ascii_digit) && i - start < 10 {
                    i += 1;
                }
                let n: u64 = std::str::from_utf8(&bytes[start..i])
                    .ok()
                    .and_then(|t| t.parse().ok())
                    .ok_or("bad PNM header")?;
                numbers.push(n);
            }
            _ => return Err("bad PNM header".into()),
        }
    }
    match numbers[2] {
        255 | 65535 => Ok(()),
        m => Err(format!(
            "a PNM file with maximum value {m} (255 and 65535 are read, as llama.cpp reads them)"
        )),
    }
}

/// A GIF's first frame as stb_image gives it: transparent pixels black (its
/// canvas starts as zeros; the `image` crate keeps the palette colour under
/// a zero alpha).
fn gif_rgb_as_stb_image(img: image::DynamicImage) -> Vec<u8> {
    img.to_rgba8()
        .as_raw()
        .chunks_exact(4)
        .flat_map(|p| {
            if p[3] == 0 {
                [0; 3]
            } else {
                [p[0], p[1], p[2]]
            }
        })
        .collect()
}

/// A decoded image's pixels as 8-bit RGB the way llama.cpp's stb_image makes
/// them: alpha dropped (not composited), gray repeated, and 16-bit samples
/// cut to their high byte (the `image` crate rounds them, off by one in a
/// quarter of the samples).
fn to_rgb8_as_stb_image(img: image::DynamicImage) -> Vec<u8> {
    use image::DynamicImage::*;
    let high = |v: &u16| (v >> 8) as u8;
    match img {
        ImageRgb16(i) => i.as_raw().iter().map(high).collect(),
        ImageRgba16(i) => i
            .as_raw()
            .chunks_exact(4)
            .flat_map(|p| [high(&p[0]), high(&p[1]), high(&p[2])])
            .collect(),
        ImageLuma16(i) => i.as_raw().iter().flat_map(|v| [high(v); 3]).collect(),
        ImageLumaA16(i) => i
            .as_raw()
            .chunks_exact(2)
            .flat_map(|p| [high(&p[0]); 3])
            .collect(),
        other => other.to_rgb8().into_raw(),
    }
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

/// The bytes of the file at `path`, at most [`MAX_FILE_BYTES`] of them.
fn read_bounded(path: &Path) -> Result<Vec<u8>, String> {
    let mut bytes = Vec::new();
    open_bounded(path)?
        .read_to_end(&mut bytes)
        .map_err(|e| e.to_string())?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err("too large for an image file".into());
    }
    Ok(bytes)
}

/// The width and height of the image file at `path`, from its header
/// alone (the same checks as [`load_image`] on the file and the dimensions):
/// what an image will cost is known before it is decoded.
pub fn probe_image(path: &Path) -> Result<(usize, usize), VisionError> {
    let err = |m: String| VisionError::Image(format!("{}: {m}", path.display()));
    dimensions(&read_bounded(path).map_err(err)?).map_err(err)
}

/// The width and height of an image file held in memory, from its header
/// alone, as [`probe_image`] reads them.
pub fn image_size(bytes: &[u8]) -> Result<(usize, usize), VisionError> {
    dimensions(bytes).map_err(VisionError::Image)
}

fn dimensions(bytes: &[u8]) -> Result<(usize, usize), String> {
    let format = supported(image::guess_format(bytes).ok())?;
    if format == ImageFormat::Jpeg {
        return super::jpeg::dimensions(bytes);
    }
    let (w, h) = ImageReader::with_format(Cursor::new(bytes), format)
        .into_dimensions()
        .map_err(|e| e.to_string())?;
    check_dimensions(w, h)?;
    Ok((w as usize, h as usize))
}

/// Reads and decodes the image file at `path` (format from its content).
pub fn load_image(path: &Path) -> Result<RgbImage, VisionError> {
    let err = |m: String| VisionError::Image(format!("{}: {m}", path.display()));
    decode(&read_bounded(path).map_err(err)?).map_err(err)
}

/// Decodes an image file held in memory.
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
    fn a_jpeg_decodes_only_up_to_its_end_marker() {
        let full = jpeg(40, 30);
        let img = decode(&full).unwrap();
        assert_eq!((img.width, img.height), (40, 30));
        // Every cut is caught (decoders fill the missing pixels with gray).
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
            assert!(decode(&full[..cut]).is_err(), "cut at {cut}");
        }
        let e = decode(&full[..full.len() - 2]).unwrap_err();
        assert!(e.contains("end-of-image marker"), "{e}");
        // An end marker inside an earlier segment (a thumbnail's, in APP1)
        // does not count: segments are skipped by their lengths.
        let mut app1 = full[..2].to_vec();
        app1.extend_from_slice(&[0xFF, 0xE1, 0x00, 0x06, 0xFF, 0xD9, 0xFF, 0xD9]);
        app1.extend_from_slice(&full[2..full.len() - 2]);
        assert!(decode(&app1).is_err());
        app1.extend_from_slice(&[0xFF, 0xD9]);
        assert_eq!(decode(&app1).unwrap(), img);
    }
}
