//! A hand-driven coordinator: the real handshake, then frames the test writes itself (for
//! sending what a real coordinator never would).

use std::time::Duration;

use loip_runtime::net::handshake;
use loip_runtime::net::session::{SealedReader, SealedWriter};
use loip_runtime::wire::{
    self, Frame, FrameKind, Role, ToCoordinator, ToWorker, WireError, WorkerInfo,
};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;

/// An authenticated, sealed session driven by the test.
pub struct Raw {
    pub rd: SealedReader<OwnedReadHalf>,
    pub wr: SealedWriter<OwnedWriteHalf>,
    pub info: WorkerInfo,
    /// the worker's static key as its handshake proved it, hex (a `PeerRef`'s `key`)
    pub key: String,
}

/// Sends a coordinator's hello of this protocol version (and nothing more).
pub async fn hello(s: &mut TcpStream) -> Result<(), WireError> {
    let h = wire::hello_payload(Role::Coordinator, wire::PROTOCOL_VERSION);
    wire::write_frame(s, FrameKind::Hello, &h, None).await
}

/// Connects and authenticates; retries while the worker is busy with an earlier session.
pub async fn authed(addr: &str, token: Option<&str>) -> Raw {
    for _ in 0..200 {
        let s = TcpStream::connect(addr).await.unwrap();
        let (mut rd, mut wr) = s.into_split();
        let me = loip_runtime::coordinator::coordinator_identity();
        let hs = handshake::connect(&mut rd, &mut wr, token.unwrap_or(""), me)
            .await
            .unwrap();
        let key = wire::hex(&hs.remote);
        let (mut rd, wr) = hs.keys.seal(Role::Coordinator, rd, wr, None);
        let f = rd.read(wire::MAX_FRAME).await.unwrap();
        match wire::parse_control::<ToCoordinator>(&f) {
            Ok(ToCoordinator::Welcome { info }) => return Raw { rd, wr, info, key },
            Err(WireError::Remote(m)) if m.starts_with("busy") => {
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
            other => panic!("no welcome: {other:?}"),
        }
    }
    panic!("the worker stayed busy")
}

impl Raw {
    /// Sends a control message.
    pub async fn control(&mut self, msg: &ToWorker) {
        self.send(FrameKind::Control, &wire::control_payload(msg).unwrap())
            .await;
    }

    /// Sends a sealed frame.
    pub async fn send(&mut self, kind: FrameKind, payload: &[u8]) {
        self.wr.write(kind, payload).await.unwrap();
    }

    /// The next frame within 10 s.
    pub async fn recv(&mut self) -> Result<Frame, WireError> {
        self.rd
            .read_timeout(wire::MAX_FRAME, Duration::from_secs(10), "a reply")
            .await
    }

    /// The next control message within 10 s.
    pub async fn recv_control(&mut self) -> ToCoordinator {
        let f = self.recv().await.unwrap();
        wire::parse_control::<ToCoordinator>(&f).unwrap()
    }

    /// Reads until the worker closes; the text of its `Error` frame, if any.
    pub async fn error_then_close(&mut self) -> Option<String> {
        let mut msg = None;
        loop {
            match self.recv().await {
                Ok(f) if f.kind == FrameKind::Error => {
                    msg = Some(String::from_utf8_lossy(&f.payload).into_owned())
                }
                Ok(_) => {}
                Err(WireError::Timeout(..)) => panic!("the worker kept the connection open"),
                Err(_) => return msg,
            }
        }
    }
}
