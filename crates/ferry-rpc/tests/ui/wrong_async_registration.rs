use ferry_rpc::{Function, Functions};

const ADD: Function<(i64, i64), i64> = Function::new("add");

fn main() {
    let mut functions = Functions::new();
    // An async body whose future gives a String, not an i64.
    functions.add(ADD, |(a, b): (i64, i64)| async move { format!("{a}{b}") });
}
