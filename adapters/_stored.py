"""Offline reference processors from stored snapshots: a fast start without transformers.

Building a reference HF processor offline (``adapters/offline.py``) imports transformers and, for
its torchvision image processors, torchvision and ``torch._dynamo``: about two seconds before an
engine built by name can serve. The native transform reads only the processors' parameters, their
accepted kwargs, the placeholder token ids and the tokenizer, so ``stored_processors.json`` keeps
exactly those, snapshot from the HF processors the offline builders make (regenerate with
``python -P -m aiomm.adapters._store_update``; ``tests/adapters/test_stored.py`` fails when the file
and a fresh snapshot differ). :class:`StoredHFProcessor` serves them and builds the real HF
processor on first access to anything else (the ``hf`` transform, the classic path's
normalisation, a tokenizer call the snapshot cannot answer), so every path still gives the HF
processor's results.

A snapshot is used only under the transformers and tokenizers versions it was taken with. Under
other versions the first start builds the HF processor and keeps its snapshot in aiomm's cache
folder (:func:`aiomm.adapters.folders.default_cache_dir`), which the next starts use.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import functools
import json
import os
import threading
import types
from collections.abc import Callable, Iterable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

from aiomm.logging import get_logger

__all__ = (
    "STORE",
    "StoredHFProcessor",
    "StoredImageProcessor",
    "StoredTokenizer",
    "build_store",
    "hf_class_name",
    "offline_hf_processor",
    "snapshot",
)

log = get_logger(__name__)

#: the shipped snapshots (package data of ``aiomm.adapters``)
STORE = Path(__file__).with_name("stored_processors.json")
#: the libraries whose versions a snapshot depends on
_VERSIONED = ("transformers", "tokenizers")


class _Fields(dict):
    """A stored dict attribute (HF's ``SizeDict``): read by key or as attributes."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self.get(name)


class _StoredPart:
    """Stored attributes of an HF object; anything else is read from the object, built on
    first use by ``real()``."""

    def __init__(self, attributes: Mapping[str, Any], real: Callable[[], Any]) -> None:
        self.__dict__.update(attributes)
        self._real = real

    def __getattr__(self, name: str) -> Any:
        # only called for names not stored; dunders stay off the real object (copy, pickle)
        if name.startswith("__") or "_real" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self._real(), name)


class StoredImageProcessor(_StoredPart):
    """An image or video processor's stored attributes, ``backend`` and ``valid_kwargs``."""

    def __init__(self, spec: Mapping[str, Any], real: Callable[[], Any]) -> None:
        super().__init__(_restore(spec["attributes"]), real)
        self.stored_class_name: str = spec["class"]
        self.backend: str = spec["backend"]
        names = frozenset(spec["valid_kwargs"])
        # the two keys sets of the TypedDict HF declares the kwargs with
        self.valid_kwargs = types.SimpleNamespace(
            __required_keys__=frozenset(), __optional_keys__=names
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._real()(*args, **kwargs)


class StoredTokenizer(_StoredPart):
    """The offline tokenizer from its stored ``tokenizer.json``: a text encodes as the HF fast
    tokenizer encodes it (both run the same ``tokenizers`` model); other calls and attributes
    go to the HF tokenizer."""

    def __init__(self, tokenizer_json: str, real: Callable[[], Any]) -> None:
        from tokenizers import Tokenizer

        super().__init__({}, real)
        self._tokenizer = Tokenizer.from_str(tokenizer_json)

    def __call__(self, text: Any, add_special_tokens: bool = True, **kwargs: Any) -> Any:
        if kwargs or not isinstance(text, str):
            return self._real()(text, add_special_tokens=add_special_tokens, **kwargs)
        ids = self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}

    def encode(self, text: Any, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        """Token ids of ``text``, as the HF fast tokenizer's ``encode`` gives them."""
        if kwargs or not isinstance(text, str):
            return self._real().encode(text, add_special_tokens=add_special_tokens, **kwargs)
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)


class StoredHFProcessor(_StoredPart):
    """Stands in for an offline reference HF processor: its stored attributes, image and video
    processors and tokenizer, with the real processor built (once, thread-safe) by ``build`` on
    first access to anything else. Copies and pickles are of the real processor."""

    def __init__(self, spec: Mapping[str, Any], tokenizer_json: str, build: Callable[[], Any]):
        lock = threading.Lock()
        built: list[Any] = []

        def real() -> Any:
            with lock:
                if not built:
                    built.append(build())
            return built[0]

        super().__init__(_restore(spec["attributes"]), real)
        self._built = built
        self.stored_class_name: str = spec["class"]
        self.tokenizer = StoredTokenizer(tokenizer_json, lambda: real().tokenizer)
        for part in ("image_processor", "video_processor"):
            if part in spec:
                setattr(self, part, StoredImageProcessor(
                    spec[part], functools.partial(lambda p: getattr(real(), p), part)
                ))  # fmt: skip

    @property
    def built(self) -> bool:
        """Whether the real HF processor has been built."""
        return bool(self._built)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._real()(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return copy.deepcopy(self._real(), memo)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_identity, (self._real(),))


def _identity(value: Any) -> Any:
    return value


