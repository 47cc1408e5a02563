"""FSDP2 (``fully_shard``): every roundpipe.optim optimizer, on every backend, against torch.optim.

Two processes on gloo (CPU, loopback) train a small model whose shards are uneven (37x29 and
29x37 Linear layers, a LayerNorm, and a 1x37 Linear whose rank-1 shards are empty), with
``fully_shard`` on every layer and on the root, once as is and once with
``CPUOffloadPolicy(pin_memory=False)``. Its parameters, their gradients and the optimizer
state are ``DTensor``s. Every optimizer (the hyperparameters of ``RICH_KWARGS``, which switch
their state on, plus SGD without momentum, which has no state) runs on every backend
(``fast`` with each engine) in lockstep with a baseline
on an identical copy (same initial values, same batches), in two param groups (the
LayerNorm's with its own lr).

At every step each model runs its own forward and backward (FSDP2's all-gather and
reduce-scatter); its loss must match the baseline's, and then it takes the baseline's gradient
values: recomputed from parameters that differ by rounding, a gradient element that is a
cancelling sum would amplify that rounding far beyond the optimizer's own (the conformance
suite, too, feeds identical gradients). After every step:

* each parameter's local shard is close to the baseline's (same type, placements and shape);
  the step left the local shard where it was (FSDP2 needs in-place updates) and did not modify
  any gradient; after the last step the full tensors (``full_tensor()``) are compared too;
* the state has the same parameters and keys as the baseline's; each entry has the same type
  (a ``DTensor`` with the parameter's placements where torch's is one, a plain 0-d tensor for
  ``step`` and the like) and local shard values close to the baseline's.

In the ``CLIPPED`` cases every run clips before each step (roundpipe's ``opt.clip_grad_norm_``
on the DTensor gradients, the baseline torch's ``torch.nn.utils.clip_grad_norm_``): the total
norms must be close, above the threshold (so every step clips), and the steps as above.

After step ``RELOAD_AFTER``, each roundpipe optimizer goes through ``get_optimizer_state_dict``
(which must match the baseline's) and ``set_optimizer_state_dict`` into a fresh optimizer on a
fresh model (loaded with ``set_model_state_dict``), which carries on in its place.

The baseline is ``torch.optim`` stepping the DTensors, except for Rprop: torch 2.13's Rprop
cannot step a sharded DTensor (``aten.index_put_`` would need a placement change), so
roundpipe's Rprop is compared with torch's Rprop stepping each rank's local shards (plain
tensors that alias the DTensors' local storage, with the local gradients).

Then, per backend, a DTensor parameter gets a gradient or state entry unlike it (a plain
full-size tensor, as an unsharded checkpoint or a hand-made gradient would give; a Replicate or
a Partial gradient): the step must raise an error naming the parameter before anything is
modified.

All cases run in one two-process spawn (a module fixture); each of the two tests lists every
combination that failed, with its first mismatch.

Checking the harness itself: ``python -m tests.test_fsdp --substitute torch`` runs the same
cases with torch.optim in place of roundpipe (Rprop: the local-shard baseline), and
``--substitute local`` with torch.optim stepping local shards in place of roundpipe for every
optimizer (no state dict round trip then), which checks the Rprop baseline's method against
torch's own DTensor steps for the other ten. Both must report no failures.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import time
import traceback
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp
from torch import nn

from roundpipe.optim import shutdown_process_group
from tests._util import OPTIMIZER_NAMES, RICH_KWARGS, TOL, rp_class, torch_class

WORLD_SIZE = 2
STEPS = 4
RELOAD_AFTER = 2  # the state dict round trip happens after this many steps
SPAWN_TIMEOUT = 180  # seconds for the whole two-process run (about 20 s on an idle 2-core machine)
GLOO_TIMEOUT = datetime.timedelta(seconds=30)

# (label, optimizer, hyperparameters)
CASES = [(name, name, dict(RICH_KWARGS[name])) for name in OPTIMIZER_NAMES] + [
    ("SGD-no-momentum", "SGD", dict(lr=0.01)),
    ("AdamW-clipped", "AdamW", dict(RICH_KWARGS["AdamW"])),
]
# cases that clip before each step, with this max_norm (below the gradients' norms): roundpipe's
# opt.clip_grad_norm_ on DTensor gradients (each norm reduced over the mesh) against torch's
# torch.nn.utils.clip_grad_norm_ on the baseline's
CLIPPED = {"AdamW-clipped": 0.05}
# "fast" runs its default engine (the environment's choice is cleared); "fast:numexpr" the other
BACKENDS = ["reference", "fast", "fast:torch", "fast:numexpr"]
OFFLOAD = [False, True]
ENV = {
    "OMP_NUM_THREADS": "1",
    "NUMBA_NUM_THREADS": "1",
    "ROUNDPIPE_OPTIM_BACKEND": None,
    "ROUNDPIPE_OPTIM_ENGINE": None,
    "ROUNDPIPE_OPTIM_NUM_THREADS": None,
}


def _combo_id(label, backend, offload):
    return f"{label} / {backend} / {'CPUOffloadPolicy' if offload else 'no offload'}"


# ---------------------------------------------------------------------------------------------
# model, data, optimizers


def _build(seed, offload):
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(37, 29), nn.LayerNorm(29), nn.Tanh(), nn.Linear(29, 37), nn.Tanh(), nn.Linear(37, 1)
    )
    kwargs = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if offload else {}
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _named_groups(model):
    """Two groups: the LayerNorm's parameters (module "1") and all others; names in order."""
    named = list(model.named_parameters())
    first = [(n, p) for n, p in named if not n.startswith("1.")]
    second = [(n, p) for n, p in named if n.startswith("1.")]
    return first, second


