"""Rollout correction: the engine-vs-trainer mismatch of the behaviour policy, corrected per token.

The rollout engine samples token ``y_t`` from its own numerics of the behaviour weights
``v(t)`` (other kernels, bf16 weights, another batch shape), while the trainer would compute
``pi_trainer(y_t; v(t))`` for the same weights. The per-token mismatch ratio is

    rho_t = pi_trainer(y_t | y_<t; v(t)) / pi_engine(y_t | y_<t; v(t))        (log_ratio = log rho_t)

Which ratio the published methods use: each takes the trainer's own log-prob of the weights
that sampled ("old log-prob", recomputed by the training backend) over the engine's.

=========  ===========================================  ==============================================
method     source                                       per-token weight ``c_t`` (replaces ``rho_t``)
=========  ===========================================  ==============================================
``tis``    Yao et al. 2025, "Your efficient RL          ``min(rho_t, C)``; C = 2 (TRL's
           framework secretly brings you off-policy     ``vllm_importance_sampling_cap``, verl's
           RL training"; TRL, verl ``token_is``,        ``rollout_is_threshold``)
           slime ``--use-tis``
``mis``    Liu, Li et al. 2025, "When speed kills       sequence ratio ``R = prod_t rho_t`` (level
           stability" (masked importance sampling);     ``sequence``) or ``G = exp(mean_t log rho_t)``
           verl ``seq_is`` / ``seq_is_rs`` /            (``geometric``), one per sequence; ``mask``:
           ``geo_rs``, TRL ``sequence_mask|truncate``   ``R * 1[lo <= R <= hi]`` (geometric:
                                                        ``1[lo <= G <= hi]``, rejection only, as verl's
                                                        ``geo_rs``); ``truncate``: ``min(R, C)``
``icepop`` Ling Team 2025, Ring-1T report               ``rho_t * 1[alpha <= rho_t <= beta]``;
           (arXiv:2510.18855), "IcePop"                 alpha = 0.5, beta = 5 (the paper's)
``none``   today's loss                                 (the mismatch stays folded into the
                                                        decoupled weight, uncorrected)
=========  ===========================================  ==============================================

In the synchronous setting of those papers the trainer's old log-prob *is* the proximal policy, so
verl writes the ratio as ``pi_old / pi_rollout`` (its decoupled mode recomputes ``old_log_prob``
with the trainer at the start of the step). Asynchronously the two differ: the proximal weights
are newer than the ones that sampled, and ``pi_prox / pi_engine`` mixes staleness with mismatch.
Here the ratio is the mismatch alone (trainer and engine at the *same* version ``v(t)``), and the
decoupled loss (:func:`a3po.algorithms.losses.decoupled_ppo_loss`) splits its behaviour weight::

    pi_prox / pi_engine  =  [pi_prox / pi_trainer(v)]  *  rho_t
                             staleness (capped by            mismatch: replaced by c_t
                             rl.behav_weight_cap)

so a token's weight becomes ``c_t * pi_prox / pi_trainer(v)``. With every token on-policy and the
proximal anchor recomputed by the trainer (``rl.proximal: recompute``), that is verl's decoupled
mode exactly: ``c_t * clip-loss(pi_theta / pi_old)``.

Each method is a pure function of ``log_ratio`` and ``mask`` ``(B, T)`` (``mask`` bool, True on
generated tokens; ``log_ratio`` is read only there) and explicit thresholds, returning a
:class:`Correction`: the weights ``c_t`` (0 off the mask and on dropped tokens), which tokens were
masked or truncated, and the ``correction/*`` metrics. Chosen by name from
:data:`ROLLOUT_CORRECTIONS` (``rl.rollout_correction``); the caller asks ``needs_trainer_logp``,
never the name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from a3po.algorithms.checks import require_finite, require_same_shape
from a3po.algorithms.stability import quantile
from a3po.registry import Registry

# exp() of a log-ratio past this overflows float32 (e^88); no threshold is near it.
_MAX_LOG_RATIO = 80.0


@dataclass(frozen=True)
class CorrectionSettings:
    """The thresholds as configured (``rl.rollout_correction_*``); None: the method's default
    (:meth:`RolloutCorrection.resolve`)."""

    cap: float | None = None  # upper threshold: TIS's C, MIS's hi (or truncation C), IcePop's beta
    lower: float | None = None  # lower threshold: MIS mask's lo, IcePop's alpha
    level: str | None = None  # MIS: 'sequence' (product) or 'geometric' (geometric mean)
    mode: str | None = None  # MIS: 'mask' or 'truncate'


@dataclass(frozen=True)
class Correction:
    """One batch's correction: ``weights`` ``(B, T)`` ``c_t >= 0`` (0 off the mask and on dropped
    tokens), ``masked`` / ``truncated`` ``(B, T)`` bool (on the mask), and the metrics."""

    weights: torch.Tensor
    masked: torch.Tensor
    truncated: torch.Tensor
    metrics: dict[str, float]


class RolloutCorrection(Protocol):
    """``needs_trainer_logp``: whether the run must compute the trainer's log-probs of the
    behaviour versions (False only for ``none``: nothing changes). ``options``: the
    ``CorrectionSettings`` fields it reads (the config refuses the others)."""

    needs_trainer_logp: bool
    options: frozenset[str]

    def resolve(self, s: CorrectionSettings) -> CorrectionSettings:
        """``s`` with the method's defaults filled in; raises ValueError on a combination it cannot run."""
        ...

    def __call__(self, log_ratio: torch.Tensor, mask: torch.Tensor, s: CorrectionSettings) -> Correction: ...


