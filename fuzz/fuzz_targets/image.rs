//! Image files (JPEG through les's own decoder, PNG, GIF, BMP and PNM through the `image`
//! crate) on arbitrary bytes: decoding never panics, hangs or allocates past
//! the bounds, and an image it accepts is whole and within them.
#![no_main]

use les::vision::image::{check_dimensions, decode_image};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(img) = decode_image(data) {
        assert!(check_dimensions(img.width as u32, img.height as u32).is_ok());
        assert_eq!(img.data.len(), img.width * img.height * 3);
    }
    if let Ok((w, h)) = les::vision::jpeg::dimensions(data) {
        assert!(check_dimensions(w as u32, h as u32).is_ok());
    }
});
