"""A gradient's states and moves (runtime/grad_state.py): every legal move, and a clear error for any other."""

import pytest
import torch

from zinf_compiler.runtime.grad_state import LEGAL_TRANSITIONS, Gradient, GradState, ZinfGradStateError


class _Copy:
    """A copy off the device in flight: done once synchronized."""

    def __init__(self):
        self.synchronized = 0

    def synchronize(self):
        self.synchronized += 1


def test_in_memory_start_add_scale_drop():
    gradient = Gradient("w")
    assert gradient.state is GradState.NONE and not gradient and gradient.shard is None
    gradient.start(torch.ones(4))
    gradient.add(1, 3, torch.full((2,), 2.0))
    gradient.scale(0.5)
    assert gradient.state is GradState.IN_MEMORY and gradient
    assert gradient.shard.tolist() == [0.5, 1.5, 1.5, 0.5]
    assert gradient.drop() == (16, False, 0)
    assert gradient.state is GradState.NONE and gradient.shard is None


def test_an_arriving_shard_lands_at_its_first_read():
    gradient, copy = Gradient("w"), _Copy()
    gradient.start_arriving(torch.zeros(3), copy)
    assert gradient.state is GradState.ARRIVING and gradient.arriving is copy and gradient.shard_nowait is not None
    assert gradient.shard_bytes == 12 and copy.synchronized == 0  # (counting waits for nothing)
    assert gradient.shard is not None and copy.synchronized == 1
    assert gradient.state is GradState.IN_MEMORY and gradient.arriving is None


def test_dropping_an_arriving_shard_waits_for_its_copy():
    gradient, copy = Gradient("w"), _Copy()
    gradient.start_arriving(torch.zeros(3), copy)
    gradient.drop()
    assert copy.synchronized == 1 and gradient.state is GradState.NONE


def test_on_disk_keeps_the_norm_and_scales_it_with_the_multiplier():
    gradient = Gradient("w")
    assert gradient.to_disk() is False  # nothing held before: the writes do not add
    gradient.written(9.0)
    gradient.scale(0.5)
    assert gradient.on_disk and gradient.multiplier == 0.5 and gradient.sq_norm == pytest.approx(2.25)
    assert gradient.to_disk() is True  # a second backward adds to what the files hold
    gradient.written(4.0)
    assert gradient.multiplier == 1.0 and gradient.sq_norm == 4.0
    assert gradient.drop() == (0, True, 0)


def test_a_lost_gradient_keeps_its_first_failure_until_dropped():
    gradient = Gradient("w")
    gradient.to_disk()
    first = OSError("ENOSPC")
    gradient.lose(first)
    gradient.lose(OSError("EIO"))
    gradient.scale(2.0)  # (nothing to scale: the step refuses it anyway)
    assert gradient.state is GradState.LOST and gradient.lost is first and gradient.on_disk
    with pytest.raises(ZinfGradStateError, match="cannot to_disk from lost"):
        gradient.to_disk()
    assert gradient.drop() == (0, True, 0) and gradient.lost is None


def test_tiles_collect_until_all_arrived_and_a_drop_gives_back_a_partial_buffer():
    gradient = Gradient("w")
    whole, made = gradient.collect_tile(0, 0, 2, torch.ones(2), 4, tiles=2)
    assert whole is None and made == 16
    whole, given_back = gradient.collect_tile(1, 2, 4, torch.full((2,), 3.0), 4, tiles=2)
    assert whole.tolist() == [1.0, 1.0, 3.0, 3.0] and given_back == -16
    gradient.collect_tile(0, 0, 2, torch.ones(2), 4, tiles=2)
    assert gradient.drop() == (0, False, 16)  # a backward stopped half way: its tiles do not survive zero_grad
    whole, made = gradient.collect_tile(1, 2, 4, torch.ones(2), 4, tiles=2)
    assert whole is None and made == 16  # a fresh buffer: the dropped tile 0 does not count as arrived


@pytest.mark.parametrize("move, setup", [("add", None), ("landed", None), ("written", None), ("lose", None),
                                         ("start", "in memory"), ("start_arriving", "on disk")])
def test_every_other_move_raises_naming_the_parameter_and_states(move, setup):
    gradient = Gradient("blocks.0.w")
    if setup == "in memory":
        gradient.start(torch.zeros(2))
    elif setup == "on disk":
        gradient.to_disk()
    args = {"add": (0, 1, torch.ones(1)), "landed": (), "written": (1.0,), "lose": (OSError(),),
            "start": (torch.zeros(2),), "start_arriving": (torch.zeros(2), _Copy())}[move]
    with pytest.raises(ZinfGradStateError, match=f"gradient of blocks.0.w cannot {move} from"):
        getattr(gradient, move)(*args)


def test_the_table_names_only_moves_that_exist():
    moves = {move for names in LEGAL_TRANSITIONS.values() for move in names}
    assert all(callable(getattr(Gradient, move)) for move in moves)
