"""GPU tier (``make test-gpu`` = ``pytest -m gpu``): the CUDA device path.

Rollout tensors stay on the GPU and sampling is reproducible there; behaviour log-probs equal
a fresh trainer forward (fp32 and bf16, tolerances below); every variant trains on CUDA through
the real controller; loglinear runs no forward pass for its proximal log-probs; bf16 runs under
autocast with fp32 log-probs; two ranks all-reduce over NCCL (>= 2 GPUs); the GPU smoke bench
runs. Without CUDA every test is reported as skipped, with the reason.
"""

from __future__ import annotations

import json
import math
import socket

import pytest
import torch

from a3po.algorithms.proximal import PROXIMAL_METHODS
from a3po.config import RLConfig, Variant, preset, proximal_method_name, with_overrides
from a3po.data.arithmetic import WORDS
from a3po.data.datasets import load_rows
from a3po.devices import sampling_generator
from a3po.models.factory import build_tiny_model
from a3po.models.logprobs import token_logprobs
from a3po.producer.weight_store import clone_state
from a3po.rollout.torch_engine import RolloutEngine
from a3po.rollout.types import SamplingParams
from a3po.training.loop import rl_train
from a3po.training.run import build_model
from a3po.training.step import train_step
from bench.prox_logp import make_scored_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason=f"needs CUDA: torch.cuda.is_available() is False (torch {torch.__version__}, CUDA build {torch.version.cuda})",
    ),
]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Behaviour log-prob (KV-cache decode, one token at a time) vs a fresh full forward of the same
# weights, on log-probs of magnitude ~6 (random "small" model, vocab ~60). fp32: different
# attention kernels agree to ~1e-6; 1e-3 still catches any wrong temperature, token or version
# (> 1e-2). bf16 (8 mantissa bits, autocast): measured on CPU bf16 max 0.005; 0.05 allows for
# CUDA's other kernels and is still below those errors' ~0.1.
LOGP_TOL = {"float32": 1e-3, "bfloat16": 5e-2}


def _small(dtype: str):
    return build_tiny_model("small", WORDS, seed=0, device="cuda", dtype=DTYPES[dtype])


def test_rollout_tensors_live_on_cuda_and_sampling_is_reproducible():
    model, tok = _small("float32")
    scored = make_scored_batch(model, tok, n_prompts=4, group_size=2, max_new_tokens=8, seed=0)
    b = scored.rollout
    for name in ("input_ids", "attention_mask", "response_mask", "behav_logp", "versions", "finished"):
        assert getattr(b, name).device.type == "cuda", name
    assert scored.rewards.device.type == "cuda"
    assert int(b.response_mask.sum()) > 0
    again = make_scored_batch(model, tok, n_prompts=4, group_size=2, max_new_tokens=8, seed=0).rollout
    assert torch.equal(b.input_ids, again.input_ids)  # the CUDA generator, seeded the same, draws the same
    engine = RolloutEngine(model, tok.eos_token_id, tok.pad_token_id)
    with pytest.raises(ValueError, match="generator is on cpu but the model is on cuda"):
        engine.generate([[1, 2, 3]], SamplingParams(4), generator=torch.Generator().manual_seed(0))
    assert sampling_generator(torch.device("cuda"), 0).device.type == "cuda"


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_behaviour_logp_equals_a_fresh_trainer_forward(dtype):
    model, tok = _small(dtype)
    scored = make_scored_batch(model, tok, n_prompts=4, group_size=2, max_new_tokens=12, seed=1)
    b = scored.rollout
    with torch.no_grad():
        fresh = token_logprobs(model, b.input_ids, b.attention_mask)
    m = b.response_mask
    assert b.behav_logp.dtype == fresh.dtype == torch.float32
    torch.testing.assert_close(b.behav_logp[m], fresh[m], rtol=0, atol=LOGP_TOL[dtype])


