use super::*;

/// A fresh directory of its own for each test.
fn scratch(test: &str) -> PathBuf {
    let directory = std::env::temp_dir().join(format!("gpuexp-files-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&directory);
    std::fs::create_dir_all(&directory).unwrap();
    directory
}

fn names(directory: &Path) -> Vec<String> {
    let mut names: Vec<String> =
        std::fs::read_dir(directory).unwrap().map(|entry| entry.unwrap().file_name().into_string().unwrap()).collect();
    names.sort();
    names
}

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o7777
}

#[test]
fn a_file_is_replaced_whole_and_keeps_its_mode() {
    let directory = scratch("mode");
    let path = directory.join("history.json");
    std::fs::write(&path, "old").unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    write_atomically(&path, b"new").unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), b"new");
    assert_eq!(mode(&path), 0o600, "the old file's mode is kept");
    assert_eq!(names(&directory), ["history.json"], "no temporary file is left");
    std::fs::remove_dir_all(directory).unwrap();
}

#[test]
fn a_new_file_gets_the_mode_open_would_give_it() {
    let directory = scratch("new");
    let path = directory.join("snapshot.pickle");
    write_atomically(&path, b"bytes").unwrap();
    let plain = directory.join("plain");
    File::create(&plain).unwrap();
    assert_eq!(mode(&path), mode(&plain), "the umask's default");
    std::fs::remove_dir_all(directory).unwrap();
}

#[test]
fn a_link_planted_at_a_temporary_name_is_never_followed() {
    let directory = scratch("planted");
    let victim = directory.join("victim");
    std::fs::write(&victim, "the victim's").unwrap();
    let path = directory.join("out.pickle");
    // The name the old writer used (from the pid), and other guessable ones: links to the victim.
    let guesses = [
        format!(".out.pickle.{}.tmp", std::process::id()),
        ".out.pickle.tmp".to_string(),
        "out.pickle.tmp".to_string(),
        ".out.pickle.0000000000000000.tmp".to_string(),
    ];
    for guess in &guesses {
        std::os::unix::fs::symlink(&victim, directory.join(guess)).unwrap();
    }
    write_atomically(&path, b"written").unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), b"written");
    assert!(!std::fs::symlink_metadata(&path).unwrap().file_type().is_symlink(), "the target is a file, not a link");
    assert_eq!(std::fs::read(&victim).unwrap(), b"the victim's");
    // Whatever name comes up, a link there is refused rather than followed.
    let link = directory.join(".out.pickle.aaaaaaaaaaaaaaaa.tmp");
    std::os::unix::fs::symlink(&victim, &link).unwrap();
    let opened = OpenOptions::new().write(true).create_new(true).custom_flags(libc::O_NOFOLLOW).open(&link);
    assert_eq!(opened.err().map(|e| e.kind()), Some(std::io::ErrorKind::AlreadyExists));
    assert_eq!(std::fs::read(&victim).unwrap(), b"the victim's");
    let mut expected: Vec<String> = guesses.to_vec();
    expected.extend([".out.pickle.aaaaaaaaaaaaaaaa.tmp", "out.pickle", "victim"].map(String::from));
    expected.sort();
    assert_eq!(names(&directory), expected, "only the target was added");
    std::fs::remove_dir_all(directory).unwrap();
}

#[test]
fn a_link_at_the_target_is_replaced_not_written_through() {
    let directory = scratch("target-link");
    let victim = directory.join("victim");
    std::fs::write(&victim, "the victim's").unwrap();
    let path = directory.join("out.json");
    std::os::unix::fs::symlink(&victim, &path).unwrap();
    write_atomically(&path, b"[]").unwrap();
    assert_eq!(std::fs::read(&victim).unwrap(), b"the victim's");
    assert_eq!(std::fs::read(&path).unwrap(), b"[]");
    std::fs::remove_dir_all(directory).unwrap();
}

#[test]
fn a_failed_write_leaves_the_old_file_and_no_temporary_file() {
    let directory = scratch("failed");
    let path = directory.join("history.json");
    std::fs::write(&path, "old").unwrap();
    // A directory where the file should be: refused before anything is created.
    let refused = write_atomically(&directory, b"x").unwrap_err();
    assert!(matches!(&refused, Error::InvalidArgument(m) if m.contains("a directory")), "{refused:?}");
    // A rename that fails (the target's directory is gone by then) after the temporary file was written.
    let gone = directory.join("gone");
    std::fs::create_dir(&gone).unwrap();
    let mut temporary = Temporary::create(&gone, std::ffi::OsStr::new("x"), None).unwrap();
    temporary.file.write_all(b"half").unwrap();
    assert_eq!(names(&gone).len(), 1);
    drop(temporary);
    assert!(names(&gone).is_empty(), "dropped before its rename, the temporary file is removed");
    // A panic in the middle of a write unwinds through the same drop.
    let unwound = std::panic::catch_unwind(|| {
        let _temporary = Temporary::create(&gone, std::ffi::OsStr::new("x"), None).unwrap();
        panic!("mid-write");
    });
    assert!(unwound.is_err());
    assert!(names(&gone).is_empty());
    assert_eq!(std::fs::read(&path).unwrap(), b"old");
    std::fs::remove_dir_all(directory).unwrap();
}

