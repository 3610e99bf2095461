"""Incremental decoders behind the rollout engine (:mod:`a3po.rollout.torch_engine`): prefill a left-padded
batch, then feed one token per row and step, returning the next-token logits each time.

Two kinds, chosen per model by :func:`decoder_for` through :data:`DECODERS` (keyed by the
transformers ``config.model_type``):

* ``generic``: the model's own forward with a transformers ``DynamicCache``; any causal LM.
* ``llama_like`` (registered for ``qwen2`` and ``llama``): the same decoder-layer math written
  as a handful of tensor ops per layer over a KV cache preallocated at full width. At the tiny
  sizes the CPU runs (hidden 96, 2 layers, 128 rows) a decode step of the generic path is
  mostly per-module Python and per-step ``torch.cat`` of the cache, not arithmetic; here a step
  writes one column in place. Rows that repeat a prompt (GRPO's group of samples per prompt) are
  prefilled once and their cache copied. Models whose config it does not cover (sliding window,
  another activation, a RoPE whose frequencies depend on the length) get ``generic``.

Both compute the logits of the same weights; they differ from a full forward only by float
rounding (different kernels), which the rollout tests bound. Each decoder holds the weights as
they were when it was built: after a weight swap the engine builds a new one and prefills again.
"""

from __future__ import annotations

import weakref
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from a3po.devices import autocast_for
from a3po.models.logprobs import cache_kwarg, forward_parameters
from a3po.registry import Registry


class Decoder(Protocol):
    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits ``(n, V)`` after the ``(n, W)`` prefix ``ids`` (``mask``: 1 = real token)."""

    def step(self, tokens: torch.Tensor, attend: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits ``(n, V)`` after one more token per row: ``tokens`` ``(n,)``, ``attend`` ``(n,)``
        (0: later tokens ignore it, e.g. padding after EOS), ``positions`` ``(n,)``."""


DecoderFactory = Callable[[torch.nn.Module, int, int], Decoder]  # (model, rows, max width) -> decoder
# Its names are declared in a3po.catalog.DECODER_NAMES, which config checks rollout.decoder against.
DECODERS: Registry[Callable[[torch.nn.Module], "DecoderFactory | None"]] = Registry("decoder")


def decoder_for(model: torch.nn.Module, name: str = "auto") -> DecoderFactory:
    """The decoder factory for ``model``: ``auto`` takes the one registered for its
    ``config.model_type`` when that one supports the config, else ``generic``; another name
    forces that decoder (raising when it does not support the model)."""
    if name == "auto":
        kind = getattr(getattr(model, "config", None), "model_type", None)
        factory = DECODERS.get(kind)(model) if kind in DECODERS else None
        return factory or DECODERS.get("generic")(model)
    factory = DECODERS.get(name)(model)
    if factory is None:
        raise ValueError(f"decoder {name!r} does not support this model ({type(model).__name__})")
    return factory


# --- generic: the model's own forward ------------------------------------------------------------


