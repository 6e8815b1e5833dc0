"""Integrations with other systems, each behind its own extra (``aiomm.integrations.ray``)."""
