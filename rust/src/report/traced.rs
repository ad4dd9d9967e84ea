//! How a traced report shows where in the code: lines under its table for what the scope left
//! held (next to the leak hunter's holder where one keeps it) and where it ran out of memory,
//! each GPU's peak by source line below it, and the host's growth by source line
//! (`trace="host"`) last.

use std::collections::BTreeMap;

use super::{GpuReport, Holders, Report};
use crate::trace::{DeviceTrace, HeldBlock};
use crate::units::bytes;

/// Sites named in a line of the report's table.
const SITES_IN_A_LINE: usize = 5;

/// The sites of `blocks` with their bytes, largest first.
fn by_site<'a>(blocks: impl Iterator<Item = &'a HeldBlock>) -> Vec<(&'a str, u64)> {
    let mut by_site: BTreeMap<&str, u64> = BTreeMap::new();
    for block in blocks {
        *by_site.entry(block.site.label.as_str()).or_default() += block.bytes;
    }
    let mut sites: Vec<(&str, u64)> = by_site.into_iter().collect();
    sites.sort_by_key(|site| std::cmp::Reverse(site.1));
    sites
}

/// Where the blocks no named holder keeps were allocated (those a holder keeps are told next to it).
fn held_line(device: &DeviceTrace) -> Option<String> {
    let sites = by_site(device.still_held.iter().filter(|block| block.holders.is_empty()));
    let named: Vec<String> =
        sites.iter().take(SITES_IN_A_LINE).map(|(label, held)| format!("{label} ({})", bytes(*held))).collect();
    (!named.is_empty())
        .then(|| format!("still held on cuda:{}, allocated at: {}", device.torch_index, named.join(", ")))
}

impl Report {
    /// The GPUs a trace describes: those where torch's allocator moved or ran out of memory during
    /// the scope (a GPU it never used would only add an empty section), or all where none did.
    pub fn traced_devices(&self) -> Vec<u32> {
        let used = |gpu: &&GpuReport| {
            let moved = gpu.torch_allocated.as_ref().is_some_and(|m| m.peak != m.start || m.before_teardown != m.start);
            moved || gpu.num_ooms.is_some_and(|ooms| ooms > 0)
        };
        let used: Vec<u32> = self.gpus.iter().filter(used).map(|gpu| gpu.torch_index).collect();
        if used.is_empty() {
            self.gpus.iter().map(|gpu| gpu.torch_index).collect()
        } else {
            used
        }
    }

    /// The leak hunter's line for one device, each holder with where the blocks it keeps were
    /// allocated, where the trace matched them.
    pub(super) fn holders_line(&self, held: &Holders) -> String {
        let device = self.trace.iter().find(|d| format!("cuda:{}", d.torch_index) == held.device);
        held.line_with(|holder| {
            let blocks = device?.still_held.iter().filter(|block| block.holders.contains(&holder.path));
            let sites: Vec<&str> = by_site(blocks).into_iter().map(|(label, _)| label).collect();
            (!sites.is_empty()).then(|| sites.join(" and "))
        })
    }

    /// Under the table: where what is still held was allocated, and each out-of-memory's line.
    pub(super) fn trace_lines(&self) -> Vec<String> {
        let mut lines = Vec::new();
        for device in &self.trace {
            lines.extend(held_line(device));
            for oom in &device.ooms {
                let top = oom.live_then(1).map(|live| format!("; most live at {live}")).unwrap_or_default();
                lines.push(format!("out of memory on cuda:{} at {}{top}", device.torch_index, oom.failed_at()));
            }
        }
        lines
    }

    /// The report as text: its table, then each traced GPU's peak by source line, then the
    /// host's growth by source line.
    pub fn to_text(&self) -> String {
        let mut text = self.grid().to_text();
        for device in &self.trace {
            text.push_str("\n\n");
            text.push_str(&device.peak.to_text());
        }
        if let Some(host) = &self.host_trace {
            text.push_str("\n\n");
            text.push_str(&host.to_text());
        }
        text
    }

    /// The same as HTML, each site's stack collapsible.
    pub fn to_html(&self) -> String {
        let mut html = self.grid().to_html();
        for device in &self.trace {
            html.push_str(&device.peak.to_html());
        }
        if let Some(host) = &self.host_trace {
            html.push_str(&host.to_html());
        }
        html
    }
}
