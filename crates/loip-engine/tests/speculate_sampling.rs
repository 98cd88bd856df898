//! Sampled requests under speculation keep the target's distribution: a draft model that
//! samples (its drafts verified by the speculative sampling rule) gives first tokens whose
//! law is that of sampling without speculation.
//!
//! A chi-square test on tiny-llama: the first three tokens of many seeded runs (a fixed seed
//! set, so the test is deterministic) against their exact law, computed from the model's
//! logits and the sampler's own distribution; and against plain sampling's counts (a
//! two-sample test; the speculative runs use other seeds, so the samples are independent).
//! The same seed gives the same tokens. The threshold is the chi-square quantile at a false-alarm rate of 1e-6.
//! A negative control checks the test can tell: sampling the draft's own law fails it.

use std::collections::BTreeMap;
use std::path::PathBuf;

use loip_engine::generate::{generate, Flow, StepBackend};
use loip_engine::speculate::draft::ModelDrafter;
use loip_engine::speculate::{generate_speculative, SpecOptions, SpecStats};
use loip_engine::{GenerateOptions, Generator, Model, Sampler, SamplingParams};
use loip_model::Checkpoint;

/// Runs per method; tokens per run looked at.
const RUNS: u64 = 3000;
const LOOK: usize = 3;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn params(seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 1.0,
        top_k: 6,
        top_p: 1.0,
        seed,
    }
}

fn opts(seed: u64) -> GenerateOptions {
    GenerateOptions {
        max_tokens: LOOK + 1,
        sampling: params(seed),
        eos_ids: vec![],
        min_tokens: 0,
    }
}

const PROMPT: [u32; 8] = [1, 17, 42, 99, 3, 250, 7, 8];

type Law = BTreeMap<Vec<u32>, f64>;
type Counts = BTreeMap<Vec<u32>, f64>;

/// The exact law of the first `LOOK` tokens under `p` (sampling params) on `model`.
fn exact_law(model: &Model<'_>, p: &SamplingParams) -> Law {
    let sampler = Sampler::new(p.clone()).unwrap();
    let mut law = Law::new();
    let mut frontier = vec![(Vec::<u32>::new(), 1.0f64)];
    while let Some((prefix, mass)) = frontier.pop() {
        if prefix.len() == LOOK {
            law.insert(prefix, mass);
            continue;
        }
        let mut ctx = PROMPT.to_vec();
        ctx.extend(&prefix);
        let logits = Generator::new(model, None).step(7, &ctx, 0).unwrap();
        let d = sampler.distribution(&logits);
        for (&id, &q) in d.ids.iter().zip(&d.probs) {
            let mut next = prefix.clone();
            next.push(id);
            frontier.push((next, mass * q));
        }
    }
    law
}

fn count(runs: impl Iterator<Item = Vec<u32>>) -> Counts {
    let mut c = Counts::new();
    for ids in runs {
        *c.entry(ids[..LOOK].to_vec()).or_insert(0.0) += 1.0;
    }
    c
}

/// The chi-square quantile at a false-alarm rate of 1e-6 (Wilson–Hilferty).
fn critical(df: usize) -> f64 {
    let z = 4.7534; // the standard normal's 1 − 1e-6 quantile
    let d = df as f64;
    let h = 2.0 / (9.0 * d);
    d * (1.0 - h + z * h.sqrt()).powi(3)
}

/// Cells of the law with an expected count of at least 5 on their own, the rest pooled.
fn cells(law: &Law, n: f64) -> Vec<Vec<Vec<u32>>> {
    let mut out: Vec<Vec<Vec<u32>>> = Vec::new();
    let mut pool = Vec::new();
    for (k, &p) in law {
        if p * n >= 5.0 {
            out.push(vec![k.clone()]);
        } else {
            pool.push(k.clone());
        }
    }
    out.push(pool);
    out
}

/// Pearson's statistic of `counts` against `law`, and its degrees of freedom.
fn goodness_of_fit(counts: &Counts, law: &Law) -> (f64, usize) {
    let n: f64 = counts.values().sum();
    let mut stat = 0.0;
    let cs = cells(law, n);
    for cell in &cs {
        let e: f64 = cell.iter().map(|k| law[k]).sum::<f64>() * n;
        let o: f64 = cell
            .iter()
            .map(|k| counts.get(k).copied().unwrap_or(0.0))
            .sum();
        if e > 0.0 {
            stat += (o - e) * (o - e) / e;
        }
    }
    // a sequence outside the law's support is a failure on its own
    let outside: f64 = counts
        .iter()
        .filter(|(k, _)| !law.contains_key(*k))
        .map(|(_, v)| v)
        .sum();
    assert_eq!(outside, 0.0, "sequences the sampler cannot draw");
    (stat, cs.len() - 1)
}

