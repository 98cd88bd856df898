//! `GET /metrics`: the server's numbers in Prometheus text, through the `metrics` facade and
//! its Prometheus recorder (installed once per process; several servers in one process, as
//! in tests, share it).
//!
//! Series (histograms render as summaries with quantiles; counters and the serving loop's
//! gauges are listed at zero from the start):
//! - `loip_requests_total`, `loip_prompt_tokens_total`, `loip_completion_tokens_total`
//!   (counters, finished requests);
//! - `loip_memory_budget_bytes`, `loip_memory_engine_bytes`, `loip_memory_process_bytes`
//!   (with `--mem`: the whole process's budget and its split), `loip_memory_charged_bytes`
//!   and `loip_memory_pressure_events` (what the kernel charges the process now, and the
//!   times its cgroup met its limit; gauges, read when `/metrics` is asked),
//!   `loip_memory_shed_total` and `loip_memory_shed_bytes` (times and bytes the engine shed
//!   by offloading blocks under memory pressure);
//! - `loip_queue_depth`, `loip_running_sequences`, `loip_batch_size` (sequences in the last
//!   step), `loip_kv_used_bytes`, `loip_kv_reserved_bytes`, `loip_kv_budget_bytes` (gauges,
//!   one-device serving loop, after each step), `loip_prompt_cache_sequences` and
//!   `loip_prompt_cache_tokens` (finished sequences whose KV is kept for later prompts, and
//!   the tokens it holds, beside `loip_kv_used_bytes`), `loip_prompt_tokens_shared_total`
//!   (prompt positions copied from another sequence's KV instead of computed);
//! - `loip_device_compute_seconds`, `loip_device_load_stall_seconds`,
//!   `loip_device_loaded_bytes` (gauges, totals since the start, `device` label: `this` for
//!   this machine from slice files, or each plan device of a cluster by name), and for a
//!   cluster's devices also `loip_device_network_seconds`, `loip_device_queued_seconds`,
//!   `loip_device_hops_total`, `loip_kv_device_used_bytes`, `loip_kv_device_budget_bytes`
//!   (gauges, read from the session when `/metrics` is asked);
//! - with online adaptation on, per device: `loip_adapt_switches_total`,
//!   `loip_adapt_crossings_total`, `loip_adapt_threshold_tokens`, `loip_kv_device_peak_bytes`,
//!   `loip_adapt_offloaded_blocks` (`kind` label `attention` / `mlp`, per stage),
//!   `loip_adapt_lent_tokens` (KV rows lent to a peer per stage now),
//!   `loip_adapt_borrowed_bytes` (reserved for peers' lent KV now),
//!   `loip_adapt_evictions_total` (sequences evicted, the last resort; the same on every
//!   device) and `loip_adapt_evicted_bytes_total` (KV evicted there, to be recomputed);
//! - `loip_prompt_tokens_shared_total` (counter: prompt positions a sequence copied from
//!   another's KV rather than computed, e.g. the `n` choices of a request; one-device
//!   serving loop, listed at zero from the start);
//! - `loip_speculate_drafted_total`, `loip_speculate_accepted_total` (counters) and
//!   `loip_speculate_acceptance` (accepted over drafted, a gauge), `source` label `lookup`
//!   (the one-device serving loop, after each step; listed at zero from the start);
//! - `loip_step_seconds`, `loip_time_to_first_token_seconds`, `loip_inter_token_seconds`
//!   (histograms).

use std::sync::OnceLock;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

/// Installs the recorder once; `None` when another recorder was installed first.
pub(crate) fn init() -> Option<&'static PrometheusHandle> {
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new().build_recorder();
            let handle = recorder.handle();
            let installed = metrics::set_global_recorder(recorder).ok().map(|_| handle);
            if installed.is_some() {
                register();
            }
            installed
        })
        .as_ref()
}

/// Every series that does not wait for a device or a budget, at zero: `/metrics` lists
/// them from the start, before the first request.
fn register() {
    for c in [
        "loip_requests_total",
        "loip_prompt_tokens_total",
        "loip_completion_tokens_total",
        "loip_prompt_tokens_shared_total",
    ] {
        metrics::counter!(c).increment(0);
    }
    for c in [
        "loip_speculate_drafted_total",
        "loip_speculate_accepted_total",
    ] {
        metrics::counter!(c, "source" => "lookup").increment(0);
    }
    metrics::gauge!("loip_speculate_acceptance", "source" => "lookup").set(0.0);
    for g in [
        "loip_queue_depth",
        "loip_running_sequences",
        "loip_batch_size",
        "loip_kv_used_bytes",
        "loip_kv_reserved_bytes",
    ] {
        metrics::gauge!(g).set(0.0);
    }
}

