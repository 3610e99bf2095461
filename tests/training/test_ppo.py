"""The PPO path (a3po.training.ppo_parts, the gae estimator, a3po.training.reward_model, tasks/reward_model.py).

Expected numbers are derived by hand in the comments; the micro runs check the plumbing of each
variant (nothing learns at micro size); learning itself is the tiny-ppo run in the docs."""

from __future__ import annotations

import json
import math

import pytest
import torch

from a3po.algorithms.advantages import ADVANTAGE_ESTIMATORS, AdvantageInputs, gae, grpo_advantages
from a3po.algorithms.kl import kl_penalty
from a3po.algorithms.value import clipped_value_loss, explained_variance, token_rewards
from a3po.config import ConfigError, config_from_dict, preset, with_overrides
from a3po.training.ppo_parts import PPOParts

PPO_MICRO = {"rl": {"advantage": "gae"}, "ppo": {"critic": "policy_copy", "critic_lr": 1e-3, "kl_coef": 0.05, "kl_estimator": "k3"}}
PPO_METRICS = ("ppo/value_loss", "ppo/value_mean", "ppo/explained_variance", "ppo/ev_prompt_ceiling", "ppo/kl", "ppo/return_mean",
               "ppo/value_clip_frac")


# --- pure functions, by hand -------------------------------------------------------------


def test_gae_three_tokens_by_hand():
    # One row: column 0 is the prompt, columns 1..3 the response, column 4 right padding (its
    # value 5.0 must be ignored). Reward 1 at the last response token; gamma 0.9, lambda 0.5:
    #   t=3: delta = 1 + 0.9*0 - 0.8 = 0.2                A3 = 0.2
    #   t=2: delta = 0 + 0.9*0.8 - 0.6 = 0.12             A2 = 0.12 + 0.45*0.2  = 0.21
    #   t=1: delta = 0 + 0.9*0.6 - 0.5 = 0.04             A1 = 0.04 + 0.45*0.21 = 0.1345
    #   returns R = A + V: 0.6345, 0.81, 1.0
    mask = torch.tensor([[False, True, True, True, False]])
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0, 0.0]])
    values = torch.tensor([[9.0, 0.5, 0.6, 0.8, 5.0]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.5)
    assert torch.allclose(adv, torch.tensor([[0.0, 0.1345, 0.21, 0.2, 0.0]]), atol=1e-6)
    assert torch.allclose(ret, torch.tensor([[0.0, 0.6345, 0.81, 1.0, 0.0]]), atol=1e-6)
    # gamma = lambda = 1: Monte Carlo, A_t = R - V_t = 1 - V_t.
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    assert torch.allclose(adv, torch.tensor([[0.0, 0.5, 0.4, 0.2, 0.0]]), atol=1e-6)
    assert torch.allclose(ret, torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0]]), atol=1e-6)


def test_gae_estimator_whitens_and_needs_values():
    est = ADVANTAGE_ESTIMATORS.get("gae")
    assert est.needs_values and not ADVANTAGE_ESTIMATORS.get("grpo").needs_values
    mask = torch.tensor([[False, True, True, True, False]])
    inp = AdvantageInputs(torch.tensor([[0.0, 0.0, 0.0, 1.0, 0.0]]), mask, torch.tensor([0]), None, 0.9, 0.5)
    with pytest.raises(ValueError, match="needs critic values"):
        est(inp)
    out = est(AdvantageInputs(inp.token_rewards, mask, inp.group_ids, torch.tensor([[9.0, 0.5, 0.6, 0.8, 5.0]]), 0.9, 0.5))
    # Whitened over the 3 response tokens: mean 0, (population) std 1; zero on prompt and pad.
    a = out.advantages[mask]
    assert abs(a.mean().item()) < 1e-6 and abs(a.std(unbiased=False).item() - 1) < 1e-5
    assert out.advantages[~mask].abs().max().item() == 0.0
    assert torch.allclose(out.returns[mask], torch.tensor([0.6345, 0.81, 1.0]), atol=1e-6)  # returns are not whitened


