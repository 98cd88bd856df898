//! KV lending (design §6), the coordinator's side: which peer a device lends to, how many
//! rows per stage (Eq. 8 at the measured rate, never below what the KV held needs), the
//! reservations on the borrower and the answers to them.

use loip_plan::adapt::{lend_cap_tokens, lend_grow};

use super::{lock, Action, Adapter};

impl Adapter {
    /// Bytes reserved on device `p` for its peers' lent KV.  // bytes
    pub(super) fn borrowed(&self, p: usize) -> u64 {
        self.devs
            .iter()
            .filter(|d| d.lend.is_some_and(|l| l.0 == p))
            .map(|d| d.lend_bytes)
            .sum()
    }

    /// KV bytes device `i` can hold for its own sequences: its layout's room, less what it
    /// reserved for peers, plus what lending frees there.  // bytes
    pub(super) fn room(&self, i: usize) -> u64 {
        let d = &self.devs[i];
        let lent = d.lend.map_or(0, |l| l.1) * d.saving_pt(self.per_layer);
        d.kv_budget.saturating_sub(self.borrowed(i)) + lent
    }

    /// Eq. 8 for device `i`: most rows per stage whose send and fetch-back fit the idle
    /// window between two of its stages at the measured rate (unbounded before any
    /// measurement).  // tokens
    pub(super) fn link_cap(&self, i: usize, seqs: u64) -> u64 {
        let (Some(bw), Some(round)) = (self.bandwidth, self.round_s) else {
            return u64::MAX;
        };
        let d = &self.devs[i];
        let s = d.stages.max(1) as f64;
        let busy = seqs as f64 * d.n_max as f64 * (d.attn_s + d.mlp_s);
        lend_cap_tokens(
            bw,
            round / s - busy,
            (seqs * self.act_bytes) as f64,
            0.0,
            (d.n_max as u64 * self.per_layer) as f64,
            self.cfg.lend_link_fraction,
        )
    }

    pub(super) fn set_lend(&mut self, i: usize, lend: Option<(usize, u64)>, seqs: u64) {
        let d = &mut self.devs[i];
        d.lend = lend.filter(|l| l.1 > 0);
        d.lend_bytes = d.lend.map_or(0, |(_, n)| {
            n * d.kv_per_token + d.stages as u64 * (4 + 12 * (seqs + 1))
        });
    }

    /// Lending that makes device `i` hold `want` tokens: grown on its peer (the current one,
    /// or the one with the most spare memory) when the link and the peer's memory carry
    /// it; the action to send, after recording it.
    pub(super) fn try_lend(
        &mut self,
        i: usize,
        want: u64,
        ahead: u64,
        tokens: u64,
        seqs: u64,
    ) -> Option<Action> {
        let (peer, memory) = self.lend_target(i, ahead)?;
        let d = &self.devs[i];
        let saving = d.saving_pt(self.per_layer);
        let over = want
            .saturating_mul(d.kv_per_token)
            .saturating_sub(self.room(i));
        let have = d.lend.map_or(0, |l| l.1);
        // rows this device has to lend (the newest of each sequence stays)
        let rows = tokens.saturating_sub(seqs);
        let cap = self.link_cap(i, seqs).min(memory).min(rows);
        let n_ts = self.cfg.min_change_tokens as u64;
        // When the link cannot carry what `want` needs, lend what the KV held now needs
        // anyway where the peer's memory allows (slower, but the step does not fail).
        let now = tokens
            .saturating_mul(d.kv_per_token)
            .saturating_sub(self.room(i));
        let to = lend_grow(have, cap, over, saving, n_ts)
            .or_else(|| lend_grow(have, memory.min(rows), now, saving, 0))?;
        let prev = d.lend;
        self.devs[i].lend_prev = Some(prev);
        self.devs[i].peer = Some(peer);
        self.set_lend(i, Some((peer, to)), seqs);
        let bytes = self.devs[i].lend_bytes;
        Some(Action::Borrow {
            peer,
            lender: i,
            bytes,
            tokens: to,
        })
    }

