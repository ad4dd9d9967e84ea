//! `gpuexp status`: what the driver says, then every device with its compute processes, as text
//! and (through serde) as JSON.

use serde::Serialize;

use crate::error::Result;
use crate::snapshot::nvml::{self, DeviceStatus};
use crate::units::bytes;

/// `gpuexp status`: what the driver says, then every device.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Status {
    pub driver: String,
    /// The newest CUDA version the driver supports, e.g. "13.0".
    pub cuda: String,
    /// "nvml", or "cuda" when CUDA_VISIBLE_DEVICES chose and ordered the devices.
    pub order: &'static str,
    pub devices: Vec<DeviceStatus>,
}

impl Status {
    /// Fails with [`crate::error::Error::NoDriver`] where there is no driver to ask.
    pub fn read(cuda_order: bool, with_processes: bool) -> Result<Status> {
        let (driver, cuda) = nvml::driver_versions()?;
        let devices = nvml::list_devices(cuda_order)?
            .iter()
            .map(|device| device.status(with_processes))
            .collect::<Result<_>>()?;
        Ok(Status { driver, cuda, order: if cuda_order { "cuda" } else { "nvml" }, devices })
    }

    pub fn to_text(&self) -> String {
        let order = order_label(self.order == "cuda");
        let mut lines = vec![format!("gpuexp status · driver {} · CUDA {} · {order}", self.driver, self.cuda)];
        for device in &self.devices {
            lines.push(device_line(device));
            for process in &device.processes {
                let used = process.used.map(bytes).unwrap_or_else(|| "n/a".into());
                let command: String = process.command.chars().take(60).collect();
                lines.push(format!("    pid {} ({}) {command} · {used}", process.pid, process.user));
            }
        }
        if self.devices.is_empty() {
            lines.push("no GPU listed".into());
        }
        lines.join("\n")
    }
}

/// Which devices are shown, and in what order, in words: indices mean different GPUs in each.
pub(crate) fn order_label(cuda_order: bool) -> &'static str {
    if cuda_order {
        "CUDA order (CUDA_VISIBLE_DEVICES)"
    } else {
        "NVML order"
    }
}

/// One line per device, as `status` and the live view show it.
pub(crate) fn device_line(device: &DeviceStatus) -> String {
    let a = device.activity;
    let mut activity = vec![a.utilization.map_or_else(|| "util n/a".to_string(), |u| format!("{u}%"))];
    activity.extend(a.temperature_c.map(|t| format!("{t} °C")));
    activity.extend(a.power_w.map(|w| format!("{w:.0} W")));
    format!(
        "[{}] {} · {} / {} · {} · {}",
        device.index,
        device.name,
        bytes(device.used),
        bytes(device.total),
        activity.join(" · "),
        device.uuid
    )
}

/// Devices made up for the tests of what `status` and `watch` print.
#[cfg(test)]
pub(crate) mod testing {
    use crate::snapshot::nvml::{Activity, DeviceStatus, ProcessStatus};

    /// An H200 with one process on it, 3 GiB of 140 GiB used.
    pub(crate) fn device(index: u32, activity: Activity) -> DeviceStatus {
        DeviceStatus {
            index,
            nvml_index: index,
            uuid: format!("GPU-{index}"),
            name: "NVIDIA H200".into(),
            used: 3 << 30,
            total: 140 << 30,
            activity,
            processes: vec![ProcessStatus {
                pid: 42,
                user: "ann".into(),
                command: "python train.py".into(),
                used: Some(1 << 30),
            }],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::testing::device;
    use super::*;
    use crate::error::Error;
    use crate::snapshot::nvml::Activity;

    #[test]
    fn status_text_lists_processes_under_their_device() {
        let status = Status {
            driver: "580.1".into(),
            cuda: "13.0".into(),
            order: "cuda",
            devices: vec![device(0, Activity::default())],
        };
        let text = status.to_text();
        assert!(
            text.starts_with("gpuexp status · driver 580.1 · CUDA 13.0 · CUDA order (CUDA_VISIBLE_DEVICES)"),
            "{text}"
        );
        assert!(text.contains("[0] NVIDIA H200 · 3.00 GiB / 140.00 GiB · util n/a · GPU-0\n    pid 42 (ann) python train.py · 1.00 GiB"), "{text}");
        let empty = Status { devices: vec![], ..status };
        assert!(empty.to_text().ends_with("no GPU listed"));
    }

    #[test]
    fn a_machine_without_a_driver_is_told_apart_from_a_failed_read() {
        match nvml::available() {
            // The `gpuexp` command exits 3 for this kind only.
            Err(_) => {
                assert!(matches!(nvml::available(), Err(Error::NoDriver(_))));
                assert!(matches!(Status::read(false, false), Err(Error::NoDriver(_))));
                assert!(matches!(Status::read(true, false), Err(Error::NoDriver(_))));
            }
            Ok(()) => assert!(Status::read(false, false).is_ok()),
        }
    }
}
