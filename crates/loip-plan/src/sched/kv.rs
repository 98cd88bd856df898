//! The KV ledger: per sequence and per device, how many tokens are cached and how many are
//! reserved.
//!
//! A device is a set of layers with a KV byte budget and a cost in bytes per cached token
//! (over its layers). A sequence reserves, at admission, the most tokens it can ever cache
//! (`prompt + max_new_tokens − 1`: the last sampled token is never fed), on every device.
//!
//! Growth (design §6, planning for what is held at admission): instead of the worst case, a
//! caller may reserve only what a sequence holds at admission and [`KvLedger::grant`] more as
//! it grows, while that fits; [`KvLedger::set_device`] follows a device whose KV room changed
//! (a plan switch offloaded or brought back blocks). A grant that does not fit is refused,
//! never half-made: the caller holds new admissions (the last resort), and an admitted
//! sequence's grant waits for room.
//!
//! Invariants: on every device `Σ reserved × bytes_per_token ≤ budget` (a budget lowered
//! below what is reserved refuses every grant until releases bring it back under), and a
//! sequence's cached tokens never exceed its reservation; a released sequence holds nothing
//! at once.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// One device's KV capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvDevice {
    /// KV bytes this device may hold for all sequences together // bytes
    pub budget: u64,
    /// KV bytes one cached token costs over this device's layers (K and V) // bytes / token
    pub bytes_per_token: u64,
}

/// What one device holds now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct KvUsage {
    /// bytes of K and V written // bytes
    pub used: u64,
    /// bytes promised to admitted sequences (≥ used) // bytes
    pub reserved: u64,
    /// the device's budget // bytes
    pub budget: u64,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    reserved: u64, // tokens
    cached: u64,   // tokens
}

/// Reservations and cached tokens of every admitted sequence on every device.
#[derive(Debug, Clone)]
pub struct KvLedger {
    devices: Vec<KvDevice>,
    seqs: BTreeMap<u64, Entry>,
    reserved: u64, // tokens, summed over sequences (the same on every device)
    cached: u64,   // tokens, summed over sequences
}

impl KvLedger {
    /// An empty ledger over `devices`.
    pub fn new(devices: Vec<KvDevice>) -> KvLedger {
        KvLedger {
            devices,
            seqs: BTreeMap::new(),
            reserved: 0,
            cached: 0,
        }
    }

    /// Whether `tokens` could ever be reserved, on an empty ledger.
    pub fn could_fit(&self, tokens: u64) -> bool {
        self.devices
            .iter()
            .all(|d| tokens.saturating_mul(d.bytes_per_token) <= d.budget)
    }

    /// Whether `tokens` more can be reserved now.
    pub fn fits(&self, tokens: u64) -> bool {
        let total = self.reserved.saturating_add(tokens);
        self.could_fit(total)
    }

    /// Reserves `tokens` for `seq` (the caller checked [`KvLedger::fits`]).
    pub(crate) fn reserve(&mut self, seq: u64, tokens: u64) {
        self.release(seq);
        self.seqs.insert(
            seq,
            Entry {
                reserved: tokens,
                cached: 0,
            },
        );
        self.reserved += tokens;
    }

    /// Records `tokens` more cached for `seq`, within its reservation.
    pub(crate) fn cache(&mut self, seq: u64, tokens: u64) {
        if let Some(e) = self.seqs.get_mut(&seq) {
            let add = tokens.min(e.reserved - e.cached);
            e.cached += add;
            self.cached += add;
        }
    }

    /// Frees everything `seq` holds.
    pub(crate) fn release(&mut self, seq: u64) {
        if let Some(e) = self.seqs.remove(&seq) {
            self.reserved -= e.reserved;
            self.cached -= e.cached;
        }
    }

    /// Grants `tokens` more to admitted `seq`'s reservation if they fit on every device now;
    /// false (nothing changed) when they do not or `seq` is unknown.
    pub fn grant(&mut self, seq: u64, tokens: u64) -> bool {
        if !self.seqs.contains_key(&seq) || !self.fits(tokens) {
            return false;
        }
        if let Some(e) = self.seqs.get_mut(&seq) {
            e.reserved += tokens;
            self.reserved += tokens;
        }
        true
    }

    /// Tokens that can still be reserved (or granted) on every device.  // tokens
    pub fn headroom(&self) -> u64 {
        self.devices
            .iter()
            .map(|d| {
                (d.budget / d.bytes_per_token.max(1)).saturating_sub(self.reserved)
            })
            .min()
            .unwrap_or(0)
    }

    /// Device `i`'s capacity changed (a plan switch); unknown `i` is ignored.
    pub fn set_device(&mut self, i: usize, device: KvDevice) {
        if let Some(d) = self.devices.get_mut(i) {
            *d = device;
        }
    }

    /// Tokens cached for `seq` (0 when unknown).
    pub fn cached_tokens(&self, seq: u64) -> u64 {
        self.seqs.get(&seq).map_or(0, |e| e.cached)
    }

    /// Per device: bytes used, reserved and the budget.
    pub fn usage(&self) -> Vec<KvUsage> {
        self.devices
            .iter()
            .map(|d| KvUsage {
                used: self.cached.saturating_mul(d.bytes_per_token),
                reserved: self.reserved.saturating_mul(d.bytes_per_token),
                budget: d.budget,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ledger() -> KvLedger {
        KvLedger::new(vec![
            KvDevice {
                budget: 1000,
                bytes_per_token: 10,
            },
            KvDevice {
                budget: 400,
                bytes_per_token: 2,
            },
        ])
    }

    #[test]
    fn grants_follow_growth_within_every_budget() {
        let mut l = ledger();
        assert_eq!(l.headroom(), 100);
        l.reserve(1, 30); // what the sequence holds at admission
        assert!(l.grant(1, 60));
        assert_eq!(l.headroom(), 10);
        assert!(!l.grant(1, 11), "over the first device's budget");
        assert!(!l.grant(2, 1), "unknown sequence");
        assert_eq!(l.usage()[0].reserved, 900);
        // a switch gives the first device more room
        l.set_device(
            0,
            KvDevice {
                budget: 2000,
                bytes_per_token: 10,
            },
        );
        assert!(l.grant(1, 100));
        assert_eq!(l.headroom(), 10, "now the second device limits");
        // a switch that takes room away: no grant until releases
        l.set_device(
            1,
            KvDevice {
                budget: 100,
                bytes_per_token: 2,
            },
        );
        assert_eq!(l.headroom(), 0);
        assert!(!l.grant(1, 1));
        l.release(1);
        assert_eq!(l.headroom(), 50);
        assert_eq!(l.usage()[1].reserved, 0);
    }
}
