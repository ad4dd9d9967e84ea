//! The figures torch writes into its CUDA out-of-memory message, read back: where no observer
//! ran at the failure (gpuexp was not active yet, or another allocator raised it), they are the
//! only figures taken at the failure rather than after the exception unwound.
//!
//! Torch 2.1 to 2.11 write (2.1 spelled "capacty"; 2.2 on add ", with … allocated in private
//! pools (e.g., CUDA Graphs)," where CUDA graphs hold memory):
//! `CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of
//! which 1.06 GiB is free. Process 7 has 4.00 GiB memory in use. Including non-PyTorch memory,
//! this process has 74.12 GiB memory in use. 40.00 GiB allowed; Of the allocated memory 72.10 GiB
//! is allocated by PyTorch, and 1.02 GiB is reserved by PyTorch but unallocated. …`
//! Torch 2.0 and older wrote `(GPU 0; 79.19 GiB total capacity; 77.71 GiB already allocated;
//! 3.06 MiB free; 78.40 GiB reserved in total by PyTorch)`, read here too.

use serde::Serialize;

use crate::units::{size_in_bytes, MAX_SIZE};

/// What torch's message says about the failure; each figure is None where the message has none.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct OomMessage {
    /// "Tried to allocate": the segment torch asked the driver for.
    pub requested: Option<u64>,
    pub device: Option<u32>,
    /// The device's total capacity.
    pub capacity: Option<u64>,
    /// Free on the device, as the CUDA driver said at the failure.
    pub free: Option<u64>,
    /// This process's use of the device, torch's and the rest ("Including non-PyTorch memory").
    pub process_used: Option<u64>,
    /// Other processes on the device, by pid ("Process 7 has 4.00 GiB memory in use").
    pub others: Vec<(u32, u64)>,
    /// The per-process cap `set_per_process_memory_fraction` set ("40.00 GiB allowed").
    pub allowed: Option<u64>,
    /// Allocated by torch, CUDA graphs' private pools included.
    pub allocated: Option<u64>,
    /// Reserved by torch's allocator but not allocated.
    pub reserved_unallocated: Option<u64>,
}

impl OomMessage {
    pub fn parse(message: &str) -> OomMessage {
        let old = message.contains("reserved in total by PyTorch");
        let device = message.split("GPU ").nth(1).and_then(|rest| {
            let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
            digits.parse().ok()
        });
        let allocated =
            size_after(message, "Of the allocated memory ").or_else(|| size_before(message, " already allocated"));
        let reserved_unallocated = size_before(message, " is reserved by PyTorch but unallocated").or_else(|| {
            let reserved = size_before(message, " reserved in total by PyTorch")?;
            Some(reserved.saturating_sub(allocated?))
        });
        let mut others = Vec::new();
        for piece in message.split("Process ").skip(1) {
            let digits: String = piece.chars().take_while(char::is_ascii_digit).collect();
            let used = piece.strip_prefix(digits.as_str()).and_then(|rest| size_after(rest, " has "));
            if let (Ok(pid), Some(used)) = (digits.parse(), used) {
                others.push((pid, used));
            }
        }
        OomMessage {
            requested: size_after(message, "Tried to allocate "),
            device,
            capacity: size_after(message, "total capacity of ")
                .or_else(|| size_after(message, "total capacty of "))
                .or_else(|| size_before(message, " total capacity")),
            free: size_after(message, " of which ").or_else(|| old.then(|| size_before(message, " free;")).flatten()),
            process_used: size_after(message, "this process has "),
            others,
            allowed: size_before(message, " allowed;"),
            allocated,
            reserved_unallocated,
        }
    }
}

/// A size as torch writes one ("2.00 GiB", "512 bytes"); None for a figure beyond any device
/// (torch writes 17179869184.00 GiB where NVML could not say).
fn size(number: &str, unit: &str) -> Option<u64> {
    let unit = unit.trim_end_matches(['.', ';', ',', ')']);
    size_in_bytes(number, unit).map(|n| n.round() as u64).filter(|&n| n <= MAX_SIZE)
}

/// The size written right after the first `phrase`.
fn size_after(text: &str, phrase: &str) -> Option<u64> {
    let mut words = text.split(phrase).nth(1)?.split_whitespace();
    size(words.next()?, words.next()?)
}

/// The size written right before the first `phrase`.
fn size_before(text: &str, phrase: &str) -> Option<u64> {
    let before = &text[..text.find(phrase)?];
    let mut words = before.rsplit([' ', '(', ';', '\n']).filter(|w| !w.is_empty());
    let unit = words.next()?;
    size(words.next()?, unit)
}

#[cfg(test)]
#[path = "oom_message_tests.rs"]
mod tests;
