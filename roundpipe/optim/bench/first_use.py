"""``--first-use``: what a user waits for once, each measured in fresh subprocesses.

* import: ``import roundpipe.optim`` after ``import torch`` (its own cost, torch's excluded),
  the median of ``IMPORT_RUNS`` interpreters;
* cold first step: the first ``AdamW.step()`` (default backend, the environment's backend and
  engine settings removed) of the demo's model (``roundpipe.demo.build_model``, seeded random
  gradients) in a new interpreter whose kernel cache (``ROUNDPIPE_CACHE_DIR``) is a new, empty
  temporary directory: numba's import, code generation and compilation included;
* warm first step: the same in another new interpreter, with the cache the cold one filled;
* normal step: that interpreter's third step (state and kernels in place): the warm first step
  minus it is what the first step costs beyond any step;
* torch fused's first step beyond its normal step, in the warm interpreter on copies of the
  parameters: the part of that cost any optimizer's first step pays (allocating the state).

Where scipy is installed, numba imports ``scipy.linalg`` at its first use, which the first step
pays (docs/benchmarks.md, "First use"); the report says when the measured process did.

Goals: ``GOALS``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

IMPORT_RUNS = 3
STEPS = 3  # per child: the first, the second, the third (a normal step)
# figure -> (goal in seconds, what it is)
GOALS = {
    "import_s": (0.5, "import roundpipe.optim beyond import torch"),
    "cold_first_step_s": (2.0, "first step, empty kernel cache (cold)"),
    "warm_first_step_beyond_normal_s": (0.3, "first step, filled kernel cache (warm), beyond a normal step"),
}

_IMPORT = """\
import json, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import roundpipe.optim
t2 = time.perf_counter()
print(json.dumps({"torch_s": t1 - t0, "roundpipe_s": t2 - t1}))
"""

_STEP = """\
import json, sys, time
size, steps = sys.argv[1], int(sys.argv[2])
import torch
import roundpipe.optim as rp_optim
from roundpipe.demo import HYPER, build_model
from roundpipe.optim.bench.engine import FallbackWatch, fast_engine

model = build_model(size)
params = list(model.parameters())
g = torch.Generator().manual_seed(1)
for p in params:
    p.grad = torch.randn(p.shape, generator=g).mul_(0.01)
opt = rp_optim.AdamW(params, **HYPER)
times = []
with FallbackWatch() as watch:
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
engine = fast_engine(watch.messages)
# torch fused AdamW on copies, after roundpipe's steps: what any first step pays (its state)
copies = [p.detach().clone().requires_grad_(True) for p in params]
for c, p in zip(copies, params):
    c.grad = p.grad.clone()
ref = torch.optim.AdamW(copies, **HYPER, fused=True)
torch_times = []
for _ in range(steps):
    t0 = time.perf_counter()
    ref.step()
    torch_times.append(time.perf_counter() - t0)
