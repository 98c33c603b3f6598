//! The simulator: a seeded PRNG, the simulated group with its invariant
//! checks, the random schedule driver, and hand-written scenarios.

pub(crate) mod random;
pub(crate) mod rng;
pub(crate) mod world;

mod scenarios;
