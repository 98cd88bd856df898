//! Hand-computed timelines of small plans: what overlaps with what.

use loip_plan::profile::{ComputeModel, DeviceProfile, LoaderProfile, Loaders, Roofline};
use loip_plan::{
    cost, Cluster, DevicePlan, ExecMode, LinkProfile, LoaderKind, ModelShape, Pattern, Plan,
    StagePlan,
};
use loip_sim::bandwidth::BandwidthTrace;
use loip_sim::compute::DeviceModel;
use loip_sim::{shape, simulate_pipeline, KvPolicy, SimConfig, SimReport};

const SSD: f64 = 1e9; // bytes/s

fn device(name: &str) -> (String, DeviceProfile) {
    device_ssd(name, SSD)
}

fn device_ssd(name: &str, ssd: f64) -> (String, DeviceProfile) {
    let loader = LoaderProfile {
        bandwidth: ssd,
        per_read_overhead: 0.0,
    };
    let p = DeviceProfile {
        name: name.into(),
        mem_budget: 1 << 40,
        compute: ComputeModel::Roofline(Roofline {
            mem_bw: 100e9,
            peak_flops: 1e16,
            efficiency: 1.0,
            block_overhead: 0.0,
            prefill_flops: None,
        }),
        loader: Loaders {
            direct: loader,
            conventional: loader,
        },
        sources: vec![],
        memory: None,
        collective_latency: 0.0,
        load_slowdown: 0.0,
        hop_wake: 0.0,
        hop_extra: 0.0,
        switch_s: 0.0,
    };
    (name.to_string(), p)
}

#[allow(clippy::too_many_arguments)]
/// A plan of `s` stages of `n` layers per device with `(a, m)` offloaded per stage.
fn plan(
    shape: &ModelShape,
    cluster: &Cluster,
    s: u32,
    n: u32,
    a: u32,
    m: u32,
    mode: ExecMode,
    pattern: Pattern,
    b: u32,
) -> Plan {
    let nd = cluster.devices.len() as u32;
    let devices = cluster
        .devices
        .iter()
        .enumerate()
        .map(|(j, d)| DevicePlan {
            name: d.name.clone(),
            holds_embedding: j == 0,
            holds_head: j as u32 + 1 == nd,
            stages: (0..s)
                .map(|k| StagePlan::with_offload((k * nd + j as u32) * n, n, a, m))
                .collect(),
            memory_bytes: 0,
            budget_bytes: 0,
            slot_bytes: 0,
            kv_bytes: 0,
            compute_ms: 0.0,
            load_ms: 0.0,
            stall_ms: 0.0,
        })
        .collect();
    let mut p = Plan {
        shape: shape.name.clone(),
        planner: "test".into(),
        stages_per_device: s,
        pattern,
        context: 256 * b as u64,
        micro_batches: b,
        mode,
        loader: LoaderKind::Direct,
        devices,
        dropped: vec![],
        predicted_ms_per_token: 0.0,
        breakdown: Default::default(),
    };
    let c = cost::evaluate(&p, shape, cluster).unwrap();
    cost::apply(&mut p, &c);
    p
}

fn run(p: &Plan, shape: &ModelShape, cluster: &Cluster, b: u32) -> SimReport {
    let mut cfg = SimConfig::new(
        p.pattern,
        b,
        BandwidthTrace::constant(cluster.link.bandwidth),
        cluster.link.latency,
    );
    cfg.prompt_tokens = 255;
    cfg.output_tokens = 12;
    cfg.kv_policy = KvPolicy::Recompute;
    cfg.stop_when_oot = false;
    simulate_pipeline(p, shape, cluster, &cfg).unwrap()
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-6 * b.abs().max(1e-3)
}