def _groups(model, lr):
    first, second = _named_groups(model)
    return [{"params": [p for _, p in first]}, {"params": [p for _, p in second], "lr": lr / 2}]


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 37, generator=g), torch.randn(8, 1, generator=g)


class _LocalShards:
    """torch.optim.<name> on each rank's local shards: plain leaf tensors that alias the
    DTensor parameters' local storage (FSDP2 keeps it for the parameters' lifetime), given
    the local gradients at every step."""

    def __init__(self, cls, groups, kwargs):
        self.dtensors, local_groups = [], []
        for group in groups:
            local = []
            for p in group["params"]:
                t = nn.Parameter(p.to_local().detach())
                assert t.numel() == 0 or t.data_ptr() == p.to_local().data_ptr()
                self.dtensors.append(p)
                local.append(t)
            local_groups.append({**group, "params": local})
        self.opt = cls(local_groups, **kwargs)
        self.locals = [p for g in self.opt.param_groups for p in g["params"]]

    def zero_grad(self):
        for p, t in zip(self.dtensors, self.locals, strict=True):
            p.grad = t.grad = None

    def step(self):
        for p, t in zip(self.dtensors, self.locals, strict=True):
            t.grad = None if p.grad is None else p.grad.to_local()
        self.opt.step()

    def states(self):
        return [self.opt.state.get(t) for t in self.locals]


