"""Mixed groups: a Python worker and a Rust worker
(``crates/ferry/examples/mixed_worker.rs``) in one group, calling each
other's functions by name. Each test runs a group of its own: this
process starts the Rust worker and the Python worker ``mixed_worker.py``
(which runs the scenario's checks), and for some a second Python worker
``py2`` that serves (``mixed_worker.py --serve``), and waits, bounded, for
all."""

import subprocess
import sys

import pytest

import group
import rust_worker


def run_mixed(*scenarios, pythons=1):
    """Runs ``scenarios`` in a group of the Rust worker (rank 1) and
    ``pythons`` Python workers: ``py`` (rank 0), which runs them, and
    ``py2`` (rank 2), which serves."""
    world = pythons + 1
    port = group.free_port()
    rust = rust_worker.start("mixed_worker", ["rust"], rank=1, world_size=world, port=port)
    helpers = []
    if pythons == 2:
        helpers = group.start(["mixed_worker.py", "--serve"], [2], world, port)
    py = subprocess.Popen(
        [sys.executable, "mixed_worker.py", *scenarios],
        env=group.worker_env(0, world, port),
        cwd=group.HERE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        out, _ = py.communicate(timeout=group.EXIT_BOUND_S * 2)
    except subprocess.TimeoutExpired:
        py.kill()
        out, _ = py.communicate()
        group.join([rust, *helpers], bound=5)
        pytest.fail(f"the Python worker did not finish:\n{out}")
    # A Python worker that failed before the group met leaves the others
    # waiting for it: not for long.
    codes = group.join(
        [rust, *helpers], bound=group.EXIT_BOUND_S if py.returncode == 0 else 5
    )
    assert py.returncode == 0, out
    assert codes == [0] * len(codes), f"the other workers exited with {codes}\n{out}"
    for s in scenarios:
        assert f"PASSED: {s}" in out, out


def test_python_calls_rust_functions_by_name():
    run_mixed("calls")


def test_tensors_of_several_dtypes_and_views_cross_to_rust_and_back():
    run_mixed("tensors")


def test_wrong_arguments_raise_type_errors_naming_function_and_shape():
    run_mixed("type_errors")


def test_a_rust_error_arrives_as_an_exception_with_its_text():
    run_mixed("rust_errors")


def test_rrefs_to_rust_values_convert_travel_and_are_released():
    run_mixed("rrefs")


def test_rust_calls_python_functions_registered_by_name():
    run_mixed("rust_calls_python", "registration")


def test_a_python_function_registered_after_init_rpc_is_found_from_then_on():
    run_mixed("late_registration")


def test_keywords_name_the_fields_of_a_struct_argument():
    run_mixed("keywords")


def test_wrong_missing_and_repeated_keywords_raise_type_errors():
    run_mixed("keyword_errors")


def test_raw_tensors_cross_both_ways():
    run_mixed("raw_tensors", "rust_calls_python")


def test_rrefs_to_rust_values_travel_in_pickled_python_calls_and_are_released():
    run_mixed("rrefs_pickled", pythons=2)


def test_rref_proxies_call_the_owners_functions_taking_the_rref():
    run_mixed("rref_proxies")
