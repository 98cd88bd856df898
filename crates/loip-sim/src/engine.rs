//! The discrete-event core: a virtual clock, a graph of tasks and the resources they run on.
//!
//! A task is a piece of work (compute seconds, bytes over a link, a collective) with
//! dependencies on other tasks and at most one resource (a device's compute unit, its SSD
//! loader, its network egress port). Events are task completions and resource releases, kept
//! in a heap ordered by (time, insertion number), so a run is deterministic.
//!
//! Invariants:
//! - **Program order.** Every resource serves its *ordered* tasks strictly in the order they
//!   were added: the first one waits until it is ready even if a later one is. With program
//!   order every start time is a max-plus function of the durations, so making any task
//!   shorter (more bandwidth, a faster device) never makes anything finish later.
//! - **Background tasks** (KV lending transfers) are the exception: they use a resource only
//!   while its next ordered task is not ready, and an ordered task that becomes ready
//!   preempts them (the transfer pauses and resumes with its remaining bytes).
//! - A transfer holds its sender's egress for `bytes / bandwidth` and completes one link
//!   latency later; its rate is the bandwidth in force when it (re)starts.
//! - Time never goes backwards; a task never starts before all its dependencies completed.

use crate::error::SimError;
use std::cmp::{Ordering, Reverse};
use std::collections::{BinaryHeap, VecDeque};

/// Index of a task.
pub type TaskId = u32;

/// Index of a resource.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ResId(pub u32);

/// What a task does.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Work {
    /// A fixed duration.  // seconds
    Secs(f64),
    /// Bytes sent on the resource (an egress port), then one link latency.  // bytes
    Transfer(f64),
    /// A collective over all ports (no resource): `bytes` serialised on its busiest port plus
    /// `hops` link latencies.  // bytes, count
    Collective {
        /// Bytes on the busiest port.  // bytes
        bytes: f64,
        /// Sequential message hops, each paying the link latency.
        hops: f64,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Waiting,
    Ready,
    Running,
    Done,
}

#[derive(Debug, Clone)]
struct Task {
    res: Option<ResId>,
    background: bool,
    work: Work,
    /// Remaining seconds (Secs) or bytes (Transfer).
    remaining: f64,
    deps: u32,
    first_edge: u32,
    state: State,
    started: bool,
    ready_at: f64,
    start: f64,
    end: f64,
    /// Current run segment: start time and rate (bytes/s) for transfers.
    seg_start: f64,
    seg_rate: f64,
    version: u32,
}

const NO_EDGE: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct Edge {
    to: TaskId,
    next: u32,
}

#[derive(Debug, Default)]
struct Resource {
    running: Option<TaskId>,
    ordered: VecDeque<TaskId>,
    background: BinaryHeap<Reverse<TaskId>>,
    busy_s: f64,
    bytes: f64,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum EvKind {
    /// The task's resource is released (transfers: bytes sent; others: work done).
    Release,
    /// The task completes (dependents may start).
    Done,
}

#[derive(Debug, Clone, Copy)]
struct Event {
    time: f64,
    seq: u64,
    task: TaskId,
    version: u32,
    kind: EvKind,
}

impl PartialEq for Event {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Event {}
impl PartialOrd for Event {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Event {
    fn cmp(&self, o: &Self) -> Ordering {
        // Min-heap by (time, seq) through Reverse at the call site.
        self.time.total_cmp(&o.time).then(self.seq.cmp(&o.seq))
    }
}

/// The simulator state: clock, tasks, resources, pending events.
#[derive(Debug)]
pub struct Engine {
    now: f64,
    tasks: Vec<Task>,
    edges: Vec<Edge>,
    resources: Vec<Resource>,
    events: BinaryHeap<Reverse<Event>>,
    seq: u64,
    bandwidth: f64, // bytes/s
    latency: f64,   // seconds
}

impl Engine {
    /// A new engine with link `bandwidth` (bytes/s) and `latency` (seconds).
    pub fn new(bandwidth: f64, latency: f64) -> Engine {
        Engine {
            now: 0.0,
            tasks: Vec::new(),
            edges: Vec::new(),
            resources: Vec::new(),
            events: BinaryHeap::new(),
            seq: 0,
            bandwidth,
            latency,
        }
    }

    /// Adds a resource (compute unit, loader or egress port).
    pub fn resource(&mut self) -> ResId {
        self.resources.push(Resource::default());
        ResId(self.resources.len() as u32 - 1)
    }

    /// The current virtual time.  // seconds
    pub fn now(&self) -> f64 {
        self.now
    }

    /// The link bandwidth in force.  // bytes/s
    pub fn bandwidth(&self) -> f64 {
        self.bandwidth
    }

    /// Changes the link bandwidth from now on (running transfers keep their rate).  // bytes/s
    pub fn set_bandwidth(&mut self, bandwidth: f64) {
        self.bandwidth = bandwidth;
    }

    /// Total busy time of a resource so far.  // seconds
    pub fn busy(&self, r: ResId) -> f64 {
        self.resources[r.0 as usize].busy_s
    }

