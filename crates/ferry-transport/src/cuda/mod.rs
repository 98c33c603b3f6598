//! CUDA tensors: whether CUDA is usable in this process, the `cuda_staged`
//! channel's chunk pipeline ([`staged`]), and with the `cuda` feature the
//! driver-backed pieces (`driver`: pinned staging and the copy engine;
//! `ipc`: the `cuda_ipc` channel's memory and event handles).
//!
//! CUDA's driver library (`libcuda.so.1`) is loaded at run time through
//! `cudarc`, which panics when a driver function is called without it:
//! every entry point of this module goes through [`availability`] first,
//! which probes the library once per process and returns a typed
//! [`CudaUnavailable`] whose text starts with "CUDA not available on this
//! host". A build without the `cuda` feature gives the same error, naming
//! the missing feature as the reason.

use std::sync::OnceLock;

use ferry_wire::Device;

use crate::TransportError;

#[cfg(feature = "cuda")]
pub mod driver;
#[cfg(feature = "cuda")]
pub mod ipc;
pub mod staged;

/// Why CUDA cannot be used in this process. Every message starts with
/// "CUDA not available on this host".
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CudaUnavailable {
    /// Ferry was built without its `cuda` feature.
    #[error("CUDA not available on this host: this build of Ferry has no `cuda` feature")]
    NotBuilt,
    /// The driver library could not be loaded.
    #[error(
        "CUDA not available on this host: the CUDA driver library (libcuda.so.1) cannot be loaded"
    )]
    NoDriver,
    /// The driver loaded but `cuInit` failed.
    #[error("CUDA not available on this host: cuInit failed: {0}")]
    Init(String),
    /// The driver works but reports no device.
    #[error("CUDA not available on this host: the CUDA driver reports no device")]
    NoDevice,
    /// A device ordinal beyond the devices this host has.
    #[error("CUDA not available on this host: {device} does not exist (this host has {count} CUDA device(s))")]
    NoSuchDevice {
        /// The device asked for.
        device: Device,
        /// How many devices the driver reports.
        count: usize,
    },
}

/// The number of CUDA devices this process can use, or why it can use
/// none. The driver is probed once per process (later calls return the
/// first answer).
pub fn availability() -> Result<usize, CudaUnavailable> {
    static PROBE: OnceLock<Result<usize, CudaUnavailable>> = OnceLock::new();
    PROBE.get_or_init(probe).clone()
}

/// Checks that `device` can be used here: `cpu` always, `cuda:N` when CUDA
/// is available and the host has more than `N` devices.
pub fn check_device(device: Device) -> Result<(), CudaUnavailable> {
    match device {
        Device::Cpu => Ok(()),
        Device::Cuda(i) => {
            let count = availability()?;
            if usize::from(i) < count {
                Ok(())
            } else {
                Err(CudaUnavailable::NoSuchDevice { device, count })
            }
        }
    }
}

/// Replaces an error about a pair of devices involving CUDA by
/// [`CudaUnavailable`] when CUDA is what is missing here.
pub(crate) fn explain(e: TransportError, source: Device, target: Device) -> TransportError {
    let cuda = matches!(source, Device::Cuda(_)) || matches!(target, Device::Cuda(_));
    match availability() {
        Err(reason) if cuda => reason.into(),
        _ => e,
    }
}

#[cfg(feature = "cuda")]
fn probe() -> Result<usize, CudaUnavailable> {
    let result = driver::probe();
    match &result {
        Ok(count) => tracing::info!(devices = count, "CUDA available"),
        Err(reason) => tracing::info!(%reason, "CUDA not used"),
    }
    result
}

#[cfg(not(feature = "cuda"))]
fn probe() -> Result<usize, CudaUnavailable> {
    Err(CudaUnavailable::NotBuilt)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_is_always_usable_and_messages_name_the_host() {
        assert_eq!(check_device(Device::Cpu), Ok(()));
        for e in [
            CudaUnavailable::NotBuilt,
            CudaUnavailable::NoDriver,
            CudaUnavailable::Init("CUDA_ERROR_NO_DEVICE".into()),
            CudaUnavailable::NoDevice,
            CudaUnavailable::NoSuchDevice {
                device: Device::Cuda(3),
                count: 1,
            },
        ] {
            assert!(
                e.to_string()
                    .starts_with("CUDA not available on this host: "),
                "{e}"
            );
        }
        let e = CudaUnavailable::NoSuchDevice {
            device: Device::Cuda(3),
            count: 1,
        };
        assert!(e.to_string().contains("cuda:3 does not exist"), "{e}");
    }

    #[test]
    fn a_cuda_device_is_usable_exactly_when_the_probe_counts_it() {
        match availability() {
            Ok(count) => {
                assert!(count > 0);
                let last = u16::try_from(count - 1).expect("few devices");
                assert_eq!(check_device(Device::Cuda(last)), Ok(()));
                assert!(check_device(Device::Cuda(last + 1)).is_err());
            }
            Err(reason) => {
                assert_eq!(check_device(Device::Cuda(0)), Err(reason));
            }
        }
    }
}
