"""The hybrid demo model: a tiny seeded `LaraMiniForCausalLM` with full, sliding-window and linear layers.

transformers' LaraMini decoder repeats five layer types, `linear_attention` (a gated DeltaNet: a causal
convolution and a recurrent state), `sliding_attention`, `linear_attention`, `full_attention`,
`sliding_attention`, and runs on the CPU with transformers' reference PyTorch kernels. Its per-prefix state
maps onto the cache's three components:

* full-attention layers: K/V of every token, in the cache's base pool, layout `(L_full, 2, n, H, D)`;
* sliding-window layers: K/V of the last `window = sliding_window - 1` tokens (what transformers'
  `DynamicSlidingWindowLayer` keeps), in the `SlidingWindow` component's pool, `(L_swa, 2, n, H, D)`;
* linear-attention layers: the conv state `(1, C, K)` and the recurrent state `(1, Hv, Dk, Dv)` of every
  such layer at the end of the prefix, packed into one `MambaState` slot of `state_nbytes` bytes.

A prefix of `n` tokens is restored by filling a fresh `DynamicCache` from those tensors (`cache_from_parts`):
the forward pass that follows sees exactly the inputs it would see continuing its own in-memory cache.

Everything here is synchronous and CPU-bound: the serving loop runs it in a worker thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from hicache.demo.model import Steps, full_logits, run_steps, seeded_model

__all__ = [
    "HybridDecode",
    "HybridModel",
    "HybridParts",
    "HybridPrefill",
    "HybridPrefix",
    "HybridSpec",
    "build_hybrid_model",
]

_FULL, _SLIDING, _LINEAR = "full_attention", "sliding_attention", "linear_attention"

KVPair = tuple[torch.Tensor, torch.Tensor]
"""One attention layer's `(keys, values)`, each `(1, num_kv_heads, n, head_dim)` (transformers' layout)."""


@dataclass(frozen=True, slots=True)
class HybridSpec:
    """The shape of the hybrid demo model; the weights are drawn from `torch.manual_seed(seed)`.

    Attributes:
        num_layers: decoder layers; types follow LaraMini's period-5 pattern (linear, sliding, linear,
            full, sliding), so 5 gives two linear, two sliding and one full-attention layer.
        hidden_size: model width.
        num_heads: query heads of the attention layers.
        num_kv_heads: key/value heads of the attention layers.
        head_dim: width of one attention head.
        linear_key_heads: key heads of the linear-attention layers.
        linear_value_heads: value heads of the linear-attention layers.
        linear_head_dim: key and value head width of the linear-attention layers.
        conv_kernel: the linear layers' causal convolution width (the conv state keeps that many tokens).
        num_experts: MoE experts per layer.
        experts_per_token: experts routed per token.
        expert_size: width of one expert (and of the shared expert).
        sliding_window: transformers' `sliding_window`: a query attends to itself and the
            `sliding_window - 1` tokens before it.
        vocab_size: token ids are in `[0, vocab_size)`.
        seed: the weight seed.
    """

    num_layers: int = 5
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    linear_key_heads: int = 2
    linear_value_heads: int = 4
    linear_head_dim: int = 16
    conv_kernel: int = 4
    num_experts: int = 4
    experts_per_token: int = 2
    expert_size: int = 64
    sliding_window: int = 17
    vocab_size: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "seed" else 1):
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if self.num_layers < 4:
            raise ValueError(f"num_layers: need >= 4 for a full-attention layer, got {self.num_layers}")
        if self.sliding_window < 2:
            raise ValueError(f"sliding_window: expected >= 2, got {self.sliding_window}")

    @property
    def layer_types(self) -> tuple[str, ...]:
        """Each layer's type, LaraMini's default pattern."""
        pattern = (_LINEAR, _SLIDING, _LINEAR, _FULL, _SLIDING)
        return tuple(pattern[i % len(pattern)] for i in range(self.num_layers))

    def layers_of(self, kind: str) -> tuple[int, ...]:
        """Indices of the layers of type `kind` (`full_attention`, `sliding_attention`, `linear_attention`)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == kind)

    @property
    def window(self) -> int:
        """Tokens of sliding-window K/V a prefix needs (what the model's sliding layers keep)."""
        return self.sliding_window - 1

    @property
    def conv_channels(self) -> int:
        """Channels of a linear layer's conv state: query, key and value projections."""
        return (2 * self.linear_key_heads + self.linear_value_heads) * self.linear_head_dim

    @property
    def state_numel(self) -> int:
        """float32 elements of one prefix's recurrent state over all linear layers."""
        d = self.linear_head_dim
        per_layer = self.conv_channels * self.conv_kernel + self.linear_value_heads * d * d
        return per_layer * len(self.layers_of(_LINEAR))

    @property
    def state_nbytes(self) -> int:
        """Bytes of one packed state (the `MambaState` slot size)."""
        return self.state_numel * 4


