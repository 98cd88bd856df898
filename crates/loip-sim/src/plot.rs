//! Figures of the experiments (plotters, SVG and PNG):
//!
//! - per experiment and pattern, grouped bars of ms/token: one group per (setup, bandwidth),
//!   one bar per method, OOM/OOT written where the bar would be (as in the paper's figures);
//! - the sweeps' line figures ([`crate::plot_lines`]);
//! - memory over time of one device of one LOIP run: total memory, weights + buffers, KV
//!   lent to a peer, the budget, and the threshold switches;
//! - the same per device of one run, stacked in one file ([`memory_panels`],
//!   [`device_charts`]): the simulator's runs and the runtime's (`loip local --plot`) draw
//!   with the same code.
//!
//! Text uses DejaVu Sans, embedded from `assets/` (its licence is next to it) and registered
//! with plotters once, so nothing depends on system fonts.

use crate::error::SimError;
use crate::experiments::{MemoryRun, Results};
/// A bar's value, defined with the other pieces every figure shares.
pub use crate::plot_style::Bar;
use crate::plot_style::{register_font, COLORS};
use crate::sim::{AdaptEvent, MemorySample, Status};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::path::{Path, PathBuf};

/// A grouped bar chart.
#[derive(Debug, Clone, PartialEq)]
pub struct BarChart {
    /// Title.
    pub title: String,
    /// Group labels (x axis).
    pub groups: Vec<String>,
    /// Series (one bar per group each).
    pub series: Vec<String>,
    /// `bars[group][series]`.
    pub bars: Vec<Vec<Bar>>,
}

fn err<E: std::fmt::Debug>(path: &Path) -> impl Fn(E) -> SimError + '_ {
    move |e| SimError::Output {
        path: path.display().to_string(),
        reason: format!("{e:?}"),
    }
}

