//! Line figures of the sweeps (plotters, SVG and PNG):
//!
//! - `memory-sweep-SETUP-PATTERN`: ms/token against the budget ratio (total budget / weight
//!   bytes), one panel per bandwidth, one line per method; a method's OOM and OOT points are
//!   marked in a band at the top of the panel (× OOM, ○ OOT), in its colour, one row per
//!   method;
//! - `context-sweep`: ms/token against the output tokens per sequence, one panel per number
//!   of sequences, and a panel of `loip`'s adaptation events (threshold switches and KV
//!   lending changes) per run.
//!
//! Every panel has its legend in a column on its right. Axes that span orders of magnitude (ms/token, output tokens) are drawn as logarithms on a
//! linear axis with labels in the original unit, so one drawing routine serves every panel.

use crate::error::SimError;
use crate::experiments::{Experiment, Record, Results};
use crate::plot_style::{register_font, Bar, COLORS};
use crate::sim::Status;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::path::{Path, PathBuf};

/// Width of a panel's legend column.  // pixels
const LEGEND_W: u32 = 190;

/// How an axis maps values.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Scale {
    /// As is.
    Linear,
    /// Base-2 logarithm (labels in the original unit).
    Log2,
    /// Base-10 logarithm (labels in the original unit).
    Log10,
}

impl Scale {
    fn to(self, v: f64) -> f64 {
        match self {
            Scale::Linear => v,
            Scale::Log2 => v.max(1e-9).log2(),
            Scale::Log10 => v.max(1e-9).log10(),
        }
    }
}

/// One line: `(x, value)` points in x order.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    /// Legend name.
    pub name: String,
    /// Points; `Bar::Oom`/`Bar::Oot` are marked, not drawn as values.
    pub points: Vec<(f64, Bar)>,
}

/// One panel of a line figure.
#[derive(Debug, Clone, PartialEq)]
pub struct Panel {
    /// Caption.
    pub title: String,
    /// X axis label.
    pub x_desc: String,
    /// Y axis label.
    pub y_desc: String,
    /// X scale.
    pub x_scale: Scale,
    /// Y scale.
    pub y_scale: Scale,
    /// Lines.
    pub series: Vec<Series>,
}

/// Nice values (1, 2, 5 × powers of ten; base 2: powers of two) of a logarithmic axis between
/// the scaled positions `lo` and `hi`, as (position, label).
fn log_ticks(scale: Scale, lo: f64, hi: f64) -> Vec<(f64, String)> {
    let mut v = Vec::new();
    match scale {
        Scale::Linear => {}
        Scale::Log2 => {
            for k in (lo.ceil() as i32)..=(hi.floor() as i32) {
                v.push((k as f64, fmt_val((k as f64).exp2())));
            }
        }
        Scale::Log10 => {
            for k in (lo.floor() as i32)..=(hi.ceil() as i32) {
                for m in [1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 7.0] {
                    let x = m * 10f64.powi(k);
                    let pos = x.log10();
                    if (lo..=hi).contains(&pos) {
                        v.push((pos, fmt_val(x)));
                    }
                }
            }
        }
    }
    v
}

fn fmt_val(v: f64) -> String {
    if v >= 100.0 || v == v.round() {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
    }
}

