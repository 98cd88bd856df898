//! Discrete-event simulator of LOIP and its baselines on modelled edge devices (design §8).
//!
//! Pure and deterministic: no I/O except [`plot`] writing the figure files the caller names
//! ([`report`] returns strings), and randomness only from seeded ChaCha generators (the
//! dynamic bandwidth traces, [`testkit`]'s random clusters). The same inputs give the same
//! report, whatever the number of threads running the experiments.
//!
//! Data flow: a [`loip_plan::Plan`] (or a tensor-parallel [`tp::TpPlacement`]) + a
//! [`loip_plan::Cluster`] + a [`SimConfig`] → [`pipeline::simulate_pipeline`] /
//! [`tp::simulate_tp`] → [`SimReport`]. [`methods`] turns a method name into a plan and a
//! policy; [`experiments`] runs the paper-scale experiments of design §10 and [`report`] /
//! [`plot`] write their tables and figures.
//!
//! Modules: [`engine`] (event queue, resources, task graph), [`compute`] (block times),
//! [`bandwidth`] (constant and dynamic links), [`adapt`] (memory over time, online adaptation),
//! [`pipeline`], [`tp`], [`methods`], [`setups`] (setups and the experiment type),
//! [`experiments`], [`report`], [`plot`], [`plot_lines`], [`plot_style`],
//! [`shapes`]
//! (built-in model shapes), [`replay`] (a run of the runtime replayed), [`serving`] (the runtime's step scheduler on the virtual clock),
//! [`speculate`] (a plan served with speculative decoding at given acceptance rates),
//! [`testkit`] (seeded random clusters for checks), [`sim`]
//! (configuration and report types), [`error`]. The three plot modules (plotters and the
//! embedded font) are the default feature `plot`.
//!
//! Results of the paper-scale experiments and how they compare with the paper's claims:
//! docs/simulator.md (sections "Results" and "The paper's claims, checked").
#![deny(missing_docs)]

pub mod adapt;
pub mod bandwidth;
pub mod compute;
pub mod engine;
pub mod error;
pub mod experiments;
pub mod experiments_long;
pub mod methods;
pub mod pipeline;
#[cfg(feature = "plot")]
pub mod plot;
#[cfg(feature = "plot")]
pub mod plot_lines;
#[cfg(feature = "plot")]
pub mod plot_style;
pub mod replay;
pub mod report;
pub mod serving;
pub mod setups;
pub mod shapes;
pub mod sim;
pub mod speculate;
pub mod testkit;
pub mod tp;

pub use bandwidth::{Bandwidth, BandwidthTrace};
pub use error::SimError;
pub use methods::{run_method, Method, MethodRun, PlannedFor};
pub use pipeline::simulate_pipeline;
pub use shapes::{shape, shape_names};
pub use sim::{AdaptConfig, AdaptEvent, KvPolicy, MemorySample, SimConfig, SimReport, Status};
