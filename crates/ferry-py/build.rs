//! Compiles the C++ shims (`csrc/python_tensor.cpp`: `torch.Tensor` to
//! and from a libtorch tensor; `csrc/python_future.cpp`: completing a
//! `torch.futures.Future` with an error) against the libtorch that
//! torch-sys found and the headers of the Python that runs torch, links
//! `torch_python`, and gives this crate's test binaries rpaths to
//! libtorch and (without `extension-module`) libpython so nothing needs
//! `LD_LIBRARY_PATH`.
use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=csrc/python_tensor.cpp");
    println!("cargo:rerun-if-changed=csrc/python_future.cpp");
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    println!("cargo:rerun-if-env-changed=PYO3_PYTHON");
    println!("cargo:rerun-if-env-changed=VIRTUAL_ENV");
    let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") else {
        panic!("torch-sys did not say where libtorch is (DEP_TCH_LIBTORCH_LIB)");
    };
    let lib = PathBuf::from(lib);
    let root = lib
        .parent()
        .map(PathBuf::from)
        .unwrap_or_else(|| lib.clone());
    let python = python();
    let include = python_var(&python, "sysconfig.get_path('include')");
    let abi = std::env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".into());
    cc::Build::new()
        .cpp(true)
        .pic(true)
        .warnings(false)
        .include(root.join("include"))
        .include(root.join("include/torch/csrc/api/include"))
        .include(&include)
        .flag("-std=c++17")
        .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={abi}"))
        .flag("-DGLOG_USE_GLOG_EXPORT")
        .file("csrc/python_tensor.cpp")
        .file("csrc/python_future.cpp")
        .compile("ferry_py_tensor");
    println!("cargo:rustc-link-search=native={}", lib.display());
    println!("cargo:rustc-link-lib=dylib=torch_python");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
    // Test binaries embed Python: find its shared library where it is.
    if std::env::var_os("CARGO_FEATURE_EXTENSION_MODULE").is_none() {
        let libdir = python_var(&python, "sysconfig.get_config_var('LIBDIR')");
        println!("cargo:rustc-link-arg=-Wl,-rpath,{libdir}");
    }
}

/// The Python that torch-sys asked: `PYO3_PYTHON`, the virtualenv's, or
/// `python3` on `PATH`.
fn python() -> PathBuf {
    if let Some(p) = std::env::var_os("PYO3_PYTHON") {
        return PathBuf::from(p);
    }
    if let Some(venv) = std::env::var_os("VIRTUAL_ENV") {
        let p = PathBuf::from(venv).join("bin").join("python");
        if p.exists() {
            return p;
        }
    }
    PathBuf::from("python3")
}

/// `expr` (after `import sysconfig`) as the Python prints it.
fn python_var(python: &PathBuf, expr: &str) -> String {
    let out = Command::new(python)
        .arg("-c")
        .arg(format!("import sysconfig; print({expr})"))
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", python.display()));
    assert!(
        out.status.success(),
        "{} failed to print {expr}: {}",
        python.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}
