//! Image preprocessing as llama.cpp's `tools/mtmd` does it: resizing (its
//! bicubic and bilinear kernels, with or without aspect-preserving padding),
//! MiniCPM-V's slicing of large images into a grid of slices plus an overview
//! (llava-uhd style), and normalisation with the projector's mean and std.
//!
//! The arithmetic follows llama.cpp's (`mtmd-image.cpp`) step by step, in the
//! same float widths, so the pixels fed to the encoder match llama.cpp's.

use super::image::RgbImage;

/// How to resample.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResizeAlgo {
    /// llama.cpp's bilinear kernel (corner-aligned).
    Bilinear,
    /// llama.cpp's bicubic kernel (a = -0.5 Catmull-Rom on 4x4 neighbours).
    Bicubic,
}

/// A normalised float image: interleaved `[r, g, b]` per pixel, rows top to
/// bottom (llama.cpp's `clip_image_f32`).
#[derive(Clone, Debug, PartialEq)]
pub struct ImageF32 {
    /// Width in pixels.
    pub width: usize,
    /// Height in pixels.
    pub height: usize,
    /// `width * height * 3` values.
    pub data: Vec<f32>,
}

/// `(v / 255 - mean[c]) / std[c]` for every channel value.
pub fn normalize(img: &RgbImage, mean: [f32; 3], std: [f32; 3]) -> ImageF32 {
    let data = img
        .data
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            let c = i % 3;
            (f32::from(v) / 255.0 - mean[c]) / std[c]
        })
        .collect();
    ImageF32 {
        width: img.width,
        height: img.height,
        data,
    }
}

/// Resizes `src` to exactly `width` x `height` (aspect ratio not kept).
pub fn resize(src: &RgbImage, width: usize, height: usize, algo: ResizeAlgo) -> RgbImage {
    if src.width == width && src.height == height {
        return src.clone();
    }
    match algo {
        ResizeAlgo::Bilinear => resize_bilinear(src, width, height),
        ResizeAlgo::Bicubic => resize_bicubic(src, width, height),
    }
}

/// Resizes `src` into a `width` x `height` canvas keeping its aspect ratio: scaled
/// to fit (rounding the scaled size up, llama.cpp's `PAD_CEIL`), centred, the rest
/// filled with `pad`.
pub fn resize_padded(
    src: &RgbImage,
    width: usize,
    height: usize,
    algo: ResizeAlgo,
    pad: [u8; 3],
) -> RgbImage {
    if src.width == width && src.height == height {
        return src.clone();
    }
    let scale_w = width as f32 / src.width as f32;
    let scale_h = height as f32 / src.height as f32;
    let scale = scale_w.min(scale_h);
    let new_w = ((src.width as f32 * scale).ceil() as usize).min(width);
    let new_h = ((src.height as f32 * scale).ceil() as usize).min(height);
    let resized = match algo {
        ResizeAlgo::Bilinear => resize_bilinear(src, new_w, new_h),
        ResizeAlgo::Bicubic => resize_bicubic(src, new_w, new_h),
    };
    let mut dst = RgbImage::filled(width, height, pad);
    let (ox, oy) = ((width - new_w) / 2, (height - new_h) / 2);
    for y in 0..new_h {
        let d = 3 * ((y + oy) * width + ox);
        let s = 3 * y * new_w;
        dst.data[d..d + 3 * new_w].copy_from_slice(&resized.data[s..s + 3 * new_w]);
    }
    dst
}

/// The `w` x `h` region of `img` at (`x`, `y`) (which must lie inside it).
pub fn crop(img: &RgbImage, x: usize, y: usize, w: usize, h: usize) -> RgbImage {
    let mut data = Vec::with_capacity(w * h * 3);
    for row in y..y + h {
        let s = 3 * (row * img.width + x);
        data.extend_from_slice(&img.data[s..s + 3 * w]);
    }
    RgbImage {
        width: w,
        height: h,
        data,
    }
}

fn lerp(s: f32, e: f32, t: f32) -> f32 {
    s + (e - s) * t
}

