//! The binary step and output codecs: what a worker runs and what it sends back.

use loip_engine::TokenPos;
use serde::{Deserialize, Serialize};

use super::error::WireError;

/// Header of a `Step` frame: what a worker runs on the rows that follow.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepHeader {
    /// coordinator-unique id, echoed in the output
    pub step: u64,
    /// input is token ids: embed them first (first device)
    pub embed: bool,
    /// finish with the final norm and LM head on `rows` (last device)
    pub head: bool,
    /// keep the last stage's offloaded blocks in the slot: another sequence passes it next
    pub keep: bool,
    /// local stage indices to run, in order
    pub stages: Vec<u16>,
    /// one entry per input row
    pub batch: Vec<TokenPos>,
    /// rows whose logits to return (with `head`)
    pub rows: Vec<u32>,
    /// with `head`: return each row's argmax (token id and logit) instead of its logits,
    /// after setting these token ids to −∞ (end-of-sequence ids held back by a minimum
    /// length). Greedy decoding needs nothing more, and the token's return trip shrinks from
    /// the vocabulary's 4 bytes per entry to 8 bytes.
    pub argmax: Option<Vec<u32>>,
    /// with `argmax`: empty, or one more list of masked ids per row of `rows` (each
    /// sequence of a micro-batch holds back its own EOS ids until its own minimum length);
    /// row `i` masks `argmax` and `row_masks[i]`. At most [`MAX_MASKED`] ids in all.
    pub row_masks: Vec<Vec<u32>>,
    /// sequences of the step whose KV this device drops from the step's first position of
    /// the sequence on, before each stage of the hop runs (speculative decoding: the
    /// positions a verify step wrote whose drafts were rejected). Each is a sequence of the
    /// step, listed once. A sequence not listed must start at its cached length.
    pub rewind: Vec<u64>,
}

/// Bounds on a step header (far above any real step).
const MAX_STAGES: usize = 4096;
const MAX_TOKENS: usize = 1 << 20;

const FLAG_EMBED: u8 = 1;
const FLAG_HEAD: u8 = 2;
const FLAG_KEEP: u8 = 4;
pub(super) const FLAG_ARGMAX: u8 = 8;
const FLAG_ROW_MASKS: u8 = 16;
const FLAG_REWIND: u8 = 32;
/// Bound on the masked ids of an argmax step, common and per-row lists together (far above
/// any real list of EOS ids).
pub const MAX_MASKED: usize = 1 << 16;

/// A bounds-checked little-endian reader over a payload.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len());
        let end = end.ok_or_else(|| {
            WireError::Protocol(format!("frame ends early at byte {}", self.buf.len()))
        })?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, WireError> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Result<u32, WireError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Result<u64, WireError> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    fn f64(&mut self) -> Result<f64, WireError> {
        Ok(f64::from_bits(self.u64()?))
    }
    fn count(&mut self, max: usize, what: &str) -> Result<usize, WireError> {
        let n = self.u32()? as usize;
        if n > max {
            return Err(WireError::Protocol(format!("{n} {what} (at most {max})")));
        }
        Ok(n)
    }
    fn rest(&self) -> &'a [u8] {
        &self.buf[self.pos..]
    }
}

/// The payload of a `Step` frame: header, then `data` (u32 ids or f32 rows, little endian).
pub fn encode_step(h: &StepHeader, data: &[u8]) -> Vec<u8> {
    let mut p = Vec::with_capacity(
        32 + 2 * h.stages.len() + 12 * h.batch.len() + 4 * h.rows.len() + data.len(),
    );
    p.extend_from_slice(&h.step.to_le_bytes());
    let flags = (h.embed as u8 * FLAG_EMBED)
        | (h.head as u8 * FLAG_HEAD)
        | (h.keep as u8 * FLAG_KEEP)
        | (h.argmax.is_some() as u8 * FLAG_ARGMAX)
        | ((h.argmax.is_some() && !h.row_masks.is_empty()) as u8 * FLAG_ROW_MASKS)
        | (!h.rewind.is_empty() as u8 * FLAG_REWIND);
    p.push(flags);
    p.extend_from_slice(&(h.stages.len() as u32).to_le_bytes());
    for &s in &h.stages {
        p.extend_from_slice(&s.to_le_bytes());
    }
    p.extend_from_slice(&(h.batch.len() as u32).to_le_bytes());
    for t in &h.batch {
        p.extend_from_slice(&t.seq.to_le_bytes());
        p.extend_from_slice(&(t.pos as u32).to_le_bytes());
    }
    p.extend_from_slice(&(h.rows.len() as u32).to_le_bytes());
    for &r in &h.rows {
        p.extend_from_slice(&r.to_le_bytes());
    }
    if let Some(masked) = &h.argmax {
        p.extend_from_slice(&(masked.len() as u32).to_le_bytes());
        for &id in masked {
            p.extend_from_slice(&id.to_le_bytes());
        }
        if !h.row_masks.is_empty() {
            // one list per head row, in row order
            for m in &h.row_masks {
                p.extend_from_slice(&(m.len() as u32).to_le_bytes());
                for &id in m {
                    p.extend_from_slice(&id.to_le_bytes());
                }
            }
        }
    }
    if !h.rewind.is_empty() {
        p.extend_from_slice(&(h.rewind.len() as u32).to_le_bytes());
        for &s in &h.rewind {
            p.extend_from_slice(&s.to_le_bytes());
        }
    }
    p.extend_from_slice(data);
    p
}

