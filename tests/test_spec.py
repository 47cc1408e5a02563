"""The spec layer: every optimizer spec builds valid programs for every combination of its
options, and the IR validator rejects malformed programs."""

import pytest
import torch

from roundpipe.optim.spec import SPECS, ir
from roundpipe.optim.spec.core import Options
from roundpipe.optim.spec.ir import (
    Assign,
    Call,
    Const,
    Let,
    Program,
    ProgramBuilder,
    Scalar,
    Tensor,
    add,
    addcmul,
    lerp,
    sqrt,
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


def test_specs_cover_all_optimizers():
    assert sorted(SPECS) == sorted(OPTIMIZER_NAMES)


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


# ---------------------------------------------------------------------------------------------
# the validator


INPUTS = ("param", "grad", "buf")


def test_valid_program_interface():
    b = ProgramBuilder(INPUTS)
    param, grad, buf = b.tensor("param"), b.tensor("grad"), b.tensor("buf")
    g = b.let("g", add(grad, param, alpha=b.s.wd))
    b.assign(buf, lerp(buf, g, b.s.w))
    b.assign(param, param - b.s.lr * buf)
    prog = b.build()
    assert prog.tensors == ("param", "grad", "buf")
    assert prog.scalars == ("wd", "w", "lr")
    assert prog.targets == ("buf", "param")


def test_print_program(capsys):
    b = ProgramBuilder(INPUTS)
    param, grad = b.tensor("param"), b.tensor("grad")
    g = b.let("grad", -grad)
    b.assign(param, addcmul(param, g, g, value=b.s.lr))
    prog = b.build()
    print(prog)
    out = capsys.readouterr().out
    assert out.splitlines() == [
        "let grad_t0 = neg(grad)",
        "    param = addcmul(param, grad_t0, grad_t0, $lr)",
    ]


def test_let_shadowing_gets_unique_names():
    b = ProgramBuilder(INPUTS)
    g1 = b.let("g", b.tensor("grad") * 2)
    g2 = b.let("g", g1 * 3)
    assert g1.name != g2.name
    b.assign(b.tensor("param"), b.tensor("param") + g2)
    b.build()


@pytest.mark.parametrize(
    "statements, error, match",
    [
        # a name that is neither an input nor an earlier let
        ([Assign("param", Tensor("param") + Tensor("nope"))], NameError, "nope"),
        # a let used before its definition
        ([Assign("param", Tensor("param") + Tensor("t")), Let("t", Tensor("grad") * 2.0)], NameError, "'t'"),
        # scalar math must happen in scalars(), in double precision
        ([Assign("param", Tensor("param") + Scalar("a") * Scalar("b"))], ValueError, "scalar-only"),
        ([Assign("param", Tensor("param") + (Const(1.0) - Scalar("b")))], ValueError, "scalar-only"),
        ([Assign("param", Scalar("a"))], ValueError, "scalar"),
        ([Let("t", Scalar("a") * Const(2.0))], ValueError, "scalar"),
        # grad is read-only; lets and unknown names are not writable
        ([Assign("grad", Tensor("grad") * 2.0)], ValueError, "grad"),
        ([Let("t", Tensor("grad") * 2.0), Assign("t", Tensor("grad"))], ValueError, "'t'"),
        ([Assign("other", Tensor("grad"))], ValueError, "other"),
        # unknown functions, wrong arity
        ([Assign("param", Call("exp", (Tensor("param"),)))], ValueError, "exp"),
        ([Assign("param", Call("sqrt", (Tensor("param"), Tensor("grad"))))], ValueError, "sqrt"),
        # scalar-only arguments must be scalars
        (
            [Assign("param", Call("lerp", (Tensor("param"), Tensor("grad"), Tensor("buf"))))],
            ValueError,
            "lerp",
        ),
        ([Assign("param", Call("lerp", (Tensor("param"), Tensor("grad"), Const(0.5))))], ValueError, "lerp"),
        (
            [Assign("param", Call("add", (Tensor("param"), Tensor("grad"), Tensor("buf"))))],
            ValueError,
            "argument 2",
        ),
        (
            [Assign("param", Call("clamp", (Tensor("param"), Tensor("grad"), Scalar("hi"))))],
            ValueError,
            "clamp",
        ),
        # where needs a comparison
        (
            [Assign("param", Call("where", (Tensor("grad"), Tensor("param"), Tensor("buf"))))],
            ValueError,
            "where",
        ),
        # a let may not redefine an input or an earlier let
        ([Let("param", Tensor("grad") * 2.0)], ValueError, "redefines"),
        ([Let("t", Tensor("grad") * 2.0), Let("t", Tensor("grad") * 3.0)], ValueError, "redefines"),
        # comparisons are only a where() condition, never a value
        ([Assign("param", Tensor("grad") > Const(0.0))], ValueError, None),
        ([Assign("param", Tensor("param") + (Tensor("grad") > Const(0.0)))], ValueError, None),
        ([Let("t", Tensor("grad") <= Tensor("param")), Assign("param", Tensor("t"))], ValueError, None),
        # unknown operator
        ([Assign("param", ir.Bin("**", Tensor("param"), Const(2.0)))], ValueError, r"\*\*"),
    ],
)
def test_validator_rejects(statements, error, match):
    with pytest.raises(error, match=match):
        validate(statements, INPUTS)


def test_builder_rejects_unknown_tensor_and_bad_constants():
    b = ProgramBuilder(INPUTS)
    with pytest.raises(KeyError, match="exp_avg"):
        b.tensor("exp_avg")
    with pytest.raises(TypeError):
        b.tensor("param") * True
    with pytest.raises(TypeError):
        b.tensor("param") + "1"


def test_builder_validates_on_build():
    b = ProgramBuilder(INPUTS)
    b.assign(b.tensor("grad"), sqrt(b.tensor("param")))
    with pytest.raises(ValueError, match="grad"):
        b.build()


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
