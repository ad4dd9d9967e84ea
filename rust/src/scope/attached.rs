//! The bindings' handles of an open scope, carried opaque in its one record.

use std::any::Any;

/// The bindings' handles of an open scope, opaque to the core: the scope's one record carries
/// them, so that a forked child, which drops the registry, drops them too. Taken out of the
/// registry before anything acts on them: dropping them may run Python code, which may call
/// back into the registry.
#[derive(Default)]
pub struct Attached(Option<Box<dyn Any + Send>>);

impl Attached {
    pub fn new<H: Send + 'static>(handles: H) -> Attached {
        Attached(Some(Box::new(handles)))
    }

    /// The handles, when they are of type `H` and still attached.
    pub fn get<H: 'static>(&self) -> Option<&H> {
        self.0.as_ref()?.downcast_ref()
    }

    pub fn take<H: 'static>(self) -> Option<H> {
        self.0?.downcast().ok().map(|handles| *handles)
    }
}

impl std::fmt::Debug for Attached {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str(if self.0.is_some() { "Attached(..)" } else { "Attached(None)" })
    }
}
