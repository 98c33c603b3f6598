use ferry_rpc::{Function, Functions};

const ADD: Function<(i64, i64), i64> = Function::new("add");

fn main() {
    let mut functions = Functions::new();
    functions.add(ADD, |(a, b): (i64, i64)| format!("{a}{b}"));
}
