//! A cluster of worker processes on this machine (`loip local`): their budgets, spawning
//! them on loopback (each in its own memory cgroup if asked), the specs a session connects
//! to, and cleaning up — killed with their temporary stores on drop, and on Ctrl-C.
//!
//! The remote cluster is [`crate::cluster_run`]; this is the same cluster with the workers
//! started here, so the CLI only maps flags onto it.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::Duration;

use loip_model::slice::{Manifest, SliceKind};
use loip_plan::DeviceProfile;
use serde::Serialize;

use crate::cluster_run::{kill_pid, on_interrupt, WorkerProcess, WorkerSpec};
use crate::coordinator::ClusterError;
use crate::memory::Cgroup;
use crate::RuntimeError;

/// Budgets that force offloading: the worker process itself
/// ([`crate::memory::WORKER_PROCESS_ESTIMATE`]), working buffers, the embedding / head
/// where they live, the KV cache of `context` tokens, and 60 % of an even share of the
/// layers.  // bytes
pub fn default_budgets(m: &Manifest, devices: usize, context: u64) -> Vec<u64> {
    let size = |k: SliceKind| m.slice(k).map_or(0, |s| s.size);
    let layers: u64 = (0..m.config.num_layers)
        .map(|l| size(SliceKind::Attn(l)) + size(SliceKind::Mlp(l)))
        .sum();
    let kv = context
        * m.config.num_layers as u64
        * 2
        * (m.config.num_kv_heads * m.config.head_dim) as u64
        * 4;
    let base = crate::memory::WORKER_PROCESS_ESTIMATE + (18 << 20) + kv;
    (0..devices)
        .map(|i| {
            let mut b = base + layers * 6 / 10 / devices as u64;
            if i == 0 {
                b += size(SliceKind::Embed);
            }
            if i + 1 == devices {
                b += size(SliceKind::Head)
                    + if m.config.tie_word_embeddings && i != 0 {
                        size(SliceKind::Embed)
                    } else {
                        0
                    };
            }
            b
        })
        .collect()
}

/// The benchmark's budgets: engines that together get 60 % of the model's bytes (all
/// slices), split 2:1:2:1… so that the devices differ and rounded down to MiB, each plus a
/// worker process's own share ([`WORKER_PROCESS_ESTIMATE`](crate::memory::WORKER_PROCESS_ESTIMATE),
/// since `--mem` is the whole process's budget). On llama-1b (2.1 GB) and 3 devices: 531, 279,
/// 531 MiB. No single-stage pipeline fits (`pp`, `edgeshard` report OOM); the interleaved
/// plans offload.  // bytes
pub fn bench_budgets(m: &Manifest, devices: usize) -> Vec<u64> {
    let total: u64 = m.slices.iter().map(|s| s.size).sum();
    let w: Vec<u64> = (0..devices)
        .map(|i| if i % 2 == 0 { 2 } else { 1 })
        .collect();
    let sum: u64 = w.iter().sum();
    w.iter()
        .map(|&wi| {
            let engine = (total * 6 / 10 * wi / sum) >> 20 << 20;
            engine + crate::memory::WORKER_PROCESS_ESTIMATE
        })
        .collect()
}

/// Worker children and temp dirs alive now, for the Ctrl-C handler.
static LIVE: Mutex<(Vec<u32>, Vec<PathBuf>)> = Mutex::new((Vec::new(), Vec::new()));
/// Scratch kept on purpose (the benchmark's stores), reported when interrupted.
static KEPT: Mutex<Option<PathBuf>> = Mutex::new(None);

fn live() -> std::sync::MutexGuard<'static, (Vec<u32>, Vec<PathBuf>)> {
    LIVE.lock().unwrap_or_else(|e| e.into_inner())
}

/// On SIGINT / SIGTERM: kills the worker children, removes the temp stores, says where kept
/// scratch is, exits 130.
pub fn install_interrupt_cleanup() {
    let r = on_interrupt(|| {
        let (pids, dirs) = std::mem::take(&mut *live());
        for pid in pids {
            kill_pid(pid);
        }
        for d in dirs {
            let _ = std::fs::remove_dir_all(&d);
        }
        let kept = KEPT.lock().unwrap_or_else(|e| e.into_inner()).clone();
        match kept {
            Some(k) => eprintln!(
                "interrupted: workers stopped; stores kept in {} ({})",
                k.display(),
                scratch_size(&k)
            ),
            None => eprintln!("interrupted: workers stopped, temp stores removed"),
        }
    });
    if let Err(e) = r {
        tracing::warn!("no Ctrl-C handler: {e}");
    }
}

