//! PNG plots of a training run: the loss curve and a layer × expert load heatmap.
//!
//! Text is rendered with a TrueType font read at run time: `MOEKIT_PLOT_FONT` if set, else
//! DejaVu Sans from Debian's `fonts-dejavu-core`. Without a font the plots are skipped with a
//! warning; training results are never lost to a plotting problem.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use anyhow::{Context, Result, anyhow, bail};
use plotters::prelude::*;
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
        moekit::golden::remove_stale_temporaries_named(dir, &prefix, suffix);
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

/// Heatmap of each MoE layer's share of token assignments per expert: `loads[l][e]` counts
/// for decoder layer `layers[l]`.
pub fn expert_load_heatmap(path: &Path, layers: &[usize], loads: &[Vec<f64>]) -> Result<()> {
    let experts = loads.first().map_or(0, Vec::len);
    if layers.is_empty() || experts == 0 {
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
    let peak = shares
        .iter()
        .flatten()
        .fold(0f64, |a, &b| a.max(b))
        .max(1e-12);
    let width = (120 + 24 * experts as u32).clamp(720, 1600);
    let height = (120 + 28 * layers.len() as u32).clamp(240, 1200);
    draw_png(path, (width, height), |root| {
        let caption = format!(
            "Expert load: share of each layer's assignments (darkest {:.1}%, uniform {:.1}%)",
            100.0 * peak,
            100.0 / experts as f64
        );
        let center = |v: &SegmentValue<usize>| match v {
            SegmentValue::CenterOf(i) => Some(*i),
            _ => None,
        };
        let mut chart = ChartBuilder::on(&root)
            .caption(caption, ("sans-serif", 18))
            .margin(16)
            .x_label_area_size(40)
            .y_label_area_size(56)
            .build_cartesian_2d(
                (0..experts).into_segmented(),
                (0..layers.len()).into_segmented(),
            )
            .map_err(|e| anyhow!("{e}"))?;
        chart
            .configure_mesh()
            .disable_mesh()
            .x_desc("expert")
            .y_desc("layer")
            .x_labels(experts.min(16))
            .y_labels(layers.len().min(16))
            .x_label_formatter(&|v| center(v).map_or(String::new(), |e| e.to_string()))
            .y_label_formatter(&|v| {
                center(v)
                    .and_then(|row| layers.get(row))
                    .map_or(String::new(), usize::to_string)
            })
            .draw()
            .map_err(|e| anyhow!("{e}"))?;
        chart
            .draw_series(shares.iter().enumerate().flat_map(|(row, shares)| {
                shares.iter().enumerate().map(move |(expert, &share)| {
                    let shade = 1.0 - share / peak;
                    let color = RGBColor(
                        (30.0 + 225.0 * shade) as u8,
                        (60.0 + 195.0 * shade) as u8,
                        (140.0 + 115.0 * shade) as u8,
                    );
                    let corner =
                        |e: usize, r: usize| (SegmentValue::Exact(e), SegmentValue::Exact(r));
                    Rectangle::new(
                        [corner(expert, row), corner(expert + 1, row + 1)],
                        color.filled(),
                    )
                })
            }))
            .map_err(|e| anyhow!("{e}"))?;
        Ok(())
    })
}
