use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, ferry_rpc::Schema)]
struct Inner {
    a: u8,
}

#[derive(Serialize, Deserialize, ferry_rpc::Schema)]
struct Outer {
    #[serde(flatten)]
    inner: Inner,
}

fn main() {}
