//! Which GPU is a rank's own: the one its experiments cover when `devices=` names none.
//!
//! On an 8-GPU node a rank that reported every visible GPU would show seven idle ones, and the
//! gathered table eight times the rows. Torch.distributed's own answer comes first (the device
//! the group is bound to), then what the rank's code told torch (`set_device`), then what the
//! launcher told the rank (`LOCAL_RANK`), then, for ranks spawned on one node without any of
//! those, the rank itself.

/// What a rank's process says about its GPU, read by the bindings.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceClues {
    /// `init_process_group(device_id=...)`: the device the default group is bound to.
    pub bound: Option<u32>,
    /// torch's current device, once CUDA is initialised (asking earlier would initialise it).
    pub current: Option<u32>,
    /// `LOCAL_RANK`, as launchers set it.
    pub local_rank: Option<u32>,
    pub rank: u32,
    pub world_size: u32,
    /// GPUs this process sees (torch indices 0..visible).
    pub visible: u32,
}

/// How the rank's device was chosen, for the report's note.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Because {
    BoundByGroup,
    SetDevice,
    OnlyVisible,
    LocalRank,
    RankOnOneNode,
    CurrentDevice,
}

impl Because {
    pub fn describe(self) -> &'static str {
        match self {
            Because::BoundByGroup => "the device its process group is bound to",
            Because::SetDevice => "torch's current device, set by the rank",
            Because::OnlyVisible => "the only GPU it sees",
            Because::LocalRank => "its LOCAL_RANK",
            Because::RankOnOneNode => "its rank, as every rank fits on this node's GPUs",
            Because::CurrentDevice => "torch's current device",
        }
    }
}

/// The rank's own GPU (a torch index) and why, or None where nothing points to one (every
/// visible GPU is covered then).
pub fn rank_device(clues: &DeviceClues) -> Option<(u32, Because)> {
    let seen = |index: u32| index < clues.visible;
    if let Some(bound) = clues.bound.filter(|&b| seen(b)) {
        return Some((bound, Because::BoundByGroup));
    }
    // Device 0 is also torch's default: only another index proves the rank set it.
    if let Some(current) = clues.current.filter(|&c| c != 0 && seen(c)) {
        return Some((current, Because::SetDevice));
    }
    if clues.visible == 1 {
        return Some((0, Because::OnlyVisible));
    }
    if let Some(local) = clues.local_rank.filter(|&l| seen(l)) {
        return Some((local, Because::LocalRank));
    }
    if clues.world_size <= clues.visible && seen(clues.rank) {
        return Some((clues.rank, Because::RankOnOneNode));
    }
    clues.current.filter(|&c| seen(c)).map(|c| (c, Because::CurrentDevice))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn clues(rank: u32, world_size: u32, visible: u32) -> DeviceClues {
        DeviceClues { rank, world_size, visible, ..DeviceClues::default() }
    }

    #[test]
    fn the_group_s_bound_device_comes_first() {
        let c = DeviceClues { bound: Some(3), current: Some(1), local_rank: Some(2), ..clues(1, 8, 8) };
        assert_eq!(rank_device(&c), Some((3, Because::BoundByGroup)));
    }

    #[test]
    fn a_device_the_rank_set_beats_its_local_rank() {
        let c = DeviceClues { current: Some(5), local_rank: Some(2), ..clues(2, 8, 8) };
        assert_eq!(rank_device(&c), Some((5, Because::SetDevice)));
    }

    #[test]
    fn current_device_zero_is_torch_s_default_so_local_rank_decides() {
        let c = DeviceClues { current: Some(0), local_rank: Some(1), ..clues(1, 2, 2) };
        assert_eq!(rank_device(&c), Some((1, Because::LocalRank)));
    }

    #[test]
    fn a_rank_that_sees_one_gpu_uses_it_whatever_its_local_rank() {
        // CUDA_VISIBLE_DEVICES set per rank: LOCAL_RANK 3 names no index this process sees.
        let c = DeviceClues { local_rank: Some(3), ..clues(3, 4, 1) };
        assert_eq!(rank_device(&c), Some((0, Because::OnlyVisible)));
    }

    #[test]
    fn spawned_ranks_on_one_node_take_their_rank() {
        assert_eq!(rank_device(&clues(1, 2, 2)), Some((1, Because::RankOnOneNode)));
        assert_eq!(rank_device(&clues(1, 2, 4)), Some((1, Because::RankOnOneNode)));
    }

    #[test]
    fn ranks_of_several_nodes_without_local_rank_fall_back_to_the_current_device_or_none() {
        assert_eq!(rank_device(&clues(9, 16, 8)), None);
        let c = DeviceClues { current: Some(0), ..clues(9, 16, 8) };
        assert_eq!(rank_device(&c), Some((0, Because::CurrentDevice)));
    }

    #[test]
    fn indices_this_process_does_not_see_are_ignored() {
        let c = DeviceClues { bound: Some(7), local_rank: Some(6), ..clues(1, 2, 2) };
        assert_eq!(rank_device(&c), Some((1, Because::RankOnOneNode)));
        assert_eq!(rank_device(&clues(0, 1, 0)), None);
    }
}
