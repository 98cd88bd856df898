//! `loip` is exact: on random small instances (≤ 4 devices, ≤ 10 layers, any s) its
//! prediction equals a brute-force enumeration of every allocation under the cost model
//! (design §3 with the LM head on the last device, the token's return trip of `r` bytes in
//! the round with the head, and the bursty slot window `P − (b−1)·C_i − off_i`; see
//! `loip_plan::cost`), written here independently of the
//! library, and it never exceeds a budget.

#![allow(clippy::manual_is_multiple_of)] // rust-version 1.85

mod common;

use common::{instance, Instance};
use loip_plan::{cost, PlanError, Residency};
use proptest::prelude::*;

/// Every composition of `total` into `k` parts ≥ 1.
fn compositions(total: u32, k: usize) -> Vec<Vec<u32>> {
    if k == 1 {
        return if total >= 1 {
            vec![vec![total]]
        } else {
            vec![]
        };
    }
    let mut out = Vec::new();
    for first in 1..total {
        for mut rest in compositions(total - first, k - 1) {
            rest.insert(0, first);
            out.push(rest);
        }
    }
    out
}

/// Every non-empty ordered subset of `0..d` (or just the full set).
fn subsets(d: usize, allow_drop: bool) -> Vec<Vec<usize>> {
    if !allow_drop {
        return vec![(0..d).collect()];
    }
    (1..(1u32 << d))
        .map(|m| (0..d).filter(|i| m & (1 << i) != 0).collect())
        .collect()
}

/// Design §3 `span(a, m)`.
fn span(a: u32, m: u32, ta: f64, tp: f64) -> f64 {
    let (a, m) = (a as f64, m as f64);
    if a == m {
        a * ta + m * tp
    } else if m > a {
        m * tp + a.max(m - 1.0) * ta
    } else {
        a * ta + m.max(a - 1.0) * tp
    }
}

/// One round of the cost model: `comp[j]` compute per micro-batch, `g[j]` load + span of its
/// offloaded blocks. The period without loads is one pass (`Σ comp + c`) or the busiest
/// compute unit or egress port over `b` micro-batches; device `j`'s slot is busy for
/// `(b−1)·comp[j] + span` of it and its load must fit in the rest.  // seconds
fn round(comp: &[f64], g: &[f64], b: f64, c: f64, link: f64) -> f64 {
    let pass = comp.iter().sum::<f64>() + c;
    let busiest = comp.iter().fold(link, |m, &x| m.max(x)) * b;
    let period = pass.max(busiest);
    comp.iter()
        .zip(g)
        .map(|(&x, &g)| g + (b - 1.0) * x)
        .fold(period, f64::max)
}

/// Bytes of the token's return trip: the shape's `return_bytes`, by default `h` (an activation).
fn return_bytes(sh: &loip_plan::ModelShape) -> u64 {
    sh.return_bytes.unwrap_or(sh.hidden * 4)
}

/// Brute-force optimum in ms/token, or None when nothing fits.
fn brute_force(inst: &Instance) -> Option<f64> {
    let sh = &inst.shape;
    let l = sh.layers;
    let b = inst.b_eff();
    let bf = b as f64;
    let (big_a, big_p) = (sh.attn_bytes, sh.mlp_bytes);
    let mut best: Option<f64> = None;
    for set in subsets(inst.devs.len(), inst.allow_drop) {
        let k = set.len();
        let hop = if k > 1 {
            sh.act_bytes_per_token as f64 / inst.bandwidth + inst.latency
        } else {
            0.0
        };
        let c = k as f64 * hop;
        let link = if k > 1 {
            sh.act_bytes_per_token as f64 / inst.bandwidth
        } else {
            0.0
        };
        // The round with the head: its wrap-around hop is the token's return trip of `r`
        // bytes, and the last device's egress port carries `r` instead of `h`.
        let r = return_bytes(sh) as f64;
        let (c_h, link_h) = if k > 1 {
            (
                (k - 1) as f64 * hop + r / inst.bandwidth + inst.latency,
                (sh.act_bytes_per_token as f64).max(r) / inst.bandwidth,
            )
        } else {
            (0.0, 0.0)
        };
        // LM head of the last device: a measured profile prices it as t^P · H / P.
        let last = &inst.devs[*set.last().unwrap()];
        let head_t = last.t_mlp * sh.head_bytes as f64 / sh.mlp_bytes as f64;
        for s in (1..=l).filter(|s| l % s == 0) {
            let per_stage = l / s;
            if (per_stage as usize) < k {
                continue;
            }
            'comp: for n in compositions(per_stage, k) {
                let mut comp = Vec::new();
                let mut gs = Vec::new();
                for (j, &i) in set.iter().enumerate() {
                    let d = &inst.devs[i];
                    let budget = inst.budget(d);
                    let beta = sh.layer_bytes() as f64 / d.load_per_layer;
                    let nj = n[j];
                    let (embed, head) = (j == 0, j + 1 == k);
                    let mut best_g = f64::INFINITY;
                    for a in 0..=nj {
                        for m in 0..=nj {
                            let off = a as u64 * big_a + m as u64 * big_p;
                            let retained = s as u64 * (nj as u64 * (big_a + big_p) - off);
                            let head_bytes = if !head {
                                0
                            } else if sh.tied && embed {
                                (sh.hidden as f64 * sh.weight_bytes_per_param) as u64
                            } else {
                                sh.head_bytes
                            };
                            let mem = retained
                                + off
                                + if embed { sh.embed_bytes } else { 0 }
                                + head_bytes
                                + inst.context * s as u64 * nj as u64 * sh.kv_bytes_per_token
                                + sh.working_bytes(b);
                            if mem > budget {
                                continue;
                            }
                            let ld = if a + m == 0 {
                                0.0
                            } else {
                                off as f64 / beta + d.overhead * (a + m) as f64
                            };
                            best_g = best_g.min(ld + span(a, m, d.t_attn, d.t_mlp));
                        }
                    }
                    if !best_g.is_finite() {
                        continue 'comp;
                    }
                    gs.push(best_g);
                    comp.push(nj as f64 * (d.t_attn + d.t_mlp));
                }
                // s − 1 rounds, then the last one with the head on the last device.
                let plain = round(&comp, &gs, bf, c, link);
                *comp.last_mut().unwrap() += head_t;
                let with_head = round(&comp, &gs, bf, c_h, link_h);
                let t = ((s - 1) as f64 * plain + with_head) / bf;
                if best.is_none_or(|x| t < x) {
                    best = Some(t);
                }
            }
        }
    }
    best.map(|t| t * 1e3)
}

