//! What a tensor is to training (a parameter, a gradient, optimizer state, a buffer), and the
//! bytes a leak hunt or `explain` found in each role. Below both: a report carries the sums,
//! and `explain` shows them.

use serde::{Deserialize, Serialize};

use crate::units::bytes;

/// What a storage is to training. When one storage plays several roles (a tied weight that is
/// also a buffer), the first in this order counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Role {
    Parameter,
    Buffer,
    Gradient,
    OptimizerState,
}

/// Bytes of the tensors (and arrays) Python can reach, by role; each storage counts once.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorRoles {
    pub parameters: u64,
    pub gradients: u64,
    pub optimizer_state: u64,
    pub buffers: u64,
    /// Everything else: tensors and arrays held by other names, and those no name reaches.
    pub other_tensors: u64,
}

impl TensorRoles {
    pub fn add(&mut self, role: Option<Role>, bytes: u64) {
        *match role {
            Some(Role::Parameter) => &mut self.parameters,
            Some(Role::Buffer) => &mut self.buffers,
            Some(Role::Gradient) => &mut self.gradients,
            Some(Role::OptimizerState) => &mut self.optimizer_state,
            None => &mut self.other_tensors,
        } += bytes;
    }

    pub fn total(&self) -> u64 {
        self.parameters + self.gradients + self.optimizer_state + self.buffers + self.other_tensors
    }

    fn rows(&self) -> [(&'static str, u64); 5] {
        [
            ("parameters", self.parameters),
            ("gradients", self.gradients),
            ("optimizer state", self.optimizer_state),
            ("buffers", self.buffers),
            ("other tensors", self.other_tensors),
        ]
    }

    /// "parameters 64.00 MiB, optimizer state 128.00 MiB": the roles that hold something.
    pub fn summary(&self) -> String {
        let parts: Vec<String> =
            self.rows().iter().filter(|(_, b)| *b > 0).map(|(label, b)| format!("{label} {}", bytes(*b))).collect();
        parts.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn a_summary_names_only_the_roles_that_hold_something() {
        let roles = TensorRoles { parameters: 64 * MIB, other_tensors: 1 << 30, ..TensorRoles::default() };
        assert_eq!(roles.summary(), "parameters 64.00 MiB, other tensors 1.00 GiB");
        let mut added = TensorRoles::default();
        added.add(Some(Role::Gradient), 5);
        added.add(None, 7);
        assert_eq!((added.gradients, added.other_tensors, added.total()), (5, 7, 12));
    }
}
