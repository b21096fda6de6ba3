"""A tiny random-weight Llama for vLLM tests and benchmarks, written to a directory: `config.json` plus an
offline word-level `tokenizer.json` (built with the `tokenizers` library, nothing downloaded).

vLLM loads it with `load_format="dummy"` (random weights), so the directory holds no weights at all.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["VOCAB_WORDS", "write_tiny_llama"]

VOCAB_WORDS = 480
"""Words of the word-level vocabulary (`w0` ... `w479`), after the special tokens."""


def write_tiny_llama(
    directory: Path,
    *,
    hidden_size: int = 256,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 512,
    vocab_size: int = 512,
    max_position_embeddings: int = 4096,
    tokenizer: bool = True,
) -> Path:
    """Write a Llama `config.json` (and `tokenizer.json`) into `directory`; returns `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    if tokenizer:
        _write_tokenizer(directory)
    return directory


def _write_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i in range(VOCAB_WORDS):
        vocab[f"w{i}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "unk_token": "<unk>",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "model_max_length": 4096,
            }
        )
    )