/// Parses a `Step` payload; returns the header and the input bytes. Structure only: the
/// worker checks the input length against its model.
pub fn decode_step(payload: &[u8]) -> Result<(StepHeader, &[u8]), WireError> {
    let mut c = Cursor {
        buf: payload,
        pos: 0,
    };
    let step = c.u64()?;
    let flags = c.u8()?;
    let known = FLAG_EMBED | FLAG_HEAD | FLAG_KEEP | FLAG_ARGMAX | FLAG_ROW_MASKS | FLAG_REWIND;
    if flags & !known != 0 {
        return Err(WireError::Protocol(format!(
            "unknown step flags {flags:#x}"
        )));
    }
    let n = c.count(MAX_STAGES, "stages")?;
    let stages = (0..n).map(|_| c.u16()).collect::<Result<Vec<_>, _>>()?;
    let n = c.count(MAX_TOKENS, "tokens")?;
    let mut batch = Vec::with_capacity(n.min(payload.len() / 12));
    for _ in 0..n {
        batch.push(TokenPos {
            seq: c.u64()?,
            pos: c.u32()? as usize,
        });
    }
    let n = c.count(batch.len(), "head rows")?;
    let rows = (0..n).map(|_| c.u32()).collect::<Result<Vec<_>, _>>()?;
    if rows.iter().any(|&r| r as usize >= batch.len()) {
        return Err(WireError::Protocol("a head row outside the step".into()));
    }
    let argmax = if flags & FLAG_ARGMAX != 0 {
        if flags & FLAG_HEAD == 0 {
            return Err(WireError::Protocol(
                "an argmax step without the head".into(),
            ));
        }
        let n = c.count(MAX_MASKED, "masked ids")?;
        Some((0..n).map(|_| c.u32()).collect::<Result<Vec<_>, _>>()?)
    } else {
        None
    };
    let mut row_masks = Vec::new();
    if flags & FLAG_ROW_MASKS != 0 {
        let Some(common) = &argmax else {
            return Err(WireError::Protocol(
                "per-row masks without an argmax".into(),
            ));
        };
        let mut left = MAX_MASKED - common.len();
        for _ in 0..rows.len() {
            let n = c.count(left, "masked ids (all rows)")?;
            left -= n;
            row_masks.push((0..n).map(|_| c.u32()).collect::<Result<Vec<_>, _>>()?);
        }
    }
    let mut rewind: Vec<u64> = Vec::new();
    if flags & FLAG_REWIND != 0 {
        // sets, not scans: a hostile header may list a million sequences
        let mut left: std::collections::BTreeSet<u64> = batch.iter().map(|t| t.seq).collect();
        let n = c.count(left.len(), "rewound sequences")?;
        for _ in 0..n {
            let s = c.u64()?;
            if !left.remove(&s) {
                return Err(WireError::Protocol(format!(
                    "sequence {s} rewound twice or not in the step"
                )));
            }
            rewind.push(s);
        }
    }
    let h = StepHeader {
        step,
        embed: flags & FLAG_EMBED != 0,
        head: flags & FLAG_HEAD != 0,
        keep: flags & FLAG_KEEP != 0,
        stages,
        batch,
        rows,
        argmax,
        row_masks,
        rewind,
    };
    Ok((h, c.rest()))
}

/// Where a worker's time for one step went.  // seconds
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct JobTimes {
    /// waiting in the worker's queue behind other steps  // seconds
    pub queued_s: f64,
    /// computing blocks  // seconds
    pub compute_s: f64,
    /// waiting for the loader (uncovered load)  // seconds
    pub stall_s: f64,
    /// from the frame's arrival to the output being handed to the socket  // seconds
    pub total_s: f64,
    /// bytes loaded from the SSD  // bytes
    pub loaded_bytes: u64,
}

/// What the rows of an `Output` frame hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputKind {
    /// hidden states, f32 (`cols` = hidden size)
    Hidden = 0,
    /// logits, f32 (`cols` = vocabulary size)
    Logits = 1,
    /// the argmax of each row's logits: u32 token id, then its f32 logit (`cols` = 2)
    Argmax = 2,
}

