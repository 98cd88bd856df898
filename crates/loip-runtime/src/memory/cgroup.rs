//! Memory cgroups (v2 and v1) as the kernel keeps them: which one this process is in, its
//! limit, what it charges now and at its peak, OOM kills and pressure events; and a fresh
//! child cgroup with a limit, for running a process under the kernel's own judgement
//! (`loip local --cgroup`, the budget tests).
//!
//! Everything here reads and writes files under the cgroup mounts and never panics: a file
//! that is missing or unreadable is `None` (a machine without cgroups, a container that hides
//! them), and the callers fall back to `/proc`.

use std::io;
use std::path::{Path, PathBuf};

/// Which cgroup interface a memory cgroup speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Version {
    /// the unified hierarchy: `memory.max`, `memory.current`, `memory.peak`, `memory.events`
    V2,
    /// the v1 memory controller: `memory.limit_in_bytes`, `memory.usage_in_bytes`,
    /// `memory.max_usage_in_bytes`, `memory.oom_control`
    V1,
}

/// A cgroup's figures as the kernel keeps them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Report {
    /// hard limit, bytes (`None`: unlimited)
    pub limit: Option<u64>,
    /// charge now, bytes
    pub current: Option<u64>,
    /// highest charge, bytes (`memory.peak` / `memory.max_usage_in_bytes`)
    pub peak: Option<u64>,
    /// processes killed for the limit
    pub oom_kills: u64,
    /// times the charge met the limit (v2 `max` + `high` events, v1 `failcnt`)
    pub pressure_events: u64,
    /// which interface
    pub version: Version,
}

/// One memory cgroup directory (not `Clone`: one this process created is removed when its
/// one owner drops it).
#[derive(Debug)]
pub struct Cgroup {
    dir: PathBuf,
    version: Version,
    /// removed when dropped (one this process created)
    owned: bool,
}

/// Where the v1 memory controller and the v2 hierarchy are mounted, from `/proc/self/mountinfo`.
fn mounts() -> (Option<PathBuf>, Option<PathBuf>) {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let (mut v1, mut v2) = (None, None);
    for line in text.lines() {
        // "... mount_point options - fstype source super_options"
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        let mount_point = left.split(' ').nth(4).map(PathBuf::from);
        let mut r = right.split(' ');
        let fstype = r.next().unwrap_or("");
        let supers = r.nth(1).unwrap_or("");
        if fstype == "cgroup2" && v2.is_none() {
            v2 = mount_point;
        } else if fstype == "cgroup" && supers.split(',').any(|o| o == "memory") && v1.is_none() {
            v1 = mount_point;
        }
    }
    (v1, v2)
}

/// The relative path of this process's cgroup for the v1 memory controller and for v2, from
/// `/proc/self/cgroup`.
fn own_paths() -> (Option<String>, Option<String>) {
    let text = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let (mut v1, mut v2) = (None, None);
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(ctrl), Some(path)) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        if id == "0" && ctrl.is_empty() {
            v2 = Some(path.trim_start_matches('/').to_string());
        } else if ctrl.split(',').any(|c| c == "memory") {
            v1 = Some(path.trim_start_matches('/').to_string());
        }
    }
    (v1, v2)
}

fn read_u64(p: &Path) -> Option<u64> {
    let s = std::fs::read_to_string(p).ok()?;
    let s = s.trim();
    if s == "max" {
        return Some(u64::MAX);
    }
    s.parse().ok()
}

/// A `key value` line of a flat-keyed file (`memory.events`, `memory.stat`, `oom_control`).
fn keyed(p: &Path, key: &str) -> Option<u64> {
    keyed_text(&std::fs::read_to_string(p).ok()?, key)
}

/// A `key value` line of a flat-keyed text.
fn keyed_text(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == key).then(|| v.trim().parse().ok()).flatten()
    })
}

/// A cgroup's charge split by what reclaim can do with it, bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Split {
    /// what the kernel cannot drop without a write or swap (no swap here): anonymous memory,
    /// shared memory, unevictable pages, dirty and writeback page cache, kernel memory — the
    /// charge less `reclaimable`, bytes
    pub unreclaimable: u64,
    /// clean page cache on the file LRU lists (mapped or not: code, files read): what the
    /// kernel reclaims at the limit instead of failing a charge, bytes
    pub reclaimable: u64,
}