def test_sequence_estimator_broadcasts_grpo_over_the_response():
    # Two prompts x two samples; rewards (1, 0 | 1, 1). GRPO: group 0 -> +1, -1 (mean 0.5, std 0.5);
    # group 1 all equal -> 0. Each sequence's advantage on its response tokens only.
    mask = torch.tensor([[False, True, True], [False, True, False], [True, True, True], [False, False, True]])
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 1, 1])
    out = ADVANTAGE_ESTIMATORS.get("grpo")(AdvantageInputs(token_rewards(scores, mask), mask, groups))
    expected = torch.tensor([[0.0, 1.0, 1.0], [0.0, -1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert torch.allclose(out.advantages, expected, atol=1e-5) and out.returns is None
    per_seq = grpo_advantages(scores, groups)  # bitwise the same numbers as the per-sequence function
    assert torch.equal(out.advantages[mask], per_seq[:, None].expand_as(mask)[mask])


def test_token_rewards_score_at_last_token_minus_kl():
    mask = torch.tensor([[False, True, True, False], [False, False, False, False]])
    kl = torch.tensor([[7.0, 0.5, -0.2, 9.0], [1.0, 1.0, 1.0, 1.0]])
    r = token_rewards(torch.tensor([1.0, 1.0]), mask, kl, kl_coef=0.1)
    # row 0: -0.1*0.5 = -0.05 at t=1; 1 - 0.1*(-0.2) = 1.02 at its last token t=2; row 1 has no response.
    assert torch.allclose(r, torch.tensor([[0.0, -0.05, 1.02, 0.0], [0.0, 0.0, 0.0, 0.0]]), atol=1e-6)


def test_kl_k1_k3_by_hand():
    half, quarter = math.log(0.5), math.log(0.25)
    logp = torch.tensor([[0.0, half, quarter, half]])
    ref = torch.tensor([[0.0, quarter, half, 123.0]])
    mask = torch.tensor([[False, True, True, False]])
    # pi = .5, ref = .25: k1 = log 2 = 0.693147; rho = .5: k3 = (.5 - 1) - log .5 = 0.193147
    # pi = .25, ref = .5: k1 = -0.693147;        rho = 2:  k3 = (2 - 1) - log 2  = 0.306853
    k1 = kl_penalty(logp, ref, mask, "k1")
    k3 = kl_penalty(logp, ref, mask, "k3")
    assert torch.allclose(k1, torch.tensor([[0.0, 0.693147, -0.693147, 0.0]]), atol=1e-6)
    assert torch.allclose(k3, torch.tensor([[0.0, 0.193147, 0.306853, 0.0]]), atol=1e-6)
    with pytest.raises(KeyError, match="k2"):
        kl_penalty(logp, ref, mask, "k2")


def test_clipped_value_loss_by_hand():
    # token 1: V=1.0, V_old=0.5, R=0: unclipped 1.0; V_clip = 0.5+0.2 = 0.7 -> 0.49; max 1.0 (unclipped)
    # token 2: V=0.9, V_old=0.2, R=1: unclipped 0.01; V_clip = 0.2+0.2 = 0.4 -> 0.36; max 0.36 (clipped)
    # loss = 0.5 * (1.0 + 0.36) / 2 = 0.34; clip frac 1/2. Column 0 is masked out.
    v = torch.tensor([[3.0, 1.0, 0.9]], requires_grad=True)
    old = torch.tensor([[0.0, 0.5, 0.2]])
    ret = torch.tensor([[-4.0, 0.0, 1.0]])
    mask = torch.tensor([[False, True, True]])
    loss, m = clipped_value_loss(v, old, ret, mask, clip=0.2)
    assert abs(loss.item() - 0.34) < 1e-6 and m["ppo/value_clip_frac"] == 0.5 and abs(m["ppo/value_loss"] - 0.34) < 1e-6
    loss.backward()
    # d/dV of token 1: 0.5 * 2 * (1.0 - 0) / 2 = 0.5; token 2 is clipped (V_clip constant in V): 0.
    assert torch.allclose(v.grad, torch.tensor([[0.0, 0.5, 0.0]]))
    unclipped, _ = clipped_value_loss(v.detach(), old, ret, mask, clip=None)
    assert abs(unclipped.item() - 0.5 * (1.0 + 0.01) / 2) < 1e-6


def test_value_clip_frac_counts_the_tokens_where_the_clip_binds_not_rounding():
    # |V - V_old| = 0.1006 < eps_v = 0.2: V_clip = V_old + (V - V_old) is V exactly in real arithmetic, but in
    # float32 it lands 2.8e-9 above V, so (V_clip - R)^2 > (V - R)^2 by rounding alone: the clip does not bind.
    v, old, ret = torch.tensor([[0.005558443255722523]]), torch.tensor([[-0.09500084817409515]]), torch.tensor([[0.0030965805053710938]])
    assert bool(((old + (v - old).clamp(-0.2, 0.2) - ret) ** 2 > (v - ret) ** 2).all())  # the rounding this guards against
    loss, m = clipped_value_loss(v, old, ret, torch.ones(1, 1, dtype=torch.bool), clip=0.2)
    assert m["ppo/value_clip_frac"] == 0.0
    assert abs(loss.item() - 0.5 * (0.005558443255722523 - 0.0030965805053710938) ** 2) < 1e-10  # 3.03e-6


def test_explained_variance():
    mask = torch.tensor([[True, True, True, False]])
    ret = torch.tensor([[1.0, 2.0, 3.0, 50.0]])
    assert explained_variance(ret, ret, mask) == pytest.approx(1.0)
    # constant V = mean(R): Var(R - V) = Var(R) -> 0
    assert explained_variance(torch.full_like(ret, 2.0), ret, mask) == pytest.approx(0.0, abs=1e-6)


def test_between_prompt_share_by_hand():
    from a3po.algorithms.value import between_prompt_share

    g = torch.tensor([0, 0, 0, 1, 1, 1])
    # groups (1, 1, 0) and (0, 0, 0): means 2/3 and 0, grand mean 1/3.
    # MSB = 3 (1/3)^2 + 3 (1/3)^2 = 2/3 over G - 1 = 1; MSW = ((1/3)^2 2 + (2/3)^2) / (6 - 2) = 1/6;
    # n0 = (6 - 18/6) / 1 = 3; s2_b = (2/3 - 1/6) / 3 = 1/6; share = (1/6) / (1/6 + 1/6) = 0.5.
    assert between_prompt_share(torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 0.0]), g) == pytest.approx(0.5)
    # All the variance between prompts (each prompt always right or always wrong): 1.
    assert between_prompt_share(torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0]), g) == pytest.approx(1.0)
    # Same rate in both prompts: MSB = 0 < MSW, clamped to 0 (nothing a prompt-level critic can know).
    assert between_prompt_share(torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0]), g) == 0.0
    assert between_prompt_share(torch.zeros(6), g) == 0.0  # nothing varies, nothing to explain
    assert math.isnan(between_prompt_share(torch.tensor([1.0, 0.0]), torch.tensor([0, 0])))


