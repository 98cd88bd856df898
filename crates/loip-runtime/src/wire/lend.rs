//! KV lending on the wire (design §6): `Kv` frames carry a stage's lent KV rows to the
//! borrower (`Put`) and back (`Data`), byte for byte: on the lender's peer session to the
//! borrower where it is up (the lender asks its rows back with a `Fetch` frame there, and the
//! borrower answers on the same session in the reverse direction), else lender →
//! coordinator → borrower and back (the coordinator asks with a `KvFetch` control message).
//!
//! Frame payload: `op u8 | lender u16 | stage u16 | blob`. On a peer session the `lender`
//! field is not trusted: the borrower knows the sender from the session. The blob is opaque to the
//! borrower (it only holds it, within the bytes it reserved); the lender wrote it and
//! checks it on the way back against what it lent: `nseq u32 | (seq u64, rows u32)·nseq |`
//! then, per layer of the stage and per listed sequence, `rows` K rows then `rows` V rows
//! (`kv_dim` little-endian f32 each). A short, long or different blob is a typed error.

use thiserror::Error;

/// What a `Kv` frame does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum KvOp {
    /// lent rows on their way to the borrower
    Put = 1,
    /// lent rows coming back to the lender
    Data = 2,
    /// the lender asks a stage's rows back (peer sessions; no blob)
    Fetch = 3,
}

/// A `Kv` frame's header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvHeader {
    /// put or data
    pub op: KvOp,
    /// the lending device (plan index; the coordinator sets it from the sender)
    pub lender: u16,
    /// the lender's local stage
    pub stage: u16,
}

/// Bytes of a `Kv` frame header.
pub const KV_HEADER_BYTES: usize = 5;

/// Lent KV that does not match what was lent.
#[derive(Debug, Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum LendError {
    /// a frame or blob shorter than its header says
    #[error("lent KV of stage {stage}: {got} bytes, expected {expected}")]
    Short {
        /// stage
        stage: u16,
        /// bytes expected
        expected: usize,
        /// bytes received
        got: usize,
    },
    /// rows of other sequences or counts than were lent
    #[error("lent KV of stage {stage} came back with other rows than were lent")]
    WrongRows {
        /// stage
        stage: u16,
    },
    /// a frame kind byte that is not put or data
    #[error("a KV frame with op {0}")]
    BadOp(u8),
    /// nothing came back in time
    #[error("lent KV of stage {stage} did not come back within {secs} s")]
    Timeout {
        /// stage
        stage: u16,
        /// the wait
        secs: u64,
    },
    /// the borrower or the coordinator is gone
    #[error("the lent KV of stage {0} cannot come back: the session is gone")]
    Gone(u16),
    /// the borrower that holds the rows is gone
    #[error(
        "the lent KV of stage {stage} is lost: device {device} that held it is gone ({reason})"
    )]
    PeerGone {
        /// stage
        stage: u16,
        /// the borrower
        device: String,
        /// what happened
        reason: String,
    },
    /// a put past what the borrower reserved for the lender
    #[error("lent KV of device {lender}: {bytes} bytes held, {reserved} reserved")]
    OverReserved {
        /// the lender
        lender: u16,
        /// bytes it would hold  // bytes
        bytes: u64,
        /// bytes reserved for it  // bytes
        reserved: u64,
    },
    /// lent KV on the session of a peer that lends nothing here
    #[error("device {0} sent lent KV, but lends nothing to this worker")]
    NotLending(u16),
}

/// Encodes a `Kv` frame.
pub fn encode_kv(h: KvHeader, blob: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(KV_HEADER_BYTES + blob.len());
    v.push(h.op as u8);
    v.extend_from_slice(&h.lender.to_le_bytes());
    v.extend_from_slice(&h.stage.to_le_bytes());
    v.extend_from_slice(blob);
    v
}

