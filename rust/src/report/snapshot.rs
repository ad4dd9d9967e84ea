//! The current state as a table, as `gpuexp.snapshot()` and a new experiment show it.

use super::device_line;
use crate::grid::{prefixed, Grid};
use crate::snapshot::Snapshot;
use crate::units::{bytes, rfc3339};

/// The current state, as `gpuexp.snapshot()` and a new experiment show it.
pub fn snapshot_grid(snapshot: &Snapshot, title: &str) -> Grid {
    let host = &snapshot.host;
    let mut rows = vec![vec!["host RSS".into(), bytes(host.rss), "—".into(), "—".into()]];
    rows.push(vec![
        "host system".into(),
        bytes(host.total - host.available.min(host.total)),
        bytes(host.available),
        bytes(host.total),
    ]);
    if let Some(limit) = host.cgroup_limit {
        rows.push(vec!["host cgroup limit".into(), "—".into(), "—".into(), bytes(limit)]);
    }
    let mut lines = Vec::new();
    for gpu in &snapshot.gpus {
        lines.push(device_line(gpu.torch_index, gpu.nvml_index, &gpu.name, &gpu.uuid, gpu.total));
        let label = |what: &str| format!("cuda:{} {what}", gpu.torch_index);
        if let Some(t) = gpu.torch {
            rows.push(vec![label("torch allocated"), bytes(t.allocated), "—".into(), "—".into()]);
            rows.push(vec![label("torch reserved"), bytes(t.reserved), "—".into(), "—".into()]);
        }
        let process = gpu.process_used.map(bytes).unwrap_or_else(|| "n/a".into());
        rows.push(vec![label("NVML process"), process, "—".into(), "—".into()]);
        rows.push(vec![label("NVML device"), bytes(gpu.device_used), bytes(gpu.free), bytes(gpu.total)]);
    }
    Grid {
        title: format!("gpuexp · {title} · {}", rfc3339(snapshot.taken_at)),
        lines,
        // Host "available" (capped by the cgroup) and NVML "free": what a new allocation can get.
        header: ["memory", "used", "available", "total"].map(String::from).to_vec(),
        rows,
        notes: prefixed("note", &snapshot.notes),
        compact: false,
    }
}