ROLLOUT_CORRECTIONS: Registry[RolloutCorrection] = Registry("rollout correction")


def _checked(log_ratio: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    require_same_shape(log_ratio=log_ratio, mask=mask)
    mask = mask.bool()
    require_finite("log_ratio", log_ratio.detach(), mask)
    return torch.where(mask, log_ratio.detach().float(), torch.zeros_like(log_ratio, dtype=torch.float32)), mask


def correction_metrics(log_ratio: torch.Tensor, mask: torch.Tensor, c: torch.Tensor, masked: torch.Tensor,
                       truncated: torch.Tensor) -> dict[str, float]:
    """The ``correction/*`` metrics over the generated tokens (glossary in ``a3po.training.metrics``):
    quantiles of ``rho_t``, fractions of tokens masked / truncated, of sequences wholly masked,
    and the mean weight."""
    rho = log_ratio[mask].clamp(max=_MAX_LOG_RATIO).exp()
    rows = mask.any(dim=1)  # sequences with at least one generated token
    all_masked = (masked | ~mask).all(dim=1) & rows
    n_tok, n_seq = max(int(mask.sum()), 1), max(int(rows.sum()), 1)
    return {
        "correction/ratio_p50": quantile(rho, 0.5),
        "correction/ratio_p99": quantile(rho, 0.99),
        "correction/ratio_max": rho.max().item() if rho.numel() else 0.0,
        "correction/masked_frac": int((masked & mask).sum()) / n_tok,
        "correction/truncated_frac": int((truncated & mask).sum()) / n_tok,
        "correction/seq_masked_frac": int(all_masked.sum()) / n_seq,
        "correction/weight_mean": c[mask].double().mean().item() if mask.any() else 0.0,
    }


def tis_weights(log_ratio: torch.Tensor, mask: torch.Tensor, cap: float) -> Correction:
    """Token-level truncated importance sampling (Yao et al. 2025)::

        c_t = min(rho_t, C)

    No token is dropped; ``truncated`` marks ``rho_t > C``."""
    lr, mask = _checked(log_ratio, mask)
    log_cap = math.log(cap)
    truncated = mask & (lr > log_cap)
    c = torch.where(mask, lr.clamp(max=log_cap).exp(), torch.zeros_like(lr))
    none = torch.zeros_like(mask)
    return Correction(c, none, truncated, correction_metrics(lr, mask, c, none, truncated))


def sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """Per sequence ``(B,)``: ``log R = sum_t log rho_t`` (level ``sequence``) or
    ``log G = mean_t log rho_t`` (``geometric``), over the generated tokens."""
    total = torch.where(mask, log_ratio, torch.zeros_like(log_ratio)).sum(dim=1)
    if level == "sequence":
        return total
    if level == "geometric":
        return total / mask.sum(dim=1).clamp(min=1)
    raise ValueError(f"unknown sequence level {level!r}; valid: geometric, sequence")


def mis_weights(log_ratio: torch.Tensor, mask: torch.Tensor, upper: float, lower: float, level: str = "sequence",
                mode: str = "mask") -> tuple[Correction, torch.Tensor]:
    """Sequence-level masked (or truncated) importance sampling (Liu, Li et al. 2025; verl's
    sequence-level rollout IS / rejection sampling). With ``S`` the sequence statistic
    (:func:`sequence_log_ratio`), broadcast to every token of its sequence::

        mask, sequence:   c_t = R * 1[lower <= R <= upper]        (R = prod_t rho_t)
        mask, geometric:  c_t = 1[lower <= G <= upper]            (G = (prod_t rho_t)^(1/|T|); rejection only)
        truncate:         c_t = min(R, upper)                     (sequence level only)

    Returns the correction and the per-sequence ratio ``(B,)`` (R or G)."""
    lr, mask = _checked(log_ratio, mask)
    s = sequence_log_ratio(lr, mask, level)  # (B,)
    seq_ratio = s.clamp(max=_MAX_LOG_RATIO).exp()
    log_hi = math.log(upper)
    if mode == "truncate":
        if level != "sequence":
            raise ValueError("truncation uses the sequence product; the geometric mean is for rejection only")
        c_seq, masked_seq, truncated_seq = s.clamp(max=log_hi).exp(), torch.zeros_like(s, dtype=torch.bool), s > log_hi
    elif mode == "mask":
        keep = (s >= math.log(lower)) & (s <= log_hi)
        weight = seq_ratio if level == "sequence" else torch.ones_like(seq_ratio)
        c_seq = torch.where(keep, weight, torch.zeros_like(weight))
        masked_seq, truncated_seq = ~keep, torch.zeros_like(keep)
    else:
        raise ValueError(f"unknown mode {mode!r}; valid: mask, truncate")
    c = torch.where(mask, c_seq[:, None].expand_as(lr), torch.zeros_like(lr))
    masked = mask & masked_seq[:, None]
    truncated = mask & truncated_seq[:, None]
    metrics = correction_metrics(lr, mask, c, masked, truncated)
    rows = mask.any(dim=1)
    metrics.update({
        "correction/seq_ratio_p50": quantile(seq_ratio[rows], 0.5),
        "correction/seq_ratio_p99": quantile(seq_ratio[rows], 0.99),
        "correction/seq_ratio_max": seq_ratio[rows].max().item() if bool(rows.any()) else 0.0,
    })
    return Correction(c, masked, truncated, metrics), seq_ratio


def icepop_weights(log_ratio: torch.Tensor, mask: torch.Tensor, lower: float, upper: float) -> Correction:
    """IcePop (Ling Team 2025, Ring-1T report, arXiv:2510.18855): double-sided token masking::

        c_t = rho_t * 1[lower <= rho_t <= upper]       (the paper's M(k; alpha, beta))

    A token outside the band gets no gradient (dropped, not clipped)."""
    lr, mask = _checked(log_ratio, mask)
    keep = mask & (lr >= math.log(lower)) & (lr <= math.log(upper))
    c = torch.where(keep, lr.clamp(max=math.log(upper)).exp(), torch.zeros_like(lr))
    masked = mask & ~keep
    none = torch.zeros_like(mask)
    return Correction(c, masked, none, correction_metrics(lr, mask, c, masked, none))


class _NoCorrection:
    """Today's loss: the trainer's log-probs of the behaviour versions are never computed."""

    needs_trainer_logp = False
    options: frozenset[str] = frozenset()

    def resolve(self, s: CorrectionSettings) -> CorrectionSettings:
        return s

    def __call__(self, log_ratio: torch.Tensor, mask: torch.Tensor, s: CorrectionSettings) -> Correction:
        _, mask = _checked(log_ratio, mask)
        none = torch.zeros_like(mask)
        return Correction(mask.float(), none, none, {})


class _TIS:
    needs_trainer_logp = True
    options = frozenset({"cap"})

    def resolve(self, s: CorrectionSettings) -> CorrectionSettings:
        return CorrectionSettings(cap=2.0 if s.cap is None else s.cap)

    def __call__(self, log_ratio: torch.Tensor, mask: torch.Tensor, s: CorrectionSettings) -> Correction:
        return tis_weights(log_ratio, mask, self.resolve(s).cap)


class _MIS:
    needs_trainer_logp = True
    options = frozenset({"cap", "lower", "level", "mode"})

    def resolve(self, s: CorrectionSettings) -> CorrectionSettings:
        level, mode = s.level or "sequence", s.mode or "mask"
        if mode == "truncate" and level != "sequence":
            raise ValueError("mode 'truncate' needs level 'sequence': the geometric mean is a rejection statistic "
                             "(verl uses it to reject sequences, never as a weight)")
        if mode == "truncate" and s.lower is not None:
            raise ValueError("mode 'truncate' has no lower threshold (it only caps the sequence ratio from above)")
        # verl's defaults: hi 2 for the product, a tight 1.001 for the geometric mean (a mean
        # per-token deviation of 0.1%); lo = 1 / hi.
        cap = s.cap if s.cap is not None else (2.0 if level == "sequence" else 1.001)
        lower = s.lower if s.lower is not None else (1.0 / cap if mode == "mask" else None)
        return CorrectionSettings(cap=cap, lower=lower, level=level, mode=mode)

    def __call__(self, log_ratio: torch.Tensor, mask: torch.Tensor, s: CorrectionSettings) -> Correction:
        r = self.resolve(s)
        return mis_weights(log_ratio, mask, r.cap, r.lower or 0.0, r.level, r.mode)[0]


class _IcePop:
    needs_trainer_logp = True
    options = frozenset({"cap", "lower"})

    def resolve(self, s: CorrectionSettings) -> CorrectionSettings:
        return CorrectionSettings(cap=5.0 if s.cap is None else s.cap, lower=0.5 if s.lower is None else s.lower)

    def __call__(self, log_ratio: torch.Tensor, mask: torch.Tensor, s: CorrectionSettings) -> Correction:
        r = self.resolve(s)
        return icepop_weights(log_ratio, mask, r.lower, r.cap)


ROLLOUT_CORRECTIONS.register("none")(_NoCorrection())
ROLLOUT_CORRECTIONS.register("tis")(_TIS())
ROLLOUT_CORRECTIONS.register("mis")(_MIS())
ROLLOUT_CORRECTIONS.register("icepop")(_IcePop())


def trainer_logp_source(correction: str, max_staleness: int) -> str | None:
    """Where the trainer's log-probs of the behaviour versions come from, the cheapest exact way:

    * ``'trainer'`` when every token is on-policy (effective ``max_staleness`` 0: sync): the
      behaviour version is the trainer's weights before the update, so it is one no-grad forward
      at the start of the step (verl's ``old_log_prob``), the proximal forward itself when the
      proximal method runs one (recompute): no extra forward at all then.
    * ``'producer'`` otherwise: a token of version ``v`` trained at version ``v + d`` needs the
      weights of ``v``, which only the producer still has when it finishes the batch (the store
      keeps a version while a batch not yet trained can read it). The producer re-scores the batch
      with a trainer-numerics copy of the policy, one no-grad forward per version present (two
      with the mid-batch switch), in its own thread: beside the trainer's update.
    * None: no correction (nothing is computed).
    """
    if not ROLLOUT_CORRECTIONS.get(correction).needs_trainer_logp:
        return None
    return "trainer" if max_staleness == 0 else "producer"
