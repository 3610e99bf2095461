"""The bytes between trainer rank 0 and the rollout workers (:mod:`a3po.placement.remote_rollouts`
is the trainer's side, :mod:`a3po.placement.worker_loop` the worker's).

Two gloo links (:class:`a3po.parallel.ranks.Link`: process groups of their own, outside the
trainer ranks' world) over {trainer rank 0, workers}, each used by one thread per process. Tensors
travel through host memory (gloo), on GPUs too: one transport, and exact.

* **weights** (broadcast from the trainer): a JSON hello (first batch, last batch, the weights'
  layout, the versions that follow at once: the checkpoint's history on resume; with OPPO the
  critic's layout and each worker's checkpointed OPPO state), then every version the trainer
  publishes, in order: an int64 header ``[version, bound]`` and the state dict as one byte buffer
  (exact: bytes, not values; in bf16 where the workers' engine decodes from a bf16 copy and nothing
  there needs more, :func:`version_wire`: the engine's own rounding, done before sending; a tied
  tensor once, :func:`tied_names`), with ``oppo.intra`` and a critic followed by the critic's state
  of that version; header ``[-1, 0]`` ends the run. ``bound`` is the staleness bound in force when
  the trainer published the version. With ``model.lora`` a version is the adapters alone.
* **samples** (send / recv, worker -> trainer; rank 0 re-broadcasts each batch to the other trainer
  ranks in the same framing): per batch an int64 header ``[index, JSON bytes]``, a JSON blob and
  the batch's tensors, each as its raw bytes. The format is the batch's own declaration
  (:func:`batch_fields`, read off :class:`a3po.producer.producer.ScoredBatch`'s fields): each
  field travels by its declared type, a tensor (``torch.Tensor``; ``| None``: only when present)
  as its bytes, a ``dict[str, torch.Tensor]`` (the OPPO scorers' streamed tensors) as one tensor
  per key, a dataclass (the :class:`~a3po.rollout.types.RolloutBatch`) field by field, JSON types
  (meta, completions, grader counters, figures, the OPPO states) in the blob, which also names the
  dtype and shape of every tensor that follows. A field no rule carries fails this module's import
  (or a subclass's first batch), naming it. Index ``-1`` carries a worker's error text instead.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import types
import typing
from typing import Any, Callable

import torch

from a3po.devices import DType
from a3po.models.lora import is_lora
from a3po.parallel.ranks import Link, launch_links
from a3po.placement.in_process import RolloutInputs
from a3po.producer.producer import ScoredBatch

TRAINER = 0  # global rank of the trainer, and its rank in the weights and samples links (worker k's is 1 + k)
STOP = -1  # weight header: the run is over; batch header index: an error text follows

Layout = list[list[Any]]  # [[name, dtype, shape], ...] in state-dict order


def rollout_links() -> tuple[Link, Link]:
    """(weights link, samples link) over trainer rank 0 and the workers, made by
    :func:`a3po.parallel.ranks.init_ranks`."""
    links = launch_links()
    assert links.weights is not None and links.samples is not None, (
        "only trainer rank 0 and the workers talk over these")
    return links.weights, links.samples


def version_wire(inp: RolloutInputs) -> torch.dtype | None:
    """The dtype a version's floating tensors travel in to the workers; None: the trainer's own
    (exact bytes). bf16 where the workers' torch engine decodes from a bf16 copy and nothing there
    needs the trainer's precision: the engine rounds each weight to bf16 as it loads it anyway (the
    same rounding, so the same samples), and a version is then half the bytes to pack, send, take
    in and keep. The trainer's own bytes where a worker re-scores in the trainer's precision
    (:attr:`~a3po.config.plan.RunPlan.rescore`), with LoRA (a version is the adapters, merged into
    the worker's own base) and with vLLM (whose loader casts as it loads; not checked on bf16 input)."""
    plan = inp.plan
    narrow = plan.engine_dtype is DType.BFLOAT16 and inp.cfg.rollout.engine == "torch"
    return torch.bfloat16 if narrow and not plan.rescore and not is_lora(inp.policy) else None


def wire_name(wire: torch.dtype | None) -> str | None:
    """``wire``'s name as the hello carries it (None: full precision)."""
    return None if wire is None else _dtype_name(wire)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --- weights: one byte buffer per version --------------------------------------------------------


def state_layout(state: dict[str, torch.Tensor], wire: torch.dtype | None = None) -> Layout:
    """Each tensor's name, dtype and shape as it travels: a floating tensor in ``wire`` where given."""
    return [[k, _dtype_name(_on_wire(v.dtype, wire)), list(v.shape)] for k, v in state.items()]


def _on_wire(dtype: torch.dtype, wire: torch.dtype | None) -> torch.dtype:
    return wire if wire is not None and dtype.is_floating_point else dtype


def _nbytes(dtype: str, shape: list[int]) -> int:
    return getattr(torch, dtype).itemsize * int(torch.Size(shape).numel())


def tied_names(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """``{name: earlier name}`` for each tensor of ``state`` that is an earlier one itself (tied
    weights: a causal LM's output head is often its input embeddings, ~20% of a small model's
    bytes); such a tensor travels once and the worker points both names at it."""
    seen: dict[tuple, str] = {}
    tied = {}
    for name, v in state.items():
        if v.numel() == 0:  # e.g. a parameter partitioned away (ZeRO-3): no storage to compare
            continue
        key = (v.data_ptr(), v.dtype, tuple(v.shape), v.stride())
        if key in seen:
            tied[name] = seen[key]
        else:
            seen[key] = name
    return tied


def packed_size(layout: Layout, tied: dict[str, str] | None = None) -> int:
    """The bytes of a state packed in ``layout`` (:func:`pack_state`), the ``tied`` names not sent."""
    return sum(_nbytes(d, s) for name, d, s in layout if name not in (tied or {}))


def _slot(buf: torch.Tensor, at: int, n: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor | None:
    """``buf[at:at + n]`` seen as a ``dtype`` tensor of ``shape``, or None where ``at`` is not a
    multiple of the element size (a view must be aligned: a bf16 tensor of odd length shifts the rest)."""
    return buf[at : at + n].view(dtype).view(shape) if at % dtype.itemsize == 0 else None


def pack_state(state: dict[str, torch.Tensor], wire: torch.dtype | None = None,
               tied: dict[str, str] | None = None) -> torch.Tensor:
    """The state dict's bytes, concatenated in order (CPU uint8), each of the ``tied`` names left
    out (:func:`tied_names`); with ``wire`` each floating tensor is cast to it on the way, in the
    same pass that copies it in."""
    tied = tied or {}
    layout = state_layout(state, wire)
    buf = torch.empty(packed_size(layout, tied), dtype=torch.uint8)
    at = 0
    for (name, dtype, shape), v in zip(layout, state.values(), strict=True):
        if name in tied:
            continue
        n, target = _nbytes(dtype, shape), getattr(torch, dtype)
        slot = _slot(buf, at, n, target, shape)
        if slot is not None:
            slot.copy_(v.detach())
        else:
            buf[at : at + n] = v.detach().to("cpu", target).reshape(-1).view(torch.uint8)
        at += n
    return buf


def unpack_state(buf: torch.Tensor, layout: Layout, device: torch.device,
                 tied: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """The tensors :func:`pack_state` packed: views into ``buf`` where aligned (no copy on the
    worker's core, which is the generation's), a copy where not; each ``tied`` name the very
    tensor of its earlier twin."""
    tied = tied or {}
    out, at = {}, 0
    for name, dtype, shape in layout:
        if name in tied:
            out[name] = out[tied[name]]
            continue
        n = _nbytes(dtype, shape)
        slot = _slot(buf, at, n, getattr(torch, dtype), shape)
        if slot is None:
            slot = buf[at : at + n].clone().view(getattr(torch, dtype)).view(shape)
        out[name] = slot.to(device)
        at += n
    return out


def push_version(version: int, bound: int, states: list[dict[str, torch.Tensor]], link: Link,
                 wire: torch.dtype | None = None, tied: dict[str, str] | None = None) -> int:
    """Version ``version`` with the staleness bound in force from it on: the policy's state (its
    floating tensors in ``wire`` where given, its ``tied`` names left out), then the critic's with
    ``oppo.intra``. Returns the policy's bytes sent."""
    link.broadcast(torch.tensor([version, bound], dtype=torch.int64), TRAINER)
    sent = 0
    for i, state in enumerate(states):
        buf = pack_state(state, wire, tied) if i == 0 else pack_state(state)
        link.broadcast(buf, TRAINER)
        sent = sent or buf.numel()
    return sent


def push_stop(link: Link) -> None:
    link.broadcast(torch.tensor([STOP, 0], dtype=torch.int64), TRAINER)


def receive_version(layouts: list[Layout], device: torch.device, link: Link,
                    tied: dict[str, str] | None = None) -> tuple[int, int, list[dict[str, torch.Tensor]]]:
    """What :func:`push_version` sent, ``(version, bound, states)`` (one state per layout);
    ``(STOP, 0, [])`` at the end of the run."""
    header = torch.empty(2, dtype=torch.int64)
    link.broadcast(header, TRAINER)
    version, bound = header.tolist()
    if version == STOP:
        return version, 0, []
    states = []
    for i, layout in enumerate(layouts):
        ties = tied if i == 0 else None  # the policy's
        buf = torch.empty(packed_size(layout, ties), dtype=torch.uint8)
        link.broadcast(buf, TRAINER)
        states.append(unpack_state(buf, layout, device, ties))
    return version, bound, states


# --- samples: worker -> trainer, the batch's own fields ------------------------------------------

TENSOR, OPTIONAL_TENSOR, TENSOR_DICT, NESTED, JSON = "tensor", "optional tensor", "tensor dict", "dataclass", "json"


@dataclasses.dataclass(frozen=True)
class WireField:
    """How one field of a batch travels: ``kind`` one of the rules above (``nested``: its dataclass)."""

    name: str
    kind: str
    nested: type | None = None
    init: bool = True


def _is_json_type(tp: Any) -> bool:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp in (type(None), bool, int, float, str, list, dict):
        return True
    if origin in (typing.Union, types.UnionType):
        return all(_is_json_type(a) for a in args)
    if origin is list:
        return all(_is_json_type(a) for a in args)
    return origin is dict and len(args) == 2 and args[0] is str and _is_json_type(args[1])


def _kind(tp: Any) -> tuple[str, type | None] | None:
    """The rule that carries a field declared ``tp``; None: none does."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is torch.Tensor:
        return TENSOR, None
    if origin in (typing.Union, types.UnionType) and set(args) == {torch.Tensor, type(None)}:
        return OPTIONAL_TENSOR, None
    if origin is dict and args == (str, torch.Tensor):
        return TENSOR_DICT, None
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        batch_fields(tp)  # its own fields must travel too
        return NESTED, tp
    return (JSON, None) if _is_json_type(tp) else None


@functools.cache
def batch_fields(cls: type) -> tuple[WireField, ...]:
    """How each field of dataclass ``cls`` travels, read off its declared types. Raises a
    TypeError naming the first field that no rule carries: a tensor, ``torch.Tensor | None``,
    ``dict[str, torch.Tensor]``, a dataclass, or JSON (None, bool, int, float, str, ``list[...]``,
    ``dict[str, ...]`` of those)."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        rule = _kind(hints[f.name])
        if rule is None:
            raise TypeError(f"{cls.__qualname__}.{f.name} (declared {hints[f.name]!r}) cannot travel between the "
                            "trainer and the rollout workers: declare it as a tensor, a torch.Tensor | None, a "
                            "dict[str, torch.Tensor], a dataclass or JSON types, or give a3po.placement.worker_wire "
                            "a rule for it")
        out.append(WireField(f.name, *rule, f.init))
    return tuple(out)


batch_fields(ScoredBatch)  # a ScoredBatch field no rule carries fails here, at import


def _flatten(obj: Any, prefix: str, blob: dict[str, Any], tensors: list[tuple[str, str | None, torch.Tensor]]) -> None:
    """``obj``'s JSON fields into ``blob`` and its tensors onto ``tensors`` (path, dict key), by path."""
    for f in batch_fields(type(obj)):
        path, value = prefix + f.name, getattr(obj, f.name)
        if f.kind == NESTED:
            if type(value) is not f.nested:  # a subclass's extra fields would not arrive
                raise TypeError(f"batch field {path} holds a {type(value).__qualname__}; only its declared "
                                f"{f.nested.__qualname__} travels to the trainer")
            _flatten(value, path + ".", blob, tensors)
        elif f.kind == JSON:
            blob[path] = value
        elif f.kind == TENSOR_DICT:
            tensors.extend((path, k, _tensor(f"{path}[{k!r}]", t)) for k, t in value.items())
        elif value is not None or f.kind == TENSOR:
            tensors.append((path, None, _tensor(path, value)))


def _tensor(path: str, value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"batch field {path} is declared a tensor but holds a {type(value).__qualname__}")
    return value


def _build(cls: type, prefix: str, blob: dict[str, Any], tensors: dict[str, Any]) -> Any:
    """The ``cls`` that :func:`_flatten` took apart, each field popped from ``blob`` or ``tensors``."""
    values = {}
    for f in batch_fields(cls):
        path = prefix + f.name
        if f.kind == NESTED:
            values[f.name] = _build(f.nested, path + ".", blob, tensors)
        else:
            source = blob if f.kind == JSON else tensors
            if path in source:
                values[f.name] = source.pop(path)
            elif f.kind in (JSON, TENSOR):
                raise ValueError(f"the batch received has no field {path}: trainer and workers run other code")
            else:  # an optional tensor or a tensor dict sent without one
                values[f.name] = {} if f.kind == TENSOR_DICT else None
    obj = cls(**{f.name: values[f.name] for f in batch_fields(cls) if f.init})
    for f in batch_fields(cls):
        if not f.init:
            setattr(obj, f.name, values[f.name])
    return obj


def _put_bytes(t: torch.Tensor, put: Callable[[torch.Tensor], Any]) -> None:
    if t.numel():  # nothing to move: the receiver knows the shape
        put(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8))


def _take_tensor(take: Callable[[torch.Tensor], Any], dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    buf = torch.empty(dtype.itemsize * int(torch.Size(shape).numel()), dtype=torch.uint8)
    if buf.numel():
        take(buf)
    return buf.view(dtype).view(shape)


def _json_ok(value: Any) -> bool:
    try:
        return json.dumps(value) is not None
    except (TypeError, ValueError):
        return False


def _text_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8) if text else torch.empty(0, dtype=torch.uint8)


def put_batch(sb: ScoredBatch, put: Callable[[torch.Tensor], Any]) -> None:
    """Batch ``sb`` (a :class:`ScoredBatch`, or a dataclass extending it) as ``put`` calls (one
    send or broadcast per tensor, CPU): an int64 header, the JSON blob, each tensor's bytes."""
    blob: dict[str, Any] = {}
    tensors: list[tuple[str, str | None, torch.Tensor]] = []
    _flatten(sb, "", blob, tensors)
    info = {"batch": type(sb).__qualname__, "fields": blob,
            "tensors": [[path, key, _dtype_name(t.dtype), list(t.shape)] for path, key, t in tensors]}
    try:
        text = json.dumps(info)
    except (TypeError, ValueError) as e:
        bad = next((p for p, v in blob.items() if not _json_ok(v)), "?")
        raise TypeError(f"batch field {bad} does not travel as JSON: {e}") from e
    data = _text_tensor(text)
    put(torch.tensor([sb.index, len(data)], dtype=torch.int64))
    _put_bytes(data, put)
    for _, _, t in tensors:
        _put_bytes(t, put)


def put_failure(text: str, put: Callable[[torch.Tensor], Any]) -> None:
    data = _text_tensor(text)
    put(torch.tensor([STOP, len(data)], dtype=torch.int64))
    _put_bytes(data, put)


def take_batch(take: Callable[[torch.Tensor], Any], device: torch.device,
               cls: type = ScoredBatch) -> ScoredBatch | str:
    """What :func:`put_batch` (or :func:`put_failure`) put, ``take`` filling each tensor in turn:
    a ``cls`` with its tensors on ``device``, or the error text."""
    header = torch.empty(2, dtype=torch.int64)
    take(header)
    index, nbytes = header.tolist()
    text = bytes(_take_tensor(take, torch.uint8, [nbytes]).numpy()).decode()
    if index == STOP:
        return text
    info = json.loads(text)
    if info["batch"] != cls.__qualname__:
        raise ValueError(f"received a {info['batch']} batch where a {cls.__qualname__} was expected")
    tensors: dict[str, Any] = {}
    for path, key, dtype, shape in info["tensors"]:
        t = _take_tensor(take, getattr(torch, dtype), shape).to(device)
        if key is None:
            tensors[path] = t
        else:
            tensors.setdefault(path, {})[key] = t
    batch = _build(cls, "", info["fields"], tensors)
    if info["fields"] or tensors:
        raise ValueError(f"the batch received has fields {sorted([*info['fields'], *tensors])} that a "
                         f"{cls.__qualname__} here lacks: trainer and workers run other code")
    return batch


def send_batch(sb: ScoredBatch, link: Link) -> None:
    put_batch(sb, lambda t: link.send(t, TRAINER))


def send_failure(text: str, link: Link) -> None:
    put_failure(text, lambda t: link.send(t, TRAINER))


def receive_batch(src: int, link: Link, device: torch.device) -> ScoredBatch | str:
    """The next batch from the worker of link rank ``src``, on ``device``; or the worker's error text."""
    return take_batch(lambda t: link.recv(t, src), device)
