"""Storage -> host prefetch, one lifecycle: admission (is a storage hit worth streaming), the sparse
`exists` probe that sizes it, the prefetch object and its states, the streams run in the cache's task
group, the loop pacer, the commit or drop, and the refill rescue.

May call `pages`, `storage` and `movement` (the rescue backs an anchor up before attaching a refill).
"""
