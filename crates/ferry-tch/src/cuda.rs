//! libtorch's CUDA backend, loaded at run time (feature `cuda`).
//!
//! A program that links libtorch through `tch` links `libtorch_cpu.so`; the
//! linker drops `libtorch_cuda.so` because no symbol of it is named, so
//! libtorch never registers its CUDA kernels and `tch::Cuda::is_available()`
//! says false even on a GPU host. PyTorch's Python package avoids this by
//! loading every library it ships. [`load_cuda_backend`] does the same for a
//! Rust program: it finds the `libtorch_cpu.so` this process runs and opens
//! the `libtorch_cuda.so` beside it, once, for good. [`crate::install`]
//! calls it, so a worker with feature `cuda` can allocate CUDA tensors.

use std::sync::OnceLock;

/// The directory of the `libtorch_cpu.so` mapped into this process.
fn libtorch_dir() -> Option<std::path::PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .find(|path| path.ends_with("/libtorch_cpu.so"))
        .and_then(|path| std::path::Path::new(path).parent().map(Into::into))
}

/// Loads libtorch's CUDA backend beside the libtorch this process runs
/// (or, failing that, `libtorch_cuda.so` by the loader's search), so that
/// libtorch's CUDA device, allocator and kernels are registered. Idempotent;
/// the library stays loaded. Returns why it could not be loaded: for a CPU
/// build of libtorch there is no such library, and CUDA stays unavailable.
pub fn load_cuda_backend() -> Result<(), String> {
    static LOADED: OnceLock<Result<(), String>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            let candidates: Vec<std::ffi::OsString> = libtorch_dir()
                .map(|dir| dir.join("libtorch_cuda.so").into_os_string())
                .into_iter()
                .chain(std::iter::once("libtorch_cuda.so".into()))
                .collect();
            let mut errors = Vec::new();
            for name in &candidates {
                let flags = libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL;
                // SAFETY: libtorch_cuda's initialisers only register its
                // CUDA backend with the libtorch already loaded here.
                match unsafe { libloading::os::unix::Library::open(Some(name), flags) } {
                    Ok(lib) => {
                        // Kept for the life of the process: libtorch holds
                        // pointers into it once registered.
                        std::mem::forget(lib);
                        tracing::debug!(library = ?name, "libtorch's CUDA backend loaded");
                        return Ok(());
                    }
                    Err(e) => errors.push(e.to_string()),
                }
            }
            Err(format!(
                "libtorch's CUDA backend could not be loaded: {}",
                errors.join("; ")
            ))
        })
        .clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_backend_loads_beside_libtorch_or_says_why_not() {
        // Touch libtorch so that it is mapped.
        let _ = tch::Tensor::zeros([1], (tch::Kind::Float, tch::Device::Cpu));
        let dir = libtorch_dir().expect("libtorch_cpu.so is mapped");
        match load_cuda_backend() {
            Ok(()) => assert!(dir.join("libtorch_cuda.so").exists()),
            Err(reason) => {
                assert!(!dir.join("libtorch_cuda.so").exists(), "{reason}");
                assert!(reason.contains("libtorch_cuda.so"), "{reason}");
            }
        }
        // Idempotent.
        assert_eq!(load_cuda_backend().is_ok(), load_cuda_backend().is_ok());
    }
}
