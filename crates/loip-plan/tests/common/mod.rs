//! Shared test helpers: random small instances and the paper-scale shapes.
#![allow(dead_code)]

use loip_plan::planners::PlanRequest;
use loip_plan::profile::{preset, LoaderProfile};
use loip_plan::{Cluster, DeviceProfile, LinkProfile, ModelShape, Pattern};
use proptest::prelude::*;

pub fn llama70b() -> ModelShape {
    ModelShape::from_dims(
        "llama3.3-70b",
        8192,
        28672,
        80,
        64,
        8,
        128,
        128256,
        false,
        2.0,
        2,
    )
}

/// An Orin 32 GB and a Xavier NX over 100 Mbit/s links with 2 ms latency.
pub fn orin_nx() -> Cluster {
    let devices = ["orin32", "nx16"]
        .iter()
        .enumerate()
        .map(|(i, p)| (format!("d{i}"), preset(p).unwrap()))
        .collect();
    Cluster::new(
        devices,
        LinkProfile {
            bandwidth: 12.5e6,
            latency: 2e-3,
        },
    )
}

pub fn llama13b() -> ModelShape {
    ModelShape::from_dims(
        "llama2-13b",
        5120,
        13824,
        40,
        40,
        40,
        128,
        32000,
        false,
        2.0,
        2,
    )
}

pub fn qwen32b() -> ModelShape {
    ModelShape::from_dims(
        "qwen3-32b",
        5120,
        25600,
        64,
        64,
        8,
        128,
        151936,
        false,
        2.0,
        2,
    )
}

pub fn preset_cluster(names: &[&str], mbit: f64) -> Cluster {
    let devices = names
        .iter()
        .enumerate()
        .map(|(i, n)| (format!("{n}-{i}"), preset(n).expect("preset")))
        .collect();
    Cluster::new(
        devices,
        LinkProfile {
            bandwidth: mbit * 1e6 / 8.0,
            latency: 2e-3,
        },
    )
}

/// One random device: per-block times, loader, memory as a fraction of the model.
#[derive(Debug, Clone)]
pub struct DevSpec {
    pub t_attn: f64,         // seconds
    pub t_mlp: f64,          // seconds
    pub load_per_layer: f64, // seconds to read one layer
    pub overhead: f64,       // seconds per read
    pub mem_frac: f64,       // budget = W + mem_frac · (weights + KV)
}

/// A random small instance.
#[derive(Debug, Clone)]
pub struct Instance {
    pub shape: ModelShape,
    pub devs: Vec<DevSpec>,
    pub bandwidth: f64, // bytes/s
    pub latency: f64,   // seconds
    pub context: u64,
    pub pattern: Pattern,
    pub b: u32,
    pub allow_drop: bool,
}

impl Instance {
    pub fn request(&self) -> PlanRequest {
        PlanRequest {
            context: self.context,
            pattern: self.pattern,
            micro_batches: Some(self.b),
            allow_drop: self.allow_drop,
            ..PlanRequest::default()
        }
    }

    pub fn b_eff(&self) -> u32 {
        if self.pattern == Pattern::Bursty {
            self.b
        } else {
            1
        }
    }

    pub fn budget(&self, d: &DevSpec) -> u64 {
        let s = &self.shape;
        let need = s.total_bytes() + self.context * s.layers as u64 * s.kv_bytes_per_token;
        s.working_bytes(self.b_eff()) + (d.mem_frac * need as f64) as u64
    }

    pub fn cluster(&self) -> Cluster {
        let s = &self.shape;
        let devices = self
            .devs
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let loader = LoaderProfile {
                    bandwidth: s.layer_bytes() as f64 / d.load_per_layer,
                    per_read_overhead: d.overhead,
                };
                let p = DeviceProfile::from_measurements(
                    format!("hw{i}"),
                    self.budget(d),
                    s,
                    vec![(1, 1, d.t_attn)],
                    vec![(1, d.t_mlp)],
                    loader,
                    loader,
                )
                .expect("profile");
                (format!("d{i}"), p)
            })
            .collect();
        Cluster::new(
            devices,
            LinkProfile {
                bandwidth: self.bandwidth,
                latency: self.latency,
            },
        )
    }
}

pub fn dev_spec() -> impl Strategy<Value = DevSpec> {
    (
        1e-4..1e-2f64,
        1e-4..2e-2f64,
        1e-5..2e-2f64,
        prop_oneof![Just(0.0), 0.0..1e-3f64],
        0.12..1.0f64,
    )
        .prop_map(
            |(t_attn, t_mlp, load_per_layer, overhead, mem_frac)| DevSpec {
                t_attn,
                t_mlp,
                load_per_layer,
                overhead,
                mem_frac,
            },
        )
}

pub fn instance(max_devices: usize, max_layers: u32) -> impl Strategy<Value = Instance> {
    (
        1..=max_layers,
        prop::sample::select(vec![32u64, 64, 128]),
        prop::sample::select(vec![64u64, 192, 512]),
        50u64..2000,
        any::<bool>(),
        prop::collection::vec(dev_spec(), 1..=max_devices),
        prop_oneof![Just(1e9), 1e5..1e9f64],
        0.0..5e-3f64,
        0u64..4000,
        prop_oneof![Just(Pattern::Sporadic), Just(Pattern::Bursty)],
        1u32..=4,
        prop_oneof![3 => Just(true), 1 => Just(false)],
    )
        .prop_map(
            |(
                layers,
                hidden,
                inter,
                vocab,
                tied,
                devs,
                bandwidth,
                latency,
                context,
                pattern,
                b,
                allow_drop,
            )| Instance {
                shape: ModelShape::from_dims(
                    "rand",
                    hidden,
                    inter,
                    layers,
                    4,
                    2,
                    hidden / 4,
                    vocab,
                    tied,
                    2.0,
                    2,
                ),
                devs,
                bandwidth,
                latency,
                context,
                pattern,
                b,
                allow_drop,
            },
        )
}
