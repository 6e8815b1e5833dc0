"""Request ids: unguessable bytes from the OS, fetched in batches, never repeated by a fork."""

from __future__ import annotations

import os
import re

import pytest

from aiomm.engine import _ids as request_ids
from aiomm.engine._ids import random_hex


def test_ids_are_hex_of_the_length_asked_and_distinct_across_refills() -> None:
    ids = [random_hex(8) for _ in range(3 * request_ids._REFILL_BYTES // 8)]
    assert all(re.fullmatch("[0-9a-f]{16}", i) for i in ids)
    assert len(set(ids)) == len(ids)
    assert re.fullmatch("[0-9a-f]{12}", random_hex(6))
    assert len(random_hex(2 * request_ids._REFILL_BYTES)) == 4 * request_ids._REFILL_BYTES


def test_a_refill_draws_from_the_os(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def urandom(n: int) -> bytes:
        calls.append(n)
        return (bytes(range(256)) * (n // 256 + 1))[:n]

    request_ids._forget()
    monkeypatch.setattr(request_ids.os, "urandom", urandom)
    first = [random_hex(8) for _ in range(request_ids._REFILL_BYTES // 8)]
    assert calls == [request_ids._REFILL_BYTES]  # one call for a batch of ids
    assert first[0] == bytes(range(8)).hex()
    random_hex(8)
    assert len(calls) == 2
    request_ids._forget()


@pytest.mark.filterwarnings("ignore:.*fork.*:DeprecationWarning")
def test_a_forked_child_draws_other_ids() -> None:
    random_hex(8)  # the parent holds unused bytes the child must not reuse
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(write, " ".join(random_hex(8) for _ in range(4)).encode())
        finally:
            os._exit(0)
    os.close(write)
    child = os.read(read, 1024).decode().split()
    os.close(read)
    os.waitpid(pid, 0)
    mine = [random_hex(8) for _ in range(4)]
    assert len(child) == 4 and not set(child) & set(mine)