def build_hybrid_model(spec: HybridSpec) -> Any:
    """Build a `LaraMiniForCausalLM` with seeded random float32 weights, in eval mode, eager attention."""
    from transformers import LaraMiniConfig, LaraMiniForCausalLM

    # Typed loosely: transformers' stubs do not list every keyword its configs accept.
    config_cls: Any = LaraMiniConfig
    model_cls: Any = LaraMiniForCausalLM
    config = config_cls(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        linear_conv_kernel_dim=spec.conv_kernel,
        linear_key_head_dim=spec.linear_head_dim,
        linear_value_head_dim=spec.linear_head_dim,
        linear_num_key_heads=spec.linear_key_heads,
        linear_num_value_heads=spec.linear_value_heads,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.experts_per_token,
        moe_intermediate_size=spec.expert_size,
        shared_expert_intermediate_size=spec.expert_size,
        sliding_window=spec.sliding_window,
        layer_types=list(spec.layer_types),
        max_position_embeddings=8192,
        eos_token_id=None,
        attn_implementation="eager",
        tie_word_embeddings=False,
    )
    return seeded_model(model_cls, config, spec.seed)


def _recording_cache_class() -> type:
    """A `DynamicCache` that also keeps every K/V update (the new tokens of each attention layer)."""
    from transformers import DynamicCache

    class RecordingCache(DynamicCache):
        def __init__(self, config: Any) -> None:
            super().__init__(config=config)
            self.origin = 0
            self.recorded: dict[int, list[KVPair]] = {}

        def update(
            self,
            key_states: torch.Tensor,
            value_states: torch.Tensor,
            layer_idx: int,
            *args: Any,
            **kwargs: Any,
        ) -> Any:
            self.recorded.setdefault(layer_idx, []).append((key_states, value_states))
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    return RecordingCache


@dataclass(frozen=True, slots=True)
class HybridParts:
    """A prefix's restorable state in transformers' layouts.

    Attributes:
        length: tokens in the prefix.
        full: per full-attention layer, K/V of all `length` tokens.
        swa: per sliding layer, K/V of the last `min(window, length)` tokens.
        states: per linear layer, `(conv_state, recurrent_state)` at the end of the prefix.
    """

    length: int
    full: tuple[KVPair, ...]
    swa: tuple[KVPair, ...]
    states: tuple[KVPair, ...]


@dataclass(frozen=True, slots=True)
class HybridPrefix:
    """A prefix's restorable state in the cache's pool layouts (what the three pools hold).

    Attributes:
        length: tokens in the prefix.
        full_kv: `(L_full, 2, length, H, D)` float32.
        swa_kv: `(L_swa, 2, min(window, length), H, D)` float32: the window before the prefix's end.
        state: `(state_nbytes,)` uint8: every linear layer's conv and recurrent state, packed.
    """

    length: int
    full_kv: torch.Tensor
    swa_kv: torch.Tensor
    state: torch.Tensor


@dataclass(slots=True)
class HybridPrefill:
    """What a prefill produced.

    Attributes:
        logits_last: logits of the last input position, `(vocab_size,)`.
        cache: the recording `DynamicCache`, ready for `decode`.
        start: the prefix length the prefill continued from.
        splits: where the input was cut into separate forward passes (besides `start` and the end).
        state_at: position -> packed state snapshot taken there.
    """

    logits_last: torch.Tensor
    cache: Any
    start: int
    splits: tuple[int, ...]
    state_at: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class HybridDecode:
    """What a greedy decode produced.

    Attributes:
        tokens: the generated tokens, the first one chosen from the prefill's logits.
        logits: the logits each token was chosen from, `(len(tokens), vocab_size)`.
    """

    tokens: list[int]
    logits: torch.Tensor


