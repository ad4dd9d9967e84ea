//! A snapshot file from elsewhere (a cluster job's dump, a colleague's): read only from a
//! regular file and without waiting on it, told apart from a compressed one by its first
//! bytes, parsed with checks for Ctrl-C, and refused where what it adds up to is more than any
//! device holds.

use std::path::Path;

use super::parse::{AllocationHistory, MAX_SIZE};
use super::scope::DeviceTrace;
use crate::error::{Error, Result};

/// What `load_snapshot` wants, for the errors that refuse something else.
const SNAPSHOT_FILE: &str = "load_snapshot reads a snapshot file, written by torch.cuda.memory._dump_snapshot(path) \
                             or pickle.dump(torch.cuda.memory._snapshot(), f)";

/// What a trace read from a file that holds no allocation history says instead of tables.
pub const NO_HISTORY: &str = "this snapshot holds no allocation history: no GPU's trace and no segment. Torch \
                              records one only on a CUDA device, between torch.cuda.memory._record_memory_history() \
                              and the snapshot (a CPU-only process dumps an empty one)";

/// The file's bytes and the snapshot they hold, a file that starts as no pickle refused before
/// the rest is read. `keep_going` is asked every few milliseconds (between chunks of the read,
/// by work done in the parse); its error stops the load.
pub fn read(path: &Path, keep_going: &mut dyn FnMut() -> Result<()>) -> Result<(Vec<u8>, AllocationHistory)> {
    let check_start = |start: &[u8]| {
        refuse_compressed(path, start)?;
        AllocationHistory::check_start(start)
    };
    let bytes = crate::files::read_regular(path, SNAPSHOT_FILE, &check_start, keep_going)?;
    let snapshot = AllocationHistory::from_pickle_checked(&bytes, keep_going)?;
    Ok((bytes, snapshot))
}

/// A compressed file or an archive is named as such, with the command that gives the pickle.
fn refuse_compressed(path: &Path, bytes: &[u8]) -> Result<()> {
    let shown = path.display();
    let (what, fix) = match bytes {
        [0x1f, 0x8b, ..] => {
            ("gzip-compressed", format!("decompress it first (gunzip -k {shown}) and load the file that gives"))
        }
        [0x28, 0xb5, 0x2f, 0xfd, ..] => {
            ("zstd-compressed", format!("decompress it first (zstd -d {shown}) and load the file that gives"))
        }
        [0xfd, b'7', b'z', b'X', b'Z', 0, ..] => {
            ("xz-compressed", format!("decompress it first (unxz -k {shown}) and load the file that gives"))
        }
        [b'B', b'Z', b'h', ..] => {
            ("bzip2-compressed", format!("decompress it first (bunzip2 -k {shown}) and load the file that gives"))
        }
        [b'P', b'K', 3, 4, ..] => (
            "a zip archive (torch.save writes one)",
            "write the snapshot with torch.cuda.memory._dump_snapshot(path) or pickle.dump(snapshot, f) instead".into(),
        ),
        _ => return Ok(()),
    };
    Err(Error::InvalidArgument(format!("{shown} is {what}, not a pickled snapshot: {fix}")))
}

/// Each block is at most `MAX_SIZE` (the parse saw to that), but a file may hold many alive at
/// once: a peak past what any device holds is refused, not shown.
pub fn refuse_impossible_peaks(traces: &[DeviceTrace]) -> Result<()> {
    match traces.iter().find(|trace| trace.peak.peak.bytes > MAX_SIZE) {
        Some(trace) => Err(Error::InvalidArgument(format!(
            "this snapshot adds up to a peak of {} on GPU {}, more than any device holds ({} at most): the file was \
             not written by torch, or was damaged",
            crate::units::bytes(trace.peak.peak.bytes),
            trace.torch_index,
            crate::units::bytes(MAX_SIZE)
        ))),
        None => Ok(()),
    }
}
