//! Loading offloaded blocks: the single-slot direct loader and the conventional baseline.
//!
//! A device groups its offloaded slices per stage ("groups"). Both loaders run a background
//! thread and follow the same protocol: [`Loader::start`] asks for a group, [`Loader::wait`]
//! blocks until it is in memory and returns a [`TensorSource`] over it, and dropping that
//! view releases the memory for the next group. Compute signals "done" simply by dropping
//! the view and calling `start` for the next group — the borrow checker enforces that the
//! slot is never written while a view of it is alive.
//!
//! - **direct**: one page-aligned slot, allocated once and sized for the largest group;
//!   every file read with `O_DIRECT` through io_uring, several 2 MiB reads in flight, straight
//!   into the slot; tensor views are offsets fixed at start-up from the manifest (no parsing,
//!   no allocation per load). The CRC of every file is checked after each read.
//! - **conventional**: drop the file's cached pages, buffered read into a new buffer, parse
//!   the slice header, allocate one buffer per tensor and copy into it — every time.

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use loip_engine::{EngineError, TensorSource};
use loip_kernels::DType;
use loip_model::slice::{check_crc, parse_slice_header, SliceEntry, SLICE_ALIGN};

use crate::aligned::AlignedBuf;
use crate::RuntimeError;

/// Which loading path to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum LoaderKind {
    /// single slot, O_DIRECT io_uring, compute in place
    #[default]
    Direct,
    /// buffered read, parse, allocate, copy — the ablation baseline
    Conventional,
}

impl std::str::FromStr for LoaderKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "direct" => Ok(LoaderKind::Direct),
            "conventional" => Ok(LoaderKind::Conventional),
            _ => Err(format!(
                "unknown loader {s:?}; expected direct or conventional"
            )),
        }
    }
}

/// Read size of one io_uring request, bytes.
pub const CHUNK: usize = 2 << 20;
/// io_uring requests in flight.
pub const IN_FLIGHT: usize = 16;

/// A tensor's place in a loaded group.
#[derive(Debug, Clone)]
struct View {
    dtype: DType,
    shape: Vec<usize>,
    offset: usize, // bytes from the start of the slot
    nbytes: usize, // bytes
}

/// Timing of one group load.
#[derive(Debug, Clone, Copy, Default)]
pub struct LoadStats {
    /// bytes read from disk
    pub bytes: u64,
    /// seconds from the start of the read to its end, in the loader thread
    pub load_s: f64,
}

enum Cmd {
    Load(usize),
    Stop,
}

enum Loaded {
    /// direct: the slot holds the group
    Slot(usize, LoadStats),
    /// conventional: one owned buffer per tensor
    Owned(usize, Owned, LoadStats),
}

/// A background loader of slice groups.
pub struct Loader {
    kind: LoaderKind,
    groups: Vec<Vec<PathBuf>>,         // per group, its slice files
    views: Vec<HashMap<String, View>>, // direct: per group, tensor → slot view
    slot: Option<AlignedBuf>,          // direct: the one slot
    tx: Sender<Cmd>,
    rx: Receiver<Result<Loaded, RuntimeError>>,
    pending: Option<usize>, // group being loaded
    in_slot: Option<usize>, // group fully loaded and not overwritten since
    owned: Owned,           // conventional: the tensors of `in_slot`
    thread: Option<JoinHandle<()>>,
    /// total seconds `wait` blocked (load stall), for the breakdown
    pub stall_s: f64,
    /// total seconds the loader thread spent reading (and checking) groups
    pub busy_s: f64,
    /// total bytes read from disk
    pub loaded_bytes: u64,
    /// statistics of the last load
    pub last: LoadStats,
}

/// The loaded group, borrowed until the next `start`.
pub struct GroupView<'a> {
    slot: Option<&'a [u8]>,
    views: Option<&'a HashMap<String, View>>,
    owned: Option<&'a Owned>,
}

