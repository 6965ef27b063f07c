//! Run-time x86-64 feature detection without `std`.
//!
//! `is_x86_feature_detected!` lives in `std`, so this asks the CPU directly: `cpuid`
//! for what the CPU implements, and `xgetbv` for what the OS has enabled (a CPU
//! with AVX-512 under an OS that does not save the ZMM registers must not run AVX-512
//! code). The answer is computed once and cached in an atomic; racing first calls
//! compute the same value.
//!
//! Why the `unsafe` here is sound: `cpuid` exists on every x86-64 CPU. `xgetbv` is
//! executed only after `cpuid` reports OSXSAVE, which means the OS has enabled
//! `XSAVE` and `xgetbv` is a valid instruction.
#![allow(unsafe_code)]

use core::arch::x86_64::{__cpuid_count, _xgetbv, CpuidResult};
use core::sync::atomic::{AtomicU8, Ordering};

const KNOWN: u8 = 1;
const AVX2: u8 = 2;
const AVX512: u8 = 4;
const AVX512_VNNI: u8 = 8;
const AVX_VNNI: u8 = 16;
const AMD: u8 = 32;

static FEATURES: AtomicU8 = AtomicU8::new(0);

fn cpuid(leaf: u32, sub: u32) -> CpuidResult {
    // SAFETY: `cpuid` is available on every x86-64 CPU and has no side effects.
    #[allow(unused_unsafe)]
    unsafe {
        __cpuid_count(leaf, sub)
    }
}

#[target_feature(enable = "xsave")]
unsafe fn xcr0() -> u64 {
    // SAFETY: the caller checked OSXSAVE, so `xgetbv` is enabled; register 0 (XCR0)
    // always exists.
    #[allow(unused_unsafe)]
    unsafe {
        _xgetbv(0)
    }
}

/// The vendor strings of AMD's cores (Hygon's are AMD's Zen).
const AMD_VENDORS: [&[u8; 12]; 2] = [b"AuthenticAMD", b"HygonGenuine"];

/// A 12-byte vendor string as `cpuid` leaf 0 returns it (EBX, EDX, ECX).
fn vendor_words(v: &[u8; 12]) -> [u32; 3] {
    let w = |i: usize| u32::from_le_bytes([v[i], v[i + 1], v[i + 2], v[i + 3]]);
    [w(0), w(4), w(8)]
}

fn bit(word: u32, n: u32) -> bool {
    (word >> n) & 1 == 1
}

fn detect() -> u8 {
    let mut out = KNOWN;
    let l0 = cpuid(0, 0);
    // The vendor string is EBX, EDX, ECX.
    let vendor = [l0.ebx, l0.edx, l0.ecx];
    if AMD_VENDORS.iter().any(|v| vendor_words(v) == vendor) {
        out |= AMD;
    }
    let max_leaf = l0.eax;
    if max_leaf < 7 {
        return out;
    }
    let l1 = cpuid(1, 0);
    let fma = bit(l1.ecx, 12);
    let osxsave = bit(l1.ecx, 27);
    let avx = bit(l1.ecx, 28);
    let f16c = bit(l1.ecx, 29);
    if !(osxsave && avx) {
        return out;
    }
    // SAFETY: OSXSAVE is set (checked just above).
    let xcr0 = unsafe { xcr0() };
    let os_ymm = xcr0 & 0b110 == 0b110; // SSE and AVX state
    let os_zmm = xcr0 & 0b1110_0110 == 0b1110_0110; // plus opmask, ZMM_Hi256, Hi16_ZMM
    let l7 = cpuid(7, 0);
    let avx2 = bit(l7.ebx, 5);
    let avx512f = bit(l7.ebx, 16);
    let avx512bw = bit(l7.ebx, 30);
    let avx512vl = bit(l7.ebx, 31);
    if os_ymm && avx && avx2 && fma && f16c {
        out |= AVX2;
        // Leaf 7 sub-leaf 1 (present if sub-leaf 0 says so), EAX bit 4.
        if l7.eax >= 1 && bit(cpuid(7, 1).eax, 4) {
            out |= AVX_VNNI;
        }
        if os_zmm && avx512f && avx512bw && avx512vl {
            out |= AVX512;
            if bit(l7.ecx, 11) {
                out |= AVX512_VNNI;
            }
        }
    }
    out
}

fn features() -> u8 {
    let f = FEATURES.load(Ordering::Relaxed);
    if f & KNOWN != 0 {
        return f;
    }
    let f = detect();
    FEATURES.store(f, Ordering::Relaxed);
    f
}

/// AVX2, FMA and F16C, with the OS saving YMM state.
pub(crate) fn has_avx2() -> bool {
    features() & AVX2 != 0
}

/// AVX-512 F, BW and VL (and everything [`has_avx2`] needs), with the OS saving ZMM
/// state.
pub(crate) fn has_avx512() -> bool {
    features() & AVX512 != 0
}

/// AVX-VNNI, the VEX-encoded `vpdpbusd` (and everything [`has_avx2`] needs).
pub(crate) fn has_avx_vnni() -> bool {
    features() & AVX_VNNI != 0
}

/// An AMD (or Hygon) CPU.
pub(crate) fn is_amd() -> bool {
    features() & AMD != 0
}

/// AVX-512 VNNI (and everything [`has_avx512`] needs).
pub(crate) fn has_avx512_vnni() -> bool {
    features() & AVX512_VNNI != 0
}

#[cfg(test)]
mod tests {
    #[test]
    fn agrees_with_std() {
        extern crate std;
        let avx2 = std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c");
        let avx512 = avx2
            && std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx512bw")
            && std::is_x86_feature_detected!("avx512vl");
        assert_eq!(super::has_avx2(), avx2);
        assert_eq!(super::has_avx512(), avx512);
        let vnni = avx512 && std::is_x86_feature_detected!("avx512vnni");
        assert_eq!(super::has_avx512_vnni(), vnni);
        let avx_vnni = avx2 && std::is_x86_feature_detected!("avxvnni");
        assert_eq!(super::has_avx_vnni(), avx_vnni);
    }

    #[test]
    fn vendor_words_are_the_registers_order() {
        // "GenuineIntel" is EBX "Genu", EDX "ineI", ECX "ntel".
        assert_eq!(
            super::vendor_words(b"GenuineIntel"),
            [0x756e_6547, 0x4965_6e69, 0x6c65_746e]
        );
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn vendor_agrees_with_the_kernel() {
        extern crate std;
        let info = std::fs::read_to_string("/proc/cpuinfo").unwrap();
        let vendor = info
            .lines()
            .find_map(|l| l.strip_prefix("vendor_id"))
            .map(|v| v.trim_start_matches([' ', '\t', ':']).trim())
            .unwrap();
        let amd = super::AMD_VENDORS
            .iter()
            .any(|v| v[..] == *vendor.as_bytes());
        assert_eq!(super::is_amd(), amd, "vendor_id {vendor}");
    }
}
