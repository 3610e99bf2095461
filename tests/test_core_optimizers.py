"""The RL updates' AdamW (:mod:`a3po.optimizers`): torch's fused kernel where it exists, the
same update as torch's reference loop up to rounding, and a checkpoint resumes on the
implementation it was written with."""

from __future__ import annotations

import io

import torch

from a3po.optimizers import adamw, fused_supported


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
    for a, b in zip(fused_params, loop_params):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    moved = max((a - b).abs().max().item() for a, b in zip(fused_params, _params()))
    assert moved > 1e-2  # five steps at lr 1e-2 moved the weights: the comparison is not of untouched tensors


def test_not_fused_where_torch_has_no_kernel():
    assert not fused_supported([])
    assert not fused_supported([torch.zeros(3, dtype=torch.int64)])
    assert fused_supported([torch.zeros(2)])  # a float CPU tensor does


def test_a_checkpoint_resumes_on_the_implementation_it_was_written_with():
    # Written by the earlier, unfused AdamW: loading it keeps that implementation, so the resumed
    # run takes bit for bit the steps the uninterrupted one takes.
    old_params, resumed_params = _params(), _params()
    old = torch.optim.AdamW(old_params, lr=1e-2, weight_decay=0.0)
    _grads(old_params, 0)
    old.step()
    with torch.no_grad():
        for r, o in zip(resumed_params, old_params):
            r.copy_(o)
    resumed = adamw(resumed_params, 1e-2)
    resumed.load_state_dict(_saved(old))
    assert not resumed.param_groups[0]["fused"]
    for k in (1, 2):
        _grads(old_params, k)
        _grads(resumed_params, k)
        old.step()
        resumed.step()
    assert all(torch.equal(a, b) for a, b in zip(old_params, resumed_params))
    # Written by the fused one: it resumes fused, and on the same bits as the uninterrupted run.
    first, second = _params(), _params()
    running = adamw(first, 1e-2)
    _grads(first, 0)
    running.step()
    with torch.no_grad():
        for s, f in zip(second, first):
            s.copy_(f)
    restarted = adamw(second, 1e-2)
    restarted.load_state_dict(_saved(running))
    assert restarted.param_groups[0]["fused"] is True
    _grads(first, 1)
    _grads(second, 1)
    running.step()
    restarted.step()
    assert all(torch.equal(a, b) for a, b in zip(first, second))
