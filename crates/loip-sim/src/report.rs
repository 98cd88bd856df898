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
    /// Total budget over the model's weight bytes (3 decimals).
    pub budget_ratio: f64,
    /// Output tokens per sequence.  // tokens
    pub output_tokens: u32,
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
            budget_ratio: (r.budget_ratio * 1000.0).round() / 1000.0,
            output_tokens: r.output_tokens,
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

/// Writes `rows` (the header first) as CSV with the `csv` crate: a field is quoted only
/// where it holds a comma, a quote or a line break.
fn csv_text<const N: usize>(
    header: [&str; N],
    rows: impl IntoIterator<Item = [String; N]>,
) -> String {
    let mut w = csv::Writer::from_writer(Vec::new());
    // Writing records of one length into a Vec cannot fail.
    let _ = w.write_record(header);
    for row in rows {
        let _ = w.write_record(&row);
    }
    let bytes = w.into_inner().unwrap_or_default();
    String::from_utf8(bytes).unwrap_or_default()
}

/// All records as CSV (one line per record, header first).
pub fn csv(records: &[Record]) -> String {
    let opt = |x: Option<f64>| x.map(|v| format!("{v:.2}")).unwrap_or_default();
    csv_text(
        [
            "experiment",
            "setup",
            "method",
            "pattern",
            "bandwidth_mbps",
            "budget_ratio",
            "output_tokens",
            "sequences",
            "status",
            "ms_per_token",
            "predicted_ms_per_token",
            "planned_for",
            "stages",
            "switches",
            "lends",
            "evicted_tokens",
            "note",
        ],
        records.iter().map(|r| {
            [
                r.experiment.to_string(),
                r.setup.to_string(),
                r.method.to_string(),
                r.pattern.to_string(),
                r.bandwidth_mbps
                    .map(|b| format!("{b:.0}"))
                    .unwrap_or_default(),
                format!("{:.3}", r.budget_ratio),
                r.output_tokens.to_string(),
                r.sequences.to_string(),
                r.status.to_string(),
                opt(if r.status == Status::Ok {
                    r.ms_per_token
                } else {
                    None
                }),
                opt(r.predicted_ms_per_token),
                r.planned_for.as_deref().unwrap_or("").to_string(),
                r.stages.map(|s| s.to_string()).unwrap_or_default(),
                r.switches.to_string(),
                r.lends.to_string(),
                r.evicted_tokens.to_string(),
                r.note.as_deref().unwrap_or("").to_string(),
            ]
        }),
    )
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

/// (experiment, setup, pattern, bandwidth, output tokens, sequences).
type RowKey = (String, String, String, String, u32, u32);

fn row_key(r: &Record) -> RowKey {
    (
        r.experiment.clone(),
        r.setup.clone(),
        r.pattern.to_string(),
        bw_label(r.bandwidth_mbps),
        r.output_tokens,
        r.sequences,
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
    let f = |x: f64| {
        if x.is_finite() {
            format!("{x:.3}")
        } else {
            String::new()
        }
    };
    csv_text(
        [
            "experiment",
            "method",
            "rows_both_ok",
            "geo_mean",
            "min",
            "max",
            "loip_only_ok",
            "method_only_ok",
        ],
        sp.iter().map(|s| {
            [
                s.experiment.clone(),
                s.method.clone(),
                s.rows.to_string(),
                f(s.geo_mean),
                f(s.min),
                f(s.max),
                s.loip_only.to_string(),
                s.method_only.to_string(),
            ]
        }),
    )
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
        let sweep = e.is_sweep();
        if sweep {
            let _ = writeln!(
                out,
                "| setup | budget ratio | pattern | Mbit/s | output | seqs | {} | loip placed for |",
                methods.join(" | ")
            );
            let _ = writeln!(
                out,
                "|---|---:|---|---|---:|---:|{}---|",
                "---:|".repeat(methods.len())
            );
        } else {
            let _ = writeln!(
                out,
                "| setup | pattern | Mbit/s | {} |",
                methods.join(" | ")
            );
            let _ = writeln!(out, "|---|---|---|{}", "---:|".repeat(methods.len()));
        }
        let mut order: Vec<RowKey> = Vec::new();
        let mut by_row: BTreeMap<RowKey, Vec<&Record>> = BTreeMap::new();
        for r in results.records.iter().filter(|r| r.experiment == e.name) {
            let k = row_key(r);
            let v = by_row.entry(k.clone()).or_default();
            if v.is_empty() {
                order.push(k);
            }
            v.push(r);
        }
        for k in &order {
            let row = &by_row[k];
            let cells: Vec<String> = methods
                .iter()
                .map(|m| {
                    row.iter()
                        .find(|x| x.method == *m)
                        .map(|x| cell(x))
                        .unwrap_or_else(|| "–".into())
                })
                .collect();
            if sweep {
                let first = row[0];
                let placed = row
                    .iter()
                    .find(|x| x.method == "loip")
                    .and_then(|x| x.planned_for.clone())
                    .unwrap_or_else(|| "–".into());
                let _ = writeln!(
                    out,
                    "| {} | {:.2} | {} | {} | {} | {} | {} | {} |",
                    first.setup.split('@').next().unwrap_or(&first.setup),
                    first.budget_ratio,
                    k.2,
                    k.3,
                    k.4,
                    k.5,
                    cells.join(" | "),
                    placed
                );
            } else {
                let _ = writeln!(
                    out,
                    "| {} | {} | {} | {} |",
                    k.1,
                    k.2,
                    k.3,
                    cells.join(" | ")
                );
            }
        }
        out.push_str(&ablation_markdown(&results.records, &e.name));
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

/// Where removing one LOIP component changes the result in one experiment.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AblationEffect {
    /// Experiment.
    pub experiment: String,
    /// The ablation (`loip-no-kvtransfer`, `loip-uniform`, `loip-conventional-load`).
    pub method: String,
    /// Rows where both ran (any status).
    pub rows: usize,
    /// Rows where `loip` is more than 0.5 % faster, or finishes and the ablation does not.
    pub loip_better: usize,
    /// Rows where the ablation is more than 0.5 % faster, or finishes and `loip` does not.
    pub ablation_better: usize,
    /// The rows where it matters (`loip_better`), most first: (row label, ms of the ablation /
    /// ms of loip, infinite when only loip finishes). Rows where only loip finishes sort
    /// first; the markdown lists the largest finite ones and counts those.
    pub matters: Vec<(String, f64)>,
}

fn row_label(r: &Record) -> String {
    format!(
        "{} budget {:.2}, {} {}, {} Mbit/s, {} tokens",
        r.setup.split('@').next().unwrap_or(&r.setup),
        r.budget_ratio,
        r.sequences,
        if r.sequences == 1 { "seq" } else { "seqs" },
        bw_label(r.bandwidth_mbps),
        r.output_tokens
    )
}

/// The effect of every ablation in `experiment` (none if it runs no ablation).
pub fn ablation_effects(records: &[Record], experiment: &str) -> Vec<AblationEffect> {
    const ABLATIONS: [&str; 3] = [
        "loip-no-kvtransfer",
        "loip-uniform",
        "loip-conventional-load",
    ];
    let loip: BTreeMap<RowKey, &Record> = records
        .iter()
        .filter(|r| r.experiment == experiment && r.method == "loip")
        .map(|r| (row_key(r), r))
        .collect();
    let mut out = Vec::new();
    for m in ABLATIONS {
        let mut eff = AblationEffect {
            experiment: experiment.to_string(),
            method: m.to_string(),
            rows: 0,
            loip_better: 0,
            ablation_better: 0,
            matters: Vec::new(),
        };
        for r in records
            .iter()
            .filter(|r| r.experiment == experiment && r.method == m)
        {
            let Some(l) = loip.get(&row_key(r)) else {
                continue;
            };
            eff.rows += 1;
            let ok = |x: &Record| x.status == Status::Ok;
            let ratio = match (ok(l), ok(r), l.ms_per_token, r.ms_per_token) {
                (true, true, Some(a), Some(b)) => b / a,
                (true, false, ..) => f64::INFINITY,
                (false, true, ..) => 0.0,
                _ => 1.0,
            };
            if ratio > 1.005 {
                eff.loip_better += 1;
                eff.matters.push((row_label(r), ratio));
            } else if ratio < 1.0 / 1.005 {
                eff.ablation_better += 1;
            }
        }
        eff.matters
            .sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        if eff.rows > 0 {
            out.push(eff);
        }
    }
    out
}

/// Markdown summary of [`ablation_effects`] (empty when the experiment has no ablation).
pub fn ablation_markdown(records: &[Record], experiment: &str) -> String {
    let effects = ablation_effects(records, experiment);
    let mut out = String::new();
    if effects.is_empty() {
        return out;
    }
    let _ = writeln!(
        out,
        "\nWhere each LOIP component matters (rows where removing it makes the run more than 0.5 % slower or not finish; ∞: only loip finishes):\n"
    );
    let _ = writeln!(
        out,
        "| ablation | rows | loip better | ablation better | largest effects |"
    );
    let _ = writeln!(out, "|---|---:|---:|---:|---|");
    for e in effects {
        let mut top: Vec<String> = e
            .matters
            .iter()
            .filter(|m| m.1.is_finite())
            .take(3)
            .map(|(l, x)| format!("{l}: {x:.2}×"))
            .collect();
        let only: Vec<&(String, f64)> = e.matters.iter().filter(|m| m.1.is_infinite()).collect();
        if let Some(first) = only.first() {
            top.push(format!(
                "only loip finishes in {} row(s), e.g. {}",
                only.len(),
                first.0
            ));
        }
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} |",
            e.method,
            e.rows,
            e.loip_better,
            e.ablation_better,
            if top.is_empty() {
                "none".to_string()
            } else {
                top.join("; ")
            }
        );
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
            budget_ratio: 1.0,
            output_tokens: 512,
            sequences: 1,
            planned_for: None,
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
        assert_eq!(j[0].as_object().unwrap().len(), 9);
        assert_eq!(j[0]["budget_ratio"], 1.0);
        assert_eq!(j[0]["output_tokens"], 512);
        let sp = speedups(&rs);
        assert_eq!(sp.len(), 2);
        assert!((sp[0].geo_mean - 2.0).abs() < 1e-12);
        assert_eq!(sp[1].loip_only, 1);
        assert!(csv(&rs).contains("\"a, \"\"b\"\"\""));
    }
}