fn draw_bars<DB: DrawingBackend>(
    full: &DrawingArea<DB, Shift>,
    c: &BarChart,
) -> Result<(), String> {
    full.fill(&WHITE).map_err(|e| format!("{e:?}"))?;
    let (w, _) = full.dim_in_pixel();
    let (root, legend) = full.split_horizontally(w.saturating_sub(210));
    let root = &root;
    let m = c.series.len().max(1);
    let slots = (m + 1) as f64;
    let xmax = c.groups.len() as f64 * slots;
    let ymax = c
        .bars
        .iter()
        .flatten()
        .filter_map(|b| if let Bar::Ms(v) = b { Some(*v) } else { None })
        .fold(0.0, f64::max)
        .max(1.0)
        * 1.15;
    let mut chart = ChartBuilder::on(root)
        .caption(&c.title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(64)
        .build_cartesian_2d(0.0..xmax, 0.0..ymax)
        .map_err(|e| format!("{e:?}"))?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .y_desc("ms / token")
        .y_label_formatter(&|v| format!("{v:.0}"))
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(|e| format!("{e:?}"))?;
    for (si, name) in c.series.iter().enumerate() {
        let y = 60 + 24 * si as i32;
        let color = COLORS[si % COLORS.len()];
        legend
            .draw(&Rectangle::new([(10, y - 7), (26, y + 7)], color.filled()))
            .map_err(|e| format!("{e:?}"))?;
        let style =
            TextStyle::from(("sans-serif", 14).into_font()).pos(Pos::new(HPos::Left, VPos::Center));
        legend
            .draw(&Text::new(name.clone(), (34, y), style))
            .map_err(|e| format!("{e:?}"))?;
    }
    let note =
        TextStyle::from(("sans-serif", 12).into_font()).pos(Pos::new(HPos::Left, VPos::Center));
    let y = 60 + 24 * c.series.len() as i32 + 10;
    legend
        .draw(&Text::new(
            "OOM: cannot place weights",
            (10, y),
            note.clone(),
        ))
        .map_err(|e| format!("{e:?}"))?;
    legend
        .draw(&Text::new("OOT: over the time limit", (10, y + 18), note))
        .map_err(|e| format!("{e:?}"))?;
    for (si, _) in c.series.iter().enumerate() {
        let color = COLORS[si % COLORS.len()];
        let rects: Vec<Rectangle<(f64, f64)>> = c
            .bars
            .iter()
            .enumerate()
            .filter_map(|(g, row)| match row.get(si) {
                Some(Bar::Ms(v)) => {
                    let x = g as f64 * slots + 0.5 + si as f64;
                    Some(Rectangle::new([(x, 0.0), (x + 0.9, *v)], color.filled()))
                }
                _ => None,
            })
            .collect();
        chart.draw_series(rects).map_err(|e| format!("{e:?}"))?;
        // OOM / OOT markers, written vertically where the bar would stand.
        for (g, row) in c.bars.iter().enumerate() {
            let text = match row.get(si) {
                Some(Bar::Oom) => "OOM",
                Some(Bar::Oot) => "OOT",
                _ => continue,
            };
            let x = g as f64 * slots + 0.5 + si as f64 + 0.45;
            let style = ("sans-serif", 13)
                .into_font()
                .transform(FontTransform::Rotate270)
                .color(&color);
            chart
                .draw_series(std::iter::once(Text::new(
                    text.to_string(),
                    (x, ymax * 0.02),
                    style,
                )))
                .map_err(|e| format!("{e:?}"))?;
        }
    }
    for (g, label) in c.groups.iter().enumerate() {
        let (px, py) = chart.backend_coord(&(g as f64 * slots + slots / 2.0, 0.0));
        let style =
            TextStyle::from(("sans-serif", 14).into_font()).pos(Pos::new(HPos::Center, VPos::Top));
        root.draw(&Text::new(label.clone(), (px, py + 8), style))
            .map_err(|e| format!("{e:?}"))?;
    }
    full.present().map_err(|e| format!("{e:?}"))
}

/// Writes `base.svg` and `base.png`.
pub fn bar_chart(base: &Path, c: &BarChart) -> Result<Vec<PathBuf>, SimError> {
    register_font();
    let w = (430 + 24 * c.groups.len() * (c.series.len() + 1)).clamp(1000, 2000) as u32;
    let size = (w, 560);
    let svg = base.with_extension("svg");
    draw_bars(&SVGBackend::new(&svg, size).into_drawing_area(), c).map_err(err(&svg))?;
    let png = base.with_extension("png");
    draw_bars(&BitMapBackend::new(&png, size).into_drawing_area(), c).map_err(err(&png))?;
    Ok(vec![svg, png])
}

/// `(time s, total, weights + buffers, KV lent)`.  // seconds, bytes
type Point = (f64, u64, u64, u64);

/// Memory of one device over one run.
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryChart {
    /// Title.
    pub title: String,
    /// Budget.  // bytes
    pub budget: u64,
    /// `(time s, total, weights + buffers, right-axis KV)` per step.  // seconds, bytes
    pub points: Vec<Point>,
    /// What the right axis shows: `"lent to a peer"` or `"evicted"` (runs without lending).
    pub right_axis: String,
    /// `(time s, label)` of threshold switches.
    pub switches: Vec<(f64, String)>,
}

/// The points of a memory chart and what its right axis shows: KV lent to a peer, or KV
/// evicted where the run evicted and never lent.
fn memory_series(samples: &[MemorySample]) -> (Vec<Point>, String) {
    let lent = samples.iter().any(|s| s.kv_lent > 0) || samples.iter().all(|s| s.kv_evicted == 0);
    let points = samples
        .iter()
        .map(|s| {
            let right = if lent { s.kv_lent } else { s.kv_evicted };
            (s.time_s, s.total, s.weights, right)
        })
        .collect();
    let axis = if lent { "lent to a peer" } else { "evicted" };
    (points, axis.to_string())
}

/// The label of the `k`-th threshold switch.
fn switch_label(k: usize, tokens: u64, from: (u32, u32), to: (u32, u32)) -> String {
    format!(
        "TS{k} ({tokens} tok): a,m {},{} → {},{}",
        from.0, from.1, to.0, to.1
    )
}

fn draw_memory<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    c: &MemoryChart,
) -> Result<(), String> {
    root.fill(&WHITE).map_err(|e| format!("{e:?}"))?;
    // GB at the simulator's scale, MB for small budgets (the runtime on this machine).
    let (unit, div) = if c.budget >= 2_000_000_000 {
        ("GB", 1e9)
    } else {
        ("MB", 1e6)
    };
    let gb = |b: u64| b as f64 / div;
    let tmax = c.points.last().map(|p| p.0).unwrap_or(1.0).max(1e-9);
    let ymax = c
        .points
        .iter()
        .map(|p| gb(p.1))
        .fold(gb(c.budget), f64::max)
        * 1.08;
    let ymin = c.points.iter().map(|p| gb(p.2)).fold(ymax, f64::min) * 0.97;
    let mut chart = ChartBuilder::on(root)
        .caption(&c.title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .right_y_label_area_size(64)
        .build_cartesian_2d(0.0..tmax, ymin..ymax)
        .map_err(|e| format!("{e:?}"))?
        .set_secondary_coord(
            0.0..tmax,
            0.0..(c
                .points
                .iter()
                .map(|p| p.3 as f64 / 1e6)
                .fold(0.0, f64::max)
                .max(1.0)
                * 1.3),
        );
    chart
        .configure_mesh()
        .x_desc("time (s)")
        .y_desc(format!("memory in use ({unit})"))
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_label_formatter(&|v| format!("{v:.1}"))
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(|e| format!("{e:?}"))?;
    chart
        .configure_secondary_axes()
        .y_desc(format!("KV {} (MB)", c.right_axis))
        .y_label_formatter(&|v| format!("{v:.1}"))
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(|e| format!("{e:?}"))?;
    let line = |f: fn(&Point) -> f64| -> Vec<(f64, f64)> {
        c.points.iter().map(|p| (p.0, f(p))).collect()
    };
    let scaled = |f: fn(&Point) -> f64| -> Vec<(f64, f64)> {
        c.points.iter().map(|p| (p.0, f(p) / div)).collect()
    };
    let blue = RGBColor(31, 119, 180);
    let green = RGBColor(44, 160, 44);
    chart
        .draw_series(std::iter::once(PathElement::new(
            vec![(0.0, gb(c.budget)), (tmax, gb(c.budget))],
            RED.stroke_width(2),
        )))
        .map_err(|e| format!("{e:?}"))?
        .label("budget")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], RED.stroke_width(2)));
    chart
        .draw_series(std::iter::once(PathElement::new(
            scaled(|p| p.1 as f64),
            blue.stroke_width(2),
        )))
        .map_err(|e| format!("{e:?}"))?
        .label("total (weights + slot + buffers + KV)")
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], blue.stroke_width(2)));
    chart
        .draw_series(std::iter::once(PathElement::new(
            scaled(|p| p.2 as f64),
            BLACK.stroke_width(1),
        )))
        .map_err(|e| format!("{e:?}"))?
        .label("weights + slot + buffers")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], BLACK.stroke_width(1)));
    chart
        .draw_secondary_series(std::iter::once(PathElement::new(
            line(|p| p.3 as f64 / 1e6),
            green.stroke_width(2),
        )))
        .map_err(|e| format!("{e:?}"))?
        .label(format!("KV {} (right axis)", c.right_axis))
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], green.stroke_width(2)));
    let orange = RGBColor(255, 127, 14);
    for (j, (t, label)) in c.switches.iter().enumerate() {
        chart
            .draw_series(std::iter::once(PathElement::new(
                vec![(*t, ymin), (*t, ymax)],
                orange.stroke_width(1),
            )))
            .map_err(|e| format!("{e:?}"))?;
        let y = ymax - (ymax - ymin) * (0.06 + 0.06 * (j % 4) as f64);
        chart
            .draw_series(std::iter::once(Text::new(
                label.clone(),
                (*t, y),
                ("sans-serif", 12).into_font().color(&orange),
            )))
            .map_err(|e| format!("{e:?}"))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 13))
        .draw()
        .map_err(|e| format!("{e:?}"))?;
    Ok(())
}