impl TensorSource for GroupView<'_> {
    fn tensor(&self, name: &str) -> Result<(DType, Vec<usize>, &[u8]), EngineError> {
        if let (Some(slot), Some(views)) = (self.slot, self.views) {
            if let Some(v) = views.get(name) {
                let bytes = v
                    .offset
                    .checked_add(v.nbytes)
                    .and_then(|end| slot.get(v.offset..end))
                    .ok_or_else(|| {
                        EngineError::Invalid(format!("tensor {name} lies outside its slice"))
                    })?;
                return Ok((v.dtype, v.shape.clone(), bytes));
            }
        }
        if let Some((d, s, b)) = self.owned.and_then(|o| o.get(name)) {
            return Ok((*d, s.clone(), b));
        }
        Err(EngineError::Invalid(format!(
            "tensor {name} is not in the loaded group"
        )))
    }
}

impl Loader {
    /// A loader for `groups` (each a list of slice entries) in directory `dir`. The direct
    /// loader allocates its slot here, sized for the largest group.
    pub fn new(
        kind: LoaderKind,
        dir: &Path,
        groups: &[Vec<SliceEntry>],
    ) -> Result<Loader, RuntimeError> {
        let mut views = Vec::new();
        let mut files = Vec::new();
        let mut slot_bytes = 0usize;
        let mut layouts = Vec::new(); // per group: (path, slot offset, entry)
        for g in groups {
            let mut map = HashMap::new();
            let mut off = 0usize;
            let mut layout = Vec::new();
            for s in g {
                let path = dir.join(&s.file);
                for t in &s.tensors {
                    let dtype = t.dtype()?;
                    map.insert(
                        t.name.clone(),
                        View {
                            dtype,
                            shape: t.shape.clone(),
                            offset: off + t.offset as usize,
                            nbytes: t.nbytes as usize,
                        },
                    );
                }
                layout.push((path, off, s.clone()));
                off += s.size as usize;
            }
            slot_bytes = slot_bytes.max(off);
            files.push(layout.iter().map(|l| l.0.clone()).collect());
            views.push(map);
            layouts.push(layout);
        }
        let slot = match kind {
            LoaderKind::Direct => Some(AlignedBuf::new(slot_bytes, SLICE_ALIGN as usize)?),
            LoaderKind::Conventional => None,
        };
        let (tx, cmd_rx) = channel::<Cmd>();
        let (res_tx, rx) = channel();
        let slot_ptr = slot.as_ref().map(|s| SlotPtr(s.as_ptr_mut(), s.len()));
        let thread = std::thread::Builder::new()
            .name("loip-loader".into())
            .spawn(move || loader_thread(kind, layouts, slot_ptr, cmd_rx, res_tx))
            .map_err(|e| RuntimeError::Io {
                path: PathBuf::from("<loader thread>"),
                source: e,
            })?;
        Ok(Loader {
            kind,
            groups: files,
            views,
            slot,
            tx,
            rx,
            pending: None,
            in_slot: None,
            owned: HashMap::new(),
            thread: Some(thread),
            stall_s: 0.0,
            busy_s: 0.0,
            loaded_bytes: 0,
            last: LoadStats::default(),
        })
    }

    /// Bytes of the slot (0 for the conventional loader, which allocates per load).
    pub fn slot_bytes(&self) -> usize {
        self.slot.as_ref().map_or(0, |s| s.len())
    }

    /// The loading path.
    pub fn kind(&self) -> LoaderKind {
        self.kind
    }

    /// Number of groups.
    pub fn groups(&self) -> usize {
        self.groups.len()
    }

    /// Starts loading `group` in the background. Any previous group's view must be gone
    /// (enforced by the borrow of `self`).
    pub fn start(&mut self, group: usize) -> Result<(), RuntimeError> {
        if self.pending == Some(group) || (self.pending.is_none() && self.in_slot == Some(group)) {
            return Ok(());
        }
        if self.pending.is_some() {
            // A different group is in flight: finish it first, then reuse the slot.
            self.collect()?;
        }
        if group >= self.groups.len() {
            return Err(RuntimeError::Invalid(format!("no slice group {group}")));
        }
        self.tx
            .send(Cmd::Load(group))
            .map_err(|_| RuntimeError::LoaderGone)?;
        self.pending = Some(group);
        self.in_slot = None;
        self.owned.clear();
        Ok(())
    }

    fn account(&mut self, stats: LoadStats) {
        self.last = stats;
        self.busy_s += stats.load_s;
        self.loaded_bytes += stats.bytes;
    }

