//! The step scheduler on a virtual clock: staggered arrivals, chunked prefill, cancellation,
//! micro-batches, FIFO admission without starvation, and limits that are never exceeded.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use loip_plan::sched::{
    Action, EndReason, KvDevice, Limits, Outcome, RejectReason, Request, Scheduler, SeqId,
    SeqResult, Step, Time,
};
use proptest::prelude::*;

const BPT: u64 = 1_000; // KV bytes per token

fn limits() -> Limits {
    Limits {
        max_batch_tokens: 64,
        max_step_seqs: 4,
        max_seqs: 4,
        prefill_chunk: 32,
        max_in_flight: 1,
        max_queue: 100,
        max_seq_len: Some(4096),
        devices: vec![KvDevice {
            budget: 400 * BPT,
            bytes_per_token: BPT,
        }],
    }
}

fn req(seq: SeqId, prompt_len: usize, max_new_tokens: usize) -> Request {
    Request {
        seq,
        prompt_len,
        max_new_tokens,
    }
}

/// What a virtual-clock run saw.
#[derive(Default, Debug)]
struct Trace {
    steps: Vec<(Time, Step)>, // when each step was started
    released: BTreeMap<SeqId, (Time, EndReason, usize)>,
    first_token: BTreeMap<SeqId, Time>,
    admitted_order: Vec<SeqId>, // sequences in the order of their first step
}

/// Drives `sched` with arrivals `(time, request)`; every step takes `dt` seconds and the
/// oldest step in flight finishes first. A sequence in `stop_at` reports `Stop` at that many
/// sampled tokens. Checks the invariants after every poll. Bounded by `max_steps`.
fn drive(
    sched: &mut Scheduler,
    mut arrivals: Vec<(Time, Request)>,
    stop_at: &BTreeMap<SeqId, usize>,
    dt: f64,
    max_steps: usize,
) -> Trace {
    arrivals.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut arrivals: VecDeque<_> = arrivals.into();
    let mut trace = Trace::default();
    let mut in_flight: VecDeque<Step> = VecDeque::new();
    let mut sampled: BTreeMap<SeqId, usize> = BTreeMap::new();
    let mut now = 0.0;
    for _ in 0..max_steps {
        while arrivals.front().is_some_and(|a| a.0 <= now) {
            let (_, r) = arrivals.pop_front().unwrap();
            sched.submit(now, r).unwrap();
        }
        for a in sched.poll(now) {
            match a {
                Action::Run(step) => {
                    for i in &step.items {
                        if !trace.admitted_order.contains(&i.seq) {
                            trace.admitted_order.push(i.seq);
                        }
                    }
                    trace.steps.push((now, step.clone()));
                    in_flight.push_back(step);
                }
                Action::Release {
                    seq,
                    reason,
                    generated,
                } => {
                    assert!(trace
                        .released
                        .insert(seq, (now, reason, generated))
                        .is_none());
                }
            }
        }
        check_invariants(sched, &in_flight);
        match in_flight.pop_front() {
            Some(step) => {
                now += dt;
                let mut results = Vec::new();
                for i in step.items.iter().filter(|i| i.sample) {
                    let n = sampled.entry(i.seq).or_default();
                    *n += 1;
                    trace.first_token.entry(i.seq).or_insert(now);
                    let outcome = if stop_at.get(&i.seq) == Some(n) {
                        Outcome::Stop
                    } else {
                        Outcome::Continue
                    };
                    results.push(SeqResult {
                        seq: i.seq,
                        outcome,
                    });
                }
                sched.on_step_done(now, step.id, &results).unwrap();
            }
            None => match arrivals.front() {
                Some(a) => now = a.0,
                None if sched.is_idle() => {
                    for a in sched.poll(now) {
                        if let Action::Release {
                            seq,
                            reason,
                            generated,
                        } = a
                        {
                            trace.released.insert(seq, (now, reason, generated));
                        }
                    }
                    return trace;
                }
                None => panic!("not idle, nothing in flight and nothing to come"),
            },
        }
    }
    panic!("not done within {max_steps} steps");
}

