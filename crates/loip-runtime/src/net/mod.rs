//! Networking helpers of the worker and the coordinator: the authenticated, encrypted
//! session and its handshake, the checks of everything a peer sends, byte-bounded queues, an
//! emulated link limit, the worker's slice store, and the quick device probe behind the
//! planner's profiles; direct forwarding between workers ([`direct`], [`peer`]).

pub mod direct;
pub mod handshake;
pub mod peer;
pub mod probe;
pub mod queue;
pub mod session;
pub mod token;
pub mod validate;
pub mod store;
pub mod throttle;
