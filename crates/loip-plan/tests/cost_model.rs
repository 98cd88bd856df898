//! Hand-computed prices of small plans: the token's return trip and conventional
//! (sequential) offloading under bursty traffic.

mod common;

use common::llama13b;
use loip_plan::cost::{self, block_times};
use loip_plan::profile::LoaderProfile;
use loip_plan::{
    Cluster, DevicePlan, DeviceProfile, ExecMode, LinkProfile, LoaderKind, ModelShape, Pattern,
    Plan, StagePlan,
};

const BW: f64 = 12.5e6; // bytes/s
const LAT: f64 = 2e-3; // seconds
const CTX: u64 = 512;

fn cluster(shape: &ModelShape, nd: usize, ssd: f64) -> Cluster {
    let loader = LoaderProfile {
        bandwidth: ssd,
        per_read_overhead: 1e-4,
    };
    let devices = (0..nd)
        .map(|i| {
            let p = DeviceProfile::from_measurements(
                format!("hw{i}"),
                1 << 40,
                shape,
                vec![(1, 1, 2e-3 * (i + 1) as f64)],
                vec![(1, 3e-3 * (i + 1) as f64)],
                loader,
                loader,
            )
            .unwrap();
            (format!("d{i}"), p)
        })
        .collect();
    Cluster::new(
        devices,
        LinkProfile {
            bandwidth: BW,
            latency: LAT,
        },
    )
}

/// One stage per device: `alloc[j] = (layers, whole layers offloaded)`.
fn plan(
    shape: &ModelShape,
    cluster: &Cluster,
    alloc: &[(u32, u32)],
    mode: ExecMode,
    pattern: Pattern,
    b: u32,
) -> Plan {
    let nd = alloc.len();
    let mut first = 0;
    let devices = alloc
        .iter()
        .enumerate()
        .map(|(j, &(n, off))| {
            let st = StagePlan::with_offload(first, n, off, off);
            first += n;
            DevicePlan {
                name: cluster.devices[j].name.clone(),
                holds_embedding: j == 0,
                holds_head: j + 1 == nd,
                stages: vec![st],
                memory_bytes: 0,
                budget_bytes: 0,
                slot_bytes: 0,
                kv_bytes: 0,
                compute_ms: 0.0,
                load_ms: 0.0,
                stall_ms: 0.0,
            }
        })
        .collect();
    let mut p = Plan {
        shape: shape.name.clone(),
        planner: "test".into(),
        stages_per_device: 1,
        pattern,
        context: CTX,
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

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1e-9)
}

/// Per-device `(C_i, ld_i)` of a one-stage plan, the head on the last device.  // seconds
fn parts(p: &Plan, shape: &ModelShape, cluster: &Cluster) -> Vec<(f64, f64)> {
    let nd = p.devices.len();
    p.devices
        .iter()
        .enumerate()
        .map(|(j, d)| {
            let t = block_times(
                cluster.device(&d.name).unwrap(),
                shape,
                p.context,
                p.micro_batches,
                p.loader,
            );
            let st = &d.stages[0];
            let (n, a, m) = st.counts();
            let head = if j + 1 == nd { t.head } else { 0.0 };
            (
                n as f64 * (t.attn + t.mlp) + head,
                t.loader.load_time(st.offloaded_bytes(shape), a + m),
            )
        })
        .collect()
}

/// Sporadic, two devices, one stage each: one activation out, the return trip back, each
/// `bytes/bw + δ`; the return trip carries `r` bytes ([`ModelShape::return_bytes`]).
#[test]
fn return_trip_is_priced_at_its_own_bytes() {
    let base = llama13b();
    let h = base.act_bytes_per_token as f64;
    assert_eq!(base.return_bytes_per_token(), base.act_bytes_per_token);
    for r in [None, Some(4), Some(base.logits_return_bytes())] {
        let mut sh = base.clone();
        sh.return_bytes = r;
        let cl = cluster(&sh, 2, 1e9);
        let p = plan(
            &sh,
            &cl,
            &[(20, 0), (20, 0)],
            ExecMode::Overlapped,
            Pattern::Sporadic,
            1,
        );
        let rb = r.unwrap_or(base.act_bytes_per_token) as f64;
        let comm = (h / BW + LAT) + (rb / BW + LAT);
        let compute: f64 = parts(&p, &sh, &cl).iter().map(|x| x.0).sum();
        assert!(close(p.breakdown.comm_ms, comm * 1e3), "{r:?}");
        assert!(close(p.breakdown.compute_ms, compute * 1e3), "{r:?}");
        assert!(close(p.predicted_ms_per_token, (compute + comm) * 1e3));
        assert!(close(p.breakdown.total_ms(), p.predicted_ms_per_token));
        // Sequential mode pays the same hops.
        let q = plan(
            &sh,
            &cl,
            &[(20, 0), (20, 0)],
            ExecMode::Sequential,
            Pattern::Sporadic,
            1,
        );
        assert!(close(q.breakdown.comm_ms, comm * 1e3), "{r:?}");
    }
}

