//! Networking helpers of the worker and the coordinator: an emulated link limit, the
//! worker's slice store, and the quick device probe behind the planner's profiles.

pub mod probe;
pub mod store;
pub mod throttle;