# --- config ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "values, message",
    [
        ({"rl": {"advantage": "gae"}}, "needs critic values"),
        ({"ppo": {"critic": "policy_copy"}}, "does not use values"),
        ({"ppo": {"reward": "model"}}, "reward_model_path is not set"),
        ({"ppo": {"reward_model_path": "/x"}}, "ppo.reward is 'grader'"),
        ({"ppo": {"kl_estimator": "k2"}}, "ppo.kl_estimator"),
        ({"ppo": {"value_clip": 0}}, "ppo.value_clip"),
        ({"ppo": {"critic_epochs": 0}}, "ppo.critic_epochs"),
        ({"ppo": {"critic_init_path": "/x"}}, "ppo.critic_init_path is set but ppo.critic is 'none'"),
        ({"ppo": {"lam": 1.5}}, "ppo.gamma and ppo.lam"),
        ({"ppo": {"kl_coef": -0.1}}, "ppo.kl_coef"),
        ({"ppo": {"critic": "shared"}}, "ppo.critic"),
    ],
)
def test_invalid_ppo_configs_raise_when_built(values, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict(values, where="test.yaml")


def test_tiny_ppo_preset_is_gae_with_a_critic_and_the_tiny_warm_start():
    from a3po.training.run import warmstart_folder

    cfg = preset("tiny-ppo")
    assert cfg.rl.advantage == "gae" and cfg.ppo.critic == "policy_copy" and cfg.ppo.reward == "grader"
    assert warmstart_folder(cfg, "c") == warmstart_folder(preset("tiny"), "c")  # the same warm start as the GRPO runs


# --- end to end on micro -----------------------------------------------------------------


@pytest.fixture(scope="module")
def micro_warmstart(tmp_path_factory):
    from a3po.training.run import prepare_warmstart

    torch.set_num_threads(1)
    cache = tmp_path_factory.mktemp("cache")
    return prepare_warmstart(preset("micro"), cache, log=lambda s: None)


@pytest.mark.parametrize("variant", ["sync", "recompute", "loglinear"])
def test_micro_ppo_run_completes_with_the_ppo_metrics(variant, micro_warmstart, tmp_path):
    from a3po.storage.checkpoint import load_latest_checkpoint
    from a3po.training.metrics import JsonlLogger, read_metrics_jsonl
    from a3po.training.run import train_variant

    cfg = with_overrides(preset("micro"), rl={**PPO_MICRO["rl"], "variant": variant}, ppo=PPO_MICRO["ppo"])
    ws_dir, ws_acc = micro_warmstart
    result = train_variant(cfg, tmp_path / "run", ws_dir, ws_acc, logger=JsonlLogger(tmp_path / "m.jsonl"))
    rows = read_metrics_jsonl(tmp_path / "m.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and result.steps == 4
    for r in rows:
        for key in PPO_METRICS:
            assert key in r and math.isfinite(r[key]), (key, r.get(key))
    assert rows[-1]["ppo/kl"] > 0  # the policy moved away from the reference: the k3 estimate is positive
    # The critic and its optimizer are in the checkpoint (a resume continues the same critic).
    _, state = load_latest_checkpoint(tmp_path / "run" / "checkpoints")
    assert any(k.startswith("score.") for k in state["critic"]) and state["critic_optimizer"]["state"]


def test_critic_makes_critic_epochs_passes_per_batch(micro_warmstart, tmp_path):
    """ppo.critic_epochs 3 on micro (rl.minibatches 2), 2 steps: the critic's optimizer takes
    2 steps x 2 minibatches x 3 passes = 12 steps (the policy's own optimizer: 2 x 2 = 4)."""
    from a3po.storage.checkpoint import load_latest_checkpoint
    from a3po.training.metrics import JsonlLogger, read_metrics_jsonl
    from a3po.training.run import train_variant

    cfg = with_overrides(preset("micro"), rl={**PPO_MICRO["rl"], "steps": 2, "eval_every": 2}, ppo={**PPO_MICRO["ppo"], "critic_epochs": 3})
    ws_dir, ws_acc = micro_warmstart
    train_variant(cfg, tmp_path / "run", ws_dir, ws_acc, logger=JsonlLogger(tmp_path / "m.jsonl"))
    _, state = load_latest_checkpoint(tmp_path / "run" / "checkpoints")
    critic_steps = {int(s["step"]) for s in state["critic_optimizer"]["state"].values()}
    policy_steps = {int(s["step"]) for s in state["optimizer"]["state"].values()}
    assert critic_steps == {12} and policy_steps == {4}, (critic_steps, policy_steps)
    rows = read_metrics_jsonl(tmp_path / "m.jsonl")
    assert all(math.isfinite(r["ppo/value_loss_last_epoch"]) for r in rows)


def test_grpo_step_adds_no_ppo_parts_or_metrics(micro_warmstart, tmp_path):
    from a3po.training.metrics import JsonlLogger, read_metrics_jsonl
    from a3po.training.run import train_variant

    parts = PPOParts()
    assert parts.reference is None and parts.critic is None and parts.reward_model is None
    cfg = with_overrides(preset("micro"), rl={"steps": 2, "eval_every": 2})
    ws_dir, ws_acc = micro_warmstart
    train_variant(cfg, tmp_path / "run", ws_dir, ws_acc, logger=JsonlLogger(tmp_path / "m.jsonl"))
    keys = set().union(*(r.keys() for r in read_metrics_jsonl(tmp_path / "m.jsonl")))
    assert not {k for k in keys if k.startswith("ppo/") or k.startswith("reward/model")}


# --- reward model ------------------------------------------------------------------------


def test_reward_model_learns_a_separable_toy_set():
    """Completions ending in the word 'yes' are labelled 1, 'no' 0: the last token decides, so
    a working model + loss + head reaches held-out accuracy far above chance (0.5)."""
    from a3po.data.arithmetic import WORDS
    from a3po.models.factory import build_tiny_model
    from a3po.training.reward_model import Example, build_reward_model, train_reward_model

    torch.manual_seed(0)
    policy, tok = build_tiny_model("micro", WORDS + ["yes", "no"], seed=0)
    g = torch.Generator().manual_seed(0)

    def example(i: int) -> Example:
        label = i % 2
        filler = torch.randint(10, 30, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
        word = tok.convert_tokens_to_ids("yes" if label else "no")
        return Example(filler + [word], float(label), f"p{i}")

    train, heldout = [example(i) for i in range(200)], [example(i) for i in range(200, 260)]
    rm = build_reward_model(policy, tok.pad_token_id)
    figures = train_reward_model(rm, train, heldout, tok.pad_token_id, steps=60, batch_size=32, lr=3e-3, seed=0)
    assert figures["reward_model/heldout_majority_acc"] == 0.5
    assert figures["reward_model/heldout_acc"] >= 0.9, figures


def test_critic_backbone_from_a_reward_model(tmp_path):
    """ppo.critic_init_path: the critic's backbone is the reward model's (here: the policy's
    backbone shifted by 0.5), its per-token head a fresh one."""
    from a3po.data.arithmetic import WORDS
    from a3po.models.critic import build_critic
    from a3po.models.factory import build_tiny_model
    from a3po.storage.atomic import save_pretrained_atomic
    from a3po.training.reward_model import build_reward_model

    policy, tok = build_tiny_model("micro", WORDS, seed=0)
    rm = build_reward_model(policy, tok.pad_token_id)
    with torch.no_grad():
        for p in rm.base_model.parameters():
            p.add_(0.5)
    save_pretrained_atomic(rm, tok, tmp_path / "rm")
    critic = build_critic(policy, str(tmp_path / "rm"))
    want, policy_w = rm.base_model.state_dict(), policy.base_model.state_dict()
    got = critic.base_model.state_dict()
    assert all(torch.equal(got[k], want[k]) and not torch.equal(got[k], policy_w[k]) for k in want)
    assert not any(k.startswith("score") for k in want) and critic.score.weight.shape[0] == 1
    with pytest.raises(FileNotFoundError, match="ppo.critic_init_path"):
        build_critic(policy, str(tmp_path / "missing"))


def test_classification_figures_by_hand():
    from a3po.training.reward_model import classification_figures

    # labels 1 1 0 0 0, logits 2 -1 1 -3 -1: predicted 1 0 1 0 0.
    # acc 3/5; majority 3/5; TPR 1/2, TNR 2/3 -> balanced 7/12.
    # AUC: pairs (pos, neg): 2 beats 1, -3, -1 (3); -1 loses to 1, beats -3, ties -1 (1.5) -> 4.5 / 6 = 0.75.
    f = classification_figures(torch.tensor([2.0, -1.0, 1.0, -3.0, -1.0]), torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0]))
    assert f["acc"] == pytest.approx(0.6) and f["majority_acc"] == pytest.approx(0.6) and f["positive_frac"] == pytest.approx(0.4)
    assert f["balanced_acc"] == pytest.approx(7 / 12) and f["auc"] == pytest.approx(0.75)
    # A constant guess: accuracy can equal the majority baseline, balanced accuracy and AUC stay at 0.5.
    const = classification_figures(torch.full((5,), -1.0), torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0]))
    assert const["acc"] == pytest.approx(0.8) == const["majority_acc"] and const["balanced_acc"] == 0.5 and const["auc"] == 0.5
    assert math.isnan(classification_figures(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 1.0]))["auc"])


