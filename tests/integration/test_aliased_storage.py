"""Tensors sharing a stage-3 parameter's storage (issue 25, point 2): equal to eager or a clear error.

At stage 3 zinf frees a parameter's storage between uses.  A ``state_dict()``
(its values are ``param.detach()``), ``param.data`` or a view taken before
compiling or inside ``zinf.gathered`` shares that storage.  Before: reading
such a tensor after the storage was freed segfaulted (``sum``, ``repr``,
``clone``), ``torch.save`` silently wrote an empty storage (a file that
``torch.load`` refuses), and ``load_state_dict`` of a state dict taken
before compiling failed.  Now: each read raises a ZinfRestingParameterError
naming the parameter and ``zinf_compiler.full_state_dict``; inside
``zinf.gathered`` the same tensors read the parameter's current value, as
eager's do; ``load_state_dict`` of them changes nothing, as in eager.  Each
case runs in a worker process (tests/workers/alias_worker.py): a crash fails one test.
"""

from __future__ import annotations

import pytest

from multirank import run_ranks

RTOL = 1e-5


def run(case: str) -> dict:
    return run_ranks(1, "alias_worker", {"case": case})[0]


def assert_clear_errors(reads: dict, name: str) -> None:
    for use, result in reads.items():
        assert result.get("error") == "ZinfRestingParameterError", f"{use} of an alias of {name}: {result}"
        message = result["message"]
        assert name in message and "zinf_compiler.full_state_dict(model)" in message, f"{use}: {message}"
        assert "zinf_compiler.gathered" in message, f"{use}: {message}"


def assert_equal_to_eager(errors: dict, what: str) -> None:
    assert errors and max(errors.values()) <= RTOL, f"{what}: {errors}"


@pytest.mark.slow  # each case is a process of its own; the default run keeps two (load_state_dict, the aliases)
def test_state_dict_taken_before_compiling_read_after_a_step():
    result = run("state_dict_before_compiling_read_after_a_step")
    for name in ("0.weight", "0.bias", "2.weight", "2.bias"):
        assert_clear_errors(result[name], name)
    assert_equal_to_eager(result["inside_gathered"], "inside zinf.gathered")
    assert_equal_to_eager(result["inside_gathered_after_another_step"], "inside zinf.gathered, a step later")


def test_load_state_dict_taken_before_compiling_after_a_step_equals_eager():
    # In eager the state dict holds the parameters' current values: loading it changes nothing.
    result = run("load_state_dict_taken_before_compiling")
    assert result["loaded"] == {"value": "<All keys matched successfully>"}
    for eager, mine in result["losses"]:
        assert abs(eager - mine) <= RTOL * abs(eager), result["losses"]
    assert_equal_to_eager(result["after_aliases"], "after loading the aliases")
    assert_equal_to_eager(result["after_copy"], "after loading a copy taken before compiling")
    assert_equal_to_eager(result["final"], "a step later")


@pytest.mark.slow  # each case is a process of its own; the default run keeps two (load_state_dict, the aliases)
def test_state_dict_taken_inside_gathered_read_after_the_block():
    result = run("state_dict_inside_gathered_read_after_the_block")
    for name in ("0.weight", "0.bias", "2.weight", "2.bias"):
        assert_clear_errors(result[name], name)
    assert_equal_to_eager(result["inside"], "inside the block")
    assert_equal_to_eager(result["inside_gathered_again"], "inside a later block")
    assert_equal_to_eager(result["inside_gathered_after_another_step"], "inside a block a step later")


@pytest.mark.slow  # each case is a process of its own; the default run keeps two (load_state_dict, the aliases)
def test_state_dict_taken_inside_gathered_saved_after_the_block():
    result = run("state_dict_inside_gathered_saved_after_the_block")
    assert_clear_errors({use: result[use] for use in ("torch.save", "pickle", "deepcopy")}, "0.weight")
    # Inside a block they save and copy as eager's do, as plain tensors.
    assert_equal_to_eager(result["saved_inside"], "torch.save inside the block")
    assert_equal_to_eager(result["saved_again"], "torch.save inside a later block")
    assert_equal_to_eager(result["deepcopy_again"], "copy.deepcopy inside a later block")
    assert result["saved_inside_types"] == result["deepcopy_types"] == ["Tensor"]


@pytest.fixture(scope="module")
def aliases_result() -> dict:
    return run("aliases_taken_before_compiling")  # one worker for every kind of alias


@pytest.mark.parametrize("alias", ["detach", "data", "view", "t", "row", "bias_view"])
def test_detach_data_and_views_taken_before_compiling(alias, aliases_result):
    assert_clear_errors(aliases_result[alias], "0.bias" if alias == "bias_view" else "0.weight")
    assert aliases_result["inside_gathered"][alias] <= RTOL, aliases_result["inside_gathered"]


@pytest.mark.slow  # each case is a process of its own; the default run keeps two (load_state_dict, the aliases)
def test_a_view_only_an_autograd_graph_holds_keeps_its_memory():
    # Only C++ holds it (a view addmm saved for backward): zinf cannot guard it, so the storage is
    # not freed; the parameter moves to an empty storage of its own and trains as in eager.
    result = run("autograd_graph_from_before_compiling")
    for eager, mine in result["losses"]:
        assert abs(eager - mine) <= RTOL * abs(eager), result["losses"]
    assert_equal_to_eager(result["final"], "after two steps")
    assert result["saved_view_error"] == 0.0  # its values as saved: memory intact, never freed
    assert result["param_storage_bytes"] == 0


@pytest.mark.slow  # each case is a process of its own; the default run keeps two (load_state_dict, the aliases)
def test_a_parameter_sharing_the_storage_of_another_module():
    result = run("parameter_sharing_the_storage")
    assert result["type"] == "RestingParameter"
    assert_clear_errors({"forward": result["forward"]}, "0.weight")
    assert result["inside_gathered"] <= RTOL
