//! A figure: curves on shared axes, optionally over a band (a baseline and its tolerance) with
//! marked points (the steps outside it), drawn by `plotters` as SVG text or as a PNG.
//!
//! Every figure of the product goes through here (`engine plot`, test-all's report.html), so
//! they share one look: the same palette, axes and legend. Text is laid out (and drawn in the
//! PNG) with the font embedded below (a cut of DejaVu Sans; see `DejaVuSans-LICENSE.txt`),
//! through `ab_glyph`, so drawing needs no system font library; the SVG names `sans-serif` and
//! lets the viewer choose.

use std::sync::Once;

use anyhow::{Context, Result, anyhow};
use plotters::coord::Shift;
use plotters::prelude::*;

/// The curves' colours in order (Matplotlib's "tab10", which people read as distinct).
pub const PALETTE: [RGBColor; 10] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0x8c, 0x56, 0x4b),
    RGBColor(0xe3, 0x77, 0xc2),
    RGBColor(0x7f, 0x7f, 0x7f),
    RGBColor(0xbc, 0xbd, 0x22),
    RGBColor(0x17, 0xbe, 0xcf),
];
/// The band's colour (drawn at a fifth of its strength) and its edges'.
pub const BAND: RGBColor = RGBColor(0x7f, 0x7f, 0x7f);
/// The marked points' colour.
pub const MARK: RGBColor = RGBColor(0xd6, 0x27, 0x28);
/// The marked points' radius in pixels.
pub const MARK_RADIUS: i32 = 4;

/// A figure's default size in pixels.
pub const SIZE: (u32, u32) = (900, 540);

/// The largest magnitude an axis spans: values beyond it (a diverged loss near `f64::MAX`) are
/// drawn at it, so that the axis' width and its ticks stay finite.
pub const AXIS_LIMIT: f64 = 1e300;

/// One curve: its legend entry and its points `(x, y)`, in drawing order.
#[derive(Debug, Clone, PartialEq)]
pub struct Line {
    /// The legend entry.
    pub label: String,
    /// The points, joined in this order.
    pub points: Vec<(f64, f64)>,
}

/// A band: at each `x`, the interval `[low, high]` (a baseline's tolerance).
#[derive(Debug, Clone, PartialEq)]
pub struct Band {
    /// The legend entry.
    pub label: String,
    /// `(x, low, high)` in increasing `x`.
    pub points: Vec<(f64, f64, f64)>,
}

/// What one picture shows.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Figure {
    /// The caption above the axes (may be empty).
    pub title: String,
    /// The horizontal axis' name.
    pub x_label: String,
    /// The vertical axis' name.
    pub y_label: String,
    /// The band under the curves, if any.
    pub band: Option<Band>,
    /// The curves, coloured by [`PALETTE`] in order.
    pub lines: Vec<Line>,
    /// Points drawn as circles over the curves (a check's failing steps), with their legend
    /// entry (a circle too, drawn last; none when there is no point).
    pub marks: Option<(String, Vec<(f64, f64)>)>,
}

impl Figure {
    /// The figure as an SVG document of `size` pixels.
    pub fn svg(&self, size: (u32, u32)) -> Result<String> {
        // Even SVG text is measured (to size the legend), with the same font.
        register_font()?;
        let mut text = String::new();
        {
            let root = SVGBackend::with_string(&mut text, size).into_drawing_area();
            self.clamped().draw(&root)?;
            root.present().map_err(|e| anyhow!("cannot draw the figure: {e}"))?;
        }
        Ok(text)
    }