    /// Rows per stage device `i` must lend to hold `tokens` of KV in its current layout
    /// (0 when it holds them without lending).  // tokens
    pub(super) fn lend_needed(&self, i: usize, tokens: u64) -> u64 {
        let d = &self.devs[i];
        let saving = d.saving_pt(self.per_layer);
        let own = d.kv_budget.saturating_sub(self.borrowed(i));
        let over = tokens.saturating_mul(d.kv_per_token).saturating_sub(own);
        if saving == 0 {
            return 0;
        }
        over.div_ceil(saving)
    }

    /// KV bytes lending could still free on device `i` holding `tokens` for `seqs`
    /// sequences: every row but each sequence's newest lent, within its peer's spare memory
    /// (0 without lending).  // bytes
    pub(super) fn lend_headroom(&self, i: usize, tokens: u64, seqs: u64) -> u64 {
        let Some((_, memory)) = self.lend_target(i, tokens) else {
            return 0;
        };
        let d = &self.devs[i];
        let have = d.lend.map_or(0, |l| l.1);
        let most = memory.min(tokens.saturating_sub(seqs));
        most.saturating_sub(have)
            .saturating_mul(d.saving_pt(self.per_layer))
    }

    /// Where device `i` lends (its current peer, or the one with the most spare memory
    /// once every device holds `ahead` tokens) and the most rows per stage that peer's
    /// memory takes; `None` when it cannot lend.  // tokens
    pub(super) fn lend_target(&self, i: usize, ahead: u64) -> Option<(usize, u64)> {
        let d = &self.devs[i];
        let saving = d.saving_pt(self.per_layer);
        if !self.lending || self.evict_only || saving == 0 || d.lend_refused || d.kv_per_token == 0
        {
            return None;
        }
        let spare = |p: usize| {
            self.room(p)
                .saturating_sub(ahead.saturating_mul(self.devs[p].kv_per_token))
        };
        let peer = d.peer.or_else(|| {
            (0..self.devs.len())
                .filter(|&p| p != i && self.devs[p].lend.is_none())
                .max_by_key(|&p| (spare(p), std::cmp::Reverse(p)))
        })?;
        Some((peer, (spare(peer) + d.lend_bytes) / d.kv_per_token))
    }

    /// A peer answered a reservation for `lender`'s KV: when reserved, the lend to send.
    pub fn on_borrowed(&mut self, lender: usize, ok: bool) -> Option<Action> {
        let d = self.devs.get_mut(lender)?;
        let prev = d.lend_prev.take()?;
        let mut rep = lock(&self.report);
        let name = rep
            .devices
            .get(lender)
            .map(|r| r.name.clone())
            .unwrap_or_default();
        if !ok {
            tracing::warn!("device {name}: its peer refused to hold its KV; not lending more");
            d.lend = prev;
            d.lend_refused = true;
            return None;
        }
        let (peer, tokens) = d.lend?;
        let peer_name = rep.devices.get(peer).map(|r| r.name.clone());
        tracing::info!(
            "device {name}: lends {tokens} KV tokens per stage to {}",
            peer_name.clone().unwrap_or_default()
        );
        let lent = tokens * d.saving_pt(self.per_layer);
        let bytes = d.lend_bytes;
        if let Some(r) = rep.devices.get_mut(lender) {
            r.lent_to = peer_name;
            r.lent_tokens = tokens;
            r.lent_bytes = lent;
        }
        if let Some(r) = rep.devices.get_mut(peer) {
            r.borrowed_bytes = bytes;
        }
        Some(Action::Lend {
            device: lender,
            tokens,
        })
    }

    /// Lent KV of `lender` came back: `bytes` in `secs` since it was asked (the transfer
    /// rate lending is sized by).
    pub fn on_fetched(&mut self, lender: usize, bytes: u64, secs: f64) {
        if secs > 0.0 && bytes > 0 {
            self.bandwidth = Some(bytes as f64 / secs);
        }
        let mut rep = lock(&self.report);
        rep.lend_bandwidth = self.bandwidth;
        if let Some(r) = rep.devices.get_mut(lender) {
            r.fetches += 1;
            r.kv_moved_bytes += 2 * bytes;
        }
    }

    /// The peer `lender` lends to (or lent to), if any.
    pub fn lend_peer(&self, lender: usize) -> Option<usize> {
        self.devs.get(lender)?.peer
    }
}
