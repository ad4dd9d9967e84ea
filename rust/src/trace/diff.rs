//! Why one trace peaks higher than another: the difference in peak attributed to sites, largest
//! growth first, each site's growth related to the param that changed (linear in bs, quadratic
//! in seq_len).

use serde::Serialize;

use super::peak::{PeakSites, SiteRow};
use super::sites::StackText;
use crate::grid::Grid;
use crate::params::{Param, Params};
use crate::units::{bytes, signed_bytes};

/// How close a factor must be to 1, r or r² to be called constant, linear or quadratic.
pub const TOLERANCE: f64 = 0.1;

/// How a site's bytes grew against the param's ratio r.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind", content = "factor")]
pub enum Growth {
    /// Only in b.
    New,
    /// Only in a.
    Gone,
    Constant,
    Linear,
    Quadratic,
    /// None of the above, or no numeric param changed: b's bytes over a's.
    Factor(f64),
}

impl Growth {
    fn of(factor: f64, ratio: Option<f64>) -> Growth {
        let near = |target: f64| (factor - target).abs() <= TOLERANCE * target;
        match ratio {
            _ if near(1.0) => Growth::Constant,
            Some(r) if (r - 1.0).abs() > TOLERANCE && near(r) => Growth::Linear,
            Some(r) if (r - 1.0).abs() > TOLERANCE && near(r * r) => Growth::Quadratic,
            _ => Growth::Factor(factor),
        }
    }

    pub fn label(self, param: Option<&str>) -> String {
        let of = param.map_or(String::new(), |name| format!(" in {name}"));
        match self {
            Growth::New => "new".into(),
            Growth::Gone => "gone".into(),
            Growth::Constant => "constant".into(),
            Growth::Linear => format!("linear{of}"),
            Growth::Quadratic => format!("quadratic{of}"),
            Growth::Factor(factor) => format!("{factor:.1}×"),
        }
    }
}

/// The numeric param that differs between the two runs.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ParamChange {
    pub name: String,
    pub a: Param,
    pub b: Param,
    pub ratio: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SiteDiffRow {
    pub label: String,
    pub source: Option<String>,
    pub bytes_a: u64,
    pub bytes_b: u64,
    pub delta: i64,
    /// b's bytes over a's; None when the site is in one run only.
    pub factor: Option<f64>,
    pub growth: Growth,
    /// The row in a sentence: "+2.40 GiB In [9], line 14 `…`: 4.0× (bs 64 → 128)".
    pub text: String,
    pub stack: StackText,
}

/// Two peaks compared site by site.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SiteDiff {
    pub peak_a: u64,
    pub peak_b: u64,
    pub delta: i64,
    pub param: Option<ParamChange>,
    /// Largest growth first, shrinkage last.
    pub rows: Vec<SiteDiffRow>,
    pub notes: Vec<String>,
}

/// The first numeric param whose value differs, and how many others differ too.
fn param_change(params_a: &Params, params_b: &Params) -> (Option<ParamChange>, Vec<String>) {
    let mut changed = params_a.0.iter().filter_map(|(name, a)| {
        let b = params_b.get(name)?;
        let ratio = b.number()? / a.number()?;
        (ratio.is_finite() && ratio > 0.0 && a != b).then(|| ParamChange {
            name: name.clone(),
            a: a.clone(),
            b: b.clone(),
            ratio,
        })
    });
    let first = changed.next();
    let others: Vec<String> = changed.map(|change| change.name).collect();
    let notes = if others.is_empty() {
        Vec::new()
    } else {
        vec![format!(
            "growth is related to {} only; {} changed too",
            first.as_ref().map_or("", |c| &c.name),
            others.join(", ")
        )]
    };
    (first, notes)
}

/// Pairs each site of `a` with the same site of `b`: by label, then by the line's source
/// (a function re-run from a new cell keeps its source, not its cell number).
fn pair<'x>(a: &'x [SiteRow], b: &'x [SiteRow]) -> Vec<(Option<&'x SiteRow>, Option<&'x SiteRow>)> {
    let mut taken = vec![false; b.len()];
    let mut pairs = Vec::new();
    let mut unpaired = Vec::new();
    for row in a {
        match b.iter().enumerate().position(|(i, other)| !taken[i] && other.label == row.label) {
            Some(i) => {
                taken[i] = true;
                pairs.push((Some(row), Some(&b[i])));
            }
            None => unpaired.push(row),
        }
    }
    for row in unpaired {
        let same_source = |other: &SiteRow| other.source.is_some() && other.source == row.source;
        let candidates: Vec<usize> = (0..b.len()).filter(|&i| !taken[i] && same_source(&b[i])).collect();
        if let [i] = candidates[..] {
            taken[i] = true;
            pairs.push((Some(row), Some(&b[i])));
        } else {
            pairs.push((Some(row), None));
        }
    }
    pairs.extend(b.iter().enumerate().filter(|(i, _)| !taken[*i]).map(|(_, row)| (None, Some(row))));
    pairs
}

