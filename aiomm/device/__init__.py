"""Pixels onto the accelerator: :mod:`.stage` (the device stage: uint8 copies and the fused
normalise), :mod:`.pinned_pool` (pinned staging buffers) and :mod:`.host_buffers` (recycled CPU
output blocks)."""