fn draw_panel<DB: DrawingBackend>(whole: &DrawingArea<DB, Shift>, p: &Panel) -> Result<(), String> {
    let e = |x: &dyn std::fmt::Debug| format!("{x:?}");
    let (w, _) = whole.dim_in_pixel();
    let (area, legend) = whole.split_horizontally(w.saturating_sub(LEGEND_W));
    let area = &area;
    for (si, s) in p.series.iter().enumerate() {
        let y = 60 + 20 * si as i32;
        let color = COLORS[si % COLORS.len()];
        legend
            .draw(&PathElement::new(
                vec![(4, y), (22, y)],
                color.stroke_width(3),
            ))
            .map_err(|x| e(&x))?;
        let style =
            TextStyle::from(("sans-serif", 12).into_font()).pos(Pos::new(HPos::Left, VPos::Center));
        legend
            .draw(&Text::new(s.name.clone(), (28, y), style))
            .map_err(|x| e(&x))?;
    }
    let xs: Vec<f64> = p
        .series
        .iter()
        .flat_map(|s| s.points.iter().map(|q| p.x_scale.to(q.0)))
        .collect();
    let (x0, x1) = xs.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |a, &x| {
        (a.0.min(x), a.1.max(x))
    });
    let (x0, x1) = if x0.is_finite() && x1 > x0 {
        let pad = (x1 - x0) * 0.04;
        (x0 - pad, x1 + pad)
    } else {
        (0.0, 1.0)
    };
    let vals: Vec<f64> = p
        .series
        .iter()
        .flat_map(|s| {
            s.points.iter().filter_map(|q| match q.1 {
                Bar::Ms(v) if v.is_finite() => Some(p.y_scale.to(v)),
                _ => None,
            })
        })
        .collect();
    let (lo, hi) = vals
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |a, &v| {
            (a.0.min(v), a.1.max(v))
        });
    let (lo, hi) = if lo.is_finite() {
        (lo, hi.max(lo + 1e-6))
    } else {
        (0.0, 1.0)
    };
    let rows = p.series.len().max(1) as f64;
    let span = hi - lo;
    let band = span.max(0.3) * 0.045; // height of one marker row
    let y0 = if p.y_scale == Scale::Linear {
        lo.min(0.0)
    } else {
        lo - span * 0.05
    };
    let top = hi + span * 0.05;
    let y1 = top + band * (rows + 0.5);
    let mut chart = ChartBuilder::on(area)
        .caption(&p.title, ("sans-serif", 17))
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(x0..x1, y0..y1)
        .map_err(|x| e(&x))?;
    let (xs_, ys_) = (p.x_scale, p.y_scale);
    chart
        .configure_mesh()
        .x_desc(p.x_desc.clone())
        .y_desc(p.y_desc.clone())
        .x_labels(if xs_ == Scale::Linear { 12 } else { 0 })
        .y_labels(if ys_ == Scale::Linear { 10 } else { 0 })
        .x_label_formatter(&|v| fmt_val(*v))
        .y_label_formatter(&|v| if *v > top { String::new() } else { fmt_val(*v) })
        .label_style(("sans-serif", 13))
        .draw()
        .map_err(|x| e(&x))?;
    // Logarithmic axes: light grid lines at nice values, labelled inside the plot.
    let grey = RGBColor(200, 200, 200);
    for (pos, text) in log_ticks(xs_, x0, x1) {
        chart
            .draw_series(std::iter::once(PathElement::new(
                vec![(pos, y0), (pos, top)],
                grey.stroke_width(1),
            )))
            .map_err(|x| e(&x))?;
        chart
            .draw_series(std::iter::once(Text::new(
                text,
                (pos, y0 + (top - y0) * 0.01),
                ("sans-serif", 12).into_font(),
            )))
            .map_err(|x| e(&x))?;
    }
    for (pos, text) in log_ticks(ys_, y0, top) {
        chart
            .draw_series(std::iter::once(PathElement::new(
                vec![(x0, pos), (x1, pos)],
                grey.stroke_width(1),
            )))
            .map_err(|x| e(&x))?;
        chart
            .draw_series(std::iter::once(Text::new(
                text,
                (x0 + (x1 - x0) * 0.005, pos),
                ("sans-serif", 12).into_font(),
            )))
            .map_err(|x| e(&x))?;
    }
    // The first series (loip) is drawn last, on top.
    for (si, s) in p.series.iter().enumerate().rev() {
        let color = COLORS[si % COLORS.len()];
        // Lines through consecutive finished points.
        let mut run: Vec<(f64, f64)> = Vec::new();
        let mut runs: Vec<Vec<(f64, f64)>> = Vec::new();
        for &(x, b) in &s.points {
            match b {
                Bar::Ms(v) if v.is_finite() => run.push((p.x_scale.to(x), p.y_scale.to(v))),
                _ => {
                    if !run.is_empty() {
                        runs.push(std::mem::take(&mut run));
                    }
                }
            }
        }
        if !run.is_empty() {
            runs.push(run);
        }
        for r in &runs {
            chart
                .draw_series(std::iter::once(PathElement::new(
                    r.clone(),
                    color.stroke_width(2),
                )))
                .map_err(|x| e(&x))?;
            chart
                .draw_series(r.iter().map(|&pt| Circle::new(pt, 3, color.filled())))
                .map_err(|x| e(&x))?;
        }
        let y = top + band * (si as f64 + 1.0);
        for &(x, b) in &s.points {
            let pt = (p.x_scale.to(x), y);
            match b {
                Bar::Oom => {
                    chart
                        .draw_series(std::iter::once(Cross::new(pt, 4, color.stroke_width(2))))
                        .map_err(|x| e(&x))?;
                }
                Bar::Oot => {
                    chart
                        .draw_series(std::iter::once(Circle::new(pt, 4, color.stroke_width(1))))
                        .map_err(|x| e(&x))?;
                }
                Bar::Ms(_) => {}
            }
        }
    }
    Ok(())
}

