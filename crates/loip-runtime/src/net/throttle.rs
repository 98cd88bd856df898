//! An emulated link: a token bucket that delays each frame by its serialization time at a
//! given bandwidth (`--bandwidth` of `loip worker` / `loip local`).
//!
//! The bucket keeps a virtual clock `next_free`: a frame of `n` bytes starts when the link is
//! free and ends `n / rate` seconds later; the writer sleeps until then. Frames from several
//! tasks sharing one bucket queue behind each other like on a real link.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A shared bandwidth limit for one direction of one link.
#[derive(Debug, Clone)]
pub struct Throttle {
    rate: f64, // bytes/s
    next_free: Arc<Mutex<Instant>>,
}

impl Throttle {
    /// A limit of `bytes_per_s` (must be positive and finite; others are clamped to 1 B/s).
    pub fn new(bytes_per_s: f64) -> Throttle {
        let rate = if bytes_per_s.is_finite() && bytes_per_s > 0.0 {
            bytes_per_s
        } else {
            1.0
        };
        Throttle {
            rate,
            next_free: Arc::new(Mutex::new(Instant::now())),
        }
    }

    /// The limit, bytes/s.
    pub fn rate(&self) -> f64 {
        self.rate
    }

    /// Waits until `n` bytes would have crossed the link.
    pub async fn take(&self, n: usize) {
        let until = {
            let mut next = match self.next_free.lock() {
                Ok(g) => g,
                Err(p) => p.into_inner(),
            };
            let start = (*next).max(Instant::now());
            *next = start + Duration::from_secs_f64(n as f64 / self.rate);
            *next
        };
        tokio::time::sleep_until(until.into()).await;
    }
}
