//! Memory of pipeline devices over a run and LOIP's online adaptation (design §6): the
//! shared policy of [`loip_plan::adapt`] (no copy here), driven with the simulator's block
//! times ([`Models`]).

use crate::compute::DeviceModel;
pub use loip_plan::adapt::{Adapter, BlockTimes, DevState, Measure};

/// The simulator's block times: one [`DeviceModel`] per pipeline device.
#[derive(Debug, Clone)]
pub struct Models<'a>(pub Vec<DeviceModel<'a>>);

impl BlockTimes for Models<'_> {
    fn blocks(&self, device: usize, tokens: u32, n: u64) -> (f64, f64) {
        match self.0.get(device) {
            Some(m) => (m.attn(1, tokens, n, 1.0), m.mlp(tokens, 1.0)),
            None => (0.0, 0.0),
        }
    }

    fn head(&self, device: usize) -> f64 {
        self.0.get(device).map_or(0.0, |m| m.head(1))
    }
}