/// On one device there is no return trip, whatever it would carry.
#[test]
fn one_device_has_no_return_trip() {
    let sh = llama13b().with_return_bytes(1 << 30);
    let cl = cluster(&sh, 1, 1e9);
    for mode in [ExecMode::Overlapped, ExecMode::Sequential] {
        for (pattern, b) in [(Pattern::Sporadic, 1), (Pattern::Bursty, 3)] {
            let p = plan(&sh, &cl, &[(40, 0)], mode, pattern, b);
            assert_eq!(p.breakdown.comm_ms, 0.0);
        }
    }
}

/// With interleaved stages only the last round's wrap-around hop is the return trip; the
/// others carry an activation.
#[test]
fn only_the_last_round_returns_the_token() {
    let sh = llama13b();
    let r = sh.logits_return_bytes();
    let cl = cluster(&sh, 2, 1e9);
    // Two stages of 10 layers per device, nothing offloaded.
    let mut p = plan(
        &sh,
        &cl,
        &[(10, 0), (10, 0)],
        ExecMode::Overlapped,
        Pattern::Sporadic,
        1,
    );
    for (j, d) in p.devices.iter_mut().enumerate() {
        d.stages = (0..2u32)
            .map(|k| StagePlan::with_offload((2 * k + j as u32) * 10, 10, 0, 0))
            .collect();
    }
    p.stages_per_device = 2;
    p.reprice(&sh, &cl).unwrap();
    p.validate(&sh, &cl).unwrap();
    let s = p.stages_per_device as f64;
    let mut q = p.clone();
    let shr = sh.clone().with_return_bytes(r);
    q.reprice(&shr, &cl).unwrap();
    let h = sh.act_bytes_per_token as f64;
    // No loads here, so comm is every hop of the token's path.
    assert_eq!(p.breakdown.uncovered_load_ms, 0.0);
    assert!(close(p.breakdown.comm_ms, 2.0 * s * (h / BW + LAT) * 1e3));
    assert!(close(
        q.breakdown.comm_ms - p.breakdown.comm_ms,
        (r as f64 - h) / BW * 1e3
    ));
}

/// Bursty: the last device's egress port sends `b` return trips per round; a large `r`
/// makes that port the bottleneck.
#[test]
fn bursty_return_port_can_be_the_bottleneck() {
    let sh = llama13b().with_return_bytes(64 << 20);
    let cl = cluster(&sh, 2, 1e9);
    let b = 4;
    let p = plan(
        &sh,
        &cl,
        &[(20, 0), (20, 0)],
        ExecMode::Overlapped,
        Pattern::Bursty,
        b,
    );
    let r = (64u64 << 20) as f64;
    // round = b·r/bw, per token r/bw; compute of the busiest device, the rest communication.
    assert!(close(p.predicted_ms_per_token, r / BW * 1e3));
    assert!(close(p.breakdown.total_ms(), p.predicted_ms_per_token));
    let max_c = parts(&p, &sh, &cl).iter().map(|x| x.0).fold(0.0, f64::max);
    assert!(close(p.breakdown.compute_ms, max_c * 1e3));
}

/// Conventional offloading, bursty: each micro-batch runs through the stage on its own and
/// reads every offloaded block again into the one-block buffer, so an offloading device is
/// busy `b·(C_i + ld_i + hop_i)` per round. Here device 1 (slow SSD, many offloaded layers)
/// is the bottleneck: per token `C_1 + ld_1 + hop_1`, its hop the return trip.
#[test]
fn sequential_bursty_reads_offloaded_blocks_per_micro_batch() {
    let sh = llama13b().with_return_bytes(4);
    let cl = cluster(&sh, 2, 2e8);
    let b = 4;
    let p = plan(
        &sh,
        &cl,
        &[(20, 0), (20, 10)],
        ExecMode::Sequential,
        Pattern::Bursty,
        b,
    );
    let x = parts(&p, &sh, &cl);
    let (c1, ld1) = x[1];
    let hop = 4.0 / BW + LAT;
    let expect = c1 + ld1 + hop;
    let pass = x[0].0 + x[1].0 + ld1 + (sh.act_bytes_per_token as f64 / BW + LAT) + hop;
    assert!(
        b as f64 * expect > pass,
        "the offloading device is the bottleneck"
    );
    assert!(close(p.predicted_ms_per_token, expect * 1e3));
    assert!(close(p.breakdown.compute_ms, c1 * 1e3));
    assert!(close(p.breakdown.uncovered_load_ms, ld1 * 1e3));
    assert!(close(p.breakdown.comm_ms, hop * 1e3));
    // Every generated token's sequence reads the blocks: load per token is `ld_1`.
    assert!(close(p.devices[1].load_ms, ld1 * 1e3));
    assert!(close(p.devices[1].stall_ms, ld1 * 1e3));
    assert_eq!(p.devices[0].load_ms, 0.0);
    // More micro-batches do not amortise the reads.
    let q = plan(
        &sh,
        &cl,
        &[(20, 0), (20, 10)],
        ExecMode::Sequential,
        Pattern::Bursty,
        8,
    );
    assert!(q.predicted_ms_per_token > ld1 * 1e3);
}

/// Sporadic sequential offloading is unchanged: one micro-batch, every load exposed.
#[test]
fn sequential_sporadic_exposes_every_load() {
    let sh = llama13b();
    let cl = cluster(&sh, 2, 2e8);
    let p = plan(
        &sh,
        &cl,
        &[(20, 3), (20, 10)],
        ExecMode::Sequential,
        Pattern::Sporadic,
        1,
    );
    let x = parts(&p, &sh, &cl);
    let c: f64 = x.iter().map(|x| x.0).sum();
    let ld: f64 = x.iter().map(|x| x.1).sum();
    let comm = 2.0 * (sh.act_bytes_per_token as f64 / BW + LAT);
    assert!(close(p.predicted_ms_per_token, (c + ld + comm) * 1e3));
    assert!(close(p.breakdown.uncovered_load_ms, ld * 1e3));
}

