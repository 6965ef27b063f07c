//! Transparent huge pages for the large buffers every token streams through:
//! the expert slots and the KV cache.
//!
//! With 4 KiB pages, streaming a buffer costs a TLB miss every 4 KiB (and an
//! `O_DIRECT` read pins one page per 4 KiB); 2 MiB pages remove almost all of
//! them. THP's default mode on most distributions is `madvise`, so a buffer
//! gets huge pages only if asked for them before its pages are first touched.
#![allow(unsafe_code)]

use std::mem::MaybeUninit;

/// The transparent huge page size on x86-64 and arm64 with 4 KiB base pages.
pub const HUGE_PAGE: usize = 2 << 20;

/// Asks for transparent huge pages (`MADV_HUGEPAGE`) over the whole huge pages
/// inside `buf`, memory not touched yet (a vector's spare capacity, a fresh
/// mapping) so that its first touch allocates them. Best effort: nothing
/// happens on a kernel without THP, or off Linux.
pub fn advise<T>(buf: &mut [MaybeUninit<T>]) {
    let start = buf.as_mut_ptr() as usize;
    let end = start + std::mem::size_of_val(buf);
    let (from, to) = (
        start.next_multiple_of(HUGE_PAGE),
        end / HUGE_PAGE * HUGE_PAGE,
    );
    if from >= to {
        return;
    }
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        // SAFETY: `from..to` lies inside `buf`, which the caller holds exclusively,
        // and `MADV_HUGEPAGE` is advice: it changes no contents, only which
        // pages back the range.
        let _ = unsafe {
            rustix::mm::madvise(
                from as *mut std::ffi::c_void,
                to - from,
                rustix::mm::Advice::LinuxHugepage,
            )
        };
    }
}

/// `n` zeroed values of `T`, on transparent huge pages where the kernel gives
/// them (see [`advise`]); `None` where the allocator refuses them.
pub fn zeroed_vec<T: Copy + Default>(n: usize) -> Option<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).ok()?;
    advise(v.spare_capacity_mut());
    v.resize(n, T::default());
    Some(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeroed_vectors_are_zero_and_sized() {
        for n in [0, 1, 1000, 3 * HUGE_PAGE / 4 + 5] {
            let v: Vec<f32> = zeroed_vec(n).unwrap();
            assert_eq!(v.len(), n);
            assert!(v.iter().all(|x| *x == 0.0));
        }
        assert!(zeroed_vec::<f32>(usize::MAX / 2).is_none());
    }

    #[test]
    fn advice_over_any_buffer_is_harmless() {
        let mut v: Vec<u8> = Vec::with_capacity(3 * HUGE_PAGE);
        advise(v.spare_capacity_mut());
        v.extend((0..3 * HUGE_PAGE).map(|i| i as u8));
        assert!(v.iter().enumerate().all(|(i, b)| *b == i as u8));
        let mut small = [MaybeUninit::<u64>::uninit(); 4];
        advise(&mut small);
    }
}
