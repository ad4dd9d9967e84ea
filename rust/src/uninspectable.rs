//! Objects a walk over the user's namespace could not inspect: a dead `weakref.proxy`, an
//! object whose `__class__` or `__dict__` raises, a container whose iteration fails. The walk
//! skips each one and counts it here; the report says so in one note. A user object's error
//! is never raised from gpuexp.

/// What a walk skipped: how many objects, and the first reason, as an example.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Uninspectable {
    pub count: u64,
    pub first: Option<String>,
}

impl Uninspectable {
    /// Counts one skipped object; `why` is asked for only for the first one.
    pub fn skip(&mut self, why: impl FnOnce() -> String) {
        if self.first.is_none() {
            self.first = Some(why());
        }
        self.count += 1;
    }

    /// Adds what another walk of the same report skipped.
    pub fn merge(&mut self, other: Uninspectable) {
        if self.first.is_none() {
            self.first = other.first;
        }
        self.count += other.count;
    }

    /// The one note a report gives, where anything was skipped.
    pub fn note(&self) -> Option<String> {
        if self.count == 0 {
            return None;
        }
        let objects = if self.count == 1 { "1 object".to_string() } else { format!("{} objects", self.count) };
        let first = self.first.as_deref().map(|why| format!(" (first: {why})")).unwrap_or_default();
        Some(format!(
            "{objects} in the namespace could not be inspected and {} skipped{first}; memory only they hold is not \
             named here",
            if self.count == 1 { "was" } else { "were" }
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_note_counts_every_skip_and_names_the_first_reason() {
        let mut skipped = Uninspectable::default();
        assert_eq!(skipped.note(), None, "nothing skipped, nothing said");
        skipped.skip(|| "ReferenceError: weakly-referenced object no longer exists".into());
        skipped.skip(|| unreachable!("only the first reason is built"));
        let mut later = Uninspectable::default();
        later.skip(|| "ValueError: bad class".into());
        skipped.merge(later);
        let note = skipped.note().unwrap();
        assert!(note.starts_with("3 objects in the namespace could not be inspected and were skipped"), "{note}");
        assert!(note.contains("(first: ReferenceError: weakly-referenced object no longer exists)"), "{note}");
        let mut one = Uninspectable::default();
        one.merge(Uninspectable { count: 1, first: Some("ValueError: x".into()) });
        assert!(one.note().unwrap().starts_with("1 object in the namespace could not be inspected and was skipped"));
    }
}