    /// The figure as a PNG file's bytes, `size` pixels, 8-bit RGB.
    pub fn png(&self, size: (u32, u32)) -> Result<Vec<u8>> {
        register_font()?;
        let mut pixels = vec![0u8; size.0 as usize * size.1 as usize * 3];
        {
            let root = BitMapBackend::with_buffer(&mut pixels, size).into_drawing_area();
            self.clamped().draw(&root)?;
            root.present().map_err(|e| anyhow!("cannot draw the figure: {e}"))?;
        }
        let mut out = Vec::new();
        let mut encoder = png::Encoder::new(&mut out, size.0, size.1);
        encoder.set_color(png::ColorType::Rgb);
        encoder.set_depth(png::BitDepth::Eight);
        let mut writer = encoder.write_header().context("cannot encode the PNG")?;
        writer.write_image_data(&pixels).context("cannot encode the PNG")?;
        writer.finish().context("cannot encode the PNG")?;
        Ok(out)
    }

    /// The ranges the axes span: every point's, a twentieth wider on each side so that no
    /// point sits on the frame; a range of one value is widened to show it. Neither goes beyond
    /// ±[`AXIS_LIMIT`].
    pub fn ranges(&self) -> Option<((f64, f64), (f64, f64))> {
        let mut xs = Vec::new();
        let mut ys = Vec::new();
        for l in &self.lines {
            xs.extend(l.points.iter().map(|p| p.0));
            ys.extend(l.points.iter().map(|p| p.1));
        }
        if let Some(b) = &self.band {
            xs.extend(b.points.iter().map(|p| p.0));
            ys.extend(b.points.iter().flat_map(|p| [p.1, p.2]));
        }
        if let Some((_, marks)) = &self.marks {
            xs.extend(marks.iter().map(|p| p.0));
            ys.extend(marks.iter().map(|p| p.1));
        }
        let span = |v: &[f64], pad: bool| {
            let lo = v.iter().copied().filter(|x| x.is_finite()).fold(f64::INFINITY, f64::min);
            let hi = v.iter().copied().filter(|x| x.is_finite()).fold(f64::NEG_INFINITY, f64::max);
            if !lo.is_finite() {
                return None;
            }
            let (lo, hi) = (lo.clamp(-AXIS_LIMIT, AXIS_LIMIT), hi.clamp(-AXIS_LIMIT, AXIS_LIMIT));
            if hi - lo <= f64::EPSILON * hi.abs().max(1.0) {
                let d = (lo.abs() * 0.1).max(1e-6);
                return Some((lo - d, hi + d));
            }
            let d = if pad { (hi - lo) / 20.0 } else { 0.0 };
            Some((lo - d, hi + d))
        };
        Some((span(&xs, false)?, span(&ys, true)?))
    }

    /// The corner of the plot the legend covers least of: the one with the fewest points in
    /// its part of the plot (the legend's rough size: a third of the width, a quarter of the
    /// height), the upper right among equals.
    fn legend_corner(&self, ((x0, x1), (y0, y1)): ((f64, f64), (f64, f64))) -> SeriesLabelPosition {
        let points: Vec<(f64, f64)> = self
            .lines
            .iter()
            .flat_map(|l| l.points.iter().copied())
            .chain(self.marks.iter().flat_map(|m| m.1.iter().copied()))
            .map(|(x, y)| ((x - x0) / (x1 - x0), (y - y0) / (y1 - y0)))
            .collect();
        let covered = |right: bool, upper: bool| {
            points
                .iter()
                .filter(|(x, y)| {
                    (if right { *x > 0.62 } else { *x < 0.38 }) && (if upper { *y > 0.72 } else { *y < 0.28 })
                })
                .count()
        };
        [
            (SeriesLabelPosition::UpperRight, covered(true, true)),
            (SeriesLabelPosition::UpperLeft, covered(false, true)),
            (SeriesLabelPosition::LowerRight, covered(true, false)),
            (SeriesLabelPosition::LowerLeft, covered(false, false)),
        ]
        .into_iter()
        .min_by_key(|c| c.1)
        .map(|c| c.0)
        .unwrap_or(SeriesLabelPosition::UpperRight)
    }