    /// Bytes a resource has sent so far (transfers only).  // bytes
    pub fn bytes(&self, r: ResId) -> f64 {
        self.resources[r.0 as usize].bytes
    }

    /// Completion time of a finished task, `None` while it runs or waits.  // seconds
    pub fn end(&self, t: TaskId) -> Option<f64> {
        let task = &self.tasks[t as usize];
        (task.state == State::Done).then_some(task.end)
    }

    /// First start time of a task that has started.  // seconds
    pub fn start(&self, t: TaskId) -> Option<f64> {
        let task = &self.tasks[t as usize];
        matches!(task.state, State::Running | State::Done).then_some(task.start)
    }

    /// Adds an ordered task on `res` (or none) after `deps`. Tasks on one resource run in the
    /// order they are added.
    pub fn task(&mut self, res: Option<ResId>, work: Work, deps: &[TaskId]) -> TaskId {
        self.add(res, work, deps, false)
    }

    /// Adds a background task on `res`: it runs only while the resource's next ordered task is
    /// not ready and is preempted by it.
    pub fn background(&mut self, res: ResId, work: Work, deps: &[TaskId]) -> TaskId {
        self.add(Some(res), work, deps, true)
    }

    fn add(&mut self, res: Option<ResId>, work: Work, deps: &[TaskId], background: bool) -> TaskId {
        let id = self.tasks.len() as TaskId;
        let remaining = match work {
            Work::Secs(s) => s.max(0.0),
            Work::Transfer(b) => b.max(0.0),
            Work::Collective { .. } => 0.0,
        };
        self.tasks.push(Task {
            res,
            background,
            work,
            remaining,
            deps: 0,
            first_edge: NO_EDGE,
            state: State::Waiting,
            started: false,
            ready_at: self.now,
            start: 0.0,
            end: 0.0,
            seg_start: 0.0,
            seg_rate: 0.0,
            version: 0,
        });
        let mut pending = 0;
        for &d in deps {
            let dep = &self.tasks[d as usize];
            if dep.state == State::Done {
                let e = dep.end;
                let t = &mut self.tasks[id as usize];
                t.ready_at = t.ready_at.max(e);
            } else {
                pending += 1;
                self.edges.push(Edge {
                    to: id,
                    next: self.tasks[d as usize].first_edge,
                });
                self.tasks[d as usize].first_edge = self.edges.len() as u32 - 1;
            }
        }
        self.tasks[id as usize].deps = pending;
        if let Some(r) = res {
            let rs = &mut self.resources[r.0 as usize];
            if background {
                rs.background.push(Reverse(id));
            } else {
                rs.ordered.push_back(id);
            }
        }
        if pending == 0 {
            self.make_ready(id);
        }
        id
    }

    fn push(&mut self, time: f64, task: TaskId, kind: EvKind) {
        self.seq += 1;
        let version = self.tasks[task as usize].version;
        self.events.push(Reverse(Event {
            time,
            seq: self.seq,
            task,
            version,
            kind,
        }));
    }

    fn make_ready(&mut self, id: TaskId) {
        let t = &mut self.tasks[id as usize];
        t.state = State::Ready;
        let at = t.ready_at.max(self.now);
        match t.res {
            None => {
                t.state = State::Running;
                t.started = true;
                t.start = at;
                let dur = match t.work {
                    Work::Secs(s) => s,
                    Work::Transfer(b) => b / self.bandwidth + self.latency,
                    Work::Collective { bytes, hops } => {
                        bytes / self.bandwidth + hops * self.latency
                    }
                };
                self.push(at + dur.max(0.0), id, EvKind::Done);
            }
            // Dependencies finish at or before `now`, so a task with a resource is ready now.
            Some(r) => self.dispatch(r),
        }
    }

    /// Starts work on an idle resource, or preempts a background task for a ready ordered one.
    fn dispatch(&mut self, r: ResId) {
        let ri = r.0 as usize;
        let front_ready = self.resources[ri]
            .ordered
            .front()
            .is_some_and(|&f| self.tasks[f as usize].state == State::Ready);
        if let Some(run) = self.resources[ri].running {
            if front_ready && self.tasks[run as usize].background {
                self.preempt(run);
            } else {
                return;
            }
        }
        let next = if front_ready {
            self.resources[ri].ordered.pop_front()
        } else {
            // Lowest-id ready background task.
            let mut skipped = Vec::new();
            let mut found = None;
            while let Some(Reverse(b)) = self.resources[ri].background.pop() {
                if self.tasks[b as usize].state == State::Ready {
                    found = Some(b);
                    break;
                }
                skipped.push(b);
            }
            for b in skipped {
                self.resources[ri].background.push(Reverse(b));
            }
            found
        };
        if let Some(id) = next {
            self.begin(r, id);
        }
    }

    fn begin(&mut self, r: ResId, id: TaskId) {
        let now = self.now;
        let bw = self.bandwidth;
        let t = &mut self.tasks[id as usize];
        if !t.started {
            t.started = true;
            t.start = now;
        }
        t.state = State::Running;
        t.seg_start = now;
        let dur = match t.work {
            Work::Transfer(_) => {
                t.seg_rate = bw;
                t.remaining / bw
            }
            _ => {
                t.seg_rate = 1.0;
                t.remaining
            }
        };
        self.resources[r.0 as usize].running = Some(id);
        self.push(now + dur.max(0.0), id, EvKind::Release);
    }

