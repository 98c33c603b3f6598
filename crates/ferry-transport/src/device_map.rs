//! Device maps (PyTorch's `TensorPipeRpcBackendOptions.set_device_map`):
//! for each peer worker, which of its devices each local device maps to.
//!
//! `set_device_map("trainer1", [(cuda:0, cuda:1)])` on worker `ps` says:
//! a tensor `ps` sends to `trainer1` from its `cuda:0` lands on
//! `trainer1`'s `cuda:1`, and (the reverse, as PyTorch uses for replies) a
//! tensor `trainer1` sends from its `cuda:1` lands on `ps`'s `cuda:0`.
//! Ferry's descriptors carry only the sender's device, so the receiving
//! worker decides where a tensor lands from its own map for the sender
//! ([`DeviceMaps::received_on`]): both workers of a pair that exchange CUDA
//! tensors set matching maps (PyTorch needs only the caller's, since it
//! sends the target devices along).
//!
//! Rules, as PyTorch's:
//! - a map is one-to-one: two local devices onto one peer device is an
//!   error ([`DeviceMapError::NotInjective`]);
//! - at init ([`DeviceMaps::validate`]) every local device a map names
//!   exists here: `cpu` always, `cuda:N` when CUDA is available and the host
//!   has more than `N` devices; without CUDA any `cuda:N` in a map is an
//!   error carrying "CUDA not available on this host"; with a static group,
//!   every worker a map names is one of the group;
//! - a CPU tensor without a mapping for `cpu` stays on the CPU; a CPU
//!   tensor may be mapped onto a GPU and a GPU tensor onto the CPU;
//! - a CUDA tensor needs a mapping for its device
//!   ([`DeviceMapError::NoMapping`]).

use std::collections::BTreeMap;

use ferry_wire::Device;

use crate::cuda::{self, CudaUnavailable};
use crate::TransportError;

/// Why a device map is refused, or a tensor has no device to land on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceMapError {
    /// Two local devices map onto one device of the peer.
    #[error(
        "device map for worker {worker:?}: {first} and {second} both map to {target}; \
         a device map must be one-to-one"
    )]
    NotInjective {
        /// The peer worker.
        worker: String,
        /// The peer's device named twice.
        target: Device,
        /// One local device mapped onto it.
        first: Device,
        /// The other.
        second: Device,
    },
    /// A local device of a map cannot be used here.
    #[error("device map for worker {worker:?} names local device {device}: {reason}")]
    LocalDevice {
        /// The peer worker.
        worker: String,
        /// The local device.
        device: Device,
        /// Why it cannot be used ("CUDA not available on this host: …").
        #[source]
        reason: CudaUnavailable,
    },
    /// A map names a worker outside the (static) group.
    #[error("device map names worker {worker:?}, which is not in the group ({known})")]
    UnknownWorker {
        /// The worker named.
        worker: String,
        /// The group's workers.
        known: String,
    },
    /// A CUDA tensor's device has no mapping with this worker.
    #[error(
        "no device mapping for {device} with worker {worker:?}: CUDA tensors travel only \
         between mapped devices (set a device map for this worker)"
    )]
    NoMapping {
        /// The peer worker.
        worker: String,
        /// The device without a mapping (local when sending, the peer's
        /// when receiving).
        device: Device,
    },
    /// The peer sends a tensor to one device and this worker's map lands
    /// it on another: the two workers' maps for each other disagree.
    #[error(
        "worker {worker:?} sends a tensor to {sent}, but this worker's device map for it \
         lands it on {here}: the two workers' device maps disagree"
    )]
    Disagree {
        /// The peer worker.
        worker: String,
        /// The device the peer's maps chose.
        sent: Device,
        /// The device this worker's maps chose.
        here: Device,
    },
    /// A device name that is neither `cpu` nor `cuda:N`.
    #[error("device map for worker {worker:?}: {text:?} is not a device (cpu or cuda:N)")]
    BadDevice {
        /// The peer worker.
        worker: String,
        /// The text given.
        text: String,
    },
}