/// Decodes a `Kv` frame.
pub fn decode_kv(p: &[u8]) -> Result<(KvHeader, &[u8]), LendError> {
    if p.len() < KV_HEADER_BYTES {
        return Err(LendError::Short {
            stage: 0,
            expected: KV_HEADER_BYTES,
            got: p.len(),
        });
    }
    let op = match p[0] {
        1 => KvOp::Put,
        2 => KvOp::Data,
        3 => KvOp::Fetch,
        o => return Err(LendError::BadOp(o)),
    };
    let lender = u16::from_le_bytes([p[1], p[2]]);
    let stage = u16::from_le_bytes([p[3], p[4]]);
    Ok((KvHeader { op, lender, stage }, &p[KV_HEADER_BYTES..]))
}

/// Rows lent of one stage: (sequence, rows) in order.
pub type LentRows = Vec<(u64, u32)>;

/// Encodes a blob: `rows`, then `data` (already laid out per layer, per sequence, K then V).
pub fn encode_blob(rows: &LentRows, data: &[f32]) -> Vec<u8> {
    let mut v = Vec::with_capacity(4 + rows.len() * 12 + data.len() * 4);
    v.extend_from_slice(&(rows.len() as u32).to_le_bytes());
    for &(s, n) in rows {
        v.extend_from_slice(&s.to_le_bytes());
        v.extend_from_slice(&n.to_le_bytes());
    }
    for x in data {
        v.extend_from_slice(&x.to_le_bytes());
    }
    v
}

/// Decodes a blob of stage `stage` that must list exactly `want` and hold `layers` layers of
/// `kv_dim` floats per row for each of K and V: its floats.
pub fn decode_blob(
    stage: u16,
    blob: &[u8],
    want: &LentRows,
    layers: usize,
    kv_dim: usize,
) -> Result<Vec<f32>, LendError> {
    let head = 4 + want.len() * 12;
    let rows: u64 = want.iter().map(|r| r.1 as u64).sum();
    let floats = rows as usize * 2 * kv_dim * layers;
    let expected = head + floats * 4;
    if blob.len() != expected {
        return Err(LendError::Short {
            stage,
            expected,
            got: blob.len(),
        });
    }
    let n = u32::from_le_bytes([blob[0], blob[1], blob[2], blob[3]]) as usize;
    if n != want.len() {
        return Err(LendError::WrongRows { stage });
    }
    for (i, &(s, r)) in want.iter().enumerate() {
        let o = 4 + i * 12;
        let mut sb = [0u8; 8];
        sb.copy_from_slice(&blob[o..o + 8]);
        let rb = [blob[o + 8], blob[o + 9], blob[o + 10], blob[o + 11]];
        if u64::from_le_bytes(sb) != s || u32::from_le_bytes(rb) != r {
            return Err(LendError::WrongRows { stage });
        }
    }
    Ok(blob[head..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blobs_round_trip_and_bad_ones_are_typed_errors() {
        let rows: LentRows = vec![(3, 2), (9, 1)];
        let data: Vec<f32> = (0..(3 * 2 * 2 * 2))
            .map(|i| i as f32 * 0.25 - 1.0)
            .collect();
        let blob = encode_blob(&rows, &data);
        assert_eq!(decode_blob(4, &blob, &rows, 2, 2).unwrap(), data);
        let short = &blob[..blob.len() - 4];
        assert!(matches!(
            decode_blob(4, short, &rows, 2, 2),
            Err(LendError::Short { stage: 4, .. })
        ));
        let other: LentRows = vec![(3, 1), (9, 2)];
        assert_eq!(
            decode_blob(4, &blob, &other, 2, 2),
            Err(LendError::WrongRows { stage: 4 })
        );
        let h = KvHeader {
            op: KvOp::Data,
            lender: 1,
            stage: 4,
        };
        let f = encode_kv(h, &blob);
        let (h2, b2) = decode_kv(&f).unwrap();
        assert_eq!((h2, b2), (h, &blob[..]));
        assert_eq!(decode_kv(&[9, 0, 0, 0, 0]), Err(LendError::BadOp(9)));
        assert!(decode_kv(&[1, 0]).is_err());
    }
}
