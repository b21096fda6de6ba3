"""Engine adapters: `hicache.integrations.vllm` is a vLLM KV connector (imported only when named, so
`import hicache` never imports an engine)."""

from __future__ import annotations

__all__: list[str] = []
