"""The statement language (``roundpipe/optim/spec/ir.py``): the program interface, printing, let
shadowing, and the validator and builder rejecting malformed programs.
"""

import pytest

from roundpipe.optim.spec import ir
from roundpipe.optim.spec.ir import (
    Assign,
    Call,
    Const,
    Let,
    ProgramBuilder,
    Scalar,
    Tensor,
    add,
    addcmul,
    lerp,
    sqrt,
    validate,
)

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
