//! Where ranks publish: the address `GPUEXP_RANKS_STORE` holds, and the notebook kernel's own
//! private directory for the ranks it launches.

use crate::error::{Error, Result};
use crate::fork::PerProcess;
use std::fs;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::Mutex;
use std::time::Duration;

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

// ---- checks before torch opens a store -----------------------------------------------------
//
// torch's stores wait where gpuexp must not: a FileStore in a missing directory retries its
// open for 300 s, and a TCPStore client of an address that accepts but never answers (no
// TCPStore there) retries for its whole timeout, warning at every try. These checks answer in
// at most a few seconds, so a rank's experiment opens with one note instead.

/// How long a store operation may wait for the store's lock or connection.
pub const STORE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a rank tries to reach a TCPStore's port: one that is gone (a kernel restarted)
/// refuses at once, and is not tried again in that process.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// How long a TCPStore has to answer gpuexp's ping: a loaded server answers in milliseconds;
/// a listener that is no TCPStore never does.
pub const PING_TIMEOUT: Duration = Duration::from_secs(5);
/// How long torch's client then has to connect and be validated: 64 ranks opening at once on
/// a loaded 2-core box took more than 3 s.
pub const VALIDATE_TIMEOUT: Duration = Duration::from_secs(60);

/// The check that runs before torch opens the store at `address`, ready to run on a thread of
/// its own ([`Pending`]).
pub fn check_before_opening(
    address: &StoreAddress,
) -> impl FnOnce() -> std::result::Result<(), String> + Send + 'static {
    let address = address.clone();
    move || match &address {
        StoreAddress::Directory(dir) => check_store_directory(dir),
        StoreAddress::Tcp { host, port } => check_tcp_store(host, *port, CONNECT_TIMEOUT, PING_TIMEOUT),
    }
}

/// A check that may wait (a disk, the network) running on a thread of its own, so that its
/// caller keeps answering Ctrl-C meanwhile instead of waiting for the check's own timeout. An
/// abandoned check ends by itself at that timeout.
pub struct Pending<T>(Mutex<Receiver<T>>);

impl<T: Send + 'static> Pending<T> {
    pub fn start(check: impl FnOnce() -> T + Send + 'static) -> std::result::Result<Pending<T>, String> {
        let (answer, answered) = mpsc::channel();
        std::thread::Builder::new()
            .name("gpuexp-store-check".into())
            .spawn(move || {
                let _ = answer.send(check());
            })
            .map_err(|e| format!("could not start a thread to check the store: {e}"))?;
        // In a mutex only so that a waiter on another thread may borrow it: one thread ever receives.
        Ok(Pending(Mutex::new(answered)))
    }

    /// The check's answer, waiting at most `tick` for it: None while it still runs.
    pub fn wait(&self, tick: Duration) -> std::result::Result<Option<T>, String> {
        match crate::locks::unpoisoned(self.0.lock()).recv_timeout(tick) {
            Ok(value) => Ok(Some(value)),
            Err(RecvTimeoutError::Timeout) => Ok(None),
            Err(RecvTimeoutError::Disconnected) => Err("the store check ended without an answer".into()),
        }
    }
}

/// Whether a FileStore can live in `dir`: it exists, is a directory, and this user can create
/// files in it.
pub fn check_store_directory(dir: &Path) -> std::result::Result<(), String> {
    let fix = format!("create it (mode 0700 where only you run ranks), or point {STORE_ENV} at one that exists");
    match fs::metadata(dir) {
        Err(e) => Err(format!("file://{}: {e}; {fix}", dir.display())),
        Ok(meta) if !meta.is_dir() => Err(format!("file://{} is not a directory; {fix}", dir.display())),
        Ok(_) => {
            let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).map_err(|e| e.to_string())?;
            // SAFETY: a valid NUL-terminated path; access() only reads it.
            if unsafe { libc::access(c.as_ptr(), libc::W_OK | libc::X_OK) } != 0 {
                return Err(format!("file://{} is not writable by this user; {fix}", dir.display()));
            }
            Ok(())
        }
    }
}