class _Run:
    """One model and its optimizer, stepped in lockstep with the others of a case."""

    def __init__(self, backend, kind, name, kwargs, offload, clip=None):
        self.backend, self.kind, self.name, self.kwargs, self.offload = backend, kind, name, kwargs, offload
        self.clip = clip  # max_norm: clip before each step
        self.norm = None  # the last clip's total norm, as a plain tensor
        self.error = None
        self._install(_build(0, offload))

    def _install(self, model):
        self.model = model
        first, second = _named_groups(model)
        self.names = [n for n, _ in first + second]
        self.params = [p for _, p in first + second]
        self.opt = self._make(model)

    def _make(self, model):
        groups = _groups(model, self.kwargs["lr"])
        if self.kind == "roundpipe":
            opt = rp_class(self.name)(groups, backend=self.backend, **self.kwargs)
            assert opt.backend == self.backend, (opt.backend, self.backend)
            return opt
        if self.kind == "torch":
            return torch_class(self.name)(groups, **self.kwargs)
        return _LocalShards(torch_class(self.name), groups, self.kwargs)

    def states(self):
        if self.kind == "local":
            return self.opt.states()
        return [self.opt.state.get(p) for p in self.params]

    def backward(self, rank, k):
        x, y = _batch(rank, k)
        self.opt.zero_grad()
        loss = nn.functional.mse_loss(self.model(x), y)
        loss.backward()
        return loss.detach()

    def take_grads(self, loss, base, base_loss):
        """The baseline's gradient values, after checking that the losses agree.

        Runs in lockstep drift apart by rounding; a gradient element that is a sum which
        cancels, recomputed from drifted parameters, would amplify that drift far beyond the
        optimizer's own rounding. So every run steps the baseline's gradients (as the
        conformance suite does), and the loss shows that each forward saw its own parameters.
        """
        _close(loss, base_loss, "loss (forward with the stepped parameters)")
        for name, p, q in zip(self.names, self.params, base.params, strict=True):
            if (p.grad is None) != (q.grad is None):
                raise AssertionError(f"{name}: grad is {p.grad}, the baseline's {q.grad}")
            if p.grad is not None:
                local = p.grad.to_local()
                local.copy_(q.grad.to_local())
                assert torch.equal(p.grad.to_local(), local)

    def step(self):
        if self.clip is not None:
            if self.kind == "roundpipe":
                norm = self.opt.clip_grad_norm_(self.clip)
            else:
                norm = torch.nn.utils.clip_grad_norm_(self.params, self.clip)
            self.norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            if not self.norm.item() > self.clip:
                raise AssertionError(f"the total norm {self.norm.item()} does not clip at {self.clip}")
        where = [(type(p), p.to_local().data_ptr()) for p in self.params]
        grads = [None if p.grad is None else p.grad.to_local().clone() for p in self.params]
        self.opt.step()
        for i, p in enumerate(self.params):
            if (type(p), p.to_local().data_ptr()) != where[i]:
                raise AssertionError(f"{self.names[i]}: the step replaced the parameter or its local shard")
            if grads[i] is not None and not torch.equal(p.grad.to_local(), grads[i]):
                raise AssertionError(f"{self.names[i]}: the step modified the gradient")

    def reload(self):
        """get_optimizer_state_dict, then a fresh model and optimizer loaded from the state
        dicts (set_model_state_dict, set_optimizer_state_dict) replace this run's."""
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        osd = _detached(get_optimizer_state_dict(self.model, self.opt))
        msd = _detached(get_model_state_dict(self.model))
        model = _build(1, self.offload)
        set_model_state_dict(model, msd)
        self._install(model)
        set_optimizer_state_dict(model, self.opt, osd)
        return osd

    def osd(self):
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.opt)


