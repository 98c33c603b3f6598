use ferry_rpc::Function;

const ADD: Function<(i64, i64), i64> = Function::new("add");

fn main() {
    let _sum: Result<String, ferry_rpc::RpcError> = ADD.rpc_sync(1, (2, 3));
}