def test_reward_model_reward_in_a_ppo_run_and_task_logs_accuracy(micro_warmstart, tmp_path):
    """The Prefect task trains (then finds in its cache) the reward model of the micro warm start
    and logs its held-out accuracy on a real MLflow parent run; a PPO run then uses it as reward."""
    from a3po.training.metrics import JsonlLogger, read_metrics_jsonl
    from a3po.training.reward_model import RewardModelSettings
    from a3po.training.run import train_variant
    from tasks.reward_model import reward_model_ready, train_reward_model
    from tasks.tracking import TrackingRef, client_for, create_run, ensure_experiment
    from tasks.training import WarmStart

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = client_for(uri)
    exp = ensure_experiment(client, "test", uri)
    ref = TrackingRef(uri, exp, create_run(client, exp, "parent", {"a3po.role": "parent"}))
    cfg = preset("micro")
    ws_dir, ws_acc = micro_warmstart
    ws = WarmStart(dir=str(ws_dir), heldout_acc=ws_acc, key="micro")
    settings = RewardModelSettings(n_prompts=20, samples_per_prompt=2, steps=5, batch_size=8)
    assert not reward_model_ready(cfg, ws, tmp_path / "cache", settings)
    rm = train_reward_model.fn(cfg, ws, str(tmp_path / "cache"), ref, settings)
    assert reward_model_ready(cfg, ws, tmp_path / "cache", settings)
    logged = client.get_run(ref.parent_run_id).data.metrics
    assert logged["reward_model/heldout_acc"] == pytest.approx(rm.heldout_acc)
    assert 0.0 <= rm.heldout_acc <= 1.0 and logged["reward_model/n_heldout"] > 0
    assert {"reward_model/heldout_balanced_acc", "reward_model/heldout_auc", "reward_model/heldout_majority_acc"} <= set(logged)
    again = train_reward_model.fn(cfg, ws, str(tmp_path / "cache"), None, settings)
    assert again.dir == rm.dir and again.heldout_acc == rm.heldout_acc
    assert json.loads((tmp_path / "cache" / f"reward-model-{rm.key}" / "a3po_reward_model.json").read_text())

    ppo = {**PPO_MICRO["ppo"], "reward": "model", "reward_model_path": rm.dir}
    cfg = with_overrides(cfg, rl={**PPO_MICRO["rl"], "steps": 2, "eval_every": 2}, ppo=ppo)
    train_variant(cfg, tmp_path / "run", ws_dir, ws_acc, logger=JsonlLogger(tmp_path / "m.jsonl"))
    last = read_metrics_jsonl(tmp_path / "m.jsonl")[-1]
    assert 0.0 < last["reward/model_mean"] < 1.0 and 0.0 <= last["reward/model_grader_agreement"] <= 1.0


