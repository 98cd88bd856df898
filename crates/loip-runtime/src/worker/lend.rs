//! KV lending on a worker (design §6), both sides.
//!
//! Lender: after stage `k` runs, the oldest rows of its layers (up to `tokens`, summed over
//! sequences in id order) leave the KV cache (their bytes are freed) in a `Kv` put frame to
//! the coordinator, which passes them to the borrower; then it asks back the next stage's
//! rows, so they are here before that stage runs (one stage's lent rows are held at a
//! time). Before a stage with rows out runs, they are put back exactly as they left, or the
//! step fails with a typed error ([`LendError`]) when what came back is not what was lent.
//!
//! Borrower: holds each lender's blobs (opaque bytes) within the bytes it reserved, which
//! count against its own KV budget; returns a stage's blob when asked.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use crate::executor::Device;
use crate::wire::lend::{decode_blob, encode_blob, encode_kv, KvHeader, KvOp, LendError, LentRows};
use crate::wire::{FrameKind, ToCoordinator};
use crate::RuntimeError;

use super::ComputeCtx;

/// How long a stage waits for its lent rows.
const FETCH_WAIT: Duration = Duration::from_secs(30);

/// The lender's side.
pub(super) struct Lender {
    tokens: u64,                 // rows to lend per stage  // tokens
    out: HashMap<u16, LentRows>, // stage → rows out
    asked: HashSet<u16>,         // stages whose rows were asked back
    back: HashMap<u16, Vec<u8>>, // blobs back, not yet put in
    rx: Receiver<(u16, Vec<u8>)>,
}

fn lend_err(e: LendError) -> RuntimeError {
    RuntimeError::Invalid(e.to_string())
}

impl Lender {
    pub(super) fn new(rx: Receiver<(u16, Vec<u8>)>) -> Lender {
        Lender {
            tokens: 0,
            out: HashMap::new(),
            asked: HashSet::new(),
            back: HashMap::new(),
            rx,
        }
    }

    /// Lend `tokens` rows per stage from the next stage that runs (0: stop; rows out come
    /// back as their stages run).
    pub(super) fn set(&mut self, tokens: u64) {
        tracing::info!("KV lending: {tokens} tokens per stage");
        self.tokens = tokens;
    }

    fn ask(&mut self, ctx: &ComputeCtx, stage: u16) -> bool {
        if self.out.contains_key(&stage) && self.asked.insert(stage) {
            return ctx.send(ToCoordinator::KvFetch { stage });
        }
        true
    }

