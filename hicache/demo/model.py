"""The demo's model: a small Llama with seeded random weights, and K/V conversion to and from the pool layout.

The pool layout of K/V for `n` tokens is one tensor of shape `(num_layers, 2, n, num_kv_heads, head_dim)`
(index 0 of the second axis is K, 1 is V), which is what `KVPool.write_tokens` takes and `read_tokens`
returns. Transformers keeps the same data per layer as `(batch=1, num_kv_heads, n, head_dim)` in a
`DynamicCache`; `kv_from_cache` and `cache_from_kv` convert between the two.

Everything here is synchronous and CPU-bound: the serving loop runs it in a worker thread.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

__all__ = [
    "DecodeResult",
    "DemoModel",
    "ModelSpec",
    "PrefillResult",
    "Steps",
    "build_model",
    "cache_from_kv",
    "full_logits",
    "kv_from_cache",
    "run_steps",
    "seeded_model",
]


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The shape of the demo model; the weights are drawn from `torch.manual_seed(seed)`.

    Attributes:
        num_layers: decoder layers.
        hidden_size: model width.
        intermediate_size: MLP width.
        num_heads: query heads.
        num_kv_heads: key/value heads (grouped-query attention when fewer than `num_heads`).
        head_dim: width of one head.
        vocab_size: token ids are in `[0, vocab_size)`.
        seed: the weight seed.
    """

    num_layers: int = 4
    hidden_size: int = 128
    intermediate_size: int = 344
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    vocab_size: int = 512
    seed: int = 0

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V of one token over all layers in float32."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * 4


def build_model(spec: ModelSpec) -> Any:
    """Build a `LlamaForCausalLM` with seeded random float32 weights, in eval mode.

    Eager attention is used: on CPU it gives bitwise-identical results for identical inputs and shapes,
    which is what the demo's bitwise checks rely on.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    # Typed loosely: transformers' stubs do not list every keyword its configs accept.
    config_cls: Any = LlamaConfig
    model_cls: Any = LlamaForCausalLM
    config = config_cls(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=8192,
        attn_implementation="eager",
        tie_word_embeddings=False,
    )
    return seeded_model(model_cls, config, spec.seed)


def seeded_model(model_cls: Any, config: Any, seed: int) -> Any:
    """`model_cls(config)` with weights drawn from `torch.manual_seed(seed)`, float32, in eval mode, frozen.

    The global RNG state is restored afterwards.
    """
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = model_cls(config)
    finally:
        torch.random.set_rng_state(state)
    model = model.to(dtype=torch.float32)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def full_logits(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of every position of `tokens` from one forward pass of `model` with no cache, `(n, vocab_size)`."""
    with torch.inference_mode():
        out = model(input_ids=tokens.unsqueeze(0), use_cache=False)
    return out.logits[0].clone()  # type: ignore[no-any-return]


def kv_from_cache(cache: Any, start: int, end: int) -> torch.Tensor:
    """K/V of positions `[start, end)` of a `DynamicCache` in the pool layout `(L, 2, n, H, D)` (a copy).

    Args:
        cache: a transformers `DynamicCache` of batch size 1.
        start: first position.
        end: one past the last position; at most `cache.get_seq_length()`.
    """
    length = int(cache.get_seq_length())
    if not 0 <= start <= end <= length:
        raise ValueError(f"start/end: need 0 <= start <= end <= {length}, got start={start}, end={end}")
    per_layer = []
    for layer in cache.layers:
        k = layer.keys[0, :, start:end, :]  # (H, n, D)
        v = layer.values[0, :, start:end, :]
        per_layer.append(torch.stack([k, v]).permute(0, 2, 1, 3))  # (2, n, H, D)
    return torch.stack(per_layer).contiguous()


def cache_from_kv(kv: torch.Tensor, config: Any = None) -> Any:
    """A `DynamicCache` holding K/V given in the pool layout `(L, 2, n, H, D)`.

    The per-layer tensors are made contiguous, exactly as the model's own cache holds them, so that a
    forward pass over the restored cache takes the same kernels as one over the model's own cache.

    Args:
        kv: K/V in the pool layout, float32 on the CPU.
        config: the model's config, passed on to `DynamicCache`.
    """
    from transformers import DynamicCache

    if kv.dim() != 5 or kv.shape[1] != 2:
        raise ValueError(f"kv: expected shape (L, 2, n, H, D), got {tuple(kv.shape)}")
    cache = DynamicCache(config=config) if config is not None else DynamicCache()
    if kv.shape[2] == 0:
        return cache
    for layer_idx in range(kv.shape[0]):
        k = kv[layer_idx, 0].permute(1, 0, 2).unsqueeze(0).contiguous()  # (1, H, n, D)
        v = kv[layer_idx, 1].permute(1, 0, 2).unsqueeze(0).contiguous()
        cache.update(k, v, layer_idx)
    return cache


T = TypeVar("T")

Steps = Generator[None, None, T]
"""A model call cut into steps: each `next()` runs one step; the return value is the call's result."""