class HFDecoder:
    """``model(...)`` with a DynamicCache; the attention mask lives in one tensor allocated at
    full width (a view of its filled columns is passed), and only the last position's logits are
    computed where the model accepts ``logits_to_keep``."""

    def __init__(self, model: torch.nn.Module, n: int, max_width: int) -> None:
        self.model, self.cache, self.width = model, DynamicCache(), 0
        self.mask: torch.Tensor | None = None
        self.max_width = max_width
        self.keep = {"logits_to_keep": 1} if "logits_to_keep" in forward_parameters(model) else {}
        self.cache_kw = cache_kwarg(model) or "past_key_values"

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        with autocast_for(self.model):
            out = self.model(input_ids=ids, attention_mask=self.mask[:, : self.width], position_ids=positions,
                             use_cache=True, **{self.cache_kw: self.cache}, **self.keep)
        return out.logits[:, -1]

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        n, w = ids.shape
        self.mask = torch.zeros((n, self.max_width), dtype=mask.dtype, device=mask.device)
        self.mask[:, :w] = mask
        self.width = w
        return self._forward(ids, positions)

    def step(self, tokens: torch.Tensor, attend: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.mask[:, self.width] = attend
        self.width += 1
        return self._forward(tokens[:, None], positions[:, None])


@DECODERS.register("generic")
def generic(model: torch.nn.Module) -> DecoderFactory:
    return lambda m, n, max_width: HFDecoder(m, n, max_width)


# --- llama_like: Qwen2 / Llama decoder layers as plain tensor ops --------------------------------

# RoPE types whose frequencies do not depend on the sequence length, so one table serves a batch.
_STATIC_ROPE = ("default", "linear", "llama3")


def _llama_like_supported(model: torch.nn.Module) -> bool:
    cfg = getattr(model, "config", None)
    core = getattr(model, "model", None)
    if cfg is None or core is None or not hasattr(model, "lm_head"):
        return False
    rope_settings = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    rope = rope_settings.get("rope_type", "default")
    layer_types = getattr(cfg, "layer_types", None) or ["full_attention"]
    # Forward hooks (tests scripting outputs, instrumentation) must keep firing: this path calls
    # no module's forward but the head's.
    hooked = any(m._forward_hooks or m._forward_pre_hooks for m in model.modules() if m is not model.lm_head)
    return (not hooked and _plain_layers(core) and getattr(cfg, "hidden_act", None) == "silu" and rope in _STATIC_ROPE
            and all(t == "full_attention" for t in layer_types) and not getattr(cfg, "use_sliding_window", False)
            and getattr(cfg, "pretraining_tp", 1) == 1 and hasattr(core, "rotary_emb")
            and all(hasattr(layer.self_attn, "q_proj") and not hasattr(layer.self_attn, "q_norm")
                    for layer in core.layers))


def _plain_layers(core: torch.nn.Module) -> bool:
    """Whether every weight this path reads is a plain ``nn.Linear`` / ``nn.Embedding``'s: a wrapped
    layer (peft's LoRA layer adds ``B A x`` to its base's output) would be decoded without it."""
    names = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}
    layers = getattr(core, "layers", None)
    return (isinstance(getattr(core, "embed_tokens", None), torch.nn.Embedding) and layers is not None
            and all(isinstance(getattr(getattr(layer, part, None), n, None), torch.nn.Linear) for layer in layers
                    for part, ns in names.items() for n in ns))


def _cat_bias(weights: list[torch.Tensor], biases: list[torch.Tensor | None]) -> torch.Tensor | None:
    """The bias of ``cat(weights)``: None when every part has none, zeros for a part without."""
    if all(b is None for b in biases):
        return None
    return torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in zip(weights, biases, strict=True)])


def _rotate_half_rows(w: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """Rows of ``w`` ``(heads * head_dim, ...)`` rearranged so that ``w' x = rotate_half(w x)``
    per head (RoPE's ``rotate_half``: ``(a, b) -> (-b, a)``). A signed permutation, so exact."""
    half = head_dim // 2
    w = w.reshape(heads, head_dim, *w.shape[1:])
    return torch.cat((-w[:, half:], w[:, :half]), dim=1).reshape(heads * head_dim, *w.shape[2:])


_FUSED: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple, list]]" = weakref.WeakKeyDictionary()


def _fused_layers(model: torch.nn.Module) -> list[tuple]:
    """Per layer: the norms, ``q | k | v | rotate_half(q) | rotate_half(k)`` and ``gate | up`` fused
    weights and the transposed output weights. Built once per set of weights and reused by the
    decoders of later batches (each batch builds a decoder; copying every weight each time would
    cost a model's worth of memory traffic per batch). Any in-place change of a parameter
    (``load_state_dict``, an optimizer step) bumps its version counter and rebuilds them; writes
    through ``param.data`` bypass that counter (DeepSpeed copies its master weights that way), so
    the rollout engine also drops the copy whenever it is built or loads weights
    (:func:`forget_fused`)."""
    key = tuple((p.data_ptr(), p._version, p.dtype) for p in model.parameters())
    cached = _FUSED.get(model)
    if cached is not None and cached[0] == key:
        return cached[1]
    cfg, core = model.config, model.model
    attn0 = core.layers[0].self_attn
    hd, nq, nk = attn0.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    layers = []
    with torch.no_grad():
        for layer in core.layers:
            a, mlp = layer.self_attn, layer.mlp
            ws = [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight,
                  _rotate_half_rows(a.q_proj.weight, nq, hd), _rotate_half_rows(a.k_proj.weight, nk, hd)]
            bq, bk = a.q_proj.bias, a.k_proj.bias
            b_proj = _cat_bias(ws, [bq, bk, a.v_proj.bias, None if bq is None else _rotate_half_rows(bq, nq, hd),
                                    None if bk is None else _rotate_half_rows(bk, nk, hd)])
            gate_up = [mlp.gate_proj.weight, mlp.up_proj.weight]
            layers.append((
                layer.input_layernorm.weight, torch.cat(ws), b_proj, a.o_proj.weight.t(), a.o_proj.bias,
                layer.post_attention_layernorm.weight, torch.cat(gate_up),
                _cat_bias(gate_up, [mlp.gate_proj.bias, mlp.up_proj.bias]), mlp.down_proj.weight.t(),
                mlp.down_proj.bias))
    _FUSED[model] = (key, layers)
    return layers


