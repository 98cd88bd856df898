//! Body of the `noise` target: the bytes a stranger sends either side of the Noise handshake
//! (`loip_runtime::net::handshake`) after a valid hello. The first byte picks the side (even:
//! a worker accepting; odd: a coordinator or peer connecting) and the connecting role; the
//! rest is the stream that side reads (frame headers and Noise messages). Every input must end
//! in an error or a finished handshake, never a panic, and nothing larger than the
//! pre-authentication frame limit is allocated from a length the input gives.

use loip_runtime::net::handshake;
use loip_runtime::net::identity::Identity;
use loip_runtime::wire::{FrameKind, Role, PROTOCOL_VERSION};

thread_local! {
    static RT: tokio::runtime::Runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a runtime");
}

/// A plaintext frame: header and payload.
pub fn frame(kind: FrameKind, payload: &[u8]) -> Vec<u8> {
    let mut v = (payload.len() as u32).to_le_bytes().to_vec();
    v.push(kind as u8);
    v.extend_from_slice(payload);
    v
}

/// The stream a side reads: the other side's hello, then `rest`.
pub fn stream(hello_role: Role, rest: &[u8]) -> Vec<u8> {
    let hello = loip_runtime::wire::hello_payload(hello_role, PROTOCOL_VERSION);
    let mut v = frame(FrameKind::Hello, &hello);
    v.extend_from_slice(rest);
    v
}

/// Runs one input.
pub fn run(data: &[u8]) {
    let Some((&pick, rest)) = data.split_first() else {
        return;
    };
    let me = Identity::from_private([7; 32]);
    let token = "a-fuzzing-token-of-some-length";
    let role = if pick & 2 == 0 {
        Role::Coordinator
    } else {
        Role::Peer
    };
    RT.with(|rt| {
        rt.block_on(async {
            let mut out = tokio::io::sink();
            if pick & 1 == 0 {
                let input = stream(role, rest);
                let mut rd = &input[..];
                let _ = handshake::accept_role(&mut rd, &mut out, token, &me).await;
            } else {
                let input = stream(Role::Worker, rest);
                let mut rd = &input[..];
                let _ = handshake::connect_as(&mut rd, &mut out, token, &me, role).await;
            }
        })
    });
}
