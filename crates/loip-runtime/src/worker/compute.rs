//! The worker's compute thread: the jobs a session hands it (probe, load, steps, plan
//! switches, KV lending), run one at a time on the device, with memory pressure checked
//! between steps.

use super::*;

pub(super) enum Job {
    Probe(Box<Manifest>, bool, bool),
    Load(Box<Manifest>, Box<DeviceSpec>),
    Step {
        header: StepHeader,
        data: Vec<u8>,
        arrived: Instant,
        /// direct forwarding: the hop and where its output goes
        route: Option<peer::HopRoute>,
    },
    Release(Vec<u64>),
    /// a ping answered from this thread after a round trip through the compute pool
    /// (`ToWorker::Echo`)
    Echo(u64),
    Switch(Vec<crate::executor::StageSpec>),
    /// KV lending: rows per stage and the borrower's peer index (lender); reserve for a
    /// lender and the peer its rows come from (borrower)
    Lend(u64, Option<u16>),
    Borrow(u16, u64, Option<u16>),
}

/// What the compute thread works with.
pub(super) struct ComputeCtx {
    pub(super) out: mpsc::Sender<Out>,
    pub(super) outbox: ByteBudget,
    pub(super) rt: tokio::runtime::Handle,
    pub(super) dir: PathBuf,
    pub(super) budget: u64,
    pub(super) frame_limit: Arc<AtomicUsize>,
    pub(super) direct: Arc<peer::Direct>,
    pub(super) refuse_switches: u32,
}

impl ComputeCtx {
    /// Queues a frame for the writer, waiting for output-budget bytes; false when the session
    /// is gone.
    pub(super) fn send_frame(&self, kind: FrameKind, payload: Vec<u8>) -> bool {
        let permit = self.outbox.blocking_acquire(payload.len(), &self.rt);
        self.out
            .blocking_send((kind, payload, Some(permit)))
            .is_ok()
    }

    pub(super) fn send(&self, msg: ToCoordinator) -> bool {
        match wire::control_payload(&msg) {
            Ok(p) => self.send_frame(FrameKind::Control, p),
            Err(_) => false,
        }
    }

    pub(super) fn fail(&self, step: Option<u64>, message: String) -> bool {
        let message = scrub_path(&message, &self.dir);
        self.send(ToCoordinator::Failed { step, message })
    }
}

/// The largest step frame a device can use: its most tokens of hidden rows plus headers.
pub(super) fn step_frame_limit(spec: &DeviceSpec, hidden: usize) -> usize {
    let rows = spec
        .max_step_tokens
        .saturating_mul(hidden)
        .saturating_mul(4);
    let header = spec.max_step_tokens.saturating_mul(32) + (1 << 20);
    rows.saturating_add(header)
        .clamp(BASE_FRAME, wire::MAX_FRAME)
}

