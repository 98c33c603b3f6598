//! torchft's wire types, generated from `proto/torchft.proto` (package
//! `torchft`) by prost and tonic-build: the messages, the
//! `LighthouseService` / `ManagerService` server traits
//! ([`lighthouse_service_server`], [`manager_service_server`]) and clients
//! ([`lighthouse_service_client`], [`manager_service_client`]).
//!
//! Names and field numbers are torchft's, so torchft's own clients and
//! servers interoperate with Ferry's.

#![allow(
    missing_docs,
    unreachable_pub,
    rust_2018_idioms,
    clippy::all,
    clippy::pedantic,
    clippy::unwrap_used
)]

include!(concat!(env!("OUT_DIR"), "/torchft.rs"));
