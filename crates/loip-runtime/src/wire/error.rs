//! The errors of one connection, below the frames, the step messages and the direct hops
//! that all return them.

use std::time::Duration;

use thiserror::Error;

/// Errors of one connection. A [`NetError`](super::NetError) adds which device it was.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum WireError {
    /// The peer closed the connection.
    #[error("the connection was closed")]
    Closed,
    /// An I/O error on the socket.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// Nothing arrived in time.
    #[error("timed out after {0:?} waiting for {1}")]
    Timeout(Duration, &'static str),
    /// A frame longer than the bound.
    #[error("frame of {len} bytes exceeds the limit of {max} bytes")]
    TooLarge {
        /// announced payload length, bytes
        len: u64,
        /// the limit, bytes
        max: usize,
    },
    /// A frame kind this version does not know (usually garbage on the socket).
    #[error("unknown frame kind {0} (not a LOIP peer, or a corrupt stream)")]
    BadKind(u8),
    /// The peer does not speak LOIP.
    #[error("the peer is not a LOIP peer (bad hello)")]
    NotLoip,
    /// The peer speaks another protocol version.
    #[error("protocol version mismatch: this side speaks LOIP v{ours}, the peer v{theirs}")]
    VersionMismatch {
        /// our version
        ours: u32,
        /// theirs
        theirs: u32,
    },
    /// Authentication failed.
    #[error("authentication refused: {0}")]
    AuthRefused(String),
    /// A frame whose content is malformed or unexpected here.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// A sealed frame failed authentication: modified, injected, replayed or reordered.
    #[error("a frame failed authentication (modified, injected, replayed or reordered); the session is closed")]
    Tampered,
    /// The peer sent an `Error` frame (and closes).
    #[error("the peer reported: {0}")]
    Remote(String),
}
