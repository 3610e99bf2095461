"""Online tuning of the streaming chunk size (OPPO intra-step overlap), pure logic.

A small chunk overlaps more (the scorers lag the actor by at most one chunk) but pays a
scorer forward and a queue hand-off per chunk; a large chunk is cheaper per token and
overlaps less. The best size depends on the models, the hardware and the answer lengths, so
it is measured rather than guessed:

* **probe**: each candidate (powers of two between ``chunk_min`` and ``chunk_max``, both
  bounds included) runs one step; the cost of a step is its latency per generated token;
* **exploit**: the cheapest candidate runs for ``probe_every`` steps;
* **re-probe** after those steps, or as soon as the mean answer length of a step moves more
  than ``shift`` (relative) away from its mean during the last probe: the length distribution
  shifted, and with it the trade-off. A re-probe tries the best size and its neighbours among the
  candidates only: a probe step at a far-off size costs up to twice a step (chunk 1 against 16
  on CPU, measured), and the best size moves by a step of the ladder at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def chunk_candidates(chunk_min: int, chunk_max: int) -> list[int]:
    """``chunk_min``, the powers of two strictly between, ``chunk_max`` (ascending, unique)."""
    if not 1 <= chunk_min <= chunk_max:
        raise ValueError(f"need 1 <= chunk_min <= chunk_max, got {chunk_min}, {chunk_max}")
    out, p = [chunk_min], 1
    while p < chunk_max:
        if p > chunk_min:
            out.append(p)
        p *= 2
    if chunk_max != chunk_min:
        out.append(chunk_max)
    return out


@dataclass
class ChunkTuner:
    chunk_min: int
    chunk_max: int
    probe_every: int = 20
    shift: float = 0.25
    candidates: list[int] = field(init=False)
    best: int = field(init=False)
    _probe: list[int] = field(init=False)  # candidates still to try in this probe
    _costs: dict[int, float] = field(init=False)
    _probe_lengths: list[float] = field(init=False)
    _exploit_steps: int = field(init=False, default=0)
    probes: int = field(init=False, default=0)  # probes started so far (logged)

    def __post_init__(self) -> None:
        if self.probe_every < 1:
            raise ValueError(f"probe_every must be >= 1, got {self.probe_every}")
        if self.shift <= 0:
            raise ValueError(f"shift must be > 0, got {self.shift}")
        self.candidates = chunk_candidates(self.chunk_min, self.chunk_max)
        self.best = self.candidates[0]
        self._start_probe()

    def _start_probe(self) -> None:
        if self.probes == 0:
            probe = list(self.candidates)
        else:  # the best and its neighbours on the ladder
            i = self.candidates.index(self.best)
            probe = self.candidates[max(0, i - 1):i + 2]
        self._probe, self._costs, self._probe_lengths = probe, {}, []
        self.probes += 1

    @property
    def probing(self) -> bool:
        return bool(self._probe)

    def chunk_size(self) -> int:
        """The size to use for the next step."""
        return self._probe[0] if self._probe else self.best

    def record(self, step_seconds: float, generated_tokens: int, mean_length: float) -> None:
        """Report the step just run with :meth:`chunk_size`: its latency, its generated tokens
        and its mean answer length."""
        size = self.chunk_size()
        if self._probe:
            self._costs[size] = step_seconds / max(generated_tokens, 1)
            self._probe_lengths.append(mean_length)
            self._probe.pop(0)
            if not self._probe:
                self.best = min(self._costs, key=lambda c: (self._costs[c], c))
                self._exploit_steps = 0
            return
        self._exploit_steps += 1
        ref = sum(self._probe_lengths) / len(self._probe_lengths)
        shifted = abs(mean_length - ref) > self.shift * max(ref, 1.0)
        if shifted or self._exploit_steps >= self.probe_every:
            self._start_probe()

    def state_dict(self) -> dict:
        """JSON-able state (checkpoints)."""
        return {"best": self.best, "probe": list(self._probe), "costs": {str(k): v for k, v in self._costs.items()},
                "probe_lengths": list(self._probe_lengths), "exploit_steps": self._exploit_steps, "probes": self.probes}

    def load_state_dict(self, state: dict) -> None:
        self.best, self._probe = int(state["best"]), [int(c) for c in state["probe"]]
        self._costs = {int(k): float(v) for k, v in state["costs"].items()}
        self._probe_lengths = [float(x) for x in state["probe_lengths"]]
        self._exploit_steps, self.probes = int(state["exploit_steps"]), int(state["probes"])
