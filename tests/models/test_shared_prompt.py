"""The training forward with shared prompts (a3po.models.logprobs.response_logits) and the minibatch
splits (a3po.algorithms.minibatches).

Running each distinct prompt once and the responses on top of its KV cache must give the plain
forward's log-probs, entropies and gradients to float rounding (different matmul shapes: ~1e-6
here, tolerance 1e-5 on log-probs of magnitude <= ~5), on Qwen2 and Llama configs with
left-padded prompts of different lengths repeated as GRPO groups; and it must really run each
prompt once (token positions counted at the embedding).
"""

from __future__ import annotations

import json

import pytest
import torch

from a3po.algorithms.minibatches import MINIBATCH_SPLITS
from a3po.config import RLConfig, TrainConfig, config_differences, config_to_dict
from a3po.models.logprobs import token_logprobs
from a3po.rollout.torch_engine import RolloutEngine
from a3po.rollout.types import SamplingParams
from tests.support.tiny_models import EOS, PAD, llama, qwen2

pytestmark = pytest.mark.usefixtures("core_one_thread")

TOL = 1e-5
# Three prompts of different lengths (left padding), a group of three samples each, the groups
# interleaved as a shuffled minibatch would hold them.
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [20, 21, 22, 23, 24, 25, 26]]
ROWS = [0, 1, 2, 0, 2, 1, 1, 0, 2]


def _batch(model):
    engine = RolloutEngine(model, EOS, PAD)
    b = engine.generate([PROMPTS[i] for i in ROWS], SamplingParams(max_new_tokens=10, temperature=1.0),
                        generator=torch.Generator().manual_seed(4))
    assert b.response_mask.sum(1).min() < b.response_mask.sum(1).max()  # some rows end early: right padding
    return b


def _logp_ent_grads(model, b, share):
    model.zero_grad(set_to_none=True)
    logp, ent = token_logprobs(model, b.input_ids, b.attention_mask, temperature=0.8, return_entropy=True,
                               start=b.prompt_len, share_prompt=share)
    weights = torch.linspace(-1.0, 2.0, logp.numel()).view_as(logp)  # a loss that weighs every token differently
    (logp * weights * b.response_mask).sum().backward()
    return logp.detach(), ent, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("build", [qwen2, llama], ids=["qwen2", "llama"])
