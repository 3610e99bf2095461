"""bench.peer_trl_ppo (TRL 1.12's PPOTrainer as bench.oppo's other side): where TRL 1.12 is not
importable it says so with the install command and exits with a "not run" JSON line; its grader
behind TRL's reward-model interface scores as the grader; with TRL 1.12 (slow) it runs."""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from a3po.config import preset
from a3po.data.arithmetic import WORDS
from a3po.data.datasets import load_rows, prompt_style
from a3po.models.factory import build_tiny_model
from a3po.producer.producer import PromptSampler
from bench import oppo
from bench.peer_trl_ppo import GraderReward, SigmoidReward, main, trl_ppo_missing

pytestmark = pytest.mark.usefixtures("core_one_thread")

MISSING = trl_ppo_missing()


@pytest.mark.skipif(MISSING is None, reason="TRL 1.12 is importable here: the bench runs instead")
def test_without_trl_ppo_the_bench_says_how_to_install_it_and_ends_with_a_not_run_line(capsys):
    out = main(["--preset", "micro", "--steps", "2"])  # returns (exit 0) instead of raising
    lines = capsys.readouterr().out.strip().splitlines()
    last = json.loads(lines[-1])
    assert last == json.loads(json.dumps(out))
    assert last["trl_ppo"] == "not run"
    assert "pip install -e '.[bench-ppo]'" in last["why"] and "TRL 1.12" in last["why"]
    assert any(line.startswith("peer_trl_ppo: not run:") for line in lines[:-1])  # said plainly, not only in the JSON


@pytest.mark.skipif(MISSING is None, reason="TRL 1.12 is importable here: the bench runs instead")
def test_bench_oppo_reports_why_trl_ppo_was_not_run():
    assert oppo.trl_ppo_side(oppo.parse_args(["--path", "grpo"])) == "not run (PPO path only: --path ppo)"
    assert oppo.trl_ppo_side(oppo.parse_args(["--path", "ppo", "--no-trl"])) == "not run (--no-trl)"
    why = oppo.trl_ppo_side(oppo.parse_args(["--path", "ppo"]))
    assert why.startswith("not run: ") and "'.[bench-ppo]'" in why


def test_help_gives_the_install_command(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # argparse wraps help to the terminal's width (and may break at a hyphen)
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    assert "make setup-trl-ppo" in capsys.readouterr().out


def test_grader_behind_trls_reward_model_interface_scores_each_row_against_its_prompts_gold():
    cfg = preset("micro")
    _, tok = build_tiny_model("micro", WORDS, seed=0)
    train, _, _ = load_rows(cfg.data, tok)
    rows = [r for r in train if r["solution"].endswith(f"#### {r['gold']}")][:2]  # solutions without a teacher slip
    sampler = PromptSampler(rows, tok, batch_prompts=2, group_size=1, seed=0, style=prompt_style(cfg.data))
    prompts, meta = sampler.batch(0)
    golds = {tuple(p): (m["gold"], m["id"]) for p, m in zip(prompts, meta, strict=True)}
    by_id = {r["id"]: r for r in rows}
    right = [by_id[m["id"]]["solution"] for m in meta]
    wrong = [s.rsplit("#### ", 1)[0] + f"#### {int(m['gold']) + 1}" for s, m in zip(right, meta, strict=True)]
    # TRL's layout: left-padded prompts to one width, then each response up to its EOS, pad after.
    width = max(map(len, prompts))
    ids, mask = [], []
    for p, text in zip(prompts + prompts, right + wrong, strict=True):
        resp = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        row = [tok.pad_token_id] * (width - len(p)) + p + resp
        ids.append(row)
        mask.append([0] * (width - len(p)) + [1] * (len(p) + len(resp)))
    L = max(map(len, ids))
    ids = torch.tensor([r + [tok.pad_token_id] * (L - len(r)) for r in ids])
    mask = torch.tensor([m + [0] * (L - len(m)) for m in mask])
    reward = GraderReward(cfg.data.task, tok, golds)
    reward.context_length = width
    # As TRL's get_reward calls it: the backbone named by base_model_prefix, then score(last hidden).
    hidden = getattr(reward, reward.base_model_prefix)(input_ids=ids.masked_fill(mask == 0, 0), attention_mask=mask).hidden_states[-1]
    scores = reward.score(hidden)
    assert scores.shape == (4, L, 1)
    assert scores[:, 0, 0].tolist() == [1.0, 1.0, 0.0, 0.0]  # right, right, wrong, wrong
    assert bool((scores == scores[:, :1]).all())  # the same score at every position TRL may read


def test_reward_model_behind_trls_interface_scores_as_the_project_does():
    from a3po.models.critic import reward_model_scores
    from a3po.training.reward_model import build_reward_model

    policy, tok = build_tiny_model("micro", WORDS, seed=0)
    rm = build_reward_model(policy, tok.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        torch.nn.init.normal_(rm.score.weight, std=1.0)  # a head that tells rows apart (a fresh one gives ~0.5 everywhere)
    pad, eos = tok.pad_token_id, tok.eos_token_id
    # TRL's layout: prompts left-padded to width 4, responses up to their EOS, then padding.
    ids = torch.tensor([[pad, 7, 8, 9, 10, 11, eos, pad],
                        [5, 6, 7, 8, 12, 13, 14, eos],
                        [pad, pad, 9, 9, 15, eos, pad, pad]])
    mask = (ids != pad).long()
    expected = reward_model_scores(rm, ids, mask)  # (N,): sigmoid of the logit at each row's last token (the EOS)
    wrapped = SigmoidReward(rm)
    # TRL's get_reward: the backbone named by base_model_prefix, score(last hidden), read at the EOS column.
    out = getattr(wrapped, wrapped.base_model_prefix)(input_ids=ids.masked_fill(mask == 0, 0), attention_mask=mask,
                                                      position_ids=mask.cumsum(1) - mask, return_dict=True,
                                                      output_hidden_states=True, use_cache=False)
    logits = wrapped.score(out.hidden_states[-1])
    eos_col = (ids == eos).int().argmax(1)
    got = logits[torch.arange(3), eos_col, 0]
    assert expected.unique().numel() == 3  # the rows really differ
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_trl_ppo_runs_two_steps_on_the_micro_work():
    pytest.importorskip("trl.experimental.ppo")
    from bench.peer_trl_ppo import run_trl_ppo

    args = oppo.parse_args(["--path", "ppo", "--preset", "micro", "--steps", "2", "--max-new-tokens", "8"])
    cfg = oppo.setting_config(args, {})
    model, tok, train, _ = oppo.setting_model(args, cfg)
    tok.padding_side = "right"  # as a saved warm start's tokenizer may load: TRL must still get left-padded prompts
    before = {k: v.clone() for k, v in model.state_dict().items()}
    f = run_trl_ppo(cfg, model, tok, train, args.steps, threads=1)
    assert f["steps"] == 2 and len(f["reward_curve"]) == 2
    assert all(0.0 <= r <= 1.0 for r in f["reward_curve"])  # the grader's scale: TRL scored with the grader
    assert f["step_s_median"] > 0 and f["gen_tok_s"] > 0
    assert 0 < f["response_len"] <= 8  # at most max_new_tokens, EOS included
    assert statistics.fsum([f["trainer_busy"], f["generator_busy"], f["scorer_busy"]]) == pytest.approx(1.0)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # TRL trained a copy
