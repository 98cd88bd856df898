//! Tables of experiment results: markdown, CSV, the `--json` array, and LOIP's speedups.
//!
//! Speedup of LOIP over a method, per row (experiment, setup, pattern, bandwidth) where both
//! ran within the limits: `ms_method / ms_loip` (> 1: LOIP is faster). Summaries are the
//! geometric mean, minimum and maximum over those rows, plus how many rows only one of the two
//! finished (the other OOM/OOT).

use crate::experiments::{Record, Results};
use crate::sim::Status;
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// One `--json` record: exactly the fields of the issue.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct JsonRecord {
    /// Experiment name.
    pub experiment: String,
    /// Setup name.
    pub setup: String,
    /// Method name.
    pub method: String,
    /// `sporadic` or `bursty`.
    pub pattern: String,
    /// Fixed bandwidth, null for dynamic.  // Mbit/s
    pub bandwidth_mbps: Option<f64>,
    /// `ok`, `oom` or `oot`.
    pub status: String,
    /// Decode ms/token, null unless the status is ok.  // milliseconds
    pub ms_per_token: Option<f64>,
}

/// The `--json` array.
pub fn json_records(records: &[Record]) -> Vec<JsonRecord> {
    records
        .iter()
        .map(|r| JsonRecord {
            experiment: r.experiment.clone(),
            setup: r.setup.clone(),
            method: r.method.clone(),
            pattern: r.pattern.to_string(),
            bandwidth_mbps: r.bandwidth_mbps,
            status: r.status.to_string(),
            ms_per_token: if r.status == Status::Ok {
                r.ms_per_token.map(round2)
            } else {
                None
            },
        })
        .collect()
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

fn bw_label(b: Option<f64>) -> String {
    b.map(|m| format!("{m:.0}"))
        .unwrap_or_else(|| "dynamic".into())
}

fn cell(r: &Record) -> String {
    match (r.status, r.ms_per_token) {
        (Status::Ok, Some(ms)) => format!("{ms:.1}"),
        (Status::Oom, _) => "OOM".into(),
        _ => "OOT".into(),
    }
}

fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

/// All records as CSV (one line per record, header first).
pub fn csv(records: &[Record]) -> String {
    let mut out = String::from(
        "experiment,setup,method,pattern,bandwidth_mbps,status,ms_per_token,predicted_ms_per_token,stages,switches,lends,evicted_tokens,note\n",
    );
    let opt = |x: Option<f64>| x.map(|v| format!("{v:.2}")).unwrap_or_default();
    for r in records {
        let _ = writeln!(
            out,
            "{},{},{},{},{},{},{},{},{},{},{},{},{}",
            r.experiment,
            r.setup,
            r.method,
            r.pattern,
            r.bandwidth_mbps
                .map(|b| format!("{b:.0}"))
                .unwrap_or_default(),
            r.status,
            opt(if r.status == Status::Ok {
                r.ms_per_token
            } else {
                None
            }),
            opt(r.predicted_ms_per_token),
            r.stages.map(|s| s.to_string()).unwrap_or_default(),
            r.switches,
            r.lends,
            r.evicted_tokens,
            csv_field(r.note.as_deref().unwrap_or("")),
        );
    }
    out
}

/// LOIP's speedup over one method in one experiment.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Speedup {
    /// Experiment.
    pub experiment: String,
    /// Method compared with.
    pub method: String,
    /// Rows where both finished.
    pub rows: usize,
    /// Geometric mean of `ms_method / ms_loip` over them (NaN if none).
    pub geo_mean: f64,
    /// Smallest.
    pub min: f64,
    /// Largest.
    pub max: f64,
    /// Rows where LOIP finished and the method was OOM/OOT.
    pub loip_only: usize,
    /// Rows where the method finished and LOIP was OOM/OOT.
    pub method_only: usize,
}

type RowKey = (String, String, String, String);

fn row_key(r: &Record) -> RowKey {
    (
        r.experiment.clone(),
        r.setup.clone(),
        r.pattern.to_string(),
        bw_label(r.bandwidth_mbps),
    )
}

/// Speedups of `loip` over every other method, per experiment, in record order.
pub fn speedups(records: &[Record]) -> Vec<Speedup> {
    let loip: BTreeMap<RowKey, &Record> = records
        .iter()
        .filter(|r| r.method == "loip")
        .map(|r| (row_key(r), r))
        .collect();
    let mut order: Vec<(String, String)> = Vec::new();
    let mut acc: BTreeMap<(String, String), (Vec<f64>, usize, usize)> = BTreeMap::new();
    for r in records.iter().filter(|r| r.method != "loip") {
        let Some(l) = loip.get(&row_key(r)) else {
            continue;
        };
        let key = (r.experiment.clone(), r.method.clone());
        if !acc.contains_key(&key) {
            order.push(key.clone());
        }
        let e = acc.entry(key).or_default();
        match (l.status == Status::Ok, r.status == Status::Ok) {
            (true, true) => {
                if let (Some(a), Some(b)) = (l.ms_per_token, r.ms_per_token) {
                    e.0.push(b / a);
                }
            }
            (true, false) => e.1 += 1,
            (false, true) => e.2 += 1,
            _ => {}
        }
    }
    order
        .into_iter()
        .map(|key| {
            let (v, lo, mo) = &acc[&key];
            let geo = if v.is_empty() {
                f64::NAN
            } else {
                (v.iter().map(|x| x.ln()).sum::<f64>() / v.len() as f64).exp()
            };
            Speedup {
                experiment: key.0.clone(),
                method: key.1.clone(),
                rows: v.len(),
                geo_mean: geo,
                min: v.iter().copied().fold(f64::INFINITY, f64::min),
                max: v.iter().copied().fold(f64::NEG_INFINITY, f64::max),
                loip_only: *lo,
                method_only: *mo,
            }
        })
        .collect()
}