#[test]
fn a_fifo_is_refused_at_once_and_a_regular_file_is_read_in_chunks() {
    let directory = scratch("read");
    let fifo = directory.join("fifo.pickle");
    let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let started = std::time::Instant::now();
    let refused = read_regular(&fifo, "name a snapshot file", &|_| Ok(()), &mut || Ok(())).unwrap_err();
    assert!(matches!(&refused, Error::InvalidArgument(m) if m.contains("FIFO") && m.contains("name a snapshot")));
    assert!(started.elapsed() < std::time::Duration::from_secs(1), "no writer was waited for");
    let device = read_regular(Path::new("/dev/zero"), "fix", &|_| Ok(()), &mut || Ok(())).unwrap_err();
    assert!(matches!(&device, Error::InvalidArgument(m) if m.contains("a device")), "{device:?}");
    let file = directory.join("f");
    std::fs::write(&file, vec![7u8; 100]).unwrap();
    let mut asked = 0;
    let read = read_regular(&file, "fix", &|_| Ok(()), &mut || {
        asked += 1;
        Ok(())
    });
    assert_eq!(read.unwrap(), vec![7u8; 100]);
    assert_eq!(asked, 1);
    let stopped = read_regular(&file, "fix", &|_| Ok(()), &mut || Err(Error::Interrupted)).unwrap_err();
    assert_eq!(stopped, Error::Interrupted);
    std::fs::remove_dir_all(directory).unwrap();
}

#[test]
fn a_unix_socket_is_named_as_one() {
    let directory = scratch("socket");
    let path = directory.join("listening.sock");
    let _listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
    let refused = read_regular(&path, "name a snapshot file", &|_| Ok(()), &mut || Ok(())).unwrap_err();
    assert!(matches!(&refused, Error::InvalidArgument(m) if m.contains("is a socket")), "{refused:?}");
    std::fs::remove_dir_all(directory).unwrap();
}

#[test]
fn the_start_is_judged_before_the_rest_is_read_and_a_file_too_large_for_memory_is_an_error() {
    let directory = scratch("start");
    let path = directory.join("sparse");
    // 8 GiB with no disk used: refused at its start, never read whole.
    let file = File::create(&path).unwrap();
    file.set_len(8 << 30).unwrap();
    let judged = std::cell::Cell::new(0);
    let junk = |start: &[u8]| {
        judged.set(start.len());
        Err(Error::InvalidArgument("junk".into()))
    };
    let started = std::time::Instant::now();
    let refused = read_regular(&path, "fix", &junk, &mut || Ok(())).unwrap_err();
    assert_eq!((refused, judged.get()), (Error::InvalidArgument("junk".into()), START));
    assert!(started.elapsed() < std::time::Duration::from_secs(1));
    // Room no process has (past any address space) is an error, not an abort.
    let too_large = reserve_for(&mut Vec::new(), 1 << 62, &path, "fix").unwrap_err();
    assert!(matches!(&too_large, Error::InvalidArgument(m) if m.contains("more than this process can hold")));
    std::fs::remove_dir_all(directory).unwrap();
}

#[test]
fn names_up_to_the_longest_the_file_system_takes_are_written() {
    let directory = scratch("long");
    for length in [233, 234, 255] {
        let path = directory.join("n".repeat(length));
        write_atomically(&path, b"first").unwrap();
        write_atomically(&path, b"second").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"second", "{length}");
    }
    assert_eq!(names(&directory).len(), 3, "no temporary file is left");
    std::fs::remove_dir_all(directory).unwrap();
}

#[test]
fn a_replaced_file_loses_its_setuid_and_setgid_bits_and_keeps_the_rest() {
    let directory = scratch("setuid");
    let path = directory.join("tool");
    std::fs::write(&path, "old").unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o6755)).unwrap();
    assert_eq!(mode(&path), 0o6755, "the test's own file system keeps the bits");
    write_atomically(&path, b"new").unwrap();
    assert_eq!(mode(&path), 0o755);
    std::fs::remove_dir_all(directory).unwrap();
}
