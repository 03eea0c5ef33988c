"""Issue 38, acceptance 6: DeepSpeed's documented ZeRO-3 configs with CPU and with NVMe offload, mapped by
zinf.options_from_deepspeed, train equal to eager; the keys zinf does not map are named in its warning.

The configs are written here from the keys DeepSpeed documents: the CPU one is the ZeRO-Infinity
example of its ZeRO tutorial (deepspeed.ai/tutorials/zero, "Offloading to CPU and NVMe with
ZeRO-Infinity"), the NVMe one the ``offload_param`` / ``offload_optimizer`` / ``aio`` blocks of its
config reference (deepspeed.ai/docs/config-json, "Parameter offloading", "Optimizer offloading",
"Asynchronous I/O") with ``nvme_path`` a temporary folder.  Neither sets a precision: fp32, as eager.
"""

import json

import pytest

import zinf_compiler as zinf
from equivalence import compare_training
from zinf_compiler.gpt import GPTConfig

TINY = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)

ZERO3_CPU_OFFLOAD = {
    "zero_optimization": {
        "stage": 3,
        "contiguous_gradients": True,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_prefetch_bucket_size": 1e7,
        "stage3_param_persistence_threshold": 1e5,
        "reduce_bucket_size": 1e7,
        "sub_group_size": 1e9,
        "offload_optimizer": {"device": "cpu"},
        "offload_param": {"device": "cpu"},
    }
}


def zero3_nvme_offload(nvme_path: str) -> dict:
    """DeepSpeed's documented NVMe offload blocks (its defaults written out) at stage 3."""
    return {
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": nvme_path, "pin_memory": True, "buffer_count": 5,
                              "buffer_size": 1e8, "max_in_cpu": 1e9},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path, "pin_memory": True, "buffer_count": 4,
                                  "fast_init": False},
        },
        "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False,
                "overlap_events": True},
    }


@pytest.mark.slow  # Inductor (about 15 s cold); the NVMe config lowered eagerly is the default run's
def test_deepspeeds_zero3_cpu_offload_config_trains_equal_to_eager_under_inductor():
    with pytest.warns(zinf.DeepSpeedConfigWarning) as caught:
        options = zinf.options_from_deepspeed(ZERO3_CPU_OFFLOAD)
    assert options == {"stage": 3, "offload_param": "cpu", "offload_optimizer": "cpu",
                       "bucket_bytes": 4 * 10**7, "max_live_bytes": 4 * 10**9}  # fp32: 4 bytes an element
    warning = str(caught[0].message)
    for key in ("stage3_max_reuse_distance", "stage3_param_persistence_threshold", "sub_group_size"):
        assert f"zero_optimization.{key}=" in warning
    # No "lower" in the options: Inductor, zinf's default.  Tolerances as test_backend.py's stage-3 Inductor run.
    result = compare_training(TINY, options, steps=3)
    assert result.max_loss_error <= 1e-4, result.describe()
    assert result.max_param_error <= 1e-3, result.describe()


@pytest.mark.parametrize("lower", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_deepspeeds_zero3_nvme_offload_config_from_a_json_file_trains_equal_to_eager(tmp_path, lower):
    swap = tmp_path / "nvme"
    swap.mkdir()
    config_file = tmp_path / "ds_config.json"
    config_file.write_text(json.dumps(zero3_nvme_offload(str(swap))))
    with pytest.warns(zinf.DeepSpeedConfigWarning) as caught:
        options = zinf.options_from_deepspeed(config_file)
    assert options == {"stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme", "nvme_path": str(swap),
                       "aio_block_size": 1048576, "aio_queue_depth": 8, "aio_threads": 1}
    warning = str(caught[0].message)
    for key in ("offload_param.buffer_count", "offload_param.buffer_size", "offload_param.max_in_cpu",
                "offload_optimizer.buffer_count", "offload_optimizer.fast_init"):
        assert f"zero_optimization.{key}=" in warning
    assert "aio.single_submit=" in warning
    # The default run lowers with eager (short; Inductor: this test's other case and the CPU test, both
    # slow), held to test_nvme_params.py's tolerances; Inductor to the CPU test's.
    result = compare_training(TINY, {**options, "lower": lower}, steps=3)
    loss_tolerance, param_tolerance = (1e-5, 1e-5) if lower == "eager" else (1e-4, 1e-3)
    assert result.max_loss_error <= loss_tolerance, result.describe()
    assert result.max_param_error <= param_tolerance, result.describe()