/// The current numbers, Prometheus text.
pub(crate) fn render() -> String {
    memory(&loip_runtime::memory::report());
    match init() {
        Some(h) => {
            h.run_upkeep();
            h.render()
        }
        None => String::new(),
    }
}

/// The process's memory: its budget split (with `--mem`) and what the kernel charges now.
fn memory(m: &loip_runtime::memory::MemoryNow) {
    if let Some(b) = m.budget {
        metrics::gauge!("loip_memory_budget_bytes").set(b.total as f64);
        metrics::gauge!("loip_memory_engine_bytes").set(b.engine as f64);
        metrics::gauge!("loip_memory_process_bytes").set(b.process as f64);
    }
    metrics::gauge!("loip_memory_charged_bytes").set(m.charge.bytes as f64);
    metrics::gauge!("loip_memory_pressure_events").set(m.charge.pressure_events as f64);
    metrics::gauge!("loip_memory_shed_total").set(m.shed.sheds as f64);
    metrics::gauge!("loip_memory_shed_bytes").set(m.shed.bytes as f64);
}

/// One finished request.
pub(crate) fn request_done(prompt_tokens: usize, completion_tokens: usize) {
    metrics::counter!("loip_requests_total").increment(1);
    metrics::counter!("loip_prompt_tokens_total").increment(prompt_tokens as u64);
    metrics::counter!("loip_completion_tokens_total").increment(completion_tokens as u64);
}

/// Seconds from a request's start to its first token.
pub(crate) fn first_token(s: f64) {
    metrics::histogram!("loip_time_to_first_token_seconds").record(s);
}

/// Seconds between two tokens of one request.
pub(crate) fn inter_token(s: f64) {
    metrics::histogram!("loip_inter_token_seconds").record(s);
}

/// The serving loop after a step.
pub(crate) fn step(st: &crate::stats::LoopStats, step_s: Option<f64>) {
    metrics::gauge!("loip_queue_depth").set(st.queued as f64);
    metrics::gauge!("loip_running_sequences").set(st.running as f64);
    metrics::gauge!("loip_batch_size").set(st.last_batch as f64);
    metrics::gauge!("loip_kv_used_bytes").set(st.kv_used as f64);
    metrics::gauge!("loip_kv_reserved_bytes").set(st.kv_reserved as f64);
    if st.kv_budget != u64::MAX {
        metrics::gauge!("loip_kv_budget_bytes").set(st.kv_budget as f64);
    }
    if st.device != crate::stats::DeviceTotals::default() {
        device("this", &st.device);
    }
    if st.shared_tokens > 0 {
        metrics::counter!("loip_prompt_tokens_shared_total").absolute(st.shared_tokens);
    }
    metrics::gauge!("loip_prompt_cache_sequences").set(st.prompt_cache_sequences as f64);
    metrics::gauge!("loip_prompt_cache_tokens").set(st.prompt_cache_tokens as f64);
    for (source, s) in &st.spec {
        let source = match source {
            loip_engine::Speculate::Lookup => "lookup",
            loip_engine::Speculate::Draft => "draft",
            loip_engine::Speculate::Off => continue,
        };
        metrics::counter!("loip_speculate_drafted_total", "source" => source)
            .absolute(s.drafted as u64);
        metrics::counter!("loip_speculate_accepted_total", "source" => source)
            .absolute(s.accepted as u64);
        metrics::gauge!("loip_speculate_acceptance", "source" => source).set(s.acceptance());
    }
    if let Some(s) = step_s {
        metrics::histogram!("loip_step_seconds").record(s);
    }
}

/// A device's totals since the start.
pub(crate) fn device(name: &str, d: &crate::stats::DeviceTotals) {
    let n = name.to_string();
    metrics::gauge!("loip_device_compute_seconds", "device" => n.clone()).set(d.compute_s);
    metrics::gauge!("loip_device_load_stall_seconds", "device" => n.clone()).set(d.load_stall_s);
    metrics::gauge!("loip_device_loaded_bytes", "device" => n).set(d.loaded_bytes as f64);
}

