//! The whole system on this machine: N worker processes on loopback with memory budgets (by
//! default budgets in which no worker can keep its even share of the layers resident, so the
//! plan streams blocks), the coordinator's session over them, and what `loip local` runs on
//! it: one generation or a burst of them, micro-batch sizes side by side, and the benchmark
//! matrix (patterns × link limits × planners). Every job starts its cluster the one way
//! ([`LocalCluster::start_as`]).

mod batches;
mod bench;
mod run;

pub use batches::{compare_micro_batches, micro_batch_choice, MicroBatchRow};
pub use bench::{bench, bench_store_root, BenchEvent, BenchMatrix, BenchRow};
pub use run::{generated, run, Event, Generated, Job, Outcome};

use anyhow::{Context, Result};
pub use loip_runtime::local_cluster::{
    bench_budgets, scratch_size, Burst, CgroupReport, LocalCluster, LocalOptions, Start, Started,
    Until,
};

/// A link limit: `unlimited`/`none` or a bandwidth (`100mbit`), bytes/s.
pub fn parse_bandwidth(s: &str) -> Result<Option<f64>> {
    if s == "unlimited" || s == "none" {
        return Ok(None);
    }
    Ok(Some(
        loip_plan::parse_bandwidth(s).with_context(|| format!("bandwidth {s}"))?,
    ))
}