pub(super) fn compute_thread(
    jobs: std::sync::mpsc::Receiver<(Job, BytePermit)>,
    ctx: ComputeCtx,
    mut lender: lend::Lender,
) {
    let mut device: Option<Device> = None;
    let mut refusals = ctx.refuse_switches;
    let mut guard = crate::executor::PressureGuard::new();
    while let Ok((job, permit)) = jobs.recv() {
        if let (Job::Step { .. }, Some(d)) = (&job, device.as_mut()) {
            guard.check(d); // between steps: sheds blocks under memory pressure
        }
        let ok = match job {
            Job::Probe(m, compute, loads) => {
                let budget = crate::net::probe::ProbeBudget { bytes: ctx.budget };
                match crate::net::probe::probe(&ctx.dir, &m, compute, loads, budget) {
                    Ok(r) => ctx.send(ToCoordinator::Probed(r)),
                    Err(e) => ctx.fail(None, format!("probe failed: {e}")),
                }
            }
            Job::Load(m, spec) => {
                device = None; // free the old device's memory first
                ctx.frame_limit.store(BASE_FRAME, Ordering::Relaxed);
                let mut spec = *spec;
                // The worker's own budget is the truth, whatever the plan assumed.
                spec.mem_budget = Some(ctx.budget);
                let limit = step_frame_limit(&spec, m.config.hidden_size);
                match Device::open(&ctx.dir, &m, spec) {
                    Ok(mut d) => {
                        // a speculating sequence may rewind this many positions
                        d.kv.widen_windows(loip_engine::speculate::MAX_REWIND);
                        let memory = d.memory().into();
                        device = Some(d);
                        // what starting read of the code and did not map stays charged
                        crate::memory::drop_unmapped_code();
                        ctx.frame_limit.store(limit, Ordering::Relaxed);
                        ctx.send(ToCoordinator::Loaded { memory })
                    }
                    Err(e) => ctx.fail(None, format!("cannot open the device: {e}")),
                }
            }
            Job::Switch(stages) => {
                let refuse = refusals > 0;
                refusals = refusals.saturating_sub(1);
                ctx.send(crate::adapt::apply_switch(device.as_mut(), stages, refuse))
            }
            Job::Echo(id) => {
                // a hop's hand-off to the compute pool, answered from there as a hop's output
                // is (`run_hop`), doing nothing there
                loip_kernels::on_pool(|| ctx.send(ToCoordinator::Pong { id }))
            }
            Job::Lend(tokens, via) => {
                lender.set(tokens, via);
                true
            }
            Job::Borrow(l, bytes, via) => {
                let held = &ctx.direct.held;
                ctx.send(lend::borrow(held, device.as_mut(), l, bytes, via))
            }
            Job::Release(seqs) => {
                if let Some(d) = device.as_mut() {
                    for s in seqs {
                        d.kv.remove(s);
                    }
                }
                true
            }
            Job::Step {
                header,
                data,
                arrived,
                route,
            } => {
                let queued_s = arrived.elapsed().as_secs_f64();
                let marks = crate::hop_trace::on().then(|| crate::hop_trace::Marks::new(arrived));
                let hop = Hop {
                    header,
                    data,
                    arrived,
                    route,
                    queued_s,
                };
                // The whole hop on the compute pool, its output handed on from there: one
                // hand-off in a hop, however many stages and whether it ends with the head
                // (each runs inline on the step's team), and the way back to this thread
                // after the output is on its way.
                let (d, lender, ctx) = (&mut device, &mut lender, &ctx);
                loip_kernels::on_pool(move || run_hop(d, hop, permit, lender, ctx, marks))
            }
        };
        if !ok {
            return;
        }
    }
}

/// A step's hop as the compute thread takes it.
struct Hop {
    header: StepHeader,
    data: Vec<u8>,
    arrived: Instant,
    route: Option<peer::HopRoute>,
    queued_s: f64,
}

/// Runs a hop and hands its output to the coordinator's writer (or the next peer); false
/// when the session is gone.
fn run_hop(
    device: &mut Option<Device>,
    hop: Hop,
    permit: BytePermit,
    lender: &mut lend::Lender,
    ctx: &ComputeCtx,
    mut marks: Option<crate::hop_trace::Marks>,
) -> bool {
    let Hop {
        header,
        data,
        arrived,
        route,
        queued_s,
    } = hop;
    if let Some(m) = marks.as_mut() {
        m.pooled = Some(Instant::now());
    }
    let result = match device.as_mut() {
        Some(d) => run_step(d, &header, &data, lender, ctx, marks.as_mut()),
        None => Err(RuntimeError::Invalid("no device is loaded".into())),
    };
    drop(data);
    if let Some(m) = marks.as_mut() {
        m.ran = Some(Instant::now());
    }
    let (kind, cols, rows_out, bytes) = match result {
        Ok(r) => r,
        Err(e) => {
            if let Some(d) = device.as_mut() {
                let _ = d.take_times();
            }
            return ctx.fail(Some(header.step), e.to_string());
        }
    };
    let t = device.as_mut().map(|d| d.take_times()).unwrap_or_default();
    let trace = marks.map(|m| {
        let mut inside = device.as_mut().map(|d| d.take_trace()).unwrap_or_default();
        inside.compute_s = t.compute_s;
        inside.stall_s = t.stall_s;
        inside.load_s = t.load_s;
        inside.loaded_bytes = t.loaded_bytes;
        (header.step, m, inside)
    });
    let times = JobTimes {
        queued_s,
        compute_s: t.compute_s,
        stall_s: t.stall_s,
        total_s: arrived.elapsed().as_secs_f64(),
        loaded_bytes: t.loaded_bytes,
    };
    let sent = if let Some((r, to)) = route.and_then(|r| Some((r, r.to?))) {
        drop(permit);
        ctx.direct.hand_on(ctx, header.step, r, to, bytes, times)
    } else {
        let h = OutputHeader {
            step: header.step,
            kind,
            rows: rows_out,
            cols,
            times,
        };
        let payload = wire::encode_output(&h, &bytes);
        drop(bytes);
        drop(permit); // the input is done with before the output waits
        ctx.send_frame(FrameKind::Output, payload)
    };
    if let Some((step, m, inside)) = trace {
        crate::hop_trace::print(step, &m, &inside, Instant::now());
    }
    sent
}