/// Scratch under `dir` is kept on purpose (reported when interrupted).
pub fn keep_scratch(dir: &Path) {
    *KEPT.lock().unwrap_or_else(|e| e.into_inner()) = Some(dir.to_path_buf());
}

/// Bytes under `dir`, formatted.
pub fn scratch_size(dir: &Path) -> String {
    fn walk(p: &Path) -> u64 {
        let Ok(rd) = std::fs::read_dir(p) else {
            return 0;
        };
        rd.flatten()
            .map(|e| match e.file_type() {
                Ok(t) if t.is_dir() => walk(&e.path()),
                Ok(t) if t.is_file() => e.metadata().map_or(0, |m| m.len()),
                _ => 0,
            })
            .sum()
    }
    loip_plan::units::format_bytes(walk(dir))
}

/// How to start the workers.
#[derive(Debug, Clone, Default)]
pub struct LocalWorkerOptions {
    /// the `loip` binary to run (`loip worker …`)
    pub exe: PathBuf,
    /// each worker's `--mem`, bytes
    pub budgets: Vec<u64>,
    /// emulated outgoing bandwidth of every worker, bytes/s
    pub bandwidth: Option<f64>,
    /// the shared secret (given in `LOIP_TOKEN`, never on a command line)
    pub token: String,
    /// where the stores live (kept); `None`: a temporary directory removed on drop
    pub store_root: Option<PathBuf>,
    /// each worker in a fresh memory cgroup of exactly its `--mem`
    pub cgroup: bool,
}

/// Name of a local cluster's temp stores, before the owning process's id.
const SCRATCH_PREFIX: &str = "loip-local-";

/// Removes the temp stores (`loip-local-PID` in `tmp`) of local clusters whose process is
/// gone: a run killed with SIGKILL cannot remove its own (about 126 MB for SmolLM2 on three
/// workers). Only where `/proc` tells which processes live; logged with the bytes freed.
pub fn sweep_stale_scratch(tmp: &Path) {
    let proc = Path::new("/proc");
    if !proc.join("self").exists() {
        return;
    }
    let Ok(entries) = std::fs::read_dir(tmp) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(SCRATCH_PREFIX))
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if proc.join(pid.to_string()).exists() {
            continue;
        }
        let dir = e.path();
        let size = scratch_size(&dir);
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => tracing::info!(
                "removed {} ({size}), left by local workers of process {pid}, which is gone",
                dir.display()
            ),
            Err(err) => tracing::warn!("cannot remove {}: {err}", dir.display()),
        }
    }
}

/// Worker processes of this binary on loopback; killed (and their temp stores removed) on
/// drop.
pub struct LocalWorkers {
    /// the workers, `dev1`, `dev2`, … in order
    pub procs: Vec<WorkerProcess>,
    temp: Option<PathBuf>,
}

impl LocalWorkers {
    /// Starts one `loip worker` per budget and waits for each to listen.
    pub fn spawn(o: &LocalWorkerOptions) -> Result<LocalWorkers, ClusterError> {
        let (root, temp) = match &o.store_root {
            Some(r) => (r.clone(), None),
            None => {
                sweep_stale_scratch(&std::env::temp_dir());
                let t =
                    std::env::temp_dir().join(format!("{SCRATCH_PREFIX}{}", std::process::id()));
                live().1.push(t.clone());
                (t.clone(), Some(t))
            }
        };
        // dropped on an error: the workers started so far are killed
        let mut w = LocalWorkers {
            procs: Vec::new(),
            temp,
        };
        for (i, b) in o.budgets.iter().enumerate() {
            let name = format!("dev{}", i + 1);
            let mut cmd = Command::new(&o.exe);
            cmd.args(["worker", "--listen", "127.0.0.1:0", "--exit-with-parent"])
                .args(["--name", &name])
                .arg("--mem")
                .arg(b.to_string())
                .arg("--store")
                .arg(root.join(&name))
                .env("LOIP_TOKEN", &o.token);
            if let Some(bw) = o.bandwidth {
                cmd.arg("--bandwidth").arg(format!("{bw}"));
            }
            let cg = if o.cgroup {
                let cg_name = format!("loip-local-{}-{name}", std::process::id());
                let cg = Cgroup::create(&cg_name, *b).map_err(|e| {
                    RuntimeError::Invalid(format!(
                        "creating memory cgroup {cg_name} (--cgroup needs root or a delegated \
                         cgroup): {e}"
                    ))
                })?;
                Some(cg)
            } else {
                None
            };
            let p = WorkerProcess::spawn_in(cmd, Duration::from_secs(120), cg)?;
            live().0.push(p.pid);
            w.procs.push(p);
        }
        Ok(w)
    }

