"""bitsandbytes' per-parameter config (``GlobalOptimManager``) against bitsandbytes 0.50's CPU step:
the overrides HF Trainer registers for ``optim="adamw_bnb_8bit"`` (every ``nn.Embedding``'s
weight in 32-bit state) on a small model, stepped beside ``bitsandbytes.optim.AdamW(optim_bits=8)``
(what that option runs) and a checkpoint resumed either way; hyperparameter overrides of every
8-bit class, changed mid-run; the errors. Parameters and every state entry are compared bit for
bit after every step. Each test runs with the overrides in bitsandbytes' manager and in
roundpipe's (``roundpipe.optim.GlobalOptimManager``); bitsandbytes' optimizer always reads its own.

No transformers: the test registers the overrides as ``Trainer.create_optimizer`` does (after
constructing the optimizer, before its first step), with its two param groups (weight decay on
all but biases and LayerNorm weights).
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import roundpipe.optim as ro
from roundpipe.optim.spec import EIGHTBIT_SPECS

from .test_eightbit import compare, make, same

pytestmark = pytest.mark.filterwarnings("ignore:Paged optimizers are not supported on CPU")

try:  # the ground truth (the test extra), as test_eightbit.py
    import bitsandbytes as bnb
except Exception as err:  # noqa: BLE001
    pytest.skip(f"bitsandbytes cannot be imported: {err}", allow_module_level=True)

MANAGERS = ("bitsandbytes", "roundpipe")
VOCAB, WIDTH, CONTEXT = 320, 48, 12  # the token embedding (15,360 elements) would be 8-bit


@pytest.fixture(autouse=True)
def _fresh_managers():
    """Both managers empty before and after each test (they are per process)."""
    for manager in (bnb.optim.GlobalOptimManager.get_instance(), ro.GlobalOptimManager.get_instance()):
        manager.initialize()
    yield
    for manager in (bnb.optim.GlobalOptimManager.get_instance(), ro.GlobalOptimManager.get_instance()):
        manager.initialize()


def manager_of(kind: str):
    return (bnb.optim if kind == "bitsandbytes" else ro).GlobalOptimManager.get_instance()


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(CONTEXT, WIDTH)
        self.ln = nn.LayerNorm(WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos.weight[: idx.shape[1]]
        return self.head(x + self.down(F.gelu(self.up(self.ln(x)))))


def trainer_groups(model, weight_decay=0.01):
    """``Trainer.create_optimizer``'s two groups: no decay for biases and LayerNorm weights."""
    decay = [p for n, p in model.named_parameters() if not (n.endswith("bias") or n.startswith("ln."))]
    rest = [p for n, p in model.named_parameters() if n.endswith("bias") or n.startswith("ln.")]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def register_embeddings(manager, model):
    """What Trainer does for ``optim="adamw_bnb_8bit"`` (its ``create_optimizer``)."""
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            manager.register_module_override(module, "weight", {"optim_bits": 32})


HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8)  # TrainingArguments' adam_* and a learning rate


def theirs_for(model):
    """``optim="adamw_bnb_8bit"``: bitsandbytes' ``AdamW`` with ``optim_bits=8``."""
    opt = bnb.optim.AdamW(trainer_groups(model), **HYPER, optim_bits=8, is_paged=False)
    register_embeddings(bnb.optim.GlobalOptimManager.get_instance(), model)
    return opt


def ours_for(model, kind):
    """roundpipe's run of it: ``optimizer_cls_and_kwargs=(AdamW8bit, HYPER)``, the overrides in
    manager ``kind``."""
    opt = ro.AdamW8bit(trainer_groups(model), **HYPER)
    register_embeddings(manager_of(kind), model)
    return opt


