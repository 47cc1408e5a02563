"""Zero-copy: the optimizers update parameters and state in place, in the tensors' own memory.

* the numexpr engine binds numpy views that share the tensors' memory (never copies);
* through an optimizer, a large parameter (one the fast backend does not batch) is bound
  directly: the arrays numexpr reads and writes are its own, its grad's and its state's memory;
* after any number of steps, on every backend, each parameter and state tensor is the same
  object at the same address (state is never replaced), gradients are never written, and the
  values did change.
"""

import numpy as np
import pytest
import torch

import roundpipe.optim
from roundpipe.optim.backends import fast, numexpr_engine
from tests._util import RICH_KWARGS, clone_params, groups, make_params, roundtrip, rp_class, set_grads

# a parameter above the fast backend's batching threshold: stepped in place, not gathered
LARGE = fast.SMALL_NUMEL + 7


def _params_with_large(seed=0):
    params = make_params(seed)
    g = torch.Generator().manual_seed(seed + 50)
    large = [
        torch.nn.Parameter(torch.randn(LARGE, generator=g)),
        torch.nn.Parameter(torch.randn(LARGE // 2 + 3, generator=g, dtype=torch.complex64)),
    ]
    return params, large


def _optimizer(name, backend, params, large, **extra):
    gs = groups(params)
    gs[1]["params"] = gs[1]["params"] + large
    return rp_class(name)(gs, backend=backend, **{**RICH_KWARGS[name], **extra})


def _state_tensors(opt):
    return {
        (id(p), k): v for p, st in opt.state.items() for k, v in st.items() if isinstance(v, torch.Tensor)
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64])
def test_as_numpy_shares_memory(dtype):
    p = torch.nn.Parameter(torch.randn(3, 5, dtype=dtype))
    t = torch.view_as_real(p.detach()) if dtype.is_complex else p
    arr = numexpr_engine.as_numpy(t)
    assert arr.dtype == np.float32
    assert arr.ctypes.data == t.data_ptr() == p.data_ptr()
    assert np.shares_memory(
        arr, p.detach().numpy() if not dtype.is_complex else p.detach().numpy().view(np.float32)
    )
    arr.reshape(-1)[0] = 42.0
    assert p.detach().reshape(-1)[0].real.item() == 42.0


def test_numexpr_program_writes_into_the_tensors(monkeypatch):
    from roundpipe.optim.spec import SPECS

    spec = SPECS["Adam"]
    opts = {"maximize": False, "weight_decay": True, "decoupled_weight_decay": False, "amsgrad": True}
    prog = spec.program(opts)
    cp = numexpr_engine.compile_program(prog, (True,) * len(numexpr_engine.lerp_weights(prog)))
    tensors = {n: torch.rand(100) + 0.5 for n in prog.tensors}
    tensors["max_exp_avg_sq"].zero_()
    before = {n: t.clone() for n, t in tensors.items()}
    seen = []
    real = numexpr_engine.as_numpy

    def spy(t):
        arr = real(t)
        seen.append((t.data_ptr(), arr.ctypes.data))
        return arr

    monkeypatch.setattr(numexpr_engine, "as_numpy", spy)
    sc = {k: 0.1 for k in prog.scalars}
    cp.run(tensors, numexpr_engine.scalar_env(sc, numexpr_engine.lerp_weights(prog)))
    assert sorted(seen) == sorted((t.data_ptr(), t.data_ptr()) for t in tensors.values())
    for n in prog.targets:
        assert not torch.equal(tensors[n], before[n]), f"{n} not written in place"
    assert torch.equal(tensors["grad"], before["grad"])


def test_large_parameters_are_bound_in_place(name, monkeypatch):
    """Through the optimizer (numexpr engine): every array numexpr gets for a large parameter
    is the memory of that parameter, its grad or its state."""
    monkeypatch.setenv(fast.ENGINE_ENV_VAR, "numexpr")
    params, large = _params_with_large()
    opt = _optimizer(name, "fast", params, large)
    set_grads(params + large, 0)
    opt.step()
    seen = []
    real = numexpr_engine.as_numpy

    def spy(t):
        arr = real(t)
        assert arr.ctypes.data == t.data_ptr(), "as_numpy copied"
        seen.append(arr.ctypes.data)
        return arr

    monkeypatch.setattr(numexpr_engine, "as_numpy", spy)
    set_grads(params + large, 1)
    opt.step()
    bound = set(seen)
    for p in large:
        own = {p.data_ptr(), p.grad.data_ptr()}
        own |= {v.data_ptr() for v in opt.state[p].values() if isinstance(v, torch.Tensor) and v.dim() > 0}
        assert p.data_ptr() in bound and p.grad.data_ptr() in bound
        missing = own - bound
        assert not missing, f"{len(missing)} of the parameter's tensors were not bound in place"


def test_steps_keep_tensors_and_addresses(name, backend):
    """Params and state keep their objects and addresses across steps (state created on the
    first step is never replaced); grads are never written; every parameter moves."""
    params, large = _params_with_large()
    everything = params + large
    opt = _optimizer(name, backend, params, large, maximize=True)
    ptrs = [p.data_ptr() for p in everything]
    initial = [p.detach().clone() for p in everything]
    state0 = None
    for k in range(4):
        set_grads(everything, k)
        grads = [p.grad for p in everything]
        grad_copies = [g.clone() for g in grads]
        opt.step()
        assert [p.data_ptr() for p in everything] == ptrs
        flat = [p for g in opt.param_groups for p in g["params"]]
        assert all(a is b for a, b in zip(flat, everything, strict=True))
        for p, g, gc in zip(everything, grads, grad_copies, strict=True):
            assert p.grad is g and torch.equal(g, gc), "grad was written"
        state = _state_tensors(opt)
        if state0 is None:
            state0 = {key: (t, t.data_ptr()) for key, t in state.items()}
        else:
            assert state.keys() == state0.keys()
            for key, t in state.items():
                obj, ptr = state0[key]
                assert t is obj, f"state {key[1]!r} replaced"
                assert t.data_ptr() == ptr, f"state {key[1]!r} moved"
    for i, (p, p0) in enumerate(zip(everything, initial, strict=True)):
        assert not torch.equal(p.detach(), p0), f"param {i} did not change"


def test_state_created_in_init_is_kept(backend):
    """Adagrad creates its state in __init__: the first step updates that state in place."""
    params, large = _params_with_large()
    opt = _optimizer("Adagrad", backend, params, large)
    before = {key: (t, t.data_ptr(), t.clone()) for key, t in _state_tensors(opt).items()}
    assert before
    set_grads(params + large, 0)
    opt.step()
    after = _state_tensors(opt)
    assert after.keys() == before.keys()
    for key, (obj, ptr, _) in before.items():
        assert after[key] is obj and after[key].data_ptr() == ptr
    assert any(not torch.equal(after[key], val) for key, (_, _, val) in before.items() if key[1] == "sum")


@pytest.mark.parametrize("opt_name", ["Adam", "RMSprop"])
def test_two_threads_give_the_same_bits(opt_name, engine):
    """The thread count does not change results (the rest of the suite runs on one thread)."""
    results = []
    for n in (1, 2):
        roundpipe.optim.set_num_threads(n)
        try:
            params, large = _params_with_large()
            opt = _optimizer(opt_name, "fast", params, large)
            for k in range(2):
                set_grads(params + large, k)
                opt.step()
            results.append([p.detach().clone() for p in params + large])
        finally:
            roundpipe.optim.set_num_threads(None)
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_loaded_state_is_updated_in_place(name, backend):
    """State that exists before a step (here: loaded from a checkpoint) is updated where it
    is: the state dict keeps the very tensors load_state_dict put there."""
    params, large = _params_with_large()
    opt = _optimizer(name, backend, params, large)
    for k in range(2):
        set_grads(params + large, k)
        opt.step()
    new_params, new_large = clone_params(params), clone_params(large)
    new = _optimizer(name, backend, new_params, new_large)
    new.load_state_dict(roundtrip(opt.state_dict()))
    before = {key: (t, t.data_ptr()) for key, t in _state_tensors(new).items()}
    for k in range(2, 4):
        set_grads(new_params + new_large, k)
        new.step()
    after = _state_tensors(new)
    assert after.keys() == before.keys()
    for key, (obj, ptr) in before.items():
        assert after[key] is obj, f"state {key[1]!r} replaced"
        assert after[key].data_ptr() == ptr, f"state {key[1]!r} moved"
