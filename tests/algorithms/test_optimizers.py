"""The RL updates' AdamW (:mod:`a3po.algorithms.optimizers`): torch's fused kernel where it exists, the
same update as torch's reference loop up to rounding, and a checkpoint resumes on the
implementation it was written with."""

from __future__ import annotations

import io

import pytest
import torch

from a3po.algorithms.optimizers import adamw, fused_supported


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in ((7, 5), (5,), (3, 4, 2))]


def _saved(optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer``'s state through a save and a weights-only load, as a checkpoint holds it
    (a bare ``state_dict()`` shares its tensors with the optimizer)."""
    buf = io.BytesIO()
    torch.save(optimizer.state_dict(), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _grads(params, k: int) -> None:
    g = torch.Generator().manual_seed(100 + k)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def test_fused_on_the_cpu_and_the_same_update_as_torchs_loop():
    fused_params, loop_params = _params(), _params()
    fused, loop = adamw(fused_params, 1e-2), torch.optim.AdamW(loop_params, lr=1e-2, weight_decay=0.0, foreach=False)
    assert fused.param_groups[0]["fused"] is True and fused.param_groups[0]["weight_decay"] == 0.0
    for k in range(5):
        _grads(fused_params, k)
        _grads(loop_params, k)
        fused.step()
        loop.step()
    for a, b in zip(fused_params, loop_params, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    moved = max((a - b).abs().max().item() for a, b in zip(fused_params, _params(), strict=True))
    assert moved > 1e-2  # five steps at lr 1e-2 moved the weights: the comparison is not of untouched tensors


def test_not_fused_where_torch_has_no_kernel():
    assert not fused_supported([])
    assert not fused_supported([torch.zeros(3, dtype=torch.int64)])
    assert fused_supported([torch.zeros(2)])  # a float CPU tensor does


@pytest.mark.parametrize("written_by, resumes_fused", [
    (lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0), False),  # the earlier, unfused AdamW
    (lambda params: adamw(params, 1e-2), True),
], ids=["unfused", "fused"])
def test_a_checkpoint_resumes_on_the_kernel_it_was_written_with(written_by, resumes_fused):
    # The trainer's adamw loading a state keeps the kernel that state was written with, so the
    # resumed run takes bit for bit the steps the uninterrupted one takes.
    running_params, resumed_params = _params(), _params()
    running = written_by(running_params)
    _grads(running_params, 0)
    running.step()
    with torch.no_grad():
        for r, o in zip(resumed_params, running_params, strict=True):
            r.copy_(o)
    resumed = adamw(resumed_params, 1e-2)
    resumed.load_state_dict(_saved(running))
    assert bool(resumed.param_groups[0]["fused"]) is resumes_fused
    for k in (1, 2):
        _grads(running_params, k)
        _grads(resumed_params, k)
        running.step()
        resumed.step()
    assert all(torch.equal(a, b) for a, b in zip(running_params, resumed_params, strict=True))
