"""Mixed groups: a Python worker and a Rust worker
(``crates/ferry/examples/mixed_worker.rs``) in one group, calling each
other's functions by name. Each test runs a group of its own: this
process starts the Rust worker and the Python worker ``mixed_worker.py``
(which runs the scenario's checks) and waits, bounded, for both."""

import subprocess
import sys

import pytest

import group
import rust_worker


def run_mixed(*scenarios):
    port = group.free_port()
    rust = rust_worker.start("mixed_worker", ["rust"], rank=1, world_size=2, port=port)
    py = subprocess.Popen(
        [sys.executable, "mixed_worker.py", *scenarios],
        env=group.worker_env(0, 2, port),
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
        group.join([rust], bound=5)
        pytest.fail(f"the Python worker did not finish:\n{out}")
    # A Python worker that failed before the group met leaves the Rust
    # worker waiting for it: not for long.
    codes = group.join([rust], bound=group.EXIT_BOUND_S if py.returncode == 0 else 5)
    assert py.returncode == 0, out
    assert codes == [0], f"the Rust worker exited with {codes}\n{out}"
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
