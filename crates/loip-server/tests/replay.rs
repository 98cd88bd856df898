//! One policy, two drivers: one request trace (arrival times, prompt and output lengths)
//! replayed through the runtime's serving loop (`loip_engine::Serving` over the tiny model,
//! a backend that records each forward, a fake clock that advances by the same step-time
//! function) and through the simulator's `simulate_serving`; the steps must be the same,
//! item for item, at the same times. Each sequence's tokens are also those of `generate`
//! alone.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;

use loip_engine::{
    generate, BatchBackend, EngineError, Flow, GenerateOptions, Generator, Model, Next, RowPick,
    SamplingParams, SeqEvent, Serving, TokenPos,
};
use loip_plan::sched::{Limits, Step};
use loip_sim::serving::{linear_step_time, simulate_serving, TraceRequest};

/// A step as (sequence, first position, tokens) per sequence, sorted.
type Shape = Vec<(u64, usize, usize)>;

/// What the recording backend saw.
#[derive(Default)]
struct Log {
    steps: Vec<Shape>,
    /// steps whose time the clock has added
    timed: usize,
    /// the fake clock  // seconds
    now: f64,
}

fn shape(batch: &[TokenPos]) -> Shape {
    let mut by: BTreeMap<u64, (usize, usize)> = BTreeMap::new();
    for t in batch {
        let e = by.entry(t.seq).or_insert((t.pos, 0));
        e.0 = e.0.min(t.pos);
        e.1 += 1;
    }
    by.into_iter().map(|(s, (p, n))| (s, p, n)).collect()
}

struct Recording<B> {
    inner: B,
    log: Rc<RefCell<Log>>,
}

impl<B: BatchBackend> BatchBackend for Recording<B> {
    fn forward_rows(
        &mut self,
        ids: &[u32],
        batch: &[TokenPos],
        rows: &[usize],
    ) -> Result<Vec<f32>, EngineError> {
        self.log.borrow_mut().steps.push(shape(batch));
        self.inner.forward_rows(ids, batch, rows)
    }
    fn forward_pick(
        &mut self,
        ids: &[u32],
        batch: &[TokenPos],
        picks: &[RowPick<'_>],
    ) -> Result<Vec<Next>, EngineError> {
        self.log.borrow_mut().steps.push(shape(batch));
        self.inner.forward_pick(ids, batch, picks)
    }
    fn release(&mut self, seq: u64) {
        self.inner.release(seq)
    }
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
}

fn tiny() -> loip_model::Checkpoint {
    let dir = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/tiny-llama"
    );
    loip_model::Checkpoint::open(std::path::Path::new(dir)).unwrap()
}

fn opts(n: usize, seed: u64, sampled: bool) -> GenerateOptions {
    let sampling = if sampled {
        SamplingParams {
            temperature: 0.8,
            top_k: 20,
            top_p: 0.9,
            seed,
        }
    } else {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed,
        }
    };
    GenerateOptions {
        max_tokens: n,
        sampling,
        eos_ids: Vec::new(),
        min_tokens: n,
    }
}

#[test]
fn a_trace_gives_the_same_steps_in_the_runtime_and_the_simulator() {
    let trace = [
        (0.0, 9, 4),
        (0.0, 3, 6),
        (0.0031, 13, 3),
        (0.0102, 5, 5),
        (0.0105, 2, 2),
        (0.05, 6, 3),
    ]
    .map(|(arrival, prompt_len, output_len)| TraceRequest {
        arrival,
        prompt_len,
        output_len,
    });
    let ckpt = tiny();
    let model = Model::from_checkpoint(&ckpt).unwrap();
    let vocab = ckpt.config.vocab_size as u32;
    let mut limits: Limits = loip_engine::one_device_limits(&model, None);
    limits.prefill_chunk = 4;
    limits.max_batch_tokens = 8;
    limits.max_seqs = 3;
    limits.max_step_seqs = 3;
    let cost = linear_step_time(0.001, 0.0002);

    // The simulator.
    let sim = simulate_serving(limits.clone(), &trace, &cost).unwrap();
    assert!(sim.refused.is_empty(), "{:?}", sim.refused);

    // The runtime, on the same clock.
    let prompts: Vec<Vec<u32>> = trace
        .iter()
        .enumerate()
        .map(|(k, r)| {
            (0..r.prompt_len)
                .map(|i| ((k * 31 + i * 7 + 1) as u32) % vocab)
                .collect()
        })
        .collect();
    let log = Rc::new(RefCell::new(Log::default()));
    let backend = Recording {
        inner: Generator::new(&model, None),
        log: log.clone(),
    };
    let mut serving = Serving::new(limits, backend).unwrap();
    let mut clock = {
        let log = log.clone();
        move || {
            let mut l = log.borrow_mut();
            // a step recorded since the last call ended: its time passed
            while l.timed < l.steps.len() {
                let tokens: usize = l.steps[l.timed].iter().map(|s| s.2).sum();
                let step = Step {
                    id: 0,
                    items: vec![loip_plan::sched::StepItem {
                        seq: 0,
                        start: 0,
                        len: tokens,
                        sample: false,
                    }],
                };
                l.now += cost(&step);
                l.timed += 1;
            }
            l.now
        }
    };
    let mut tokens: Vec<Vec<u32>> = vec![Vec::new(); trace.len()];
    let mut next = 0;
    for _ in 0..1000 {
        let now = clock();
        while next < trace.len() && trace[next].arrival <= now {
            let o = opts(trace[next].output_len, next as u64, next % 2 == 1);
            serving
                .submit(now, next as u64, &prompts[next], &o)
                .unwrap();
            next += 1;
        }
        if serving.is_idle() {
            if next == trace.len() {
                break;
            }
            log.borrow_mut().now = trace[next].arrival;
            continue;
        }
        for ev in serving.step(&mut clock).unwrap() {
            match ev {
                SeqEvent::Token { seq, id } => tokens[seq as usize].push(id),
                SeqEvent::Failed { error, .. } => panic!("{error}"),
                _ => {}
            }
        }
    }
    assert_eq!(next, trace.len());
    assert!(serving.is_idle());

    let log = log.borrow();
    let sim_steps: Vec<Shape> = sim
        .steps
        .iter()
        .map(|s| {
            let mut v: Shape = s.items.iter().map(|i| (i.seq, i.start, i.len)).collect();
            v.sort();
            v
        })
        .collect();
    assert_eq!(log.steps.len(), sim_steps.len());
    for (k, (got, want)) in log.steps.iter().zip(&sim_steps).enumerate() {
        assert_eq!(got, want, "step {k}");
    }
    assert!((log.now - sim.steps.last().unwrap().end).abs() < 1e-9);
    // chunked prefill and joins at step boundaries happened
    assert!(log.steps.iter().any(|s| s.len() >= 3));

    // Each sequence's tokens are those of generate alone.
    for (k, r) in trace.iter().enumerate() {
        let mut gen = Generator::new(&model, None);
        let o = opts(r.output_len, k as u64, k % 2 == 1);
        let alone = generate(&mut gen, 1, &prompts[k], &o, &mut |_| Flow::Continue).unwrap();
        assert_eq!(tokens[k], alone.new_ids, "sequence {k}");
    }
}
