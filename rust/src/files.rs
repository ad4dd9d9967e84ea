//! Files at paths a user names: what gpuexp reads is a regular file opened without waiting, and
//! every file it writes whole (a snapshot, the history, a figure) is written by one writer that
//! replaces the target atomically.
//!
//! The writer's guarantee: the target is the old file or the new one, never a mix or a cut-off
//! file. The bytes go to a temporary file beside the target, created with `O_EXCL | O_NOFOLLOW`
//! under a name with 64 random bits (a link planted at any name is never followed, and a name
//! can't be guessed ahead; a long target name is shortened in it, so that any name the file
//! system takes can be written), synced, given the old file's mode without its setuid and
//! setgid bits (a new file gets the umask's default), then renamed over the target, and the
//! directory is synced. The temporary file is
//! removed on any failure, a panic included; a Python caller's interrupt waits for the write,
//! which releases the GIL, to end. A symbolic link at the target itself is replaced by the
//! file, not written through.

use std::ffi::OsString;
use std::fs::{File, Metadata, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// Refuses what is not a regular file (a FIFO blocks whoever opens it, a device never ends, a
/// socket is no file). `fix` says what the caller wants instead.
pub fn refuse_special(path: &Path, meta: &Metadata, fix: &str) -> Result<()> {
    let kind = meta.file_type();
    let what = if kind.is_fifo() {
        "a FIFO (named pipe)"
    } else if kind.is_socket() {
        "a socket"
    } else if kind.is_char_device() || kind.is_block_device() {
        "a device"
    } else if kind.is_dir() {
        "a directory"
    } else {
        return Ok(());
    };
    Err(Error::InvalidArgument(format!("{} is {what}, not a regular file: {fix}", path.display())))
}

/// How much of a file `read_regular` reads before `check_start` judges it.
pub const START: usize = 4096;

/// A regular file's bytes, read without ever waiting on it: `O_NONBLOCK` makes opening a FIFO
/// return at once, and what was opened is checked before a byte is read, so a special file
/// swapped in after any earlier check is refused too. Its first `START` bytes go to
/// `check_start` before the rest is read, so a large file of the wrong kind is refused at
/// once; the room for the rest is asked for, not assumed (a file too large for memory is an
/// error, not an abort). `keep_going` is asked between chunks of 64 MiB: an error from it
/// stops the read.
pub fn read_regular(
    path: &Path,
    fix: &str,
    check_start: &dyn Fn(&[u8]) -> Result<()>,
    keep_going: &mut dyn FnMut() -> Result<()>,
) -> Result<Vec<u8>> {
    let cannot = |e: std::io::Error| Error::Io(format!("{}: cannot read it ({e})", path.display()));
    let opened = OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC).open(path);
    let mut file = match opened {
        Ok(file) => file,
        // Opening a UNIX socket fails (ENXIO): say what it is, as for one opened.
        Err(e) => match std::fs::metadata(path) {
            Ok(meta) => refuse_special(path, &meta, fix).and(Err(cannot(e)))?,
            Err(_) => return Err(cannot(e)),
        },
    };
    let meta = file.metadata().map_err(cannot)?;
    refuse_special(path, &meta, fix)?;
    let mut bytes = Vec::new();
    (&mut file).take(START as u64).read_to_end(&mut bytes).map_err(cannot)?;
    check_start(&bytes)?;
    reserve_for(&mut bytes, meta.len(), path, fix)?;
    const CHUNK: usize = 64 << 20;
    loop {
        keep_going()?;
        let read = (&mut file).take(CHUNK as u64).read_to_end(&mut bytes).map_err(cannot)?;
        if read < CHUNK {
            return Ok(bytes);
        }
    }
}

/// Room in `bytes` for a file of `size` bytes (and one more, to see its end), asked for: an
/// error names the file where the room is not to be had.
fn reserve_for(bytes: &mut Vec<u8>, size: u64, path: &Path, fix: &str) -> Result<()> {
    let more = usize::try_from(size).unwrap_or(usize::MAX).saturating_add(1).saturating_sub(bytes.len());
    bytes.try_reserve_exact(more).map_err(|_| {
        Error::InvalidArgument(format!(
            "{} is {}, more than this process can hold in memory to read: {fix}",
            path.display(),
            crate::units::bytes(size)
        ))
    })
}