/// torch's TCPStore wire protocol, as its client opens a connection: a VALIDATE query with the
/// magic number, then a PING whose nonce the server sends back, in native byte order. Checked
/// against torch 2.15's libuv and classic servers (tests/test_ranks.py opens real ones); a torch
/// whose server knows no PING would be refused here with "not a TCPStore".
mod wire {
    pub const VALIDATE: u8 = 0;
    pub const PING: u8 = 13;
    pub const MAGIC: u32 = 0x3C85_F7CE;
}

/// Whether a TCPStore answers at `host:port`: connected within `connect`, and the nonce of a
/// ping sent back within `reply`. Something else listening there (a web server, a plain
/// socket) is told apart in seconds, where torch's client would retry for its timeout.
pub fn check_tcp_store(host: &str, port: u16, connect: Duration, reply: Duration) -> std::result::Result<(), String> {
    use std::io::{Read, Write};
    use std::net::{TcpStream, ToSocketAddrs};
    let url = format!("tcp://{host}:{port}");
    let addresses = (host, port).to_socket_addrs().map_err(|e| format!("{url}: {e}"))?;
    let mut last = format!("{url}: no address");
    for address in addresses {
        let mut stream = match TcpStream::connect_timeout(&address, connect) {
            Ok(stream) => stream,
            Err(e) => {
                last = format!("nothing answers at {url} ({e})");
                continue;
            }
        };
        let nonce = std::process::id() ^ 0x5EED_0000;
        let mut query = vec![wire::VALIDATE];
        query.extend(wire::MAGIC.to_ne_bytes());
        query.push(wire::PING);
        query.extend(nonce.to_ne_bytes());
        let mut answer = [0u8; 4];
        let exchanged = stream
            .set_read_timeout(Some(reply))
            .and_then(|()| stream.set_write_timeout(Some(reply)))
            .and_then(|()| stream.write_all(&query))
            .and_then(|()| stream.read_exact(&mut answer));
        let not_a_store = format!("{url} answers but is not a TCPStore");
        return match exchanged {
            Ok(()) if u32::from_ne_bytes(answer) == nonce => Ok(()),
            Ok(()) => Err(format!("{not_a_store} (its reply to torch's ping is not torch's)")),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                Err(format!("{not_a_store} (no reply to torch's ping in {:.0} s)", reply.as_secs_f64()))
            }
            Err(e) => Err(format!("{not_a_store} ({e})")),
        };
    }
    Err(last)
}

// ---- the kernel's own store directory ----------------------------------------------------

/// The directory this kernel made for its ranks, removed at exit by the process that made it
/// (a forked child has none).
static KERNEL_DIR: PerProcess<Option<PathBuf>> = PerProcess::new(|| None);

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
/// directories of kernels that are gone are removed on the way. Where none can be made, the
/// error says that ranks launched from the kernel are off, why, and how to turn them on.
pub fn kernel_store_dir() -> Result<PathBuf> {
    made_kernel_store_dir().map_err(ranks_off)
}

fn ranks_off(why: Error) -> Error {
    Error::Io(format!(
        "ranks launched from this kernel won't reach it ({why}). To fix it, set TMPDIR or XDG_RUNTIME_DIR to a \
         directory only you can write, or set {STORE_ENV} (file:///a/dir or tcp://host:port), before importing gpuexp"
    ))
}

