//! A container whose elements are each holders, as one row: a list of 142 outputs kept with
//! their graphs is one thing the user keeps (`outs`), not 142 (`outs[0]`, `outs[1]`, …), and each
//! alone may be too small to list while together they fill the device.

use super::Buffer;
use crate::report::Holder;

/// Elements of one container that make it one row.
pub const ROLL_UP_AT: usize = 8;

/// A list, tuple or dict whose elements are holders: the path to it, its type, and its elements
/// (indices into the survey's `held`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Container {
    pub path: String,
    pub type_name: String,
    pub members: Vec<usize>,
}

/// `a list of 142 tensors that require grad, each keeping its graph`
fn what(container: &Container, members: &[&Holder]) -> String {
    let keeping = members.iter().filter(|h| h.saved_for_backward > 0).count();
    let (count, type_name) = (members.len(), &container.type_name);
    let article = if type_name.starts_with(['a', 'e', 'i', 'o', 'u']) { "an" } else { "a" };
    let graphs = match keeping {
        0 => String::new(),
        all if all == count => " that require grad, each keeping its graph".into(),
        some => format!(", {some} of them keeping their graphs"),
    };
    format!("{article} {type_name} of {count} tensors{graphs}")
}

/// The holders as shown: each container's elements as one row (its bytes, and what their graphs
/// saved, summed), the rest as they are, largest first.
pub fn rolled(held: &[(Buffer, Holder)], containers: &[Container]) -> Vec<Holder> {
    let mut rolled_in = vec![false; held.len()];
    let mut rows: Vec<Holder> = containers
        .iter()
        .map(|container| {
            let members: Vec<&Holder> = container.members.iter().map(|&i| &held[i].1).collect();
            container.members.iter().for_each(|&i| rolled_in[i] = true);
            Holder {
                path: container.path.clone(),
                bytes: members.iter().map(|h| h.bytes).sum(),
                saved_for_backward: members.iter().map(|h| h.saved_for_backward).sum(),
                device: members.first().map(|h| h.device.clone()).unwrap_or_default(),
                kind: what(container, &members),
                shape: String::new(),
            }
        })
        .collect();
    rows.extend(held.iter().zip(&rolled_in).filter(|(_, rolled)| !**rolled).map(|((_, holder), _)| holder.clone()));
    rows.sort_by(|a, b| {
        (b.bytes + b.saved_for_backward).cmp(&(a.bytes + a.saved_for_backward)).then_with(|| a.path.cmp(&b.path))
    });
    rows
}
