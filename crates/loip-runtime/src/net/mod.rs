//! Networking helpers of the worker and the coordinator: the authenticated, encrypted
//! session and its handshake, the checks of everything a peer sends, byte-bounded queues, an
//! emulated link limit, the worker's slice store, and the quick device probe behind the
//! planner's profiles.

pub mod handshake;
pub mod probe;
pub mod queue;
pub mod session;
pub mod token;
pub mod validate;
pub mod store;
pub mod throttle;