/// The two-sample (homogeneity) statistic of `a` against `b`, over the cells of `law`.
fn two_sample(a: &Counts, b: &Counts, law: &Law) -> (f64, usize) {
    let (na, nb): (f64, f64) = (a.values().sum(), b.values().sum());
    let mut stat = 0.0;
    let cs = cells(law, na.min(nb));
    for cell in &cs {
        let get =
            |c: &Counts| -> f64 { cell.iter().map(|k| c.get(k).copied().unwrap_or(0.0)).sum() };
        let (oa, ob) = (get(a), get(b));
        let tot = oa + ob;
        if tot > 0.0 {
            let (ea, eb) = (tot * na / (na + nb), tot * nb / (na + nb));
            stat += (oa - ea).powi(2) / ea + (ob - eb).powi(2) / eb;
        }
    }
    (stat, cs.len() - 1)
}

fn plain(model: &Model<'_>, seed: u64, sampling: SamplingParams) -> Vec<u32> {
    let o = GenerateOptions {
        sampling,
        ..opts(seed)
    };
    let mut g = Generator::new(model, None);
    generate(&mut g, 7, &PROMPT, &o, &mut |_| Flow::Continue)
        .unwrap()
        .new_ids
}

/// Speculative runs with `draft` sampling under `draft_params(seed)`; their stats summed.
fn speculative(
    target: &Model<'_>,
    draft: &Model<'_>,
    draft_params: impl Fn(u64) -> SamplingParams,
) -> (Counts, SpecStats) {
    let mut total = SpecStats::default();
    let spec = SpecOptions {
        k_max: 3,
        adaptive: false,
        ..Default::default()
    };
    let run = |seed: u64| {
        let mut gen = Generator::new(target, None);
        let mut d = ModelDrafter::new(Generator::new(draft, None), 7)
            .sampling(&draft_params(seed))
            .unwrap();
        generate_speculative(
            &mut gen,
            7,
            &PROMPT,
            &opts(seed),
            &mut d,
            &spec,
            &mut |_| Flow::Continue,
        )
        .unwrap()
    };
    // seeds other than plain sampling's, so that the two samples are independent
    let counts = count((RUNS..2 * RUNS).map(|seed| {
        let out = run(seed);
        total.drafted += out.stats.drafted;
        total.accepted += out.stats.accepted;
        out.out.new_ids
    }));
    // deterministic under a seed: the same seed, the same tokens
    for seed in [3, 11] {
        assert_eq!(run(seed).out.new_ids, run(seed).out.new_ids, "seed {seed}");
    }
    (counts, total)
}

#[test]
fn a_sampling_draft_keeps_the_targets_law() {
    let open = |n: &str| Checkpoint::open(&fixture(n)).unwrap();
    let (target_ck, other_ck) = (open("tiny-llama"), open("tiny-llama-bf16-tied"));
    let target = Model::from_checkpoint(&target_ck).unwrap();
    let other = Model::from_checkpoint(&other_ck).unwrap();
    let law = exact_law(&target, &params(0));
    let total: f64 = law.values().sum();
    assert!((total - 1.0).abs() < 1e-9, "{total}");

    // without speculation: the test's calibration (the sampler draws from this very law)
    let base = count((0..RUNS).map(|s| plain(&target, s, params(s))));
    let (stat, df) = goodness_of_fit(&base, &law);
    eprintln!("plain sampling: chi-square {stat:.1} (df {df})");
    assert!(
        stat < critical(df),
        "plain sampling: {stat} ≥ {} (df {df})",
        critical(df)
    );

    // the draft's own law (a hotter sampler of the target, on the same support) is far from
    // it: the test has power where a wrong rule would leave the draft's bias
    let hot = |seed| SamplingParams {
        temperature: 2.0,
        ..params(seed)
    };
    let biased = count((0..RUNS).map(|s| plain(&target, s, hot(s))));
    let (stat, df) = goodness_of_fit(&biased, &law);
    eprintln!("negative control: chi-square {stat:.1} (df {df})");
    assert!(
        stat > critical(df),
        "negative control passed: {stat} (df {df})"
    );

    // drafts drawn from a distorted law of the target itself, and from another model
    type DraftParams<'f> = &'f dyn Fn(u64) -> SamplingParams;
    let drafts: [(&str, &Model<'_>, DraftParams); 2] = [
        ("hot self", &target, &hot),
        ("other model", &other, &params),
    ];
    for (name, draft, dp) in drafts {
        let (counts, stats) = speculative(&target, draft, dp);
        let (stat, df) = goodness_of_fit(&counts, &law);
        eprintln!(
            "{name}: chi-square {stat:.1} (df {df}, critical {:.1}), acceptance {:.2} of {}",
            critical(df),
            stats.acceptance(),
            stats.drafted
        );
        assert!(
            stat < critical(df),
            "{name}: {stat} ≥ {} (df {df})",
            critical(df)
        );
        let (stat, df) = two_sample(&counts, &base, &law);
        eprintln!("{name} against plain sampling: chi-square {stat:.1} (df {df})");
        assert!(
            stat < critical(df),
            "{name} vs plain: {stat} ≥ {} (df {df})",
            critical(df)
        );
        // the rule was exercised both ways
        assert!(
            stats.accepted > 0 && stats.accepted < stats.drafted,
            "{name}: {stats:?}"
        );
    }
}
