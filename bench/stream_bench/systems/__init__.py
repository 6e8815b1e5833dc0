"""The systems under test, one module each: ``hf`` (sequential and threads), ``aiomm``, ``vllm``.

``hf`` and ``aiomm`` run in this interpreter; ``vllm`` runs ``bench/_vllm_worker.py`` in the
interpreter of a vLLM environment.
"""

SYSTEMS = ("hf-sequential", "hf-threads", "vllm", "aiomm")
BASELINES = ("hf-sequential", "hf-threads", "vllm")
