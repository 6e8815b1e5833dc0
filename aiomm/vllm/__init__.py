"""vLLM 0.33's wire format and rules, shared by the render server and the Ray stage: the
``GenerateRequest`` and its features (:mod:`.generate_request`, items in :mod:`.wire`'s msgpack
layout), mm_hashes (:mod:`.mm_hash`), the request fields and sampling parameters as vLLM reads
and writes them (:mod:`.request_values`, :mod:`.request_fields`, :mod:`.sampling`, :mod:`.rules`),
chat content and templates (:mod:`.content`, :mod:`.chat_template`), vLLM's image and video
loading rules (:mod:`.media`, :mod:`.video_media`) and its OpenAI-shaped errors (:mod:`.errors`).
"""