    /// The figure with every finite value beyond ±[`AXIS_LIMIT`] brought to it, as drawn: the
    /// axes stop there, and a point beyond them would have no pixel.
    fn clamped(&self) -> Figure {
        let c = |v: f64| if v.is_finite() { v.clamp(-AXIS_LIMIT, AXIS_LIMIT) } else { v };
        let mut f = self.clone();
        for l in &mut f.lines {
            l.points.iter_mut().for_each(|p| *p = (c(p.0), c(p.1)));
        }
        if let Some(b) = &mut f.band {
            b.points.iter_mut().for_each(|p| *p = (c(p.0), c(p.1), c(p.2)));
        }
        if let Some((_, marks)) = &mut f.marks {
            marks.iter_mut().for_each(|p| *p = (c(p.0), c(p.1)));
        }
        f
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<()>
    where
        DB::ErrorType: 'static,
    {
        let fail = |e: DrawingAreaErrorKind<DB::ErrorType>| anyhow!("cannot draw the figure: {e}");
        root.fill(&WHITE).map_err(fail)?;
        let Some(((x0, x1), (y0, y1))) = self.ranges() else {
            root.draw_text("no points to draw", &("sans-serif", 16).into_text_style(root), (20, 20)).map_err(fail)?;
            return Ok(());
        };
        let mut builder = ChartBuilder::on(root);
        if !self.title.is_empty() {
            builder.caption(&self.title, ("sans-serif", 18));
        }
        let mut chart = builder
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(x0..x1, y0..y1)
            .map_err(fail)?;
        chart
            .configure_mesh()
            .light_line_style(WHITE.mix(0.0))
            .bold_line_style(BLACK.mix(0.08))
            .x_desc(&self.x_label)
            .y_desc(&self.y_label)
            .x_label_formatter(&|v| tick(*v))
            .y_label_formatter(&|v| tick(*v))
            .label_style(("sans-serif", 13))
            .axis_desc_style(("sans-serif", 14))
            .draw()
            .map_err(fail)?;
        if let Some(band) = &self.band {
            // The band as one closed outline: the high edge left to right, the low one back.
            let outline: Vec<(f64, f64)> =
                band.points.iter().map(|p| (p.0, p.2)).chain(band.points.iter().rev().map(|p| (p.0, p.1))).collect();
            chart
                .draw_series(std::iter::once(Polygon::new(outline, BAND.mix(0.2).filled())))
                .map_err(fail)?
                .label(&band.label)
                .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 20, y + 5)], BAND.mix(0.2).filled()));
        }
        for (i, line) in self.lines.iter().enumerate() {
            let colour = PALETTE[i % PALETTE.len()];
            chart
                .draw_series(LineSeries::new(line.points.iter().copied(), colour.stroke_width(2)))
                .map_err(fail)?
                .label(&line.label)
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], colour.stroke_width(2)));
        }
        if let Some((label, marks)) = self.marks.as_ref().filter(|m| !m.1.is_empty()) {
            let style = MARK.stroke_width(2);
            chart
                .draw_series(marks.iter().map(|&p| Circle::new(p, MARK_RADIUS, style)))
                .map_err(fail)?
                .label(label)
                .legend(move |(x, y)| Circle::new((x + 10, y), MARK_RADIUS, style));
        }
        chart
            .configure_series_labels()
            .position(self.legend_corner(((x0, x1), (y0, y1))))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.3))
            .label_font(("sans-serif", 13))
            .draw()
            .map_err(fail)?;
        Ok(())
    }
}

/// A tick's label: at most four significant digits, no trailing zeros, scientific notation for
/// very small and very large magnitudes.
pub fn tick(v: f64) -> String {
    // Ticks are sums of steps: a zero one may come out as 1e-18.
    let v = if v.abs() < 1e-12 { 0.0 } else { v };
    let a = v.abs();
    if a != 0.0 && !(1e-3..1e6).contains(&a) {
        return format!("{v:.2e}");
    }
    let decimals = if a == 0.0 { 0 } else { (3 - a.log10().floor() as i32).clamp(0, 6) as usize };
    let s = format!("{v:.decimals$}");
    let s = if s.contains('.') { s.trim_end_matches('0').trim_end_matches('.').to_owned() } else { s };
    if s == "-0" { "0".into() } else { s }
}

