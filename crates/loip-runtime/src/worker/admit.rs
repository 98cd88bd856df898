//! Admission into the handshake: a connection's place among those in their handshake (one
//! of the worker's `max_unauthenticated` and one of its host's quarter of them), or a
//! fast-lane slot when those are taken, so strangers holding every slot cannot keep the
//! coordinator out. A host outside `--peer-allow` is refused before all that.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::OwnedSemaphorePermit;

use super::{lock, Shared, WorkerOptions};

/// A connection's place among those in their handshake: one of the worker's
/// `max_unauthenticated` and one of its host's quarter of them, both given back when dropped.
pub(super) struct PreAuth {
    _permit: OwnedSemaphorePermit,
    /// the host whose share it holds (None: a fast-lane slot)
    host: Option<std::net::IpAddr>,
    by_host: Arc<Mutex<std::collections::HashMap<std::net::IpAddr, usize>>>,
}

impl PreAuth {
    /// The deadline of this connection's whole handshake: a fast-lane slot must prove the
    /// token within [`FAST_HANDSHAKE`].
    pub(super) fn deadline(&self, opts: &WorkerOptions) -> Duration {
        match self.host {
            Some(_) => opts.handshake_timeout,
            None => opts.handshake_timeout.min(FAST_HANDSHAKE),
        }
    }
}

/// Slots for connections that arrive while the regular handshake slots are full (or their
/// host's share is): strangers holding every regular slot cannot keep the coordinator out,
/// since a connection that proves the token does so in milliseconds.
pub(super) const FAST_LANE: usize = 4;
/// The whole handshake's deadline in a fast-lane slot.
const FAST_HANDSHAKE: Duration = Duration::from_secs(1);

impl Drop for PreAuth {
    fn drop(&mut self) {
        let Some(host) = self.host else { return };
        let mut m = lock(&self.by_host);
        if let Some(n) = m.get_mut(&host) {
            *n -= 1;
            if *n == 0 {
                m.remove(&host);
            }
        }
    }
}

impl Shared {
    /// Admits a new connection from `host` into the handshake; refused (why) when `host` is
    /// outside `--peer-allow`, or when the worker or that host already has its share in flight
    /// and the fast lane is full (so one host cannot crowd out the coordinator).
    pub(super) fn admit(&self, host: std::net::IpAddr) -> Result<PreAuth, &'static str> {
        if !crate::net::allow::allowed(&self.opts.peer_allow, host) {
            return Err("outside --peer-allow");
        }
        let fast = || {
            Some(PreAuth {
                _permit: self.fast_lane.clone().try_acquire_owned().ok()?,
                host: None,
                by_host: self.preauth_by_host.clone(),
            })
        };
        self.admit_regular(host)
            .or_else(fast)
            .ok_or("too many connections in their handshake")
    }

    fn admit_regular(&self, host: std::net::IpAddr) -> Option<PreAuth> {
        let per_host = (self.opts.max_unauthenticated / 4).max(2);
        let mut m = lock(&self.preauth_by_host);
        if m.get(&host).is_some_and(|&n| n >= per_host) {
            return None;
        }
        let permit = self.preauth.clone().try_acquire_owned().ok()?;
        *m.entry(host).or_insert(0) += 1;
        Some(PreAuth {
            _permit: permit,
            host: Some(host),
            by_host: self.preauth_by_host.clone(),
        })
    }
}
