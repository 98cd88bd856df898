//! Re-admitting workers that come back: a watcher thread that notices a missing worker
//! (unreachable at setup, or gone) answering again, and re-plans the session with it.
//!
//! The re-plan stops the running pipeline, so it waits until no sequence holds KV on it,
//! unless the pipeline is broken already (a device gone: requests fail until a re-plan).

use std::net::{TcpStream, ToSocketAddrs};
use std::sync::{Mutex, TryLockError, Weak};
use std::time::Duration;

use super::Session;
use crate::coordinator::Endpoint;

/// How long a missing worker has to accept a TCP connection to count as back.
const ANSWER_TIMEOUT: Duration = Duration::from_millis(500);

/// Watches `session` every `every` from a thread of its own, until the session is dropped:
/// when a missing worker accepts connections again, re-plans with it ([`Session::rejoin`])
/// and tells `say` what happened (a line for the log).
pub fn watch_rejoin(
    session: Weak<Mutex<Session>>,
    every: Duration,
    say: impl Fn(String) + Send + 'static,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("loip-rejoin".into())
        .spawn(move || {
            let mut pause = every;
            loop {
                std::thread::sleep(pause);
                // the thread ends with the session
                let Some(s) = session.upgrade() else { return };
                pause = match rejoin_round(&s) {
                    Some(Ok(line)) => {
                        say(line);
                        every
                    }
                    Some(Err(line)) => {
                        say(line);
                        // a worker that answers but cannot join: not every round
                        (pause * 2).min(MAX_PAUSE)
                    }
                    None => pause,
                };
            }
        })
}

/// Longest pause between two looks after failed re-admissions.
const MAX_PAUSE: Duration = Duration::from_secs(60);

/// One look: the missing workers that answer, re-admitted when the pipeline allows it; the
/// line to log, `Err` when the re-plan with them failed.
fn rejoin_round(s: &Mutex<Session>) -> Option<Result<String, String>> {
    let (missing, broken, idle) = {
        let g = match s.try_lock() {
            Ok(g) => g,
            // busy (a request re-planning): look again next round
            Err(TryLockError::WouldBlock) => return None,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
        };
        (g.missing(), !g.gone().is_empty(), g.idle())
    };
    if missing.is_empty() || !(broken || idle) {
        return None;
    }
    // probed without the session's lock: a host that is down takes ANSWER_TIMEOUT
    let back: Vec<String> = missing
        .iter()
        .filter(|e| answers(e))
        .map(|e| e.name.clone())
        .collect();
    if back.is_empty() {
        return None;
    }
    let mut g = s.lock().unwrap_or_else(|p| p.into_inner());
    Some(match g.rejoin(&back) {
        Ok(on) => Ok(format!(
            "{} answers again; re-planned over {}",
            back.join(", "),
            on.join(", ")
        )),
        Err(e) => Err(format!(
            "{} answers again, but re-planning with it failed: {e}",
            back.join(", ")
        )),
    })
}

/// Whether `e`'s address accepts a TCP connection within [`ANSWER_TIMEOUT`].
fn answers(e: &Endpoint) -> bool {
    let Ok(addrs) = e.addr.to_socket_addrs() else {
        return false;
    };
    addrs
        .take(4)
        .any(|a| TcpStream::connect_timeout(&a, ANSWER_TIMEOUT).is_ok())
}