def test_shared_prompt_forward_equals_the_plain_one_with_its_gradient(build):
    model = build().train()
    b = _batch(model)
    plain, shared = _logp_ent_grads(model, b, share=False), _logp_ent_grads(model, b, share=True)
    m = b.response_mask
    torch.testing.assert_close(shared[0][m], plain[0][m], rtol=0, atol=TOL)
    torch.testing.assert_close(shared[1][m], plain[1][m], rtol=0, atol=TOL)
    assert (shared[0][:, : b.prompt_len] == 0).all()  # aligned as the plain one: 0 before the response
    for name, g in plain[2].items():
        assert g.abs().max() > 0, name  # every parameter, the prompt's path included, gets a gradient
        torch.testing.assert_close(shared[2][name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_under_gradient_checkpointing_the_plain_forward_runs():
    # transformers' checkpointed layers drop a cache: the responses would not see their prompt.
    model = qwen2().train()
    b = _batch(model)
    plain = _logp_ent_grads(model, b, share=False)
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()  # renamed in transformers 5
    shared = _logp_ent_grads(model, b, share=True)
    m = b.response_mask
    torch.testing.assert_close(shared[0][m], plain[0][m], rtol=0, atol=TOL)
    for name, g in plain[2].items():
        torch.testing.assert_close(shared[2][name], g, rtol=1e-4, atol=1e-6, msg=name)


def _positions_run(model, fn) -> tuple[int, list[int]]:
    """Token positions the model embeds while ``fn`` runs, and the rows of each call."""
    seen, rows = [0], []

    def hook(module, args):
        seen[0] += args[0].numel()
        rows.append(args[0].shape[0])

    handle = model.get_input_embeddings().register_forward_pre_hook(hook)
    try:
        fn()
    finally:
        handle.remove()
    return seen[0], rows


def test_each_distinct_prompt_runs_once():
    model = qwen2()
    b = _batch(model)
    n, length, p = *b.input_ids.shape, b.prompt_len
    with torch.no_grad():
        shared, rows = _positions_run(model, lambda: token_logprobs(model, b.input_ids, b.attention_mask, start=p, share_prompt=True))
        plain, _ = _positions_run(model, lambda: token_logprobs(model, b.input_ids, b.attention_mask, start=p))
    assert rows == [len(PROMPTS), n]
    assert shared == len(PROMPTS) * p + n * (length - p)
    assert plain == n * length


def test_without_repeated_prompts_the_plain_forward_runs():
    model = qwen2()
    b = _batch(model)
    one_each = torch.tensor([ROWS.index(i) for i in range(len(PROMPTS))])
    ids, attn = b.input_ids[one_each], b.attention_mask[one_each]
    with torch.no_grad():
        _, rows = _positions_run(model, lambda: token_logprobs(model, ids, attn, start=b.prompt_len, share_prompt=True))
        shared = token_logprobs(model, ids, attn, start=b.prompt_len, share_prompt=True)
        plain = token_logprobs(model, ids, attn, start=b.prompt_len)
    assert rows == [len(PROMPTS)]
    assert torch.equal(shared, plain)


# --- minibatch splits -----------------------------------------------------------------------------


def _chunks(order: torch.Tensor, k: int) -> list[list[int]]:
    return [c.tolist() for c in order.chunk(k)]


def test_groups_split_keeps_each_group_in_one_minibatch_in_a_seeded_random_order():
    group_ids = torch.tensor([7, 7, 3, 3, 9, 9, 1, 1, 7, 7, 3, 3, 9, 9, 1, 1]).view(8, 2).T.reshape(-1)  # groups of 4, rows interleaved
    split = MINIBATCH_SPLITS.get("groups")
    orders = [split(group_ids, torch.Generator().manual_seed(s)) for s in range(6)]
    for order in orders:
        assert sorted(order.tolist()) == list(range(16))  # every row exactly once
        for chunk in _chunks(order, 4):  # minibatches of 4 rows: one whole group each
            assert len(set(group_ids[chunk].tolist())) == 1
            assert chunk == sorted(chunk)  # a group's rows in batch order
    firsts = {tuple(group_ids[o[::4]].tolist()) for o in orders}
    assert len(firsts) > 1  # the order of the groups depends on the seed
    assert torch.equal(orders[0], split(group_ids, torch.Generator().manual_seed(0)))  # and on nothing else


def test_groups_split_with_groups_across_minibatches_still_takes_every_row_once():
    # Groups of 3 in minibatches of 4 rows (or groups of unequal size, as after a skipped row):
    # a group then straddles two minibatches, and nothing is lost.
    for group_ids in (torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]), torch.tensor([4, 4, 4, 4, 4, 2, 2, 8])):
        order = MINIBATCH_SPLITS.get("groups")(group_ids, torch.Generator().manual_seed(1))
        assert sorted(order.tolist()) == list(range(len(group_ids)))
        seen = group_ids[order].tolist()
        for g in set(seen):  # each group's rows are consecutive
            at = [i for i, x in enumerate(seen) if x == g]
            assert at == list(range(at[0], at[0] + len(at)))


def test_rows_split_is_the_seeded_shuffle_of_the_rows():
    group_ids = torch.arange(16) // 4
    order = MINIBATCH_SPLITS.get("rows")(group_ids, torch.Generator().manual_seed(5))
    assert torch.equal(order, torch.randperm(16, generator=torch.Generator().manual_seed(5)))
    assert any(len(set(group_ids[c].tolist())) > 1 for c in _chunks(order, 4))  # groups mixed across minibatches


def test_an_unknown_split_is_refused_naming_the_field():
    with pytest.raises(KeyError, match=r"rl.minibatch_split: unknown minibatch split 'prompts'; valid: groups, rows"):
        RLConfig(minibatch_split="prompts")


def test_a_checkpoint_from_before_the_shared_forward_existed_resumes_only_the_old_way():
    # Saved by the version before the field: plain forward. Resuming it under the new default
    # would change the run's bits; the resume check names the field instead.
    current = config_to_dict(TrainConfig())
    saved = json.loads(json.dumps(current))
    del saved["rl"]["minibatch_split"], saved["rl"]["shared_prompt_forward"]
    assert config_differences(saved, current) == ["rl.shared_prompt_forward"]
    old_way = config_to_dict(TrainConfig(rl=RLConfig(shared_prompt_forward=False)))
    assert config_differences(saved, old_way) == []
