//! Loads on one disk that run at the same time: the disk's rate shared among the loads
//! running at each instant, fairly or at its measured rate for several readers
//! ([`crate::cost`]'s `share_disks`).

/// Loads on one disk that start at different times (`starts`, seconds) and would take
/// `works` seconds each alone, sharing the disk fairly among those running at each instant
/// (each runs at `1/n` of its own rate while `n` run): how long each lasts from its start.
/// Equal starts give the common-start sharing; loads that do not overlap keep their times.
/// // seconds
pub fn staggered_load_times(works: &[f64], starts: &[f64]) -> Vec<f64> {
    staggered(works, starts, |running| running.len().max(1) as f64)
}

/// [`staggered_load_times`] on a disk whose rate with several readers is measured: the loads
/// running at an instant share `rate` (bytes/s, in all), each at the same fraction
/// `min(1, rate / Σ solo)` of its own rate alone (`solo`, bytes/s); a load running alone
/// keeps its own rate, and a disk that serves three readers faster than one shares more than
/// `1/n`.
/// // seconds
pub fn staggered_load_times_at(works: &[f64], starts: &[f64], solo: &[f64], rate: f64) -> Vec<f64> {
    staggered(works, starts, |running| {
        let sum: f64 = running
            .iter()
            .map(|&i| solo.get(i).copied().unwrap_or(0.0))
            .sum();
        if running.len() > 1 && sum > 0.0 && rate > 0.0 {
            (sum / rate).max(1.0)
        } else {
            running.len().max(1) as f64
        }
    })
}

/// The processor-sharing pass: `slowdown(running)` is the wall time per second of work alone
/// of each load while the loads `running` (indices) run (`n` for fair sharing).
fn staggered(works: &[f64], starts: &[f64], slowdown: impl Fn(&[usize]) -> f64) -> Vec<f64> {
    let n = works.len().min(starts.len());
    let mut left: Vec<f64> = works[..n].iter().map(|w| w.max(0.0)).collect();
    let mut end = vec![f64::NAN; n];
    for i in 0..n {
        if left[i] <= 0.0 {
            end[i] = starts[i];
        }
    }
    let mut now = starts[..n].iter().copied().fold(f64::INFINITY, f64::min);
    // every pass ends a load or starts one: at most 2n events
    for _ in 0..2 * n + 1 {
        let running: Vec<usize> = (0..n)
            .filter(|&i| end[i].is_nan() && starts[i] <= now)
            .collect();
        let next_start = (0..n)
            .filter(|&i| end[i].is_nan() && starts[i] > now)
            .map(|i| starts[i])
            .fold(f64::INFINITY, f64::min);
        if running.is_empty() {
            if next_start.is_finite() {
                now = next_start;
                continue;
            }
            break;
        }
        let share = slowdown(&running).max(1.0);
        let first_done = running
            .iter()
            .map(|&i| left[i] * share)
            .fold(f64::INFINITY, f64::min);
        let step = first_done.min(next_start - now);
        for &i in &running {
            let t = left[i] * share;
            if t <= step * (1.0 + 1e-12) {
                left[i] = 0.0;
                end[i] = now + t.min(step);
            } else {
                left[i] -= step / share;
            }
        }
        now += step;
    }
    (0..n)
        .map(|i| {
            if end[i].is_nan() {
                works[i]
            } else {
                end[i] - starts[i]
            }
        })
        .collect()
}