/// Per peer worker, local device → the peer's device.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceMaps {
    maps: BTreeMap<String, BTreeMap<Device, Device>>,
}

impl DeviceMaps {
    /// No maps: only CPU tensors travel.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds mappings for worker `to` (merged into earlier ones for it, an
    /// entry for the same local device replaced), as PyTorch's
    /// `set_device_map`. The merged map must stay one-to-one.
    pub fn set_device_map(
        &mut self,
        to: &str,
        map: impl IntoIterator<Item = (Device, Device)>,
    ) -> Result<(), DeviceMapError> {
        let mut merged = self.maps.get(to).cloned().unwrap_or_default();
        merged.extend(map);
        check_injective(to, &merged)?;
        self.maps.insert(to.to_owned(), merged);
        Ok(())
    }

    /// Like [`set_device_map`](Self::set_device_map) with device names
    /// (`"cuda:0"`, `"cpu"`), as PyTorch's options take them.
    pub fn set_device_map_str(
        &mut self,
        to: &str,
        map: &[(&str, &str)],
    ) -> Result<(), DeviceMapError> {
        let parse = |text: &str| {
            text.trim()
                .parse::<Device>()
                .map_err(|_| DeviceMapError::BadDevice {
                    worker: to.to_owned(),
                    text: text.to_owned(),
                })
        };
        let parsed = map
            .iter()
            .map(|(l, r)| Ok((parse(l)?, parse(r)?)))
            .collect::<Result<Vec<_>, DeviceMapError>>()?;
        self.set_device_map(to, parsed)
    }

    /// The map for worker `to`, if any.
    pub fn get(&self, to: &str) -> Option<&BTreeMap<Device, Device>> {
        self.maps.get(to)
    }

    /// Whether no map is set.
    pub fn is_empty(&self) -> bool {
        self.maps.is_empty()
    }

    /// Checks the maps at init: local devices exist here (`cuda_devices`:
    /// the host's CUDA device count, or why CUDA is not available), and,
    /// when `group` is given (a static group), every worker named is in it.
    pub fn validate(
        &self,
        group: Option<&[String]>,
        cuda_devices: Result<usize, CudaUnavailable>,
    ) -> Result<(), DeviceMapError> {
        for (worker, map) in &self.maps {
            if let Some(group) = group {
                if !group.iter().any(|w| w == worker) {
                    return Err(DeviceMapError::UnknownWorker {
                        worker: worker.clone(),
                        known: group.join(", "),
                    });
                }
            }
            check_injective(worker, map)?;
            for &device in map.keys() {
                let Device::Cuda(i) = device else { continue };
                let reason = match &cuda_devices {
                    Err(reason) => reason.clone(),
                    Ok(count) if usize::from(i) < *count => continue,
                    Ok(count) => CudaUnavailable::NoSuchDevice {
                        device,
                        count: *count,
                    },
                };
                return Err(DeviceMapError::LocalDevice {
                    worker: worker.clone(),
                    device,
                    reason,
                });
            }
        }
        Ok(())
    }

    /// The device of worker `to` that a tensor sent there from local
    /// `device` lands on.
    pub fn target(&self, to: &str, device: Device) -> Result<Device, DeviceMapError> {
        match (self.maps.get(to).and_then(|m| m.get(&device)), device) {
            (Some(&d), _) => Ok(d),
            (None, Device::Cpu) => Ok(Device::Cpu),
            (None, Device::Cuda(_)) => Err(DeviceMapError::NoMapping {
                worker: to.to_owned(),
                device,
            }),
        }
    }

    /// The local device a tensor that worker `from` sent from its `device`
    /// lands on: the local device this worker's map for `from` maps onto
    /// `device` (the map's reverse); a CPU tensor without a mapping stays on
    /// the CPU.
    pub fn received_on(&self, from: &str, device: Device) -> Result<Device, DeviceMapError> {
        let found = self
            .maps
            .get(from)
            .and_then(|m| m.iter().find(|(_, r)| **r == device).map(|(l, _)| *l));
        match (found, device) {
            (Some(local), _) => Ok(local),
            (None, Device::Cpu) => Ok(Device::Cpu),
            (None, Device::Cuda(_)) => Err(DeviceMapError::NoMapping {
                worker: from.to_owned(),
                device,
            }),
        }
    }

