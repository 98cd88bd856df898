//! Worker child processes, signal cleanup and the fixed round-robin plan for tests.

use std::io::BufRead;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use loip_plan::{ExecMode, Pattern, Plan};

use crate::coordinator::ClusterError;
use crate::memory::Cgroup;
use crate::RuntimeError;

/// Sends SIGKILL to process `pid` (a worker child), ignoring errors.
pub fn kill_pid(pid: u32) {
    // SAFETY: kill(2) has no memory-safety preconditions.
    unsafe {
        libc::kill(pid as libc::pid_t, libc::SIGKILL);
    }
}

/// Runs `cleanup` on the first SIGINT or SIGTERM, then exits with status 130; the handlers
/// are installed before this returns and are watched from a background thread.
pub fn on_interrupt(cleanup: impl FnOnce() + Send + 'static) -> std::io::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (mut int, mut term) = rt.block_on(async {
        Ok::<_, std::io::Error>((
            signal(SignalKind::interrupt())?,
            signal(SignalKind::terminate())?,
        ))
    })?;
    std::thread::Builder::new()
        .name("loip-signals".into())
        .spawn(move || {
            rt.block_on(async {
                tokio::select! {
                    _ = int.recv() => {}
                    _ = term.recv() => {}
                }
            });
            cleanup();
            std::process::exit(130);
        })?;
    Ok(())
}

/// A `loip worker` child process; killed when dropped.
pub struct WorkerProcess {
    child: Child,
    /// the memory cgroup it runs in, if it was started in one (removed after the child)
    cgroup: Option<Cgroup>,
    /// the address it listens on
    pub addr: String,
    /// its lines on stdout after `listening on`, and stderr, are inherited / discarded
    pub pid: u32,
}

impl WorkerProcess {
    /// Spawns `cmd` (a `loip worker --listen HOST:0 …` command line) and waits up to
    /// `timeout` for its `listening on ADDR` line on stdout.
    pub fn spawn(cmd: Command, timeout: Duration) -> Result<WorkerProcess, ClusterError> {
        Self::spawn_in(cmd, timeout, None)
    }

    /// [`WorkerProcess::spawn`] inside `cgroup` (see [`Cgroup::confine`]).
    pub fn spawn_in(
        mut cmd: Command,
        timeout: Duration,
        cgroup: Option<Cgroup>,
    ) -> Result<WorkerProcess, ClusterError> {
        if let Some(cg) = &cgroup {
            cg.confine(&mut cmd).map_err(|e| RuntimeError::Io {
                path: cg.dir().to_path_buf(),
                source: e,
            })?;
        }
        cmd.stdout(Stdio::piped()).stdin(Stdio::null());
        let mut child = cmd.spawn().map_err(|e| RuntimeError::Io {
            path: PathBuf::from(format!("{cmd:?}")),
            source: e,
        })?;
        let pid = child.id();
        let Some(stdout) = child.stdout.take() else {
            let _ = child.kill();
            return Err(ClusterError::Invalid("worker without stdout".into()));
        };
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut sent = false;
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if !sent {
                    if let Some(a) = line.split("listening on ").nth(1) {
                        let _ = tx.send(a.trim().to_string());
                        sent = true;
                    }
                }
            }
        });
        match rx.recv_timeout(timeout) {
            Ok(addr) => Ok(WorkerProcess {
                child,
                cgroup,
                addr,
                pid,
            }),
            Err(e) => {
                let _ = child.kill();
                let status = child
                    .wait()
                    .map_or_else(|e| format!("status unknown: {e}"), |s| s.to_string());
                Err(ClusterError::Invalid(match e {
                    std::sync::mpsc::RecvTimeoutError::Disconnected => format!(
                        "worker process {pid} ended before it listened ({status}; its error is above)"
                    ),
                    std::sync::mpsc::RecvTimeoutError::Timeout => format!(
                        "worker process {pid} did not report its address within {} s ({status})",
                        timeout.as_secs_f64()
                    ),
                }))
            }
        }
    }

    /// Its memory cgroup's figures (limit, peak, OOM kills), if it runs in one.
    pub fn memory(&self) -> Option<crate::memory::cgroup::Report> {
        self.cgroup.as_ref().map(Cgroup::report)
    }

    /// Kills it now (a fault test).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Layers `0..L` in `stages·devices` contiguous stages in round-robin order, as even as
/// possible: a fixed plan for tests and hand-made runs. `offload(device, stage_len)` returns
/// how many attention and MLP blocks to offload at the end of each stage of that device.
pub fn uniform_plan(
    shape_name: &str,
    layers: u32,
    devices: &[String],
    stages_per_device: u32,
    mode: ExecMode,
    offload: &dyn Fn(usize, u32) -> (u32, u32),
) -> Result<Plan, ClusterError> {
    let nd = devices.len() as u32;
    let total = nd * stages_per_device;
    if nd == 0 || stages_per_device == 0 || total > layers {
        return Err(ClusterError::Invalid(format!(
            "{layers} layers cannot fill {total} stages"
        )));
    }
    let mut plan_devices: Vec<loip_plan::DevicePlan> = devices
        .iter()
        .enumerate()
        .map(|(i, name)| loip_plan::DevicePlan {
            name: name.clone(),
            holds_embedding: i == 0,
            holds_head: i + 1 == devices.len(),
            stages: Vec::new(),
            memory_bytes: 0,
            budget_bytes: 0,
            slot_bytes: 0,
            kv_bytes: 0,
            compute_ms: 0.0,
            load_ms: 0.0,
            stall_ms: 0.0,
        })
        .collect();
    let mut first = 0u32;
    for g in 0..total {
        let n = layers / total + u32::from(g < layers % total);
        let d = (g % nd) as usize;
        let (a, m) = offload(d, n);
        plan_devices[d]
            .stages
            .push(loip_plan::StagePlan::with_offload(first, n, a, m));
        first += n;
    }
    Ok(Plan {
        shape: shape_name.to_string(),
        planner: "manual".into(),
        stages_per_device,
        pattern: Pattern::Sporadic,
        context: 0,
        micro_batches: 1,
        mode,
        loader: loip_plan::LoaderKind::Direct,
        devices: plan_devices,
        dropped: Vec::new(),
        predicted_ms_per_token: 0.0,
        breakdown: Default::default(),
    })
}