fn draw_lines<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    title: &str,
    panels: &[Panel],
) -> Result<(), String> {
    root.fill(&WHITE).map_err(|e| format!("{e:?}"))?;
    let root = root
        .titled(
            &format!("{title}   (× OOM, ○ OOT, in the top band)"),
            ("sans-serif", 20),
        )
        .map_err(|e| format!("{e:?}"))?;
    let areas = root.split_evenly((1, panels.len().max(1)));
    for (a, p) in areas.iter().zip(panels) {
        draw_panel(a, p)?;
    }
    root.present().map_err(|e| format!("{e:?}"))
}

/// Writes `base.svg` and `base.png`: `panels` side by side under `title`.
pub fn line_chart(base: &Path, title: &str, panels: &[Panel]) -> Result<Vec<PathBuf>, SimError> {
    register_font();
    let size = (
        (620 + LEGEND_W as usize) as u32 * panels.len().max(1) as u32,
        600,
    );
    let err = |path: &Path, e: String| SimError::Output {
        path: path.display().to_string(),
        reason: e,
    };
    let svg = base.with_extension("svg");
    draw_lines(
        &SVGBackend::new(&svg, size).into_drawing_area(),
        title,
        panels,
    )
    .map_err(|e| err(&svg, e))?;
    let png = base.with_extension("png");
    draw_lines(
        &BitMapBackend::new(&png, size).into_drawing_area(),
        title,
        panels,
    )
    .map_err(|e| err(&png, e))?;
    Ok(vec![svg, png])
}

fn bar_of(r: &Record) -> Bar {
    match (r.status, r.ms_per_token) {
        (Status::Ok, Some(v)) => Bar::Ms(v),
        (Status::Oom, _) => Bar::Oom,
        _ => Bar::Oot,
    }
}

fn bw_name(b: Option<f64>) -> String {
    b.map(|m| format!("{m:.0} Mbit/s"))
        .unwrap_or_else(|| "dynamic".into())
}

