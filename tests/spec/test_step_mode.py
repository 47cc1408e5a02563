"""``spec.modes.StepMode``: the one enumeration of how a program computes and stores, which every
engine dispatches on through ``param_rounding``; a mode it does not know raises."""

import pytest
import torch

from roundpipe.optim.spec import modes, variants
from roundpipe.optim.spec.adam import ADAM


def test_every_mode_has_its_rounding_and_an_unknown_one_raises():
    assert {m: modes.param_rounding(m) for m in modes.StepMode} == {
        modes.StepMode.TORCH: "own",
        modes.StepMode.WIDENED: "nearest",
        modes.StepMode.STOCHASTIC: "stochastic",
    }
    with pytest.raises(ValueError, match="unknown step mode"):
        modes.param_rounding("rounded-somehow")


def test_a_stored_program_is_another_program_of_its_mode():
    group = torch.optim.Adam([torch.zeros(1)]).param_groups[0]
    program = ADAM.program(ADAM.options(group))
    assert program.storage is modes.StepMode.TORCH and not program.storage
    for mode in (modes.StepMode.WIDENED, modes.StepMode.STOCHASTIC):
        other = variants.stored(program, mode)
        assert other.storage is mode and other != program
    with pytest.raises(ValueError):
        variants.stored(program, modes.StepMode.TORCH)
