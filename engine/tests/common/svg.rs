//! Reading drawn figures back: the curves, circles and axes of an SVG that `plotters` wrote
//! (engine/src/plot), turned back into data coordinates, so that tests compare a picture with
//! the numbers it was drawn from.

/// The attributes of every `<tag .../>` or `<tag ...>` element, in document order.
pub fn elements(svg: &str, tag: &str) -> Vec<Vec<(String, String)>> {
    let open = format!("<{tag} ");
    svg.match_indices(&open)
        .map(|(at, _)| {
            let rest = &svg[at + open.len()..];
            let end = rest.find('>').expect("element closes");
            attributes(&rest[..end])
        })
        .collect()
}

fn attributes(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(eq) = rest.find("=\"") {
        let name = rest[..eq].trim().to_owned();
        let after = &rest[eq + 2..];
        let close = after.find('"').expect("attribute closes");
        out.push((name, after[..close].to_owned()));
        rest = &after[close + 1..];
    }
    out
}

/// An attribute's value.
pub fn attr<'a>(element: &'a [(String, String)], name: &str) -> Option<&'a str> {
    element.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
}

/// One axis' mapping from data to pixels, `pixel = scale · value + offset`, fitted to its
/// tick labels.
#[derive(Debug, Clone, Copy)]
pub struct Axis {
    pub scale: f64,
    pub offset: f64,
}

impl Axis {
    /// The data value at a pixel.
    pub fn value(&self, pixel: f64) -> f64 {
        (pixel - self.offset) / self.scale
    }

    /// Data units per pixel.
    pub fn per_pixel(&self) -> f64 {
        1.0 / self.scale.abs()
    }
}

/// The two axes of a figure, fitted (least squares) to its numeric tick labels: the horizontal
/// axis' labels are centred under their ticks, the vertical axis' end at theirs. Panics unless
/// each axis has two labels and every label lies within a pixel of the fitted line.
pub fn axes(svg: &str) -> (Axis, Axis) {
    let mut xs = Vec::new();
    let mut ys = Vec::new();
    for (at, _) in svg.match_indices("<text ") {
        let rest = &svg[at..];
        let head_end = rest.find('>').unwrap();
        let body_end = rest.find("</text>").unwrap();
        let a = attributes(&rest[6..head_end]);
        let Ok(value) = rest[head_end + 1..body_end].trim().parse::<f64>() else { continue };
        if attr(&a, "transform").is_some() {
            continue;
        }
        let px = |n| attr(&a, n).unwrap().parse::<f64>().unwrap();
        match attr(&a, "text-anchor") {
            Some("middle") => xs.push((value, px("x"))),
            Some("end") => ys.push((value, px("y"))),
            _ => {}
        }
    }
    (fit(&xs, "x"), fit(&ys, "y"))
}

fn fit(ticks: &[(f64, f64)], name: &str) -> Axis {
    assert!(ticks.len() >= 2, "the {name} axis has {} numeric tick labels", ticks.len());
    let n = ticks.len() as f64;
    let (mv, mp) = (ticks.iter().map(|t| t.0).sum::<f64>() / n, ticks.iter().map(|t| t.1).sum::<f64>() / n);
    let cov: f64 = ticks.iter().map(|t| (t.0 - mv) * (t.1 - mp)).sum();
    let var: f64 = ticks.iter().map(|t| (t.0 - mv).powi(2)).sum();
    let scale = cov / var;
    let axis = Axis { scale, offset: mp - scale * mv };
    for &(v, p) in ticks {
        // Tick labels are rounded for reading (four digits), so allow that rounding too.
        let slack = 1.0 + (v.abs() * 5e-4) * scale.abs();
        assert!(
            (axis.offset + scale * v - p).abs() <= slack,
            "{name} tick {v} at {p} px is off the fitted axis {axis:?}"
        );
    }
    axis
}

/// The points of every `<polyline>` drawn in `colour` (`#RRGGBB`), in pixels.
pub fn polylines(svg: &str, colour: &str) -> Vec<Vec<(f64, f64)>> {
    elements(svg, "polyline")
        .iter()
        .filter(|e| attr(e, "stroke").is_some_and(|s| s.eq_ignore_ascii_case(colour)))
        .map(|e| points(attr(e, "points").unwrap()))
        .collect()
}

/// The points of every `<polygon>` filled in `colour`, in pixels.
pub fn polygons(svg: &str, colour: &str) -> Vec<Vec<(f64, f64)>> {
    elements(svg, "polygon")
        .iter()
        .filter(|e| attr(e, "fill").is_some_and(|s| s.eq_ignore_ascii_case(colour)))
        .map(|e| points(attr(e, "points").unwrap()))
        .collect()
}

fn points(text: &str) -> Vec<(f64, f64)> {
    text.split_whitespace()
        .map(|p| {
            let (x, y) = p.split_once(',').unwrap();
            (x.parse().unwrap(), y.parse().unwrap())
        })
        .collect()
}

/// The centres of every `<circle>` stroked in `colour`, in pixels.
pub fn circles(svg: &str, colour: &str) -> Vec<(f64, f64)> {
    elements(svg, "circle")
        .iter()
        .filter(|e| attr(e, "stroke").is_some_and(|s| s.eq_ignore_ascii_case(colour)))
        .map(|e| (attr(e, "cx").unwrap().parse().unwrap(), attr(e, "cy").unwrap().parse().unwrap()))
        .collect()
}

/// Pixels back to data through the fitted axes.
pub fn to_data(points: &[(f64, f64)], (x, y): (Axis, Axis)) -> Vec<(f64, f64)> {
    points.iter().map(|&(px, py)| (x.value(px), y.value(py))).collect()
}

/// Asserts that `drawn` (data coordinates read back) equals `data` point for point, within
/// what drawing on whole pixels rounds away (a pixel on each axis).
pub fn assert_drawn(drawn: &[(f64, f64)], data: &[(f64, f64)], (x, y): (Axis, Axis), what: &str) {
    assert_eq!(drawn.len(), data.len(), "{what}: {} points drawn, {} in the data", drawn.len(), data.len());
    for (d, e) in drawn.iter().zip(data) {
        assert!(
            (d.0 - e.0).abs() <= x.per_pixel() && (d.1 - e.1).abs() <= y.per_pixel(),
            "{what}: drawn {d:?}, data {e:?} (a pixel is {} by {})",
            x.per_pixel(),
            y.per_pixel()
        );
    }
}
