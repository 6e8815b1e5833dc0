"""The decoder seam the cache tests count computations with."""

from __future__ import annotations

import threading
import time

import numpy as np

from aiomm.engine.stages import PillowDecoder
from aiomm.media.image import DecodeConfig


class CountingDecoder(PillowDecoder):
    """Pillow, counting decodes; ``delay`` keeps each one in flight a while, and ``hold`` (when
    set) keeps it in flight until the event is set."""

    def __init__(self, delay: float = 0.0) -> None:
        super().__init__(DecodeConfig())
        self.decodes = 0
        self.delay = delay
        self.hold: threading.Event | None = None
        self.entered = threading.Event()

    def decode(self, data: bytes) -> np.ndarray:
        self.decodes += 1
        self.entered.set()
        if self.hold is not None:
            self.hold.wait(10)
        time.sleep(self.delay)
        return super().decode(data)


class ConcurrencyDecoder(PillowDecoder):
    """Pillow, recording the most decodes in flight at once (each held ``delay`` seconds, then
    until ``gate`` is set when one is given); :meth:`wait_running` waits for decodes to start."""

    def __init__(self, delay: float = 0.05, gate: threading.Event | None = None) -> None:
        super().__init__(DecodeConfig())
        self.delay = delay
        self.gate = gate
        self.running = self.most = 0
        self.changed = threading.Condition()

    def wait_running(self, count: int, timeout: float = 10.0) -> bool:
        """Block until ``count`` or more decodes are in flight; False after ``timeout``."""
        with self.changed:
            return self.changed.wait_for(lambda: self.running >= count, timeout)

    def decode(self, data: bytes) -> np.ndarray:
        with self.changed:
            self.running += 1
            self.most = max(self.most, self.running)
            self.changed.notify_all()
        try:
            time.sleep(self.delay)
            if self.gate is not None:
                self.gate.wait(30)
            return super().decode(data)
        finally:
            with self.changed:
                self.running -= 1