    /// What a session connects to: `dev1`, `dev2`, … at their addresses, with `profiles`
    /// (one per worker) or measured.
    pub fn specs(&self, profiles: Option<&[DeviceProfile]>) -> Vec<WorkerSpec> {
        self.procs
            .iter()
            .enumerate()
            .map(|(i, p)| WorkerSpec {
                profile: profiles.and_then(|ps| ps.get(i).cloned()),
                ..WorkerSpec::new(format!("dev{}", i + 1), &p.addr)
            })
            .collect()
    }

    /// Each worker's memory cgroup as the kernel saw it (empty without cgroups).
    pub fn cgroup_reports(&self) -> Vec<CgroupReport> {
        self.procs
            .iter()
            .enumerate()
            .filter_map(|(i, p)| p.memory().map(|m| (i, m)))
            .map(|(i, m)| CgroupReport {
                device: format!("dev{}", i + 1),
                limit: m.limit.unwrap_or(0),
                peak: m.peak.unwrap_or(0),
                oom_kills: m.oom_kills,
                pressure_events: m.pressure_events,
            })
            .collect()
    }
}

impl Drop for LocalWorkers {
    fn drop(&mut self) {
        let pids: Vec<u32> = self.procs.iter().map(|p| p.pid).collect();
        self.procs.clear();
        if let Some(t) = &self.temp {
            let _ = std::fs::remove_dir_all(t);
        }
        let mut live = live();
        live.0.retain(|p| !pids.contains(p));
        if let Some(t) = &self.temp {
            live.1.retain(|d| d != t);
        }
    }
}

/// One worker's memory cgroup at the end of a run.
#[derive(Debug, Clone, Serialize)]
pub struct CgroupReport {
    /// `devN`
    pub device: String,
    /// bytes (= its --mem)
    pub limit: u64,
    /// highest charge, bytes
    pub peak: u64,
    /// processes the kernel killed for the limit
    pub oom_kills: u64,
    /// times the charge met the limit
    pub pressure_events: u64,
}

impl std::fmt::Display for CgroupReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use loip_plan::units::format_bytes;
        write!(
            f,
            "{}: memory cgroup limit {}, peak charge {} ({:.0}%), OOM kills {}, limit reached {} \
             times",
            self.device,
            format_bytes(self.limit),
            format_bytes(self.peak),
            100.0 * self.peak as f64 / self.limit.max(1) as f64,
            self.oom_kills,
            self.pressure_events
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sweeps_only_the_scratch_of_processes_that_are_gone() {
        let root = std::env::temp_dir().join(format!("loip-sweep-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        // pid_max is at most 2^22 on Linux: this process cannot exist
        let gone = root.join(format!("{SCRATCH_PREFIX}{}", 1u32 << 30));
        let alive = root.join(format!("{SCRATCH_PREFIX}{}", std::process::id()));
        let other = root.join("loip-local-notapid");
        for d in [&gone, &alive, &other] {
            std::fs::create_dir_all(d.join("dev1")).unwrap();
            std::fs::write(d.join("dev1/slice"), [0u8; 16]).unwrap();
        }
        sweep_stale_scratch(&root);
        assert!(!gone.exists());
        assert!(alive.exists() && other.exists());
        std::fs::remove_dir_all(&root).unwrap();
    }
}
