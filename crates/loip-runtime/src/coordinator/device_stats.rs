//! Per-device sums over the pipeline's steps, from the times each worker reports with its
//! hop (output frame or notice), and the KV tokens the pipeline's sequences hold.
//!
//! Invariants: every completed hop adds once to its device; a hop's network time is the
//! coordinator's wait for it (from the previous hop's report, or the step's dispatch, to
//! this one's) less the time inside the worker, never negative; held tokens per sequence are
//! the highest position a step carried plus one, dropped when the sequence is released.

use std::collections::BTreeMap;

use loip_engine::TokenPos;
use serde::Serialize;

use crate::wire::JobTimes;

/// What one device did over the pipeline's steps so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct DeviceStepTotals {
    /// hops run there
    pub hops: u64,
    /// block compute  // seconds
    pub compute_s: f64,
    /// waiting for loads  // seconds
    pub stall_s: f64,
    /// waiting in the device's queue behind other steps  // seconds
    pub queued_s: f64,
    /// transfers into the hop and its report back (wait less the worker's time)  // seconds
    pub network_s: f64,
    /// bytes loaded from the device's SSD  // bytes
    pub loaded_bytes: u64,
}

/// The pipeline's per-device sums and the KV tokens its sequences hold.
#[derive(Debug, Default)]
pub(super) struct DeviceLedger {
    devices: Vec<DeviceStepTotals>,
    held: BTreeMap<u64, u64>, // seq → tokens cached
}

impl DeviceLedger {
    /// A ledger for `n` devices.
    pub(super) fn new(n: usize) -> DeviceLedger {
        DeviceLedger {
            devices: vec![DeviceStepTotals::default(); n],
            held: BTreeMap::new(),
        }
    }

    /// Device `d` ran a hop: its worker's times, and the coordinator's wait for it.
    pub(super) fn hop(&mut self, d: usize, times: &JobTimes, waited_s: f64) {
        if let Some(t) = self.devices.get_mut(d) {
            t.hops += 1;
            t.compute_s += times.compute_s;
            t.stall_s += times.stall_s;
            t.queued_s += times.queued_s;
            t.loaded_bytes += times.loaded_bytes;
            t.network_s += (waited_s - times.total_s).max(0.0);
        }
    }

    /// A step entered the pipeline: its sequences hold KV up to its last positions.
    pub(super) fn step(&mut self, batch: &[TokenPos]) {
        for t in batch {
            let e = self.held.entry(t.seq).or_insert(0);
            *e = (*e).max((t.pos as u64).saturating_add(1));
        }
    }

    /// Sequence `seq` keeps its first `len` positions (speculative decoding).
    pub(super) fn rewind(&mut self, seq: u64, len: usize) {
        if let Some(e) = self.held.get_mut(&seq) {
            *e = (*e).min(len as u64);
        }
    }

    /// Sequences whose KV the devices dropped.
    pub(super) fn release(&mut self, seqs: &[u64]) {
        for s in seqs {
            self.held.remove(s);
        }
    }

    /// Each device's sums, in pipeline order.
    pub(super) fn devices(&self) -> Vec<DeviceStepTotals> {
        self.devices.clone()
    }

    /// KV tokens held now, summed over sequences  // tokens
    pub(super) fn held_tokens(&self) -> u64 {
        self.held.values().sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn times(compute_s: f64, total_s: f64) -> JobTimes {
        JobTimes {
            queued_s: 0.0,
            compute_s,
            stall_s: 0.0,
            total_s,
            loaded_bytes: 10,
        }
    }

    #[test]
    fn sums_hops_per_device_and_tokens_per_sequence() {
        let mut l = DeviceLedger::new(2);
        l.hop(1, &times(0.5, 0.6), 1.0);
        l.hop(1, &times(0.25, 0.3), 0.2); // reported before the wait: no negative network
        l.hop(7, &times(1.0, 1.0), 2.0); // out of range: ignored
        let d = l.devices();
        assert_eq!(d[0], DeviceStepTotals::default());
        assert_eq!(d[1].hops, 2);
        assert!((d[1].compute_s - 0.75).abs() < 1e-12);
        assert!((d[1].network_s - 0.4).abs() < 1e-12);
        assert_eq!(d[1].loaded_bytes, 20);
        let tp = |seq, pos| TokenPos { seq, pos };
        l.step(&[tp(1, 0), tp(1, 1), tp(1, 2), tp(2, 0)]);
        l.step(&[tp(1, 3), tp(2, 1)]);
        assert_eq!(l.held_tokens(), 6);
        l.rewind(1, 2); // two rejected drafts dropped
        assert_eq!(l.held_tokens(), 4);
        l.step(&[tp(1, 2), tp(1, 3), tp(1, 4)]);
        assert_eq!(l.held_tokens(), 7);
        l.release(&[1]);
        assert_eq!(l.held_tokens(), 2);
    }
}
