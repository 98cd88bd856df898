//! Adaptive draft length: per sequence, how many draft tokens the next step verifies.
//!
//! Pure state (times are inputs). The model: each draft token is accepted with probability
//! `a` given the previous one was (a geometric run), so a step verifying `k` drafts yields
//! `E(k) = 1 + a + … + a^k` tokens; it costs `c(k)`, the time of a step of `k + 1` positions
//! over one. The next `k` maximises `E(k) / c(k)`.
//!
//! - `a` is the ratio of accepted drafts to drafts that were tested (a step that accepts `j`
//!   of `k` drafts tested `j + 1` of them when `j < k`, else `k`), both counts decaying so a
//!   change of regime (copying starts or stops) shows within a few steps.
//! - `c(k)` starts from a prior: a table of step times by size when the caller has one (the
//!   cost model's `loip_plan::speculate::verify_step_times` for a cluster's plan, or times measured
//!   before), else a slope (`StepCost::prior_per_row`). Measured times of steps of each size
//!   (drafting included: a draft model's `k` steps count) are blended in as both sizes of a
//!   ratio are seen, weighing more with more samples: a plan's table holds against a few
//!   noisy steps (on a compute-bound plan, where a step of `k + 1` positions costs nearly
//!   `k + 1` steps, three unlucky samples must not make drafting look free), a slope guess
//!   gives way after a couple.
//! - A draft must promise 2 % more tokens per unit time than none, and an extra position is
//!   taken to cost at least 1 % of a step (so timing noise never makes drafting look free).
//! - At `a` near 0 the best `k` is 0; a step at `k = 0` teaches nothing, so after
//!   `probe_every` such steps one step verifies a single draft; each probe whose draft is
//!   rejected doubles the gap to the next (up to `MAX_PROBE_GAP`), an accepted one resets it,
//!   so a sequence whose drafts never hit pays for fewer and fewer probes.
//!
//! Invariant: the choice never changes which tokens are produced (verification is exact),
//! only how many positions a step carries.

/// The relative cost of a step of `n` positions of one sequence.
#[derive(Debug, Clone)]
pub struct StepCost {
    /// the prior `c(n) = 1 + prior_per_row × (n − 1)` (where `table` has no entry)
    pub prior_per_row: f64,
    table: Vec<f64>, // [n - 1]: prior seconds of a step of n positions (may be empty)
    seconds: Vec<Option<f64>>, // [n - 1]: decayed mean seconds of a step of n positions
    samples: Vec<u32>, // [n - 1]: steps of n positions measured
}

/// Measured steps of a size that weigh as much as a plan's table: a measured ratio of two
/// sizes counts `m / (m + TRUST_TABLE)` (in logarithms) against the table's, `m` the fewer
/// samples of the two. With ±30 % noise per step a handful of samples can make an extra
/// position look several times cheaper than it is; after 16 the decayed mean's noise is a
/// few percent and it weighs half.
const TRUST_TABLE: f64 = 16.0;

/// The same for the slope prior (a guess, not a price): a measurement weighs half after
/// two samples.
const TRUST_SLOPE: f64 = 2.0;

impl StepCost {
    /// A cost model for steps of up to `max_rows` positions with a prior slope.
    pub fn new(max_rows: usize, prior_per_row: f64) -> StepCost {
        StepCost {
            prior_per_row,
            table: Vec::new(),
            seconds: vec![None; max_rows.max(1)],
            samples: vec![0; max_rows.max(1)],
        }
    }

    /// Takes `table[n - 1]`, the time of a step of `n` positions (any unit: only ratios are
    /// used), as the prior where both sizes of a ratio are in it; non-finite or non-positive
    /// entries end the table.
    pub fn with_table(mut self, table: &[f64]) -> StepCost {
        self.table = table
            .iter()
            .copied()
            .take_while(|t| t.is_finite() && *t > 0.0)
            .collect();
        self
    }

