//! The device runtime: resident blocks, the slot loader, the stage executor, and the
//! distributed pipeline: wire protocol ([`wire`]), worker ([`worker`]), coordinator
//! ([`coordinator`]) and cluster sessions ([`cluster_run`]).
//!
//! `unsafe` here is limited to the page-aligned buffer and the io_uring submissions of the
//! direct loader, and the `pre_exec` that starts a child in a memory cgroup; each documents
//! the protocol that makes it sound.
#![deny(missing_docs)]

pub mod adapt;
pub mod aligned;
pub mod cluster_run;
pub mod coordinator;
mod error;
pub mod executor;
pub mod hop_trace;
pub mod loader;
pub mod local;
pub mod local_cluster;
pub mod memory;
pub mod net;
pub mod profile;
pub mod resident;
pub mod shape;
mod slice_file;
pub mod wire;
pub mod worker;

pub use error::RuntimeError;
pub use executor::{BlockPlacement, Device, DeviceSpec, MemoryReport, StageSpec, StepTimes};
pub use loader::{Loader, LoaderKind};