/// Two llama-13b devices, each on its own disk and both on one disk: the shape and the two
/// clusters.
fn two_devices_one_disk() -> (ModelShape, Cluster, Cluster) {
    let sh = llama13b();
    let alone = cluster(&sh, 2, 2e8);
    let mut shared = alone.clone();
    shared.disks = vec![vec!["d0".into(), "d1".into()]];
    (sh, alone, shared)
}

/// [`two_devices_one_disk`] planned with 20 layers each, 5 and 10 blocks offloaded: the plan
/// with each device on its own disk, the plan with both on one, each device's offloaded
/// bytes.
fn apart_and_on_one_disk(mode: ExecMode, pattern: Pattern, b: u32) -> (Plan, Plan, Vec<f64>) {
    let (sh, alone, shared) = two_devices_one_disk();
    let alloc = [(20, 5), (20, 10)];
    let p = plan(&sh, &alone, &alloc, mode, pattern, b);
    let q = plan(&sh, &shared, &alloc, mode, pattern, b);
    let bytes = p
        .devices
        .iter()
        .map(|d| d.stages[0].offloaded_bytes(&sh) as f64)
        .collect();
    (p, q, bytes)
}

/// Devices that read from one disk (`Cluster::disks`, several workers on one host) share its
/// rate in a round: with fair sharing from a common start, device `i`'s load lasts until
/// `Σ_j min(B_j, B_i)` bytes were served, so `ld_i` grows by that over `B_i`.
#[test]
fn devices_on_one_disk_share_its_rate() {
    let (p, q, b) = apart_and_on_one_disk(ExecMode::Overlapped, Pattern::Bursty, 2);
    assert!(b[0] < b[1]);
    // the smaller load ends after twice its bytes; the larger after both devices' bytes
    assert!(close(q.devices[0].load_ms, p.devices[0].load_ms * 2.0));
    assert!(close(
        q.devices[1].load_ms,
        p.devices[1].load_ms * (b[0] + b[1]) / b[1]
    ));
    assert!(q.predicted_ms_per_token > p.predicted_ms_per_token);
    // a device alone on its disk is priced as before; sequential mode loads one device at a time
    assert_eq!(two_devices_one_disk().2.disk_mates("d9"), vec!["d9"]);
    let (s1, s2, _) = apart_and_on_one_disk(ExecMode::Sequential, Pattern::Bursty, 2);
    assert_eq!(s1.predicted_ms_per_token, s2.predicted_ms_per_token);
}

/// `disk = "..."` in a cluster file groups the devices naming one disk.
#[test]
fn cluster_file_groups_devices_by_disk() {
    let text = r#"
[[device]]
name = "a"
preset = "orin32"
disk = "host1"
[[device]]
name = "b"
preset = "orin32"
[[device]]
name = "c"
preset = "orin32"
disk = "host1"
[link]
bandwidth = "100mbit"
latency = "2ms"
"#;
    let c = Cluster::from_toml_str(text, &mut |_| Err("no files".into())).unwrap();
    assert_eq!(c.disks, vec![vec!["a".to_string(), "c".to_string()]]);
    assert_eq!(c.disk_mates("c"), vec!["a", "c"]);
    assert_eq!(c.disk_mates("b"), vec!["b"]);
    let bad = text.replacen("disk = \"host1\"", "disk = \" \"", 1);
    assert!(Cluster::from_toml_str(&bad, &mut |_| Err("no files".into())).is_err());
}