    fn collect(&mut self) -> Result<Loaded, RuntimeError> {
        let t = Instant::now();
        let r = self.rx.recv().map_err(|_| RuntimeError::LoaderGone)?;
        self.stall_s += t.elapsed().as_secs_f64();
        self.pending = None;
        r
    }

    /// Waits for `group` (starting it if it was not started) and returns its tensors. A group
    /// still in the slot from the previous wait is returned without reading it again.
    pub fn wait(&mut self, group: usize) -> Result<GroupView<'_>, RuntimeError> {
        if !(self.pending.is_none() && self.in_slot == Some(group)) {
            if self.pending != Some(group) {
                self.start(group)?;
            }
            match self.collect()? {
                Loaded::Slot(g, stats) if g == group => self.account(stats),
                Loaded::Owned(g, owned, stats) if g == group => {
                    self.account(stats);
                    self.owned = owned;
                }
                _ => {
                    return Err(RuntimeError::Invalid(
                        "loader answered for another group".into(),
                    ))
                }
            }
            self.in_slot = Some(group);
        }
        Ok(match self.kind {
            LoaderKind::Direct => GroupView {
                slot: self.slot.as_ref().map(|s| s.as_slice()),
                views: self.views.get(group),
                owned: None,
            },
            LoaderKind::Conventional => GroupView {
                slot: None,
                views: None,
                owned: Some(&self.owned),
            },
        })
    }
}