/// One device, two stages, the last MLP block of each offloaded. The load of the next stage
/// starts when the current run ends and overlaps the next stage's retained blocks (and the
/// LM head before stage 1). Per token: `2·t_P + max(R, ld) + max(R + head, ld)`, `R` the
/// retained compute of a stage — which is also the cost model's prediction.
#[test]
fn overlapped_loads_hide_behind_retained_blocks() {
    let sh = shape("llama2-7b").unwrap();
    for (n, ssd, expect_stall) in [(16u32, 10e9, false), (16, SSD, true), (2, SSD, true)] {
        let cluster = Cluster::new(
            vec![device_ssd("d0", ssd)],
            LinkProfile {
                bandwidth: 1e9,
                latency: 0.0,
            },
        );
        let p = plan(
            &sh,
            &cluster,
            32 / n,
            n,
            0,
            1,
            ExecMode::Overlapped,
            Pattern::Sporadic,
            1,
        );
        let r = run(&p, &sh, &cluster, 1);
        let m = DeviceModel::new(&cluster.devices[0].profile, &sh);
        let (head, s) = (m.head(1), (32 / n) as f64);
        let ld = sh.mlp_bytes as f64 / ssd;
        // Steady state: attention at the context of the last steps (grows by a token a step).
        let (ta, tm) = (m.attn(1, 1, 256 + 11, 1.0), m.mlp(1, 1.0));
        let retained = n as f64 * ta + (n - 1) as f64 * tm;
        let per_token = s * tm + (s - 1.0) * retained.max(ld) + (retained + head).max(ld);
        let got = r.step_end_s[11] - r.step_end_s[10];
        assert!(
            (got - per_token).abs() < 1e-4 * per_token,
            "n = {n}: {got} vs {per_token}"
        );
        assert_eq!(ld > retained + head, expect_stall);
        // The plan is priced at context 256 (the simulator's last steps run at 266-267).
        let model = p.predicted_ms_per_token / 1e3;
        assert!(
            (model - got).abs() < 1e-3 * got,
            "n = {n}: model {model} vs {got}"
        );
    }
}

/// Conventional offloading (sequential): each offloaded block is read after the blocks before
/// it ran, then computed: nothing overlaps.
#[test]
fn sequential_loads_are_not_hidden() {
    let sh = shape("llama2-7b").unwrap();
    let cluster = Cluster::new(
        vec![device("d0")],
        LinkProfile {
            bandwidth: 1e9,
            latency: 0.0,
        },
    );
    let p = plan(
        &sh,
        &cluster,
        1,
        32,
        2,
        2,
        ExecMode::Sequential,
        Pattern::Sporadic,
        1,
    );
    let r = run(&p, &sh, &cluster, 1);
    let m = DeviceModel::new(&cluster.devices[0].profile, &sh);
    let (ta, tm) = (m.attn(1, 1, 256 + 11, 1.0), m.mlp(1, 1.0));
    let ld = 2.0 * (sh.attn_bytes + sh.mlp_bytes) as f64 / SSD;
    let expect = 32.0 * (ta + tm) + ld + m.head(1);
    let got = r.step_end_s[11] - r.step_end_s[10];
    assert!(close(got, expect), "{got} vs {expect}");
}

fn two_devices(bw: f64, lat: f64) -> Cluster {
    Cluster::new(
        vec![device("d0"), device("d1")],
        LinkProfile {
            bandwidth: bw,
            latency: lat,
        },
    )
}

/// Two devices, sporadic: a token crosses both links (activation out, the return trip back),
/// each `bytes / bw + δ`; the return trip carries `ModelShape::return_bytes_per_token`, `h`
/// by default, in the simulator as in the cost model.
#[test]
fn two_devices_pay_two_hops() {
    let sh = shape("llama2-7b").unwrap();
    let (bw, lat) = (12.5e6, 2e-3);
    let cluster = two_devices(bw, lat);
    let p = plan(
        &sh,
        &cluster,
        1,
        16,
        0,
        0,
        ExecMode::Overlapped,
        Pattern::Sporadic,
        1,
    );
    let r = run(&p, &sh, &cluster, 1);
    let m = DeviceModel::new(&cluster.devices[0].profile, &sh);
    let (ta, tm) = (m.attn(1, 1, 256 + 11, 1.0), m.mlp(1, 1.0));
    let h = sh.act_bytes_per_token as f64;
    assert_eq!(sh.return_bytes_per_token(), sh.act_bytes_per_token);
    let expect = 32.0 * (ta + tm) + m.head(1) + 2.0 * (h / bw + lat);
    let got = r.step_end_s[11] - r.step_end_s[10];
    assert!(close(got, expect), "{got} vs {expect}");
    // And the cost model, which counts the head and the same return trip.
    // (The plan is priced at context 256; the simulator's last steps run at 266-267.)
    let model = p.predicted_ms_per_token / 1e3;
    assert!((model - got).abs() < 1e-3 * got, "{model} vs {got}");
}