fn resize_bilinear(src: &RgbImage, width: usize, height: usize) -> RgbImage {
    let (width, height) = (width.max(1), height.max(1));
    let mut dst = RgbImage::filled(width, height, [0; 3]);
    let x_ratio = if width > 1 {
        (src.width - 1) as f32 / (width - 1) as f32
    } else {
        0.0
    };
    let y_ratio = if height > 1 {
        (src.height - 1) as f32 / (height - 1) as f32
    } else {
        0.0
    };
    for y in 0..height {
        for x in 0..width {
            let px = x as f32 * x_ratio;
            let py = y as f32 * y_ratio;
            let x0 = (px as usize).min(src.width - 1);
            let y0 = (py as usize).min(src.height - 1);
            let x1 = (x0 + 1).min(src.width - 1);
            let y1 = (y0 + 1).min(src.height - 1);
            let xf = px - x0 as f32;
            let yf = py - y0 as f32;
            let (p00, p10) = (src.pixel(x0, y0), src.pixel(x1, y0));
            let (p01, p11) = (src.pixel(x0, y1), src.pixel(x1, y1));
            let mut p = [0u8; 3];
            for c in 0..3 {
                let top = lerp(f32::from(p00[c]), f32::from(p10[c]), xf);
                let bottom = lerp(f32::from(p01[c]), f32::from(p11[c]), xf);
                p[c] = lerp(top, bottom, yf) as u8;
            }
            dst.set_pixel(x, y, p);
        }
    }
    dst
}

/// One cubic interpolation step of llama.cpp's kernel: the coefficients are
/// computed in double precision and stored as `f32`, the polynomial in `f32`.
#[inline]
fn cubic(p: [f32; 4], t: f32) -> f32 {
    let (d0, d2, d3) = (p[0] - p[1], p[2] - p[1], p[3] - p[1]);
    let a0 = p[1];
    let (d0, d2, d3) = (f64::from(d0), f64::from(d2), f64::from(d3));
    let a1 = (-1.0 / 3.0 * d0 + d2 - 1.0 / 6.0 * d3) as f32;
    let a2 = (1.0 / 2.0 * d0 + 1.0 / 2.0 * d2) as f32;
    let a3 = (-1.0 / 6.0 * d0 - 1.0 / 2.0 * d2 + 1.0 / 6.0 * d3) as f32;
    a0 + a1 * t + a2 * t * t + a3 * t * t * t
}

fn resize_bicubic(src: &RgbImage, width: usize, height: usize) -> RgbImage {
    let (nx, ny) = (src.width as i64, src.height as i64);
    let mut dst = RgbImage::filled(width, height, [0; 3]);
    let tx = nx as f32 / width as f32;
    let ty = ny as f32 / height as f32;
    let clip = |v: i64, hi: i64| v.clamp(0, hi - 1) as usize;
    for i in 0..height {
        let y = (ty * i as f32) as i64;
        let dy = ty * i as f32 - y as f32;
        let rows = [0, 1, 2, 3].map(|jj| clip(y - 1 + jj, ny) * src.width);
        for j in 0..width {
            let x = (tx * j as f32) as i64;
            let dx = tx * j as f32 - x as f32;
            let cols = [-1, 0, 1, 2].map(|o| clip(x + o, nx));
            // col[k][jj]: row jj interpolated along x, channel k.
            let mut col = [[0f32; 4]; 3];
            for (jj, &row) in rows.iter().enumerate() {
                let px = cols.map(|c| 3 * (row + c));
                for (k, ck) in col.iter_mut().enumerate() {
                    let p = px.map(|at| f32::from(src.data[at + k]));
                    ck[jj] = cubic(p, dx);
                }
            }
            let mut p = [0u8; 3];
            for (out, ck) in p.iter_mut().zip(col) {
                *out = cubic(ck, dy).round().clamp(0.0, 255.0) as u8;
            }
            dst.set_pixel(j, i, p);
        }
    }
    dst
}

/// Where the slices of an image come from (llama.cpp's `slice_instructions`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SliceInstructions {
    /// Size of the overview (the whole image, resized): `(width, height)`.
    pub overview: (usize, usize),
    /// Size the image is resized to before cutting the slices; `(0, 0)` without
    /// slices.
    pub refined: (usize, usize),
    /// Slices per row and rows of slices; `(0, 0)` without slices.
    pub grid: (usize, usize),
    /// Each slice as `(x, y, width, height)` in the refined image, row by row.
    pub slices: Vec<(usize, usize, usize, usize)>,
}

/// `length` rounded to the nearest multiple of `align` (at least `align`).
pub fn ensure_divide(length: usize, align: usize) -> usize {
    let v = ((length as f32 / align as f32).round() * align as f32) as usize;
    v.max(align)
}

/// MiniCPM-V's `find_best_resize`: scale `(w, h)` to about `scale_resolution`²
/// pixels keeping the aspect ratio (only down, unless `allow_upscale`), each side
/// rounded to a multiple of `align`.
pub fn get_best_resize(
    (width, height): (usize, usize),
    scale_resolution: usize,
    align: usize,
    allow_upscale: bool,
) -> (usize, usize) {
    let (mut w, mut h) = (width, height);
    if w * h > scale_resolution * scale_resolution || allow_upscale {
        let r = w as f32 / h as f32;
        h = (scale_resolution as f32 / r.sqrt()) as usize;
        w = (h as f32 * r) as usize;
    }
    (ensure_divide(w, align), ensure_divide(h, align))
}

