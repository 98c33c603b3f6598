//! Typed remote functions are checked by the compiler: calling or
//! registering a declaration with the wrong argument or result type does
//! not compile (the cases in `tests/ui/`, with the errors expected).

#[test]
fn wrong_types_do_not_compile() {
    let cases = trybuild::TestCases::new();
    cases.compile_fail("tests/ui/*.rs");
}