    /// The maps seen from the peers' side: for each worker, its device →
    /// the local device (what a peer would set for this worker).
    pub fn inverse(&self) -> BTreeMap<String, BTreeMap<Device, Device>> {
        self.maps
            .iter()
            .map(|(w, m)| (w.clone(), m.iter().map(|(l, r)| (*r, *l)).collect()))
            .collect()
    }
}

fn check_injective(worker: &str, map: &BTreeMap<Device, Device>) -> Result<(), DeviceMapError> {
    let mut seen: BTreeMap<Device, Device> = BTreeMap::new();
    for (&local, &remote) in map {
        if let Some(&first) = seen.get(&remote) {
            return Err(DeviceMapError::NotInjective {
                worker: worker.to_owned(),
                target: remote,
                first,
                second: local,
            });
        }
        seen.insert(remote, local);
    }
    Ok(())
}

/// The device a tensor that worker `peer` sent from its `device` lands on
/// here (the device maps' reverse), checked to exist. A CUDA tensor with no
/// landing device on a host without CUDA gets [`CudaUnavailable`] rather
/// than the missing mapping.
pub(crate) fn landing(
    maps: &DeviceMaps,
    peer: &str,
    device: Device,
) -> Result<Device, TransportError> {
    match maps.received_on(peer, device) {
        Ok(local) => {
            cuda::check_device(local)?;
            Ok(local)
        }
        Err(e) => Err(cuda::explain(e.into(), device, device)),
    }
}