# --- resume (last in the module: core_stub_rewards patches the grader until the module ends) ---


class _Crash(Exception):
    pass


def test_resumed_ppo_run_equals_uninterrupted_run(core_stub_rewards, micro_warmstart, tmp_path):
    """The critic and its optimizer come back from the checkpoint, and the reference stays the
    warm start (not the checkpoint's policy): a run crashed after step 4 and resumed gives the
    same per-step figures (ppo/kl and the value metrics included) and the same final weights.
    The stub reward (digit fraction) varies on micro, so the advantages are not all zero."""
    from a3po.data.datasets import load_rows
    from a3po.models.factory import load_pretrained
    from a3po.producer.weight_store import clone_state
    from a3po.training.loop import rl_train

    cfg = with_overrides(preset("micro"), rl={**PPO_MICRO["rl"], "steps": 6, "checkpoint_every": 2, "eval_every": 6}, ppo=PPO_MICRO["ppo"])

    def run(ckpt_dir, progress=None):
        model, tok = load_pretrained(micro_warmstart[0])
        train, held, _ = load_rows(cfg.data, tok)
        return rl_train(cfg, model, tok, train, held, ckpt_dir=ckpt_dir, warmstart_acc=0.0, progress=progress), clone_state(model)

    full, w_full = run(str(tmp_path / "full"))

    def crash_at_5(step, metrics):
        if step == 5:
            raise _Crash()

    with pytest.raises(_Crash):
        run(str(tmp_path / "resumed"), crash_at_5)
    resumed, w_resumed = run(str(tmp_path / "resumed"))
    assert resumed.resumed_from == 4
    timing = ("perf/", "time/", "prox/time_s")
    strip = lambda h: [{k: v for k, v in m.items() if not k.startswith(timing)} for m in h]  # noqa: E731
    assert strip(resumed.history) == strip(full.history)
    assert any(abs(m["loss/policy"]) > 0 for m in full.history) and full.history[-1]["ppo/kl"] > 0
    assert all(torch.equal(w_full[k], w_resumed[k]) for k in w_full)
