//! The device runtime: resident blocks, the slot loader, the stage executor, and (later) the
//! worker, coordinator and wire protocol.
//!
//! `unsafe` here is limited to the page-aligned buffer and the io_uring submissions of the
//! direct loader; both document the protocol that makes them sound.
#![deny(missing_docs)]

pub mod aligned;
mod error;
pub mod executor;
pub mod local;
pub mod loader;
pub mod resident;
pub mod shape;

pub use error::RuntimeError;
pub use executor::{BlockPlacement, Device, DeviceSpec, MemoryReport, StageSpec, StepTimes};
pub use loader::{LoaderKind, Loader};
