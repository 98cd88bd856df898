//! The step scheduler with speculating sequences (issue 31), on a virtual clock: a decode
//! item carries the drafts the driver has ready, within the step's token limit and never past
//! the sequence's last wanted token; the KV ledger caches only the kept positions, stays
//! within each sequence's worst-case reservation, and the sequence ends at exactly
//! `max_new_tokens`.

use loip_plan::sched::{
    Action, EndReason, KvDevice, Limits, Outcome, Request, Scheduler, SeqResult,
};

const BPT: u64 = 1_000; // KV bytes per token

fn limits(max_batch_tokens: usize) -> Limits {
    Limits {
        max_batch_tokens,
        max_step_seqs: 4,
        max_seqs: 4,
        prefill_chunk: 8,
        max_in_flight: 1,
        max_queue: 10,
        max_seq_len: Some(4096),
        devices: vec![KvDevice {
            budget: 200 * BPT,
            bytes_per_token: BPT,
        }],
    }
}

/// Each step's items `(seq, start, len)`.
type Items = Vec<Vec<(u64, usize, usize)>>;
/// Each release `(seq, reason, tokens generated)`.
type Releases = Vec<(u64, EndReason, usize)>;

/// Runs two sequences (seq 1 speculates with `drafts` ready before every step and keeps
/// `keep(len)` tokens of a decode item of `len` positions; seq 2 is plain) to their end.
/// Returns each step's items `(seq, start, len)` and the releases.
fn run(max_batch_tokens: usize, drafts: usize, keep: impl Fn(usize) -> usize) -> (Items, Releases) {
    let mut s = Scheduler::new(limits(max_batch_tokens)).unwrap();
    let (p1, n1, p2, n2) = (10, 20, 6, 9);
    for (seq, prompt_len, max_new_tokens) in [(1, p1, n1), (2, p2, n2)] {
        let r = Request {
            seq,
            prompt_len,
            max_new_tokens,
        };
        s.submit(0.0, r).unwrap();
    }
    let mut steps = Vec::new();
    let mut released = Vec::new();
    let mut t = 0.0;
    for _ in 0..200 {
        t += 1.0;
        s.set_drafts(1, drafts);
        let mut ran = false;
        for a in s.poll(t) {
            match a {
                Action::Release {
                    seq,
                    reason,
                    generated,
                } => released.push((seq, reason, generated)),
                Action::Run(step) => {
                    ran = true;
                    assert!(step.tokens() <= max_batch_tokens, "{step:?}");
                    let mut results = Vec::new();
                    for i in &step.items {
                        if i.seq == 2 || i.len == 1 || i.start < p1 {
                            // plain decode, or a prompt chunk
                            assert!(i.seq == 1 || i.start < p2 || i.len == 1, "{i:?}");
                            results.push(SeqResult {
                                seq: i.seq,
                                outcome: Outcome::Continue,
                            });
                            continue;
                        }
                        // a speculative decode item: never past the last wanted token, so
                        // every position written is inside the worst-case reservation
                        assert!(i.start + i.len < p1 + n1, "{i:?}");
                        let kept = keep(i.len).clamp(1, i.len);
                        results.push(SeqResult {
                            seq: i.seq,
                            outcome: if kept == 1 {
                                Outcome::Continue
                            } else {
                                Outcome::Kept(kept)
                            },
                        });
                    }
                    let items = step.items.iter().map(|i| (i.seq, i.start, i.len)).collect();
                    steps.push(items);
                    s.on_step_done(t, step.id, &results).unwrap();
                    let kv = &s.stats().kv[0];
                    assert!(kv.used <= kv.reserved && kv.reserved <= kv.budget, "{kv:?}");
                }
            }
        }
        released.extend(s.poll_releases().into_iter().filter_map(|a| match a {
            Action::Release {
                seq,
                reason,
                generated,
            } => Some((seq, reason, generated)),
            _ => None,
        }));
        if !ran && s.is_idle() {
            return (steps, released);
        }
    }
    panic!("not idle after 200 rounds");
}

#[test]
fn drafts_ride_in_the_decode_item_and_only_kept_positions_are_cached() {
    // all drafts kept: seq 1 needs far fewer steps than its 20 tokens
    let (steps, released) = run(64, 4, |len| len);
    assert!(
        released.contains(&(1, EndReason::Length, 20)),
        "{released:?}"
    );
    assert!(
        released.contains(&(2, EndReason::Length, 9)),
        "{released:?}"
    );
    let decode_steps = steps
        .iter()
        .filter(|s| s.iter().any(|&(q, start, _)| q == 1 && start >= 10))
        .count();
    assert!(decode_steps <= 5, "{decode_steps} decode steps: {steps:?}");
    // each decode item starts where the last one's kept positions end (all kept here)
    let items: Vec<(usize, usize)> = steps
        .iter()
        .flat_map(|s| {
            s.iter()
                .filter(|i| i.0 == 1 && i.1 >= 10)
                .map(|i| (i.1, i.2))
        })
        .collect();
    assert!(items.iter().any(|i| i.1 == 5), "{items:?}");
    assert!(
        items.windows(2).all(|w| w[1].0 == w[0].0 + w[0].1),
        "{items:?}"
    );

    // every draft rejected: one token per step, the positions cached are the kept ones
    let (steps, released) = run(64, 4, |_| 1);
    assert!(
        released.contains(&(1, EndReason::Length, 20)),
        "{released:?}"
    );
    let starts: Vec<usize> = steps
        .iter()
        .flat_map(|s| s.iter().filter(|i| i.0 == 1 && i.1 >= 10).map(|i| i.1))
        .collect();
    assert_eq!(starts, (10..29).collect::<Vec<_>>());

    // a tight step limit: the drafts only take spare tokens (1 each for the two sequences
    // first), so the step never exceeds it
    let (_, released) = run(3, 8, |len| len / 2);
    assert!(
        released.contains(&(1, EndReason::Length, 20)),
        "{released:?}"
    );
}
