"""Command lines refuse numbers out of range with the option's name and the allowed range, before any run starts:
the shared argparse types (``pivotrl.cli``), the experiments' parser and the end-to-end benchmark's allocation
check."""
import argparse
import importlib.util
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pivotrl.cli import at_least, positive_seconds
from pivotrl.sim import experiments


@given(st.integers(min_value=-10, max_value=10), st.integers(min_value=-50, max_value=50))
def test_at_least_accepts_exactly_the_whole_numbers_from_its_minimum(minimum: int, value: int) -> None:
    parse = at_least(minimum)
    if value >= minimum:
        assert parse(str(value)) == value
    else:
        with pytest.raises(argparse.ArgumentTypeError, match=f">= {minimum}, got {value}"):
            parse(str(value))


@pytest.mark.parametrize("text", ["1.5", "x", "", "1e3"])
def test_at_least_refuses_what_is_not_a_whole_number(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="whole number >= 1"):
        at_least(1)(text)


@pytest.mark.parametrize("text", ["0", "-1", "nan", "inf", "-inf", "x"])
def test_positive_seconds_refuses_what_is_not_a_finite_positive_number(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="seconds > 0"):
        positive_seconds(text)


def test_positive_seconds_accepts_a_positive_number() -> None:
    assert positive_seconds("0.25") == 0.25


@pytest.mark.parametrize("argv, message", [
    (["fig9", "--jobs", "0"], "argument --jobs: must be >= 1, got 0"),
    (["fig9", "--steps", "-1"], "argument --steps: must be >= 0, got -1"),
    (["fig11", "--seed", "-5"], "argument --seed: must be >= 0, got -5"),
    (["calibrate", "--evaluations", "0"], "argument --evaluations: must be >= 1, got 0"),
    (["calibrate", "--warmup-steps", "8"], "--warmup-steps must be below the steps of a run"),
    (["calibrate", "--steps", "3", "--warmup-steps", "3"], "got 3 of 3"),
    (["fidelity", "--devices", "4", "0"], "argument --devices: must be >= 1, got 0"),
    (["fidelity", "--repeats", "0"], "argument --repeats: must be >= 1, got 0"),
    (["fig9", "--jobs", "two"], "argument --jobs: must be a whole number >= 1, got 'two'"),
])
def test_the_experiments_refuse_bad_numbers_naming_the_option(argv: list[str], message: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        experiments.main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def _e2e():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "e2e.py"
    spec = importlib.util.spec_from_file_location("pivotrl_bench_e2e", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_e2e_tuned_choice_refuses_a_label_no_device_count_has() -> None:
    e2e = _e2e()
    assert e2e.check_tuned_choice([4, 8], None, None) is None
    # fidelity's default labels span both device counts: each names an allocation at one of them
    assert e2e.check_tuned_choice([4, 8], None, ["all", "1/1/2", "4/2/2", "2+2", "4+4", "TR=2", "TR=4"]) is None
    problem = e2e.check_tuned_choice([4], None, ["4/2/2"])
    assert problem is not None and "--allocations: 4/2/2" in problem and "1/1/2" in problem
    problem = e2e.check_tuned_choice([8], ["colocated"], ["TR=2"])
    assert problem is not None and "TR=2" in problem and "8 devices: all" in problem


def test_e2e_tuned_choice_refuses_a_device_count_with_nothing_to_run() -> None:
    e2e = _e2e()
    problem = e2e.check_tuned_choice([4, 8], ["disaggregated"], ["4/2/2"])
    assert problem is not None and problem.startswith("--devices: nothing to run at 4 device(s)")


def test_e2e_refuses_bad_numbers_before_running(capsys: pytest.CaptureFixture[str]) -> None:
    e2e = _e2e()
    for argv, message in ((["--tuned", "--devices", "0"], "argument --devices: must be >= 1, got 0"),
                          (["--timeout-s", "nan"], "argument --timeout-s: must be a finite number of seconds > 0"),
                          (["--tuned", "--allocations", "9/9/9"], "--allocations: 9/9/9 names no allocation")):
        with pytest.raises(SystemExit) as exit_:
            e2e.main(argv)
        assert exit_.value.code == 2
        assert message in capsys.readouterr().err
