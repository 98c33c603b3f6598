use std::time::Duration;

use ferry_rpc::Function;

const ADD: Function<(i64, i64), i64> = Function::new("add");

fn main() {
    // Options on the call change nothing of its types.
    let _ = ADD.timeout(Duration::from_secs(1)).rpc_async(1, ("2".to_string(), 3));
}