def forget_fused(model: torch.nn.Module) -> None:
    """Drop ``model``'s fused weights: the next decoder rebuilds them from its parameters."""
    _FUSED.pop(model, None)


class LlamaLikeDecoder:
    """Pre-norm decoder layers: ``x += o(attn(rope(q), rope(k), v))``, ``x += down(silu(gate) * up)``,
    RMSNorm before each, tied or untied head.

    Per layer and step, one matmul gives ``q | k | v | rotate_half(q) | rotate_half(k)`` (the
    rotation folded into the weights), so RoPE is ``qk * cos + qk_rot * sin`` over one flat
    tensor, with the attention scale folded into the query's tables; the KV cache is preallocated
    at full width, keys stored transposed ``(n * kv_heads, head_dim, W)`` and values
    ``(n * kv_heads, W, head_dim)`` so each step writes one column and attends with two batched
    matmuls; the key mask is an additive bias (0 or -inf) of the same width."""

    def __init__(self, model: torch.nn.Module, n: int, max_width: int) -> None:
        cfg, core = model.config, model.model
        self.model, self.n, self.max_width = model, n, max_width
        attn0 = core.layers[0].self_attn
        hd, nq, nk = attn0.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim, self.heads, self.kv_heads = hd, nq, nk
        self.eps = core.norm.variance_epsilon
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.layers = _fused_layers(model)  # the weights as they are now (a weight swap builds a new decoder)
        self.embed, self.norm, self.head = core.embed_tokens.weight, core.norm.weight, model.lm_head
        self.k_t = [torch.empty((n * nk, hd, max_width), dtype=self.dtype, device=self.device) for _ in core.layers]
        self.v = [torch.empty((n * nk, max_width, hd), dtype=self.dtype, device=self.device) for _ in core.layers]
        self.key_bias = torch.full((n, nk, 1, max_width), float("-inf"), dtype=self.dtype, device=self.device)
        with torch.no_grad():  # RoPE tables over every position a row can reach, tiled over q and k heads
            cos, sin = core.rotary_emb(self.embed[:1, None], torch.arange(max_width, device=self.device)[None])
            # In float32 whatever the weights: in bf16 the folded scale would round once more than
            # the model's own forward does (q and k are cast to the weights' dtype where stored or multiplied).
            cos, sin = cos.float(), sin.float()
            scale = torch.cat([torch.full((nq * hd,), attn0.scaling), torch.ones(nk * hd)]).to(self.device)
            self.cos = torch.cat([cos[0].repeat(1, nq), cos[0].repeat(1, nk)], dim=1) * scale  # (P, (nq + nk) hd)
            self.sin = torch.cat([sin[0].repeat(1, nq), sin[0].repeat(1, nk)], dim=1) * scale
        self.width = 0

    def _attn_in(self, x: torch.Tensor, i: int, cos: torch.Tensor, sin: torch.Tensor):
        """``x`` ``(r, H)`` -> RoPE'd ``q`` (scaled) ``(r, nq hd)``, ``k`` ``(r, nk hd)``, ``v`` ``(r, nk hd)``."""
        w_in, w_proj, b_proj = self.layers[i][:3]
        nq, nk, hd = self.heads, self.kv_heads, self.head_dim
        proj = F.linear(F.rms_norm(x, x.shape[-1:], w_in, self.eps), w_proj, b_proj)
        qk, v, qk_rot = proj.split(((nq + nk) * hd, nk * hd, (nq + nk) * hd), dim=-1)
        qk = torch.addcmul(qk * cos, qk_rot, sin).to(proj.dtype)  # tables in fp32: one rounding to the weights' dtype
        return qk[:, : nq * hd], qk[:, nq * hd :], v

    def _attn_out_and_mlp(self, x: torch.Tensor, o: torch.Tensor, i: int) -> torch.Tensor:
        """Residual adds of the attention output ``o`` ``(r, nq hd)`` and of the MLP."""
        w_o_t, b_o, w_post, w_gu, b_gu, w_down_t, b_down = self.layers[i][3:]
        x = torch.addmm(x, o, w_o_t) if b_o is None else torch.addmm(x + b_o, o, w_o_t)
        gate, up = F.linear(F.rms_norm(x, x.shape[-1:], w_post, self.eps), w_gu, b_gu).chunk(2, dim=-1)
        hidden = F.silu(gate) * up
        return torch.addmm(x, hidden, w_down_t) if b_down is None else torch.addmm(x + b_down, hidden, w_down_t)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """``(r, V)`` logits of ``x`` ``(r, H)`` (the head module sees ``(r, 1, H)``, as in the
        model's own forward with ``logits_to_keep=1``, so hooks on it see that shape)."""
        return self.head(F.rms_norm(x, x.shape[-1:], self.norm, self.eps)[:, None])[:, -1]

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        n, w = ids.shape
        nq, nk, hd = self.heads, self.kv_heads, self.head_dim
        # Rows with the same prefix (a GRPO group) are computed once, then copied.
        uniq, inverse = torch.unique(torch.cat([ids, mask.to(ids.dtype)], dim=1), dim=0, return_inverse=True)
        u = len(uniq)
        u_ids, u_mask = uniq[:, :w], uniq[:, w:].bool()
        u_pos = positions.new_zeros((u, w)).index_copy_(0, inverse, positions).reshape(-1)
        # Causal and padding mask; each position also sees itself, so a padding position's output
        # stays finite (real positions never attend to padding).
        causal = torch.ones((w, w), dtype=torch.bool, device=ids.device).tril()
        diagonal = torch.eye(w, dtype=torch.bool, device=ids.device)
        allowed = ((causal[None] & u_mask[:, None, :]) | diagonal[None])[:, None]
        with autocast_for(self.model):
            x = F.embedding(u_ids.reshape(-1), self.embed)  # (u w, H)
            cos, sin = self.cos[u_pos], self.sin[u_pos]
            for i in range(len(self.layers)):
                q, k, v = self._attn_in(x, i, cos, sin)
                q, k, v = (t.reshape(u, w, -1, hd).transpose(1, 2) for t in (q, k, v))  # (u, heads, w, hd)
                self.k_t[i][:, :, :w] = k[inverse].transpose(2, 3).reshape(n * nk, hd, w)
                self.v[i][:, :w] = v[inverse].reshape(n * nk, w, hd)
                if nq != nk:
                    k, v = k.repeat_interleave(nq // nk, dim=1), v.repeat_interleave(nq // nk, dim=1)
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=1.0)  # q carries the scale
                x = self._attn_out_and_mlp(x, o.transpose(1, 2).reshape(u * w, nq * hd), i)
            logits = self._logits(x.view(u, w, -1)[:, -1][inverse])  # every row in order (hooks on the head too)
        self.key_bias[:, :, 0, :w] = torch.where(mask.bool(), 0.0, float("-inf"))[:, None]
        self.width = w
        return logits

    def step(self, tokens: torch.Tensor, attend_col: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        c = self.width
        if c >= self.max_width:
            raise ValueError(f"the decoder was built for {self.max_width} columns")
        n, nq, nk, hd = self.n, self.heads, self.kv_heads, self.head_dim
        self.key_bias[:, :, 0, c] = torch.where(attend_col.bool(), 0.0, float("-inf"))[:, None]
        bias = self.key_bias.view(n * nk, 1, -1)[:, :, : c + 1]
        with autocast_for(self.model):
            x = F.embedding(tokens, self.embed)  # (n, H)
            cos, sin = self.cos[positions], self.sin[positions]
            for i in range(len(self.layers)):
                q, k, v = self._attn_in(x, i, cos, sin)
                # This column of the cache, then softmax(q K^T + bias) V over the columns so far
                # (the query heads of one KV head as the rows of one small matmul).
                self.k_t[i][:, :, c] = k.reshape(n * nk, hd)
                self.v[i][:, c] = v.reshape(n * nk, hd)
                scores = torch.baddbmm(bias, q.reshape(n * nk, nq // nk, hd), self.k_t[i][:, :, : c + 1])
                probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
                o = torch.bmm(probs, self.v[i][:, : c + 1]).reshape(n, nq * hd)
                x = self._attn_out_and_mlp(x, o, i)
            logits = self._logits(x)
        self.width = c + 1
        return logits


@DECODERS.register("llama_like")
def llama_like(model: torch.nn.Module) -> DecoderFactory | None:
    return (lambda m, n, max_width: LlamaLikeDecoder(m, n, max_width)) if _llama_like_supported(model) else None


for _model_type in ("qwen2", "llama"):
    DECODERS.register(_model_type)(llama_like)