    /// Records a step of `rows` positions that took `seconds`.
    pub fn observe(&mut self, rows: usize, seconds: f64) {
        if rows == 0 || !seconds.is_finite() || seconds <= 0.0 {
            return;
        }
        if let (Some(s), Some(n)) = (
            self.seconds.get_mut(rows - 1),
            self.samples.get_mut(rows - 1),
        ) {
            *s = Some(s.map_or(seconds, |m| 0.8 * m + 0.2 * seconds));
            *n = n.saturating_add(1);
        }
    }

    /// `c(rows)`: a step of `rows` positions over a step of one (≥ 1 for rows ≥ 1).
    pub fn relative(&self, rows: usize) -> f64 {
        self.ratio(1, rows)
    }

    /// A step of `to` positions over a step of `from` (1 ≤ from ≤ to): the prior's (the
    /// table's where it has both sizes, else the slope's) blended with the measured ratio
    /// where both sizes were seen, the measurement weighing more with more samples of
    /// each ([`TRUST_TABLE`], [`TRUST_SLOPE`]); never below 1 % a position more (timing
    /// noise must not make extra positions look free).
    pub fn ratio(&self, from: usize, to: usize) -> f64 {
        let from = from.max(1);
        if to <= from {
            return 1.0;
        }
        let least = floor(to - from + 1);
        let tabled = |n: usize| self.table.get(n - 1).copied();
        let (prior, trust) = match (tabled(from), tabled(to)) {
            (Some(a), Some(b)) => (b / a, TRUST_TABLE),
            _ => {
                let slope = |n: usize| 1.0 + self.prior_per_row * (n - 1) as f64;
                (slope(to) / slope(from), TRUST_SLOPE)
            }
        };
        let prior = prior.max(least);
        let seen = |n: usize| {
            let s = self.seconds.get(n - 1).copied().flatten()?;
            Some((s, *self.samples.get(n - 1)?))
        };
        let ratio = match (seen(from), seen(to)) {
            (Some((a, na)), Some((b, nb))) if a > 0.0 => {
                let m = f64::from(na.min(nb));
                let w = m / (m + trust);
                ((1.0 - w) * prior.ln() + w * (b / a).max(least).ln()).exp()
            }
            _ => prior,
        };
        ratio.max(least)
    }
}

/// The least relative cost assumed for a step of `rows` positions: 1 % per extra position.
fn floor(rows: usize) -> f64 {
    1.0 + 0.01 * rows.saturating_sub(1) as f64
}

/// A draft is worth verifying only when it promises this much more tokens per unit time
/// than a step without drafts.
const MIN_GAIN: f64 = 1.02;

/// The longest gap between probes of a sequence whose probes keep failing. // steps
pub const MAX_PROBE_GAP: usize = 256;

/// The per-sequence draft-length controller.
#[derive(Debug, Clone)]
pub struct AdaptiveK {
    k_max: usize,
    accepted: f64, // decayed count of accepted drafts
    tested: f64,   // decayed count of drafts tested (accepted + first rejected)
    idle: usize,   // steps at k = 0 since the last probe
    probe_every: usize,
    probe_gap: usize, // idle steps before the next probe (probe_every, doubled per failure)
    probing: bool,    // the last k asked for was a probe
    /// the step cost model
    pub cost: StepCost,
}

/// How fast old observations fade (per step).
const DECAY: f64 = 0.9;

impl AdaptiveK {
    /// A controller of drafts up to `k_max` with a prior acceptance of 1/2 (worth one step)
    /// and a prior step-cost slope `prior_per_row`.
    pub fn new(k_max: usize, prior_per_row: f64) -> AdaptiveK {
        AdaptiveK {
            k_max,
            accepted: 1.0,
            tested: 2.0,
            idle: 0,
            probe_every: 16,
            probe_gap: 16,
            probing: false,
            cost: StepCost::new(k_max + 1, prior_per_row),
        }
    }

    /// [`AdaptiveK::new`] with a prior table of step times by size ([`StepCost::with_table`]).
    pub fn with_table(k_max: usize, prior_per_row: f64, table: &[f64]) -> AdaptiveK {
        let mut a = AdaptiveK::new(k_max, prior_per_row);
        a.cost = a.cost.with_table(table);
        a
    }

