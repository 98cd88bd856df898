//! Body of the `lent_kv` target: `Kv` frames as a borrower or a lender reads them (header,
//! then a blob checked against the rows lent) and the control messages of lending. The blob is
//! checked both against rows taken from its own header (so the row check passes and the
//! length check runs) and against rows it does not list. Each decoder must give an error,
//! never a panic.

use loip_runtime::wire::lend::{self, LentRows};
use loip_runtime::wire::{self, Frame, FrameKind, ToWorker};

/// The rows a blob says it holds (at most 64 listed, as far as its bytes go).
fn listed(blob: &[u8]) -> LentRows {
    let Some(n) = blob.get(..4) else {
        return Vec::new();
    };
    let n = u32::from_le_bytes([n[0], n[1], n[2], n[3]]).min(64) as usize;
    blob[4..]
        .chunks_exact(12)
        .take(n)
        .map(|c| {
            let mut s = [0u8; 8];
            s.copy_from_slice(&c[..8]);
            (
                u64::from_le_bytes(s),
                u32::from_le_bytes([c[8], c[9], c[10], c[11]]) % 4096,
            )
        })
        .collect()
}

/// Runs one input.
pub fn run(data: &[u8]) {
    if let Ok((h, blob)) = lend::decode_kv(data) {
        let rows = listed(blob);
        let (layers, kv_dim) = (1 + h.stage as usize % 4, 1 + h.lender as usize % 64);
        let _ = lend::decode_blob(h.stage, blob, &rows, layers, kv_dim);
        let _ = lend::decode_blob(h.stage, blob, &vec![(1, 1)], layers, kv_dim);
    }
    let f = Frame {
        kind: FrameKind::Control,
        payload: data.to_vec(),
    };
    match wire::parse_control::<ToWorker>(&f) {
        Ok(ToWorker::Borrow { bytes, .. }) => {
            let _ = bytes.checked_add(lend::KV_HEADER_BYTES as u64);
        }
        Ok(ToWorker::KvFetch { stage, .. }) => {
            let _ = lend::encode_kv(
                lend::KvHeader {
                    op: lend::KvOp::Fetch,
                    lender: 0,
                    stage,
                },
                &[],
            );
        }
        _ => {}
    }
}
