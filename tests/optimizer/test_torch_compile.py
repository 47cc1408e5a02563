"""``opt.step()`` inside ``torch.compile``: torch's "compiling the optimizer" recipe, and what
compiling a whole training step does.

A roundpipe step runs as itself under ``torch.compile(fullgraph=False)`` (``torch.compiler.
disable`` on it, see ``optimizer.step``): dynamo neither traces into numba's dispatcher (which
it cannot: ``AssertionError: exception table entry start instruction has no offset``) nor hands
the torch engine's or the reference backend's ops to inductor (which rounds differently). So
three compiled AdamW steps are bit for bit three eager ``torch.optim.AdamW(foreach=False)``
steps, parameters and every state tensor, on every bit-for-bit backend.
"""

import pytest
import torch

import roundpipe.optim
from tests._util import assert_bits_equal

BACKENDS = ["fast", "fast:numba", "fast:torch", "reference"]
KWARGS = dict(lr=0.01, weight_decay=0.1, amsgrad=True)
STEPS = 3


def _params():
    g = torch.Generator().manual_seed(5)
    return [
        torch.nn.Parameter(torch.randn(shape, generator=g, dtype=dtype))
        for shape, dtype in (((7, 5), torch.float32), ((70000,), torch.float32), ((6,), torch.complex64))
    ]


def _grads(step, params):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in params]


@pytest.fixture
def fresh_dynamo():
    import torch._dynamo

    torch._dynamo.reset()
    yield torch._dynamo
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", BACKENDS)
def test_step_inside_torch_compile_is_the_eager_step(backend, fresh_dynamo):
    ours, theirs = _params(), _params()
    opt = roundpipe.optim.AdamW(ours, backend=backend, **KWARGS)
    ref = torch.optim.AdamW(theirs, foreach=False, **KWARGS)

    @torch.compile(fullgraph=False)  # inductor, torch's default
    def compiled_step():
        opt.step()

    fresh_dynamo.utils.counters.clear()
    for step in range(STEPS):
        for params in (ours, theirs):
            for p, g in zip(params, _grads(step, params), strict=True):
                p.grad = g
        compiled_step()
        ref.step()
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert_bits_equal(a.detach(), b.detach(), f"step {step} param {i}")
            assert sorted(opt.state[a]) == sorted(ref.state[b])
            for k, vb in ref.state[b].items():
                assert_bits_equal(opt.state[a][k], vb, f"step {step} param {i} state[{k!r}]")
    # dynamo did see the function (the step ran inside torch.compile, not beside it)
    assert sum(fresh_dynamo.utils.counters["frames"].values()) > 0, dict(fresh_dynamo.utils.counters)