def hf_class_name(hf_processor: Any) -> str:
    """The class name of an HF processor (or image / video processor), or of the one a stored
    stand-in (:class:`StoredHFProcessor`, :class:`StoredImageProcessor`) is for."""
    if isinstance(hf_processor, (StoredHFProcessor, StoredImageProcessor)):
        return hf_processor.stored_class_name
    return type(hf_processor).__name__


# ------------------------------------------------------------------------------- snapshots


_SKIP = object()


def _plain(value: Any) -> Any:
    """``value`` as JSON data, or ``_SKIP`` when it is not plain data (left to the object)."""
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        elements = [_plain(v) for v in value]
        return _SKIP if any(v is _SKIP for v in elements) else elements
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        items = {k: _plain(v) for k, v in value.items()}
        return _SKIP if any(v is _SKIP for v in items.values()) else items
    return _SKIP


def _restore(attributes: Mapping[str, Any]) -> dict[str, Any]:
    def restore(value: Any) -> Any:
        if isinstance(value, dict):
            return _Fields({k: restore(v) for k, v in value.items()})
        return value

    return {k: restore(v) for k, v in attributes.items()}


def _attributes(obj: Any) -> dict[str, Any]:
    plain = {k: _plain(v) for k, v in vars(obj).items() if not k.startswith("_")}
    return {k: v for k, v in sorted(plain.items()) if v is not _SKIP}


def _image_part(image_processor: Any) -> dict[str, Any]:
    typed = image_processor.valid_kwargs
    names = set(getattr(typed, "__required_keys__", ())) | set(typed.__optional_keys__)
    return {
        "class": type(image_processor).__name__,
        "backend": image_processor.backend,
        "valid_kwargs": sorted(names),
        "attributes": _attributes(image_processor),
    }


def snapshot(hf_processor: Any) -> tuple[dict[str, Any], str]:
    """The stored form of an HF processor: its spec and its tokenizer's ``tokenizer.json``."""
    spec: dict[str, Any] = {
        "class": type(hf_processor).__name__,
        "attributes": _attributes(hf_processor),
    }
    for part in ("image_processor", "video_processor"):
        if getattr(hf_processor, part, None) is not None:
            spec[part] = _image_part(getattr(hf_processor, part))
    return spec, hf_processor.tokenizer.backend_tokenizer.to_str()


def _versions() -> dict[str, str]:
    return {name: metadata.version(name) for name in _VERSIONED}


def build_store(builders: Iterable[tuple[str, Callable[[], Any]]]) -> dict[str, Any]:
    """The store's content: ``builders`` yields ``(key, build)``, each building an HF
    processor; equal tokenizers are stored once."""
    processors: dict[str, Any] = {}
    tokenizers: dict[str, str] = {}
    for key, build in builders:
        spec, tokenizer_json = snapshot(build())
        name = next((n for n, t in tokenizers.items() if t == tokenizer_json), key)
        tokenizers.setdefault(name, tokenizer_json)
        processors[key] = {**spec, "tokenizer": name}
    return {"versions": _versions(), "tokenizers": tokenizers, "processors": processors}


@functools.cache
def _load_store() -> dict[str, Any] | None:
    return json.loads(STORE.read_text()) if STORE.is_file() else None


def _cache_file(key: str, versions: Mapping[str, str]) -> Path | None:
    """Where the snapshot of ``key`` taken under ``versions`` is kept: ``processors/`` in
    aiomm's cache folder (:func:`aiomm.adapters.folders.default_cache_dir`); None (none kept)
    when ``AIOMM_CACHE_DIR`` is set but empty."""
    if os.environ.get("AIOMM_CACHE_DIR") == "":
        return None
    # imported here: folders imports the registry, which imports this module
    from aiomm.adapters._cache_dir import default_cache_dir

    tag = "-".join(f"{name}{versions[name]}" for name in _VERSIONED)
    return default_cache_dir() / "processors" / tag / f"{key.replace('/', '--')}.json"


def _remember(path: Path, hf_processor: Any) -> None:
    """Keep ``hf_processor``'s snapshot at ``path`` (best effort: a read-only home is fine)."""
    spec, tokenizer_json = snapshot(hf_processor)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"spec": spec, "tokenizer": tokenizer_json}))
        os.replace(tmp, path)  # readers never see half a file
    except OSError as exc:
        log.debug("processor_snapshot_not_kept", path=str(path), error=str(exc))


def offline_hf_processor(key: str, build: Callable[[], Any]) -> Any | None:
    """The offline reference processor ``key`` (``"<short name>/<backend>"``) for the store's
    architectures: a :class:`StoredHFProcessor` of the shipped snapshot when the installed
    versions are the store's, else of the snapshot kept in aiomm's cache folder, else ``build()``'s
    processor itself, whose snapshot is kept for the next start. None for other keys.
    """
    store = _load_store()
    if store is None or key not in store["processors"]:
        return None
    versions = _versions()
    if store["versions"] == versions:
        spec = store["processors"][key]
        return StoredHFProcessor(spec, store["tokenizers"][spec["tokenizer"]], build)
    path = _cache_file(key, versions)
    try:
        kept = json.loads(path.read_text()) if path is not None else None
    except (OSError, ValueError):
        kept = None
    if kept is not None:
        return StoredHFProcessor(kept["spec"], kept["tokenizer"], build)
    hf_processor = build()
    if path is not None:
        _remember(path, hf_processor)
    return hf_processor
