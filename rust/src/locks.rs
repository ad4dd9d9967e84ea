//! Locks that outlive a panic. A panic while a lock was held (a bug, caught at the Python
//! boundary as an exception) poisons it; gpuexp's locked state is whole after every statement
//! that changes it, so the next caller goes on with it rather than failing every later cell.

use std::sync::{LockResult, Mutex, MutexGuard, PoisonError};

/// The guard, poisoned or not.
pub fn unpoisoned<G>(result: LockResult<G>) -> G {
    result.unwrap_or_else(PoisonError::into_inner)
}

/// Locks `mutex`, poisoned or not.
pub fn lock<T: ?Sized>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    unpoisoned(mutex.lock())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_while_locked_leaves_the_value_usable() {
        let shared = Mutex::new(1);
        let panicked = std::panic::catch_unwind(|| {
            let mut value = shared.lock().unwrap();
            *value = 2;
            panic!("a bug while the lock is held");
        });
        assert!(panicked.is_err() && shared.is_poisoned());
        assert_eq!(*lock(&shared), 2);
    }
}
