"""Streaming benchmark: aiomm against the baselines, side by side, with backpressure tuning.

Every system serves the same seeded requests (a prompt plus 1-4 encoded JPEG/PNG images, some
repeated with Zipf popularity) in the same run, each in a process of its own (``--isolate``, the
default except with ``--quick``):

- ``hf-sequential``: decode, then the HF processor per request (CPU normalisation), on the event
  loop, as a naive server would;
- ``hf-threads``: the same through ``asyncio.to_thread`` (the default executor);
- ``vllm``: vLLM's own path, run by ``bench/_vllm_worker.py`` in the interpreter given by
  ``--vllm-python``: decode in a media thread pool, then ``BaseMultiModalProcessor.apply`` with its
  processor cache on the event loop, as vLLM's renderer does (skipped without ``--vllm-python``);
- ``aiomm``: ``Engine.stream`` fed through a bounded queue (the queue bound sheds load).

Load modes: a closed loop (``--concurrency`` clients) and an open loop (Poisson arrivals at
multiples of each system's own closed-loop capacity). Every arriving request carries its own copy
of its image bytes, so a backlog costs memory as it would in a server. Latency runs from the
moment a request is sent (closed) or scheduled to arrive (open), so a blocked event loop cannot
hide its queueing. The floor is the single-thread CPU time of decode + resize alone (the engine's
own functions) over the unique images, divided by the cores. CPU ms per image (process CPU time
over images) is the figure least disturbed by other work on a shared machine. Exactness: on a
sample, aiomm's uint8 pixels and token ids equal the HF processor's (``do_rescale=False,
do_normalize=False``) and the engine's normalised float32 output is within 1e-6 of HF's (max
error relative to the largest magnitude); vLLM's pixels and token ids are compared with aiomm's.
Thread scaling pins the process to as many cores as transform threads and keeps the best of
three interleaved runs per thread count (other tenants of a shared machine only slow runs down).
``--sweep`` tunes threads x max_in_flight (closed loop) and then the queue bound (open loop at 2x
capacity); ``--gpu`` adds the engine with its device stage on CUDA (``aiomm-gpu``) and the bytes
it moves.

    aiomm bench --quick                    # every system on a tiny workload, < 1 minute
    aiomm bench --sizes 512,1024,2048      # per size class, and the fast mode (``sizes``)
    aiomm bench                            # the full report, ~5-10 minutes on 2 cores
    aiomm bench --vllm-python /tmp/vllm-venv/bin/python --sweep [--gpu]
    python bench/stream_bench --quick      # the same without the aiomm command

Output: a table on stdout, ``stream_bench.json`` and ``stream_bench.png`` (matplotlib, the
``bench`` extra) under ``--out``; the generated images are cached under ``--out``/workload.

Modules, in import order (each imports only those above it):

- ``measure``: cores, core pinning, RSS, the :class:`~stream_bench.measure.Meter`, percentiles;
- ``workload``: the seeded requests and images;
- ``loadgen``: closed and open loops against a ``Server``, and their JSON records;
- ``processors``: the reference HF processor and aiomm's, warmed;
- ``systems/``: ``hf`` (sequential, threads), ``aiomm`` (with thread scaling), ``vllm`` (runs
  ``bench/_vllm_worker.py`` in another interpreter);
- ``exactness``: the decode + resize floor and the output checks;
- ``sizes``: ``--sizes``, throughput per size class (float32 and uint8 rows) and the fast mode;
- ``tuning``: the ``--sweep`` grid; ``gpu``: the ``--gpu`` run;
- ``jobs``: one job per system, in this process or a child;
- ``analysis``, ``report``, ``plot``: ratios and targets, the table, the PNG;
- ``cli``: the command line.

``measure``, ``workload`` and ``loadgen`` import only the standard library and numpy at import
time: ``_vllm_worker.py`` reuses them inside the vLLM environment, which has no aiomm.
"""