fn check_invariants(sched: &Scheduler, in_flight: &VecDeque<Step>) {
    let l = sched.limits();
    let stats = sched.stats();
    assert!(stats.running <= l.max_seqs);
    assert!(stats.in_flight <= l.max_in_flight);
    assert_eq!(stats.in_flight, in_flight.len());
    for kv in &stats.kv {
        assert!(kv.used <= kv.reserved && kv.reserved <= kv.budget, "{kv:?}");
    }
    let mut busy = BTreeSet::new();
    for s in in_flight {
        assert!(s.tokens() <= l.max_batch_tokens);
        assert!(s.items.len() <= l.max_step_seqs);
        for i in &s.items {
            assert!(i.len >= 1 && i.len <= l.max_batch_tokens);
            assert!(busy.insert(i.seq), "seq {} in two steps in flight", i.seq);
        }
    }
}

#[test]
fn staggered_arrivals_join_at_step_boundaries_and_finish() {
    let mut s = Scheduler::new(limits()).unwrap();
    let arrivals = vec![
        (0.0, req(1, 10, 5)),
        (0.25, req(2, 3, 8)),
        (1.5, req(3, 40, 2)),
        (3.5, req(4, 1, 1)),
    ];
    let t = drive(&mut s, arrivals, &BTreeMap::new(), 1.0, 1000);
    for (seq, n) in [(1, 5), (2, 8), (3, 2), (4, 1)] {
        assert_eq!(t.released[&seq].1, EndReason::Length);
        assert_eq!(t.released[&seq].2, n);
    }
    // Sequence 2 arrived during step 1 and joined step 2, while 1 decodes.
    let (_, step2) = &t.steps[1];
    let seqs: Vec<_> = step2
        .items
        .iter()
        .map(|i| (i.seq, i.len, i.sample))
        .collect();
    assert_eq!(seqs, vec![(1, 1, true), (2, 3, true)]);
    // Positions are contiguous per sequence: each step starts where the last one ended.
    let mut fed: BTreeMap<SeqId, usize> = BTreeMap::new();
    for (_, step) in &t.steps {
        for i in &step.items {
            let f = fed.entry(i.seq).or_default();
            assert_eq!(i.start, *f);
            *f += i.len;
        }
    }
    // Prompt 40 with 2 new tokens feeds 41 positions; 10 + 5 feeds 14.
    assert_eq!(fed[&3], 41);
    assert_eq!(fed[&1], 14);
    assert_eq!(fed[&4], 1);
    assert!(s.stats().kv.iter().all(|k| k.used == 0 && k.reserved == 0));
}

#[test]
fn chunked_prefill_stays_within_its_bounds_and_never_stalls_decode() {
    let mut l = limits();
    l.max_batch_tokens = 48;
    l.prefill_chunk = 20;
    l.devices[0].budget = 1000 * BPT;
    let mut s = Scheduler::new(l).unwrap();
    let arrivals = vec![
        (0.0, req(1, 2, 30)),
        (2.0, req(2, 300, 2)),
        (2.0, req(3, 100, 2)),
    ];
    let t = drive(&mut s, arrivals, &BTreeMap::new(), 1.0, 1000);
    for (_, step) in &t.steps {
        for i in &step.items {
            assert!(i.len <= 20, "a chunk of {} tokens", i.len);
        }
        assert!(step.tokens() <= 48);
    }
    // Sequence 1 decodes in every step from its first token until it is done.
    let first = t.first_token[&1];
    let end = t.released[&1].0;
    for (at, step) in &t.steps {
        if *at >= first && *at < end {
            assert!(
                step.items.iter().any(|i| i.seq == 1 && i.len == 1),
                "{step:?}"
            );
        }
    }
    // Both long prompts progress side by side: 20 + 20 + decode 1 ≤ 48.
    let both = t
        .steps
        .iter()
        .filter(|(_, s)| s.items.iter().filter(|i| i.len == 20).count() == 2)
        .count();
    assert!(both >= 4, "{both}");
}