impl Split {
    /// The split of a charge of `current` bytes by the cgroup's `memory.stat` text: clean file
    /// pages are `inactive_file + active_file` less `dirty + writeback` (v1's `total_*`
    /// figures, which count the cgroup's children; v2's `file_dirty`, `file_writeback`).
    /// Shared memory and locked pages live on other lists and stay unreclaimable.
    pub fn of(current: u64, stat: &str, version: Version) -> Split {
        let k = |v1: &str, v2: &str| {
            let key = match version {
                Version::V1 => v1,
                Version::V2 => v2,
            };
            keyed_text(stat, key).unwrap_or(0)
        };
        let file =
            k("total_inactive_file", "inactive_file") + k("total_active_file", "active_file");
        let unclean = k("total_dirty", "file_dirty") + k("total_writeback", "file_writeback");
        let reclaimable = file.saturating_sub(unclean).min(current);
        Split {
            unreclaimable: current - reclaimable,
            reclaimable,
        }
    }
}

/// v1 reports "no limit" as a page-rounded `i64::MAX`.
const V1_UNLIMITED: u64 = 1 << 62;

impl Cgroup {
    /// The memory cgroup this process is in, v2 where its memory files exist, else v1.
    pub fn of_self() -> Option<Cgroup> {
        let (m1, m2) = mounts();
        let (p1, p2) = own_paths();
        if let (Some(m), Some(p)) = (&m2, &p2) {
            let dir = m.join(p);
            if dir.join("memory.current").exists() {
                return Some(Cgroup {
                    dir,
                    version: Version::V2,
                    owned: false,
                });
            }
        }
        if let (Some(m), Some(p)) = (&m1, &p1) {
            let dir = m.join(p);
            if dir.join("memory.usage_in_bytes").exists() {
                return Some(Cgroup {
                    dir,
                    version: Version::V1,
                    owned: false,
                });
            }
        }
        None
    }

