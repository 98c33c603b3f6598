//! # ferry-rref
//!
//! Remote References for Ferry.

pub mod protocol;
