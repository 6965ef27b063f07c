//! Image preprocessing as llama.cpp's `tools/mtmd` does it: resizing (Pillow's
//! bilinear and bicubic resampling in fixed point, as llama.cpp's
//! `resize_pillow`, with or without aspect-preserving padding),
//! MiniCPM-V's slicing of large images into a grid of slices plus an overview
//! (llava-uhd style), Qwen-VL's "smart resize" to a token budget
//! ([`smart_resize`]), and normalisation with the projector's mean and std.
//!
//! The arithmetic follows llama.cpp's (`mtmd-image.cpp`) step by step, in the
//! same float widths, so the pixels fed to the encoder match llama.cpp's.

use super::image::RgbImage;

/// How to resample.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResizeAlgo {
    /// Pillow's bilinear filter (a triangle, widened when shrinking).
    Bilinear,
    /// Pillow's bicubic filter (a = -0.5, widened when shrinking).
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
    resample(src, width, height, algo)
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
    let resized = resample(src, new_w, new_h, algo);
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

/// Fractional bits of the resampler's fixed-point weights (Pillow's: 32 bits
/// less 8 for the pixel, less 2 of headroom for the sums).
const PRECISION_BITS: u32 = 22;

/// The resampling filter at distance `x` (in input pixels, scaled).
fn filter(algo: ResizeAlgo, x: f64) -> f64 {
    let x = x.abs();
    match algo {
        ResizeAlgo::Bilinear => {
            if x < 1.0 {
                1.0 - x
            } else {
                0.0
            }
        }
        ResizeAlgo::Bicubic => {
            // Pillow's a = -0.5.
            const A: f64 = -0.5;
            if x < 1.0 {
                ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
            } else if x < 2.0 {
                (((x - 5.0) * x + 8.0) * x - 4.0) * A
            } else {
                0.0
            }
        }
    }
}

/// One axis's resampling: for each output pixel, the first input pixel it
/// reads and its fixed-point weights (`ksize` of them, zero past those it
/// uses).
struct Axis {
    ksize: usize,
    /// `(first, count)` input pixels per output pixel.
    bounds: Vec<(usize, usize)>,
    weights: Vec<i32>,
}

impl Axis {
    /// Pillow's coefficients for resampling `in_size` pixels to `out_size`:
    /// the filter widened by the scale when shrinking (antialiasing),
    /// centred on each output pixel's centre, normalised, then rounded to
    /// fixed point (Pillow's rounding: add a half away from zero, truncate).
    fn new(in_size: usize, out_size: usize, algo: ResizeAlgo) -> Axis {
        let radius = match algo {
            ResizeAlgo::Bilinear => 1.0,
            ResizeAlgo::Bicubic => 2.0,
        };
        let scale = in_size as f64 / out_size as f64;
        let filterscale = scale.max(1.0);
        let support = radius * filterscale;
        let ksize = support.ceil() as usize * 2 + 1;
        let mut bounds = Vec::with_capacity(out_size);
        let mut weights = vec![0i32; out_size * ksize];
        let mut w = vec![0f64; ksize];
        for (xx, row) in weights.chunks_exact_mut(ksize).enumerate() {
            let center = (xx as f64 + 0.5) * scale;
            // Truncation toward zero, then clamped, as the C casts do.
            let first = ((center - support + 0.5) as i64).max(0) as usize;
            let end = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
            let count = end.saturating_sub(first).min(ksize);
            let mut total = 0.0;
            for (x, wx) in w.iter_mut().enumerate().take(count) {
                *wx = filter(algo, ((x + first) as f64 - center + 0.5) / filterscale);
                total += *wx;
            }
            let one = f64::from(1u32 << PRECISION_BITS);
            for (k, &wx) in row.iter_mut().zip(&w[..count]) {
                let wx = if total != 0.0 { wx / total } else { wx };
                *k = (wx * one + if wx < 0.0 { -0.5 } else { 0.5 }) as i32;
            }
            bounds.push((first, count));
        }
        Axis {
            ksize,
            bounds,
            weights,
        }
    }

    /// The weighted sum at output pixel `i` of the values `value(j)` of
    /// input pixels `j`, rounded back to a byte.
    #[inline]
    fn sample(&self, i: usize, value: impl Fn(usize) -> u8) -> u8 {
        let (first, count) = self.bounds[i];
        let k = &self.weights[i * self.ksize..][..count];
        let sum = k
            .iter()
            .enumerate()
            .fold(1i64 << (PRECISION_BITS - 1), |acc, (j, &w)| {
                acc + i64::from(value(first + j)) * i64::from(w)
            });
        (sum >> PRECISION_BITS).clamp(0, 255) as u8
    }
}

