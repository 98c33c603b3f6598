//! # ferry-facade-only
//!
//! The proof that the `ferry` facade is enough: this crate depends on
//! `ferry` (with its `torch` and `ft` features) and on no other Ferry
//! crate, and compiles the user guide's and the README's code as its
//! doctests. An example there that needs another Ferry crate (a
//! `use ferry_schedule::...` where `ferry::schedule` reaches the same)
//! fails here, as it would in a user's program.
//!
//! ```sh
//! LIBTORCH_USE_PYTORCH=1 cargo test -p ferry-facade-only --doc
//! ```
//!
//! `cargo xtask test` runs it with the libtorch crates.

/// The user guide's code (`docs/user-guide.md`).
#[cfg(doctest)]
#[doc = include_str!("../../../docs/user-guide.md")]
pub struct UserGuide;

/// The README's code.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct Readme;
