//! Inputs for the stable runs of the fuzz bodies (`cargo test`, no libFuzzer): from a seeded
//! generator, random bytes or a seed with one to four mutations (a flipped bit, a byte set, a
//! range removed or repeated, random bytes inserted, the end cut), so each run is the same.

use rand::{Rng, SeedableRng};

/// The generator of one run.
pub fn rng(seed: u64) -> rand::rngs::StdRng {
    rand::rngs::StdRng::seed_from_u64(seed)
}

/// One input: a quarter random bytes (up to `max_len`), the rest mutated seeds.
pub fn input(rng: &mut impl Rng, seeds: &[Vec<u8>], max_len: usize) -> Vec<u8> {
    if seeds.is_empty() || rng.gen_bool(0.25) {
        let n = rng.gen_range(0..=max_len);
        return (0..n).map(|_| rng.gen()).collect();
    }
    let mut v = seeds[rng.gen_range(0..seeds.len())].clone();
    for _ in 0..rng.gen_range(1..=4) {
        let len = v.len();
        match rng.gen_range(0..6) {
            0 if len > 0 => {
                let i = rng.gen_range(0..len);
                v[i] ^= 1 << rng.gen_range(0..8);
            }
            1 if len > 0 => {
                let i = rng.gen_range(0..len);
                v[i] = rng.gen();
            }
            2 if len > 0 => {
                let a = rng.gen_range(0..len);
                let b = rng.gen_range(a..=len.min(a + 16));
                v.drain(a..b);
            }
            3 if len > 0 && len < max_len => {
                let a = rng.gen_range(0..len);
                let b = rng.gen_range(a..=len.min(a + 16));
                let chunk = v[a..b].to_vec();
                let at = rng.gen_range(0..=v.len());
                v.splice(at..at, chunk);
            }
            4 if len < max_len => {
                let at = rng.gen_range(0..=len);
                let n = rng.gen_range(1..=8);
                let bytes: Vec<u8> = (0..n).map(|_| rng.gen()).collect();
                v.splice(at..at, bytes);
            }
            _ if len > 0 => v.truncate(rng.gen_range(0..len)),
            _ => v.push(rng.gen()),
        }
    }
    v.truncate(max_len);
    v
}
