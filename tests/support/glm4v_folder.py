"""Rebuild, without vLLM, the offline GLM-4.1V model folder the server's GLM-4V video fixtures
(``tests/server/fixtures_glm4v/``) were recorded with.

aiomm's own offline GLM-4V folder (:func:`aiomm.adapters.folders.write_model_folder`) with what
vLLM's render server needs on top: words for the numbers 0-299 (GLM-4V's per-frame timestamps
are whole seconds written as text), the special tokens numbered after the whole vocabulary (or
``tokenizers`` renumbers them), a full ``Glm4vConfig`` whose token ids are the tokenizer's, and
a small video pixel floor (small fixtures). The family chat template writes videos already.
``tests/server`` checks the ids against the recorded ones, so any drift fails there.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ("build_glm4v_folder",)

#: the video processor's ``size.shortest_edge`` (pixels over the sampled frames)
VIDEO_MIN_PIXELS = 28 * 28 * 2


def build_glm4v_folder(path: Path) -> Path:
    """Write the folder into ``path`` and return it."""
    from transformers import Glm4vConfig

    from aiomm.adapters.folders import write_model_folder

    write_model_folder("Glm4vForConditionalGeneration", path)
    tok = json.loads((path / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    following = max([*vocab.values(), *(t["id"] for t in tok["added_tokens"])]) + 1
    for word in [str(i) for i in range(300)] + ["video", "seconds", "frames"]:
        if word not in vocab:
            vocab[word] = following
            following += 1
    extra = [t for t in tok["added_tokens"] if t["content"] not in vocab]
    for i, token in enumerate(extra):
        token["id"] = len(vocab) + i
    (path / "tokenizer.json").write_text(json.dumps(tok))
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    config = Glm4vConfig().to_dict()
    config.update(
        architectures=["Glm4vForConditionalGeneration"],
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
    processor = json.loads((path / "processor_config.json").read_text())
    # a small pixel floor for videos keeps the recorded tensors small (GLM-4.1V's is 112**2)
    processor["video_processor"]["size"]["shortest_edge"] = VIDEO_MIN_PIXELS
    (path / "processor_config.json").write_text(json.dumps(processor, indent=2))
    return path