class HybridModel:
    """A seeded LaraMini with prefill/decode, state snapshots at chosen positions, and prefix restore.

    Args:
        spec: the model's shape and weight seed.
    """

    def __init__(self, spec: HybridSpec | None = None) -> None:
        self.spec = spec if spec is not None else HybridSpec()
        self.model = build_hybrid_model(self.spec)
        self.config = self.model.config
        self.full_layers = self.spec.layers_of(_FULL)
        self.swa_layers = self.spec.layers_of(_SLIDING)
        self.linear_layers = self.spec.layers_of(_LINEAR)
        self._cache_cls = _recording_cache_class()

    def __repr__(self) -> str:
        s = self.spec
        return (
            f"HybridModel(layers={''.join(t[0].upper() for t in s.layer_types)}, hidden={s.hidden_size}, "
            f"kv_heads={s.num_kv_heads}, window={s.window}, state_nbytes={s.state_nbytes}, seed={s.seed})"
        )

    # ------------------------------------------------------------------ caches

    def new_cache(self) -> Any:
        """An empty recording cache."""
        return self._cache_cls(self.config)

    def cache_from_parts(self, parts: HybridParts) -> Any:
        """A recording cache holding a prefix restored from its parts (made contiguous, as the model's own)."""
        cache = self.new_cache()
        cache.origin = parts.length
        if parts.length == 0:
            return cache
        for idx, (k, v) in zip(self.full_layers, parts.full, strict=True):
            cache.layers[idx].update(k.contiguous(), v.contiguous())
        for idx, (k, v) in zip(self.swa_layers, parts.swa, strict=True):
            layer = cache.layers[idx]
            layer.update(k.contiguous(), v.contiguous())
            # The sliding layer counts every token it has seen, not only those it keeps.
            layer.cumulative_length = parts.length
        for idx, (conv, rec) in zip(self.linear_layers, parts.states, strict=True):
            cache.update_conv_state(conv.contiguous(), idx, conv_kernel_size=self.spec.conv_kernel)
            cache.update_recurrent_state(rec.contiguous(), idx)
        return cache

    def parts_from_prefix(self, prefix: HybridPrefix) -> HybridParts:
        """Convert a prefix from the pool layouts to transformers' layouts (copies)."""
        return HybridParts(
            length=prefix.length,
            full=_pairs_from_pool(prefix.full_kv),
            swa=_pairs_from_pool(prefix.swa_kv),
            states=self.unpack_state(prefix.state),
        )

    def cache_from_prefix(self, prefix: HybridPrefix) -> Any:
        """A recording cache holding `prefix` (pool layouts)."""
        return self.cache_from_parts(self.parts_from_prefix(prefix))

    def pack_state(self, cache: Any) -> torch.Tensor:
        """Every linear layer's conv and recurrent state of `cache`, packed as `(state_nbytes,)` uint8."""
        flat = [
            t.reshape(-1)
            for idx in self.linear_layers
            for t in (cache.layers[idx].conv_states[0], cache.layers[idx].recurrent_states[0])
        ]
        return torch.cat(flat).view(torch.uint8).clone()

    def unpack_state(self, state: torch.Tensor) -> tuple[KVPair, ...]:
        """The inverse of `pack_state`: per linear layer `(conv_state, recurrent_state)` (copies)."""
        s = self.spec
        if state.dtype != torch.uint8 or state.numel() != s.state_nbytes:
            raise ValueError(
                f"state: expected {s.state_nbytes} uint8 bytes, got {state.numel()} {state.dtype}"
            )
        values = state.reshape(-1).clone().view(torch.float32)
        conv_n = s.conv_channels * s.conv_kernel
        d = s.linear_head_dim
        rec_n = s.linear_value_heads * d * d
        out: list[KVPair] = []
        pos = 0
        for _ in self.linear_layers:
            conv = values[pos : pos + conv_n].reshape(1, s.conv_channels, s.conv_kernel)
            rec = values[pos + conv_n : pos + conv_n + rec_n].reshape(1, s.linear_value_heads, d, d)
            out.append((conv, rec))
            pos += conv_n + rec_n
        return tuple(out)

    def new_kv(self, cache: Any, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V the model computed itself for positions `[start, end)`, in the pool layouts.

        Returns:
            `(full_kv, swa_kv)`: `(L_full, 2, n, H, D)` and `(L_swa, 2, n, H, D)`.
        """
        return (
            _pool_from_pairs(self.recorded_pairs(cache, self.full_layers, start, end)),
            _pool_from_pairs(self.recorded_pairs(cache, self.swa_layers, start, end)),
        )

    def recorded_pairs(self, cache: Any, layers: tuple[int, ...], start: int, end: int) -> tuple[KVPair, ...]:
        """Per layer of `layers`, the K/V updates the model made for positions `[start, end)`."""
        origin = int(cache.origin)
        if not origin <= start <= end <= int(cache.get_seq_length()):
            raise ValueError(
                f"start/end: need {origin} <= start <= end <= {int(cache.get_seq_length())}, got {start}, {end}"
            )
        out: list[KVPair] = []
        for idx in layers:
            updates = cache.recorded.get(idx, [])
            keys = torch.cat([k for k, _ in updates], dim=2)[:, :, start - origin : end - origin]
            values = torch.cat([v for _, v in updates], dim=2)[:, :, start - origin : end - origin]
            out.append((keys, values))
        return tuple(out)

    # ------------------------------------------------------------------ forward passes

    def _forward(self, cache: Any, tokens: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            out = self.model(input_ids=tokens.unsqueeze(0), cache=cache, use_cache=True)
        return out.logits[0, -1].clone()  # type: ignore[no-any-return]

    def prefill(
        self, tokens: torch.Tensor, prefix: HybridPrefix | None, snapshot_at: int | None = None
    ) -> HybridPrefill:
        """Run the model over the tokens after `prefix`, taking a state snapshot at `snapshot_at`.

        When `snapshot_at` falls strictly inside the new tokens, the input is run as two forward passes
        split there (a recurrent state exists only at the end of a pass).

        Args:
            tokens: the whole sequence so far, a 1-D int64 tensor.
            prefix: the restored state of a prefix of `tokens`, or `None` for a full prefill.
            snapshot_at: a position whose state to keep, or `None`.

        Raises:
            ValueError: if nothing is left to prefill.
        """
        if tokens.dim() != 1:
            raise ValueError(f"tokens: expected a 1-D tensor, got shape {tuple(tokens.shape)}")
        start = 0 if prefix is None else prefix.length
        n = int(tokens.numel())
        if start >= n:
            raise ValueError(f"prefix: covers {start} of {n} tokens; nothing left to prefill")
        cache = self.new_cache() if prefix is None else self.cache_from_prefix(prefix)
        splits = (snapshot_at,) if snapshot_at is not None and start < snapshot_at < n else ()
        result = HybridPrefill(torch.empty(0), cache, start, splits)
        result.logits_last = self.continue_from(cache, tokens, splits, result.state_at)
        if snapshot_at == n:
            result.state_at[n] = self.pack_state(cache)
        return result

    def continue_from(
        self,
        cache: Any,
        tokens: torch.Tensor,
        splits: tuple[int, ...] = (),
        state_at: dict[int, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Logits of the last position after running the rest of `tokens` on `cache`, cut at `splits`.

        Args:
            cache: a cache holding a prefix of `tokens` (extended in place).
            tokens: the whole sequence, longer than the cache.
            splits: positions where one forward pass ends and the next begins.
            state_at: if given, receives the packed state at each split.
        """
        past = int(cache.get_seq_length())
        n = int(tokens.numel())
        if past >= n:
            raise ValueError(f"cache: covers {past} of {n} tokens; nothing left to run")
        logits = torch.empty(0)
        for lo, hi in zip((past, *splits), (*splits, n), strict=True):
            logits = self._forward(cache, tokens[lo:hi])
            if state_at is not None and hi != n:
                state_at[hi] = self.pack_state(cache)
        return logits

    def decode(self, prefill: HybridPrefill, steps: int, snapshot_at: int | None = None) -> HybridDecode:
        """Generate `steps` tokens greedily after a prefill, snapshotting the state at `snapshot_at`.

        Args:
            prefill: the prefill to continue; its cache is extended in place.
            steps: tokens to generate (>= 1); all but the last are fed back.
            snapshot_at: a position (prefill end < it <= prefill end + steps - 1) whose state to keep.
        """
        return run_steps(self.decode_steps(prefill, steps, snapshot_at))

    def decode_steps(
        self, prefill: HybridPrefill, steps: int, snapshot_at: int | None = None
    ) -> Steps[HybridDecode]:
        """`decode`, one forward pass per `next()`; the generator's return value is the `HybridDecode`."""
        if steps < 1:
            raise ValueError(f"steps: must be >= 1, got {steps}")
        cache = prefill.cache
        logits = [prefill.logits_last]
        tokens = [int(torch.argmax(prefill.logits_last))]
        for step in range(steps - 1):
            if step:  # between forward passes, not before the first or after the last
                yield
            step_logits = self._forward(cache, torch.tensor([tokens[-1]], dtype=torch.int64))
            if int(cache.get_seq_length()) == snapshot_at:
                prefill.state_at[snapshot_at] = self.pack_state(cache)
            logits.append(step_logits)
            tokens.append(int(torch.argmax(step_logits)))
        return HybridDecode(tokens=tokens, logits=torch.stack(logits))

    def full_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of every position of `tokens` from one forward pass with no cache, `(n, vocab_size)`."""
        return full_logits(self.model, tokens)


def _pairs_from_pool(kv: torch.Tensor) -> tuple[KVPair, ...]:
    """`(L, 2, n, H, D)` -> per layer `(keys, values)` of shape `(1, H, n, D)` (copies)."""
    return tuple(
        (
            kv[i, 0].permute(1, 0, 2).unsqueeze(0).contiguous(),
            kv[i, 1].permute(1, 0, 2).unsqueeze(0).contiguous(),
        )
        for i in range(kv.shape[0])
    )


def _pool_from_pairs(pairs: tuple[KVPair, ...]) -> torch.Tensor:
    """Per layer `(keys, values)` of shape `(1, H, n, D)` -> `(L, 2, n, H, D)` (a copy)."""
    return torch.stack([torch.stack([k[0], v[0]]).permute(0, 2, 1, 3) for k, v in pairs]).contiguous()
