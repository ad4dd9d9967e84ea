//! Which holder the leak hunter named keeps each block still alive at a scope's end, so that a
//! report says where a named holder's memory was allocated. A tensor's storage lies inside the
//! caching allocator's block: its data pointer falls within `[addr, addr + bytes)`.

use super::held::HeldBlock;
use super::scope::DeviceTrace;

/// A holder the leak hunter named on one GPU, and the storages it keeps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HolderStorages {
    pub torch_index: u32,
    /// How the hunter names it: `cache[0]`, `model.encoder.weight`.
    pub path: String,
    /// (data pointer, bytes) of each storage.
    pub storages: Vec<(u64, u64)>,
}

/// The block of `held` (sorted by address) that contains `pointer`.
fn block_containing(held: &mut [HeldBlock], pointer: u64) -> Option<&mut HeldBlock> {
    let after = held.partition_point(|block| block.addr <= pointer);
    let block = &mut held[after.checked_sub(1)?];
    (pointer < block.addr.saturating_add(block.bytes)).then_some(block)
}

/// Gives each still-held block of `devices` the paths of the holders whose storages lie in it;
/// the blocks stay largest first.
pub fn name_holders(devices: &mut [DeviceTrace], holders: &[HolderStorages]) {
    for device in devices {
        device.still_held.sort_by_key(|block| block.addr);
        for holder in holders.iter().filter(|h| h.torch_index == device.torch_index) {
            for &(pointer, _) in &holder.storages {
                if let Some(block) = block_containing(&mut device.still_held, pointer) {
                    if !block.holders.contains(&holder.path) {
                        block.holders.push(holder.path.clone());
                    }
                }
            }
        }
        device.still_held.sort_by_key(|block| std::cmp::Reverse(block.bytes));
    }
}
