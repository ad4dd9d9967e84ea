//! The moment `memory_allocated` peaked, by site: the top sites with their bytes and share,
//! the rest, and the same category split `estimate` uses.

use std::collections::HashMap;

use serde::Serialize;

use super::block::{Block, SiteSource};
use super::replay::{Completeness, Peak, PeakBounds, Replay};
use super::sampling::Sampling;
use super::sites::{Attribution, SiteKey, StackText};
use crate::error::Result;
use crate::estimate::Category;
use crate::grid::{escape, prefixed, Grid};
use crate::units::bytes;

/// How many sites a table shows before "the rest" when the caller does not say.
pub const TOP_SITES: usize = 10;

/// One site's blocks live at a moment.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SiteRow {
    pub label: String,
    pub source: Option<String>,
    pub bytes: u64,
    pub blocks: usize,
    /// Of the total at that moment, 0 to 1.
    pub share: f64,
    /// The full stack of its largest block, innermost first.
    pub stack: StackText,
}

/// Everything past the top sites, together.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Rest {
    pub sites: usize,
    pub bytes: u64,
    pub blocks: usize,
    pub share: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CategoryRow {
    /// `estimate`'s category label, or "before recording" where the frames cannot tell.
    pub category: String,
    pub bytes: u64,
    pub share: f64,
}

/// The live blocks of one moment grouped by site.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SiteTable {
    pub total: u64,
    pub sites: Vec<SiteRow>,
    pub rest: Rest,
    pub categories: Vec<CategoryRow>,
    /// Every site, largest first (`sites` and `rest` together), for diffs.
    #[serde(skip)]
    pub all: Vec<SiteRow>,
}

/// The live set at the peak of one device's trace, by site.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PeakSites {
    pub device: usize,
    pub peak: Peak,
    #[serde(flatten)]
    pub table: SiteTable,
    pub completeness: Completeness,
    /// Where the true peak lies, where block sizes alive then were inferred (a file from
    /// elsewhere); None when the peak is exact.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bounds: Option<PeakBounds>,
    /// Torch's own `max_memory_allocated` over the window, where the snapshot carries it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub true_peak: Option<u64>,
    /// How the sites were found where gpuexp sampled the stacks: on which steps, and how much of
    /// the peak was attributed directly, mapped from a sampled step, or not at all.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sampling: Option<Sampling>,
}

/// Groups `blocks` by site: the top `top` sites, the rest, and the categories.
pub fn site_table(replay: &Replay, attribution: &Attribution, blocks: &[&Block], top: usize) -> SiteTable {
    super::unstoppable(|keep_going| site_table_checked(replay, attribution, blocks, top, keep_going))
}

/// `site_table`, asking `keep_going` every so many blocks whether to go on.
pub(super) fn site_table_checked(
    replay: &Replay,
    attribution: &Attribution,
    blocks: &[&Block],
    top: usize,
    keep_going: &mut dyn FnMut() -> Result<()>,
) -> Result<SiteTable> {
    let total: u64 = blocks.iter().map(|block| block.bytes).sum();
    let share = |part: u64| if total == 0 { 0.0 } else { part as f64 / total as f64 };
    // Per site: bytes, blocks, and its largest block's stack (the one most worth reading).
    let mut by_site: HashMap<SiteKey, (u64, usize, &Block)> = HashMap::new();
    let mut by_category: HashMap<Option<Category>, u64> = HashMap::new();
    let mut unattributed = 0u64;
    for (n, &block) in blocks.iter().enumerate() {
        super::ask_every(n, keep_going)?;
        let entry = by_site.entry(attribution.key(replay, block)).or_insert((0, 0, block));
        entry.0 += block.bytes;
        entry.1 += 1;
        if block.bytes > entry.2.bytes {
            entry.2 = block;
        }
        if block.sites == SiteSource::Unattributed {
            unattributed += block.bytes;
        } else {
            *by_category.entry(attribution.category(replay, block)).or_default() += block.bytes;
        }
    }
    let all: Vec<SiteRow> = by_site
        .into_iter()
        .map(|(key, (site_bytes, count, largest))| {
            let site = attribution.site(replay, key, largest.stack);
            SiteRow {
                label: site.label,
                source: site.source,
                bytes: site_bytes,
                blocks: count,
                share: 0.0,
                stack: site.stack,
            }
        })
        .collect();
    let mut categories: Vec<CategoryRow> = Category::ALL
        .iter()
        .map(|&category| Some(category))
        .chain([None])
        .filter_map(|category| {
            let part = *by_category.get(&category)?;
            let label = category.map_or("before recording", Category::label).to_string();
            Some(CategoryRow { category: label, bytes: part, share: share(part) })
        })
        .chain((unattributed > 0).then(|| CategoryRow {
            category: "unattributed (a step without stacks)".into(),
            bytes: unattributed,
            share: share(unattributed),
        }))
        .collect();
    categories.sort_by_key(|row| std::cmp::Reverse(row.bytes));
    Ok(SiteTable::ranked(all, total, top, categories))
}

/// The peak of `replay`, by site.
pub fn peak_sites(replay: &Replay, attribution: &Attribution, top: usize) -> PeakSites {
    let live = replay.live_at_peak();
    PeakSites {
        device: replay.device,
        peak: replay.peak,
        table: site_table(replay, attribution, &live, top),
        completeness: replay.completeness.clone(),
        bounds: replay.peak_bounds(0),
        true_peak: None,
        sampling: super::sampling::summary(replay, i64::MIN, &live),
    }
}