def train_step(models, opts, gen):
    """Forward and backward on the first model; every model gets its gradients; ours step first
    (so that bitsandbytes' first step cannot lend its overrides to ours by position)."""
    idx = torch.randint(0, VOCAB, (4, CONTEXT + 1), generator=gen)
    for m in models:
        m.zero_grad()
    F.cross_entropy(models[0](idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten()).backward()
    for m in models[1:]:
        for p, q in zip(m.parameters(), models[0].parameters(), strict=True):
            p.grad = q.grad.clone()
    for opt in opts:
        opt.step()


def params_of(model):
    return list(model.parameters())


def checkpoint(opt):
    """``opt.state_dict()`` through ``torch.save`` and ``torch.load`` (as a Trainer checkpoint)."""
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("kind", MANAGERS)
def test_trainer_overrides_as_bitsandbytes_and_a_checkpoint_resumed_either_way(kind):
    torch.manual_seed(0)
    theirs_model = TinyLM()
    ours_model = copy.deepcopy(theirs_model)
    theirs, ours = theirs_for(theirs_model), ours_for(ours_model, kind)
    gen = torch.Generator().manual_seed(1)
    models, opts = [theirs_model, ours_model], [ours, theirs]
    for step in range(4):
        train_step(models, opts, gen)
        compare(ours, theirs, params_of(ours_model), params_of(theirs_model), f"{kind}, step {step + 1}")
    for model, opt in ((ours_model, ours), (theirs_model, theirs)):
        assert opt.state[model.tok.weight]["state1"].dtype == torch.float32, "the embedding in 32 bits"
        assert opt.state[model.head.weight]["state1"].dtype == torch.uint8, "the rest in 8 bits"
    # resumed as a Trainer resumes: a new optimizer, the overrides, then the checkpoint
    theirs_copy, ours_copy = copy.deepcopy(ours_model), copy.deepcopy(theirs_model)
    theirs_loaded, ours_loaded = theirs_for(theirs_copy), ours_for(ours_copy, kind)
    theirs_loaded.load_state_dict(checkpoint(ours))
    ours_loaded.load_state_dict(checkpoint(theirs))
    models = [theirs_model, ours_model, theirs_copy, ours_copy]
    for step in range(4, 8):
        train_step(models, [ours, ours_loaded, theirs, theirs_loaded], gen)
        where = f"{kind}, step {step + 1}"
        compare(ours, theirs, params_of(ours_model), params_of(theirs_model), where)
        compare(ours_loaded, theirs, params_of(ours_copy), params_of(theirs_model), f"{where} (bnb -> ours)")
        compare(ours, theirs_loaded, params_of(ours_model), params_of(theirs_copy), f"{where} (ours -> bnb)")


def test_without_the_overrides_the_embedding_is_8_bit():
    """The control: the same run with no override keeps the embedding in 8 bits (both)."""
    torch.manual_seed(0)
    model = TinyLM()
    ours = ro.AdamW8bit(trainer_groups(model), **HYPER)
    theirs_model = copy.deepcopy(model)
    theirs = bnb.optim.AdamW(trainer_groups(theirs_model), **HYPER, optim_bits=8, is_paged=False)
    train_step([theirs_model, model], [ours, theirs], torch.Generator().manual_seed(1))
    assert ours.state[model.tok.weight]["state1"].dtype == torch.uint8
    compare(ours, theirs, params_of(model), params_of(theirs_model), "no overrides")


# hyperparameter overrides: per class, which parameter gets what, at the start and before step 4
# (p0 has 32-bit state, p1 and p2 8-bit ones; p2 is moved to 32 bits by its config)
SHAPES = [(300,), (5000,), (64, 80)]
START = {
    "p0": {"lr": 3e-2, "weight_decay": 0.2},
    "p1": {"betas": (0.8, 0.95), "eps": 1e-5, "weight_decay": 0.05},
    "p2": {"optim_bits": 32, "lr": 2e-3, "skip_zeros": True},
}
RULE_OVERRIDES = {  # the keys only some rules read
    "SGD8bit": {"p1": {"betas": (0.5, 0.0), "weight_decay": 0.05}},
    "AdEMAMix8bit": {"p1": {"betas": (0.8, 0.95, 0.99), "alpha": 2.0, "t_alpha": 6, "t_beta3": 5}},
}
LATER = {"p1": ("lr", 4e-3), "p0": ("weight_decay", 0.0)}
NAMES = [n for n in EIGHTBIT_SPECS if not n.startswith("Paged")] + ["PagedAdEMAMix8bit"]


def lockstep(ours, ours_params, theirs, their_params, steps, gen, where, before=None):
    """``steps`` steps of both on the same gradients, compared after each; ``before(step)`` first."""
    for step in range(steps):
        if before is not None:
            before(step)
        for p, q in zip(ours_params, their_params, strict=True):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        ours.step()
        theirs.step()
        compare(ours, theirs, ours_params, their_params, f"{where}, step {step + 1}")


def _register(manager, params, overrides):
    for key, config in overrides.items():
        manager.override_config(params[int(key[1:])], key_value_dict=dict(config))


@pytest.mark.parametrize("kind", MANAGERS)
@pytest.mark.parametrize("name", NAMES)
def test_hyperparameter_overrides_as_bitsandbytes(name, kind):
    kwargs = dict(EIGHTBIT_SPECS[name].rich_kwargs)
    gen = torch.Generator().manual_seed(2)
    start = [torch.randn(s, generator=gen) for s in SHAPES]
    ours_params, their_params = ([t.clone().requires_grad_() for t in start] for _ in range(2))
    ours, theirs = make(name, ours_params, kwargs, "fast"), make(name, their_params, kwargs)
    overrides = {**START, **RULE_OVERRIDES.get(name.removeprefix("Paged"), {})}
    _register(manager_of(kind), ours_params, overrides)
    _register(bnb.optim.GlobalOptimManager.get_instance(), their_params, overrides)

    def later(step):
        if step == 3:
            for key, (k, v) in LATER.items():
                manager_of(kind).override_config(ours_params[int(key[1:])], k, v)
                bnb.optim.GlobalOptimManager.get_instance().override_config(their_params[int(key[1:])], k, v)

    lockstep(ours, ours_params, theirs, their_params, 8, gen, f"{name} ({kind})", later)
    assert ours.state[ours_params[2]]["state1"].dtype == torch.float32
    assert ours.state[ours_params[1]]["state1"].dtype == torch.uint8


def test_a_module_override_after_the_first_step_is_not_taken_up():
    """bitsandbytes takes module overrides up at an optimizer's first step only: registered
    later, a parameter's new state is 8-bit in both."""
    torch.manual_seed(3)
    ours_layers, their_layers = nn.Linear(100, 50), nn.Linear(100, 50)
    their_layers.load_state_dict(ours_layers.state_dict())
    ours = ro.AdamW8bit(ours_layers.parameters())
    theirs = bnb.optim.AdamW8bit(their_layers.parameters())
    for step in range(3):
        for p, q in zip(ours_layers.parameters(), their_layers.parameters(), strict=True):
            p.grad = None if (step == 0 and p.dim() == 2) else torch.randn(p.shape)
            q.grad = None if p.grad is None else p.grad.clone()
        ours.step()
        theirs.step()
        if step == 0:
            for kind, layers in (("roundpipe", ours_layers), ("bitsandbytes", their_layers)):
                manager_of(kind).register_module_override(layers, "weight", {"optim_bits": 32})
        compare(ours, theirs, list(ours_layers.parameters()), list(their_layers.parameters()), f"step {step}")
    assert ours.state[ours_layers.weight]["state1"].dtype == torch.uint8


@pytest.mark.parametrize("kind", MANAGERS)
def test_unsupported_bits_raise_as_bitsandbytes_before_anything_moves(kind):
    p, q = torch.randn(5000, requires_grad=True), torch.randn(5000, requires_grad=True)
    manager_of(kind).override_config(p, "optim_bits", 16)
    bnb.optim.GlobalOptimManager.get_instance().override_config(q, "optim_bits", 16)
    ours, theirs = ro.AdamW8bit([p]), bnb.optim.AdamW8bit([q])
    p.grad, q.grad = torch.randn(5000), torch.randn(5000)
    before = p.detach().clone()
    with pytest.raises(NotImplementedError) as mine:
        ours.step()
    with pytest.raises(NotImplementedError) as ground_truth:
        theirs.step()
    assert str(mine.value) == str(ground_truth.value) == "Amount of optimizer bits not supported: 16"
    assert not ours.state and same(p.detach(), before)


@pytest.mark.parametrize("kind", MANAGERS)
def test_max_unorm_is_refused_before_anything_moves(kind):
    p = torch.randn(5000, requires_grad=True)
    manager_of(kind).override_config(p, "max_unorm", 0.5)
    opt = ro.Lion8bit([p])
    p.grad = torch.randn(5000)
    before = p.detach().clone()
    with pytest.raises(NotImplementedError, match="max_unorm=0.5"):
        opt.step()
    assert not opt.state and same(p.detach(), before)


@pytest.mark.parametrize("kind", MANAGERS)
def test_overrides_registered_by_position_reach_other_parameters_there(kind):
    """``override_config`` on some parameters, then ``register_parameters`` of them: bitsandbytes'
    optimizers then read the config by position too, for whatever parameter stands there (its
    recipe for parameters replaced after registering, as when a model moves to another device)."""
    gen = torch.Generator().manual_seed(4)
    start = [torch.randn(s, generator=gen) for s in SHAPES]
    sides, alive = [], []
    for side in ("roundpipe", "bitsandbytes"):
        manager = manager_of(kind if side == "roundpipe" else "bitsandbytes")
        registered = [t.clone().requires_grad_() for t in start]
        # kept alive to the end: the managers key overrides by id(), and a freed tensor's id
        # can come back as a stepped parameter's, which would then take the override too
        alive.append(registered)
        manager.override_config(registered[1], key_value_dict={"optim_bits": 32, "lr": 5e-3})
        manager.register_parameters(registered)
        stepped = [t.clone().requires_grad_() for t in start]  # other tensors at the same positions
        sides.append((stepped, make("AdamW8bit", stepped, {}, "fast" if side == "roundpipe" else None)))
    (ours_params, ours), (their_params, theirs) = sides
    lockstep(ours, ours_params, theirs, their_params, 4, gen, kind)
    assert ours.state[ours_params[1]]["state1"].dtype == torch.float32
