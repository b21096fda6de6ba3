"""Host <-> storage: the circuit breaker of the storage tier, the backend seen through it, and the
write-through writer that sends committed host pages to storage in the background.

May call `pages` (the writer allocates and releases host pages) and the storage backends.
"""
