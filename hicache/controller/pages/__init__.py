"""Who holds each page: allocating device, host and component pages (evicting what the tree lets go of
when a pool is full) and handing host buffers back through the release queue once no I/O can touch them.

The bottom room of the controller: it may call the tree and the pools, and nothing else of the controller.
"""
