//! Which GPUs a CUDA process sees, and in which order, from CUDA_VISIBLE_DEVICES and
//! CUDA_DEVICE_ORDER, mirroring the CUDA driver's documented rules.
//!
//! Pure logic: the caller reads the environment and enumerates GPUs through NVML, so this
//! can be tested without either.

use std::cmp::{Ordering, Reverse};

/// CUDA_DEVICE_ORDER. CUDA's default is FASTEST_FIRST.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceOrder {
    FastestFirst,
    PciBusId,
}

impl DeviceOrder {
    /// Parses the variable's value; None, "" and unknown values give FastestFirst (as CUDA does).
    pub fn from_env_value(value: Option<&str>) -> DeviceOrder {
        match value.map(str::trim) {
            Some(v) if v.eq_ignore_ascii_case("PCI_BUS_ID") => DeviceOrder::PciBusId,
            _ => DeviceOrder::FastestFirst,
        }
    }
}

/// One physical GPU as NVML enumerates it (NVML enumerates in PCI bus order).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PhysicalGpu {
    pub nvml_index: u32,
    pub uuid: String,                   // as NVML prints it: "GPU-6fb5a6d3-0a1b-..."
    pub pci_bus_id: String,             // e.g. "00000000:18:00.0"
    pub compute_capability: (i32, i32), // (major, minor)
    pub multiprocessors: u32,           // 0 when unknown
    pub mig_uuids: Vec<String>,         // MIG instances' UUIDs, "MIG-..."; empty when MIG is off
}

/// One device the CUDA process sees, in CUDA ordinal order (position in the Vec = torch index).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VisibleGpu {
    Whole { nvml_index: u32 },
    Mig { parent_nvml_index: u32, uuid: String },
}

/// The devices a CUDA process would see. `cuda_visible_devices` is the raw value of
/// CUDA_VISIBLE_DEVICES (None when unset).
///
/// With the variable unset this lists whole GPUs only: on a MIG-enabled GPU CUDA would
/// expose at most one instance, but which one is not knowable here, and the caller maps
/// by UUID once torch has initialised CUDA anyway.
pub fn resolve(cuda_visible_devices: Option<&str>, order: DeviceOrder, gpus: &[PhysicalGpu]) -> Vec<VisibleGpu> {
    let ordered = enumeration_order(order, gpus);
    let Some(value) = cuda_visible_devices else {
        return ordered.iter().map(|g| VisibleGpu::Whole { nvml_index: g.nvml_index }).collect();
    };

    let mut visible: Vec<VisibleGpu> = Vec::new();
    for token in value.split(',') {
        // CUDA ignores everything from the first token it cannot use, including a repeat.
        match resolve_token(token.trim(), &ordered, gpus) {
            Some(device) if !visible.iter().any(|seen| same_device(seen, &device)) => visible.push(device),
            _ => break,
        }
    }
    visible
}

/// True when two UUID spellings name the same device: compares case-insensitively after
/// stripping a leading "GPU-" or "MIG-" (torch prints UUIDs without the prefix, NVML with it).
pub fn same_uuid(a: &str, b: &str) -> bool {
    bare_uuid(a).eq_ignore_ascii_case(bare_uuid(b))
}

/// CUDA's ordinal order.
///
/// FASTEST_FIRST is CUDA's undocumented speed heuristic; compute capability, then SM count,
/// then bus id approximates it. It only matters before torch has initialised CUDA: after
/// that the caller maps devices by UUID, which is exact.
fn enumeration_order(order: DeviceOrder, gpus: &[PhysicalGpu]) -> Vec<&PhysicalGpu> {
    let mut ordered: Vec<&PhysicalGpu> = gpus.iter().collect();
    // Stable sorts: GPUs that compare equal keep NVML's order.
    match order {
        DeviceOrder::PciBusId => ordered.sort_by(|a, b| cmp_bus_id(a, b)),
        DeviceOrder::FastestFirst => ordered.sort_by(|a, b| {
            (Reverse(a.compute_capability), Reverse(a.multiprocessors))
                .cmp(&(Reverse(b.compute_capability), Reverse(b.multiprocessors)))
                .then_with(|| cmp_bus_id(a, b))
        }),
    }
    ordered
}