/// Header of an `Output` frame.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OutputHeader {
    /// the step it answers
    pub step: u64,
    /// what the rows hold
    pub kind: OutputKind,
    /// rows
    pub rows: u32,
    /// 4-byte values per row (hidden size, vocabulary, or 2 for an argmax)
    pub cols: u32,
    /// worker-side times
    pub times: JobTimes,
}

/// Bytes of an encoded [`OutputHeader`].
pub const OUTPUT_HEADER_BYTES: usize = 8 + 1 + 4 + 4 + 4 * 8 + 8;

/// Writes an `Output` header in front of `data` (f32 LE, rows × cols).
pub fn encode_output(h: &OutputHeader, data: &[u8]) -> Vec<u8> {
    let mut p = Vec::with_capacity(OUTPUT_HEADER_BYTES + data.len());
    p.extend_from_slice(&h.step.to_le_bytes());
    p.push(h.kind as u8);
    p.extend_from_slice(&h.rows.to_le_bytes());
    p.extend_from_slice(&h.cols.to_le_bytes());
    for v in [
        h.times.queued_s,
        h.times.compute_s,
        h.times.stall_s,
        h.times.total_s,
    ] {
        p.extend_from_slice(&v.to_bits().to_le_bytes());
    }
    p.extend_from_slice(&h.times.loaded_bytes.to_le_bytes());
    p.extend_from_slice(data);
    p
}

/// Parses an `Output` payload, checking that the data is exactly rows × cols floats.
pub fn decode_output(payload: &[u8]) -> Result<(OutputHeader, &[u8]), WireError> {
    let mut c = Cursor {
        buf: payload,
        pos: 0,
    };
    let step = c.u64()?;
    let kind = match c.u8()? {
        0 => OutputKind::Hidden,
        1 => OutputKind::Logits,
        2 => OutputKind::Argmax,
        k => return Err(WireError::Protocol(format!("bad output kind {k}"))),
    };
    let rows = c.u32()?;
    let cols = c.u32()?;
    let mut t = [0f64; 4];
    for v in &mut t {
        *v = c.f64()?;
    }
    let loaded_bytes = c.u64()?;
    let data = c.rest();
    if data.len() as u64 != rows as u64 * cols as u64 * 4 {
        return Err(WireError::Protocol(format!(
            "output of {rows}×{cols} floats carries {} bytes",
            data.len()
        )));
    }
    let times = JobTimes {
        queued_s: t[0],
        compute_s: t[1],
        stall_s: t[2],
        total_s: t[3],
        loaded_bytes,
    };
    Ok((
        OutputHeader {
            step,
            kind,
            rows,
            cols,
            times,
        },
        data,
    ))
}

/// The rows of an argmax output: `(token id, logit)` each, as u32 LE then f32 LE.
pub fn argmax_bytes(v: &[(u32, f32)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(v.len() * 8);
    for (id, logit) in v {
        out.extend_from_slice(&id.to_le_bytes());
        out.extend_from_slice(&logit.to_le_bytes());
    }
    out
}

/// Parses [`argmax_bytes`].
pub fn bytes_argmax(b: &[u8]) -> Result<Vec<(u32, f32)>, WireError> {
    if !b.len().is_multiple_of(8) {
        return Err(WireError::Protocol(format!(
            "{} bytes are not whole (id, logit) pairs",
            b.len()
        )));
    }
    Ok(b.chunks_exact(8)
        .map(|c| {
            (
                u32::from_le_bytes([c[0], c[1], c[2], c[3]]),
                f32::from_le_bytes([c[4], c[5], c[6], c[7]]),
            )
        })
        .collect())
}

/// Exact little-endian bytes of `v`.
pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(v.len() * 4);
    for x in v {
        out.extend_from_slice(&x.to_le_bytes());
    }
    out
}

/// The f32 values of exact little-endian bytes (`b.len()` must be a multiple of 4).
pub fn bytes_f32(b: &[u8]) -> Result<Vec<f32>, WireError> {
    if !b.len().is_multiple_of(4) {
        return Err(WireError::Protocol(format!(
            "{} bytes are not whole f32 values",
            b.len()
        )));
    }
    Ok(b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// Little-endian u32 token ids.
pub fn u32_bytes(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Token ids from little-endian bytes.
pub fn bytes_u32(b: &[u8]) -> Result<Vec<u32>, WireError> {
    if !b.len().is_multiple_of(4) {
        return Err(WireError::Protocol(format!(
            "{} bytes are not whole u32 ids",
            b.len()
        )));
    }
    Ok(b.chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// Lower-case hex.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