fn draw_memory_alone<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    c: &MemoryChart,
) -> Result<(), String> {
    draw_memory(root, c)?;
    root.present().map_err(|e| format!("{e:?}"))
}

/// Writes `base.svg` and `base.png`.
pub fn memory_chart(base: &Path, c: &MemoryChart) -> Result<Vec<PathBuf>, SimError> {
    register_font();
    let size = (1100, 560);
    let svg = base.with_extension("svg");
    draw_memory_alone(&SVGBackend::new(&svg, size).into_drawing_area(), c).map_err(err(&svg))?;
    let png = base.with_extension("png");
    draw_memory_alone(&BitMapBackend::new(&png, size).into_drawing_area(), c).map_err(err(&png))?;
    Ok(vec![svg, png])
}

/// Writes `charts` stacked in one figure at `path`: SVG when it ends in `.svg`, else PNG
/// (one panel per device of a run, e.g. `loip local --plot`).
pub fn memory_panels(path: &Path, charts: &[MemoryChart]) -> Result<PathBuf, SimError> {
    register_font();
    let n = charts.len().max(1);
    let size = (1100, (420 * n as u32).min(8400));
    let svg = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("svg"));
    if svg {
        draw_stack(&SVGBackend::new(path, size).into_drawing_area(), charts).map_err(err(path))?;
    } else {
        draw_stack(&BitMapBackend::new(path, size).into_drawing_area(), charts)
            .map_err(err(path))?;
    }
    Ok(path.to_path_buf())
}