/// Bus ids are hex, and spellings differ in case between tools.
fn cmp_bus_id(a: &PhysicalGpu, b: &PhysicalGpu) -> Ordering {
    a.pci_bus_id.to_ascii_lowercase().cmp(&b.pci_bus_id.to_ascii_lowercase())
}

/// One trimmed token to a device, or None when CUDA would reject it.
fn resolve_token(token: &str, ordered: &[&PhysicalGpu], gpus: &[PhysicalGpu]) -> Option<VisibleGpu> {
    if !token.is_empty() && token.bytes().all(|b| b.is_ascii_digit()) {
        // Overflowing ordinals are out of range like any other.
        let ordinal: usize = token.parse().ok()?;
        return ordered.get(ordinal).map(|g| VisibleGpu::Whole { nvml_index: g.nvml_index });
    }
    // Old style is tested first because its "MIG-" would otherwise read as a new-style prefix.
    if let Some(rest) = strip_prefix_ci(token, "MIG-GPU-") {
        return resolve_old_mig(token, rest, gpus);
    }
    if let Some(prefix) = strip_prefix_ci(token, "MIG-") {
        let (parent, uuid) = unique_match(
            gpus.iter()
                .flat_map(|g| g.mig_uuids.iter().map(move |m| (g, m)))
                .filter(|(_, m)| starts_with_ci(bare_uuid(m), prefix)),
            prefix,
        )?;
        return Some(VisibleGpu::Mig { parent_nvml_index: parent.nvml_index, uuid: uuid.clone() });
    }
    if let Some(prefix) = strip_prefix_ci(token, "GPU-") {
        let gpu = unique_gpu(gpus, prefix)?;
        return Some(VisibleGpu::Whole { nvml_index: gpu.nvml_index });
    }
    None
}

/// "MIG-GPU-<uuid>/<gi>/<ci>": the GPU instance id is not the position in `mig_uuids`, so
/// the token itself is handed back for the caller to look up through NVML.
fn resolve_old_mig(token: &str, rest: &str, gpus: &[PhysicalGpu]) -> Option<VisibleGpu> {
    let mut parts = rest.split('/');
    let (gpu_uuid, gi, ci) = (parts.next()?, parts.next()?, parts.next()?);
    let is_id = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if parts.next().is_some() || !is_id(gi) || !is_id(ci) {
        return None;
    }
    let parent = unique_gpu(gpus, gpu_uuid)?;
    // Without MIG enabled on the parent there is no instance for CUDA to find.
    if parent.mig_uuids.is_empty() {
        return None;
    }
    Some(VisibleGpu::Mig { parent_nvml_index: parent.nvml_index, uuid: token.to_string() })
}

/// The one GPU whose bare UUID starts with `prefix`.
fn unique_gpu<'a>(gpus: &'a [PhysicalGpu], prefix: &str) -> Option<&'a PhysicalGpu> {
    unique_match(gpus.iter().filter(|g| starts_with_ci(bare_uuid(&g.uuid), prefix)), prefix)
}

/// CUDA rejects both a prefix that matches nothing and one that matches several devices;
/// an empty prefix would match everything, so it is rejected outright.
fn unique_match<T>(mut matches: impl Iterator<Item = T>, prefix: &str) -> Option<T> {
    if prefix.is_empty() {
        return None;
    }
    let first = matches.next()?;
    matches.next().is_none().then_some(first)
}

/// Old-style MIG tokens carry no instance UUID, so they are compared as written.
fn same_device(a: &VisibleGpu, b: &VisibleGpu) -> bool {
    match (a, b) {
        (VisibleGpu::Whole { nvml_index: x }, VisibleGpu::Whole { nvml_index: y }) => x == y,
        (VisibleGpu::Mig { uuid: x, .. }, VisibleGpu::Mig { uuid: y, .. }) => same_uuid(x, y),
        _ => false,
    }
}

