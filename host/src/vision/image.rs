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

fn decode(bytes: &[u8]) -> Result<RgbImage, String> {
    let format = image::guess_format(bytes).map_err(|_| "not a PNG or JPEG image".to_string())?;
    if !matches!(format, ImageFormat::Png | ImageFormat::Jpeg) {
        return Err(format!(
            "unsupported image format {format:?} (PNG and JPEG are)"
        ));
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

/// Reads and decodes the PNG or JPEG file at `path` (format from its content).
pub fn load_image(path: &Path) -> Result<RgbImage, VisionError> {
    let err = |m: String| VisionError::Image(format!("{}: {m}", path.display()));
    let meta = std::fs::metadata(path).map_err(|e| err(e.to_string()))?;
    // A pipe or a device has no length to check, and may never end.
    if !meta.is_file() {
        return Err(err("not a regular file".into()));
    }
    if meta.len() > MAX_FILE_BYTES {
        return Err(err(format!(
            "{} bytes is too large for an image file",
            meta.len()
        )));
    }
    // Bounded even if the file grows after the check.
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(MAX_FILE_BYTES + 1).read_to_end(&mut bytes))
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