def run_steps(steps: Steps[T]) -> T:
    """Run every step of `steps` at once and return its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """What a prefill produced.

    Attributes:
        logits_last: logits of the last input position, shape `(vocab_size,)`.
        kv_new: K/V of the new (input) tokens in the pool layout `(L, 2, n_new, H, D)`.
        cache: the `DynamicCache` now holding prefix and new tokens, ready for `decode`.
    """

    logits_last: torch.Tensor
    kv_new: torch.Tensor
    cache: Any


@dataclass(frozen=True, slots=True)
class DecodeResult:
    """What a greedy decode produced.

    Attributes:
        tokens: the generated token ids, the first one chosen from the prefill's logits.
        logits: the logits each token was chosen from, shape `(len(tokens), vocab_size)`.
        kv: K/V of the generated tokens that were fed back, all but the last, `(L, 2, len(tokens) - 1, H, D)`.
    """

    tokens: list[int]
    logits: torch.Tensor
    kv: torch.Tensor


class DemoModel:
    """A seeded Llama with the two operations a serving loop needs: prefill a suffix, decode greedily.

    Args:
        spec: the model's shape and weight seed.
    """

    def __init__(self, spec: ModelSpec | None = None) -> None:
        self.spec = spec if spec is not None else ModelSpec()
        self.model = build_model(self.spec)

    def __repr__(self) -> str:
        s = self.spec
        return (
            f"DemoModel(layers={s.num_layers}, hidden={s.hidden_size}, kv_heads={s.num_kv_heads}, "
            f"head_dim={s.head_dim}, vocab={s.vocab_size}, seed={s.seed})"
        )

    def prefill(self, tokens: torch.Tensor, past_kv: torch.Tensor | None) -> PrefillResult:
        """Run the model over `tokens[past_len:]`, continuing from `past_kv` (K/V of `tokens[:past_len]`).

        Args:
            tokens: the whole sequence so far, a 1-D int64 tensor.
            past_kv: K/V of a prefix of `tokens` in the pool layout, or `None` for a full prefill.

        Raises:
            ValueError: if nothing is left to prefill or `past_kv` does not fit the model.
        """
        if tokens.dim() != 1:
            raise ValueError(f"tokens: expected a 1-D tensor, got shape {tuple(tokens.shape)}")
        past_len = 0 if past_kv is None else int(past_kv.shape[2])
        if past_len >= tokens.numel():
            raise ValueError(
                f"past_kv: covers {past_len} of {tokens.numel()} tokens; nothing left to prefill"
            )
        cache = cache_from_kv(past_kv if past_kv is not None else self._empty_kv(), config=self.model.config)
        with torch.inference_mode():
            out = self.model(input_ids=tokens[past_len:].unsqueeze(0), cache=cache, use_cache=True)
        cache = out.cache
        return PrefillResult(
            logits_last=out.logits[0, -1].clone(),
            kv_new=kv_from_cache(cache, past_len, tokens.numel()),
            cache=cache,
        )

    def decode(self, prefill: PrefillResult, steps: int) -> DecodeResult:
        """Generate `steps` tokens greedily after a prefill.

        Args:
            prefill: the prefill to continue; its cache is extended in place.
            steps: tokens to generate (>= 1).
        """
        return run_steps(self.decode_steps(prefill, steps))

    def decode_steps(self, prefill: PrefillResult, steps: int) -> Steps[DecodeResult]:
        """`decode`, one forward pass per `next()`: a serving loop can let other requests in between.

        The generator's return value (`StopIteration.value`) is the `DecodeResult`.
        """
        if steps < 1:
            raise ValueError(f"steps: must be >= 1, got {steps}")
        cache = prefill.cache
        start = int(cache.get_seq_length())
        logits = [prefill.logits_last]
        tokens = [int(torch.argmax(prefill.logits_last))]
        for step in range(steps - 1):
            if step:  # between forward passes, not before the first or after the last
                yield
            # Per step: the next step may run in another worker thread, and inference mode is per thread.
            with torch.inference_mode():
                out = self.model(
                    input_ids=torch.tensor([[tokens[-1]]], dtype=torch.int64), cache=cache, use_cache=True
                )
            cache = out.cache
            step_logits = out.logits[0, -1].clone()
            logits.append(step_logits)
            tokens.append(int(torch.argmax(step_logits)))
        return DecodeResult(
            tokens=tokens,
            logits=torch.stack(logits),
            kv=kv_from_cache(cache, start, int(cache.get_seq_length())),
        )

    def continue_from(self, cache: Any, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of the last position after running the rest of `tokens` on `cache` (extended in place).

        Args:
            cache: a `DynamicCache` holding K/V of a prefix of `tokens`.
            tokens: the whole sequence, a 1-D int64 tensor longer than the cache.
        """
        past_len = int(cache.get_seq_length())
        if past_len >= tokens.numel():
            raise ValueError(f"cache: covers {past_len} of {tokens.numel()} tokens; nothing left to run")
        with torch.inference_mode():
            out = self.model(input_ids=tokens[past_len:].unsqueeze(0), cache=cache, use_cache=True)
        return out.logits[0, -1].clone()  # type: ignore[no-any-return]

    def full_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of every position of `tokens` from one forward pass with no cache, `(n, vocab_size)`."""
        return full_logits(self.model, tokens)

    def _empty_kv(self) -> torch.Tensor:
        s = self.spec
        return torch.empty((s.num_layers, 2, 0, s.num_kv_heads, s.head_dim), dtype=torch.float32)