fn draw_stack<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    charts: &[MemoryChart],
) -> Result<(), String> {
    root.fill(&WHITE).map_err(|e| format!("{e:?}"))?;
    for (area, c) in root
        .split_evenly((charts.len().max(1), 1))
        .iter()
        .zip(charts)
    {
        draw_memory(area, c)?;
    }
    root.present().map_err(|e| format!("{e:?}"))
}

/// One chart per device from memory samples (`memory[device]`, one per step) and the
/// adaptation events: threshold switches, lending changes and evictions marked where they
/// apply. `names` and `budgets` per device; `title` heads every panel.
pub fn device_charts(
    title: &str,
    names: &[String],
    budgets: &[u64],
    memory: &[Vec<MemorySample>],
    events: &[AdaptEvent],
) -> Vec<MemoryChart> {
    let names_of = |i: usize| names.get(i).cloned().unwrap_or_else(|| format!("#{i}"));
    memory
        .iter()
        .enumerate()
        .map(|(i, samples)| {
            let time_of = |step: u32| {
                samples
                    .iter()
                    .find(|s| s.step >= step)
                    .or(samples.last())
                    .map_or(0.0, |s| s.time_s)
            };
            let mut k = 0;
            let marks = events
                .iter()
                .filter_map(|e| match e {
                    AdaptEvent::Switch {
                        step,
                        device,
                        tokens,
                        from,
                        to,
                    } if *device == i => {
                        k += 1;
                        Some((time_of(*step), switch_label(k, *tokens, *from, *to)))
                    }
                    AdaptEvent::Lend {
                        step,
                        device,
                        peer,
                        tokens,
                    } if *device == i => Some((
                        time_of(*step),
                        format!("lend {tokens} tok → {}", names_of(*peer)),
                    )),
                    AdaptEvent::Evict { step, tokens } => {
                        Some((time_of(*step), format!("evict {tokens} tok")))
                    }
                    _ => None,
                })
                .collect();
            let (points, right_axis) = memory_series(samples);
            MemoryChart {
                title: format!("{title}: memory of `{}`", names_of(i)),
                budget: budgets.get(i).copied().unwrap_or(0),
                points,
                right_axis,
                switches: marks,
            }
        })
        .collect()
}