/// Attributes `b`'s peak minus `a`'s to sites.
pub fn diff(a: &PeakSites, b: &PeakSites, params_a: &Params, params_b: &Params) -> SiteDiff {
    let (param, mut notes) = param_change(params_a, params_b);
    let mut rows: Vec<SiteDiffRow> = pair(&a.table.all, &b.table.all)
        .into_iter()
        .map(|(in_a, in_b)| {
            let bytes_a = in_a.map_or(0, |row| row.bytes);
            let bytes_b = in_b.map_or(0, |row| row.bytes);
            let shown = in_b.or(in_a).expect("one side at least");
            let factor = (bytes_a > 0 && bytes_b > 0).then(|| bytes_b as f64 / bytes_a as f64);
            let growth = match factor {
                Some(factor) => Growth::of(factor, param.as_ref().map(|p| p.ratio)),
                None if bytes_a == 0 => Growth::New,
                None => Growth::Gone,
            };
            let delta = bytes_b as i64 - bytes_a as i64;
            let mut text = format!("{} {}", signed_bytes(delta), shown.label);
            if let Some(source) = &shown.source {
                text.push_str(&format!(" `{source}`"));
            }
            text.push_str(&format!(": {}", factor.map_or(growth.label(None), |f| format!("{f:.1}×"))));
            if let Some(change) = &param {
                text.push_str(&format!(" ({} {} → {})", change.name, change.a, change.b));
                if matches!(growth, Growth::Linear | Growth::Quadratic | Growth::Constant) {
                    text.push_str(&format!(", {}", growth.label(Some(&change.name))));
                }
            }
            SiteDiffRow {
                label: shown.label.clone(),
                source: shown.source.clone(),
                bytes_a,
                bytes_b,
                delta,
                factor,
                growth,
                text,
                stack: shown.stack.clone(),
            }
        })
        .collect();
    rows.sort_by(|x, y| y.delta.cmp(&x.delta).then_with(|| x.label.cmp(&y.label)));
    notes.extend(a.completeness.unknown.iter().map(|line| format!("a: {line}")));
    notes.extend(b.completeness.unknown.iter().map(|line| format!("b: {line}")));
    SiteDiff {
        peak_a: a.peak.bytes,
        peak_b: b.peak.bytes,
        delta: b.peak.bytes as i64 - a.peak.bytes as i64,
        param,
        rows,
        notes,
    }
}

impl SiteDiff {
    pub fn grid(&self) -> Grid {
        let param = self.param.as_ref().map(|change| change.name.as_str());
        Grid {
            title: format!(
                "Peak {} → {} ({}), by site",
                bytes(self.peak_a),
                bytes(self.peak_b),
                signed_bytes(self.delta)
            ),
            lines: self
                .param
                .iter()
                .map(|change| format!("{} {} → {} (×{:.2})", change.name, change.a, change.b, change.ratio))
                .collect(),
            header: ["site", "line", "a", "b", "change", "growth"].map(String::from).to_vec(),
            rows: self
                .rows
                .iter()
                .map(|row| {
                    vec![
                        row.label.clone(),
                        row.source.clone().unwrap_or_default(),
                        bytes(row.bytes_a),
                        bytes(row.bytes_b),
                        signed_bytes(row.delta),
                        match row.growth {
                            Growth::Factor(_) | Growth::New | Growth::Gone => row.growth.label(param),
                            _ => format!("{:.1}×, {}", row.factor.unwrap_or(1.0), row.growth.label(param)),
                        },
                    ]
                })
                .collect(),
            notes: self.notes.iter().map(|note| format!("note: {note}")).collect(),
            compact: false,
        }
    }

    pub fn to_text(&self) -> String {
        self.grid().to_text()
    }

    pub fn to_html(&self) -> String {
        self.grid().to_html()
    }

    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).expect("plain data serializes")
    }
}