def _detached(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _detached(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_detached(v) for v in obj)
    return obj


# ---------------------------------------------------------------------------------------------
# comparisons (each raises AssertionError with the first mismatch)


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _close(a, b, what):
    torch.testing.assert_close(a, b, msg=lambda m: f"{what}: {m}", **TOL)


def _compare_params(run, base):
    for name, p, q in zip(run.names, run.params, base.params, strict=True):
        got, expected = _describe(run, p, p), _describe(base, q, q)
        if got != expected:
            raise AssertionError(f"parameter {name}: (type, placements, shape) {got}, expected {expected}")
        _close(p.to_local(), q.to_local(), f"parameter {name} (local shard)")


def _compare_full(run, full, full_base):
    for name, a, b in zip(run.names, full, full_base, strict=True):
        _close(a, b, f"parameter {name} (full tensor)")


def _describe(run, p, t):
    """(type, placements, shape) of a state tensor; a local-shard run's per-element entries
    count as what torch creates for a DTensor parameter (zeros_like / full_like: a DTensor
    like the parameter)."""
    from torch.distributed.tensor import DTensor

    if run.kind == "local" and t.dim() > 0:
        return (DTensor, tuple(p.placements), tuple(p.shape))
    return (type(t), tuple(getattr(t, "placements", ())), tuple(t.shape))


def _compare_state(run, base):
    ours, theirs = run.states(), base.states()
    for name, p, sa, sb in zip(run.names, run.params, ours, theirs, strict=True):
        if (sa is None) != (sb is None):
            raise AssertionError(
                f"state of {name}: {'absent' if sa is None else 'present'}, "
                f"torch's {'absent' if sb is None else 'present'}"
            )
        if sa is None:
            continue
        if sorted(sa) != sorted(sb):
            raise AssertionError(f"state of {name}: keys {sorted(sa)}, torch's {sorted(sb)}")
        for key in sa:
            va, vb = sa[key], sb[key]
            what = f"state[{name}][{key!r}]"
            if not isinstance(vb, torch.Tensor):
                if va != vb:
                    raise AssertionError(f"{what}: {va!r}, torch's {vb!r}")
                continue
            got, expected = _describe(run, p, va), _describe(base, p, vb)
            if got != expected:
                raise AssertionError(f"{what}: (type, placements, shape) {got}, expected {expected}")
            la, lb = _local(va), _local(vb)
            if la.dtype != lb.dtype or la.shape != lb.shape:
                raise AssertionError(
                    f"{what}: local {la.dtype} {tuple(la.shape)}, torch's {lb.dtype} {tuple(lb.shape)}"
                )
            _close(la, lb, f"{what} (local shard)")


def _compare_osd(a, b, path="get_optimizer_state_dict"):
    from torch.distributed.tensor import DTensor

    if isinstance(b, torch.Tensor):
        if not isinstance(a, torch.Tensor) or type(a) is not type(b):
            raise AssertionError(f"{path}: {type(a).__name__}, torch's {type(b).__name__}")
        if isinstance(b, DTensor) and (a.placements != b.placements or a.shape != b.shape):
            raise AssertionError(
                f"{path}: {a.placements} {tuple(a.shape)}, torch's {b.placements} {tuple(b.shape)}"
            )
        _close(_local(a), _local(b), path)
    elif isinstance(b, dict):
        if not isinstance(a, dict) or sorted(map(str, a)) != sorted(map(str, b)):
            raise AssertionError(f"{path}: keys {sorted(map(str, a))}, torch's {sorted(map(str, b))}")
        for k in b:
            _compare_osd(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(b, list | tuple):
        if not isinstance(a, list | tuple) or len(a) != len(b):
            raise AssertionError(f"{path}: {a!r}, torch's {b!r}")
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _compare_osd(x, y, f"{path}[{i}]")
    elif a != b:
        raise AssertionError(f"{path}: {a!r}, torch's {b!r}")


# ---------------------------------------------------------------------------------------------
# the two-process run (module-level functions: spawn pickles them by name)


def _message(e):
    if isinstance(e, AssertionError):
        return str(e).strip()
    frame = traceback.extract_tb(e.__traceback__)[-1]
    where = f"{os.path.basename(frame.filename)}:{frame.lineno}"
    return f"{type(e).__name__}: {str(e).strip()} (at {where})"


def _agree(runs, label):
    """Both ranks drop the runs that failed on either (the next collectives skip them)."""
    flags = torch.tensor([run.error is not None for run in runs], dtype=torch.int32)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    for run, flag in zip(runs, flags.tolist(), strict=True):
        if flag and run.error is None:
            run.error = f"{label}: failed on the other rank"


def _attempt(run, label, fn, *args):
    if run.error is not None:
        return None
    try:
        return fn(*args)
    except Exception as e:  # recorded: the test reports every failed combination
        run.error = f"{label}: {_message(e)}"
        return None


def _run_case(rank, label, name, kwargs, offload, substitute):
    """All backends of one (optimizer, offload) in lockstep with the baseline: {combo: error}."""
    base_kind = "local" if name == "Rprop" else "torch"
    kind = {None: "roundpipe", "torch": base_kind, "local": "local"}[substitute]
    clip = CLIPPED.get(label)
    if clip is not None and base_kind != "torch":
        raise ValueError(f"{label}: clipping is compared with torch.optim on DTensors only")
    base = _Run(None, base_kind, name, kwargs, offload, clip)
    runs = [_Run(b, kind, name, kwargs, offload, clip) for b in BACKENDS]
    everyone = [base, *runs]

    def compare(when, full=False):
        for r in runs:
            _attempt(r, when, _compare_params, r, base)
            _attempt(r, when, _compare_state, r, base)
        _agree(everyone, when)
        if full and base.error is None:  # every rank's shards compared, now the whole tensors
            gathered = {
                id(r): _attempt(r, when, lambda r=r: [p.full_tensor() for p in r.params]) for r in everyone
            }
            _agree(everyone, when)
            for r in runs:
                _attempt(r, when, _compare_full, r, gathered.get(id(r)), gathered.get(id(base)))
            _agree(everyone, when)

    for k in range(STEPS):
        when = f"step {k + 1}"
        losses = {id(r): _attempt(r, when, r.backward, rank, k) for r in everyone}
        for r in runs:
            _attempt(r, when, r.take_grads, losses[id(r)], base, losses[id(base)])
        for r in everyone:
            _attempt(r, when, r.step)
        _agree(everyone, when)
        if clip is not None and base.error is None:
            for r in runs:
                _attempt(r, when, _close, r.norm, base.norm, "clip_grad_norm_'s total norm")
        compare(when, full=k + 1 == STEPS)
        if k + 1 == RELOAD_AFTER and kind != "local":
            when = f"state dict round trip after step {k + 1}"
            theirs = base.osd() if base.kind == "torch" and base.error is None else None
            for r in runs:
                osd = _attempt(r, when, r.reload)
                if theirs is not None and osd is not None:
                    _attempt(r, when, _compare_osd, osd, theirs)
            _agree(everyone, when)
            compare(when)
    out = {}
    for r in runs:
        error = r.error
        if base.error is not None:
            error = f"the baseline (torch.optim.{name}, {base.kind}) failed: {base.error}"
        out[_combo_id(label, r.backend, offload)] = error
    return out


# a DTensor parameter whose gradient or state is not its like: (label, how to break params[0])
REFUSALS = [
    ("plain full-size state entry", "state"),  # e.g. loaded from an unsharded checkpoint
    ("plain full-size gradient", "grad"),
    ("Replicate gradient of a Shard parameter", "replicate"),
    ("Partial gradient", "partial"),
]


def _break(opt, p, how):
    from torch.distributed.tensor import DTensor, Partial, Replicate

    if how == "state":
        st = opt.state[p]
        st["exp_avg_sq"] = st["exp_avg_sq"].full_tensor()
    elif how == "grad":
        p.grad = p.grad.full_tensor()
    elif how == "replicate":
        p.grad = p.grad.redistribute(placements=[Replicate()])
    else:
        p.grad = DTensor.from_local(
            torch.zeros(p.shape),
            p.device_mesh,
            [Partial()],
            run_check=False,
            shape=p.shape,
            stride=p.stride(),
        )


def _snapshot(opt, params):
    state = {
        i: {k: (v, _local(v).clone()) for k, v in opt.state.get(p, {}).items()} for i, p in enumerate(params)
    }
    return [
        (_local(p).clone(), p.grad, None if p.grad is None else _local(p.grad).clone()) for p in params
    ], state


def _changed(opt, params, snap):
    tensors, state = snap
    for i, (p, (value, grad, grad_value)) in enumerate(zip(params, tensors, strict=True)):
        if not torch.equal(_local(p), value):
            return f"parameter {i} was modified"
        if p.grad is not grad or (grad is not None and not torch.equal(_local(grad), grad_value)):
            return f"the gradient of parameter {i} was replaced or modified"
        now = opt.state.get(p, {})
        if sorted(now) != sorted(state[i]):
            return f"the state keys of parameter {i} changed: {sorted(state[i])} -> {sorted(now)}"
        for k, (obj, val) in state[i].items():
            if now[k] is not obj or not torch.equal(_local(now[k]), val):
                return f"state[{i}][{k!r}] was replaced or modified"
    return None


def _refusal_case(rank, how, backend):
    """After a good step, params[0] gets a gradient or state entry that is not like it (a
    DTensor of its placements): the step must raise an error naming the parameter
    (``param_groups[g]['params'][i]``) before anything is modified. torch.optim fails on
    these too (mixed Tensor and DTensor), or redistributes the gradient (Replicate)."""
    model = _build(0, False)
    params = list(model.parameters())
    opt = rp_class("Adam")(params, backend=backend, **RICH_KWARGS["Adam"])
    x, y = _batch(rank, 0)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    _break(opt, params[0], how)  # collectives (full_tensor, redistribute): on both ranks alike
    snap = _snapshot(opt, params)
    try:
        opt.step()
    except Exception as e:
        problem = _changed(opt, params, snap)
        if problem is not None:
            return f"the failed step left a change behind: {problem} ({_message(e)})"
        if "param_groups[" not in str(e):
            return f"the error does not name the parameter: {_message(e)}"
        return None
    return "stepped without an error"


def _worker(rank, port, out_dir, substitute):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE, timeout=GLOO_TIMEOUT)
    try:
        results, seconds = {}, {}
        for offload in OFFLOAD:
            for label, name, kwargs in CASES:
                start = time.perf_counter()
                results.update(_run_case(rank, label, name, kwargs, offload, substitute))
                seconds[(label, offload)] = time.perf_counter() - start
        refusals = {}
        if substitute is None:
            for label, how in REFUSALS:
                for backend in BACKENDS:
                    try:
                        refusals[f"{label} / {backend}"] = _refusal_case(rank, how, backend)
                    except Exception as e:
                        refusals[f"{label} / {backend}"] = f"the case itself failed: {_message(e)}"
        out = {"results": results, "refusals": refusals, "seconds": seconds}
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        dist.destroy_process_group()
        raise
    shutdown_process_group()  # not a bare destroy: docs/distributed.md, "Ending a rank"


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_processes(out_dir, substitute=None):
    """Spawn the two ranks, wait (at most SPAWN_TIMEOUT s), return each rank's results."""
    saved = {k: os.environ.get(k) for k in ENV}
    for k, v in ENV.items():  # inherited by the children, read by torch and numba on import
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        ctx = tmp.start_processes(
            _worker,
            args=(_free_port(), str(out_dir), substitute),
            nprocs=WORLD_SIZE,
            join=False,
            start_method="spawn",
        )
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    deadline = time.monotonic() + SPAWN_TIMEOUT
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {WORLD_SIZE}-process FSDP2 run did not finish in {SPAWN_TIMEOUT} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(WORLD_SIZE)]