/// Runs one step on the device: embed, stages, head. Returns (what the rows hold, values per
/// row, rows, bytes). On error, rolls this device's KV of the step's sequences back to where
/// the step began.
fn run_step(
    d: &mut Device,
    h: &StepHeader,
    data: &[u8],
    lend: &mut lend::Lender,
    ctx: &ComputeCtx,
    mut marks: Option<&mut crate::hop_trace::Marks>,
) -> Result<(OutputKind, u32, u32, Vec<u8>), RuntimeError> {
    let bad = |m: String| RuntimeError::Invalid(m);
    let (hidden, max_pos) = (d.tf.cfg.hidden_size, d.tf.cfg.max_position_embeddings);
    let n = h.batch.len();
    if n == 0 {
        return Err(bad("a step without tokens".into()));
    }
    // Every buffer a step allocates was accounted for these limits when the device opened.
    let (max_tokens, max_rows) = (d.spec().max_step_tokens, d.spec().max_step_seqs.max(1));
    if n > max_tokens {
        return Err(bad(format!(
            "a step of {n} tokens; this device was opened for at most {max_tokens}"
        )));
    }
    if h.head && h.argmax.is_none() && h.rows.len() > max_rows {
        // Logits beyond the accounted rows must fit in what the KV cache leaves free (an
        // argmax step computes them `max_rows` rows at a time).
        let extra = (h.rows.len() - max_rows) as u64 * d.tf.cfg.vocab_size as u64 * 4;
        let free = d.memory().kv_budget.saturating_sub(d.kv.used_bytes());
        let unlimited = d.memory().budget == 0;
        if !unlimited && extra > free {
            return Err(bad(format!(
                "{} rows of logits need {extra} bytes beyond the {max_rows} row(s) this device \
                 was opened for, and its budget has {free} bytes free",
                h.rows.len()
            )));
        }
    }
    if let Some(&r) = h.rows.iter().find(|&&r| r as usize >= n) {
        return Err(bad(format!("row {r} of a step of {n} tokens")));
    }
    if let Some(t) = h.batch.iter().find(|t| t.pos >= max_pos) {
        return Err(bad(format!(
            "position {} is beyond the model's {max_pos} positions",
            t.pos
        )));
    }
    if let Some(&k) = h.stages.iter().find(|&&k| k as usize >= d.stages()) {
        return Err(bad(format!(
            "stage {k} of a device with {} stages",
            d.stages()
        )));
    }
    let mut x = if h.embed {
        let ids = wire::bytes_u32(data).map_err(|e| bad(e.to_string()))?;
        if ids.len() != n {
            return Err(bad(format!("{} ids for {n} tokens", ids.len())));
        }
        d.embed(&ids)?
    } else {
        if data.len() != n * hidden * 4 {
            return Err(bad(format!(
                "{} bytes of hidden state for {n} tokens of {hidden} floats",
                data.len()
            )));
        }
        wire::bytes_f32(data).map_err(|e| bad(e.to_string()))?
    };
    // Where each sequence of the step starts, for a rollback.
    let mut starts: Vec<TokenPos> = Vec::new();
    for t in &h.batch {
        match starts.iter_mut().find(|s| s.seq == t.seq) {
            Some(s) => s.pos = s.pos.min(t.pos),
            None => starts.push(*t),
        }
    }
    // Speculative decoding: the listed sequences drop their positions from the step's first
    // on (rejected drafts), each stage's layers before the stage runs, once its lent rows
    // are back (the cut may fall among them: every row but a sequence's newest may be out).
    // Per stage, not per hop: a device's later hop of this step keeps what its earlier hop
    // wrote.
    let rewind: Vec<TokenPos> = starts
        .iter()
        .filter(|s| h.rewind.contains(&s.seq))
        .copied()
        .collect();
    if h.stages.first() == Some(&0) {
        // A sequence starting over at position 0 drops what it had cached.
        for s in starts.iter().filter(|s| s.pos == 0) {
            d.kv.remove(s.seq);
        }
        // the rejected rows not lent out go before the step's KV is reserved
        for k in 0..d.stages() {
            rewind_stage(d, k, &rewind);
        }
        // a lend grown since the last step frees its room before the reservation counts it
        lend.top_up(d, ctx, 0)?;
        d.reserve(n)?;
    }
    let last = h.stages.len().saturating_sub(1);
    let mut run = |d: &mut Device, x: &mut Vec<f32>| -> Result<(), RuntimeError> {
        for (i, &k) in h.stages.iter().enumerate() {
            lend.before_stage(d, ctx, k as usize)?;
            rewind_stage(d, k as usize, &rewind);
            if h.keep && i == last {
                d.run_stage_keep(k as usize, x, &h.batch)?;
            } else {
                d.run_stage(k as usize, x, &h.batch)?;
            }
            lend.after_stage(d, ctx, k as usize)?;
        }
        Ok(())
    };
    if let Some(m) = marks.as_deref_mut() {
        m.stages = Some(Instant::now());
    }
    if let Err(e) = run(d, &mut x) {
        for s in &starts {
            d.kv.truncate(s.seq, s.pos);
        }
        return Err(e);
    }
    if let Some(m) = marks {
        m.stages_done = Some(Instant::now());
    }
    if h.head {
        let rows: Vec<usize> = h.rows.iter().map(|&r| r as usize).collect();
        let vocab = d.tf.cfg.vocab_size;
        let Some(masked) = &h.argmax else {
            let logits = d.head(&x, &rows)?;
            let bytes = wire::f32_bytes(&logits);
            return Ok((OutputKind::Logits, vocab as u32, rows.len() as u32, bytes));
        };
        if !h.row_masks.is_empty() && h.row_masks.len() != rows.len() {
            return Err(bad(format!(
                "{} per-row masks for {} rows",
                h.row_masks.len(),
                rows.len()
            )));
        }
        // the coordinator's greedy sampler, here: mask (the common list, then the row's
        // own), then the same argmax; the logits of at most the rows the device was opened
        // for at a time (a speculative verify step has more)
        let mut picks: Vec<(u32, f32)> = Vec::with_capacity(rows.len());
        for chunk in rows.chunks(max_rows) {
            let mut logits = d.head(&x, chunk)?;
            for row in logits.chunks_exact_mut(vocab.max(1)) {
                loip_engine::sampling::mask(row, masked);
                if let Some(own) = h.row_masks.get(picks.len()) {
                    loip_engine::sampling::mask(row, own);
                }
                let id = loip_engine::sampling::argmax(row);
                picks.push((id, row[id as usize]));
            }
        }
        let bytes = wire::argmax_bytes(&picks);
        return Ok((OutputKind::Argmax, 2, rows.len() as u32, bytes));
    }
    Ok((
        OutputKind::Hidden,
        hidden as u32,
        n as u32,
        wire::f32_bytes(&x),
    ))
}

/// Drops the positions of each `rewind` sequence from its start on at stage `k`'s layers,
/// except at a layer with rows lent out (they come back before the stage runs, and the cut
/// is made then). Only ever frees memory: a cut below what a sliding layer holds leaves it
/// short, and the read that needs the missing rows is then a typed error, never a different
/// answer.
fn rewind_stage(d: &mut Device, k: usize, rewind: &[TokenPos]) {
    if rewind.is_empty() {
        return;
    }
    let Some(stage) = d.spec().stages.get(k) else {
        return;
    };
    let layers: Vec<usize> = stage.layers.iter().map(|l| l.layer).collect();
    for s in rewind {
        for &l in &layers {
            if d.kv.lent(s.seq, l) == 0 {
                d.kv.truncate_layer(s.seq, l, s.pos);
            }
        }
    }
}