#[test]
fn a_short_request_behind_a_2000_token_prompt_gets_its_first_token_within_2_steps() {
    let mut l = limits();
    l.max_batch_tokens = 512;
    l.prefill_chunk = 256;
    l.devices[0].budget = 10_000 * BPT;
    let mut s = Scheduler::new(l).unwrap();
    let arrivals = vec![(0.0, req(1, 2000, 4)), (0.5, req(2, 12, 4))];
    let t = drive(&mut s, arrivals, &BTreeMap::new(), 1.0, 1000);
    let ttft = t.first_token[&2] - 0.5;
    assert!(ttft < 2.0, "TTFT {ttft} steps");
    // The long prompt took 8 chunks of 256, not one step.
    assert!(t.first_token[&1] >= 8.0);
}

#[test]
fn cancellation_mid_batch_frees_kv_at_once() {
    let mut s = Scheduler::new(limits()).unwrap();
    s.submit(0.0, req(1, 10, 50)).unwrap();
    s.submit(0.0, req(2, 10, 50)).unwrap();
    let Action::Run(step) = s.poll(0.0).remove(0) else {
        panic!("no step")
    };
    assert_eq!(step.items.len(), 2);
    let before = s.stats().kv[0].reserved;
    assert_eq!(before, 2 * 59 * BPT);
    // Cancelled while its step is in flight: the reservation is free now.
    assert!(s.cancel(0.5, 2));
    assert_eq!(s.stats().kv[0].reserved, 59 * BPT);
    assert!(!s.cancel(0.5, 2));
    let results = [
        SeqResult {
            seq: 1,
            outcome: Outcome::Continue,
        },
        SeqResult {
            seq: 2,
            outcome: Outcome::Continue,
        },
    ];
    s.on_step_done(1.0, step.id, &results).unwrap();
    let actions = s.poll(1.0);
    assert_eq!(
        actions[0],
        Action::Release {
            seq: 2,
            reason: EndReason::Cancelled,
            generated: 0
        }
    );
    let Action::Run(next) = &actions[1] else {
        panic!("{actions:?}")
    };
    assert_eq!(next.items.len(), 1);
    assert_eq!(next.items[0].seq, 1);
    assert_eq!(s.stats().kv[0].used, 10 * BPT);
    // A queued request cancelled never runs.
    s.submit(1.0, req(3, 5, 5)).unwrap();
    assert!(s.cancel(1.0, 3));
    assert!(matches!(
        s.on_step_done(2.0, next.id + 7, &[]),
        Err(loip_plan::sched::SchedError::UnknownStep(_))
    ));
}

#[test]
fn requests_that_can_never_fit_are_refused_with_a_reason() {
    let mut s = Scheduler::new(limits()).unwrap();
    assert_eq!(s.submit(0.0, req(1, 0, 5)), Err(RejectReason::EmptyPrompt));
    assert_eq!(s.submit(0.0, req(1, 5, 0)), Err(RejectReason::NoNewTokens));
    assert_eq!(
        s.submit(0.0, req(1, 300, 200)),
        Err(RejectReason::NeverFits { tokens: 499 })
    );
    assert!(matches!(
        s.submit(0.0, req(1, 5000, 1)),
        Err(RejectReason::TooLong { .. })
    ));
    s.submit(0.0, req(1, 5, 5)).unwrap();
    assert_eq!(s.submit(0.0, req(1, 5, 5)), Err(RejectReason::Duplicate(1)));
    assert!(Scheduler::new(Limits {
        max_batch_tokens: 0,
        ..limits()
    })
    .is_err());
}

