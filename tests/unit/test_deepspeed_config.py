"""zinf.options_from_deepspeed (issue 38, acceptance 6): each documented DeepSpeed key's zinf option, the
warning that names what is not mapped, and the errors for what zinf cannot honour.  No compile: training
with the mapped options is tests/integration/test_deepspeed_config_training.py."""

import json
import warnings

import pytest

import zinf_compiler as zinf
from zinf_compiler.options import SPECS_BY_NAME, parse_options


def _map(config) -> tuple[dict, str]:
    """The options and the warning's text ('' when none); at most one warning per call."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        options = zinf.options_from_deepspeed(config)
    ours = [w for w in caught if issubclass(w.category, zinf.DeepSpeedConfigWarning)]
    assert len(ours) <= 1, [str(w.message) for w in ours]
    return options, str(ours[0].message) if ours else ""


def _zero(**keys) -> dict:
    return {"zero_optimization": keys}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_stage(stage):
    assert _map(_zero(stage=stage)) == ({"stage": stage}, "")


def test_no_zero_section_is_deepspeeds_stage_0():
    assert _map({})[0] == {"stage": 0}
    assert _map(_zero())[0] == {"stage": 0}


@pytest.mark.parametrize("param, optimizer", [("cpu", "cpu"), ("none", "cpu"), ("cpu", "none"), ("nvme", "nvme"),
                                              ("nvme", "cpu"), ("cpu", "nvme")])
def test_offload_devices_and_one_nvme_path(param, optimizer, tmp_path):
    config = _zero(stage=3, offload_param={"device": param, "nvme_path": str(tmp_path)},
                   offload_optimizer={"device": optimizer, "nvme_path": str(tmp_path)})
    options, warning = _map(config)
    expected = {"stage": 3}
    expected.update({name: device for name, device in (("offload_param", param), ("offload_optimizer", optimizer))
                     if device != "none"})
    if "nvme" in (param, optimizer):
        expected["nvme_path"] = str(tmp_path)
    assert options == expected
    # DeepSpeed ignores nvme_path off nvme: named, not taken.
    for name, device in (("offload_param", param), ("offload_optimizer", optimizer)):
        assert (f"zero_optimization.{name}.nvme_path" in warning) == (device != "nvme"), warning
    parse_options(options, environ={})


def test_old_cpu_offload_flags():
    assert _map(_zero(stage=2, cpu_offload=True))[0] == {"stage": 2, "offload_optimizer": "cpu"}
    assert _map(_zero(stage=3, cpu_offload_params=True))[0] == {"stage": 3, "offload_param": "cpu"}


@pytest.mark.parametrize("section, dtype", [("bf16", "bf16"), ("bfloat16", "bf16"), ("fp16", "fp16")])
def test_precision(section, dtype):
    assert _map({section: {"enabled": True}})[0] == {"stage": 0, "param_dtype": dtype}
    # Not enabled: fp32, and the section's other keys are inert (in DeepSpeed too), so not named.
    assert _map({section: {"enabled": False, "loss_scale_window": 100}}) == ({"stage": 0}, "")


def test_fp16_scaler_settings_zinf_has_no_option_for_are_named():
    options, warning = _map({"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16,
                                      "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}})
    assert options["param_dtype"] == "fp16"
    for key in ("initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale"):
        assert f"fp16.{key}=" in warning
    assert "fp16.loss_scale=" not in warning  # 0: dynamic scaling, what zinf does
    assert "zinf does not act on" in _map({"fp16": {"enabled": True, "loss_scale": 128}})[1]  # static: named


@pytest.mark.parametrize("dtype, itemsize", [(None, 4), ("bf16", 2), ("fp16", 2)])
def test_element_counts_become_bytes_of_the_parameter_dtype(dtype, itemsize):
    config = _zero(stage=3, reduce_bucket_size=5e8, stage3_prefetch_bucket_size=1e7, allgather_bucket_size=2e8,
                   stage3_max_live_parameters=1e9)
    if dtype is not None:
        config[dtype] = {"enabled": True}
    options, warning = _map(config)
    # One zinf bucket serves gathers and reductions: the smallest DeepSpeed bucket.
    assert options["bucket_bytes"] == 10_000_000 * itemsize
    assert options["max_live_bytes"] == 1_000_000_000 * itemsize
    assert warning == ""


def test_aio():
    options, warning = _map({"aio": {"block_size": 262144, "queue_depth": 32, "thread_count": 2,
                                     "single_submit": False, "overlap_events": True}})
    assert options == {"stage": 0, "aio_block_size": 262144, "aio_queue_depth": 32, "aio_threads": 2}
    assert "aio.single_submit=false" in warning
    assert "aio.overlap_events" not in warning  # zinf's engine overlaps its requests anyway
    assert _map({"aio": {"intra_op_parallelism": 3}})[0]["aio_threads"] == 3


def test_what_zinf_does_anyway_passes_silently():
    config = _zero(stage=3, overlap_comm=True, contiguous_gradients=True, reduce_scatter=True,
                   allgather_partitions=True, offload_param={"device": "cpu", "pin_memory": True},
                   offload_optimizer={"device": "cpu", "pin_memory": True})
    config["bf16"] = {"enabled": True, "bf16_master_weights_and_grads": False, "bf16_optimizer_states": False}
    assert _map(config)[1] == ""
    # The opposite values are named.
    warning = _map(_zero(stage=3, overlap_comm=False, offload_param={"device": "cpu", "pin_memory": False}))[1]
    assert "zero_optimization.overlap_comm=false" in warning
    assert "zero_optimization.offload_param.pin_memory=false" in warning


def test_every_unmapped_key_is_named_in_one_warning():
    config = {
        "zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 1e9, "stage3_param_persistence_threshold": 1e5,
                              "sub_group_size": 1e9, "stage3_gather_16bit_weights_on_model_save": True,
                              "zero_hpz_partition_size": 8, "aio": {"block_size": 1},
                              "offload_param": {"device": "nvme", "nvme_path": "/x", "buffer_count": 5,
                                                "buffer_size": 1e8, "max_in_cpu": 1e9},
                              "offload_optimizer": {"device": "nvme", "nvme_path": "/x", "buffer_count": 4,
                                                    "fast_init": False, "ratio": 0.3}},
        "gradient_clipping": 1.0, "train_batch_size": 32, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "a_key_deepspeed_may_add_next_year": 1,
    }
    options, warning = _map(config)
    assert options == {"stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme", "nvme_path": "/x"}
    named = ["zero_optimization.stage3_max_reuse_distance", "zero_optimization.stage3_param_persistence_threshold",
             "zero_optimization.sub_group_size", "zero_optimization.stage3_gather_16bit_weights_on_model_save",
             "zero_optimization.zero_hpz_partition_size", "zero_optimization.aio",
             "zero_optimization.offload_param.buffer_count", "zero_optimization.offload_param.buffer_size",
             "zero_optimization.offload_param.max_in_cpu", "zero_optimization.offload_optimizer.buffer_count",
             "zero_optimization.offload_optimizer.fast_init", "zero_optimization.offload_optimizer.ratio",
             "gradient_clipping", "train_batch_size", "optimizer", "a_key_deepspeed_may_add_next_year"]
    for key in named:
        assert f"{key}=" in warning, key
    assert "clip_grad_norm_" in warning  # says how to clip in zinf
    with pytest.warns(zinf.DeepSpeedConfigWarning) as caught:
        zinf.options_from_deepspeed(config)
    assert caught[0].filename == __file__  # points at the caller's line


def test_auto_takes_zinfs_default_with_a_note():
    config = _zero(stage="auto", reduce_bucket_size="auto", stage3_prefetch_bucket_size="auto",
                   stage3_max_live_parameters="auto")
    config.update(bf16={"enabled": "auto"}, fp16={"enabled": "auto"}, gradient_clipping="auto",
                  train_micro_batch_size_per_gpu="auto")
    options, warning = _map(config)
    assert options == {}  # every option at zinf's default (stage 3, fp32, 64 MiB buckets, auto cap)
    for key, option in (("zero_optimization.stage", "stage"), ("zero_optimization.reduce_bucket_size", "bucket_bytes"),
                        ("zero_optimization.stage3_max_live_parameters", "max_live_bytes"),
                        ("bf16.enabled", "param_dtype"), ("fp16.enabled", "param_dtype")):
        assert f"{key}='auto' -> zinf's {option}={SPECS_BY_NAME[option].default!r}" in warning
    assert "gradient_clipping='auto'" in warning and "train_micro_batch_size_per_gpu='auto'" in warning


def test_a_json_file(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(_zero(stage=2, offload_optimizer={"device": "cpu"})))
    assert zinf.options_from_deepspeed(path) == zinf.options_from_deepspeed(str(path)) == {
        "stage": 2, "offload_optimizer": "cpu"}


@pytest.mark.parametrize("config, key", [
    (_zero(stage=3, offload_param={"device": "gpu"}), "zero_optimization.offload_param.device"),
    (_zero(stage=3, offload_optimizer={"device": "disk"}), "zero_optimization.offload_optimizer.device"),
    (_zero(stage=2, offload_param={"device": "cpu"}), "zero_optimization.offload_param.device"),
    (_zero(stage=0, offload_optimizer={"device": "cpu"}), "zero_optimization.offload_optimizer.device"),
    (_zero(stage=4), "zero_optimization.stage"),
    (_zero(stage=True), "zero_optimization.stage"),
    (_zero(stage=3, offload_param={"device": "nvme", "nvme_path": "/a"},
           offload_optimizer={"device": "nvme", "nvme_path": "/b"}), "zero_optimization.offload_param.nvme_path"),
    (_zero(stage=3, offload_optimizer={"device": "nvme"}), "zero_optimization.offload_optimizer.nvme_path"),
    (_zero(stage=3, offload_param={"device": "nvme", "nvme_path": "auto"}), "zero_optimization.offload_param.nvme_path"),
    (_zero(stage=3, cpu_offload=True, offload_optimizer={"device": "nvme", "nvme_path": "/a"}),
     "zero_optimization.cpu_offload"),
    ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "bf16.enabled and fp16.enabled"),
    ({"fp16": {"enabled": "yes"}}, "fp16.enabled"),
    (_zero(stage=3, reduce_bucket_size=1.5), "zero_optimization.reduce_bucket_size"),
    (_zero(stage=3, stage3_max_live_parameters=-1), "zero_optimization.stage3_max_live_parameters"),
    ({"aio": {"queue_depth": "deep"}}, "aio.queue_depth"),
    ({"zero_optimization": [3]}, "zero_optimization"),
])
def test_what_zinf_cannot_honour_is_a_value_error_naming_the_key(config, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        zinf.options_from_deepspeed(config)


def test_a_value_zinf_refuses_after_mapping_is_a_value_error():
    # aio.queue_depth 0 maps, but zinf needs at least one request in flight: parse_options says so.
    with pytest.raises(ValueError, match=r"DeepSpeed key aio\.queue_depth: .*aio_queue_depth"):
        zinf.options_from_deepspeed({"aio": {"queue_depth": 0}})