def test_bf16_forward_runs_under_autocast_and_log_probs_are_fp32():
    model, tok = _small("bfloat16")
    seen = []
    handle = model.register_forward_pre_hook(lambda mod, args: seen.append(torch.is_autocast_enabled("cuda")))
    try:
        ids = torch.tensor([tok("Question: Mia has 23 pens.", add_special_tokens=False)["input_ids"]], device="cuda")
        logp = token_logprobs(model, ids, torch.ones_like(ids))
    finally:
        handle.remove()
    assert seen == [True]
    assert logp.dtype == torch.float32 and logp.device.type == "cuda"


def test_loglinear_runs_no_forward_for_prox_on_cuda():
    model, tok = _small("float32")
    scored = make_scored_batch(model, tok, n_prompts=4, group_size=2, max_new_tokens=8, seed=0)
    init, n = clone_state(model), len(scored.rollout)
    for variant, expected in [(Variant.LOGLINEAR, [n // 2] * 2), (Variant.RECOMPUTE, [n] + [n // 2] * 2)]:
        model.load_state_dict(init)
        cfg = RLConfig(variant=variant, batch_prompts=4, group_size=2, minibatches=2, max_new_tokens=8, temperature=1.0)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
        calls = []
        handle = model.register_forward_pre_hook(lambda mod, args, kwargs, calls=calls: calls.append(kwargs["input_ids"].shape[0]), with_kwargs=True)
        try:
            metrics = train_step(model, opt, scored, 2, cfg, PROXIMAL_METHODS.get(proximal_method_name(cfg)))
        finally:
            handle.remove()
        assert calls == expected, variant  # one forward per minibatch, plus recompute's full-batch pass
        assert metrics["staleness/mean"] == 2.0
        assert all(math.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("variant", [v.value for v in Variant])
def test_each_variant_trains_on_cuda_through_the_controller(variant, dtype, tmp_path, core_stub_rewards):
    cfg = with_overrides(preset("micro"), rl={"variant": variant}, device="cuda", dtype=dtype)
    model, tok = build_model(cfg)
    assert {p.device.type for p in model.parameters()} == {"cuda"}
    assert {p.dtype for p in model.parameters()} == {DTYPES[dtype]}
    init = clone_state(model)
    train_rows, heldout_rows, _ = load_rows(cfg.data, tok)
    result = rl_train(cfg, model, tok, train_rows, heldout_rows, ckpt_dir=str(tmp_path / "ckpt"), warmstart_acc=0.0)
    assert len(result.history) == cfg.rl.steps
    for m in result.history:
        assert all(math.isfinite(v) for v in m.values())
    assert any(m["policy/grad_norm"] > 0 for m in result.history)  # the stub reward varies: real gradients
    if variant != "sync":
        assert max(m["staleness/max"] for m in result.history) >= 1
    assert {p.device.type for p in model.parameters()} == {"cuda"}
    assert {p.dtype for p in model.parameters()} == {DTYPES[dtype]}
    assert any(not torch.equal(a, b) for a, b in zip(init.values(), model.state_dict().values(), strict=True))
    assert result.checkpoint is not None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _nccl_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        x = torch.full((4,), float(rank + 1), device="cuda")
        dist.all_reduce(x)
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump({"sum": x.tolist(), "device": str(x.device)}, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason=f"needs >= 2 GPUs, found {torch.cuda.device_count()}")
def test_nccl_all_reduce_across_two_ranks(tmp_path):
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_nccl_available():
        pytest.skip("this torch build has no NCCL backend")
    mp.spawn(_nccl_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["sum"] == [3.0] * 4  # 1 + 2 on every rank
        assert got["device"] == f"cuda:{rank}"


def test_gpu_smoke_bench_runs_on_cuda(capsys):
    from bench import gpu_smoke

    figures = gpu_smoke.main(["--size", "small", "--device", "cuda", "--steps", "2"])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last == json.loads(json.dumps(figures))
    assert last["device"].startswith("cuda") and last["gpu"] and last["dtype"] == "bfloat16"
    for v in ("sync", "recompute", "loglinear"):
        assert last[f"{v}/tokens_per_s"] > 0 and last[f"{v}/step_s"] > 0
    assert last["peak_gpu_mem_gib"] > 0
