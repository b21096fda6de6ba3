"""Device <-> host: backups (write-through, selective, write-back) and load-backs, whole or layer by
layer, the counted copies in flight, the backup work queue, and the rank-agreed form of backups under
tensor parallelism.

May call `pages` and `storage` (a committed backup is handed to the storage writer).
"""
