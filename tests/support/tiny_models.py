"""Tiny Qwen2 and Llama causal LMs built from a config, shared by the tests of the decoders and
of the training forward: grouped-query attention, tied (Qwen2) or untied embeddings, and (Llama)
attention and MLP biases drawn non-zero so that they matter; and the micro preset's model in the
shape vLLM's CPU kernels take, saved as a folder."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

VOCAB, EOS, PAD = 40, 3, 0


def qwen2(**kw):
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=64, max_position_embeddings=128, tie_word_embeddings=True, eos_token_id=EOS,
                      pad_token_id=PAD, **kw)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return Qwen2ForCausalLM(cfg).eval()


def llama(**kw):
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                      intermediate_size=48, max_position_embeddings=128, tie_word_embeddings=False, attention_bias=True,
                      mlp_bias=True, eos_token_id=EOS, pad_token_id=PAD, **kw)
    with torch.random.fork_rng():
        torch.manual_seed(1)
        model = LlamaForCausalLM(cfg).eval()
        with torch.no_grad():  # the default init leaves biases at 0: make them matter
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0.0, 0.1)
        return model


def save_micro_h32(folder: Path) -> Path:
    """The micro preset's sizes with one head of 32 instead of two of 16 (vLLM's CPU attention has
    no kernel for head size 16), saved with its tokenizer as a model folder ``model.name`` takes."""
    from a3po.data.arithmetic import WORDS
    from a3po.models.factory import TinyArch, build_tiny_model

    model, tok = build_tiny_model(TinyArch(hidden_size=32, num_layers=1, num_heads=1, intermediate_size=64), WORDS, seed=0)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder
