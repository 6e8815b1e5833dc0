"""The async engine: :class:`Engine` composes the stages (:mod:`.stages`) for a request
(``_pipeline``), owns their lifecycle, the transform's worker threads (``_worker_pool``), the
decoded-bytes budget (``_byte_budget``) and the bounded :class:`ResultStream` of
:meth:`Engine.stream`."""

from ._engine import Engine as Engine
from ._engine import EngineStats as EngineStats
from ._engine import LimiterStats as LimiterStats
from ._pipeline import PLAN_SOURCES as PLAN_SOURCES
from ._stream import ResultStream as ResultStream

__all__ = ("PLAN_SOURCES", "Engine", "EngineStats", "LimiterStats", "ResultStream")
