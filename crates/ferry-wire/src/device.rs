//! Devices a tensor can live on.

use serde::{Deserialize, Serialize};

use crate::WireError;

/// Where a tensor's bytes live: host memory or a CUDA device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Device {
    /// Host memory.
    Cpu,
    /// CUDA device with the given ordinal (`cuda:N`).
    Cuda(u16),
}

impl Device {
    /// Wire encoding: a tag byte and a 16-bit index.
    pub(crate) fn encode(self) -> (u8, u16) {
        match self {
            Device::Cpu => (0, 0),
            Device::Cuda(i) => (1, i),
        }
    }

    pub(crate) fn decode(tag: u8, index: u16) -> Result<Self, WireError> {
        match (tag, index) {
            (0, 0) => Ok(Device::Cpu),
            (0, i) => Err(WireError::InvalidDescriptor(format!(
                "cpu device with non-zero index {i}"
            ))),
            (1, i) => Ok(Device::Cuda(i)),
            (t, _) => Err(WireError::UnknownDevice(t)),
        }
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

impl std::str::FromStr for Device {
    type Err = WireError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == "cpu" {
            return Ok(Device::Cpu);
        }
        s.strip_prefix("cuda:")
            .and_then(|i| i.parse().ok())
            .map(Device::Cuda)
            .ok_or_else(|| WireError::InvalidDescriptor(format!("unknown device name {s:?}")))
    }
}