/// The memory-sweep figures of `e`: one per (setup, pattern), one panel per bandwidth.
fn memory_sweep(results: &Results, e: &Experiment, dir: &Path) -> Result<Vec<PathBuf>, SimError> {
    let rows: Vec<&Record> = results
        .records
        .iter()
        .filter(|r| r.experiment == e.name)
        .collect();
    let mut bases: Vec<&str> = Vec::new();
    for s in &e.setups {
        if !bases.contains(&s.base_name()) {
            bases.push(s.base_name());
        }
    }
    let mut files = Vec::new();
    for base in bases {
        for &pattern in &e.patterns {
            let panels: Vec<Panel> = e
                .bandwidths
                .iter()
                .map(|bw| {
                    let series = e
                        .methods
                        .iter()
                        .map(|m| {
                            let mut points: Vec<(f64, Bar)> = rows
                                .iter()
                                .filter(|r| {
                                    r.method == m.name()
                                        && r.pattern == pattern
                                        && r.bandwidth_mbps == bw.fixed_mbps()
                                        && r.setup.split('@').next() == Some(base)
                                })
                                .map(|r| (r.budget_ratio, bar_of(r)))
                                .collect();
                            points.sort_by(|a, b| a.0.total_cmp(&b.0));
                            Series {
                                name: m.name().to_string(),
                                points,
                            }
                        })
                        .collect();
                    Panel {
                        title: bw_name(bw.fixed_mbps()),
                        x_desc: "total budget / weight bytes".into(),
                        y_desc: "ms / token (log)".into(),
                        x_scale: Scale::Linear,
                        y_scale: Scale::Log10,
                        series,
                    }
                })
                .collect();
            files.extend(line_chart(
                &dir.join(format!("{}-{}-{}", e.name, base, pattern)),
                &format!("{} — {} — {}", e.name, base, pattern),
                &panels,
            )?);
        }
    }
    Ok(files)
}

/// The context-sweep figure of `e`: a panel per (sequences, bandwidth) and one of `loip`'s
/// adaptation events.
fn context_sweep(results: &Results, e: &Experiment, dir: &Path) -> Result<Vec<PathBuf>, SimError> {
    let rows: Vec<&Record> = results
        .records
        .iter()
        .filter(|r| r.experiment == e.name)
        .collect();
    let mut groups: Vec<(u32, Option<f64>)> = Vec::new();
    for r in &rows {
        let g = (r.sequences, r.bandwidth_mbps);
        if !groups.contains(&g) {
            groups.push(g);
        }
    }
    let pick = |method: &str, g: (u32, Option<f64>)| -> Vec<&Record> {
        let mut v: Vec<&Record> = rows
            .iter()
            .copied()
            .filter(|r| r.method == method && (r.sequences, r.bandwidth_mbps) == g)
            .collect();
        v.sort_by_key(|r| r.output_tokens);
        v
    };
    let mut panels: Vec<Panel> = groups
        .iter()
        .map(|&g| Panel {
            title: format!("{} sequences, {}", g.0, bw_name(g.1)),
            x_desc: "output tokens per sequence".into(),
            y_desc: "ms / token (log)".into(),
            x_scale: Scale::Log2,
            y_scale: Scale::Log10,
            series: e
                .methods
                .iter()
                .map(|m| Series {
                    name: m.name().to_string(),
                    points: pick(m.name(), g)
                        .iter()
                        .map(|r| (r.output_tokens as f64, bar_of(r)))
                        .collect(),
                })
                .collect(),
        })
        .collect();
    let mut events = Vec::new();
    for &g in &groups {
        let runs = pick("loip", g);
        let count = |f: fn(&Record) -> usize| -> Vec<(f64, Bar)> {
            runs.iter()
                .map(|r| (r.output_tokens as f64, Bar::Ms(f(r) as f64)))
                .collect()
        };
        events.push(Series {
            name: format!("threshold switches, {} seqs", g.0),
            points: count(|r| r.switches),
        });
        events.push(Series {
            name: format!("KV lending changes, {} seqs", g.0),
            points: count(|r| r.lends),
        });
    }
    panels.push(Panel {
        title: "loip: adaptation events per run".into(),
        x_desc: "output tokens per sequence".into(),
        y_desc: "events".into(),
        x_scale: Scale::Log2,
        y_scale: Scale::Linear,
        series: events,
    });
    line_chart(
        &dir.join(&e.name),
        &format!("{} — ms/token and adaptation", e.name),
        &panels,
    )
}

/// The line figures of a sweep experiment (none for the others).
pub fn sweep_plots(
    results: &Results,
    e: &Experiment,
    dir: &Path,
) -> Result<Vec<PathBuf>, SimError> {
    if !e.outputs.is_empty() {
        context_sweep(results, e, dir)
    } else if e.setups.iter().any(|s| s.budget_scale.is_some()) {
        memory_sweep(results, e, dir)
    } else {
        Ok(Vec::new())
    }
}