impl Drop for Loader {
    fn drop(&mut self) {
        let _ = self.tx.send(Cmd::Stop);
        // Drain a load in flight so the thread stops writing into the slot before it is freed.
        if self.pending.is_some() {
            let _ = self.rx.recv_timeout(Duration::from_secs(60));
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The slot's address, handed to the loader thread. It writes there only between a `Load`
/// command and its answer; the owner holds no view in that window.
struct SlotPtr(*mut u8, usize);
// SAFETY: see the protocol above: exactly one side touches the slot at a time.
unsafe impl Send for SlotPtr {}

type Layout = Vec<(PathBuf, usize, SliceEntry)>;

fn loader_thread(
    kind: LoaderKind,
    layouts: Vec<Layout>,
    slot: Option<SlotPtr>,
    rx: Receiver<Cmd>,
    tx: Sender<Result<Loaded, RuntimeError>>,
) {
    let mut ring = match kind {
        LoaderKind::Direct => io_uring::IoUring::new(IN_FLIGHT as u32 * 2).ok(),
        LoaderKind::Conventional => None,
    };
    while let Ok(Cmd::Load(g)) = rx.recv() {
        let t = Instant::now();
        let layout = &layouts[g];
        let res = match (kind, &slot) {
            (LoaderKind::Direct, Some(slot)) => load_direct(&mut ring, layout, slot).map(|bytes| {
                Loaded::Slot(
                    g,
                    LoadStats {
                        bytes,
                        load_s: t.elapsed().as_secs_f64(),
                    },
                )
            }),
            _ => load_conventional(layout).map(|(owned, bytes)| {
                Loaded::Owned(
                    g,
                    owned,
                    LoadStats {
                        bytes,
                        load_s: t.elapsed().as_secs_f64(),
                    },
                )
            }),
        };
        if tx.send(res).is_err() {
            return;
        }
    }
}

fn load_direct(
    ring: &mut Option<io_uring::IoUring>,
    layout: &Layout,
    slot: &SlotPtr,
) -> Result<u64, RuntimeError> {
    let mut total = 0u64;
    for (path, off, entry) in layout {
        let size = entry.size as usize;
        if off + size > slot.1 {
            return Err(RuntimeError::Invalid(format!(
                "{} does not fit the slot",
                path.display()
            )));
        }
        let file = crate::slice_file::open_slice(path, entry, true)?;
        // SAFETY: [off, off+size) lies inside the slot (checked above), and the owner holds no
        // view of the slot while a load is in flight (module protocol).
        let dst = unsafe { std::slice::from_raw_parts_mut(slot.0.add(*off), size) };
        let crc = match ring {
            Some(r) => read_uring(r, &file, dst, path)?,
            None => {
                read_pread(&file, dst, path)?;
                crc32fast::hash(dst)
            }
        };
        check_crc(path, entry, crc)?;
        total += size as u64;
    }
    Ok(total)
}

/// Reads the whole file into `dst` with several reads in flight; returns the CRC-32 of the
/// bytes, computed chunk by chunk as reads complete (overlapping the remaining I/O) and
/// combined in file order.
fn read_uring(
    ring: &mut io_uring::IoUring,
    file: &File,
    dst: &mut [u8],
    path: &Path,
) -> Result<u32, RuntimeError> {
    let mut crcs: Vec<Option<crc32fast::Hasher>> = vec![None; dst.len().div_ceil(CHUNK)];
    read_uring_chunks(ring, file, dst, path, &mut |idx, chunk| {
        let mut h = crc32fast::Hasher::new();
        h.update(chunk);
        crcs[idx] = Some(h);
    })?;
    let mut total = crc32fast::Hasher::new();
    for h in crcs.iter().flatten() {
        total.combine(h);
    }
    Ok(total.finalize())
}

/// Reads the whole file into `dst` in [`CHUNK`]-byte reads, [`IN_FLIGHT`] at a time, and
/// calls `on_chunk(index, bytes)` for each chunk as its read completes.
fn read_uring_chunks(
    ring: &mut io_uring::IoUring,
    file: &File,
    dst: &mut [u8],
    path: &Path,
    on_chunk: &mut dyn FnMut(usize, &[u8]),
) -> Result<(), RuntimeError> {
    use io_uring::{opcode, types};
    let io = |e: std::io::Error| RuntimeError::Io {
        path: path.to_path_buf(),
        source: e,
    };
    let fd = types::Fd(file.as_raw_fd());
    let (dst_len, base) = (dst.len(), dst.as_mut_ptr());
    let n_chunks = dst_len.div_ceil(CHUNK);
    let (mut next, mut done, mut in_flight) = (0usize, 0usize, 0usize);
    // Queues reads until IN_FLIGHT are in flight; returns whether it queued any.
    let mut push_reads = |ring: &mut io_uring::IoUring, in_flight: &mut usize| {
        let mut pushed = false;
        while *in_flight < IN_FLIGHT && next < n_chunks {
            let start = next * CHUNK;
            let len = CHUNK.min(dst_len - start);
            // SAFETY: the buffer [start, start+len) stays alive and untouched until its
            // completion is reaped below (we reap every submission before returning).
            let sqe = opcode::Read::new(fd, unsafe { base.add(start) }, len as u32)
                .offset(start as u64)
                .build()
                .user_data(next as u64);
            // SAFETY: see above.
            if unsafe { ring.submission().push(&sqe) }.is_err() {
                break;
            }
            next += 1;
            *in_flight += 1;
            pushed = true;
        }
        pushed
    };
    let mut ready = Vec::with_capacity(IN_FLIGHT);
    while done < n_chunks {
        push_reads(ring, &mut in_flight);
        ring.submit_and_wait(1).map_err(io)?;
        let cqes: Vec<(u64, i32)> = ring
            .completion()
            .map(|c| (c.user_data(), c.result()))
            .collect();
        ready.clear();
        for (idx, res) in cqes {
            in_flight -= 1;
            let idx = idx as usize;
            let want = CHUNK.min(dst_len - idx * CHUNK);
            if res < 0 {
                // Reap what is still in flight before reporting, so no read outlives `dst`.
                drain(ring, in_flight);
                return Err(io(std::io::Error::from_raw_os_error(-res)));
            }
            if res as usize != want {
                // A short read: finish this chunk synchronously.
                let got = res as usize;
                // SAFETY: this chunk's read completed; no request in flight touches it.
                let chunk = unsafe {
                    std::slice::from_raw_parts_mut(base.add(idx * CHUNK + got), want - got)
                };
                if let Err(e) = pread_exact(file, chunk, (idx * CHUNK + got) as u64) {
                    drain(ring, in_flight);
                    return Err(io(e));
                }
            }
            ready.push((idx, want));
        }
        // Refill the queue before the per-chunk work (the checksum), so the device stays
        // busy while it runs: on a contended CPU that work would otherwise stall the reads.
        if push_reads(ring, &mut in_flight) {
            if let Err(e) = ring.submit() {
                drain(ring, in_flight);
                return Err(io(e));
            }
        }
        for &(idx, want) in &ready {
            // SAFETY: this chunk's read completed; no request in flight touches it.
            on_chunk(idx, unsafe {
                std::slice::from_raw_parts(base.add(idx * CHUNK), want)
            });
            done += 1;
        }
    }
    Ok(())
}

/// The raw read path the direct loader is measured against: the same files read with
/// `O_DIRECT` through io_uring at the same request size ([`CHUNK`]) and queue depth
/// ([`IN_FLIGHT`]) into one reused page-aligned buffer, with nothing else (no checksum, no
/// loader thread, no views). For `loip bench loader`.
pub struct RawReader {
    ring: io_uring::IoUring,
    buf: AlignedBuf, // (largest file,) bytes
}

impl RawReader {
    /// A reader whose buffer holds the largest of `entries`.
    pub fn new(entries: &[SliceEntry]) -> Result<RawReader, RuntimeError> {
        let io = |e| RuntimeError::Io {
            path: PathBuf::from("<io_uring>"),
            source: e,
        };
        let bytes = entries.iter().map(|s| s.size as usize).max().unwrap_or(0);
        Ok(RawReader {
            ring: io_uring::IoUring::new(IN_FLIGHT as u32 * 2).map_err(io)?,
            buf: AlignedBuf::new(bytes.max(SLICE_ALIGN as usize), SLICE_ALIGN as usize)?,
        })
    }

    /// Reads slice `entry` of directory `dir` whole; returns bytes and seconds.
    pub fn read(&mut self, dir: &Path, entry: &SliceEntry) -> Result<LoadStats, RuntimeError> {
        let path = dir.join(&entry.file);
        let size = entry.size as usize;
        if size > self.buf.len() {
            return Err(RuntimeError::Invalid(format!(
                "{} does not fit the buffer",
                path.display()
            )));
        }
        let t = Instant::now();
        let file = crate::slice_file::open_slice(&path, entry, true)?;
        let dst = &mut self.buf.as_mut_slice()[..size];
        read_uring_chunks(&mut self.ring, &file, dst, &path, &mut |_, _| {})?;
        Ok(LoadStats {
            bytes: size as u64,
            load_s: t.elapsed().as_secs_f64(),
        })
    }
}

fn drain(ring: &mut io_uring::IoUring, mut in_flight: usize) {
    while in_flight > 0 {
        if ring.submit_and_wait(1).is_err() {
            return;
        }
        in_flight -= ring.completion().count();
    }
}

fn pread_exact(file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    file.read_exact_at(buf, offset)
}

fn read_pread(file: &File, dst: &mut [u8], path: &Path) -> Result<(), RuntimeError> {
    pread_exact(file, dst, 0).map_err(|e| RuntimeError::Io {
        path: path.to_path_buf(),
        source: e,
    })
}

type Owned = HashMap<String, (DType, Vec<usize>, Vec<u8>)>;

fn load_conventional(layout: &Layout) -> Result<(Owned, u64), RuntimeError> {
    let mut owned = HashMap::new();
    let mut total = 0u64;
    for (path, _, entry) in layout {
        drop_cache(path);
        let bytes = std::fs::read(path).map_err(|e| RuntimeError::Io {
            path: path.clone(),
            source: e,
        })?;
        if bytes.len() as u64 != entry.size {
            return Err(RuntimeError::Model(loip_model::ModelError::Truncated {
                path: path.clone(),
                what: format!(
                    "slice is {} bytes, manifest says {}",
                    bytes.len(),
                    entry.size
                ),
            }));
        }
        check_crc(path, entry, crc32fast::hash(&bytes))?;
        let header = parse_slice_header(path, &bytes)?;
        for t in header.tensors {
            let (o, n) = (t.offset as usize, t.nbytes as usize);
            let data = o
                .checked_add(n)
                .and_then(|end| bytes.get(o..end))
                .ok_or_else(|| {
                    RuntimeError::Invalid(format!(
                        "slice {}: tensor {} lies outside the file",
                        entry.file, t.name
                    ))
                })?
                .to_vec();
            owned.insert(t.name.clone(), (t.dtype()?, t.shape.clone(), data));
        }
        total += bytes.len() as u64;
    }
    Ok((owned, total))
}

pub use crate::slice_file::{drop_cache, drop_cached};
