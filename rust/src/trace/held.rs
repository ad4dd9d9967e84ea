//! The sites of memory at two moments a report explains: the blocks still alive at the end of
//! the trace (what a scope did not give back), and the live set when an allocation failed.

use std::collections::HashMap;

use serde::ser::{SerializeMap, SerializeSeq};
use serde::{Serialize, Serializer};

use super::block::Block;
use super::parse::{Action, AllocationHistory, StackId};
use super::peak::{site_table_checked, SiteTable};
use super::replay::Replay;
use super::sites::{Attribution, Site, SiteKey};
use crate::error::Result;

/// A block alive at the end of the trace, and where it was allocated (its site shared with
/// every other block of the site: a leak of 20,000 blocks from one deep stack holds that stack
/// once).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct HeldBlock {
    pub addr: u64,
    pub bytes: u64,
    #[serde(flatten)]
    pub site: Site,
    /// The leak hunter's names for what keeps it alive (`cache[0]`), where they were matched.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub holders: Vec<String>,
}

/// Held blocks as a list of their fields, the `stack` given with the first block that has it
/// and the others saying `stack_of`, that block's index: written whole for each block, one
/// deep stack shared by 20,000 blocks would be 20,000 copies of it.
pub(super) fn each_stack_once<S: Serializer>(
    held: &[HeldBlock],
    serializer: S,
) -> std::result::Result<S::Ok, S::Error> {
    let mut first: HashMap<*const String, usize> = HashMap::new();
    let mut list = serializer.serialize_seq(Some(held.len()))?;
    for (index, block) in held.iter().enumerate() {
        let stack_of = *first.entry(block.site.stack.as_ptr()).or_insert(index);
        list.serialize_element(&Entry { block, stack_of: (stack_of != index).then_some(stack_of) })?;
    }
    return list.end();

    struct Entry<'a> {
        block: &'a HeldBlock,
        stack_of: Option<usize>,
    }

    impl Serialize for Entry<'_> {
        fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
            let (block, site) = (self.block, &self.block.site);
            let mut map = serializer.serialize_map(None)?;
            map.serialize_entry("addr", &block.addr)?;
            map.serialize_entry("bytes", &block.bytes)?;
            map.serialize_entry("label", &site.label)?;
            map.serialize_entry("source", &site.source)?;
            match self.stack_of {
                Some(earlier) => map.serialize_entry("stack_of", &earlier)?,
                None => map.serialize_entry("stack", &site.stack)?,
            }
            if !block.holders.is_empty() {
                map.serialize_entry("holders", &block.holders)?;
            }
            map.end()
        }
    }
}

/// The blocks alive at the end with their sites; only those at `addresses` when given (the
/// storages the leak hunter found), in that order, skipping addresses the trace has no live
/// block at.
pub fn still_held(replay: &Replay, attribution: &Attribution, addresses: Option<&[u64]>) -> Vec<HeldBlock> {
    super::unstoppable(|keep_going| still_held_checked(replay, attribution, addresses, keep_going))
}

/// `still_held`, asking `keep_going` every so many blocks whether to go on.
pub(super) fn still_held_checked(
    replay: &Replay,
    attribution: &Attribution,
    addresses: Option<&[u64]>,
    keep_going: &mut dyn FnMut() -> Result<()>,
) -> Result<Vec<HeldBlock>> {
    let blocks: Vec<&Block> = match addresses {
        None => replay.live_at_end().collect(),
        Some(addresses) => {
            let live: HashMap<u64, &Block> = replay.live_at_end().map(|b| (b.addr, b)).collect();
            addresses.iter().filter_map(|addr| live.get(addr).copied()).collect()
        }
    };
    // A leak is often many blocks from one line: each site is named once.
    let mut named: HashMap<(SiteKey, StackId), Site> = HashMap::new();
    let mut held = Vec::with_capacity(blocks.len());
    for (n, block) in blocks.into_iter().enumerate() {
        super::ask_every(n, keep_going)?;
        let key = attribution.key(replay, block);
        let site = named.entry((key, block.stack)).or_insert_with(|| attribution.site(replay, key, block.stack));
        held.push(HeldBlock { addr: block.addr, bytes: block.bytes, site: site.clone(), holders: Vec::new() });
    }
    Ok(held)
}

/// An allocation that failed: where, and what was live then.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct OomSites {
    pub event: usize,
    pub time_us: i64,
    /// What was asked for.
    pub requested: u64,
    /// What CUDA had free.
    pub device_free: u64,
    /// The failed allocation's site.
    pub site: Site,
    /// The blocks live at that moment, by site.
    pub live: SiteTable,
}