    /// A controller that always asks for `k` (no adaptation).
    pub fn fixed(k: usize) -> AdaptiveK {
        let mut a = AdaptiveK::new(k, 0.0);
        a.probe_every = 0;
        a
    }

    /// The estimated acceptance rate of one draft token.
    pub fn acceptance(&self) -> f64 {
        if self.tested > 0.0 {
            self.accepted / self.tested
        } else {
            0.0
        }
    }

    /// The number of drafts the next step should verify (before any cap of the caller).
    pub fn next_k(&mut self) -> usize {
        let cost = self.cost.clone();
        self.next_k_shared(0, &cost)
    }

    /// [`AdaptiveK::next_k`] for a step shared with `others` positions of other sequences
    /// (one token each): the `k` with the most tokens of the whole step per unit of its
    /// time, `(others + E(k)) / c(others + 1 → others + 1 + k)` from `cost`, the step cost
    /// model of the steps of all sequences (a draft that slows the neighbours more than it
    /// gains is not worth it).
    pub fn next_k_shared(&mut self, others: usize, cost: &StepCost) -> usize {
        if self.probe_every == 0 {
            return self.k_max; // fixed
        }
        let a = self.acceptance().clamp(0.0, 0.999);
        let base = others as f64 + 1.0; // tokens of a step without this sequence's drafts
        let mut best = (0usize, MIN_GAIN * base); // (k, tokens per unit cost to beat)
        let mut expected = 1.0;
        let mut term = 1.0;
        for k in 1..=self.k_max {
            term *= a;
            expected += term;
            let rate = (others as f64 + expected) / cost.ratio(others + 1, others + 1 + k);
            if rate > best.1 * 1.0001 {
                best = (k, rate);
            }
        }
        self.probing = false;
        if best.0 == 0 && self.k_max > 0 {
            self.idle += 1;
            if self.idle >= self.probe_gap {
                self.idle = 0;
                self.probing = true;
                return 1;
            }
        }
        best.0
    }

