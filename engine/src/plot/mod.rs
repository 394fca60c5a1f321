//! Pictures: a [`Figure`] (curves, a band, marked points) drawn by `plotters` as SVG or PNG
//! (`figure.rs`), and runs' curves overlaid for `engine plot` (`runs.rs`). test-all's
//! report.html draws its curve checks with the same figure ([docs/plots.md]).

pub mod figure;
pub mod runs;

pub use figure::{Band, Figure, Line};
pub use runs::{Metric, Run, XAxis};
