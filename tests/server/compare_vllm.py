"""Randomized comparison of ``aiomm serve`` with vLLM 0.33's render server, side by side.

Not a test: run it by hand where vLLM is installed, against both servers serving the same model
folder (vLLM's processor cache off, so every item's flat slices come from its own request; aiomm
given the path vLLM was given as ``--model-id``)::

    PORT=18115 MM_CACHE_GB=0 MODEL=/tmp/vllm-probe/qwen2vl shared/vllm_render/launch.sh start
    aiomm serve /tmp/vllm-probe/qwen2vl --port 18200
    python tests/server/compare_vllm.py --vllm http://127.0.0.1:18115 \\
        --aiomm http://127.0.0.1:18200 --model /tmp/vllm-probe/qwen2vl --n 200 --out /tmp/diff

Seeded random requests (``tests/support/random_requests.py``) go to both; every answer pair is
compared as the golden fixtures are (``tests/support/render_compare.py``). It prints the counts
per status pair and every difference with the request's media; with ``--out`` each differing
case is written as a golden fixture (``{"path", "body", "status", "response"}``, vLLM's answer)
to move into ``tests/server/fixtures*/`` once understood. Exits 1 when anything differs.
``--audios P`` makes that share of the requests chats with zero to two audio clips instead of
images, for a model that takes audio (vLLM started with ``LIMIT_MM='{"audio": 2}'``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from random_requests import random_requests
from render_compare import differences


@dataclass
class Case:
    """One request and both answers."""

    index: int
    path: str
    body: dict[str, Any]
    what: list[str]
    ours: tuple[int, Any] = (0, None)
    theirs: tuple[int, Any] = (0, None)
    found: list[str] = field(default_factory=list)


@dataclass
class Report:
    cases: list[Case] = field(default_factory=list)

    @property
    def differing(self) -> list[Case]:
        return [c for c in self.cases if c.found]

    def statuses(self) -> Counter[tuple[int, int]]:
        """(aiomm's status, vLLM's status) -> requests."""
        return Counter((c.ours[0], c.theirs[0]) for c in self.cases)


async def _answer(client: httpx.AsyncClient, url: str, case: Case) -> tuple[int, Any]:
    response = await client.post(url + case.path, json=case.body)
    try:
        return response.status_code, response.json()
    except ValueError:
        return response.status_code, response.text


async def compare(
    aiomm_url: str,
    vllm_url: str,
    requests: Iterable[tuple[str, dict[str, Any], list[str]]],
    *,
    concurrency: int = 2,
    timeout: float = 300,
) -> Report:
    """Send each request to both servers (``concurrency`` at a time) and compare the answers."""
    report = Report()
    queue: asyncio.Queue[Case | None] = asyncio.Queue(maxsize=concurrency)

    async def worker(client: httpx.AsyncClient) -> None:
        while (case := await queue.get()) is not None:
            case.ours, case.theirs = await asyncio.gather(
                _answer(client, aiomm_url, case), _answer(client, vllm_url, case)
            )
            case.found = differences(*case.ours, *case.theirs, body=case.body, path=case.path)
            if not case.found:  # megabytes of items each: keep only what a report shows
                case.body, case.ours, case.theirs = {}, (case.ours[0], None), (case.theirs[0], None)
            report.cases.append(case)

    async with httpx.AsyncClient(timeout=timeout) as client:
        workers = [asyncio.create_task(worker(client)) for _ in range(concurrency)]
        for i, (path, body, what) in enumerate(requests):
            await queue.put(Case(i, path, body, what))
        for _ in workers:
            await queue.put(None)
        await asyncio.gather(*workers)
    report.cases.sort(key=lambda c: c.index)
    return report


def _write_fixtures(report: Report, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for case in report.differing:
        status, response = case.theirs
        fixture = {"path": case.path, "body": case.body, "status": status, "response": response}
        (out / f"random_{case.index:04d}.json").write_text(json.dumps(fixture))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--aiomm", required=True, help="aiomm serve's URL")
    parser.add_argument("--vllm", required=True, help="vllm launch render's URL")
    parser.add_argument("--model", required=True, help="the served model name of both")
    parser.add_argument("--n", type=int, default=100, help="requests (default: 100)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--videos", type=float, default=0.0, help="share of chat requests with a clip"
    )
    parser.add_argument(
        "--audios",
        type=float,
        default=0.0,
        help="share of requests that are chats with 0-2 audio clips and no image",
    )
    parser.add_argument(
        "--none",
        type=float,
        help="the share of chat requests with mm_payload none (default: one in five)",
    )
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--out", type=Path, help="write each differing case here as a fixture")
    args = parser.parse_args()

    requests = random_requests(
        args.seed, args.model, videos=args.videos, none=args.none, audios=args.audios
    )
    picked = (next(requests) for _ in range(args.n))
    t0 = time.monotonic()
    report = asyncio.run(compare(args.aiomm, args.vllm, picked, concurrency=args.concurrency))
    elapsed = time.monotonic() - t0
    for case in report.differing:
        print(f"#{case.index} {case.path} {case.what}")
        for line in case.found:
            print(f"    {line}")
    print(f"{len(report.cases)} requests in {elapsed:.0f} s (seed {args.seed}):")
    for (ours, theirs), count in sorted(report.statuses().items()):
        print(f"    aiomm {ours} / vLLM {theirs}: {count}")
    print(f"    identical: {len(report.cases) - len(report.differing)}")
    print(f"    different: {len(report.differing)}")
    if args.out and report.differing:
        _write_fixtures(report, args.out)
        print(f"differing cases written to {args.out}")
    sys.exit(1 if report.differing else 0)


if __name__ == "__main__":
    main()