    /// Records a step that verified `drafted` drafts and accepted the first `accepted` of them
    /// in `seconds` (`None`: not timed).
    pub fn observe(&mut self, drafted: usize, accepted: usize, seconds: Option<f64>) {
        if let Some(s) = seconds {
            self.cost.observe(drafted + 1, s);
        }
        if drafted == 0 {
            return;
        }
        if std::mem::take(&mut self.probing) {
            self.probe_gap = if accepted > 0 {
                self.probe_every
            } else {
                (self.probe_gap * 2).min(MAX_PROBE_GAP)
            };
        }
        let tested = if accepted < drafted {
            accepted + 1
        } else {
            drafted
        };
        self.accepted = DECAY * self.accepted + accepted as f64;
        self.tested = DECAY * self.tested + tested as f64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_acceptance_asks_for_the_most_and_rejection_falls_to_zero() {
        let mut a = AdaptiveK::new(6, 0.1);
        for _ in 0..20 {
            a.observe(6, 6, None);
        }
        assert_eq!(a.next_k(), 6);
        for _ in 0..60 {
            a.observe(1, 0, None);
        }
        assert_eq!(a.next_k(), 0);
        // measured steps whose noise makes a longer one look no dearer do not bring it back
        a.cost.observe(1, 0.010);
        a.cost.observe(2, 0.009);
        assert_eq!(a.next_k(), 0);
        // a probe of one draft comes after `probe_every` idle steps (two were above); each
        // rejected one doubles the gap: 16, 32, 64, …
        let mut probes = Vec::new();
        for step in 1..=400 {
            if a.next_k() == 1 {
                probes.push(step);
                a.observe(1, 0, None);
            }
        }
        assert_eq!(probes, vec![14, 46, 110, 238]);
        // an accepted probe brings the gap back to `probe_every`
        assert_eq!(a.probe_gap, 256);
        assert!((0..=MAX_PROBE_GAP).any(|_| a.next_k() == 1));
        a.observe(1, 1, None);
        assert_eq!(a.probe_gap, 16);
    }

    #[test]
    fn a_prior_table_prices_steps_until_they_are_measured() {
        // acceptance about 0.6; the table says a position more costs 40 % of a step
        let table: Vec<f64> = (1..=9)
            .map(|n| 0.010 * (1.0 + 0.4 * (n - 1) as f64))
            .collect();
        let mut a = AdaptiveK::with_table(8, 0.02, &table);
        for _ in 0..40 {
            a.observe(4, 2, None);
        }
        assert!(a.next_k() <= 1, "{}", a.next_k());
        assert!((a.cost.relative(3) - 1.8).abs() < 1e-9);
        // one measurement of each size barely moves it; many replace it
        for n in 1..=9 {
            a.cost.observe(n, 0.010 + 0.0001 * (n - 1) as f64);
        }
        assert!(a.next_k() <= 1, "{}", a.next_k());
        for _ in 0..200 {
            for n in 1..=9 {
                a.cost.observe(n, 0.010 + 0.0001 * (n - 1) as f64);
            }
        }
        assert!(a.next_k() >= 6, "{}", a.next_k());
        // a broken table ends at its first bad entry
        let c = StepCost::new(4, 0.5).with_table(&[1.0, 1.1, f64::NAN, 9.0]);
        assert!((c.relative(2) - 1.1).abs() < 1e-9);
        assert!((c.relative(4) - 2.5).abs() < 1e-9);
    }

    #[test]
    fn costly_steps_shorten_the_draft() {
        // acceptance about 0.6: cheap extra rows → long drafts, dear ones → short or none
        let mut cheap = AdaptiveK::new(8, 0.02);
        let mut dear = AdaptiveK::new(8, 0.9);
        for a in [&mut cheap, &mut dear] {
            for _ in 0..40 {
                a.observe(4, 2, None);
            }
        }
        assert!(cheap.next_k() >= 6, "{}", cheap.next_k());
        assert!(dear.next_k() <= 1, "{}", dear.next_k());
        // measured times override the prior
        let mut m = AdaptiveK::new(8, 0.9);
        for _ in 0..40 {
            m.observe(4, 2, None);
            for n in 1..=9 {
                m.cost.observe(n, 0.010 + 0.0001 * (n - 1) as f64);
            }
        }
        assert!(m.next_k() >= 6, "{}", m.next_k());
        assert!(AdaptiveK::fixed(3).next_k() == 3);
    }

    #[test]
    fn a_shared_step_weighs_the_neighbours_time() {
        // acceptance about 0.6, three neighbours of one position each
        let mut a = AdaptiveK::new(8, 0.25);
        for _ in 0..40 {
            a.observe(4, 2, None);
        }
        // compute-bound: each position more costs half a one-position step (a sixth of the
        // 4-position one)
        let mut dear = StepCost::new(16, 0.25);
        let mut cheap = StepCost::new(16, 0.25);
        for _ in 0..20 {
            for n in 1..=16 {
                dear.observe(n, 0.010 * (1.0 + 0.5 * n as f64));
                // load-bound: positions nearly free
                cheap.observe(n, 0.100 + 0.0005 * n as f64);
            }
        }
        assert_eq!(a.next_k_shared(3, &dear), 0);
        // load-bound: drafts pay even beside neighbours
        assert!(
            a.next_k_shared(3, &cheap) >= 4,
            "{}",
            a.next_k_shared(3, &cheap)
        );
        // alone, the same costs give what next_k gives
        let mut b = a.clone();
        b.cost = cheap.clone();
        assert_eq!(b.next_k(), a.next_k_shared(0, &cheap));
    }

    /// ±30 % uniform noise, deterministic (xorshift64).
    struct Noise(u64);

    impl Noise {
        fn uniform(&mut self) -> f64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            (self.0 >> 11) as f64 / (1u64 << 53) as f64
        }

        fn factor(&mut self) -> f64 {
            0.7 + 0.6 * self.uniform()
        }
    }

