//! The worker's side of a plan switch: apply it to the loaded device or say why not.

use crate::executor::{Device, StageSpec};
use crate::wire::{DeviceMemory, ToCoordinator, ToWorker};

/// The worker's side: applies a switch to the loaded device, or says why not (`refuse`:
/// refuses it as if it did not fit, see [`crate::worker::WorkerOptions::refuse_switches`]).
pub(crate) fn apply_switch(
    device: Option<&mut Device>,
    stages: Vec<StageSpec>,
    refuse: bool,
) -> ToCoordinator {
    let Some(d) = device else {
        return ToCoordinator::SwitchRefused {
            message: "plan switch refused: no device is loaded".into(),
            memory: DeviceMemory::default(),
        };
    };
    let r = if refuse {
        Err(crate::RuntimeError::Invalid(
            "this worker refuses plan switches (fault injection)".into(),
        ))
    } else {
        d.switch(stages)
    };
    match r {
        Ok(m) => {
            tracing::info!(
                "plan switch applied: resident {} B, slot {} B, KV room {} B",
                m.resident,
                m.slot,
                m.kv_budget
            );
            ToCoordinator::Switched { memory: m.into() }
        }
        Err(e) => ToCoordinator::SwitchRefused {
            message: format!("plan switch refused: {e}"),
            memory: d.memory().into(),
        },
    }
}

/// The control frame of a switch to `stages`, ready for a device's writer.
pub(crate) fn switch_payload(stages: Vec<StageSpec>) -> Option<Vec<u8>> {
    crate::wire::control_payload(&ToWorker::Switch { stages }).ok()
}