#[test]
fn micro_batches_are_disjoint_and_bounded_in_flight() {
    let mut l = limits();
    l.max_in_flight = 3;
    l.max_step_seqs = 2;
    l.max_seqs = 6;
    let mut s = Scheduler::new(l).unwrap();
    for seq in 0..6 {
        s.submit(0.0, req(seq, 4, 3)).unwrap();
    }
    let actions = s.poll(0.0);
    let steps: Vec<&Step> = actions
        .iter()
        .filter_map(|a| match a {
            Action::Run(s) => Some(s),
            _ => None,
        })
        .collect();
    assert_eq!(steps.len(), 3);
    let groups: Vec<Vec<SeqId>> = steps
        .iter()
        .map(|s| s.items.iter().map(|i| i.seq).collect())
        .collect();
    assert_eq!(groups, vec![vec![0, 1], vec![2, 3], vec![4, 5]]);
    assert!(
        s.poll(0.0).is_empty(),
        "a fourth step would exceed max_in_flight"
    );
    // And a whole run through the driver keeps every invariant.
    let mut s = Scheduler::new(s.limits().clone()).unwrap();
    let arrivals = (0..6)
        .map(|i| (i as f64 * 0.3, req(i, 5 + i as usize, 6)))
        .collect();
    let t = drive(&mut s, arrivals, &BTreeMap::new(), 1.0, 1000);
    assert_eq!(t.released.len(), 6);
}

fn arb_requests() -> impl Strategy<Value = Vec<(f64, usize, usize, Option<usize>)>> {
    prop::collection::vec(
        (
            0.0..20.0f64,
            1usize..120,
            1usize..40,
            prop::option::of(1usize..40),
        ),
        1..24,
    )
}

fn arb_limits() -> impl Strategy<Value = Limits> {
    (
        1usize..80,
        1usize..6,
        1usize..8,
        1usize..40,
        1usize..4,
        160u64..600,
    )
        .prop_map(
            |(tokens, step_seqs, seqs, chunk, in_flight, budget)| Limits {
                max_batch_tokens: tokens,
                max_step_seqs: step_seqs,
                max_seqs: seqs,
                prefill_chunk: chunk,
                max_in_flight: in_flight,
                max_queue: 1000,
                max_seq_len: None,
                devices: vec![
                    KvDevice {
                        budget: budget * BPT,
                        bytes_per_token: BPT,
                    },
                    KvDevice {
                        budget: budget * 3 * BPT,
                        bytes_per_token: 2 * BPT,
                    },
                ],
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    /// Every request ends (nothing starves), with the right count, and sequences are first
    /// served in the order they were submitted (FIFO). `drive` checks the limits after
    /// every poll.
    #[test]
    fn fifo_no_starvation_and_limits_hold(reqs in arb_requests(), l in arb_limits()) {
        let mut s = Scheduler::new(l).unwrap();
        let mut arrivals = Vec::new();
        let mut stop_at = BTreeMap::new();
        for (i, &(t, p, n, stop)) in reqs.iter().enumerate() {
            let r = req(i as u64, p, n);
            arrivals.push((t, r));
            if let Some(k) = stop {
                stop_at.insert(i as u64, k);
            }
        }
        // Ties in arrival time keep submission order (stable sort in drive).
        let mut order: Vec<(f64, u64)> = arrivals.iter().map(|(t, r)| (*t, r.seq)).collect();
        order.sort_by(|a, b| a.0.total_cmp(&b.0));
        let t = drive(&mut s, arrivals, &stop_at, 1.0, 100_000);
        for (i, &(_, _, n, stop)) in reqs.iter().enumerate() {
            let (_, reason, generated) = t.released[&(i as u64)];
            match stop {
                Some(k) if k <= n => {
                    prop_assert_eq!(reason, EndReason::Stopped);
                    prop_assert_eq!(generated, k - 1);
                }
                _ => {
                    prop_assert_eq!(reason, EndReason::Length);
                    prop_assert_eq!(generated, n);
                }
            }
        }
        let submitted: Vec<u64> = order.into_iter().map(|(_, s)| s).collect();
        prop_assert_eq!(t.admitted_order, submitted);
        prop_assert!(s.stats().kv.iter().all(|k| k.used == 0 && k.reserved == 0));
    }
}