/// Writes `bytes` to `path` atomically (see the module's comment). The error names the path.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let failed = |e: std::io::Error| {
        Error::Io(format!("writing {} failed, and the previous file is left as it was: {e}", path.display()))
    };
    let directory = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let Some(name) = path.file_name() else {
        return Err(Error::InvalidArgument(format!("{} names no file: give a file's path", path.display())));
    };
    let old_mode = match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_symlink() => None,
        Ok(meta) => {
            refuse_special(path, &meta, "name a file to write, which is replaced whole")?;
            // Never setuid or setgid: the new bytes are not the program that was trusted so.
            Some(meta.permissions().mode() & 0o1777)
        }
        Err(_) => None,
    };
    let mut temporary = Temporary::create(directory, name, old_mode).map_err(failed)?;
    temporary.file.write_all(bytes).map_err(failed)?;
    temporary.file.sync_all().map_err(failed)?;
    std::fs::rename(&temporary.path, path).map_err(failed)?;
    temporary.renamed = true;
    sync_directory(directory).map_err(|e| {
        Error::Io(format!("{} was written, but its directory could not be synced to disk: {e}", path.display()))
    })
}

/// The temporary file beside the target; removed when dropped unless it was renamed.
struct Temporary {
    path: PathBuf,
    file: File,
    renamed: bool,
}

impl Temporary {
    /// Created with `O_EXCL | O_NOFOLLOW` under a fresh random name (another try where one
    /// exists). With `mode`, the file is made 0600 and then given it before anything is written;
    /// without, it gets the umask's default, as a file `open()` makes.
    fn create(directory: &Path, target: &std::ffi::OsStr, mode: Option<u32>) -> std::io::Result<Temporary> {
        let mut tries = 0;
        loop {
            let mut name = OsString::from(".");
            name.push(shortened(target));
            name.push(format!(".{:016x}.tmp", random_u64()?));
            let path = directory.join(name);
            let opened = OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(if mode.is_some() { 0o600 } else { 0o666 })
                .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
                .open(&path);
            match opened {
                Ok(file) => {
                    let temporary = Temporary { path, file, renamed: false };
                    if let Some(mode) = mode {
                        temporary.file.set_permissions(std::fs::Permissions::from_mode(mode))?;
                    }
                    return Ok(temporary);
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && tries < 8 => tries += 1,
                Err(e) => return Err(e),
            }
        }
    }
}

/// The longest name a file can have (Linux's NAME_MAX), and what the temporary name adds.
const NAME_MAX: usize = 255;
const TEMPORARY_ADDS: usize = ".".len() + ".0123456789abcdef.tmp".len();

/// The target's name as the temporary one starts with it: cut so that the whole fits.
fn shortened(target: &std::ffi::OsStr) -> &std::ffi::OsStr {
    let bytes = target.as_bytes();
    std::ffi::OsStr::from_bytes(&bytes[..bytes.len().min(NAME_MAX - TEMPORARY_ADDS)])
}

impl Drop for Temporary {
    fn drop(&mut self) {
        if !self.renamed {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// 64 bits from the kernel's random source.
fn random_u64() -> std::io::Result<u64> {
    let mut bytes = [0u8; 8];
    // SAFETY: getrandom writes at most `bytes.len()` bytes into the buffer it is given.
    let got = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    if got != bytes.len() as isize {
        return Err(std::io::Error::last_os_error());
    }
    Ok(u64::from_ne_bytes(bytes))
}

/// Makes a rename in `directory` durable. A file system that can't sync a directory (EINVAL)
/// has nothing more to do.
fn sync_directory(directory: &Path) -> std::io::Result<()> {
    let opened = OpenOptions::new().read(true).custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC).open(directory)?;
    match opened.sync_all() {
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(()),
        synced => synced,
    }
}

#[cfg(test)]
mod tests;
