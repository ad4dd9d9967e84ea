//! Who published a report: its rank in a distributed run, as top-level keys of its JSON.

use std::fs;

use serde::{Deserialize, Serialize};

/// Who a process is in a distributed run; every field absent outside one.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankIdentity {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local_rank: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub world_size: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
}

impl RankIdentity {
    /// From the initialised process group (`group`: rank and world size) or, without one, from
    /// `RANK` and `WORLD_SIZE` (torchrun and most launchers set both). `LOCAL_RANK` where set.
    pub fn detect(group: Option<(u32, u32)>, env: impl Fn(&str) -> Option<String>) -> RankIdentity {
        let number = |name: &str| env(name).and_then(|v| v.trim().parse::<u32>().ok());
        let (rank, world_size) = match group {
            Some((rank, world_size)) => (rank, world_size),
            None => match (number("RANK"), number("WORLD_SIZE")) {
                (Some(rank), Some(world_size)) if rank < world_size => (rank, world_size),
                _ => return RankIdentity::default(),
            },
        };
        RankIdentity {
            rank: Some(rank),
            local_rank: number("LOCAL_RANK"),
            world_size: Some(world_size),
            hostname: Some(hostname()),
        }
    }

    /// Rank and world size, when this is a rank.
    pub fn position(&self) -> Option<(u32, u32)> {
        self.rank.zip(self.world_size)
    }

    /// How a report introduces its rank.
    pub fn line(&self) -> Option<String> {
        let (rank, world_size) = self.position()?;
        let local = self.local_rank.map(|l| format!(" (local rank {l})")).unwrap_or_default();
        let host = self.hostname.as_deref().map(|h| format!(" on {h}")).unwrap_or_default();
        Some(format!("rank {rank} of {world_size}{local}{host}"))
    }
}

/// This machine's name, as its UTS namespace has it.
pub fn hostname() -> String {
    fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "?".into())
}