    /// Decodes `tokens` tokens with `a` choosing each step's drafts, each draft kept with
    /// probability `accept` (until the first rejected one), a step of `n` positions taking
    /// `cost(n)` and measured with ±30 % noise: the true time per token over a plain step's
    /// (`cost(1)`), and the steps that verified drafts.
    fn replay(
        a: &mut AdaptiveK,
        cost: impl Fn(usize) -> f64,
        accept: f64,
        tokens: usize,
        seed: u64,
    ) -> (f64, usize) {
        let mut noise = Noise(seed);
        let (mut made, mut time, mut drafting) = (0, 0.0, 0);
        while made < tokens {
            let k = a.next_k().min(tokens - made - 1);
            let kept = (0..k).take_while(|_| noise.uniform() < accept).count();
            time += cost(k + 1);
            a.observe(k, kept, Some(cost(k + 1) * noise.factor()));
            made += kept + 1;
            drafting += usize::from(k > 0);
        }
        (time / made as f64 / cost(1), drafting)
    }

    #[test]
    fn a_compute_bound_plan_does_not_draft_on_noisy_timings() {
        // the plan's price: a step of n positions costs nearly n one-position steps
        let cost = |n: usize| 0.040 * (0.1 + 0.9 * n as f64);
        let table: Vec<f64> = (1..=9).map(cost).collect();
        // three unlucky samples: one-position steps 30 % slow, two-position ones 30 % fast
        // measure a position more as 2 % (the truth: 90 %). Taken at their word they make a
        // draft pay at 70 % acceptance (1.7 tokens for 1.02 steps) and lose 12 % in truth
        // (1.7 tokens for 1.9 steps); against the table they weigh 3/19.
        let mut a = AdaptiveK::with_table(8, 0.03, &table);
        for _ in 0..20 {
            a.observe(2, 1, None);
            a.observe(1, 1, None);
        }
        for _ in 0..3 {
            a.cost.observe(1, cost(1) * 1.3);
            a.cost.observe(2, cost(2) * 0.7);
        }
        assert!(a.acceptance() > 0.65, "{}", a.acceptance());
        assert_eq!(a.next_k(), 0);
        // whole runs with noisy timings: copying (70 % acceptance) and never hitting
        for (accept, seed) in [(0.7, 1), (0.7, 2), (0.9, 3), (0.0, 4), (0.0, 5)] {
            let mut a = AdaptiveK::with_table(8, 0.03, &table);
            let (ratio, drafting) = replay(&mut a, cost, accept, 256, seed);
            assert!(ratio <= 1.03, "acceptance {accept}: {ratio:.3}× plain");
            // probes only (at 90 % a draft breaks even: 1.9 tokens for 1.9 steps)
            if accept < 0.8 {
                assert!(
                    drafting <= 20,
                    "acceptance {accept}: {drafting} drafting steps"
                );
            }
        }
    }

    #[test]
    fn a_load_bound_plan_drafts_and_measurements_correct_a_wrong_table() {
        // load-bound: a position more costs 2 % of a step
        let cheap = |n: usize| 0.040 * (1.0 + 0.02 * (n - 1) as f64);
        let table: Vec<f64> = (1..=9).map(cheap).collect();
        for seed in 1..=3 {
            let mut a = AdaptiveK::with_table(8, 0.03, &table);
            let (ratio, _) = replay(&mut a, cheap, 0.7, 256, seed);
            assert!(ratio <= 0.6, "{ratio:.3}× plain");
            // every draft rejected: back to one position a step, probes rarely
            let mut a = AdaptiveK::with_table(8, 0.03, &table);
            let (ratio, _) = replay(&mut a, cheap, 0.0, 256, seed);
            assert!(ratio <= 1.03, "{ratio:.3}× plain");
        }
        // a table that prices the load-bound device as compute-bound gives way to the
        // probes' measurements over a long run
        let dear: Vec<f64> = (1..=9).map(|n| 0.040 * (0.1 + 0.9 * n as f64)).collect();
        let mut a = AdaptiveK::with_table(8, 0.03, &dear);
        let (ratio, _) = replay(&mut a, cheap, 0.7, 4000, 7);
        assert!(ratio <= 0.9, "{ratio:.3}× plain");
    }
}
