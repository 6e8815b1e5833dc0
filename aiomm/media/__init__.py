"""Bytes in, pixels out: :mod:`.fetch` (URLs, data URLs and local files, SSRF-guarded),
:mod:`.image` (probe and decode with the pixel limits), :mod:`.video` (PyAV decode and frame
sampling), :mod:`.hashing` (content hashes and cache keys), :mod:`.samples` (seeded sample
photos), :mod:`.audio` (audio decode and resampling, sample for sample as vLLM's render
server)."""
