//! Property tests of the parsers that read what people type: sizes, intervals and
//! CUDA_VISIBLE_DEVICES.
//! No input makes them panic, and what they return means what their documentation says.

use gpuexp_core::snapshot::visible::{resolve, DeviceOrder, PhysicalGpu, VisibleGpu};
use std::time::Duration;

use gpuexp_core::units::{bytes, parse_interval, parse_size};
use proptest::prelude::*;

const UNITS: [(&str, u64); 10] = [
    ("", 1),
    ("B", 1),
    ("KiB", 1 << 10),
    ("KB", 1 << 10),
    ("MiB", 1 << 20),
    ("MB", 1 << 20),
    ("mib", 1 << 20),
    ("GiB", 1 << 30),
    ("GB", 1 << 30),
    ("TiB", 1 << 40),
];

fn gpus(count: u32) -> Vec<PhysicalGpu> {
    (0..count)
        .map(|i| PhysicalGpu {
            nvml_index: i,
            uuid: format!("GPU-{i:08x}-0000-0000-0000-{:012x}", i * 7919),
            pci_bus_id: format!("00000000:{:02X}:00.0", 0x18 + i),
            compute_capability: (9, 0),
            multiprocessors: 132,
            mig_uuids: Vec::new(),
        })
        .collect()
}

fn whole(indices: &[u32]) -> Vec<VisibleGpu> {
    indices.iter().map(|&nvml_index| VisibleGpu::Whole { nvml_index }).collect()
}

proptest! {
    #[test]
    fn no_text_makes_parse_size_panic(text in "\\PC*") {
        let _ = parse_size(&text);
    }

    #[test]
    fn a_size_in_any_unit_is_that_many_bytes(n in 1u64..1_000_000, unit in 0usize..UNITS.len(), space in any::<bool>()) {
        let (name, scale) = UNITS[unit];
        let text = format!("{n}{}{name}", if space && !name.is_empty() { " " } else { "" });
        // Past 1 PiB a size is refused, never saturated: no machine has that much.
        if n * scale <= 1 << 50 {
            prop_assert_eq!(parse_size(&text), Ok(n * scale), "{}", text);
        } else {
            prop_assert!(parse_size(&text).is_err(), "{} accepted", text);
        }
    }

    #[test]
    fn what_bytes_writes_reads_back_within_its_rounding(n in 1u64..(1 << 50)) {
        let read = parse_size(&bytes(n)).expect("bytes() writes a size parse_size reads") as f64;
        // bytes() keeps two decimals: at most half a hundredth of the unit off.
        prop_assert!((read - n as f64).abs() <= n as f64 * 0.005 + 1.0, "{} read back as {}", bytes(n), read);
    }

    #[test]
    fn negative_and_unknown_units_are_refused_and_zero_is_zero(n in 0u64..1000, unit in "[a-zA-Z]{1,4}") {
        let negative = format!("-{n}GiB");
        prop_assert!(parse_size(&negative).is_err());
        // Zero reads as zero, as the number 0 does; callers that need a positive size say so.
        prop_assert_eq!(parse_size("0"), Ok(0));
        let known = UNITS.iter().any(|(name, _)| name.eq_ignore_ascii_case(&unit))
            || ["b", "byte", "bytes", "k", "m", "g", "t", "p", "kb", "pb", "pib", "tb"].contains(&unit.to_ascii_lowercase().as_str());
        if !known {
            let text = format!("{}{unit}", n + 1);
            prop_assert!(parse_size(&text).is_err(), "{} accepted", text);
        }
    }

    #[test]
    fn no_cuda_visible_devices_value_makes_resolve_panic(value in "\\PC*", count in 0u32..9, pci in any::<bool>()) {
        let order = if pci { DeviceOrder::PciBusId } else { DeviceOrder::FastestFirst };
        let visible = resolve(Some(&value), order, &gpus(count));
        prop_assert!(visible.len() <= value.split(',').count());
        for (i, a) in visible.iter().enumerate() {
            let in_range = matches!(a, VisibleGpu::Whole { nvml_index } if *nvml_index < count);
            prop_assert!(in_range, "{:?} for {} GPUs", a, count);
            prop_assert!(!visible[i + 1..].contains(a), "{:?} listed twice for {:?}", a, value);
        }
    }

    #[test]
    fn indices_are_taken_in_order_up_to_the_first_one_cuda_cannot_use(
        picks in proptest::collection::vec(0u32..12, 0..8),
        count in 1u32..9,
    ) {
        let value = picks.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
        let usable: Vec<u32> = picks
            .iter()
            .scan(Vec::new(), |seen: &mut Vec<u32>, &p| {
                if p >= count || seen.contains(&p) {
                    None
                } else {
                    seen.push(p);
                    Some(p)
                }
            })
            .collect();
        prop_assert_eq!(resolve(Some(&value), DeviceOrder::PciBusId, &gpus(count)), whole(&usable), "{}", value);
    }

    #[test]
    fn unset_means_every_gpu_and_uuids_name_their_gpu(count in 1u32..9, pick in 0u32..8) {
        let all: Vec<u32> = (0..count).collect();
        prop_assert_eq!(resolve(None, DeviceOrder::PciBusId, &gpus(count)), whole(&all));
        let pick = pick % count;
        let uuid = gpus(count)[pick as usize].uuid.clone();
        prop_assert_eq!(resolve(Some(&uuid), DeviceOrder::FastestFirst, &gpus(count)), whole(&[pick]));
    }

    #[test]
    fn no_text_makes_parse_interval_panic(text in "\\PC*") {
        let _ = parse_interval(&text);
    }

    #[test]
    fn an_interval_in_any_unit_is_that_long(n in 1u64..100_000, unit in 0usize..5) {
        let (name, millis) = [("ms", 1), ("s", 1000), ("sec", 1000), ("m", 60_000), ("min", 60_000)][unit];
        let text = format!("{n}{name}");
        prop_assert_eq!(parse_interval(&text).ok(), Some(Duration::from_millis(n * millis)), "{}", text);
        prop_assert_eq!(parse_interval(&n.to_string()).ok(), Some(Duration::from_secs(n)), "a plain number is seconds");
    }

    #[test]
    fn zero_and_negative_intervals_are_refused(n in 0u64..1000, unit in "(ms|s|min)?") {
        let negative = format!("-{n}{unit}");
        prop_assert!(parse_interval(&negative).is_err());
        let zero = format!("0{unit}");
        prop_assert!(parse_interval(&zero).is_err());
    }
}
