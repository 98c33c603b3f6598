//! Compiles the engine shim (`csrc/engine_shim.cpp`) against the libtorch
//! that torch-sys found, and gives this crate's tests and examples an
//! rpath to it so that nothing needs `LD_LIBRARY_PATH` at run time.
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=csrc/engine_shim.cpp");
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") else {
        panic!("torch-sys did not say where libtorch is (DEP_TCH_LIBTORCH_LIB)");
    };
    let lib = PathBuf::from(lib);
    let root = lib
        .parent()
        .map(PathBuf::from)
        .unwrap_or_else(|| lib.clone());
    // PyTorch wheels since 2.7 (and libtorch cxx11 builds) use the new ABI.
    let abi = std::env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".into());
    cc::Build::new()
        .cpp(true)
        .pic(true)
        .warnings(false)
        .include(root.join("include"))
        .include(root.join("include/torch/csrc/api/include"))
        .flag("-std=c++17")
        .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={abi}"))
        .flag("-DGLOG_USE_GLOG_EXPORT")
        .file("csrc/engine_shim.cpp")
        .compile("ferry_engine_shim");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
}
