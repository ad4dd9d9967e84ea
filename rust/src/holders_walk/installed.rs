//! Which kind of root a frame, a module or a suspended generator is: installed code (the
//! standard library, site-packages) is walked after what the user wrote, by the file it comes
//! from. The bindings read the files; the kinds and their order are decided here.

use super::RootKind;

/// The interpreter's install prefixes (`sys.prefix`, `sys.base_prefix`, `sys.exec_prefix`).
pub struct InstalledCode {
    pub prefixes: Vec<String>,
}

impl InstalledCode {
    /// Whether code from `file` is installed; code with no file (built in) counts as installed.
    pub fn holds(&self, file: Option<&str>) -> bool {
        match file {
            Some(file) => self.prefixes.iter().any(|p| file.starts_with(p.as_str())) || file.contains("-packages"),
            None => true,
        }
    }

    /// A frame of a thread: the user's code as a thread's root; installed code of other threads
    /// after the libraries' globals; the hunter's own installed frames (IPython running this
    /// cell) not at all.
    pub fn thread_frame(&self, file: Option<&str>, in_hunting_thread: bool) -> Option<RootKind> {
        match (self.holds(file), in_hunting_thread) {
            (false, _) => Some(RootKind::Thread),
            (true, false) => Some(RootKind::LibraryModule),
            (true, true) => None,
        }
    }

    /// A module's globals: the user's own modules before libraries.
    pub fn module(&self, file: Option<&str>) -> RootKind {
        if self.holds(file) {
            RootKind::LibraryModule
        } else {
            RootKind::UserModule
        }
    }

    /// A suspended generator's or coroutine's frame: the user's among the suspended roots,
    /// installed code's after the libraries' globals.
    pub fn suspended(&self, file: Option<&str>) -> RootKind {
        if self.holds(file) {
            RootKind::LibraryModule
        } else {
            RootKind::Suspended
        }
    }
}

/// The order threads are walked in: other threads first, the hunter's own last, each by its id.
pub fn thread_order(ident: u64, hunting: u64) -> (bool, u64) {
    (ident == hunting, ident)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn installed() -> InstalledCode {
        InstalledCode { prefixes: vec!["/usr/lib/python3.11".into(), "/venv".into()] }
    }

    #[test]
    fn installed_code_is_told_by_its_prefix_or_a_packages_folder() {
        let installed = installed();
        assert!(installed.holds(Some("/usr/lib/python3.11/threading.py")));
        assert!(installed.holds(Some("/venv/lib/python3.11/site-packages/torch/nn/module.py")));
        assert!(installed.holds(Some("/home/me/.local/lib/python3.11/dist-packages/x.py")));
        assert!(installed.holds(None), "built-in code has no file");
        assert!(!installed.holds(Some("/home/me/project/train.py")));
        assert!(!installed.holds(Some("<ipython-input-3-abc>")));
    }

    #[test]
    fn each_place_gets_its_kind_and_the_hunters_own_installed_frames_none() {
        let installed = installed();
        let mine = Some("/home/me/train.py");
        let library = Some("/venv/lib/python3.11/site-packages/ipykernel/kernelbase.py");
        assert_eq!(installed.thread_frame(mine, true), Some(RootKind::Thread));
        assert_eq!(installed.thread_frame(library, false), Some(RootKind::LibraryModule));
        assert_eq!(installed.thread_frame(library, true), None);
        assert_eq!(
            (installed.module(mine), installed.module(library)),
            (RootKind::UserModule, RootKind::LibraryModule)
        );
        assert_eq!(
            (installed.suspended(mine), installed.suspended(library)),
            (RootKind::Suspended, RootKind::LibraryModule)
        );
    }

    #[test]
    fn other_threads_come_before_the_hunters_own() {
        let mut idents = vec![7, 3, 5];
        idents.sort_by_key(|ident| thread_order(*ident, 3));
        assert_eq!(idents, [5, 7, 3]);
    }
}