/// A cluster's devices, as the session reports them now.
pub(crate) fn cluster_devices(devices: &[loip_runtime::cluster_run::DeviceStats]) {
    for d in devices {
        let t = &d.steps;
        let totals = crate::stats::DeviceTotals {
            compute_s: t.compute_s,
            load_stall_s: t.stall_s,
            loaded_bytes: t.loaded_bytes,
        };
        device(&d.name, &totals);
        let n = d.name.clone();
        metrics::gauge!("loip_device_network_seconds", "device" => n.clone()).set(t.network_s);
        metrics::gauge!("loip_device_queued_seconds", "device" => n.clone()).set(t.queued_s);
        metrics::gauge!("loip_device_hops_total", "device" => n.clone()).set(t.hops as f64);
        metrics::gauge!("loip_kv_device_used_bytes", "device" => n.clone()).set(d.kv_used as f64);
        if let Some(b) = d.kv_budget {
            metrics::gauge!("loip_kv_device_budget_bytes", "device" => n.clone()).set(b as f64);
        }
        let Some(a) = &d.adapt else { continue };
        metrics::gauge!("loip_adapt_switches_total", "device" => n.clone()).set(a.switches as f64);
        metrics::gauge!("loip_adapt_crossings_total", "device" => n.clone())
            .set(a.crossings as f64);
        if let Some(ts) = a.threshold {
            metrics::gauge!("loip_adapt_threshold_tokens", "device" => n.clone()).set(ts as f64);
        }
        metrics::gauge!("loip_kv_device_peak_bytes", "device" => n.clone()).set(a.kv_peak as f64);
        metrics::gauge!("loip_adapt_lent_tokens", "device" => n.clone()).set(a.lent_tokens as f64);
        metrics::gauge!("loip_adapt_borrowed_bytes", "device" => n.clone())
            .set(a.borrowed_bytes as f64);
        metrics::gauge!("loip_adapt_evictions_total", "device" => n.clone())
            .set(a.evictions as f64);
        metrics::gauge!("loip_adapt_evicted_bytes_total", "device" => n.clone())
            .set(a.evicted_bytes as f64);
        let (attn, mlp) = a.offloaded;
        metrics::gauge!("loip_adapt_offloaded_blocks", "device" => n.clone(), "kind" => "attention")
            .set(f64::from(attn));
        metrics::gauge!("loip_adapt_offloaded_blocks", "device" => n, "kind" => "mlp")
            .set(f64::from(mlp));
    }
}

#[cfg(test)]
mod tests {
    use loip_runtime::cluster_run::{DeviceAdaptStats, DeviceStats};

    /// A value of `series` for `device` in `text`.
    fn value(text: &str, series: &str, device: &str) -> Option<f64> {
        let p = format!("{series}{{device=\"{device}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&p))
            .and_then(|v| v.trim().parse().ok())
    }

    #[test]
    fn adaptation_series_per_device() {
        let dev = DeviceStats {
            name: "adapt-m1".into(),
            steps: Default::default(),
            kv_used: 4096,
            kv_budget: Some(8192),
            adapt: Some(DeviceAdaptStats {
                switches: 2,
                crossings: 3,
                threshold: Some(40),
                kv_peak: 6000,
                offloaded: (1, 2),
                lent_tokens: 16,
                borrowed_bytes: 512,
                evictions: 1,
                evicted_bytes: 2048,
            }),
        };
        if super::init().is_none() {
            return; // another recorder owns this process
        }
        super::cluster_devices(&[dev]);
        let text = super::render();
        for (series, want) in [
            ("loip_kv_device_used_bytes", 4096.0),
            ("loip_kv_device_budget_bytes", 8192.0),
            ("loip_kv_device_peak_bytes", 6000.0),
            ("loip_adapt_switches_total", 2.0),
            ("loip_adapt_crossings_total", 3.0),
            ("loip_adapt_threshold_tokens", 40.0),
            ("loip_adapt_lent_tokens", 16.0),
            ("loip_adapt_borrowed_bytes", 512.0),
            ("loip_adapt_evictions_total", 1.0),
            ("loip_adapt_evicted_bytes_total", 2048.0),
        ] {
            assert_eq!(
                value(&text, series, "adapt-m1"),
                Some(want),
                "{series} in\n{text}"
            );
        }
    }
}
