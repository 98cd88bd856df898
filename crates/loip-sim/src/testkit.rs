//! Clusters for tests and checks: seeded random ones (a failing case can be replayed) and
//! clusters of named presets.

use crate::bandwidth::BandwidthTrace;
use crate::sim::{KvPolicy, SimConfig};
use loip_plan::profile::{preset, ComputeModel, DeviceProfile, LoaderProfile, Loaders, Roofline};
use loip_plan::{Cluster, LinkProfile, Pattern};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// A random cluster of 1–4 devices: Jetson presets or random roofline devices, random
/// reservations, link 50–1000 Mbit/s with 0.1–5 ms latency.
pub fn random_cluster(seed: u64) -> Cluster {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let n = rng.gen_range(1..=4);
    let mut devices = Vec::new();
    for i in 0..n {
        let p = match rng.gen_range(0..4) {
            0 => preset("orin64"),
            1 => preset("orin32"),
            2 => preset("nx16"),
            _ => None,
        };
        let profile = p.unwrap_or_else(|| {
            let ssd = rng.gen_range(0.5e9..4e9);
            DeviceProfile {
                name: format!("rand-{i}"),
                mem_budget: rng.gen_range(8u64..64) << 30,
                compute: ComputeModel::Roofline(Roofline {
                    mem_bw: rng.gen_range(20e9..200e9),
                    peak_flops: rng.gen_range(1e12..40e12),
                    efficiency: rng.gen_range(0.5..0.9),
                    block_overhead: rng.gen_range(0.0..50e-6),
                    prefill_flops: None,
                }),
                loader: Loaders {
                    direct: LoaderProfile {
                        bandwidth: ssd,
                        per_read_overhead: 1e-4,
                    },
                    conventional: LoaderProfile {
                        bandwidth: ssd / 2.0,
                        per_read_overhead: 1e-3,
                    },
                },
                sources: vec![],
                memory: None,
                collective_latency: 0.0,
                load_slowdown: 0.0,
                hop_wake: 0.0,
                hop_extra: 0.0,
                switch_s: 0.0,
            }
        });
        devices.push((format!("d{i}"), profile));
    }
    let link = LinkProfile {
        bandwidth: rng.gen_range(50.0..1000.0) * 1e6 / 8.0,
        latency: rng.gen_range(0.1e-3..5e-3),
    };
    let mut c = Cluster::new(devices, link);
    for d in &mut c.devices {
        d.reserve = (d.profile.mem_budget as f64 * rng.gen_range(0.0..0.2)) as u64;
    }
    c
}

/// A cluster of the named presets (see [`Cluster::of_presets`]) on a 100 Mbit/s link with
/// 2 ms latency.
///
/// Panics on an unknown preset name (a test helper).
pub fn preset_cluster(presets: &[&str]) -> Cluster {
    let link = LinkProfile {
        bandwidth: 12.5e6,
        latency: 2e-3,
    };
    Cluster::of_presets(presets, link).unwrap_or_else(|| panic!("unknown preset in {presets:?}"))
}

/// A random model shape name and planned context for `seed`.
pub fn random_request(seed: u64) -> (&'static str, u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x9e37_79b9_7f4a_7c15);
    let shapes = ["llama2-7b", "llama2-13b", "qwen3-32b", "llama3.3-70b"];
    (
        shapes[rng.gen_range(0..shapes.len())],
        rng.gen_range(128..4096),
    )
}

/// A config that simulates `steps` tokens of one sequence starting at `context` tokens
/// (steady state at the planned context) on `cluster`'s link.
pub fn steady_config(cluster: &Cluster, context: u64, steps: u32) -> SimConfig {
    let mut c = SimConfig::new(
        Pattern::Sporadic,
        1,
        BandwidthTrace::constant(cluster.link.bandwidth),
        cluster.link.latency,
    );
    c.prompt_tokens = context.saturating_sub(1) as u32;
    c.output_tokens = steps;
    c.kv_policy = KvPolicy::Recompute;
    c.stop_when_oot = false;
    c
}