    fn preempt(&mut self, id: TaskId) {
        let now = self.now;
        let t = &mut self.tasks[id as usize];
        let done = (now - t.seg_start) * t.seg_rate;
        t.remaining = (t.remaining - done).max(0.0);
        t.version += 1;
        t.state = State::Ready;
        let r = t.res.map(|r| r.0 as usize).unwrap_or(0);
        let rs = &mut self.resources[r];
        rs.busy_s += now - t.seg_start;
        if matches!(t.work, Work::Transfer(_)) {
            rs.bytes += done;
        }
        rs.running = None;
        rs.background.push(Reverse(id));
    }

    fn complete(&mut self, id: TaskId) {
        let now = self.now;
        let t = &mut self.tasks[id as usize];
        t.state = State::Done;
        t.end = now;
        let mut e = t.first_edge;
        while e != NO_EDGE {
            let Edge { to, next } = self.edges[e as usize];
            let succ = &mut self.tasks[to as usize];
            succ.deps -= 1;
            succ.ready_at = succ.ready_at.max(now);
            if succ.deps == 0 {
                self.make_ready(to);
            }
            e = next;
        }
    }

    /// Processes events until task `target` has completed; returns its completion time.
    pub fn run_until(&mut self, target: TaskId) -> Result<f64, SimError> {
        while self.tasks[target as usize].state != State::Done {
            let Some(Reverse(ev)) = self.events.pop() else {
                return Err(SimError::Deadlock { time_s: self.now });
            };
            let t = &self.tasks[ev.task as usize];
            if ev.version != t.version {
                continue;
            }
            self.now = self.now.max(ev.time);
            match ev.kind {
                EvKind::Done => self.complete(ev.task),
                EvKind::Release => {
                    let Some(r) = self.tasks[ev.task as usize].res else {
                        continue;
                    };
                    let now = self.now;
                    let t = &mut self.tasks[ev.task as usize];
                    let seg = now - t.seg_start;
                    let sent = if matches!(t.work, Work::Transfer(_)) {
                        t.remaining
                    } else {
                        0.0
                    };
                    t.remaining = 0.0;
                    let is_transfer = matches!(t.work, Work::Transfer(_));
                    let rs = &mut self.resources[r.0 as usize];
                    rs.busy_s += seg;
                    rs.bytes += sent;
                    rs.running = None;
                    if is_transfer {
                        let lat = self.latency;
                        self.push(now + lat, ev.task, EvKind::Done);
                    } else {
                        self.complete(ev.task);
                    }
                    self.dispatch(r);
                }
            }
        }
        Ok(self.tasks[target as usize].end)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_and_program_order() {
        let mut e = Engine::new(1e6, 0.001);
        let cpu = e.resource();
        let a = e.task(Some(cpu), Work::Secs(1.0), &[]);
        let b = e.task(Some(cpu), Work::Secs(2.0), &[]);
        let end = e.task(None, Work::Secs(0.0), &[a, b]);
        assert_eq!(e.run_until(end).unwrap(), 3.0);
        assert_eq!(e.start(b), Some(1.0));
    }

    #[test]
    fn ordered_waits_for_front() {
        // The second ordered task is ready at 0 but the first one only at 5: it waits.
        let mut e = Engine::new(1e6, 0.0);
        let cpu = e.resource();
        let other = e.resource();
        let gate = e.task(Some(other), Work::Secs(5.0), &[]);
        let first = e.task(Some(cpu), Work::Secs(1.0), &[gate]);
        let second = e.task(Some(cpu), Work::Secs(1.0), &[]);
        assert_eq!(e.run_until(second).unwrap(), 7.0);
        assert_eq!(e.end(first), Some(6.0));
    }

    #[test]
    fn transfer_latency_and_preemption() {
        let mut e = Engine::new(1000.0, 0.5); // 1000 B/s, 0.5 s latency
        let port = e.resource();
        let cpu = e.resource();
        let bg = e.background(port, Work::Transfer(4000.0), &[]); // 4 s of sending
        let gate = e.task(Some(cpu), Work::Secs(1.0), &[]);
        let fg = e.task(Some(port), Work::Transfer(1000.0), &[gate]); // preempts at t = 1
        assert_eq!(e.run_until(fg).unwrap(), 2.5);
        // Background: 1 s sent before, 3 s after the foreground (t = 2 .. 5), +0.5 latency.
        assert!((e.run_until(bg).unwrap() - 5.5).abs() < 1e-9);
        assert!((e.bytes(port) - 5000.0).abs() < 1e-6);
    }

    #[test]
    fn collective_uses_bandwidth_at_start() {
        let mut e = Engine::new(100.0, 0.01);
        let c = e.task(
            None,
            Work::Collective {
                bytes: 100.0,
                hops: 2.0,
            },
            &[],
        );
        assert!((e.run_until(c).unwrap() - 1.02).abs() < 1e-12);
    }
}