def _skip_where_torch_cannot(lines):
    """torch 2.6's FSDP2 does not run on the CPU (``Stream.record_event``), for torch's own
    optimizers too: nothing to compare with there (docs/torch-versions.md)."""
    if lines and all("record_event" in line for line in lines):
        pytest.skip(f"torch {torch.__version__}'s FSDP2 does not run on CPU: {lines[0][:200]}")


def failures(ranks, key="results"):
    """One line per failed combination: the ranks it failed on and the first error seen."""
    lines = []
    for combo in ranks[0][key]:
        errors = [(r, res[key][combo]) for r, res in enumerate(ranks) if res[key][combo]]
        if errors:
            own = [e for _, e in errors if not e.endswith("failed on the other rank")]
            shown = " ".join((own or [errors[0][1]])[0].split())
            lines.append(f"{combo}: [rank {','.join(str(r) for r, _ in errors)}] {shown[:500]}")
    return lines


# ---------------------------------------------------------------------------------------------
# the test


@pytest.fixture(scope="module")
def fsdp_ranks(tmp_path_factory):
    try:
        return run_two_processes(tmp_path_factory.mktemp("fsdp"))
    except TimeoutError as e:
        pytest.fail(str(e))


def test_fsdp2_every_optimizer_and_backend_matches_torch(fsdp_ranks):
    expected = {_combo_id(label, b, o) for label, _, _ in CASES for b in BACKENDS for o in OFFLOAD}
    for res in fsdp_ranks:
        assert set(res["results"]) == expected
    lines = failures(fsdp_ranks)
    _skip_where_torch_cannot(lines)
    if lines:
        pytest.fail(
            f"{len(lines)} of {len(expected)} combinations failed:\n" + "\n".join(lines), pytrace=False
        )


def test_fsdp2_malformed_gradient_or_state_refused_before_anything_changes(fsdp_ranks):
    expected = {f"{label} / {b}" for label, _ in REFUSALS for b in BACKENDS}
    for res in fsdp_ranks:
        assert set(res["refusals"]) == expected
    lines = failures(fsdp_ranks, "refusals")
    _skip_where_torch_cannot(lines)
    if lines:
        pytest.fail(f"{len(lines)} of {len(expected)} cases failed:\n" + "\n".join(lines), pytrace=False)


if __name__ == "__main__":
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--substitute", choices=["torch", "local"], default=None)
    args = parser.parse_args()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        ranks = run_two_processes(out, args.substitute)
    wall = time.perf_counter() - start
    lines = failures(ranks) + failures(ranks, "refusals")
    print("\n".join(lines) or "no failures")
    slowest = sorted(ranks[0]["seconds"].items(), key=lambda kv: -kv[1])[:5]
    print(f"{len(ranks[0]['results'])} combinations, {len(lines)} failed; wall {wall:.1f} s; slowest cases:")
    for (label, offload), s in slowest:
        print(f"  {label} {'offload' if offload else ''}: {s:.2f} s")
    sys.exit(1 if lines else 0)
