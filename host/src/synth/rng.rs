//! Deterministic random numbers that are identical on every platform.
//!
//! SplitMix64 turns a seed and a stream name into independent xoshiro256++ states;
//! normals come from the Box-Muller transform computed with `libm` (pure Rust), so
//! the same seed gives the same bits whatever the OS, CPU or thread count.

/// One step of SplitMix64: advances `state` and returns a well-mixed 64-bit value.
pub fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// FNV-1a hash of a stream name.
fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// A xoshiro256++ generator.
#[derive(Clone, Debug)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    /// The generator for stream `name`, part `index`, of the model seeded `seed`.
    /// Distinct (name, index) pairs give independent streams.
    pub fn stream(seed: u64, name: &str, index: u64) -> Self {
        let mut sm = seed ^ fnv1a(name).rotate_left(17);
        let _ = splitmix64(&mut sm);
        sm ^= index.wrapping_mul(0xd1b5_4a32_d192_ed03);
        let mut s = [0u64; 4];
        for v in &mut s {
            *v = splitmix64(&mut sm);
        }
        if s == [0; 4] {
            s[0] = 1;
        }
        Rng { s }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[0].wrapping_add(s[3]).rotate_left(23).wrapping_add(s[0]);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in `(0, 1]` with 53 random bits.
    pub fn uniform_open0(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform integer in `0..n` (`n > 0`), by widening multiplication.
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// Fills `out` with independent normals of mean 0 and standard deviation `std`.
    pub fn fill_normal(&mut self, out: &mut [f32], std: f32) {
        let mut pairs = out.chunks_exact_mut(2);
        for pair in &mut pairs {
            let (a, b) = self.normal_pair();
            pair[0] = a * std;
            pair[1] = b * std;
        }
        if let [last] = pairs.into_remainder() {
            *last = self.normal_pair().0 * std;
        }
    }

    /// Two independent standard normals (Box-Muller).
    pub fn normal_pair(&mut self) -> (f32, f32) {
        let u1 = self.uniform_open0();
        let u2 = (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64);
        let r = libm::sqrt(-2.0 * libm::log(u1));
        let (s, c) = libm::sincos(core::f64::consts::TAU * u2);
        ((r * c) as f32, (r * s) as f32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_are_reproducible_and_distinct() {
        let a: Vec<u64> = {
            let mut r = Rng::stream(7, "x", 3);
            (0..4).map(|_| r.next_u64()).collect()
        };
        let mut r = Rng::stream(7, "x", 3);
        assert_eq!(a, (0..4).map(|_| r.next_u64()).collect::<Vec<_>>());
        let mut r = Rng::stream(7, "x", 4);
        assert_ne!(a, (0..4).map(|_| r.next_u64()).collect::<Vec<_>>());
        let mut r = Rng::stream(8, "x", 3);
        assert_ne!(a, (0..4).map(|_| r.next_u64()).collect::<Vec<_>>());
    }

    #[test]
    fn normals_have_unit_variance() {
        let mut r = Rng::stream(1, "normal", 0);
        let mut v = vec![0f32; 100_001];
        r.fill_normal(&mut v, 2.0);
        let n = v.len() as f64;
        let mean = v.iter().map(|&x| f64::from(x)).sum::<f64>() / n;
        let var = v
            .iter()
            .map(|&x| (f64::from(x) - mean).powi(2))
            .sum::<f64>()
            / n;
        assert!(mean.abs() < 0.02, "{mean}");
        assert!((var - 4.0).abs() < 0.08, "{var}");
    }
}