fn made_kernel_store_dir() -> Result<PathBuf> {
    let mut made = KERNEL_DIR.lock();
    if let Some(dir) = made.as_ref() {
        return Ok(dir.clone());
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
    let dir = base.join(format!("kernel-{}-{nanos:x}", crate::fork::pid()));
    private_dir(&dir)?;
    *made = Some(dir.clone());
    Ok(dir)
}

/// Removes the kernel's store directory, in the process that made it (not in a forked child).
pub fn remove_kernel_store_dir() {
    if let Some(dir) = KERNEL_DIR.lock().take() {
        let _ = fs::remove_dir_all(dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pending_check_answers_once_done_and_says_when_it_died() {
        let (go, wait) = mpsc::channel::<()>();
        let pending = Pending::start(move || {
            wait.recv().unwrap();
            7
        })
        .unwrap();
        assert_eq!(pending.wait(Duration::from_millis(10)), Ok(None), "still running");
        go.send(()).unwrap();
        assert_eq!(pending.wait(Duration::from_secs(10)), Ok(Some(7)));
        let died: Pending<u8> = Pending::start(|| panic!("the check died")).unwrap();
        assert_eq!(died.wait(Duration::from_secs(10)), Err("the store check ended without an answer".into()));
    }

    #[test]
    fn the_check_before_opening_a_missing_directory_names_the_fix() {
        let check = check_before_opening(&StoreAddress::Directory("/nonexistent/gpuexp-h11".into()));
        let message = check().unwrap_err();
        assert!(message.starts_with("file:///nonexistent/gpuexp-h11:") && message.contains(STORE_ENV), "{message}");
    }

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
    fn a_store_directory_must_exist_and_be_writable() {
        let missing = check_store_directory(Path::new("/nonexistent/dir")).unwrap_err();
        assert!(
            missing.starts_with("file:///nonexistent/dir: No such file") && missing.contains(STORE_ENV),
            "{missing}"
        );
        let file = check_store_directory(Path::new("/proc/self/status")).unwrap_err();
        assert!(file.contains("is not a directory"), "{file}");
        assert_eq!(check_store_directory(&std::env::temp_dir()), Ok(()));
    }

    fn listener() -> (std::net::TcpListener, u16) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        (listener, port)
    }

    #[test]
    fn a_listener_that_is_no_tcp_store_is_told_apart_in_seconds() {
        use std::io::{Read, Write};
        let short = Duration::from_millis(300);
        // Accepts and never answers: torch's client would wait for its whole timeout.
        let (_silent, port) = listener();
        let started = std::time::Instant::now();
        let silent = check_tcp_store("127.0.0.1", port, short, short).unwrap_err();
        assert!(silent.contains("answers but is not a TCPStore") && silent.contains("no reply"), "{silent}");
        assert!(started.elapsed() < Duration::from_secs(2));
        // Answers something else.
        let (chatty, port) = listener();
        let server = std::thread::spawn(move || {
            let (mut peer, _) = chatty.accept().unwrap();
            let mut query = [0u8; 10];
            peer.read_exact(&mut query).unwrap();
            peer.write_all(b"HTTP/1.1 400 Bad Request\r\n").unwrap();
        });
        let chatty = check_tcp_store("127.0.0.1", port, short, short).unwrap_err();
        assert!(chatty.contains("is not torch's"), "{chatty}");
        server.join().unwrap();
        // Echoes the ping's nonce, as a TCPStore does.
        let (store, port) = listener();
        let server = std::thread::spawn(move || {
            let (mut peer, _) = store.accept().unwrap();
            let mut query = [0u8; 10];
            peer.read_exact(&mut query).unwrap();
            assert_eq!(
                (query[0], &query[1..5], query[5]),
                (wire::VALIDATE, &wire::MAGIC.to_ne_bytes()[..], wire::PING)
            );
            peer.write_all(&query[6..]).unwrap();
        });
        assert_eq!(check_tcp_store("127.0.0.1", port, short, short), Ok(()));
        server.join().unwrap();
        // Nothing listens.
        let gone = listener().1;
        assert!(check_tcp_store("127.0.0.1", gone, short, short).unwrap_err().starts_with("nothing answers"));
    }

    #[test]
    fn an_unusable_base_says_that_ranks_are_off_and_how_to_fix_it() {
        let base = std::env::temp_dir().join(format!("gpuexp-open-base-{}", std::process::id()));
        fs::create_dir_all(base.join("gpuexp")).unwrap();
        fs::set_permissions(base.join("gpuexp"), fs::Permissions::from_mode(0o755)).unwrap();
        let why = private_dir(&base.join("gpuexp")).unwrap_err().to_string();
        assert!(why.contains("not a private directory"), "{why}");
        let said = ranks_off(Error::Io(why)).to_string();
        assert!(said.starts_with("ranks launched from this kernel won't reach it (") && said.contains("set TMPDIR"));
        fs::remove_dir_all(base).unwrap();
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