/// Registers the embedded font as `sans-serif` for the PNG back-end, once per process.
fn register_font() -> Result<()> {
    static FONT: &[u8] = include_bytes!("DejaVuSans-subset.ttf");
    static ONCE: Once = Once::new();
    let mut result = Ok(());
    ONCE.call_once(|| {
        result = plotters::style::register_font("sans-serif", FontStyle::Normal, FONT)
            .map_err(|_| anyhow!("the embedded font does not read (a build fault)"));
    });
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    fn figure() -> Figure {
        Figure {
            title: "loss".into(),
            x_label: "step".into(),
            y_label: "loss".into(),
            band: Some(Band { label: "baseline ± 5%".into(), points: vec![(1.0, 4.5, 5.5), (2.0, 3.5, 4.5)] }),
            lines: vec![Line { label: "run".into(), points: vec![(1.0, 5.0), (2.0, 4.8)] }],
            marks: Some(("outside".into(), vec![(2.0, 4.8)])),
        }
    }

    #[test]
    fn ticks_read_as_people_write_numbers() {
        assert_eq!(tick(10.0), "10");
        assert_eq!(tick(2.5), "2.5");
        assert_eq!(tick(0.12345), "0.1235");
        assert_eq!(tick(1234.6), "1235");
        assert_eq!(tick(0.0), "0");
        assert_eq!(tick(6.94e-18), "0");
        assert_eq!(tick(3e-5), "3.00e-5");
        assert_eq!(tick(-0.0001), "-1.00e-4");
    }

    #[test]
    fn axes_hold_every_point_band_and_mark() {
        let ((x0, x1), (y0, y1)) = figure().ranges().unwrap();
        assert_eq!((x0, x1), (1.0, 2.0));
        assert!(y0 < 3.5 && y1 > 5.5, "{y0} {y1}");
        let flat = Figure { lines: vec![Line { label: "a".into(), points: vec![(3.0, 2.0)] }], ..Figure::default() };
        let ((x0, x1), (y0, y1)) = flat.ranges().unwrap();
        assert!(x0 < 3.0 && x1 > 3.0 && y0 < 2.0 && y1 > 2.0);
        assert_eq!(Figure::default().ranges(), None);
    }

    /// Values near the largest float (a diverged loss of 1.7e308) would make the axis wider
    /// than an f64 holds, and the tick search never ends: the axis stops at ±1e300 and the
    /// points beyond it are drawn on its edge.
    #[test]
    fn axes_of_values_near_the_largest_float_are_clamped() {
        for ys in [[1.7e308, -1.7e308], [1.7e308, 1.0], [-f64::MAX, f64::MAX], [1.7e308, 1.7e308]] {
            let points = vec![(1.0, ys[0]), (2.0, ys[1])];
            let f = Figure { lines: vec![Line { label: "a".into(), points }], ..Figure::default() };
            let (_, (y0, y1)) = f.ranges().unwrap();
            assert!(y0 >= -1.1 * AXIS_LIMIT && y1 <= 1.1 * AXIS_LIMIT && y0 < y1, "{ys:?}: {y0} {y1}");
            assert!(f.svg(SIZE).unwrap().contains("<polyline"), "{ys:?}");
            f.png((300, 200)).unwrap();
        }
    }

    #[test]
    fn both_formats_draw() {
        let svg = figure().svg(SIZE).unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("<polyline") && svg.contains("<polygon"), "{svg}");
        let png = figure().png((300, 200)).unwrap();
        let decoder = png::Decoder::new(std::io::Cursor::new(png));
        let reader = decoder.read_info().unwrap();
        assert_eq!((reader.info().width, reader.info().height), (300, 200));
    }
}
