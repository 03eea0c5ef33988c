"""Issue 2 acceptance 4: unknown options and bad values raise errors that name them."""

import pytest

from zinf_compiler.options import ZinfOptionError, parse_options, parse_bytes


def test_defaults_parse():
    options = parse_options({}, environ={})
    assert options.lower == "inductor" and options.tile_threshold == 256 * 1024**2
    assert options.prefetch_nc == 3 and options.prefetch_cg == 2 and options.prefetch_gg == 1


def test_unknown_option_lists_valid_names():
    with pytest.raises(ZinfOptionError) as err:
        parse_options({"stgae": 3}, environ={})
    message = str(err.value)
    assert "'stgae'" in message and "stage" in message and "offload_param" in message


def test_unknown_environment_variable_is_named_in_a_warning():
    with pytest.warns(UserWarning, match="ZINF_PREFETCH.*prefetch_nc"):
        options = parse_options({}, environ={"ZINF_PREFETCH": "2"})
    assert options.prefetch_nc == 3


@pytest.mark.parametrize(
    "name, value, expected_words",
    [
        ("stage", 4, ["'stage'", "4", "0, 1, 2, 3"]),
        ("lower", "tvm", ["'lower'", "'tvm'", "'inductor'", "'eager'"]),
        ("tile_threshold", "lots", ["'tile_threshold'", "'lots'", "byte count"]),
        ("tile_factor", 0, ["'tile_factor'", "integer >= 1", "'auto'"]),
        ("prefetch_nc", -1, ["'prefetch_nc'", "integer >= 0"]),
        ("prefetch_gg", 1.5, ["'prefetch_gg'", "integer"]),
        ("offload_param", "gpu", ["'offload_param'", "'cpu'", "'nvme'"]),
        ("device_memory_limit", True, ["'device_memory_limit'", "byte count"]),
        ("disable_passes", 3, ["'disable_passes'", "pass names"]),
    ],
)
def test_bad_values_name_the_option_and_what_is_accepted(name, value, expected_words):
    with pytest.raises(ZinfOptionError) as err:
        parse_options({name: value}, environ={})
    for word in expected_words:
        assert word in str(err.value)


def test_environment_is_read_and_options_win():
    options = parse_options({}, environ={"ZINF_LOWER": "eager", "ZINF_TILE_THRESHOLD": "1MiB"})
    assert options.lower == "eager" and options.tile_threshold == 1024**2
    assert parse_options({"lower": "inductor"}, environ={"ZINF_LOWER": "eager"}).lower == "inductor"


def test_bad_environment_value_names_the_variable():
    with pytest.raises(ZinfOptionError, match="environment variable ZINF_PREFETCH_CG"):
        parse_options({}, environ={"ZINF_PREFETCH_CG": "soon"})


def test_nvme_offload_needs_a_path():
    # Whatever this build supports, asking for NVMe offload without a folder is refused.
    with pytest.raises(ZinfOptionError, match="nvme"):
        parse_options({"offload_param": "nvme"}, environ={})


def test_unknown_pass_in_disable_passes():
    with pytest.raises(ZinfOptionError, match="'no_such_pass'"):
        parse_options({"disable_passes": "no_such_pass"}, environ={}, known_passes=("partition",))


@pytest.mark.parametrize("text, expected", [("256MiB", 256 * 1024**2), ("2GB", 2 * 1000**3), (4096, 4096), ("1.5k", 1536)])
def test_byte_counts(text, expected):
    assert parse_bytes(text) == expected
