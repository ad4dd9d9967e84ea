//! This process's descendants on the GPUs: ranks a notebook launched (forked, spawned, or a
//! torchrun subprocess), DataLoader workers, anything started below the kernel. NVML lists the
//! compute processes of a device; a process is a descendant when its chain of parents in
//! /proc reaches this process. Nothing here ends a process: a person decides that.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::struct_wrappers::device::ProcessInfo;
use serde::{Deserialize, Serialize};

use crate::fork::PerProcess;
use crate::units::bytes;

/// A descendant holding memory on a GPU.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChildProcess {
    pub pid: u32,
    pub command: String,
    pub torch_index: u32,
    /// None where the driver withholds the figure.
    pub used: Option<u64>,
}

/// How long a verdict on a PID is trusted: a PID reused by an unrelated process within a
/// second, and on the GPU at once, is not worth a /proc walk every millisecond.
const VERDICT_TTL: Duration = Duration::from_secs(1);

/// Whether a process descends from this one, and when that was found, by the listed PID:
/// a forked child asks about its own descendants.
static VERDICTS: PerProcess<HashMap<u32, (bool, Instant)>> = PerProcess::new(HashMap::new);

/// The parent of a process, from /proc/<pid>/stat (its name may hold spaces and parentheses,
/// so the fields are read after the last ')').
fn parent_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.split_whitespace().nth(1)?.parse().ok()
}

/// Whether `pid` descends from `ancestor`, walking parents up to init.
fn descends_from(pid: u32, ancestor: u32) -> bool {
    let mut current = pid;
    // A bound, in case /proc changes under the walk into a loop.
    for _ in 0..64 {
        match parent_of(current) {
            Some(parent) if parent == ancestor => return true,
            Some(parent) if parent > 1 => current = parent,
            _ => return false,
        }
    }
    false
}

/// Whether a process is this process's descendant, cached for [`VERDICT_TTL`].
pub fn is_descendant(pid: u32) -> bool {
    let own = crate::fork::pid();
    if pid == own {
        return false;
    }
    let now = Instant::now();
    let mut verdicts = VERDICTS.lock();
    if let Some((verdict, at)) = verdicts.get(&pid) {
        if now.duration_since(*at) < VERDICT_TTL {
            return *verdict;
        }
    }
    if verdicts.len() > 1024 {
        verdicts.retain(|_, (_, at)| now.duration_since(*at) < VERDICT_TTL);
    }
    let verdict = descends_from(pid, own);
    verdicts.insert(pid, (verdict, now));
    verdict
}

/// What the descendants among a device's compute processes hold (their figures withheld count as 0).
pub fn held_by_descendants(processes: &[ProcessInfo]) -> u64 {
    processes
        .iter()
        .filter(|p| is_descendant(p.pid))
        .map(|p| match p.used_gpu_memory {
            UsedGpuMemory::Used(bytes) => bytes,
            UsedGpuMemory::Unavailable => 0,
        })
        .sum()
}

/// The lines a report shows for them: each named, and how to end it.
pub fn still_holding_lines(children: &[ChildProcess]) -> Vec<String> {
    if children.is_empty() {
        return Vec::new();
    }
    let mut lines: Vec<String> = children
        .iter()
        .map(|c| {
            let size = c.used.map(bytes).unwrap_or_else(|| "an unreported amount".into());
            format!("child process {} still holds {size} on cuda:{}: {}", c.pid, c.torch_index, c.command)
        })
        .collect();
    let pids: Vec<String> = children.iter().map(|c| c.pid.to_string()).collect();
    lines.push(format!("gpuexp ends no process: if they are strays, `kill {}` ends them", pids.join(" ")));
    lines
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::{Command, Stdio};

    fn listed(pid: u32, used: u64) -> ProcessInfo {
        ProcessInfo {
            pid,
            used_gpu_memory: UsedGpuMemory::Used(used),
            gpu_instance_id: None,
            compute_instance_id: None,
        }
    }

    #[test]
    fn children_and_grandchildren_are_descendants_others_are_not() {
        let mut child = Command::new("sleep").arg("5").spawn().unwrap();
        // A shell whose own child is the grandchild; it prints the grandchild's PID.
        let mut shell =
            Command::new("sh").args(["-c", "sleep 5 & echo $!; wait"]).stdout(Stdio::piped()).spawn().unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(shell.stdout.as_mut().unwrap()), &mut line).unwrap();
        let grandchild: u32 = line.trim().parse().unwrap();
        assert!(is_descendant(child.id()) && is_descendant(grandchild));
        assert!(!is_descendant(1) && !is_descendant(std::process::id()));
        let held = held_by_descendants(&[listed(child.id(), 3 << 30), listed(1, 5 << 30), listed(grandchild, 1 << 30)]);
        assert_eq!(held, 4 << 30);
        for process in [&mut child, &mut shell] {
            process.kill().unwrap();
            process.wait().unwrap();
        }
        let _ = Command::new("kill").arg(grandchild.to_string()).status();
    }

    #[test]
    fn the_parent_is_read_from_proc() {
        assert_eq!(parent_of(std::process::id()), Some(std::os::unix::process::parent_id()));
        assert_eq!(parent_of(u32::MAX), None);
    }

    #[test]
    fn strays_are_named_with_how_to_end_them() {
        let children = [
            ChildProcess {
                pid: 41,
                command: "python -m torch.distributed.run".into(),
                torch_index: 0,
                used: Some(1 << 30),
            },
            ChildProcess { pid: 42, command: "python worker.py".into(), torch_index: 1, used: None },
        ];
        let lines = still_holding_lines(&children);
        assert_eq!(lines[0], "child process 41 still holds 1.00 GiB on cuda:0: python -m torch.distributed.run");
        assert!(lines[1].contains("an unreported amount on cuda:1"));
        assert!(lines[2].contains("kill 41 42"), "{lines:?}");
        assert!(still_holding_lines(&[]).is_empty());
    }
}