fn bare_uuid(uuid: &str) -> &str {
    strip_prefix_ci(uuid, "GPU-").or_else(|| strip_prefix_ci(uuid, "MIG-")).unwrap_or(uuid)
}

fn strip_prefix_ci<'a>(s: &'a str, prefix: &str) -> Option<&'a str> {
    // `get` rather than indexing: the cut may fall inside a multi-byte character.
    let head = s.get(..prefix.len())?;
    head.eq_ignore_ascii_case(prefix).then(|| &s[prefix.len()..])
}

fn starts_with_ci(s: &str, prefix: &str) -> bool {
    strip_prefix_ci(s, prefix).is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    const UUID0: &str = "GPU-6fb5a6d3-0a1b-4c2d-9e8f-001122334455";
    const UUID1: &str = "GPU-6fb5b000-1111-2222-3333-444455556666";
    const UUID2: &str = "GPU-a0c1d2e3-aaaa-bbbb-cccc-ddddeeeeffff";
    const MIG_A: &str = "MIG-11111111-2222-3333-4444-555555555555";
    const MIG_B: &str = "MIG-1abcdef0-2222-3333-4444-555555555555";

    fn gpu(index: u32, uuid: &str, bus: u8, cc: (i32, i32), sms: u32) -> PhysicalGpu {
        PhysicalGpu {
            nvml_index: index,
            uuid: uuid.to_string(),
            pci_bus_id: format!("00000000:{bus:02X}:00.0"),
            compute_capability: cc,
            multiprocessors: sms,
            mig_uuids: Vec::new(),
        }
    }

    /// Three identical GPUs, so both orders coincide with NVML's.
    fn uniform() -> Vec<PhysicalGpu> {
        vec![gpu(0, UUID0, 0x18, (9, 0), 132), gpu(1, UUID1, 0x2A, (9, 0), 132), gpu(2, UUID2, 0x3B, (9, 0), 132)]
    }

    /// An older GPU on the lower bus and a newer one above it.
    fn mixed() -> Vec<PhysicalGpu> {
        vec![gpu(0, UUID0, 0x00, (7, 5), 40), gpu(1, UUID1, 0x01, (8, 6), 84)]
    }

    fn with_mig() -> Vec<PhysicalGpu> {
        let mut gpus = uniform();
        gpus[1].mig_uuids = vec![MIG_A.to_string(), MIG_B.to_string()];
        gpus
    }

    fn whole(indices: &[u32]) -> Vec<VisibleGpu> {
        indices.iter().map(|&i| VisibleGpu::Whole { nvml_index: i }).collect()
    }

    fn pci(value: &str, gpus: &[PhysicalGpu]) -> Vec<VisibleGpu> {
        resolve(Some(value), DeviceOrder::PciBusId, gpus)
    }

    #[test]
    fn unset_lists_all_whole_gpus() {
        assert_eq!(resolve(None, DeviceOrder::PciBusId, &uniform()), whole(&[0, 1, 2]));
        assert_eq!(resolve(None, DeviceOrder::PciBusId, &with_mig()), whole(&[0, 1, 2]));
        assert_eq!(resolve(None, DeviceOrder::FastestFirst, &[]), whole(&[]));
    }

    #[test]
    fn empty_and_blank_hide_everything() {
        assert_eq!(pci("", &uniform()), whole(&[]));
        assert_eq!(pci("   ", &uniform()), whole(&[]));
    }

    #[test]
    fn integers_and_reordering() {
        assert_eq!(pci("0", &uniform()), whole(&[0]));
        assert_eq!(pci("2,0", &uniform()), whole(&[2, 0]));
        assert_eq!(pci("1,0", &uniform()), whole(&[1, 0]));
        assert_eq!(pci("0,1,2", &uniform()), whole(&[0, 1, 2]));
    }

    #[test]
    fn whitespace_around_tokens_is_ignored() {
        assert_eq!(pci(" 1 , 0 ", &uniform()), whole(&[1, 0]));
        assert_eq!(pci("\t2,\n0", &uniform()), whole(&[2, 0]));
    }

    #[test]
    fn first_invalid_token_truncates() {
        assert_eq!(pci("0,1,-1,2", &uniform()), whole(&[0, 1]));
        assert_eq!(pci("-1", &uniform()), whole(&[]));
        assert_eq!(pci("abc", &uniform()), whole(&[]));
        assert_eq!(pci("1,abc,0", &uniform()), whole(&[1]));
        assert_eq!(pci("0,,1", &uniform()), whole(&[0]));
        assert_eq!(pci("1,", &uniform()), whole(&[1]));
        assert_eq!(pci("+1", &uniform()), whole(&[]));
    }

    #[test]
    fn out_of_range_truncates() {
        assert_eq!(pci("0,3,1", &uniform()), whole(&[0]));
        assert_eq!(pci("99999999999999999999999,0", &uniform()), whole(&[]));
        assert_eq!(pci("0", &[]), whole(&[]));
    }

    #[test]
    fn duplicates_truncate_at_second_mention() {
        assert_eq!(pci("0,1,0,2", &uniform()), whole(&[0, 1]));
        // The same GPU by ordinal and by UUID is still a repeat.
        assert_eq!(pci(&format!("1,{UUID1},2"), &uniform()), whole(&[1]));
        assert_eq!(pci(&format!("{MIG_A},MIG-1111,0"), &with_mig()).len(), 1);
    }

    #[test]
    fn full_uuid_and_prefix() {
        assert_eq!(pci(UUID2, &uniform()), whole(&[2]));
        assert_eq!(pci(&format!("{UUID1},{UUID0}"), &uniform()), whole(&[1, 0]));
        assert_eq!(pci("GPU-a0c1", &uniform()), whole(&[2]));
        assert_eq!(pci("GPU-6fb5a", &uniform()), whole(&[0]));
    }

    #[test]
    fn ambiguous_or_unknown_uuid_truncates() {
        // Both UUID0 and UUID1 start with 6fb5.
        assert_eq!(pci("2,GPU-6fb5,0", &uniform()), whole(&[2]));
        assert_eq!(pci("GPU-ffff", &uniform()), whole(&[]));
        assert_eq!(pci("GPU-", &uniform()), whole(&[]));
        // A bare UUID without its prefix is not a token CUDA accepts.
        assert_eq!(pci("a0c1d2e3", &uniform()), whole(&[]));
    }

    #[test]
    fn uuids_match_case_insensitively() {
        assert_eq!(pci("GPU-A0C1D2E3", &uniform()), whole(&[2]));
        assert_eq!(pci("gpu-a0c1", &uniform()), whole(&[2]));
        assert_eq!(pci(&UUID0.to_ascii_uppercase(), &uniform()), whole(&[0]));
    }

    #[test]
    fn new_style_mig() {
        let mig = |uuid: &str| VisibleGpu::Mig { parent_nvml_index: 1, uuid: uuid.to_string() };
        assert_eq!(pci(MIG_B, &with_mig()), vec![mig(MIG_B)]);
        assert_eq!(pci("MIG-1111", &with_mig()), vec![mig(MIG_A)]);
        assert_eq!(pci("mig-1ABC,0", &with_mig()), vec![mig(MIG_B), whole(&[0])[0].clone()]);
        // Prefix "1" matches both instances.
        assert_eq!(pci("MIG-1", &with_mig()), whole(&[]));
        assert_eq!(pci("MIG-9999", &with_mig()), whole(&[]));
        assert_eq!(pci(MIG_A, &uniform()), whole(&[]));
    }

    #[test]
    fn old_style_mig() {
        let token = format!("MIG-{UUID1}/1/0");
        assert_eq!(pci(&token, &with_mig()), vec![VisibleGpu::Mig { parent_nvml_index: 1, uuid: token.clone() }]);
        // Parent without MIG enabled: nothing to find.
        assert_eq!(pci(&format!("MIG-{UUID0}/1/0"), &with_mig()), whole(&[]));
        // Malformed instance ids.
        assert_eq!(pci(&format!("MIG-{UUID1}/1"), &with_mig()), whole(&[]));
        assert_eq!(pci(&format!("MIG-{UUID1}/1/0/2"), &with_mig()), whole(&[]));
        assert_eq!(pci(&format!("MIG-{UUID1}/x/0"), &with_mig()), whole(&[]));
        // Same token twice is a repeat.
        assert_eq!(pci(&format!("{token},{token}"), &with_mig()).len(), 1);
    }

    #[test]
    fn pci_order_versus_fastest_first() {
        let gpus = mixed();
        assert_eq!(resolve(None, DeviceOrder::PciBusId, &gpus), whole(&[0, 1]));
        assert_eq!(resolve(None, DeviceOrder::FastestFirst, &gpus), whole(&[1, 0]));
        assert_eq!(resolve(Some("0"), DeviceOrder::PciBusId, &gpus), whole(&[0]));
        assert_eq!(resolve(Some("0"), DeviceOrder::FastestFirst, &gpus), whole(&[1]));
        // UUIDs name the same GPU whatever the order.
        assert_eq!(resolve(Some(UUID0), DeviceOrder::FastestFirst, &gpus), whole(&[0]));
    }

    #[test]
    fn fastest_first_tie_breaks() {
        // Same capability: more SMs first; full tie: lower bus first.
        let gpus =
            vec![gpu(0, UUID0, 0x10, (8, 0), 108), gpu(1, UUID1, 0x20, (8, 0), 120), gpu(2, UUID2, 0x05, (8, 0), 108)];
        assert_eq!(resolve(None, DeviceOrder::FastestFirst, &gpus), whole(&[1, 2, 0]));
        assert_eq!(resolve(None, DeviceOrder::PciBusId, &gpus), whole(&[2, 0, 1]));
    }

    #[test]
    fn device_order_from_env_value() {
        assert_eq!(DeviceOrder::from_env_value(None), DeviceOrder::FastestFirst);
        assert_eq!(DeviceOrder::from_env_value(Some("")), DeviceOrder::FastestFirst);
        assert_eq!(DeviceOrder::from_env_value(Some("FASTEST_FIRST")), DeviceOrder::FastestFirst);
        assert_eq!(DeviceOrder::from_env_value(Some("bogus")), DeviceOrder::FastestFirst);
        assert_eq!(DeviceOrder::from_env_value(Some("PCI_BUS_ID")), DeviceOrder::PciBusId);
        assert_eq!(DeviceOrder::from_env_value(Some(" pci_bus_id ")), DeviceOrder::PciBusId);
    }

    #[test]
    fn same_uuid_with_and_without_prefixes() {
        let bare = &UUID0[4..];
        assert!(same_uuid(UUID0, bare));
        assert!(same_uuid(bare, UUID0));
        assert!(same_uuid(UUID0, &UUID0.to_ascii_uppercase()));
        assert!(same_uuid(MIG_A, &MIG_A[4..]));
        assert!(same_uuid("gpu-ABC", "abc"));
        assert!(!same_uuid(UUID0, UUID1));
        assert!(!same_uuid(UUID0, &UUID0[..20]));
        assert!(!same_uuid("", UUID0));
    }

    #[test]
    fn odd_input_never_panics() {
        let odd = [
            ",",
            ",,,",
            "é",
            "GPU-é",
            "MIG-é",
            "MIG-GPU-",
            "MIG-GPU-é/1/1",
            "MIG-GPU-//",
            "G",
            "GP",
            "\u{1F600},0",
            "0\u{0}",
            "MIG-GPU-6fb5a6d3/99999999999999999999/0",
            "-",
            "0x1",
            "1e3",
            "٣",
            "GPU-6fb5a6d3-0a1b-4c2d-9e8f-001122334455-extra",
        ];
        for value in odd {
            for order in [DeviceOrder::PciBusId, DeviceOrder::FastestFirst] {
                for gpus in [uniform(), with_mig(), mixed(), Vec::new()] {
                    let _ = resolve(Some(value), order, &gpus);
                }
            }
            let _ = same_uuid(value, "é");
            let _ = DeviceOrder::from_env_value(Some(value));
        }
        assert_eq!(pci("é,0", &uniform()), whole(&[]));
    }
}
