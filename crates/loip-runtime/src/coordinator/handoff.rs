//! The coordinator's own part of a step on its machine, measured before the run: a step's
//! reply goes from the pipeline's task to the caller's thread waiting on a oneshot, and the
//! caller's next step comes back through the command channel, waking the task. Between the
//! last hop's arrival and the next step's dispatch a greedy step does little else (the
//! argmax is the last device's), so this round trip is the cost model's per-step coordinator
//! term ([`loip_plan::Cluster::coordinator`]); the run measures the same span per step
//! (`StepStats::coordinator_s`).

use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};

/// Round trips timed (the median is kept).
const ROUNDS: usize = 21;

/// Median round trip of a reply to a thread blocked on a oneshot and its answer through an
/// unbounded channel back to this task, the thread asleep before each.  // seconds
pub async fn handoff_s() -> f64 {
    let (to_task, mut from_thread) = mpsc::unbounded_channel::<()>();
    let (to_thread, waits) = std::sync::mpsc::channel::<oneshot::Receiver<()>>();
    let spawned = std::thread::Builder::new()
        .name("loip-handoff".into())
        .spawn(move || {
            for rx in waits {
                if rx.blocking_recv().is_err() || to_task.send(()).is_err() {
                    return;
                }
            }
        });
    if spawned.is_err() {
        return 0.0;
    }
    let mut times = Vec::with_capacity(ROUNDS);
    for _ in 0..ROUNDS {
        let (tx, rx) = oneshot::channel();
        if to_thread.send(rx).is_err() {
            break;
        }
        // the thread goes to sleep on the oneshot, as a caller waits for its step
        tokio::time::sleep(Duration::from_millis(1)).await;
        let t = Instant::now();
        if tx.send(()).is_err() {
            break;
        }
        match tokio::time::timeout(Duration::from_secs(1), from_thread.recv()).await {
            Ok(Some(())) => times.push(t.elapsed().as_secs_f64()),
            _ => break,
        }
    }
    drop(to_thread); // the thread ends
    crate::net::probe::median(times)
}

#[cfg(test)]
mod tests {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn handoff_is_positive_and_bounded() {
        let s = super::handoff_s().await;
        assert!(s > 0.0 && s < 1.0, "{s}");
    }
}