/// The runtime's fixed costs, as measured on a real machine: each hop wakes its receiving
/// device (`hop_wake`) and each step pays the coordinator's part (`Cluster::coordinator`).
/// The simulator adds both to a sporadic token's pass exactly as the cost model does.
#[test]
fn hop_wake_ups_and_the_coordinator_lengthen_the_pass() {
    let sh = shape("llama2-7b").unwrap();
    let (bw, lat) = (12.5e6, 2e-3);
    let plain = two_devices(bw, lat);
    let mut timed = plain.clone();
    timed.devices[0].profile.hop_wake = 3e-4;
    timed.devices[1].profile.hop_wake = 5e-4;
    timed.coordinator = 7e-4;
    let step = |c: &Cluster| {
        let p = plan(
            &sh,
            c,
            1,
            16,
            0,
            0,
            ExecMode::Overlapped,
            Pattern::Sporadic,
            1,
        );
        let r = run(&p, &sh, c, 1);
        (
            r.step_end_s[11] - r.step_end_s[10],
            p.predicted_ms_per_token / 1e3,
        )
    };
    let (base, _) = step(&plain);
    let (got, model) = step(&timed);
    let extra = 3e-4 + 5e-4 + 7e-4;
    assert!(close(got, base + extra), "{got} vs {base} + {extra}");
    assert!((model - got).abs() < 1e-3 * got, "{model} vs {got}");
}

/// The warm-up's extra per hop (`hop_extra`) lengthens a sporadic token's pass by `Σ_i x_i`
/// even when the loads bind: no load progresses in it (the run queue the loaders share), so
/// the simulator lengthens each overlapped load by the same figure
/// (`cost::round_extra`) and adds what the cost model adds, where letting the loads overlap
/// it would hide it behind the stall.
#[test]
fn hop_extras_are_not_hidden_by_the_loads() {
    let sh = shape("llama2-7b").unwrap();
    let plain = two_devices(12.5e6, 2e-3);
    let mut timed = plain.clone();
    timed.devices[0].profile.hop_extra = 3e-3;
    timed.devices[1].profile.hop_extra = 5e-3;
    let step = |c: &Cluster| {
        let p = plan(
            &sh,
            c,
            2,
            8,
            1,
            1,
            ExecMode::Overlapped,
            Pattern::Sporadic,
            1,
        );
        let r = run(&p, &sh, c, 1);
        (
            r.step_end_s[11] - r.step_end_s[10],
            p.predicted_ms_per_token / 1e3,
            p.breakdown.uncovered_load_ms,
        )
    };
    let (base, model0, stall) = step(&plain);
    assert!(stall > 0.0, "the loads bind");
    let (got, model, _) = step(&timed);
    let extra = 2.0 * (3e-3 + 5e-3); // two rounds, both devices' hops in each
    assert!(
        close(model - model0, extra),
        "{model} vs {model0} + {extra}"
    );
    assert!(close(got - base, extra), "{got} vs {base} + {extra}");
}

/// The return trip carries the shape's `return_bytes` (a 4-byte token id, the runtime's 8-byte
/// argmax, its full logits when sampling, or more): simulated ms/token grows by
/// `(r − h)/bw` per generated token in sporadic traffic, and in both patterns the simulator
/// agrees with the cost model — also when the last device's egress port, sending `b` returns
/// per round, is the bottleneck.
#[test]
fn return_trip_carries_the_shapes_return_bytes() {
    let base = shape("llama2-7b").unwrap();
    let (bw, lat) = (12.5e6, 2e-3);
    let cluster = two_devices(bw, lat);
    let h = base.act_bytes_per_token as f64;
    for pattern in [Pattern::Sporadic, Pattern::Bursty] {
        let b = if pattern == Pattern::Bursty { 2 } else { 1 };
        let step = |sh: &ModelShape| {
            let p = plan(sh, &cluster, 1, 16, 0, 0, ExecMode::Overlapped, pattern, b);
            let r = run(&p, sh, &cluster, b);
            (
                r.step_end_s[11] - r.step_end_s[10],
                p.predicted_ms_per_token / 1e3 * b as f64,
            )
        };
        let (got_h, _) = step(&base);
        for r in [4, 8, base.logits_return_bytes(), 8 << 20] {
            let sh = base.clone().with_return_bytes(r);
            let (got, model) = step(&sh);
            assert!(
                (model - got).abs() < 1e-3 * got,
                "{pattern}, r = {r}: model {model} vs simulated {got} per step"
            );
            if pattern == Pattern::Sporadic {
                let expect = got_h + (r as f64 - h) / bw;
                assert!(close(got, expect), "r = {r}: {got} vs {expect}");
            }
        }
        // 8 MiB back per token: the last device's port is busy `b·r/bw` per step, which is
        // the whole step in bursty traffic.
        let port = b as f64 * (8u64 << 20) as f64 / bw;
        let (got, _) = step(&base.clone().with_return_bytes(8 << 20));
        assert!(got >= port * (1.0 - 1e-9), "{pattern}: {got} vs {port}");
        if pattern == Pattern::Bursty {
            assert!(close(got, port), "{got} vs {port}");
        }
    }
}