/// A block computes `σ` slower beside a load (`DeviceProfile::load_slowdown`): in overlapped
/// mode the loading device's compute grows by `σ · min(ld_i, Σ_mates C_j − off_i)`, its
/// mates the devices on its disk (its machine); sequential mode and `σ = 0` are unchanged.
#[test]
fn compute_beside_a_load_runs_slower() {
    let sh = llama13b();
    let alone = cluster(&sh, 2, 2e8);
    let mut slow = alone.clone();
    for d in &mut slow.devices {
        d.profile.load_slowdown = 0.5;
    }
    let alloc = [(20, 0), (20, 2)];
    let p = plan(
        &sh,
        &alone,
        &alloc,
        ExecMode::Overlapped,
        Pattern::Sporadic,
        1,
    );
    let q = plan(
        &sh,
        &slow,
        &alloc,
        ExecMode::Overlapped,
        Pattern::Sporadic,
        1,
    );
    let x = parts(&p, &sh, &alone);
    let t = block_times(slow.device("d1").unwrap(), &sh, CTX, 1, LoaderKind::Direct);
    let off = cost::stage_span(&p.devices[1].stages[0], t.attn, t.mlp);
    // alone on its disk, only its own compute outside the offloaded run is overlapped
    let extra = 0.5 * x[1].1.min(x[1].0 - off);
    assert!(extra > 0.0);
    assert!(close(
        q.devices[1].compute_ms,
        p.devices[1].compute_ms + extra * 1e3
    ));
    assert!(close(q.devices[0].compute_ms, p.devices[0].compute_ms));
    assert!(close(
        q.breakdown.compute_ms,
        p.breakdown.compute_ms + extra * 1e3
    ));
    // on one machine with d0, d0's compute is overlapped too (capped by the load)
    let mut shared = slow.clone();
    shared.disks = vec![vec!["d0".into(), "d1".into()]];
    let r = plan(
        &sh,
        &shared,
        &alloc,
        ExecMode::Overlapped,
        Pattern::Sporadic,
        1,
    );
    let extra2 = 0.5 * x[1].1.min(x[0].0 + x[1].0 - off);
    assert!(extra2 > extra);
    assert!(close(
        r.devices[1].compute_ms,
        p.devices[1].compute_ms + extra2 * 1e3
    ));
    // sequential mode reads before it computes
    let s1 = plan(
        &sh,
        &alone,
        &alloc,
        ExecMode::Sequential,
        Pattern::Sporadic,
        1,
    );
    let s2 = plan(
        &sh,
        &slow,
        &alloc,
        ExecMode::Sequential,
        Pattern::Sporadic,
        1,
    );
    assert_eq!(s1.predicted_ms_per_token, s2.predicted_ms_per_token);
    assert_eq!(cost::load_slowdown_extra(0.0, 1.0, 1.0), 0.0);
    assert_eq!(cost::load_slowdown_extra(0.5, 1.0, -1.0), 0.0);
    assert_eq!(cost::load_slowdown_extra(0.5, 1.0, 3.0), 0.5);
}

/// The runtime's wake-up of a hop into a device (`hop_wake`) is paid on every hop into it:
/// one pass of a sporadic token crosses each device once per round, so `comm` grows by the
/// sum of the wake-ups per round; the egress ports are not held longer.
#[test]
fn every_hop_pays_its_receivers_wake_up() {
    let sh = llama13b();
    let mut cl = cluster(&sh, 2, 1e9);
    let alloc = [(20, 0), (20, 0)];
    let base = plan(&sh, &cl, &alloc, ExecMode::Overlapped, Pattern::Sporadic, 1);
    let (w0, w1) = (1e-4, 3e-4); // seconds
    cl.devices[0].profile.hop_wake = w0;
    cl.devices[1].profile.hop_wake = w1;
    for mode in [ExecMode::Overlapped, ExecMode::Sequential] {
        let p = plan(&sh, &cl, &alloc, mode, Pattern::Sporadic, 1);
        assert!(close(
            p.breakdown.comm_ms - base.breakdown.comm_ms,
            (w0 + w1) * 1e3
        ));
        assert!(close(p.breakdown.compute_ms, base.breakdown.compute_ms));
    }
    // Two rounds (interleaved stages): twice the wake-ups.
    let mut p = base.clone();
    for (j, d) in p.devices.iter_mut().enumerate() {
        d.stages = (0..2u32)
            .map(|k| StagePlan::with_offload((2 * k + j as u32) * 10, 10, 0, 0))
            .collect();
    }
    p.stages_per_device = 2;
    let plain = cluster(&sh, 2, 1e9);
    p.reprice(&sh, &plain).unwrap();
    let before = p.breakdown.comm_ms;
    p.reprice(&sh, &cl).unwrap();
    assert!(close(p.breakdown.comm_ms - before, 2.0 * (w0 + w1) * 1e3));
    // On one device there is no hop.
    let mut one = cluster(&sh, 1, 1e9);
    one.devices[0].profile.hop_wake = w0;
    let p = plan(
        &sh,
        &one,
        &[(40, 0)],
        ExecMode::Overlapped,
        Pattern::Sporadic,
        1,
    );
    assert_eq!(p.breakdown.comm_ms, 0.0);
}

