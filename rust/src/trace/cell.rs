//! A notebook cell's torch peak by site, for the cell log's block: the line that allocated most
//! of what the cell had live at its peak (`cuda:0 peak +2.10 GiB, 71% at In [9], line 14`).

use serde::{Deserialize, Serialize};

use super::block::Block;
use super::parse::AllocationHistory;
use super::peak::{site_table, SiteRow};
use super::replay::{replay, Replay};
use super::scope::peak_since;
use super::sites::Attribution;
use crate::units::bytes;

/// The top site of one GPU's peak in one cell.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CellPeakSite {
    pub torch_index: u32,
    /// How far torch allocated rose above where the cell began (the block's own figure).
    pub peak_above_start: u64,
    /// `In [9], line 14`, or `train.py:41`.
    pub label: String,
    pub source: Option<String>,
    /// What that site had live at the cell's peak.
    pub bytes: u64,
    /// Of what the cell allocated and had live at its peak, 0 to 1.
    pub share: f64,
}

impl CellPeakSite {
    /// `cuda:0 peak +2.10 GiB, 71% at In [9], line 14: y = x @ x`.
    pub fn line(&self) -> String {
        let source = self.source.as_deref().map(|s| format!(": {s}")).unwrap_or_default();
        format!(
            "cuda:{} peak +{}, {:.0}% at {}{source}",
            self.torch_index,
            bytes(self.peak_above_start),
            self.share * 100.0,
            self.label
        )
    }
}

/// The site that allocated most of what was live at the highest point from `since_us` on,
/// counting only blocks allocated from `since_us` on (what the cell itself made: a model loaded
/// earlier is no cell's peak). None when nothing rose above where the window opened.
pub fn cell_top_site(replay: &Replay, attribution: &Attribution, since_us: i64) -> Option<SiteRow> {
    let first = replay.time_us.iter().position(|&t| t >= since_us)?;
    let event = peak_since(replay, since_us).event.filter(|&event| event >= first)?;
    let made_here: Vec<&Block> =
        replay.live_at(event).filter(|block| block.alloc_event.is_some_and(|a| a >= first)).collect();
    site_table(replay, attribution, &made_here, 1).sites.into_iter().next()
}

/// The top site of each GPU in `moved` (torch index, how far its torch peak rose in the cell),
/// from the cell's start `since_us` on; a GPU whose trace holds nothing of the cell is left out.
pub fn cell_peak_sites(
    snapshot: &AllocationHistory,
    moved: &[(u32, u64)],
    max_entries: Option<usize>,
    since_us: i64,
    attribution: &Attribution,
) -> Vec<CellPeakSite> {
    moved
        .iter()
        .filter_map(|&(torch_index, peak_above_start)| {
            let replayed = replay(snapshot, torch_index as usize, max_entries);
            let top = cell_top_site(&replayed, attribution, since_us)?;
            Some(CellPeakSite {
                torch_index,
                peak_above_start,
                label: top.label,
                source: top.source,
                bytes: top.bytes,
                share: top.share,
            })
        })
        .collect()
}
