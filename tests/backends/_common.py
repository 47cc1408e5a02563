"""What the backends' tests share: a program that uses every IR function and operator, inputs
with NaN and signed zeros, the same math in torch ops, and a run through any backend."""

import torch

from roundpipe.optim import backends
from roundpipe.optim.spec.ir import (
    ProgramBuilder,
    abs_,
    add,
    addcdiv,
    addcmul,
    clamp,
    clamp_min,
    lerp,
    maximum,
    rsqrt,
    sign,
    sqrt,
    sqrt_rn,
    where,
)

INPUTS = ("param", "grad", "buf", "acc")


def every_function_builder():
    """The builder of ``every_function_program``, not yet built (to extend), and its tensors."""
    b = ProgramBuilder(INPUTS)
    s = b.s
    param, grad, buf, acc = (b.tensor(n) for n in INPUTS)
    g = b.let("g", add(grad, param, alpha=s.wd))
    g = b.let("g", where(g > 0.5, -g, where(g <= -2.0, g * 0.5, g)))
    b.assign(buf, lerp(buf, g, s.w))
    b.assign(acc, maximum(addcmul(acc * s.beta, g, g, value=s.one_minus_beta), abs_(buf) / 4.0))
    d = b.let("d", sqrt(acc) + s.eps)
    u = b.let("u", clamp(addcdiv(buf - buf, g, d, value=s.one), s.lo, s.hi))
    b.assign(
        param,
        addcdiv(param, buf, d, value=s.neg_lr) - u * s.lr + sign(grad) * s.tiny + 0.5 / (d + sqrt_rn(acc)),
    )
    b.assign(param, where(param >= 3.0, 3.0 - param, 1.0 + (param - 1.0)))
    b.assign(param, param + rsqrt(clamp_min(acc, s.eps)) * s.tiny)
    return b, (param, grad, buf, acc)


def every_function_program():
    """A program that uses every IR function and operator."""
    return every_function_builder()[0].build()


def inputs(seed, n=257, nan=True):
    g = torch.Generator().manual_seed(seed)
    t = {k: torch.randn(n, generator=g) for k in INPUTS}
    t["acc"] = t["acc"].abs()
    if nan:
        t["grad"][3] = float("nan")
        t["buf"][5] = float("nan")
        t["acc"][7] = float("nan")
        t["grad"][11] = 0.0
        t["grad"][12] = -0.0
    return t


SCALARS = dict(
    wd=0.1, beta=0.9, one_minus_beta=0.1, eps=1e-8, one=1.0, lo=-0.3, hi=0.3, neg_lr=-0.01, lr=0.01
)


def by_hand(t, sc):
    """The same math in torch ops, written out."""
    param, grad, buf, acc = (t[k].clone() for k in INPUTS)
    g = torch.add(grad, param, alpha=sc["wd"])
    g = torch.where(g > 0.5, -g, torch.where(g <= -2.0, g * 0.5, g))
    buf = torch.lerp(buf, g, sc["w"])
    acc = torch.maximum(torch.addcmul(acc * sc["beta"], g, g, value=sc["one_minus_beta"]), buf.abs() / 4.0)
    d = acc.sqrt() + sc["eps"]
    u = torch.clamp(torch.addcdiv(buf - buf, g, d, value=sc["one"]), sc["lo"], sc["hi"])
    param = torch.addcdiv(param, buf, d, value=sc["neg_lr"]) - u * sc["lr"] + torch.sign(grad) * sc["tiny"]
    param = param + 0.5 / (d + acc.double().sqrt().to(acc.dtype))
    param = torch.where(param >= 3.0, 3.0 - param, 1.0 + (param - 1.0))
    param = param + torch.rsqrt(torch.clamp(acc, min=sc["eps"])) * sc["tiny"]
    return dict(param=param, grad=grad, buf=buf, acc=acc)


# (label, backend, fast engine)
ALL_BACKENDS = (
    ("reference", "reference", None),
    ("numba", "fast", "numba"),
    ("numexpr", "fast", "numexpr"),
    ("torch", "fast", "torch"),
)


def run(backend_name, prog, tensors, scalars):
    """Run ``prog`` through a backend on one set of tensors (name -> tensor)."""
    backends.get(backend_name).run(prog, scalars, {k: [v] for k, v in tensors.items()})


def assert_matches(got, expected, msg=""):
    for k in INPUTS:
        torch.testing.assert_close(
            got[k], expected[k], equal_nan=True, rtol=1e-6, atol=1e-7, msg=f"{msg} {k}"
        )
        # NaN positions are exactly torch's (maximum, clamp and where propagate; sign(NaN) = 0)
        assert torch.equal(got[k].isnan(), expected[k].isnan()), f"{msg} {k}"