/// The device of worker `peer` a tensor sent there from local `device`
/// lands on; a CUDA tensor needs CUDA here ([`CudaUnavailable`]) and a
/// mapping.
pub(crate) fn target(
    maps: &DeviceMaps,
    peer: &str,
    device: Device,
) -> Result<Device, TransportError> {
    cuda::check_device(device)?;
    maps.target(peer, device).map_err(TransportError::from)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const C0: Device = Device::Cuda(0);
    const C1: Device = Device::Cuda(1);
    const C2: Device = Device::Cuda(2);

    #[test]
    fn pytorch_rules_for_cpu_and_cuda() {
        let mut m = DeviceMaps::new();
        m.set_device_map_str("w1", &[("cuda:0", "cuda:1"), ("cuda:1", "cpu")])
            .expect("valid");
        assert_eq!(m.target("w1", C0), Ok(C1));
        assert_eq!(m.target("w1", C1), Ok(Device::Cpu));
        // Unmapped CPU stays on the CPU; unmapped CUDA is an error.
        assert_eq!(m.target("w1", Device::Cpu), Ok(Device::Cpu));
        assert_eq!(m.target("w2", Device::Cpu), Ok(Device::Cpu));
        let err = m.target("w1", C2).unwrap_err();
        assert!(
            err.to_string()
                .contains("no device mapping for cuda:2 with worker \"w1\""),
            "{err}"
        );
        // Receiving from w1: its cuda:1 lands on our cuda:0, its cpu on our cuda:1.
        assert_eq!(m.received_on("w1", C1), Ok(C0));
        assert_eq!(m.received_on("w1", Device::Cpu), Ok(C1));
        assert_eq!(m.received_on("w2", Device::Cpu), Ok(Device::Cpu));
        assert_eq!(
            m.received_on("w2", C0),
            Err(DeviceMapError::NoMapping {
                worker: "w2".into(),
                device: C0
            })
        );
        // CPU onto a GPU is allowed.
        m.set_device_map("w3", [(Device::Cpu, C1)]).expect("valid");
        assert_eq!(m.target("w3", Device::Cpu), Ok(C1));
    }

    #[test]
    fn maps_must_be_one_to_one_also_after_merging() {
        let mut m = DeviceMaps::new();
        let err = m.set_device_map("w1", [(C0, C1), (C2, C1)]).unwrap_err();
        assert_eq!(
            err,
            DeviceMapError::NotInjective {
                worker: "w1".into(),
                target: C1,
                first: C0,
                second: C2
            }
        );
        assert!(
            err.to_string()
                .contains("cuda:0 and cuda:2 both map to cuda:1"),
            "{err}"
        );
        assert!(m.get("w1").is_none(), "a refused map is not kept");
        m.set_device_map("w1", [(C0, C1)]).expect("valid");
        assert!(m.set_device_map("w1", [(C2, C1)]).is_err());
        // Replacing the entry of the same local device is fine.
        m.set_device_map("w1", [(C0, C2)]).expect("replaced");
        assert_eq!(m.target("w1", C0), Ok(C2));
        let err = m
            .set_device_map_str("w1", &[("gpu0", "cuda:0")])
            .unwrap_err();
        assert!(
            err.to_string().contains("\"gpu0\" is not a device"),
            "{err}"
        );
    }

    #[test]
    fn validation_checks_local_devices_and_workers() {
        let mut m = DeviceMaps::new();
        m.set_device_map("w1", [(C1, C0)]).expect("valid");
        assert_eq!(m.validate(None, Ok(2)), Ok(()));
        let err = m.validate(None, Ok(1)).unwrap_err();
        assert!(
            err.to_string()
                .contains("worker \"w1\" names local device cuda:1")
                && err
                    .to_string()
                    .contains("cuda:1 does not exist (this host has 1 CUDA device(s))"),
            "{err}"
        );
        let err = m
            .validate(None, Err(CudaUnavailable::NoDriver))
            .unwrap_err();
        assert!(
            err.to_string().contains("CUDA not available on this host"),
            "{err}"
        );
        let group = ["w0".to_owned(), "w2".to_owned()];
        let err = m.validate(Some(&group), Ok(2)).unwrap_err();
        assert_eq!(
            err,
            DeviceMapError::UnknownWorker {
                worker: "w1".into(),
                known: "w0, w2".into()
            }
        );
        // Maps naming only the CPU need no CUDA.
        let mut cpu = DeviceMaps::new();
        cpu.set_device_map("w1", [(Device::Cpu, C0)])
            .expect("valid");
        assert_eq!(cpu.validate(None, Err(CudaUnavailable::NotBuilt)), Ok(()));
    }

    fn device() -> impl Strategy<Value = Device> {
        prop_oneof![Just(Device::Cpu), (0u16..4).prop_map(Device::Cuda)]
    }

    proptest! {
        #[test]
        fn accepted_maps_are_exactly_the_injective_ones_and_invert(
            pairs in prop::collection::vec((device(), device()), 0..6)
        ) {
            let mut m = DeviceMaps::new();
            let merged: BTreeMap<Device, Device> = pairs.iter().copied().collect();
            let distinct: std::collections::BTreeSet<Device> = merged.values().copied().collect();
            let result = m.set_device_map("peer", pairs.iter().copied());
            prop_assert_eq!(result.is_ok(), distinct.len() == merged.len());
            if result.is_err() {
                return Ok(());
            }
            let inverse = m.inverse();
            for (&local, &remote) in &merged {
                prop_assert_eq!(m.target("peer", local), Ok(remote));
                prop_assert_eq!(m.received_on("peer", remote), Ok(local));
                prop_assert_eq!(inverse["peer"][&remote], local);
            }
            // The peer's view, set as its own map, sends back where we expect.
            let mut peer = DeviceMaps::new();
            peer.set_device_map("me", inverse["peer"].iter().map(|(a, b)| (*a, *b)))
                .expect("an inverse of a one-to-one map is one-to-one");
            for (&local, &remote) in &merged {
                prop_assert_eq!(peer.target("me", remote), Ok(local));
                prop_assert_eq!(peer.received_on("me", local), Ok(remote));
            }
            // Validation with enough devices passes; with none it names CUDA.
            prop_assert_eq!(m.validate(None, Ok(4)), Ok(()));
            let uses_cuda = merged.keys().any(|d| matches!(d, Device::Cuda(_)));
            prop_assert_eq!(m.validate(None, Err(CudaUnavailable::NoDriver)).is_err(), uses_cuda);
        }
    }
}
