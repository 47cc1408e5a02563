"""Hugging Face's ``Trainer`` with ``optim="adamw_torch_fused"`` (torch's fused AdamW, what HF
Trainer runs by default on torch >= 2.8) against the same Trainer building
``roundpipe.optim.AdamW(fused=True)`` from ``optimizer_cls_and_kwargs``, with the kwargs Trainer
gives torch's: parameters and optimizer state bit for bit, on a float32 and a pure bfloat16
model, Trainer's clipping, weight-decay groups and linear schedule included; and a checkpoint
of either resumed by the other. transformers and accelerate are imported inside the tests (a
test dependency: the suite's other modules collect without them)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import roundpipe.optim as ro

STEPS = 6


class _Data(torch.utils.data.Dataset):
    def __init__(self, n=48, d=33):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, d, generator=g), torch.randn(n, 7, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


class _Model(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        torch.manual_seed(1)
        self.net = nn.Sequential(nn.Linear(33, 65), nn.LayerNorm(65), nn.GELU(), nn.Linear(65, 7)).to(dtype)

    def forward(self, x, labels=None):
        out = self.net(x.to(self.net[0].weight.dtype))
        return {"loss": (out.float() - labels).square().mean(), "logits": out}


def _trainer(tmp_path, dtype, ours, max_steps, save=False):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        optim="adamw_torch_fused",
        learning_rate=1e-2,
        weight_decay=0.1,
        warmup_steps=1,
        max_steps=max_steps,
        per_device_train_batch_size=8,
        use_cpu=True,
        report_to=[],
        save_strategy="steps" if save else "no",
        save_steps=STEPS // 2,
        logging_strategy="no",
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    model = _Model(dtype)
    extra = {}
    if ours:  # the class swapped, Trainer's own kwargs for torch's fused AdamW kept
        cls, kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(args, model)
        assert cls is torch.optim.AdamW and kwargs["fused"] is True
        extra["optimizer_cls_and_kwargs"] = (ro.AdamW, kwargs)
    return transformers.Trainer(model=model, args=args, train_dataset=_Data(), **extra)


def _snapshot(trainer):
    opt = trainer.optimizer
    opt = getattr(opt, "optimizer", opt)  # (accelerate's wrapper)
    params = [p.detach().clone() for p in trainer.model.parameters()]
    state = [{k: v.clone() for k, v in opt.state[p].items()} for p in trainer.model.parameters()]
    return type(opt), params, state


def _same(a, b, what):
    assert len(a[1]) == len(b[1])
    for i, (p, q) in enumerate(zip(a[1], b[1], strict=True)):
        assert p.dtype == q.dtype and torch.equal(
            p.view(-1).view(torch.uint8), q.view(-1).view(torch.uint8)
        ), f"{what}: parameter {i}"
    for i, (s, t) in enumerate(zip(a[2], b[2], strict=True)):
        assert s.keys() == t.keys(), f"{what}: state keys of parameter {i}"
        for k in s:
            assert torch.equal(s[k].reshape(-1).view(torch.uint8), t[k].reshape(-1).view(torch.uint8)), (
                f"{what}: state {k!r} of parameter {i}"
            )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_trainer_fused_adamw_is_torchs_bit_for_bit(tmp_path, dtype):
    runs = {}
    for ours in (False, True):
        trainer = _trainer(tmp_path / str(ours), dtype, ours, STEPS)
        trainer.train()
        runs[ours] = _snapshot(trainer)
    assert runs[True][0] is ro.AdamW and runs[False][0] is torch.optim.AdamW
    _same(runs[True], runs[False], f"{dtype} after {STEPS} steps")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_trainer_checkpoint_resumes_either_way(tmp_path, dtype):
    """Half the steps with one optimizer, saved by Trainer (optimizer.pt: its state_dict), the
    rest resumed with the other: torch's uninterrupted run, bit for bit."""
    whole = _trainer(tmp_path / "whole", dtype, False, STEPS)
    whole.train()
    want = _snapshot(whole)
    for first in (False, True):
        out = tmp_path / f"first-{first}"
        _trainer(out, dtype, first, STEPS, save=True).train()
        resumed = _trainer(out, dtype, not first, STEPS)
        resumed.train(resume_from_checkpoint=str(out / f"checkpoint-{STEPS // 2}"))
        _same(_snapshot(resumed), want, f"{dtype}: {'roundpipe' if first else 'torch'} then the other")