    /// A new memory cgroup `name` (a child of this process's own, so it nests wherever this
    /// process is confined) with a hard limit of `limit` bytes and no swap; removed when
    /// dropped. Needs the right to create cgroups (root, or a delegated v2 subtree).
    pub fn create(name: &str, limit: u64) -> io::Result<Cgroup> {
        let own = Cgroup::of_self().ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::Unsupported,
                "no memory cgroup controller here",
            )
        })?;
        let dir = own.dir.join(name);
        match std::fs::create_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
        let cg = Cgroup {
            dir,
            version: own.version,
            owned: true,
        };
        match cg.version {
            Version::V2 => {
                cg.write("memory.max", &limit.to_string())?;
                // swap would let a process exceed the limit without being charged for it
                let _ = cg.write("memory.swap.max", "0");
            }
            Version::V1 => {
                cg.write("memory.limit_in_bytes", &limit.to_string())?;
                let _ = cg.write("memory.memsw.limit_in_bytes", &limit.to_string());
                let _ = cg.write("memory.swappiness", "0");
                let _ = cg.write("memory.max_usage_in_bytes", "0");
            }
        }
        Ok(cg)
    }

    fn write(&self, file: &str, value: &str) -> io::Result<()> {
        std::fs::write(self.dir.join(file), value)
    }

    /// The cgroup's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// v1 or v2.
    pub fn version(&self) -> Version {
        self.version
    }

    /// The file a process id is written to to move that process in (for a child's `pre_exec`).
    pub fn procs_file(&self) -> PathBuf {
        self.dir.join("cgroup.procs")
    }

    /// Makes `cmd`'s child start inside this cgroup: it moves itself in between `fork` and
    /// `exec`, so everything it is ever charged for is counted here.
    pub fn confine(&self, cmd: &mut std::process::Command) -> io::Result<()> {
        use std::os::unix::ffi::OsStrExt;
        use std::os::unix::process::CommandExt;
        let path = std::ffi::CString::new(self.procs_file().as_os_str().as_bytes())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        // SAFETY: the closure runs in the forked child before exec and only makes
        // async-signal-safe calls (open, write, close) on memory prepared before the fork.
        unsafe {
            cmd.pre_exec(move || {
                let fd = libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd < 0 {
                    return Err(io::Error::last_os_error());
                }
                // "0" names the writing process itself
                let n = libc::write(fd, b"0".as_ptr().cast(), 1);
                libc::close(fd);
                if n != 1 {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            });
        }
        Ok(())
    }

    /// What the kernel recorded for this cgroup: limit, peak charge, OOM kills.
    pub fn report(&self) -> Report {
        Report {
            limit: self.limit(),
            current: self.current(),
            peak: self.peak(),
            oom_kills: self.oom_kills(),
            pressure_events: self.pressure_events(),
            version: self.version,
        }
    }

    /// Moves process `pid` into this cgroup.
    pub fn add(&self, pid: u32) -> io::Result<()> {
        self.write("cgroup.procs", &pid.to_string())
    }

    /// The hard limit, bytes; `None` when unlimited or unreadable.
    pub fn limit(&self) -> Option<u64> {
        let v = match self.version {
            Version::V2 => read_u64(&self.dir.join("memory.max"))?,
            Version::V1 => read_u64(&self.dir.join("memory.limit_in_bytes"))?,
        };
        (v < V1_UNLIMITED).then_some(v)
    }

    /// What the cgroup is charged now (anonymous memory, page cache, kernel memory), bytes.
    pub fn current(&self) -> Option<u64> {
        match self.version {
            Version::V2 => read_u64(&self.dir.join("memory.current")),
            Version::V1 => read_u64(&self.dir.join("memory.usage_in_bytes")),
        }
    }

    /// The `memory.stat` text now.
    pub fn stat(&self) -> Option<String> {
        std::fs::read_to_string(self.dir.join("memory.stat")).ok()
    }

    /// The charge now split into what the kernel cannot reclaim and the clean page cache it
    /// drops before anything else (see [`Split::of`]).
    pub fn split(&self) -> Option<Split> {
        Some(Split::of(self.current()?, &self.stat()?, self.version))
    }

    /// The highest charge seen, bytes (`memory.peak`, `memory.max_usage_in_bytes`).
    pub fn peak(&self) -> Option<u64> {
        match self.version {
            Version::V2 => read_u64(&self.dir.join("memory.peak")),
            Version::V1 => read_u64(&self.dir.join("memory.max_usage_in_bytes")),
        }
    }

    /// Processes the kernel killed for this cgroup's limit.
    pub fn oom_kills(&self) -> u64 {
        match self.version {
            Version::V2 => keyed(&self.dir.join("memory.events"), "oom_kill"),
            Version::V1 => keyed(&self.dir.join("memory.oom_control"), "oom_kill"),
        }
        .unwrap_or(0)
    }

    /// Times the charge met the limit and the kernel had to reclaim or throttle (v2
    /// `memory.events` `max` + `high`; v1 `memory.failcnt`): the pressure a process should
    /// answer by shedding memory.
    pub fn pressure_events(&self) -> u64 {
        match self.version {
            Version::V2 => {
                let ev = self.dir.join("memory.events");
                keyed(&ev, "max").unwrap_or(0) + keyed(&ev, "high").unwrap_or(0)
            }
            Version::V1 => read_u64(&self.dir.join("memory.failcnt")).unwrap_or(0),
        }
    }

    /// Page cache charged to the cgroup now, bytes (`file` in `memory.stat`; v1 `cache`).
    pub fn page_cache(&self) -> Option<u64> {
        let stat = self.dir.join("memory.stat");
        match self.version {
            Version::V2 => keyed(&stat, "file"),
            Version::V1 => keyed(&stat, "cache"),
        }
    }

    /// The processes in the cgroup now.
    pub fn pids(&self) -> Vec<u32> {
        std::fs::read_to_string(self.dir.join("cgroup.procs"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        if self.owned {
            // the processes have exited (or are moved to the parent first)
            if let Some(parent) = self.dir.parent() {
                for pid in self.pids() {
                    let _ = std::fs::write(parent.join("cgroup.procs"), pid.to_string());
                }
            }
            let _ = std::fs::remove_dir(&self.dir);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unreadable_cgroups_are_none_not_panics() {
        let cg = Cgroup {
            dir: PathBuf::from("/nonexistent/loip"),
            version: Version::V2,
            owned: false,
        };
        assert_eq!(cg.limit(), None);
        assert_eq!(cg.current(), None);
        assert_eq!(cg.oom_kills(), 0);
        assert!(cg.pids().is_empty());
    }
}
