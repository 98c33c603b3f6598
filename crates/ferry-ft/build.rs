//! Generates `ferry_ft::proto` from `proto/torchft.proto`.
//!
//! The .proto is compiled by `protox` (pure Rust), so no `protoc` binary is
//! needed; `tonic-build` turns the descriptor set into prost messages plus
//! the tonic clients and server traits.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    const PROTO: &str = "proto/torchft.proto";
    println!("cargo:rerun-if-changed={PROTO}");
    let descriptors = protox::compile([PROTO], ["proto"])?;
    tonic_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(descriptors)?;
    Ok(())
}
