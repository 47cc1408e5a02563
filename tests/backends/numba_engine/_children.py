"""Child processes for the tests that need a fresh process: each trains one problem on
roundpipe and reports a digest of the results and what its kernels' dispatchers compiled."""

import json
import os
import subprocess
import sys
import textwrap

from tests._util import torch_class

# One problem for the subprocess tests below, run by the children on roundpipe and by the
# parent on torch.optim's for-loop: ``train`` returns a digest of the parameters' and every
# state tensor's bytes after three steps.
PROBLEM = textwrap.dedent(
    """
    import hashlib
    import torch

    def problem(n_large):
        g = torch.Generator().manual_seed(7)
        shapes = [(100,), (33, 31), (n_large,)]
        params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
        grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(3)]
        return params, grads

    def train(opt, params, grads):
        for step_grads in grads:
            for p, gr in zip(params, step_grads):
                p.grad = gr.clone()
            opt.step()
        h = hashlib.sha256()
        for p in params:
            h.update(p.detach().numpy().tobytes())
            for k in sorted(opt.state[p]):
                h.update(k.encode())
                h.update(opt.state[p][k].detach().reshape(-1).numpy().tobytes())
        return h.hexdigest()
    """
)

# argv: optimizer, backend, size of the large parameter, and a directory: when given, the child
# announces itself there (ready-<pid>) and waits for the file "go" before it steps.
CHILD_SCRIPT = PROBLEM + textwrap.dedent(
    """
    import json, os, sys, time
    import numba
    import roundpipe.optim
    from roundpipe.optim import backends
    from roundpipe.optim.backends.numba_engine import kernels

    name, backend, n_large, meet = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    if meet:
        open(os.path.join(meet, f"ready-{os.getpid()}"), "w").close()
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(meet, "go")):
            if time.monotonic() > deadline:
                sys.exit("the barrier never opened")
            time.sleep(0.002)
    params, grads = problem(n_large)
    opt = getattr(roundpipe.optim, name)(params, lr=0.01, weight_decay=0.1, backend=backend)
    digest = train(opt, params, grads)
    compiled = kernels._kernels.values()
    # read before numba.get_num_threads(), which starts numba's OpenMP pool if no step did:
    # that sets the OpenMP thread count, torch's too
    roundpipe_threads, torch_threads = roundpipe.optim.get_num_threads(), torch.get_num_threads()
    print(json.dumps({
        "digest": digest,
        "hits": sum(sum(d.stats.cache_hits.values()) for k in compiled for d in k.dispatchers),
        "misses": sum(sum(d.stats.cache_misses.values()) for k in compiled for d in k.dispatchers),
        "on_disk": [k.cached_on_disk for k in compiled],
        "parallel": any(k.parallel.signatures for k in compiled),
        "numba_threads": numba.get_num_threads(),
        "numba_max": numba.config.NUMBA_NUM_THREADS,
        "roundpipe_threads": roundpipe_threads,
        "torch_threads": torch_threads,
        "engine": backends.get(opt.backend).engine(),
    }))
    """
)
# a hang detector, not a timing assertion
CHILD_TIMEOUT = 300


def torch_digest(name, n_large):
    ns = {}
    exec(PROBLEM, ns)
    params, grads = ns["problem"](n_large)
    return ns["train"](torch_class(name)(params, lr=0.01, weight_decay=0.1, foreach=False), params, grads)


def child_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROUNDPIPE_OPTIM_")}
    env.update(extra)
    return env


def start_child(env, name, backend, n_large, meet=""):
    return subprocess.Popen(
        [sys.executable, "-c", CHILD_SCRIPT, name, backend, str(n_large), str(meet)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(child, what):
    try:
        out, err = child.communicate(timeout=CHILD_TIMEOUT)
    except subprocess.TimeoutExpired:
        child.kill()
        out, err = child.communicate()
        raise AssertionError(f"{what}: still running after {CHILD_TIMEOUT} s (a hang?)\n{err}") from None
    assert child.returncode == 0, f"{what}: exit status {child.returncode}\n{err}"
    return json.loads(out.strip().splitlines()[-1])