/// Speedups as CSV.
pub fn speedups_csv(sp: &[Speedup]) -> String {
    let mut out = String::from(
        "experiment,method,rows_both_ok,geo_mean,min,max,loip_only_ok,method_only_ok\n",
    );
    for s in sp {
        let f = |x: f64| {
            if x.is_finite() {
                format!("{x:.3}")
            } else {
                String::new()
            }
        };
        let _ = writeln!(
            out,
            "{},{},{},{},{},{},{},{}",
            s.experiment,
            s.method,
            s.rows,
            f(s.geo_mean),
            f(s.min),
            f(s.max),
            s.loip_only,
            s.method_only
        );
    }
    out
}

/// Markdown: per experiment, a table of ms/token (rows: setup, pattern, bandwidth; columns:
/// methods) and a table of LOIP's speedups.
pub fn markdown(results: &Results) -> String {
    let mut out = String::new();
    let c = &results.config;
    let _ = writeln!(
        out,
        "Simulated decode time per generated token (ms/token; lower is better). Prompt {} + output {} tokens per sequence unless stated; link latency {:.1} ms; OOM: the method cannot place its weights; OOT: over 5 s/token (sporadic) or 2 s/token (bursty).\n",
        c.prompt_tokens,
        c.output_tokens,
        c.latency * 1e3
    );
    let sp = speedups(&results.records);
    for e in &results.experiments {
        let _ = writeln!(out, "### {}\n\n{}\n", e.name, e.title);
        if let Some((p, o)) = e.lengths {
            let _ = writeln!(out, "Prompt {p} + output {o} tokens per sequence.\n");
        }
        let methods: Vec<&str> = e.methods.iter().map(|m| m.name()).collect();
        let _ = writeln!(
            out,
            "| setup | pattern | Mbit/s | {} |",
            methods.join(" | ")
        );
        let _ = writeln!(out, "|---|---|---|{}", "---:|".repeat(methods.len()));
        let rows: Vec<&Record> = results
            .records
            .iter()
            .filter(|r| r.experiment == e.name)
            .collect();
        let mut seen: Vec<RowKey> = Vec::new();
        for r in &rows {
            let k = row_key(r);
            if seen.contains(&k) {
                continue;
            }
            seen.push(k.clone());
            let cells: Vec<String> = methods
                .iter()
                .map(|m| {
                    rows.iter()
                        .find(|x| row_key(x) == k && x.method == *m)
                        .map(|x| cell(x))
                        .unwrap_or_else(|| "–".into())
                })
                .collect();
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} |",
                k.1,
                k.2,
                k.3,
                cells.join(" | ")
            );
        }
        let esp: Vec<&Speedup> = sp.iter().filter(|s| s.experiment == e.name).collect();
        if !esp.is_empty() {
            let _ = writeln!(
                out,
                "\nSpeedup of loip (ms of the method / ms of loip; > 1: loip faster):\n"
            );
            let _ = writeln!(
                out,
                "| method | rows both ok | geo-mean | min | max | only loip ok | only method ok |"
            );
            let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|---:|");
            for s in esp {
                let f = |x: f64| {
                    if x.is_finite() {
                        format!("{x:.2}×")
                    } else {
                        "–".into()
                    }
                };
                let _ = writeln!(
                    out,
                    "| {} | {} | {} | {} | {} | {} | {} |",
                    s.method,
                    s.rows,
                    f(s.geo_mean),
                    f(s.min),
                    f(s.max),
                    s.loip_only,
                    s.method_only
                );
            }
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use loip_plan::Pattern;

    fn rec(method: &str, status: Status, ms: Option<f64>) -> Record {
        Record {
            experiment: "e".into(),
            setup: "s".into(),
            method: method.into(),
            pattern: Pattern::Sporadic,
            bandwidth_mbps: None,
            status,
            ms_per_token: ms,
            predicted_ms_per_token: None,
            note: Some("a, \"b\"".into()),
            switches: 0,
            lends: 0,
            evicted_tokens: 0,
            stages: None,
        }
    }

    #[test]
    fn json_nulls_and_speedups() {
        let rs = vec![
            rec("loip", Status::Ok, Some(100.0)),
            rec("pp", Status::Ok, Some(200.0)),
            rec("galaxy", Status::Oot, Some(9e9)),
        ];
        let j = serde_json::to_value(json_records(&rs)).unwrap();
        assert_eq!(j[0]["bandwidth_mbps"], serde_json::Value::Null);
        assert_eq!(j[2]["ms_per_token"], serde_json::Value::Null);
        assert_eq!(j[2]["status"], "oot");
        assert_eq!(j[0].as_object().unwrap().len(), 7);
        let sp = speedups(&rs);
        assert_eq!(sp.len(), 2);
        assert!((sp[0].geo_mean - 2.0).abs() < 1e-12);
        assert_eq!(sp[1].loip_only, 1);
        assert!(csv(&rs).contains("\"a, \"\"b\"\"\""));
    }
}
