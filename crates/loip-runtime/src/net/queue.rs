//! Byte budgets for a worker's queues: every frame read from a peer and every output waiting
//! to be written holds a permit for its bytes until it is done with, so what a peer can make
//! a worker hold is bounded in bytes, not in frames. When a budget is spent the reader stops
//! reading (TCP then slows the peer down) and the compute thread stops producing: a peer
//! that outruns the worker is slowed, never served by growing memory.

use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Granularity of a budget, bytes (semaphore permits count these).
const UNIT: u64 = 1024;

/// A budget of bytes shared by the producers of one queue.
#[derive(Clone, Debug)]
pub struct ByteBudget {
    sem: Arc<Semaphore>,
    units: u32, // total permits, in UNIT bytes
}

/// Bytes held from a [`ByteBudget`]; returned when dropped.
pub type BytePermit = OwnedSemaphorePermit;

impl ByteBudget {
    /// A budget of `bytes` (at least one unit).
    pub fn new(bytes: u64) -> ByteBudget {
        let units = (bytes / UNIT).clamp(1, u32::MAX as u64 / 2) as u32;
        ByteBudget {
            sem: Arc::new(Semaphore::new(units as usize)),
            units,
        }
    }

    /// The whole budget, bytes.
    pub fn bytes(&self) -> u64 {
        self.units as u64 * UNIT
    }

    /// Units for `bytes`: rounded up, and at most the whole budget (an item larger than the
    /// budget waits until the queue is empty, then holds all of it).
    fn units_for(&self, bytes: usize) -> u32 {
        (bytes as u64).div_ceil(UNIT).clamp(1, self.units as u64) as u32
    }

    /// Waits for `bytes` of the budget.
    pub async fn acquire(&self, bytes: usize) -> BytePermit {
        let n = self.units_for(bytes);
        match self.sem.clone().acquire_many_owned(n).await {
            Ok(p) => p,
            Err(_) => unreachable!("budgets are never closed"),
        }
    }

    /// [`ByteBudget::acquire`] from a thread outside the runtime.
    pub fn blocking_acquire(&self, bytes: usize, rt: &tokio::runtime::Handle) -> BytePermit {
        rt.block_on(self.acquire(bytes))
    }

    /// Bytes free now.
    pub fn available(&self) -> u64 {
        self.sem.available_permits() as u64 * UNIT
    }
}

/// The budget of each of a worker's two queues (frames read, outputs to write) for a memory
/// budget of `mem` bytes: a sixteenth of it, between 4 MiB and 64 MiB (part of the process's
/// share of the budget, `memory::Overhead::queues`).
pub fn queue_bytes(mem: u64) -> u64 {
    (mem / 16).clamp(4 << 20, 64 << 20)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_budget_blocks_until_bytes_come_back() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let b = ByteBudget::new(64 << 10);
            let p1 = b.acquire(40 << 10).await;
            assert_eq!(b.available(), 24 << 10);
            let wait =
                tokio::time::timeout(std::time::Duration::from_millis(50), b.acquire(40 << 10));
            assert!(wait.await.is_err(), "over budget must wait");
            drop(p1);
            let big = b.acquire(1 << 30).await; // larger than the budget: takes all of it
            assert_eq!(b.available(), 0);
            drop(big);
            assert_eq!(b.available(), 64 << 10);
        });
    }
}
