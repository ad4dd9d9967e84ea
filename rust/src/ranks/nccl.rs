//! NCCL's share of what torch does not track on a rank's GPU.
//!
//! NCCL allocates its communicator's buffers with the driver, outside torch's allocator, so
//! they show only in NVML's figure for the process: in `explain()`'s residual, "not torch".
//! A lazily initialised group creates its communicator at the first collective, so the growth
//! of that residual from gpuexp's last reading before the communicator existed to its first
//! reading after it is NCCL's (with whatever else loaded in between: the nearer the readings,
//! the tighter the figure).

/// Readings of one process's residual on its rank's GPU around the communicator's creation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NcclShare {
    /// (torch index, residual) at the last reading without a communicator.
    before: Option<(u32, u64)>,
    /// (torch index, growth) once a reading found the communicator.
    grown: Option<(u32, u64)>,
}

impl NcclShare {
    /// One reading of `device`'s residual (NVML process used less torch reserved), and whether
    /// the group's NCCL communicator existed then.
    pub fn observe(&mut self, device: u32, residual: u64, communicator: bool) {
        if self.grown.is_some() {
            return;
        }
        match (communicator, self.before) {
            (false, _) => self.before = Some((device, residual)),
            (true, Some((before_on, before))) if before_on == device => {
                self.grown = Some((device, residual.saturating_sub(before)));
            }
            // The communicator came before any reading (a group bound to its device creates
            // it at init): nothing measured its growth.
            (true, _) => {}
        }
    }

    /// A reading of `device`'s residual as `snapshot` finds it, where it read both NVML's figure
    /// for this process and torch's.
    pub fn observe_in(&mut self, snapshot: &crate::snapshot::Snapshot, device: u32, communicator: bool) {
        let Some(gpu) = snapshot.gpus.iter().find(|g| g.torch_index == device) else { return };
        if let (Some(process), Some(torch)) = (gpu.process_used, gpu.torch) {
            self.observe(device, process.saturating_sub(torch.reserved), communicator);
        }
    }

    /// NCCL's share on `device`, where a reading before and one after its communicator were taken.
    pub fn on(&self, device: u32) -> Option<u64> {
        self.grown.filter(|(d, _)| *d == device).map(|(_, grown)| grown)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::testing::{gpu, host, torch};
    use crate::snapshot::GpuReading;

    #[test]
    fn a_snapshot_s_residual_is_nvml_s_process_figure_less_torch_reserved() {
        let reading = |process: Option<u64>| GpuReading {
            process_used: process,
            torch: Some(torch(0, 100 * MIB, 0, 100 * MIB)),
            ..gpu(1, "GPU-1")
        };
        let mut share = NcclShare::default();
        share.observe_in(&host(1.0, 0, 0).with_gpu(reading(Some(300 * MIB))), 1, false);
        share.observe_in(&host(2.0, 0, 0).with_gpu(reading(None)), 1, true);
        assert_eq!(share.on(1), None, "a reading without NVML's figure is no reading");
        share.observe_in(&host(3.0, 0, 0).with_gpu(reading(Some(700 * MIB))), 0, true);
        assert_eq!(share.on(1), None, "another device is not in the snapshot");
        share.observe_in(&host(4.0, 0, 0).with_gpu(reading(Some(700 * MIB))), 1, true);
        assert_eq!(share.on(1), Some(400 * MIB));
    }

    const MIB: u64 = 1 << 20;

    #[test]
    fn the_growth_across_the_communicator_s_creation_is_nccl_s_and_stays() {
        let mut share = NcclShare::default();
        share.observe(1, 500 * MIB, false);
        share.observe(1, 520 * MIB, false);
        assert_eq!(share.on(1), None, "no communicator yet");
        share.observe(1, 1020 * MIB, true);
        assert_eq!(share.on(1), Some(500 * MIB), "measured from the last reading before it");
        share.observe(1, 1400 * MIB, true);
        assert_eq!(share.on(1), Some(500 * MIB), "later growth is not NCCL's");
        assert_eq!(share.on(0), None);
    }

    #[test]
    fn a_communicator_that_existed_before_any_reading_is_not_measured() {
        let mut share = NcclShare::default();
        share.observe(0, 900 * MIB, true);
        share.observe(0, 950 * MIB, true);
        assert_eq!(share.on(0), None);
    }

    #[test]
    fn a_reading_on_another_device_measures_nothing() {
        let mut share = NcclShare::default();
        share.observe(0, 500 * MIB, false);
        share.observe(1, 900 * MIB, true);
        assert_eq!(share.on(1), None);
        share.observe(1, 500 * MIB, false);
        share.observe(1, 600 * MIB, true);
        assert_eq!(share.on(1), Some(100 * MIB));
    }

    #[test]
    fn a_residual_that_shrank_gives_zero_not_an_underflow() {
        let mut share = NcclShare::default();
        share.observe(0, 600 * MIB, false);
        share.observe(0, 550 * MIB, true);
        assert_eq!(share.on(0), Some(0));
    }
}