scipy = "scipy.linalg" in sys.modules  # numba imported it at its first use (where installed)
print(json.dumps({
    "steps_s": times,
    "torch_fused_steps_s": torch_times,
    "scipy": scipy,
    "backend": opt.backend,
    "engine": engine,
    "numel": sum(p.numel() for p in params),
    "tensors": len(params),
}))
"""


def _env(cache_dir: str | None = None) -> dict:
    """This process's environment without roundpipe's backend and engine choices (the default
    backend is measured), with ``ROUNDPIPE_CACHE_DIR`` set if given."""
    drop = ("ROUNDPIPE_OPTIM_BACKEND", "ROUNDPIPE_OPTIM_ENGINE", "ROUNDPIPE_CACHE_DIR")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    if cache_dir is not None:
        env["ROUNDPIPE_CACHE_DIR"] = cache_dir
    return env


def _child(code: str, args=(), env=None, timeout: float = 600) -> dict:
    """Run ``code`` in a new interpreter; its last line of output, as JSON."""
    done = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    if done.returncode != 0 or not done.stdout.strip():
        raise RuntimeError(
            f"a --first-use subprocess failed (exit status {done.returncode}):\n{done.stderr[-3000:]}"
        )
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(model: str = "default", log=lambda msg: None) -> dict:
    """Every figure (seconds), with its samples, the goals and whether each is met."""
    imports = []
    for k in range(IMPORT_RUNS):
        log(f"first use: import {k + 1}/{IMPORT_RUNS} ...")
        imports.append(_child(_IMPORT, env=_env()))
    with tempfile.TemporaryDirectory(prefix="roundpipe-first-use-") as cache:
        log(f"first use: cold first step (ROUNDPIPE_CACHE_DIR={cache}, empty) ...")
        cold = _child(_STEP, (model, STEPS), env=_env(cache))
        log("first use: warm first step (the same cache, a new process) ...")
        warm = _child(_STEP, (model, STEPS), env=_env(cache))
    normal = warm["steps_s"][-1]
    torch_steps = warm["torch_fused_steps_s"]
    figures = {
        "import_s": statistics.median(r["roundpipe_s"] for r in imports),
        "cold_first_step_s": cold["steps_s"][0],
        "warm_first_step_s": warm["steps_s"][0],
        "normal_step_s": normal,
        "warm_first_step_beyond_normal_s": warm["steps_s"][0] - normal,
        "torch_fused_first_step_beyond_normal_s": torch_steps[0] - torch_steps[-1],
    }
    return {
        **figures,
        "import_samples_s": [r["roundpipe_s"] for r in imports],
        "import_torch_samples_s": [r["torch_s"] for r in imports],
        "cold_steps_s": cold["steps_s"],
        "warm_steps_s": warm["steps_s"],
        "torch_fused_steps_s": torch_steps,
        "scipy": warm["scipy"],
        "model": model,
        "numel": cold["numel"],
        "tensors": cold["tensors"],
        "backend": cold["backend"],
        "engine": {"cold": cold["engine"], "warm": warm["engine"]},
        "goals_s": {k: goal for k, (goal, _) in GOALS.items()},
        "meets_goals": {k: figures[k] <= goal for k, (goal, _) in GOALS.items()},
    }


def format_report(res: dict) -> str:
    def goal(key):
        limit = res["goals_s"][key]
        return f"goal <= {limit:g} s: {'met' if res['meets_goals'][key] else 'MISSED'}"

    torch_s = statistics.median(res["import_torch_samples_s"])
    samples = ", ".join(f"{t:.3f}" for t in res["import_samples_s"])
    cold, warm = res["cold_steps_s"], res["warm_steps_s"]
    rows = [
        (
            "import roundpipe.optim beyond import torch",
            res["import_s"],
            f"median of {len(res['import_samples_s'])} processes ({samples} s; import torch "
            f"{torch_s:.2f} s); {goal('import_s')}",
        ),
        (
            "first step, cold kernel cache",
            res["cold_first_step_s"],
            f"then {', '.join(f'{t:.3f}' for t in cold[1:])} s; {goal('cold_first_step_s')}",
        ),
        (
            "first step, warm kernel cache",
            res["warm_first_step_s"],
            f"a new process, the cache the cold one filled; then {', '.join(f'{t:.3f}' for t in warm[1:])} s",
        ),
        ("normal step (the warm process's third)", res["normal_step_s"], ""),
        (
            "warm first step - normal step",
            res["warm_first_step_beyond_normal_s"],
            goal("warm_first_step_beyond_normal_s"),
        ),
        (
            "torch fused: first step - normal step",
            res["torch_fused_first_step_beyond_normal_s"],
            "the same process, on copies: the state's allocation, which any first step pays",
        ),
    ]
    width = max(len(r[0]) for r in rows)
    engines = res["engine"]["cold"]["text"]
    if res["engine"]["warm"]["text"] != engines:
        engines += f" (warm: {res['engine']['warm']['text']})"
    out = [
        f"roundpipe.optim first use, each in fresh subprocesses: AdamW(backend {res['backend']!r}) on "
        f"the demo's {res['model']} model ({res['numel']:,} parameters in {res['tensors']} tensors); "
        f"{engines}",
        *(f"{name.ljust(width)} | {value:7.3f} s | {note}".rstrip(" |") for name, value, note in rows),
    ]
    if res["scipy"]:
        out.append(
            "(scipy is installed: numba imported scipy.linalg at its first use, part of the first "
            "steps' time; neither roundpipe, numba nor torch depends on scipy)"
        )
    return "\n".join(out)
