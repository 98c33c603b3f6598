use ferry_rpc::Function;

const ADD: Function<(i64, i64), i64> = Function::new("add");

fn main() {
    let _ = ADD.rpc_sync(1, ("2".to_string(), 3));
}
