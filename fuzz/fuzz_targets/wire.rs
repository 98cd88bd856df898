//! What a peer sends a worker or the coordinator once its session is up: control messages
//! (JSON), step and output frames, lent KV frames and blobs. Each decoder must give an error,
//! never a panic; a control message that opens a device is validated as the worker does.
#![no_main]
use libfuzzer_sys::fuzz_target;
use loip_runtime::wire::{self, lend, Frame, FrameKind, ToCoordinator, ToWorker};

fuzz_target!(|data: &[u8]| {
    let _ = wire::decode_step(data);
    let _ = wire::decode_output(data);
    let _ = wire::bytes_f32(data);
    let _ = wire::bytes_u32(data);
    let _ = wire::bytes_argmax(data);
    let _ = lend::decode_kv(data);
    if data.len() >= 6 {
        // a blob for a lend of a few rows of a small layer, as the lender checks it
        let rows: lend::LentRows = vec![(data[0] as u64, data[1] as u32 % 8)];
        let _ = lend::decode_blob(1, &data[2..], &rows, 1 + data[2] as usize % 3, 4);
    }
    for kind in [FrameKind::Control, FrameKind::Hello, FrameKind::Error] {
        let f = Frame {
            kind,
            payload: data.to_vec(),
        };
        let _ = wire::check_hello(&f);
        let _ = wire::hello_role(&f);
        let _ = wire::parse_control::<ToCoordinator>(&f);
        if let Ok(ToWorker::Load { manifest, .. }) = wire::parse_control::<ToWorker>(&f) {
            let _ = loip_runtime::net::validate::check_manifest(&manifest);
        }
    }
});