/// The coordinator's part of a step (`Cluster::coordinator`) lengthens each token's pass
/// once (sporadic) and is its own breakdown term; in bursty traffic it is a resource busy
/// `b·co` per round, which binds when it is the slowest.
#[test]
fn the_coordinator_adds_its_part_once_per_step() {
    let sh = llama13b();
    let mut cl = cluster(&sh, 2, 1e9);
    let alloc = [(20, 0), (20, 0)];
    let base = plan(&sh, &cl, &alloc, ExecMode::Overlapped, Pattern::Sporadic, 1);
    assert_eq!(base.breakdown.coordinator_ms, 0.0);
    let co = 5e-4; // seconds
    cl.coordinator = co;
    for mode in [ExecMode::Overlapped, ExecMode::Sequential] {
        let p = plan(&sh, &cl, &alloc, mode, Pattern::Sporadic, 1);
        assert!(close(p.breakdown.coordinator_ms, co * 1e3), "{mode:?}");
        assert!(
            close(p.breakdown.comm_ms, base.breakdown.comm_ms),
            "{mode:?}"
        );
        assert!(close(
            p.predicted_ms_per_token,
            base.predicted_ms_per_token + co * 1e3
        ));
        assert!(close(p.breakdown.total_ms(), p.predicted_ms_per_token));
    }
    // Bursty, a coordinator slower than every device: one step of it per micro-batch.
    let max_c = parts(&base, &sh, &cl)
        .iter()
        .map(|x| x.0)
        .fold(0.0, f64::max);
    cl.coordinator = 10.0 * max_c;
    let p = plan(&sh, &cl, &alloc, ExecMode::Overlapped, Pattern::Bursty, 4);
    assert!(close(p.predicted_ms_per_token, 10.0 * max_c * 1e3));
    assert!(close(p.breakdown.total_ms(), p.predicted_ms_per_token));
    assert!(p.breakdown.coordinator_ms > 0.0);
    // Files written before these terms load with both at 0.
    let old = r#"{"devices": [], "link": {"bandwidth": 1e6, "latency": 1e-3}}"#;
    let c: Cluster = serde_json::from_str(old).unwrap();
    assert_eq!(c.coordinator, 0.0);
    let b: loip_plan::CostBreakdown =
        serde_json::from_str(r#"{"compute_ms": 1, "comm_ms": 2, "uncovered_load_ms": 3}"#).unwrap();
    assert_eq!((b.coordinator_ms, b.total_ms()), (0.0, 6.0));
}

/// Loads on one disk that start apart share it only while they overlap
/// (`cost::staggered_load_times`): equal starts are the common-start sharing, loads that do
/// not overlap keep their own times, and one that starts while another runs shares from then.
#[test]
fn staggered_loads_share_the_disk_only_while_they_overlap() {
    let t = cost::staggered_load_times(&[1.0, 2.0], &[0.0, 0.0]);
    assert!(close(t[0], 2.0) && close(t[1], 3.0), "{t:?}");
    let t = cost::staggered_load_times(&[1.0, 1.0], &[0.0, 5.0]);
    assert!(close(t[0], 1.0) && close(t[1], 1.0), "{t:?}");
    // A alone for 1 s (1 left), then both at half rate: A ends at 3, B has 1 left, ends at 4
    let t = cost::staggered_load_times(&[2.0, 2.0], &[0.0, 1.0]);
    assert!(close(t[0], 3.0) && close(t[1], 3.0), "{t:?}");
    let t = cost::staggered_load_times(&[0.0, 1.5, 1.0], &[0.0, 0.5, 0.5]);
    assert!(
        close(t[0], 0.0) && close(t[1], 2.5) && close(t[2], 2.0),
        "{t:?}"
    );
    // a device's load starts after the compute and hops before it and its own offloaded run
    let s = cost::load_starts(&[1.0, 2.0, 3.0], &[0.5, 0.5, 0.5], &[1.0, 1.0, 0.0]);
    assert!(
        close(s[0], 1.0) && close(s[1], 2.5) && close(s[2], 4.0),
        "{s:?}"
    );
}

/// A disk whose rate with several readers is measured (`Cluster::disk_rates`,
/// `cost::staggered_load_times_at`): the loads running share that rate, each at
/// `min(1, rate / Σ solo)` of its own rate alone; a load alone keeps its time, and a rate of
/// `Σ solo / n` is fair sharing again.
#[test]
fn loads_share_the_disks_measured_rate_for_several_readers() {
    // two readers of 1 GB/s alone, 1.5 GB/s in all: both at 0.75 of their own rate
    let t = cost::staggered_load_times_at(&[1.0, 1.0], &[0.0, 0.0], &[1e9, 1e9], 1.5e9);
    assert!(close(t[0], 1.0 / 0.75) && close(t[1], 1.0 / 0.75), "{t:?}");
    // a disk as fast as both readers together: no slowdown; loads apart keep their times
    let t = cost::staggered_load_times_at(&[1.0, 2.0], &[0.0, 0.0], &[1e9, 1e9], 4e9);
    assert!(close(t[0], 1.0) && close(t[1], 2.0), "{t:?}");
    let t = cost::staggered_load_times_at(&[1.0, 1.0], &[0.0, 5.0], &[1e9, 2e9], 1e9);
    assert!(close(t[0], 1.0) && close(t[1], 1.0), "{t:?}");
    // the rate each would get with fair sharing gives fair sharing's times
    let (w, at, solo) = ([2.0, 1.5, 1.0], [0.0, 0.5, 0.7], [1e9, 1e9, 1e9]);
    let fair = cost::staggered_load_times(&w, &at);
    let t = cost::staggered_load_times_at(&w, &at, &solo, 1e9);
    for (a, b) in t.iter().zip(&fair) {
        assert!(close(*a, *b), "{t:?} vs {fair:?}");
    }
    // in a plan: the measured rate between fair sharing and a disk of its own
    let (sh, alone, mut shared) = two_devices_one_disk();
    let alloc = [(20, 5), (20, 10)];
    let sporadic = |c: &Cluster| plan(&sh, c, &alloc, ExecMode::Overlapped, Pattern::Sporadic, 1);
    let (p, q) = (sporadic(&alone), sporadic(&shared));
    let rate = |c: &Cluster, n: &str| c.device(n).unwrap().profile.loader.direct.bandwidth;
    shared.disk_rates = vec![0.75 * (rate(&shared, "d0") + rate(&shared, "d1"))];
    let r = sporadic(&shared);
    for i in 0..2 {
        assert!(r.devices[i].load_ms >= p.devices[i].load_ms * (1.0 - 1e-9));
        assert!(r.devices[i].load_ms <= q.devices[i].load_ms * (1.0 + 1e-9));
    }
    assert!(r
        .devices
        .iter()
        .zip(&q.devices)
        .any(|(r, q)| r.load_ms < q.load_ms));
}

/// With one micro-batch the devices on one disk load at staggered times: each load lasts at
/// least as long as alone and at most as long as with the common start of bursty rounds.
#[test]
fn sporadic_loads_on_one_disk_are_staggered() {
    let (p, q, b) = apart_and_on_one_disk(ExecMode::Overlapped, Pattern::Sporadic, 1);
    for i in 0..2 {
        let common = p.devices[i].load_ms * (b[0].min(b[i]) + b[1].min(b[i])) / b[i];
        assert!(q.devices[i].load_ms >= p.devices[i].load_ms * (1.0 - 1e-9));
        assert!(q.devices[i].load_ms <= common * (1.0 + 1e-9));
    }
    assert!(q.predicted_ms_per_token >= p.predicted_ms_per_token * (1.0 - 1e-9));
}

/// A warm-up (`calibrate`): the probed devices' compute is scaled by the steps' median
/// compute over the priced one, and each transfer pays what the steps' hops cost beyond the
/// priced communication; a second calibration prices the extra anew, not on top.
#[test]
fn a_warm_up_rescales_compute_and_prices_its_hops() {
    use loip_plan::calibrate::{self, WarmupStep};
    let sh = llama13b();
    let mut cl = cluster(&sh, 2, 1e9);
    let alloc = [(20, 0), (20, 0)];
    let p = plan(&sh, &cl, &alloc, ExecMode::Overlapped, Pattern::Sporadic, 1);
    let (c0, m0) = (p.breakdown.compute_ms / 1e3, p.breakdown.comm_ms / 1e3);
    // steps that computed 20 % faster than priced and spent 1 ms more in hops
    let step = |c: f64, h: f64| WarmupStep {
        wall_s: c + h + 1e-3,
        compute_s: c,
        stall_s: 1e-3,
        ..Default::default()
    };
    let steps = [
        step(0.8 * c0, m0 + 1e-3),
        step(0.8 * c0, m0 + 1e-3),
        step(5.0 * c0, m0 + 9e-3), // an outlier: the medians ignore it
    ];
    let names: Vec<String> = cl.devices.iter().map(|d| d.name.clone()).collect();
    let cal = calibrate::calibrate(&p, &sh, &mut cl, &steps, &names)
        .unwrap()
        .unwrap();
    assert!(close(cal.compute_scale, 0.8));
    assert_eq!(cal.transfers, 2);
    assert!(close(cal.hop_extra, 0.5e-3));
    let mut q = p.clone();
    q.reprice(&sh, &cl).unwrap();
    assert!(close(q.breakdown.compute_ms, 0.8 * p.breakdown.compute_ms));
    assert!(close(q.breakdown.comm_ms - p.breakdown.comm_ms, 1.0));
    // again on the calibrated cluster, with steps as priced now: nothing more
    let again = [step(0.8 * c0, m0 + 1e-3)];
    let cal2 = calibrate::calibrate(&p, &sh, &mut cl, &again, &names)
        .unwrap()
        .unwrap();
    assert!(close(cal2.compute_scale, 1.0));
    assert!(close(cal2.hop_extra, 0.5e-3));
    // only the named devices' compute is scaled; hops cheaper than priced add nothing
    let mut cl = cluster(&sh, 2, 1e9);
    let fast = [step(2.0 * c0, 0.5 * m0)];
    let cal = calibrate::calibrate(&p, &sh, &mut cl, &fast, &names[..1])
        .unwrap()
        .unwrap();
    assert_eq!(cal.hop_extra, 0.0);
    assert!(close(cal.compute_scale, 2.0));
    let plain = cluster(&sh, 2, 1e9);
    let t = |c: &Cluster, i: usize| block_times(&c.devices[i], &sh, CTX, 1, LoaderKind::Direct);
    assert!(close(t(&cl, 0).mlp, 2.0 * t(&plain, 0).mlp));
    assert!(close(t(&cl, 1).mlp, t(&plain, 1).mlp));
    // bursty plans and empty warm-ups change nothing
    let b = plan(
        &sh,
        &plain,
        &alloc,
        ExecMode::Overlapped,
        Pattern::Bursty,
        2,
    );
    let mut cl = cluster(&sh, 2, 1e9);
    assert!(calibrate::calibrate(&b, &sh, &mut cl, &steps, &names)
        .unwrap()
        .is_none());
    assert!(calibrate::calibrate(&p, &sh, &mut cl, &[], &names)
        .unwrap()
        .is_none());
    assert_eq!(cl, cluster(&sh, 2, 1e9));
}

/// The pure parts of a calibration: medians, the transfer count, the clamps.
#[test]
fn calibration_figures_are_bounded() {
    use loip_plan::calibrate::{compute_scale, extra_cap, hop_extra, median, transfers_per_step};
    assert_eq!(median([3.0, f64::NAN, 1.0, 2.0]), Some(2.0));
    assert_eq!(median([4.0, 1.0, 2.0, 3.0]), Some(2.5));
    assert_eq!(median(std::iter::empty()), None);
    assert_eq!(hop_extra(5e-3, 1e-3, 4, 1.0), 1e-3);
    assert_eq!(hop_extra(5e-3, 1e-3, 4, 0.5e-3), 0.5e-3);
    assert_eq!(hop_extra(1e-3, 5e-3, 4, 1.0), 0.0);
    assert_eq!(hop_extra(5e-3, 1e-3, 0, 1.0), 0.0);
    assert_eq!(hop_extra(f64::NAN, 1e-3, 3, 1.0), 0.0);
    assert_eq!(compute_scale(2.0, 1.0), 2.0);
    assert_eq!(compute_scale(100.0, 1.0), 4.0);
    assert_eq!(compute_scale(1.0, 100.0), 0.25);
    assert_eq!(compute_scale(1.0, 0.0), 1.0);
    let sh = llama13b();
    let cl = cluster(&sh, 3, 1e9);
    let p = plan(
        &sh,
        &cl,
        &[(10, 0), (10, 0), (20, 0)],
        ExecMode::Overlapped,
        Pattern::Sporadic,
        1,
    );
    assert_eq!(transfers_per_step(&p), 3);
    // three times the pings' price: δ and the mean wake-up
    let mut woken = cl.clone();
    woken.devices[0].profile.hop_wake = 3e-3;
    assert!(close(extra_cap(&woken), 3.0 * (LAT + 1e-3)));
    let one = plan(
        &sh,
        &cluster(&sh, 1, 1e9),
        &[(40, 0)],
        ExecMode::Overlapped,
        Pattern::Sporadic,
        1,
    );
    assert_eq!(transfers_per_step(&one), 0);
}

/// A warm-up's figures are the median over its groups of each group's median: a burst that
/// slows every step of one group of three moves nothing, even when that group ran more
/// steps than the others (a median over all steps would be the burst's).
#[test]
fn a_burst_on_one_warm_up_group_moves_no_figure() {
    use loip_plan::calibrate::{self, group_median, WarmupStep};
    let sh = llama13b();
    let alloc = [(20, 0), (20, 0)];
    let cl0 = cluster(&sh, 2, 1e9);
    let p = plan(
        &sh,
        &cl0,
        &alloc,
        ExecMode::Overlapped,
        Pattern::Sporadic,
        1,
    );
    let (c0, m0) = (p.breakdown.compute_ms / 1e3, p.breakdown.comm_ms / 1e3);
    let step = |group: u32, c: f64, h: f64| WarmupStep {
        group,
        wall_s: c + h,
        compute_s: c,
        ..Default::default()
    };
    let mut steps = vec![step(0, 1.5 * c0, m0 + 9e-3); 5]; // the burst
    for g in 1..3 {
        steps.push(step(g, 1.1 * c0, m0 + 0.2e-3));
        steps.push(step(g, 1.1 * c0, m0 + 0.2e-3));
    }
    let flat = calibrate::median(steps.iter().map(|s| s.compute_s)).unwrap();
    assert!(close(flat, 1.5 * c0));
    assert!(close(
        group_median(&steps, |s| s.compute_s).unwrap(),
        1.1 * c0
    ));
    let names: Vec<String> = cl0.devices.iter().map(|d| d.name.clone()).collect();
    let mut cl = cl0.clone();
    let cal = calibrate::calibrate(&p, &sh, &mut cl, &steps, &names)
        .unwrap()
        .unwrap();
    assert_eq!((cal.steps, cal.groups), (9, 3));
    assert!(close(cal.compute_scale, 1.1));
    assert!(close(cal.hop_extra, 0.1e-3)); // 0.2 ms over two transfers
                                           // the same steps without the burst calibrate alike
    let mut quiet = cl0.clone();
    let cal2 = calibrate::calibrate(&p, &sh, &mut quiet, &steps[5..], &names)
        .unwrap()
        .unwrap();
    assert!(close(cal2.compute_scale, cal.compute_scale));
    assert!(close(cal2.hop_extra, cal.hop_extra));
}

/// The coordinator's part of a step is warmed from the steps that measured one (a
/// sequence's later steps), the median of the groups' medians, when it is larger than the
/// setup's hand-off; a warm-up of first steps only leaves the hand-off.
#[test]
fn a_warm_up_prices_the_coordinators_part() {
    use loip_plan::calibrate::{self, WarmupStep};
    let sh = llama13b();
    let alloc = [(20, 0), (20, 0)];
    let mut cl = cluster(&sh, 2, 1e9);
    cl.coordinator = 20e-6;
    let p = plan(&sh, &cl, &alloc, ExecMode::Overlapped, Pattern::Sporadic, 1);
    let step = |group: u32, co: f64| WarmupStep {
        group,
        wall_s: 0.1,
        compute_s: 0.05,
        coordinator_s: co,
        ..Default::default()
    };
    let steps = [
        step(0, 0.0), // a sequence's first: not measured
        step(0, 80e-6),
        step(0, 90e-6),
        step(1, 0.0),
        step(1, 70e-6),
        step(2, 0.0),
        step(2, 5e-3), // one group's burst
    ];
    let names: Vec<String> = cl.devices.iter().map(|d| d.name.clone()).collect();
    let cal = calibrate::calibrate(&p, &sh, &mut cl, &steps, &names)
        .unwrap()
        .unwrap();
    assert!(close(cal.coordinator_s, 85e-6));
    assert!(close(cl.coordinator, 85e-6));
    let mut q = p.clone();
    q.reprice(&sh, &cl).unwrap();
    assert!(q.breakdown.coordinator_ms > p.breakdown.coordinator_ms);
    // first steps only, or a part under the hand-off: the hand-off stays
    for co in [0.0, 10e-6] {
        let mut c2 = cluster(&sh, 2, 1e9);
        c2.coordinator = 20e-6;
        let s = [step(0, 0.0), step(0, co)];
        calibrate::calibrate(&p, &sh, &mut c2, &s, &names).unwrap();
        assert_eq!(c2.coordinator, 20e-6);
    }
}

/// A streaming plan's loads are re-timed from the warm-up's stall: the factor at which the
/// cost model prices the stall the steps measured, weighed against the probes' 1
/// (`LOAD_WEIGHT`), slows the loaders (and the disks' measured rates); a resident plan's
/// are left alone.
#[test]
fn a_warm_up_prices_the_stall_it_measured() {
    use loip_plan::calibrate::{self, WarmupStep, LOAD_RANGE, LOAD_WEIGHT};
    let (sh, _, mut shared) = two_devices_one_disk();
    let alloc = [(20, 5), (20, 10)];
    let rate = |c: &Cluster, n: &str| c.device(n).unwrap().profile.loader.direct.bandwidth;
    shared.disk_rates = vec![0.75 * (rate(&shared, "d0") + rate(&shared, "d1"))];
    let p = plan(
        &sh,
        &shared,
        &alloc,
        ExecMode::Overlapped,
        Pattern::Sporadic,
        1,
    );
    let s0 = p.breakdown.uncovered_load_ms / 1e3;
    assert!(s0 > 0.0);
    let c0 = p.breakdown.compute_ms / 1e3;
    let names: Vec<String> = shared.devices.iter().map(|d| d.name.clone()).collect();
    let step = |stall: f64| WarmupStep {
        wall_s: c0 + stall + 0.1,
        compute_s: c0,
        stall_s: stall,
        ..Default::default()
    };
    for want in [1.5 * s0, 0.5 * s0] {
        let mut cl = shared.clone();
        let cal = calibrate::calibrate(&p, &sh, &mut cl, &[step(want)], &names)
            .unwrap()
            .unwrap();
        assert!(close(cal.priced_stall_s, s0));
        assert!(close(cal.load_scale, cal.load_fit.powf(LOAD_WEIGHT)));
        assert!((cal.load_fit > 1.0) == (want > s0));
        // at the fitted factor the stall is the measured one; at the one applied, between
        let at = |f: f64| {
            let mut c = shared.clone();
            for d in &mut c.devices {
                d.profile.scale_loads(f);
            }
            c.disk_rates[0] /= f;
            let mut q = p.clone();
            q.reprice(&sh, &c).unwrap();
            q.breakdown.uncovered_load_ms / 1e3
        };
        assert!((at(cal.load_fit) - want).abs() < 1e-6 * s0);
        let mut q = p.clone();
        q.reprice(&sh, &cl).unwrap();
        let got = q.breakdown.uncovered_load_ms / 1e3;
        assert!(close(got, at(cal.load_scale)));
        assert!(got > s0.min(want) && got < s0.max(want));
        assert!(close(
            cl.disk_rates[0],
            shared.disk_rates[0] / cal.load_scale
        ));
    }
    // as priced: nothing changes; far off: the range's end
    let mut cl = shared.clone();
    let cal = calibrate::calibrate(&p, &sh, &mut cl, &[step(s0)], &names)
        .unwrap()
        .unwrap();
    assert_eq!(cal.load_scale, 1.0);
    let mut cl = shared.clone();
    let cal = calibrate::calibrate(&p, &sh, &mut cl, &[step(100.0 * s0)], &names)
        .unwrap()
        .unwrap();
    assert_eq!(cal.load_fit, LOAD_RANGE.1);
    // a resident plan: its loads are not touched
    let r = plan(
        &sh,
        &shared,
        &[(20, 0), (20, 0)],
        ExecMode::Overlapped,
        Pattern::Sporadic,
        1,
    );
    let mut cl = shared.clone();
    let cal = calibrate::calibrate(&r, &sh, &mut cl, &[step(s0)], &names)
        .unwrap()
        .unwrap();
    assert_eq!(cal.load_scale, 1.0);
    assert_eq!(cl.disk_rates, shared.disk_rates);
}

/// [`loip_plan::calibrate::load_scale`]: the factor nearest 1 that prices the measured
/// stall, clamped; 1 where the factor moves nothing.
#[test]
fn the_load_scale_is_the_factor_nearest_one() {
    use loip_plan::calibrate::{load_scale, LOAD_RANGE};
    let linear = |f: f64| (2.0 * f - 1.0).max(0.0); // 1 at f = 1, 0 up to f = 0.5
    assert_eq!(load_scale(1.0, linear), 1.0);
    assert!((load_scale(3.0, linear) - 2.0).abs() < 1e-9);
    assert!((load_scale(0.5, linear) - 0.75).abs() < 1e-9);
    assert!((load_scale(0.0, linear) - 0.5).abs() < 1e-9); // the largest that prices 0
    assert_eq!(load_scale(100.0, linear), LOAD_RANGE.1);
    assert_eq!(load_scale(0.0, |f: f64| f), LOAD_RANGE.0);
    assert_eq!(load_scale(3.0, |_| 0.0), 1.0); // nothing streams
    assert_eq!(load_scale(f64::NAN, linear), 1.0);
}
