//! Where ranks publish: the address `GPUEXP_RANKS_STORE` holds, and the notebook kernel's own
//! private directory for the ranks it launches.

use crate::error::{Error, Result};
use std::fs;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use super::{STORE_ENV, STORE_FILE};

/// Where ranks publish, as `GPUEXP_RANKS_STORE` names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoreAddress {
    /// A directory every rank can write (the kernel's own, or a shared one): a FileStore in it.
    Directory(PathBuf),
    /// A TCPStore: the kernel's (`gpuexp.host_ranks_store()`) or any other.
    Tcp { host: String, port: u16 },
}

impl StoreAddress {
    pub fn parse(value: &str) -> Result<StoreAddress> {
        let value = value.trim();
        let bad = || {
            Error::InvalidArgument(format!(
                "{STORE_ENV}={value:?}: name a directory every rank can write (file:///shared/gpuexp) \
                 or a store address (tcp://host:port)"
            ))
        };
        if let Some(path) = value.strip_prefix("file://") {
            return if path.starts_with('/') { Ok(StoreAddress::Directory(path.into())) } else { Err(bad()) };
        }
        if let Some(address) = value.strip_prefix("tcp://") {
            let (host, port) = address.rsplit_once(':').ok_or_else(bad)?;
            let host = host.trim_start_matches('[').trim_end_matches(']');
            let port = port.trim_end_matches('/').parse().map_err(|_| bad())?;
            return if host.is_empty() { Err(bad()) } else { Ok(StoreAddress::Tcp { host: host.into(), port }) };
        }
        if value.starts_with('/') {
            return Ok(StoreAddress::Directory(value.into()));
        }
        Err(bad())
    }

    /// The FileStore's file, for a directory.
    pub fn file(&self) -> Option<PathBuf> {
        match self {
            StoreAddress::Directory(dir) => Some(dir.join(STORE_FILE)),
            StoreAddress::Tcp { .. } => None,
        }
    }
}

impl std::fmt::Display for StoreAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreAddress::Directory(dir) => write!(f, "file://{}", dir.display()),
            StoreAddress::Tcp { host, port } if host.contains(':') => write!(f, "tcp://[{host}]:{port}"),
            StoreAddress::Tcp { host, port } => write!(f, "tcp://{host}:{port}"),
        }
    }
}

// ---- the kernel's own store directory ----------------------------------------------------

/// The directory this kernel made for its ranks, removed at exit by the process that made it.
static KERNEL_DIR: Mutex<Option<(u32, PathBuf)>> = Mutex::new(None);

/// A directory only this user can enter (mode 0700, owned by them, not a link): created, or
/// checked where it exists, since a shared /tmp lets anyone create a name first.
fn private_dir(path: &Path) -> Result<()> {
    match fs::DirBuilder::new().mode(0o700).create(path) {
        Ok(()) => return Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(Error::Io(format!("could not create {}: {e}", path.display()))),
    }
    let meta = fs::symlink_metadata(path).map_err(|e| Error::Io(format!("could not read {}: {e}", path.display())))?;
    let uid = fs::metadata("/proc/self")
        .map(|m| m.uid())
        .map_err(|e| Error::Io(format!("could not read /proc/self: {e}")))?;
    if !meta.is_dir() || meta.uid() != uid || meta.permissions().mode() & 0o077 != 0 {
        return Err(Error::Io(format!(
            "{} is not a private directory of this user (mode 0700, owned by uid {uid}): remove it, or set {STORE_ENV}",
            path.display()
        )));
    }
    Ok(())
}

fn private_base() -> Result<PathBuf> {
    let runtime = std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from).filter(|d| d.is_dir());
    let base = match runtime {
        Some(dir) => dir.join("gpuexp"),
        None => {
            let uid = fs::metadata("/proc/self").map(|m| m.uid()).unwrap_or(0);
            std::env::temp_dir().join(format!("gpuexp-{uid}"))
        }
    };
    private_dir(&base)?;
    Ok(base)
}

/// This kernel's store directory for its ranks (mode 0700), made on first call; the
/// directories of kernels that are gone are removed on the way.
pub fn kernel_store_dir() -> Result<PathBuf> {
    let pid = crate::fork::pid();
    let mut made = KERNEL_DIR.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some((owner, dir)) = made.as_ref() {
        if *owner == pid {
            return Ok(dir.clone());
        }
    }
    let base = private_base()?;
    for entry in fs::read_dir(&base).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let owner = name.strip_prefix("kernel-").and_then(|rest| rest.split('-').next()?.parse::<u32>().ok());
        if owner.is_some_and(|owner| !Path::new(&format!("/proc/{owner}")).exists()) {
            let _ = fs::remove_dir_all(entry.path());
        }
    }
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
    let dir = base.join(format!("kernel-{pid}-{nanos:x}"));
    private_dir(&dir)?;
    *made = Some((pid, dir.clone()));
    Ok(dir)
}

/// Removes the kernel's store directory, in the process that made it (not in a forked child).
pub fn remove_kernel_store_dir() {
    let mut made = KERNEL_DIR.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some((owner, dir)) = made.take() {
        if owner == crate::fork::pid() {
            let _ = fs::remove_dir_all(dir);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_addresses_name_a_directory_or_a_tcp_store() {
        assert_eq!(StoreAddress::parse("file:///tmp/x").unwrap(), StoreAddress::Directory("/tmp/x".into()));
        assert_eq!(StoreAddress::parse("/shared/g").unwrap().file().unwrap(), PathBuf::from("/shared/g/ranks.store"));
        let tcp = StoreAddress::parse("tcp://10.0.0.5:29600").unwrap();
        assert_eq!(tcp, StoreAddress::Tcp { host: "10.0.0.5".into(), port: 29600 });
        assert_eq!(tcp.to_string(), "tcp://10.0.0.5:29600");
        assert_eq!(StoreAddress::parse("tcp://[::1]:7").unwrap().to_string(), "tcp://[::1]:7");
        for bad in ["tcp://host", "file://relative", "redis://x:1", "tcp://:5"] {
            assert!(
                matches!(StoreAddress::parse(bad), Err(Error::InvalidArgument(m)) if m.contains("file:///shared/gpuexp")),
                "{bad}"
            );
        }
    }

    #[test]
    fn the_kernel_directory_is_private_and_removed_by_its_maker() {
        let dir = kernel_store_dir().unwrap();
        let mode = fs::metadata(&dir).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700, "{}", dir.display());
        assert_eq!(fs::metadata(dir.parent().unwrap()).unwrap().permissions().mode() & 0o077, 0);
        assert_eq!(kernel_store_dir().unwrap(), dir, "one directory per kernel");
        remove_kernel_store_dir();
        assert!(!dir.exists());
    }

    #[test]
    fn a_directory_others_can_enter_is_refused() {
        let open = std::env::temp_dir().join(format!("gpuexp-open-{}", std::process::id()));
        fs::create_dir_all(&open).unwrap();
        fs::set_permissions(&open, fs::Permissions::from_mode(0o755)).unwrap();
        assert!(matches!(private_dir(&open), Err(Error::Io(m)) if m.contains("not a private directory")));
        fs::remove_dir_all(open).unwrap();
    }
}
