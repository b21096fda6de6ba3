"""Storage -> host prefetch, one lifecycle: admission (from `start`: the sparse `exists` probe that sizes a
storage hit, one plan agreed across the ranks, the launch), the prefetch object and the registry of those
in flight (their streams in the cache's task group, commit or drop, cancel), the loop pacer, and the
refill rescue.

May call `pages`, `storage` and `movement` (the rescue backs an anchor up before attaching a refill).
"""
