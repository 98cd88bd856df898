//! Networking helpers of the worker and the coordinator: the Noise handshake and the sealed
//! session after it, device keys and the coordinator's pins of them, the checks of everything
//! a peer sends, byte-bounded queues, an emulated link limit, the worker's slice store, the
//! networks a worker accepts connections from, and the quick device probe behind the
//! planner's profiles; LAN discovery ([`discovery`]) and pairing ([`pairing`]); direct forwarding between workers ([`direct`], [`peer`]).

pub mod allow;
pub mod direct;
pub mod discovery;
pub mod handshake;
pub mod identity;
pub mod known;
pub mod pairing;
pub mod peer;
pub mod probe;
pub mod queue;
pub mod session;
pub mod store;
pub mod throttle;
pub mod token;
pub mod validate;
