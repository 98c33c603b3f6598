//! Lets this crate's doctests (the user guide's code) find libtorch at run
//! time without `LD_LIBRARY_PATH`: an rpath to the directory torch-sys
//! linked against.
fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    if let Ok(dir) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
}
