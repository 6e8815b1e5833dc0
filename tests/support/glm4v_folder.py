"""Rebuild, without vLLM, the offline GLM-4.1V and GLM-OCR model folders the server's GLM video
fixtures (``tests/server/fixtures_glm4v/``, ``tests/server/fixtures_glm_ocr/``) were recorded with.

aiomm's own offline GLM-4V folder (:func:`aiomm.adapters.folders.write_model_folder`) with what
vLLM's render server needs on top: words for the numbers 0-299 (GLM-4V's per-frame timestamps
are whole seconds written as text), the special tokens numbered after the whole vocabulary (or
``tokenizers`` renumbers them), a full ``Glm4vConfig`` (``GlmOcrConfig``) whose token ids are
the tokenizer's, and a small video pixel floor (small fixtures). The family chat template writes
videos already. ``tests/server`` checks the ids against the recorded ones, so any drift fails there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ("build_glm4v_folder", "build_glm_ocr_folder")

#: the video processor's ``size.shortest_edge`` (pixels over the sampled frames)
VIDEO_MIN_PIXELS = 28 * 28 * 2


def build_glm4v_folder(path: Path) -> Path:
    """Write the GLM-4.1V folder into ``path`` and return it."""
    from transformers import Glm4vConfig

    words = [str(i) for i in range(300)] + ["video", "seconds", "frames"]
    return _build(path, "Glm4vForConditionalGeneration", Glm4vConfig().to_dict(), words)


def build_glm_ocr_folder(path: Path) -> Path:
    """Write the GLM-OCR folder (``Glm46VProcessor``) into ``path`` and return it.

    Its timestamps are ``"{:.1f} seconds"``: the words ``0.0`` .. ``30.0`` (every tenth, so a
    fractional timestamp reads differently from a whole one). As GLM-4.6V checkpoints do, it
    ships ``video_preprocessor_config.json`` naming ``Glm46VVideoProcessor`` (every offline
    folder does): vLLM picks its video loader from that file (``config.json``'s ``glm_ocr`` names
    no video processor).
    """
    from transformers import GlmOcrConfig

    words = [f"{i / 10:.1f}" for i in range(301)] + ["seconds"]
    config = GlmOcrConfig().to_dict()
    return _build(path, "GlmOcrForConditionalGeneration", config, words, specials_last=True)


def _build(
    path: Path,
    architecture: str,
    config: dict[str, Any],
    words: list[str],
    *,
    specials_last: bool = False,
) -> Path:
    """``specials_last``: number the words ``0 .. len(vocab) - 1`` and the special tokens after
    them (``tokenizers`` reads an added token's id as ``len(vocab) + i``); the GLM-4V folder keeps
    the numbering its fixtures were recorded with, where its last words share those ids."""
    from aiomm.adapters.folders import write_model_folder

    write_model_folder(architecture, path)
    tok = json.loads((path / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    following = max([*vocab.values(), *(t["id"] for t in tok["added_tokens"])]) + 1
    for word in words:
        if word not in vocab:
            vocab[word] = following
            following += 1
    if specials_last:
        ordered = sorted(vocab, key=vocab.__getitem__)
        tok["model"]["vocab"] = vocab = {word: i for i, word in enumerate(ordered)}
    extra = [t for t in tok["added_tokens"] if t["content"] not in vocab]
    for i, token in enumerate(extra):
        token["id"] = len(vocab) + i
    (path / "tokenizer.json").write_text(json.dumps(tok))
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    config.update(
        architectures=[architecture],
        torch_dtype="bfloat16",
        image_token_id=ids["<|image|>"],
        video_token_id=ids["<|video|>"],
        image_start_token_id=ids["<|begin_of_image|>"],
        image_end_token_id=ids["<|end_of_image|>"],
        video_start_token_id=ids["<|begin_of_video|>"],
        video_end_token_id=ids["<|end_of_video|>"],
    )
    config["text_config"]["max_position_embeddings"] = 32768
    (path / "config.json").write_text(json.dumps(config, indent=1))
    video = json.loads((path / "video_preprocessor_config.json").read_text())
    # a small pixel floor for videos keeps the recorded tensors small (GLM-4.1V's is 112**2)
    video["size"]["shortest_edge"] = VIDEO_MIN_PIXELS
    (path / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))
    return path