/// Resamples `src` to `width` x `height` as llama.cpp's `mtmd` does (its
/// `resize_pillow`, Pillow's separable convolution in fixed point): across
/// first, then down, each pass only where that size changes.
fn resample(src: &RgbImage, width: usize, height: usize, algo: ResizeAlgo) -> RgbImage {
    let (width, height) = (width.max(1), height.max(1));
    let mut img = src.clone();
    if width != img.width {
        let axis = Axis::new(img.width, width, algo);
        let mut out = RgbImage::filled(width, img.height, [0; 3]);
        for y in 0..img.height {
            let row = &img.data[3 * y * img.width..][..3 * img.width];
            for x in 0..width {
                for c in 0..3 {
                    out.data[3 * (y * width + x) + c] = axis.sample(x, |j| row[3 * j + c]);
                }
            }
        }
        img = out;
    }
    if height != img.height {
        let axis = Axis::new(img.height, height, algo);
        let mut out = RgbImage::filled(img.width, height, [0; 3]);
        let stride = 3 * img.width;
        for y in 0..height {
            for i in 0..stride {
                out.data[y * stride + i] = axis.sample(y, |j| img.data[j * stride + i]);
            }
        }
        img = out;
    }
    img
}

/// The size an image of `(width, height)` is resized to for a dynamic-size
/// projector (llama.cpp's `calc_size_preserved_ratio` without a longest edge,
/// transformers' "smart_resize"): each side rounded to the nearest multiple of
/// `align` (at least `align`); then, if that is more than `max_pixels`, both
/// sides scaled by `sqrt(w h / max_pixels)` and rounded down to multiples of
/// `align` (at least `align`), or, if less than `min_pixels`, scaled up by
/// `sqrt(min_pixels / (w h))` and rounded up. The arithmetic is llama.cpp's,
/// in `f32` (`0` disables a bound). `(0, 0)` for an empty image.
pub fn smart_resize(
    (width, height): (usize, usize),
    align: usize,
    min_pixels: usize,
    max_pixels: usize,
) -> (usize, usize) {
    if width == 0 || height == 0 || align == 0 {
        return (0, 0);
    }
    let a = align as i64;
    let f = align as f32;
    let round_by = |x: f32| (x / f).round() as i64 * a;
    let ceil_by = |x: f32| (x / f).ceil() as i64 * a;
    let floor_by = |x: f32| (x / f).floor() as i64 * a;
    let (wf, hf) = (width as f32, height as f32);
    let mut w_bar = a.max(round_by(wf));
    let mut h_bar = a.max(round_by(hf));
    if max_pixels > 0 && h_bar * w_bar > max_pixels as i64 {
        let beta = (hf * wf / max_pixels as f32).sqrt();
        h_bar = a.max(floor_by(hf / beta));
        w_bar = a.max(floor_by(wf / beta));
    } else if min_pixels > 0 && h_bar * w_bar < min_pixels as i64 {
        let beta = (min_pixels as f32 / (hf * wf)).sqrt();
        h_bar = ceil_by(hf * beta);
        w_bar = ceil_by(wf * beta);
    }
    (w_bar.max(0) as usize, h_bar.max(0) as usize)
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

impl SliceInstructions {
    /// An image that is its overview alone (of `overview` pixels).
    pub fn overview_only(overview: (usize, usize)) -> Self {
        SliceInstructions {
            overview,
            refined: (0, 0),
            grid: (0, 0),
            slices: Vec::new(),
        }
    }

    /// An overview, and the image resized to `refined` cut into `tile`²
    /// tiles row by row (the last of a row or column cut short where
    /// `refined` is not a whole number of tiles). `tile` must be positive.
    pub fn tiled(overview: (usize, usize), refined: (usize, usize), tile: usize) -> Self {
        let mut slices = Vec::new();
        for y in (0..refined.1).step_by(tile) {
            for x in (0..refined.0).step_by(tile) {
                slices.push((x, y, tile.min(refined.0 - x), tile.min(refined.1 - y)));
            }
        }
        SliceInstructions {
            overview,
            refined,
            grid: (refined.0 / tile, refined.1 / tile),
            slices,
        }
    }
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
        return SliceInstructions::overview_only((slice_size, slice_size));
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

/// The tile grids `(columns, rows)` llama.cpp offers Llama 4, in its order
/// (`set_llava_uhd_res_candidates(model, 3)`): every grid up to 3 x 3 but
/// 1 x 1, columns outer.
pub fn llama4_grids() -> Vec<(usize, usize)> {
    (1..=3)
        .flat_map(|gx| (1..=3).map(move |gy| (gx, gy)))
        .filter(|&g| g != (1, 1))
        .collect()
}

/// The tile grids `(columns, rows)` llama.cpp offers InternVL, in its order
/// (`set_internvl_dhr_res_candidates`): for each column count `a` from
/// `min` to `max`, the row counts `b` from `max(ceil(min / a), min)` to
/// `min(max / a, max)`.
pub fn internvl_grids(min: usize, max: usize) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    if min == 0 {
        return out;
    }
    for a in min..=max {
        let lo = min.div_ceil(a).max(min);
        let hi = (max / a).min(max);
        out.extend((lo..=hi).map(|b| (a, b)));
    }
    out
}

/// llava-uhd slicing with fixed candidate resolutions, as llama.cpp does it
/// for Llama 4 and InternVL (`get_slice_instructions`' pinpoints): an image
/// no larger than `tile` on both sides is one `tile`² overview; a larger one
/// also gets the candidate of `grids` (tile columns and rows, in llama.cpp's
/// order: the first of equals wins) that keeps the most of its pixels when
/// scaled to fit, then wastes the least (llama.cpp's
/// `select_best_resolution`, in its `f32` and `int` arithmetic), cut into
/// `tile`² tiles row by row.
pub fn tile_instructions(
    (width, height): (usize, usize),
    tile: usize,
    grids: &[(usize, usize)],
) -> SliceInstructions {
    let overview = (tile, tile);
    if (width <= tile && height <= tile) || width == 0 || height == 0 || tile == 0 {
        return SliceInstructions::overview_only(overview);
    }
    let (ow, oh) = (width as i64, height as i64);
    let mut best = (0, 0);
    let (mut max_effective, mut min_wasted) = (0i64, i64::MAX);
    for &(gx, gy) in grids {
        let (cw, ch) = ((gx * tile) as i64, (gy * tile) as i64);
        let scale = (cw as f32 / ow as f32).min(ch as f32 / oh as f32);
        let (tw, th) = ((ow as f32 * scale) as i64, (oh as f32 * scale) as i64);
        let effective = (tw * th).min(ow * oh);
        let wasted = cw * ch - effective;
        if effective > max_effective || (effective == max_effective && wasted < min_wasted) {
            max_effective = effective;
            min_wasted = wasted;
            best = (cw as usize, ch as usize);
        }
    }
    SliceInstructions::tiled(overview, best, tile)
}

/// The side of LFM2-VL's tiles in pixels (llama.cpp's
/// `mtmd_image_preprocessor_lfm2::tile_size`).
pub const LFM2_TILE: usize = 512;

/// LFM2-VL's tile grids `(columns, rows)`, 2 to 10 tiles, in the order
/// llama.cpp tries them: generated by `get_target_ratios` (`n` from 2 to 10,
/// then columns, then rows, each grid once) and sorted by tile count with
/// libstdc++'s `std::sort`, which is not stable: grids of the same count
/// come out in this order (read off a g++ 12 build of that code), and the
/// order decides images whose aspect ratio lies exactly between two grids'.
pub const LFM2_GRIDS: [(usize, usize); 26] = [
    (2, 1),
    (1, 2),
    (1, 3),
    (3, 1),
    (2, 2),
    (4, 1),
    (1, 4),
    (1, 5),
    (5, 1),
    (3, 2),
    (2, 3),
    (1, 6),
    (6, 1),
    (1, 7),
    (7, 1),
    (2, 4),
    (4, 2),
    (1, 8),
    (8, 1),
    (3, 3),
    (1, 9),
    (9, 1),
    (10, 1),
    (1, 10),
    (5, 2),
    (2, 5),
];

/// Whether LFM2-VL cuts an image of `(width, height)` into tiles (llama.cpp's
/// `should_tile`): its sides rounded to multiples of `align` (ties to even,
/// at least `patch`) cover more than twice `max_pixels`.
pub fn lfm2_should_tile(
    (width, height): (usize, usize),
    align: usize,
    patch: usize,
    max_pixels: usize,
) -> bool {
    if align == 0 {
        return false;
    }
    let round = |x: usize| {
        let v = ((x as f32) as f64 / align as f64).round_ties_even() as i64 * align as i64;
        v.max(patch as i64) as f64
    };
    round(height) * round(width) > max_pixels as f64 * 2.0
}

/// The grid LFM2-VL tiles an image of `(width, height)` with (llama.cpp's
/// `get_grid_layout`): of [`LFM2_GRIDS`], the one whose aspect ratio is
/// closest to the image's, in `f32`; of equally close ones the later where
/// the image covers more than half of the grid's pixels, else the earlier.
pub fn lfm2_grid((width, height): (usize, usize)) -> (usize, usize) {
    let aspect = width as f32 / height as f32;
    let area = (width * height) as f32;
    let mut best = (1, 1);
    let mut best_diff = f32::MAX;
    for &(w, h) in &LFM2_GRIDS {
        let diff = (aspect - w as f32 / h as f32).abs();
        if diff < best_diff {
            best_diff = diff;
            best = (w, h);
        } else if diff == best_diff {
            let target = (LFM2_TILE * LFM2_TILE * w * h) as f32;
            if area > 0.5 * target {
                best = (w, h);
            }
        }
    }
    best
}

/// How LFM2-VL cuts an image of `(width, height)` (llama.cpp's
/// `mtmd_image_preprocessor_lfm2`): the overview at the [`smart_resize`]
/// size within `min_pixels` to `max_pixels` (sides multiples of `align`,
/// patch x merge); where [`lfm2_should_tile`], also the [`lfm2_grid`] of
/// [`LFM2_TILE`]-pixel tiles, row by row.
pub fn lfm2_instructions(
    size: (usize, usize),
    align: usize,
    patch: usize,
    (min_pixels, max_pixels): (usize, usize),
) -> SliceInstructions {
    let overview = smart_resize(size, align, min_pixels, max_pixels);
    if size.0 == 0 || size.1 == 0 || !lfm2_should_tile(size, align, patch, max_pixels) {
        return SliceInstructions::overview_only(overview);
    }
    let (gx, gy) = lfm2_grid(size);
    SliceInstructions::tiled(overview, (gx * LFM2_TILE, gy * LFM2_TILE), LFM2_TILE)
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
    slice_image_with(img, inst, ResizeAlgo::Bicubic)
}

/// [`slice_image`] resampling with `algo` (LFM2's bilinear).
pub fn slice_image_with(img: &RgbImage, inst: &SliceInstructions, algo: ResizeAlgo) -> SlicedImage {
    let overview = resize(img, inst.overview.0, inst.overview.1, algo);
    let mut slices = Vec::new();
    if !inst.slices.is_empty() {
        let refined = resize_padded(img, inst.refined.0, inst.refined.1, algo, [0; 3]);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Llama 4's tile grids for 112-pixel tiles, as libmtmd cuts the images
    /// of `vision_encoder::llama4_embeddings_equal_llama_cpps`.
    #[test]
    fn tile_grids_are_llama_cpps() {
        for ((w, h), grid) in [
            ((112, 112), (0, 0)),
            ((100, 60), (0, 0)),
            ((300, 200), (3, 2)),
            ((640, 480), (3, 3)),
            ((97, 411), (1, 3)),
            ((224, 224), (2, 2)),
            ((1000, 180), (3, 1)),
            ((113, 112), (2, 1)),
        ] {
            let inst = tile_instructions((w, h), 112, &llama4_grids());
            assert_eq!(inst.grid, grid, "{w}x{h}");
            assert_eq!(inst.overview, (112, 112));
            assert_eq!(inst.slices.len(), grid.0 * grid.1, "{w}x{h}");
            assert_eq!(inst.refined, (grid.0 * 112, grid.1 * 112), "{w}x{h}");
            for (i, &(x, y, sw, sh)) in inst.slices.iter().enumerate() {
                assert_eq!((x, y), (i % grid.0.max(1) * 112, i / grid.0.max(1) * 112));
                assert_eq!((sw, sh), (112, 112));
            }
        }
        assert!(tile_instructions((0, 500), 112, &llama4_grids())
            .slices
            .is_empty());
        assert_eq!(llama4_grids().len(), 8);
    }

    /// LFM2-VL's grids: every grid of 2 to 10 tiles once, by tile count.
    #[test]
    fn lfm2_grids_are_llama_cpps() {
        let mut generated = Vec::new();
        for n in 2..=10usize {
            for w in 1..=n {
                for h in 1..=n {
                    if (2..=10).contains(&(w * h)) && !generated.contains(&(w, h)) {
                        generated.push((w, h));
                    }
                }
            }
        }
        let mut ours = LFM2_GRIDS.to_vec();
        assert!(ours.windows(2).all(|p| p[0].0 * p[0].1 <= p[1].0 * p[1].1));
        ours.sort_unstable();
        generated.sort_unstable();
        assert_eq!(ours, generated);
        // Each against llama.cpp's `find_closest_aspect_ratio` (compiled
        // with g++ 12 over these sizes).
        for (size, grid) in [
            ((1000, 3000), (1, 3)),
            ((1024, 768), (3, 2)),
            ((3000, 1000), (3, 1)),
            ((4000, 400), (10, 1)),
            ((700, 1400), (1, 2)),
            // 2:1 is also 4 x 2: the later wins once the image covers more
            // than half of its pixels (4 x 2 tiles of 512: 2 Mpx).
            ((2048, 1024), (4, 2)),
            ((1500, 750), (4, 2)),
            ((1400, 700), (2, 1)),
            // 1.25 lies exactly between 1:1 and 3:2: the image's pixels
            // decide among 2 x 2, 3 x 2 and 3 x 3, in the grids' order.
            ((1250, 1000), (3, 3)),
            ((500, 400), (2, 2)),
        ] {
            assert_eq!(lfm2_grid(size), grid, "{size:?}");
        }
    }

    /// LFM2-VL tiles only images more than twice its most pixels, after
    /// rounding each side to the merged patch (ties to even).
    #[test]
    fn lfm2_tiles_only_large_images() {
        let max = 256 * 32 * 32; // 256 tokens of 32 x 32 pixels: 512 x 512
        assert!(!lfm2_should_tile((512, 512), 32, 16, max));
        // 724 / 32 = 22.6 rounds to 23: 736 x 736 = 541696 > 524288.
        assert!(lfm2_should_tile((724, 724), 32, 16, max));
        // 720 / 32 = 22.5 rounds to 22 (even): 704 x 704 = 495616, not over.
        assert!(!lfm2_should_tile((720, 720), 32, 16, max));
        assert!(lfm2_should_tile((1024, 768), 32, 16, max));
        // 720 / 32 = 22.5 rounds to 22 (even): 704 x 768 = 540672 > 524288.
        assert!(lfm2_should_tile((720, 768), 32, 16, max));
        // 752 / 32 = 23.5 rounds to 24: 768 x 672 = 516096, not over.
        assert!(!lfm2_should_tile((752, 672), 32, 16, max));
        let inst = lfm2_instructions((1024, 768), 32, 16, (64 * 1024, max));
        assert_eq!(inst.grid, lfm2_grid((1024, 768)));
        assert_eq!(inst.slices.len(), inst.grid.0 * inst.grid.1);
        assert_eq!(inst.refined, (inst.grid.0 * 512, inst.grid.1 * 512));
        assert_eq!(inst.overview, smart_resize((1024, 768), 32, 64 * 1024, max));
        let small = lfm2_instructions((300, 200), 32, 16, (64 * 1024, max));
        assert!(small.slices.is_empty() && small.grid == (0, 0));
        assert_eq!(small.overview, smart_resize((300, 200), 32, 64 * 1024, max));
    }

    /// InternVL's candidates (llama.cpp's `set_internvl_dhr_res_candidates`):
    /// 1 to 12 tiles, every grid whose area is within them, columns outer.
    #[test]
    fn internvl_grids_are_llama_cpps() {
        let g = internvl_grids(1, 12);
        assert_eq!(&g[..3], &[(1, 1), (1, 2), (1, 3)]);
        assert_eq!(g.len(), 35);
        assert!(g.iter().all(|&(a, b)| (1..=12).contains(&(a * b))));
        assert_eq!(g.last(), Some(&(12, 1)));
        // llama.cpp's quirk: columns and rows both start at the fewest
        // tiles, so with 2 to 4 only 2 x 2 is offered (not 1 x 2, 4 x 1).
        assert_eq!(internvl_grids(2, 4), [(2, 2)]);
        assert!(internvl_grids(0, 4).is_empty());
        // A picture four tiles wide and one high takes the 4 x 1 grid.
        let inst = tile_instructions((1792, 448), 448, &g);
        assert_eq!(inst.grid, (4, 1));
    }
}
