"""The optimizer specs (``roundpipe/optim/spec/<name>.py``): every optimizer has one, every spec
builds a valid program for every combination of its options, creates every input in its
state, and declares the flags its scalars return.
"""

from collections.abc import Mapping

import pytest
import torch

from conformance import cases, staged_cases
from roundpipe.optim.bench import workloads
from roundpipe.optim.spec import SPECS, STAGED_SPECS
from roundpipe.optim.spec.core import Options
from roundpipe.optim.spec.ir import (
    Program,
    validate,
)
from tests._util import (
    OPTIMIZER_NAMES,
    RICH_KWARGS,
    all_programs,
    default_group,
    rp_class,
    spec_scalars,
    torch_class,
)

from .. import test_fidelity


def test_every_table_covers_every_spec():
    """The per-optimizer tables the tests and the bench read hold every registered spec and
    nothing else: each is derived from ``SPECS`` (``STAGED_SPECS`` for the staged ones) but the
    conformance cases, which a new optimizer adds by hand (CONTRIBUTING.md)."""
    tables = {
        "tests/_util.py OPTIMIZER_NAMES (the name fixture)": OPTIMIZER_NAMES,
        "tests/_util.py RICH_KWARGS": RICH_KWARGS,
        "tests/test_fidelity.py KWARGS": test_fidelity.KWARGS,
        "conformance/cases.py OPTIMIZERS": cases.OPTIMIZERS,
        "conformance/cases.py CASES_BY_OPTIMIZER": cases.CASES_BY_OPTIMIZER,
    }
    # the tables of every optimizer, the staged ones (Adafactor, Muon) included
    every = {
        "roundpipe/optim/bench/workloads.py OPTIONS": (workloads.OPTIONS, {**SPECS, **STAGED_SPECS}),
        "conformance/staged_cases.py STAGED_CASES": (
            {c.optimizer for c in staged_cases.STAGED_CASES},
            STAGED_SPECS,
        ),
    }
    checks = {**{where: (table, SPECS) for where, table in tables.items()}, **every}
    for where, (table, specs) in checks.items():
        missing, unknown = sorted(set(specs) - set(table)), sorted(set(table) - set(specs))
        assert not missing and not unknown, f"{where}: missing {missing}, not a spec {unknown}"
    assert all(cases.CASES_BY_OPTIMIZER[n] for n in SPECS), "an optimizer without conformance cases"


def test_spec_carries_valid_test_kwargs(name):
    """Both kwargs sets are mappings of constructor arguments that torch's class and roundpipe's
    accept, and ``rich_kwargs`` switches on every state tensor any of the spec's programs binds
    and weight decay where the optimizer has it (what the tests that use it rely on)."""
    spec = SPECS[name]
    for field in ("rich_kwargs", "fidelity_kwargs"):
        kwargs = getattr(spec, field)
        assert isinstance(kwargs, Mapping), (field, kwargs)
        torch_class(name)([torch.nn.Parameter(torch.zeros(3))], **kwargs)
        rp_class(name)([torch.nn.Parameter(torch.zeros(3))], **kwargs)
    bound = {n for opts, _ in all_programs(spec) for n in spec.inputs(Options(opts))}
    group, p = default_group(spec, **spec.rich_kwargs)
    state = {}
    spec.init_state(group, p, state)
    assert bound - {"param", "grad"} <= set(state), (sorted(bound), sorted(state))
    assert spec.options(group).get("weight_decay", True), "rich_kwargs leave weight decay off"


def test_spec_metadata(name):
    spec = SPECS[name]
    assert spec.name == name
    assert spec.torch_class is torch_class(name)
    assert rp_class(name).spec is spec


def test_every_option_combination_builds_a_valid_program(name):
    spec = SPECS[name]
    programs = all_programs(spec)
    assert len(programs) >= 2 ** len(spec.options(default_group(spec)[0]))
    for opts, prog in programs:
        assert isinstance(prog, Program), opts
        inputs = tuple(spec.inputs(Options(opts)))
        assert inputs[:2] == ("param", "grad"), (opts, inputs)
        # valid: re-validating the statements gives the same interface
        again = validate(prog.statements, inputs)
        assert (again.tensors, again.scalars, again.targets) == (prog.tensors, prog.scalars, prog.targets)
        assert set(prog.tensors) <= set(inputs), opts
        assert "grad" in prog.tensors, opts
        assert "param" in prog.targets, opts
        assert "grad" not in prog.targets, opts
        assert set(prog.targets) <= set(inputs), opts
        # every statement prints as one line
        text = str(prog)
        assert len(text.splitlines()) == len(prog.statements), opts
        # cached: the fast backend keys its compiled programs by identity
        assert spec.program(dict(opts)) is prog


def test_init_state_creates_every_input(name):
    """For hyperparameters that enable the optional state, init_state creates every tensor
    the program binds, with the parameter's shape and dtype, for real and complex params."""
    spec = SPECS[name]
    for dtype in (torch.float32, torch.complex64):
        p = torch.nn.Parameter(torch.zeros(2, 3, dtype=dtype))
        p.grad = torch.ones(2, 3, dtype=dtype)
        group = spec.torch_class([p], **RICH_KWARGS[name]).param_groups[0]
        state = {}
        flags = dict(spec.init_state(group, p, state) or {})
        scalars = spec_scalars(spec, group, p, state)
        flags.update({k: v for k, v in scalars.items() if isinstance(v, bool)})
        opts = {**spec.options(group), **flags}
        prog = spec.program(opts)
        for n in spec.inputs(Options(opts))[2:]:
            assert isinstance(state.get(n), torch.Tensor), (n, sorted(state))
            assert state[n].shape == p.shape and state[n].dtype == p.dtype, n
        # scalars() provides every scalar the program uses, as numbers
        values = {k: v for k, v in scalars.items() if not isinstance(v, bool)}
        assert set(prog.scalars) <= set(values), (prog.scalars, sorted(values))
        for k in prog.scalars:
            float(values[k])


@pytest.mark.parametrize("name", list(SPECS))
def test_declared_flags_are_the_flags_returned(name):
    """spec.flags lists every bool init_state and scalars return (over 12 steps), and no other."""
    spec = SPECS[name]
    group, p = default_group(spec, **RICH_KWARGS[name])
    state, seen = {}, set()
    for _ in range(12):
        seen |= {k for k, v in (spec.init_state(group, p, state) or {}).items() if isinstance(v, bool)}
        seen |= {k for k, v in spec_scalars(spec, group, p, state).items() if isinstance(v, bool)}
    assert seen == set(spec.flags)
