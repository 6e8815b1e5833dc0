"""Which registered architectures a per-architecture test runs on."""

from __future__ import annotations

from aiomm.adapters import supported_adapters


def one_per_preprocessing(modality: str = "image") -> list[str]:
    """One architecture per distinct (processor class, reference builder) among those that
    take ``modality``: rows sharing both preprocess alike (the parity harness and the
    in-process server tests take every row)."""
    seen: set[tuple[object, object]] = set()
    out = []
    for info in supported_adapters():
        if modality not in info.processor_cls.supported_modalities:
            continue
        if (info.processor_cls, info.build_hf_processor) not in seen:
            seen.add((info.processor_cls, info.build_hf_processor))
            out.append(info.short_name)
    return out