    /// Before stage `k` runs: its rows out come back into the cache.
    pub(super) fn before_stage(
        &mut self,
        d: &mut Device,
        ctx: &ComputeCtx,
        k: usize,
    ) -> Result<(), RuntimeError> {
        let stage = k as u16;
        let Some(rows) = self.out.get(&stage).cloned() else {
            return Ok(());
        };
        if !self.ask(ctx, stage) {
            return Err(lend_err(LendError::Gone(stage)));
        }
        let deadline = Instant::now() + FETCH_WAIT;
        let blob = loop {
            if let Some(b) = self.back.remove(&stage) {
                break b;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(left) {
                Ok((s, b)) => {
                    self.back.insert(s, b);
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    return Err(lend_err(LendError::Timeout {
                        stage,
                        secs: FETCH_WAIT.as_secs(),
                    }))
                }
                Err(_) => return Err(lend_err(LendError::Gone(stage))),
            }
        };
        self.out.remove(&stage);
        self.asked.remove(&stage);
        let layers: Vec<usize> = d.spec().stages[k].layers.iter().map(|l| l.layer).collect();
        let kv_dim = d.tf.cfg.num_kv_heads * d.tf.cfg.head_dim;
        let floats = decode_blob(stage, &blob, &rows, layers.len(), kv_dim).map_err(lend_err)?;
        let mut o = 0;
        for &layer in &layers {
            for &(seq, n) in &rows {
                let w = n as usize * kv_dim;
                let (kr, vr) = (&floats[o..o + w], &floats[o + w..o + 2 * w]);
                o += 2 * w;
                // a sequence released (or restarted) meanwhile: its rows are dropped
                if d.kv.lent(seq, layer) == n as usize {
                    d.kv.return_rows(seq, layer, kr, vr)?;
                }
            }
        }
        Ok(())
    }

    /// After stage `k` of a device with `stages` stages ran: its oldest rows go out, and
    /// the next stage's rows are asked back.
    pub(super) fn after_stage(
        &mut self,
        d: &mut Device,
        ctx: &ComputeCtx,
        k: usize,
    ) -> Result<(), RuntimeError> {
        let stages = d.stages();
        if self.tokens == 0 || stages < 2 {
            return Ok(());
        }
        let stage = k as u16;
        let layers: Vec<usize> = d.spec().stages[k].layers.iter().map(|l| l.layer).collect();
        let Some(&first) = layers.first() else {
            return Ok(());
        };
        let mut left = self.tokens;
        let mut rows: LentRows = Vec::new();
        for seq in d.kv.seq_ids() {
            // keep the newest row of each sequence here (a sliding layer holds only its window)
            let held = layers.iter().map(|&l| d.kv.len(seq, l)).min().unwrap_or(0);
            let n = (held.saturating_sub(1) as u64).min(left);
            if n > 0 && d.kv.lent(seq, first) == 0 {
                rows.push((seq, n as u32));
                left -= n;
            }
        }
        if !rows.is_empty() {
            let mut data = Vec::new();
            for &layer in &layers {
                for &(seq, n) in &rows {
                    let (k, v) = d.kv.lend_rows(seq, layer, n as usize)?;
                    data.extend_from_slice(&k);
                    data.extend_from_slice(&v);
                }
            }
            let h = KvHeader {
                op: KvOp::Put,
                lender: 0, // the coordinator names the sender
                stage,
            };
            if !ctx.send_frame(FrameKind::Kv, encode_kv(h, &encode_blob(&rows, &data))) {
                return Err(lend_err(LendError::Gone(stage)));
            }
            self.out.insert(stage, rows);
        }
        let next = ((k + 1) % stages) as u16;
        if !self.ask(ctx, next) {
            return Err(lend_err(LendError::Gone(next)));
        }
        Ok(())
    }
}

/// The borrower's side: blobs held per (lender, stage) within each lender's reservation.
#[derive(Default)]
pub(super) struct Borrower {
    reserved: BTreeMap<u16, u64>,        // lender → bytes
    held: BTreeMap<(u16, u16), Vec<u8>>, // (lender, stage) → blob
}

impl Borrower {
    fn held_by(&self, lender: u16) -> u64 {
        self.held
            .range((lender, 0)..=(lender, u16::MAX))
            .map(|(_, b)| b.len() as u64)
            .sum()
    }

    /// Reserve `bytes` for `lender` (never under what it holds), within the KV budget.
    pub(super) fn borrow(
        &mut self,
        d: Option<&mut Device>,
        lender: u16,
        bytes: u64,
    ) -> ToCoordinator {
        let want = bytes.max(self.held_by(lender));
        let old = self.reserved.get(&lender).copied().unwrap_or(0);
        let others: u64 = self
            .reserved
            .iter()
            .filter(|(l, _)| **l != lender)
            .map(|(_, b)| *b)
            .sum();
        let ok = match d {
            Some(d) => d.kv.set_held_for_peers(others + want).is_ok(),
            None => false,
        };
        if ok {
            self.reserved.insert(lender, want);
        }
        tracing::info!("KV borrowing for device {lender}: {want} bytes, reserved: {ok}");
        ToCoordinator::Borrowed {
            lender,
            bytes: if ok { want } else { old },
            ok,
        }
    }

    /// Holds a put blob; refused (typed error) past the reservation.
    pub(super) fn put(
        &mut self,
        lender: u16,
        stage: u16,
        blob: Vec<u8>,
    ) -> Result<(), RuntimeError> {
        let old = self
            .held
            .get(&(lender, stage))
            .map_or(0, |b| b.len() as u64);
        let after = self.held_by(lender) - old + blob.len() as u64;
        let cap = self.reserved.get(&lender).copied().unwrap_or(0);
        if after > cap {
            return Err(RuntimeError::Invalid(format!(
                "lent KV of device {lender}: {after} bytes held, {cap} reserved"
            )));
        }
        self.held.insert((lender, stage), blob);
        Ok(())
    }

    /// The data frame returning `lender`'s blob of `stage` (empty when none is held: the
    /// lender sees a short blob).
    pub(super) fn fetch(&mut self, lender: u16, stage: u16) -> Vec<u8> {
        let blob = self.held.remove(&(lender, stage)).unwrap_or_default();
        let h = KvHeader {
            op: KvOp::Data,
            lender,
            stage,
        };
        encode_kv(h, &blob)
    }
}