/// Bursty, `b` micro-batches through one device's single slot: the slot holds a stage's
/// blocks from the first micro-batch's run to the last one's, so the next load only overlaps
/// what is left of the round — here the retained part of one micro-batch (and the head), and
/// the load is exposed. The cost model's window `P − (b−1)·C − off` gives the same.
#[test]
fn bursty_slot_is_busy_until_the_last_micro_batch() {
    let sh = shape("llama2-7b").unwrap();
    let cluster = Cluster::new(
        vec![device("d0")],
        LinkProfile {
            bandwidth: 1e9,
            latency: 0.0,
        },
    );
    let b = 4;
    let p = plan(
        &sh,
        &cluster,
        2,
        16,
        0,
        1,
        ExecMode::Overlapped,
        Pattern::Bursty,
        b,
    );
    let r = run(&p, &sh, &cluster, b);
    let m = DeviceModel::new(&cluster.devices[0].profile, &sh);
    let (ta, tm) = (m.attn(1, 1, 256 + 11, 1.0), m.mlp(1, 1.0));
    let stage = 16.0 * (ta + tm);
    let ld = sh.mlp_bytes as f64 / SSD;
    // Per step: every micro-batch runs both stages and the head; each stage switch waits for
    // its load minus the retained part of the first micro-batch that overlaps it.
    let retained = stage - tm;
    let expect = b as f64 * (2.0 * stage + m.head(1))
        + (ld - retained).max(0.0)
        + (ld - retained - m.head(1)).max(0.0);
    let got = r.step_end_s[11] - r.step_end_s[10];
    assert!(close(got, expect), "{got} vs {expect}");
    assert!(ld > retained, "the load is exposed in this setting");
    // The cost model, per generated token (priced at context 256).
    let model = p.predicted_ms_per_token / 1e3 * b as f64;
    assert!((model - got).abs() < 1e-3 * got, "model {model} vs {got}");
}

/// Conventional offloading (sequential mode) in bursty traffic: every micro-batch runs the
/// stage on its own and reads each offloaded block again into the one-block buffer, as the
/// runtime does. On one device a step is `b·(C + ld)`, the loader reads `b` times the
/// offloaded bytes per step (the same bytes per generated token for every `b`), and the cost
/// model's sequential bursty round gives the same.
#[test]
fn bursty_sequential_reads_every_block_per_micro_batch() {
    let sh = shape("llama2-7b").unwrap();
    let cluster = Cluster::new(
        vec![device("d0")],
        LinkProfile {
            bandwidth: 1e9,
            latency: 0.0,
        },
    );
    let m = DeviceModel::new(&cluster.devices[0].profile, &sh);
    let (ta, tm) = (m.attn(1, 1, 256 + 11, 1.0), m.mlp(1, 1.0));
    let off_bytes = 2 * (sh.attn_bytes + sh.mlp_bytes); // bytes
    let ld = off_bytes as f64 / SSD;
    for b in [1u32, 2, 4] {
        let pattern = if b == 1 {
            Pattern::Sporadic
        } else {
            Pattern::Bursty
        };
        let p = plan(&sh, &cluster, 1, 32, 2, 2, ExecMode::Sequential, pattern, b);
        let r = run(&p, &sh, &cluster, b);
        let bf = b as f64;
        let expect = bf * (32.0 * (ta + tm) + m.head(1) + ld);
        let got = r.step_end_s[11] - r.step_end_s[10];
        assert!(close(got, expect), "b = {b}: {got} vs {expect}");
        // Loaded bytes: `b` reads of every offloaded block per step (12 steps).
        let loaded_per_step = r.devices[0].load_s * SSD / 12.0; // bytes
        assert!(
            close(loaded_per_step, bf * off_bytes as f64),
            "b = {b}: {loaded_per_step} bytes per step"
        );
        // The cost model: per generated token, one read of each block and `C + ld`.
        let dc = &p.devices[0];
        assert!(close(dc.load_ms / 1e3, ld), "b = {b}: {}", dc.load_ms);
        let model = p.predicted_ms_per_token / 1e3 * bf;
        assert!(
            (model - got).abs() < 1e-3 * got,
            "b = {b}: model {model} vs {got}"
        );
    }
}
