"""Processed items, kept: :mod:`.item_cache` (the byte-bounded in-process cache with single
flight and its second tier), :mod:`.codec` (the items' byte format), :mod:`.peer` (the tier the
workers of ``aiomm serve --workers`` share) and :mod:`.redis` (the Redis tier shared by
replicas, the ``shared-cache`` extra)."""