/// The size the image is resized to before a `grid` of slices is cut from it.
pub fn get_refine_size(
    (width, height): (usize, usize),
    (gx, gy): (usize, usize),
    scale_resolution: usize,
    align: usize,
    allow_upscale: bool,
) -> (usize, usize) {
    let refine_w = ensure_divide(width, gx);
    let refine_h = ensure_divide(height, gy);
    let (bw, bh) = get_best_resize(
        (refine_w / gx, refine_h / gy),
        scale_resolution,
        align,
        allow_upscale,
    );
    (bw * gx, bh * gy)
}

/// The grid `(columns, rows)` with `multiple - 1`, `multiple` or `multiple + 1`
/// slices (not 1, at most `max_slices`) whose aspect ratio is closest to the
/// image's (`log_ratio = ln(width / height)`); the first candidate wins ties.
pub fn get_best_grid(max_slices: usize, multiple: usize, log_ratio: f32) -> (usize, usize) {
    let mut candidates = Vec::new();
    for n in [multiple.wrapping_sub(1), multiple, multiple + 1] {
        if n == 1 || n == 0 || n > max_slices || n == usize::MAX {
            continue;
        }
        for m in 1..=n {
            if n.is_multiple_of(m) {
                candidates.push((m, n / m));
            }
        }
    }
    let mut best = (1, 1);
    let mut min_error = f32::INFINITY;
    for (w, h) in candidates {
        let error = (log_ratio - (w as f32 / h as f32).ln()).abs();
        if error < min_error {
            best = (w, h);
            min_error = error;
        }
    }
    best
}

/// llava-uhd slicing as llama.cpp does it for MiniCPM-V: an image no larger
/// than `slice_size` on both sides is one `slice_size`² overview; a larger one
/// gets an aspect-preserving overview plus a grid of up to `max_slices` slices.
/// Sizes are multiples of `align` (patch size times the projector's merge
/// factor).
pub fn slice_instructions(
    (width, height): (usize, usize),
    slice_size: usize,
    align: usize,
    max_slices: usize,
) -> SliceInstructions {
    let has_slices = width > slice_size || height > slice_size;
    if !has_slices {
        return SliceInstructions {
            overview: (slice_size, slice_size),
            refined: (0, 0),
            grid: (0, 0),
            slices: Vec::new(),
        };
    }
    let overview = get_best_resize((width, height), slice_size, align, false);
    let log_ratio = (width as f32 / height as f32).ln();
    let ratio = width as f32 * height as f32 / (slice_size * slice_size) as f32;
    let multiple = (ratio.ceil() as usize).min(max_slices);
    let grid = get_best_grid(max_slices, multiple, log_ratio);
    let refined = get_refine_size((width, height), grid, slice_size, align, true);
    let (sw, sh) = (refined.0 / grid.0, refined.1 / grid.1);
    let mut slices = Vec::new();
    let mut y = 0;
    for _ in 0..grid.1 {
        if y >= refined.1 {
            break;
        }
        let mut x = 0;
        for _ in 0..grid.0 {
            if x >= refined.0 {
                break;
            }
            slices.push((x, y, sw, sh));
            x += sw;
        }
        y += sh;
    }
    SliceInstructions {
        overview,
        refined,
        grid,
        slices,
    }
}

/// The resized and sliced pixels of one image, overview first.
#[derive(Clone, Debug)]
pub struct SlicedImage {
    /// The overview.
    pub overview: RgbImage,
    /// The slices, row by row.
    pub slices: Vec<RgbImage>,
    /// Slices per row and rows of slices (`(0, 0)` without slices).
    pub grid: (usize, usize),
}

/// Cuts `img` as `inst` says: the overview by a plain bicubic resize, the
/// slices from a bicubic resize to the refined size padded with black
/// (llama.cpp's defaults for llava-uhd).
pub fn slice_image(img: &RgbImage, inst: &SliceInstructions) -> SlicedImage {
    let overview = resize(img, inst.overview.0, inst.overview.1, ResizeAlgo::Bicubic);
    let mut slices = Vec::new();
    if !inst.slices.is_empty() {
        let refined = resize_padded(
            img,
            inst.refined.0,
            inst.refined.1,
            ResizeAlgo::Bicubic,
            [0; 3],
        );
        for &(x, y, w, h) in &inst.slices {
            slices.push(crop(&refined, x, y, w, h));
        }
    }
    SlicedImage {
        overview,
        slices,
        grid: inst.grid,
    }
}
