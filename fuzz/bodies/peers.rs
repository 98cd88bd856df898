//! Body of the `peers` target: what a token holder sends a worker about its peers (a `peers`
//! control message and its device lists with their keys) and what peers send each other
//! (their control messages, `Routed`, `Hand` and `Notice` payloads). Each decoder must give
//! an error, never a panic.

use loip_runtime::net::direct::{self, FromPeer, ToPeer};
use loip_runtime::wire::{self, Frame, FrameKind, ToCoordinator, ToWorker};

/// Runs one input.
pub fn run(data: &[u8]) {
    let f = Frame {
        kind: FrameKind::Control,
        payload: data.to_vec(),
    };
    if let Ok(ToWorker::Peers(m)) = wire::parse_control::<ToWorker>(&f) {
        let proved = [data.len() as u8; 32];
        for p in m.expect.iter().chain(&m.connect) {
            let _ = p.proves(&proved);
        }
        let _ = direct::same_secret(&m.key, "ab");
    }
    if let Ok(ToCoordinator::PeersReady { links }) = wire::parse_control::<ToCoordinator>(&f) {
        let _ = links.iter().filter(|l| l.reachable).count();
    }
    let _ = wire::parse_control::<ToPeer>(&f);
    let _ = wire::parse_control::<FromPeer>(&f);
    if let Ok((_, step)) = direct::decode_routed(data) {
        let _ = wire::decode_step(step);
    }
    let _ = direct::decode_hand(data);
    let _ = direct::decode_notice(data);
}
