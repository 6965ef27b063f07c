//! Run-time detection of aarch64's optional dot-product instructions without `std`.
//!
//! A build for a CPU that has them (`target_feature = "dotprod"`, as Apple's
//! targets are) needs no check. Elsewhere, on Linux and Android, the kernel says
//! what the CPU has in the auxiliary vector: `getauxval(AT_HWCAP)` (from the C
//! library every such program links; `std` asks the same way), bit `ASIMDDP`.
//! Other systems (bare metal) get the plain NEON kernels.
#![allow(unsafe_code)]

use core::sync::atomic::{AtomicU8, Ordering};

/// 0 = not asked yet, 1 = no, 2 = yes.
static DOTPROD: AtomicU8 = AtomicU8::new(0);

/// Whether the CPU has `sdot`/`udot` (ARMv8.2 `FEAT_DotProd`). Asked once and
/// cached; racing first calls compute the same answer.
pub fn has_dotprod() -> bool {
    if cfg!(target_feature = "dotprod") {
        return true;
    }
    match DOTPROD.load(Ordering::Relaxed) {
        0 => {
            let yes = from_auxv();
            DOTPROD.store(1 + yes as u8, Ordering::Relaxed);
            yes
        }
        v => v == 2,
    }
}

#[cfg(any(target_os = "linux", target_os = "android"))]
fn from_auxv() -> bool {
    /// `AT_HWCAP` of `<elf.h>`.
    const AT_HWCAP: core::ffi::c_ulong = 16;
    /// `HWCAP_ASIMDDP` of the kernel's `arch/arm64/include/uapi/asm/hwcap.h`.
    const HWCAP_ASIMDDP: core::ffi::c_ulong = 1 << 20;
    extern "C" {
        fn getauxval(kind: core::ffi::c_ulong) -> core::ffi::c_ulong;
    }
    // SAFETY: `getauxval` only reads the process's auxiliary vector; for a type
    // it does not know it returns 0.
    let hwcap = unsafe { getauxval(AT_HWCAP) };
    hwcap & HWCAP_ASIMDDP != 0
}

#[cfg(not(any(target_os = "linux", target_os = "android")))]
fn from_auxv() -> bool {
    false
}
