"""A tokenizer built in code for the embedded task (no download): whole words from a fixed
vocabulary, single digits, single punctuation marks and whitespace as tokens of their own,
so decoding is plain concatenation and every number is spelled digit by digit."""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "<unk>", "<bos>", "<eos>"]
_DIGITS = list("0123456789")
_SYMBOLS = list(" \n.,?!:;'\"+-*/=()#$%<>[]{}\\^_")
_LETTERS = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
# A word outside the vocabulary becomes <unk>: the tiny model is for the embedded task only.
_SPLIT = Regex(r"[A-Za-z]+|\d|\s|[^A-Za-z\d\s]")


def build_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    """Word-level tokenizer over ``words`` plus digits, symbols and single letters (left padding)."""
    vocab: dict[str, int] = {}
    for tok in [*SPECIAL_TOKENS, *_DIGITS, *_SYMBOLS, *_LETTERS, *sorted(set(words))]:
        vocab.setdefault(tok, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(_SPLIT, behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<bos>", eos_token="<eos>"
    )
    fast.padding_side = "left"
    return fast
