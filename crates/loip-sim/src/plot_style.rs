//! What every figure shares: the embedded font (DejaVu Sans, from `assets/`, registered with
//! plotters once), the colour cycle, and a bar's value ([`Bar`]). Below the bar and memory
//! figures ([`crate::plot`]) and the line figures ([`crate::plot_lines`]).

use plotters::style::{FontStyle, RGBColor};
use std::sync::Once;

static FONT: &[u8] = include_bytes!("../assets/DejaVuSans.ttf");
static REGISTER: Once = Once::new();

pub(crate) fn register_font() {
    REGISTER.call_once(|| {
        // The font is embedded and valid; a failure would only lose the text.
        let _ = plotters::style::register_font("sans-serif", FontStyle::Normal, FONT);
    });
}

pub(crate) const COLORS: [RGBColor; 10] = [
    RGBColor(214, 39, 40),
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

/// One bar: a time, or why there is none.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Bar {
    /// ms/token.
    Ms(f64),
    /// Out of memory.
    Oom,
    /// Out of time.
    Oot,
}