/// Memory of every plan device, recomputed from the plan's blocks.
fn check_memory(inst: &Instance, plan: &loip_plan::Plan) {
    let sh = &inst.shape;
    for (j, d) in plan.devices.iter().enumerate() {
        let idx: usize = d.name[1..].parse().unwrap();
        let mut retained = 0u64;
        let mut slot = 0u64;
        let mut layers = 0u64;
        for st in &d.stages {
            let mut off = 0;
            for l in &st.layers {
                layers += 1;
                for (r, bytes) in [(l.attn, sh.attn_bytes), (l.mlp, sh.mlp_bytes)] {
                    if r == Residency::Offloaded {
                        off += bytes;
                    } else {
                        retained += bytes;
                    }
                }
            }
            slot = slot.max(off);
        }
        let first = j == 0;
        let last = j + 1 == plan.devices.len();
        let head = if !last {
            0
        } else if sh.tied && first {
            (sh.hidden as f64 * 2.0) as u64
        } else {
            sh.head_bytes
        };
        let mem = retained
            + slot
            + if first { sh.embed_bytes } else { 0 }
            + head
            + inst.context * layers * sh.kv_bytes_per_token
            + sh.working_bytes(inst.b_eff());
        assert_eq!(mem, d.memory_bytes, "device {}", d.name);
        assert!(
            mem <= inst.budget(&inst.devs[idx]),
            "device {} over budget",
            d.name
        );
    }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1e-9)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, .. ProptestConfig::default() })]

    #[test]
    fn loip_equals_brute_force(
        inst in instance(4, 10),
        ret in prop_oneof![Just(None), Just(Some(4u64)), (0u64..1 << 22).prop_map(Some)],
    ) {
        let mut inst = inst;
        inst.shape.return_bytes = ret;
        let cluster = inst.cluster();
        let got = loip_plan::plan("loip", &inst.shape, &cluster, &inst.request());
        let want = brute_force(&inst);
        match (&got, want) {
            (Ok(plan), Some(w)) => {
                prop_assert!(close(plan.predicted_ms_per_token, w), "loip {} vs brute force {}", plan.predicted_ms_per_token, w);
                plan.validate(&inst.shape, &cluster).unwrap();
                check_memory(&inst, plan);
                let c = cost::evaluate(plan, &inst.shape, &cluster).unwrap();
                prop_assert!(close(c.ms_per_token, plan.predicted_ms_per_token));
            }
            (Err(PlanError::DoesNotFit { lacks_bytes, .. }), None) => prop_assert!(*lacks_bytes > 0),
            (Err(PlanError::BadRequest(_)), None) => {
                prop_assert!(!inst.allow_drop && inst.shape.layers < inst.devs.len() as u32)
            }
            (g, w) => prop_assert!(false, "loip {:?} vs brute force {:?}", g.as_ref().map(|p| p.predicted_ms_per_token), w),
        }
    }
}

#[test]
fn compositions_count() {
    assert_eq!(compositions(10, 4).len(), 84);
    assert_eq!(compositions(3, 3), vec![vec![1, 1, 1]]);
    assert!(compositions(2, 3).is_empty());
}