impl OomSites {
    /// `In [7], line 2 `huge = torch.empty(...)`, asking 1.00 PiB`
    pub fn failed_at(&self) -> String {
        let source = self.site.source.as_deref().map(|s| format!(" `{s}`")).unwrap_or_default();
        format!("{}{source}, asking {}", self.site.label, crate::units::bytes(self.requested))
    }

    /// Whether this is the failure torch's message describes (see `message_matches`).
    pub fn matches_message(&self, asked: u64) -> bool {
        message_matches(self.requested, asked)
    }

    /// The top `count` sites live when it failed: `In [6], line 1 (1.00 GiB, 97%); ...`.
    pub fn live_then(&self, count: usize) -> Option<String> {
        let sites: Vec<String> = self
            .live
            .sites
            .iter()
            .take(count)
            .map(|s| format!("{} ({}, {:.0}%)", s.label, crate::units::bytes(s.bytes), s.share * 100.0))
            .collect();
        (!sites.is_empty()).then(|| sites.join("; "))
    }
}

/// Whether an OOM that asked for `requested` is the one torch's message describes with `asked`
/// (two decimals of a unit): the segment torch tried to make for the request (2 MiB for 1 MiB or
/// less, 20 MiB below 10 MiB, else the request rounded up to 2 MiB), or, with expandable
/// segments, the request itself.
pub fn message_matches(requested: u64, asked: u64) -> bool {
    const MIB: u64 = 1 << 20;
    let segment = match requested {
        small if small <= MIB => 2 * MIB,
        medium if medium < 10 * MIB => 20 * MIB,
        large => large.div_ceil(2 * MIB) * 2 * MIB,
    };
    let near = |expected: u64| asked.abs_diff(expected) <= expected / 100;
    near(segment) || near(requested)
}

/// The most out-of-memory errors of one trace that are analysed, the first ones from the
/// window's start: each walks every block live then, and a file may hold hundreds of thousands
/// (a loop that catches the error and retries). The others are counted.
pub const OOMS_ANALYSED: usize = 100;

/// The OOMs of a trace from a moment on: the first `OOMS_ANALYSED`, and how many more there are.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Ooms {
    pub analysed: Vec<OomSites>,
    pub not_analysed: usize,
}

impl Ooms {
    /// What a report says of the OOMs it did not analyse.
    pub fn note(&self) -> Option<String> {
        (self.not_analysed > 0).then(|| {
            format!(
                "{} out-of-memory errors in the trace: the first {} are analysed (their line and what was live \
                 then), the other {} only counted",
                self.analysed.len() + self.not_analysed,
                self.analysed.len(),
                self.not_analysed
            )
        })
    }
}

/// Every OOM in `replay`'s trace, in order (the first `OOMS_ANALYSED`).
pub fn oom(snapshot: &AllocationHistory, replay: &Replay, attribution: &Attribution, top: usize) -> Vec<OomSites> {
    super::unstoppable(|keep_going| oom_checked(snapshot, replay, attribution, top, i64::MIN, keep_going)).analysed
}

/// The OOMs at or after `since_us`, asking `keep_going` at each one analysed (each walks every
/// block) whether to go on.
pub(super) fn oom_checked(
    snapshot: &AllocationHistory,
    replay: &Replay,
    attribution: &Attribution,
    top: usize,
    since_us: i64,
    keep_going: &mut dyn FnMut() -> Result<()>,
) -> Result<Ooms> {
    let events = snapshot.device_traces.get(replay.device).map(Vec::as_slice).unwrap_or(&[]);
    let mut ooms = Ooms::default();
    let failed =
        events.iter().enumerate().filter(|(_, event)| event.action == Action::Oom && event.time_us >= since_us);
    for (index, event) in failed {
        if ooms.analysed.len() == OOMS_ANALYSED {
            ooms.not_analysed += 1;
            continue;
        }
        keep_going()?;
        // The failed allocation as a block that never lived, to ask for its site.
        let failed = Block {
            addr: event.addr,
            bytes: event.size,
            requested: event.size,
            stack: event.stack,
            alloc_event: Some(index),
            free_event: Some(index),
            module: None,
            exact: true,
            sites: super::block::SiteSource::Own,
        };
        let live: Vec<&Block> = replay.live_at(index).collect();
        ooms.analysed.push(OomSites {
            event: index,
            time_us: event.time_us,
            requested: event.size,
            device_free: event.device_free,
            site: attribution.site(replay, attribution.key(replay, &failed), event.stack),
            live: site_table_checked(replay, attribution, &live, top, keep_going)?,
        });
    }
    Ok(ooms)
}