fn percent(share: f64) -> String {
    format!("{:.0}%", share * 100.0)
}

impl SiteTable {
    /// `all` sites largest first: the top `top`, the rest together, each with its share of `total`.
    pub fn ranked(mut all: Vec<SiteRow>, total: u64, top: usize, categories: Vec<CategoryRow>) -> SiteTable {
        let share = |part: u64| if total == 0 { 0.0 } else { part as f64 / total as f64 };
        for row in &mut all {
            row.share = share(row.bytes);
        }
        all.sort_by(|a, b| b.bytes.cmp(&a.bytes).then_with(|| a.label.cmp(&b.label)));
        let sites: Vec<SiteRow> = all.iter().take(top).cloned().collect();
        let past = &all[sites.len()..];
        let rest_bytes = past.iter().map(|row| row.bytes).sum();
        let rest = Rest {
            sites: past.len(),
            bytes: rest_bytes,
            blocks: past.iter().map(|row| row.blocks).sum(),
            share: share(rest_bytes),
        };
        SiteTable { total, sites, rest, categories, all }
    }

    /// The sites as a table under `title`.
    pub fn grid(&self, title: String, notes: Vec<String>) -> Grid {
        self.grid_counting("blocks", title, notes)
    }

    /// The same, its count column named `counted` (blocks, allocations).
    pub fn grid_counting(&self, counted: &str, title: String, notes: Vec<String>) -> Grid {
        let mut rows: Vec<Vec<String>> = self
            .sites
            .iter()
            .map(|row| {
                vec![
                    row.label.clone(),
                    row.source.clone().unwrap_or_default(),
                    bytes(row.bytes),
                    row.blocks.to_string(),
                    percent(row.share),
                ]
            })
            .collect();
        if self.rest.sites > 0 {
            rows.push(vec![
                format!("the rest ({} sites)", self.rest.sites),
                String::new(),
                bytes(self.rest.bytes),
                self.rest.blocks.to_string(),
                percent(self.rest.share),
            ]);
        }
        Grid {
            title,
            lines: Vec::new(),
            header: ["site", "line", "bytes", counted, "share"].map(String::from).to_vec(),
            rows,
            notes,
            compact: false,
        }
    }

    /// The category split as a table.
    pub fn category_grid(&self) -> Grid {
        Grid {
            title: "By category (from the frames; see docs/trace.md)".into(),
            lines: Vec::new(),
            header: ["category", "bytes", "share"].map(String::from).to_vec(),
            rows: self
                .categories
                .iter()
                .map(|row| vec![row.category.clone(), bytes(row.bytes), percent(row.share)])
                .collect(),
            notes: Vec::new(),
            compact: false,
        }
    }

    /// Each top site's stack, collapsible.
    pub fn stacks_html(&self) -> String {
        let mut out = String::from("<div class=\"gpuexp\">");
        for row in &self.sites {
            out.push_str(&format!(
                "<details><summary>{} ({})</summary><pre>{}</pre></details>",
                escape(&row.label),
                bytes(row.bytes),
                escape(&row.stack.join("\n"))
            ));
        }
        out.push_str("</div>");
        out
    }
}

impl PeakSites {
    fn title(&self) -> String {
        format!("At the peak on GPU {}: {} allocated", self.device, bytes(self.peak.bytes))
    }

    fn notes(&self) -> Vec<String> {
        let mut notes = self.completeness.unknown.clone();
        notes.extend(self.exactness());
        notes.extend(self.sampling.as_ref().map(Sampling::describe));
        prefixed("note", &notes)
    }

    /// How exact the peak is, where it may not be: the bound of the error, and torch's own
    /// peak where the snapshot carries it and the replay does not meet it.
    pub fn exactness(&self) -> Vec<String> {
        let mut lines = Vec::new();
        if let Some(bounds) = self.bounds {
            lines.push(format!(
                "{} block sizes were inferred from the sizes asked for: the true peak lies between {} and {} \
                 (up to {} above the one shown, {} below)",
                self.completeness.inferred_sizes,
                bytes(bounds.at_least),
                bytes(bounds.at_most),
                bytes(bounds.at_most.saturating_sub(self.peak.bytes)),
                bytes(self.peak.bytes.saturating_sub(bounds.at_least)),
            ));
        }
        if let Some(true_peak) = self.true_peak.filter(|&t| t != self.peak.bytes) {
            lines.push(format!(
                "torch counted a peak of {} ({true_peak} bytes) over the experiment; the replay's is {} ({} bytes)",
                bytes(true_peak),
                bytes(self.peak.bytes),
                self.peak.bytes
            ));
        }
        lines
    }

    pub fn to_text(&self) -> String {
        format!("{}\n\n{}", self.table.grid(self.title(), self.notes()).to_text(), self.table.category_grid().to_text())
    }

    pub fn to_html(&self) -> String {
        format!(
            "{}{}{}",
            self.table.grid(self.title(), self.notes()).to_html(),
            self.table.stacks_html(),
            self.table.category_grid().to_html()
        )
    }

    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).expect("plain data serializes")
    }
}
