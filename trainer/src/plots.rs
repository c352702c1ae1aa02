//! PNG plots of a training run: the loss curve and a layer × expert load heatmap.
//!
//! Text is rendered with a TrueType font read at run time: `MOEKIT_PLOT_FONT` if set, else
//! DejaVu Sans from Debian's `fonts-dejavu-core`. Without a font the plots are skipped with a
//! warning; training results are never lost to a plotting problem.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use anyhow::{Context, Result, anyhow, bail};
use plotters::prelude::*;
use plotters::style::colors::colormaps::{ColorMap, ViridisRGB};
use plotters::style::{FontStyle, register_font};

const FONT_CANDIDATES: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
];

/// Registers the plot font once per process; the error says which files were tried.
fn ensure_font() -> Result<()> {
    static FONT: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    FONT.get_or_init(|| {
        let candidates: Vec<PathBuf> = match std::env::var_os("MOEKIT_PLOT_FONT") {
            Some(path) => vec![PathBuf::from(path)],
            None => FONT_CANDIDATES.iter().map(PathBuf::from).collect(),
        };
        let path = candidates.iter().find(|p| p.is_file()).ok_or_else(|| {
            format!(
                "no font for the plot labels (tried {}; install Debian's fonts-dejavu-core or \
                 set MOEKIT_PLOT_FONT to a .ttf file)",
                candidates
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        })?;
        let bytes =
            std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        // plotters keeps fonts for the whole process.
        let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        register_font("sans-serif", FontStyle::Normal, bytes)
            .map_err(|_| format!("{} is not a TrueType/OpenType font", path.display()))
    })
    .clone()
    .map_err(|message| anyhow!(message))
}

/// Draws into a temporary PNG beside `path` (`.<stem>.tmp-<pid>.png`) and renames it into
/// place; the temporaries of killed runs are removed first.
fn draw_png(
    path: &Path,
    size: (u32, u32),
    draw: impl FnOnce(DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>) -> Result<()>,
) -> Result<()> {
    ensure_font()?;
    let name = path.file_stem().unwrap_or_default().to_string_lossy();
    let (prefix, suffix) = (format!(".{name}.tmp-"), ".png");
    if let Some(dir) = path.parent() {
        let dir = if dir.as_os_str().is_empty() {
            Path::new(".")
        } else {
            dir
        };
        moekit_tools::golden::remove_stale_temporaries_named(dir, &prefix, suffix);
    }
    let tmp = path.with_file_name(format!("{prefix}{}{suffix}", std::process::id()));
    let result = (|| {
        let root = BitMapBackend::new(&tmp, size).into_drawing_area();
        root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
        draw(root.clone())?;
        root.present().map_err(|e| anyhow!("{e}"))?;
        drop(root);
        std::fs::rename(&tmp, path)
            .with_context(|| format!("cannot rename {} to {}", tmp.display(), path.display()))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.with_context(|| format!("cannot draw {}", path.display()))
}

/// One step's losses in `metrics.jsonl`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossPoint {
    pub step: usize,
    pub loss: f64,
    pub aux_loss: f64,
    /// Where the validation loss was evaluated.
    pub val_loss: Option<f64>,
}

/// The loss curve: training cross-entropy per step, the validation loss where it was
/// evaluated, and with `aux` (a model with MoE layers) the auxiliary loss.
pub fn loss_curve(path: &Path, points: &[LossPoint], aux: bool) -> Result<()> {
    if points.is_empty() {
        bail!("no steps to plot");
    }
    let last = points.last().map_or(1, |p| p.step).max(2) as f64;
    let high = points
        .iter()
        .flat_map(|p| [p.loss, p.aux_loss, p.val_loss.unwrap_or(0.0)])
        .fold(0f64, f64::max)
        * 1.05;
    draw_png(path, (900, 520), |root| {
        let mut chart = ChartBuilder::on(&root)
            .caption("Training loss", ("sans-serif", 24))
            .margin(16)
            .x_label_area_size(40)
            .y_label_area_size(56)
            .build_cartesian_2d(1f64..last, 0f64..high.max(1e-3))
            .map_err(|e| anyhow!("{e}"))?;
        chart
            .configure_mesh()
            .x_desc("step")
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_desc("loss (nats per token)")
            .draw()
            .map_err(|e| anyhow!("{e}"))?;
        /// A curve's value at a point, where it has one.
        type Value = fn(&LossPoint) -> Option<f64>;
        let series: [(&str, RGBColor, bool, Value); 3] = [
            ("training cross-entropy", BLUE, true, |p| Some(p.loss)),
            ("validation cross-entropy", GREEN, true, |p| p.val_loss),
            ("auxiliary (load balancing)", RED, aux, |p| Some(p.aux_loss)),
        ];
        for (label, color, shown, value) in series {
            let values: Vec<(f64, f64)> = points
                .iter()
                .filter_map(|p| value(p).map(|y| (p.step as f64, y)))
                .collect();
            if !shown || values.is_empty() {
                continue;
            }
            chart
                .draw_series(LineSeries::new(values, color.stroke_width(2)))
                .map_err(|e| anyhow!("{e}"))?
                .label(label)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|e| anyhow!("{e}"))?;
        Ok(())
    })
}

/// At most this many labels on a heatmap axis.
const MAX_AXIS_LABELS: usize = 16;

/// The label of a heatmap axis tick at `value`: the cell index when the tick is a cell's
/// centre (an integer: cell c spans [c − ½, c + ½)), named by `name`, else none.
fn cell_label(value: f64, cells: usize, name: impl Fn(usize) -> String) -> String {
    let cell = value.round();
    match (value - cell).abs() < 1e-6 && cell >= 0.0 && (cell as usize) < cells {
        true => name(cell as usize),
        false => String::new(),
    }
}

/// Width of the colour scale beside the heatmap, its labels included (pixels).
const SCALE_WIDTH: u32 = 120;

/// Heatmap of each MoE layer's share of token assignments per expert: `loads[l][e]` counts
/// for decoder layer `layers[l]`. One cell per (layer, expert), the first MoE layer at the
/// bottom, the axes labelled at cell centres (at most 16 labels each), and a colour scale
/// (viridis) from 0 to the largest share, with the uniform share marked.
pub fn expert_load_heatmap(path: &Path, layers: &[usize], loads: &[Vec<f64>]) -> Result<()> {
    let experts = loads.first().map_or(0, Vec::len);
    if layers.is_empty() || experts == 0 || loads.len() != layers.len() {
        bail!("no MoE layers to plot");
    }
    let shares: Vec<Vec<f64>> = loads
        .iter()
        .map(|row| {
            let total: f64 = row.iter().sum();
            row.iter()
                .map(|&c| if total > 0.0 { c / total } else { 0.0 })
                .collect()
        })
        .collect();
    let uniform = 1.0 / experts as f64;
    let peak = shares.iter().flatten().fold(uniform, |a, &b| a.max(b));
    let width = (150 + 24 * experts as u32).clamp(720, 1600) + SCALE_WIDTH;
    let height = (130 + 28 * layers.len() as u32).clamp(260, 1200);
    let (e, l) = (experts as f64, layers.len() as f64);
    draw_png(path, (width, height), |root| {
        let title = format!(
            "Expert load: each layer's share of its token assignments (uniform {:.1}%: the \
             white line on the scale)",
            100.0 * uniform
        );
        let root = root
            .titled(&title, ("sans-serif", 18))
            .map_err(|e| anyhow!("{e}"))?;
        let (map, scale) = root.split_horizontally(root.dim_in_pixel().0 - SCALE_WIDTH);
        // Cell (expert e, row r) spans [e − ½, e + ½) × [r − ½, r + ½), so the integer ticks
        // the axes choose fall on cell centres.
        let mut chart = ChartBuilder::on(&map)
            .margin(12)
            .x_label_area_size(44)
            .y_label_area_size(64)
            .build_cartesian_2d(-0.5..e - 0.5, -0.5..l - 0.5)
            .map_err(|e| anyhow!("{e}"))?;
        chart
            .configure_mesh()
            .disable_mesh()
            .x_desc("expert")
            .y_desc("decoder layer")
            .x_labels(experts.min(MAX_AXIS_LABELS))
            .y_labels(layers.len().min(MAX_AXIS_LABELS))
            .label_style(("sans-serif", 14))
            .axis_desc_style(("sans-serif", 16))
            .x_label_formatter(&|&x| cell_label(x, experts, |e| e.to_string()))
            .y_label_formatter(&|&y| cell_label(y, layers.len(), |r| layers[r].to_string()))
            .draw()
            .map_err(|e| anyhow!("{e}"))?;
        chart
            .draw_series(shares.iter().enumerate().flat_map(|(row, shares)| {
                shares.iter().enumerate().map(move |(expert, &share)| {
                    let (x, y) = (expert as f64 - 0.5, row as f64 - 0.5);
                    Rectangle::new(
                        [(x, y), (x + 1.0, y + 1.0)],
                        ViridisRGB.get_color_normalized(share, 0.0, peak).filled(),
                    )
                })
            }))
            .map_err(|e| anyhow!("{e}"))?;

        // The colour scale: shares in percent, 0 at the bottom, the uniform share marked.
        let top = 100.0 * peak;
        let mut bar = ChartBuilder::on(&scale)
            .margin_top(12)
            .margin_bottom(56)
            .margin_right(8)
            .y_label_area_size(64)
            .build_cartesian_2d(0f64..1f64, 0f64..top)
            .map_err(|e| anyhow!("{e}"))?;
        bar.configure_mesh()
            .disable_mesh()
            .disable_x_axis()
            .y_labels(6)
            .label_style(("sans-serif", 14))
            .axis_desc_style(("sans-serif", 16))
            .y_desc("share (%)")
            .y_label_formatter(&|y| format!("{y:.1}"))
            .draw()
            .map_err(|e| anyhow!("{e}"))?;
        const STEPS: usize = 128;
        bar.draw_series((0..STEPS).map(|i| {
            let (low, high) = (i as f64 / STEPS as f64, (i + 1) as f64 / STEPS as f64);
            Rectangle::new(
                [(0.0, top * low), (1.0, top * high)],
                ViridisRGB.get_color(((low + high) / 2.0) as f32).filled(),
            )
        }))
        .map_err(|e| anyhow!("{e}"))?;
        let even = 100.0 * uniform;
        bar.draw_series([PathElement::new(
            vec![(0.0, even), (1.0, even)],
            WHITE.stroke_width(2),
        )])
        .map_err(|e| anyhow!("{e}"))?;
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_cell_centres_are_labelled_and_by_name() {
        let layer = |r: usize| format!("L{}", 2 * r + 1);
        assert_eq!(cell_label(0.0, 2, layer), "L1");
        assert_eq!(cell_label(1.0, 2, layer), "L3");
        // Between cells, before the first and past the last: no label (no column 8 of 8).
        for value in [0.5, -1.0, 2.0, 1.25] {
            assert_eq!(cell_label(value, 2, layer), "", "{value}");
        }
        assert_eq!(cell_label(7.0, 8, |e| e.to_string()), "7");
        assert_eq!(cell_label(8.0, 8, |e| e.to_string()), "");
    }

    /// `(width, height)` from a PNG's IHDR chunk.
    fn png_size(path: &Path) -> (u32, u32) {
        let png = std::fs::read(path).unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "{}", path.display());
        let dim = |at: usize| u32::from_be_bytes(png[at..at + 4].try_into().unwrap());
        (dim(16), dim(20))
    }

    #[test]
    fn heatmaps_of_small_and_large_models_fit_their_cells() {
        let dir = std::env::temp_dir().join(format!("moekit-plots-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for (experts, layers, size) in [(8, 2, (840, 260)), (128, 48, (1720, 1200))] {
            let loads: Vec<Vec<f64>> = (0..layers)
                .map(|l| {
                    (0..experts)
                        .map(|e| ((e * 7 + l * 3) % 11) as f64)
                        .collect()
                })
                .collect();
            let path = dir.join(format!("load-{experts}x{layers}.png"));
            let ids: Vec<usize> = (0..layers).map(|l| 2 * l + 1).collect();
            expert_load_heatmap(&path, &ids, &loads).unwrap();
            assert_eq!(png_size(&path), size, "{experts} experts × {layers} layers");
        }
        std::fs::remove_dir_all(dir).unwrap();
    }
}