/// The memory chart of the device of `m` with the most adaptation events.
pub fn memory_chart_of(m: &MemoryRun) -> Option<MemoryChart> {
    let r = &m.run.report;
    let nd = r.memory.len();
    let events_of = |i: usize| {
        r.events
            .iter()
            .filter(|e| match e {
                AdaptEvent::Switch { device, .. } | AdaptEvent::Lend { device, .. } => *device == i,
                AdaptEvent::Evict { .. } => false,
            })
            .count()
    };
    // The device with the most switches and lending; ties: the fullest one at its peak.
    let fullness = |i: usize| {
        r.devices
            .get(i)
            .map(|d| (d.peak_memory as u128 * 1000) / d.budget.max(1) as u128)
            .unwrap_or(0)
    };
    let dev = (0..nd).max_by_key(|&i| (events_of(i), fullness(i), std::cmp::Reverse(i)))?;
    let samples = &r.memory[dev];
    let (points, right_axis) = memory_series(samples);
    let time_of = |step: u32| {
        samples
            .iter()
            .find(|s| s.step >= step)
            .map(|s| s.time_s)
            .unwrap_or(0.0)
    };
    let mut j = 0;
    let switches = r
        .events
        .iter()
        .filter_map(|e| match e {
            AdaptEvent::Switch {
                step,
                device,
                tokens,
                from,
                to,
            } if *device == dev => {
                j += 1;
                // Only the first switches are labelled: long runs have dozens.
                let label = if j <= 4 {
                    switch_label(j, *tokens, *from, *to)
                } else {
                    String::new()
                };
                Some((time_of(*step), label))
            }
            _ => None,
        })
        .collect();
    let name = r
        .devices
        .get(dev)
        .map(|d| d.name.clone())
        .unwrap_or_default();
    Some(MemoryChart {
        title: format!(
            "{} / {} / loip / {} / {} Mbit/s: memory of `{}` ({} tokens decoded per sequence)",
            m.experiment, m.setup, m.pattern, m.bandwidth, name, r.steps
        ),
        budget: r.devices.get(dev).map(|d| d.budget).unwrap_or(0),
        points,
        right_axis,
        switches,
    })
}

/// Writes every figure of `results` into `dir`; returns the files written.
pub fn write_plots(results: &Results, dir: &Path) -> Result<Vec<PathBuf>, SimError> {
    let mut files = Vec::new();
    for e in &results.experiments {
        if e.is_sweep() {
            files.extend(crate::plot_lines::sweep_plots(results, e, dir)?);
            continue;
        }
        for &pattern in &e.patterns {
            let rows: Vec<_> = results
                .records
                .iter()
                .filter(|r| r.experiment == e.name && r.pattern == pattern)
                .collect();
            let mut groups: Vec<(String, String)> = Vec::new();
            for r in &rows {
                let g = (
                    r.setup.clone(),
                    r.bandwidth_mbps
                        .map(|b| format!("{b:.0} Mbit/s"))
                        .unwrap_or_else(|| "dynamic".into()),
                );
                if !groups.contains(&g) {
                    groups.push(g);
                }
            }
            let series: Vec<String> = e.methods.iter().map(|m| m.name().to_string()).collect();
            let bars = groups
                .iter()
                .map(|g| {
                    series
                        .iter()
                        .map(|m| {
                            let r = rows.iter().find(|r| {
                                &r.method == m
                                    && r.setup == g.0
                                    && r.bandwidth_mbps
                                        .map(|b| format!("{b:.0} Mbit/s"))
                                        .unwrap_or_else(|| "dynamic".into())
                                        == g.1
                            });
                            match r.map(|r| (r.status, r.ms_per_token)) {
                                Some((Status::Ok, Some(v))) => Bar::Ms(v),
                                Some((Status::Oom, _)) => Bar::Oom,
                                _ => Bar::Oot,
                            }
                        })
                        .collect()
                })
                .collect();
            // One bandwidth: it goes in the title and the groups are the setups.
            let one_bw = e.bandwidths.len() == 1;
            let chart = BarChart {
                title: match (one_bw, groups.first()) {
                    (true, Some(g)) => format!(
                        "{} — {} at {} (ms/token, lower is better)",
                        e.name,
                        pattern,
                        if g.1 == "dynamic" {
                            "50–250 Mbit/s"
                        } else {
                            &g.1
                        }
                    ),
                    _ => format!("{} — {} (ms/token, lower is better)", e.name, pattern),
                },
                groups: groups
                    .iter()
                    .map(|g| {
                        if one_bw {
                            g.0.clone()
                        } else {
                            format!("{} @ {}", g.0, g.1)
                        }
                    })
                    .collect(),
                series,
                bars,
            };
            files.extend(bar_chart(
                &dir.join(format!("{}-{}", e.name, pattern)),
                &chart,
            )?);
        }
    }
    if let Some(m) = &results.memory_run {
        if let Some(c) = memory_chart_of(m) {
            files.extend(memory_chart(&dir.join("memory-over-time"), &c)?);
        }
    }
    Ok(files)
}
