"""Offline reference processors from stored snapshots: a fast start without transformers.

Building a reference HF processor offline (``adapters/offline.py``) imports transformers and, for
its torchvision image processors, torchvision and ``torch._dynamo``: about two seconds before an
engine built by name can serve. The native transform reads only the processors' parameters, their
accepted kwargs, the placeholder token ids and the tokenizer, so ``stored_processors.json`` keeps
exactly those, snapshot from the HF processors (or the references adapters take in their place)
the offline builders make for every architecture (regenerate with
``python -P -m aiomm.adapters._store_update``; ``tests/adapters/test_stored.py`` fails when the file
and a fresh snapshot differ): the plain attributes (their classes' and properties included) of
the processor and of its image and video processors and feature extractor, and the names of
their other attributes, so that a name an object lacks is known absent; the tokenizer's
``tokenizer.json`` and its special tokens.
:class:`StoredHFProcessor` serves them, with the tokenizer's encoding, vocabulary and token ids
and the torchvision backend's rescale and fused normalisation (the classic path's, where an image
processor does not override them) restated, and builds the real HF processor on first access to
anything else (the ``hf`` transform, the PIL backend's or an overridden normalisation, a
tokenizer call the snapshot cannot answer), so every path still gives the HF processor's
results.

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
import warnings
from collections.abc import Callable, Iterable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

from aiomm.logging import get_logger

__all__ = (
    "STORE",
    "StoredFeatureExtractor",
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

    def __init__(
        self,
        attributes: Mapping[str, Any],
        real: Callable[[], Any],
        names: Iterable[str] | None = None,
    ) -> None:
        self.__dict__.update(attributes)
        self._real = real
        #: every public name the object has (the stored ones and ``names``; None: unknown); a
        #: name outside them is absent from the object
        self._names = None if names is None else frozenset(names) | frozenset(attributes)

    def __getattr__(self, name: str) -> Any:
        # only called for names not stored; dunders stay off the real object (copy, pickle)
        if name.startswith("__") or "_real" not in self.__dict__:
            raise AttributeError(name)
        names = self.__dict__.get("_names")
        if names is not None and not name.startswith("_") and name not in names:
            raise AttributeError(name)  # what the real object lacks too: no need to build it
        return getattr(self._real(), name)


class StoredImageProcessor(_StoredPart):
    """An image or video processor's stored attributes, ``backend`` and ``valid_kwargs``."""

    def __init__(self, spec: Mapping[str, Any], real: Callable[[], Any]) -> None:
        super().__init__(_restore(spec["attributes"]), real, spec.get("names"))
        self.stored_class_name: str = spec["class"]
        self.backend: str = spec["backend"]
        #: whether its rescale and normalise are the torchvision backend's own (not overridden)
        self.torchvision_operations: bool = spec.get("torchvision_operations", False)
        names = frozenset(spec["valid_kwargs"])
        # the two keys sets of the TypedDict HF declares the kwargs with
        self.valid_kwargs = types.SimpleNamespace(
            __required_keys__=frozenset(), __optional_keys__=names
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._real()(*args, **kwargs)

    def rescale(self, image: Any, scale: float, **kwargs: Any) -> Any:
        """The torchvision backend's rescale (``image * scale``); else the HF processor's."""
        if not self.torchvision_operations or kwargs:
            return self._real().rescale(image, scale, **kwargs)
        return image * scale

    def rescale_and_normalize(
        self,
        images: Any,
        do_rescale: bool,
        rescale_factor: float,
        do_normalize: bool,
        image_mean: Any,
        image_std: Any,
    ) -> Any:
        """The torchvision backend's fused rescale and normalise (the classic CPU path): the
        same float32 operations in the same order, so the same bits; other backends and
        arguments go to the HF image processor."""
        fused = do_rescale and do_normalize and all(image_std)  # a zero std: HF's error
        if not (self.torchvision_operations and fused):
            return self._real().rescale_and_normalize(
                images, do_rescale, rescale_factor, do_normalize, image_mean, image_std
            )
        import torch

        mean = torch.tensor(image_mean, device=images.device) * (1.0 / rescale_factor)
        std = torch.tensor(image_std, device=images.device) * (1.0 / rescale_factor)
        out = images.to(torch.float32)
        # in place only on a converted copy: a float32 input is the caller's
        out = out.sub_(mean.view(-1, 1, 1)) if out is not images else out.sub(mean.view(-1, 1, 1))
        return out.div_(std.view(-1, 1, 1))


class StoredFeatureExtractor(_StoredPart):
    """An audio feature extractor's stored attributes (its parameters); its features come from
    the HF feature extractor, built on first call."""

    def __init__(self, spec: Mapping[str, Any], real: Callable[[], Any]) -> None:
        super().__init__(_restore(spec["attributes"]), real, spec.get("names"))
        self.stored_class_name: str = spec["class"]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._real()(*args, **kwargs)


class StoredTokenizer(_StoredPart):
    """The offline tokenizer from its stored ``tokenizer.json``: a text encodes as the HF fast
    tokenizer encodes it (both run the same ``tokenizers`` model); other calls and attributes
    go to the HF tokenizer."""

    def __init__(
        self,
        tokenizer_json: str,
        real: Callable[[], Any],
        attributes: Mapping[str, Any] | None = None,
    ) -> None:
        from tokenizers import Tokenizer

        super().__init__(_restore(attributes or {}), real)
        self._tokenizer = Tokenizer.from_str(tokenizer_json)

    def convert_tokens_to_ids(self, tokens: Any) -> Any:
        """The id of a token (a list of them for a list), as the HF tokenizer gives it; a token
        outside the vocabulary goes to the HF tokenizer (its unknown-token rule)."""
        if isinstance(tokens, str):
            token_id = self._tokenizer.token_to_id(tokens)
            return self._real().convert_tokens_to_ids(tokens) if token_id is None else token_id
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def get_vocab(self) -> dict[str, int]:
        """Token -> id, added tokens included (the HF fast tokenizer's ``get_vocab``)."""
        return dict(self._tokenizer.get_vocab(with_added_tokens=True))

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

        super().__init__(_restore(spec["attributes"]), real, spec.get("names"))
        self._built = built
        self.stored_class_name: str = spec["class"]
        self.tokenizer = StoredTokenizer(
            tokenizer_json, lambda: real().tokenizer, spec.get("tokenizer_attributes")
        )
        for part in ("image_processor", "video_processor"):
            if part in spec:
                setattr(self, part, StoredImageProcessor(
                    spec[part], functools.partial(lambda p: getattr(real(), p), part)
                ))  # fmt: skip
        if "feature_extractor" in spec:
            self.feature_extractor = StoredFeatureExtractor(
                spec["feature_extractor"], lambda: real().feature_extractor
            )

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
    """The class name of an HF processor (or image / video processor, feature extractor), or of
    the one a stored stand-in (:class:`StoredHFProcessor`, :class:`StoredImageProcessor`,
    :class:`StoredFeatureExtractor`) is for."""
    if isinstance(hf_processor, (StoredHFProcessor, StoredImageProcessor, StoredFeatureExtractor)):
        return hf_processor.stored_class_name
    return type(hf_processor).__name__


# ------------------------------------------------------------------------------- snapshots


_SKIP = object()
#: the JSON form of a tuple (``{_TUPLE: [...]}``), restored as one: a list stays a list
_TUPLE = "__tuple__"


def _plain(value: Any) -> Any:
    """``value`` as JSON data, or ``_SKIP`` when it is not plain data (left to the object)."""
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        elements = [_plain(v) for v in value]
        if any(v is _SKIP for v in elements):
            return _SKIP
        return {_TUPLE: elements} if isinstance(value, tuple) else elements
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        # unset fields (HF's SizeDict) read as None from the stored dict too
        fields = ((f.name, getattr(value, f.name)) for f in dataclasses.fields(value))
        value = {name: v for name, v in fields if v is not None}
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        items = {k: _plain(v) for k, v in value.items()}
        return _SKIP if any(v is _SKIP for v in items.values()) else items
    return _SKIP


def _restore(attributes: Mapping[str, Any]) -> dict[str, Any]:
    def restore(value: Any) -> Any:
        if isinstance(value, dict):
            if value.keys() == {_TUPLE}:
                return tuple(restore(v) for v in value[_TUPLE])
            return _Fields({k: restore(v) for k, v in value.items()})
        if isinstance(value, list):
            return [restore(v) for v in value]
        return value

    return {k: restore(v) for k, v in attributes.items()}


def _attributes(obj: Any) -> dict[str, Any]:
    """The public attributes of ``obj`` that are plain data: its own and its class's,
    properties included, as the adapters read them."""
    plain = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated properties warn when read
        for name in dir(obj):
            if name.startswith("_"):
                continue
            try:
                value = getattr(obj, name)
            except Exception:  # a property that needs what the object lacks: left to it
                continue
            if not callable(value):
                plain[name] = _plain(value)
    return {k: v for k, v in sorted(plain.items()) if v is not _SKIP}


def _tokenizer_attributes(tokenizer: Any) -> dict[str, Any]:
    """The tokenizer attributes kept: its special tokens (the model's image tokens among them,
    which HF's tokenizers answer by ``__getattr__``) and their ids, not its vocabulary."""
    special = getattr(tokenizer, "SPECIAL_TOKENS_ATTRIBUTES", None) or ()
    wanted = {*special, *(f"{n}_id" for n in special), "all_special_tokens", "all_special_ids"}
    attributes = {}
    for name in sorted(wanted):
        value = _plain(getattr(tokenizer, name, None))
        if value is not _SKIP:
            attributes[name] = value
    return attributes


def _names(obj: Any, stored: Mapping[str, Any]) -> list[str] | None:
    """The public names of ``obj`` besides the ``stored`` attributes, where its names are all
    it answers (no ``__getattr__``)."""
    if getattr(type(obj), "__getattr__", None) is not None:
        return None
    return sorted(name for name in dir(obj) if not name.startswith("_") and name not in stored)


def _torchvision_operations(image_processor: Any) -> bool:
    """Whether ``image_processor`` rescales and normalises with the torchvision backend's own
    methods, which :class:`StoredImageProcessor` restates."""
    if image_processor.backend != "torchvision":
        return False
    from transformers.image_processing_backends import TorchvisionBackend

    methods = ("rescale", "normalize", "rescale_and_normalize", "_fuse_mean_std_and_rescale_factor")
    cls = type(image_processor)
    return all(getattr(cls, m) is getattr(TorchvisionBackend, m) for m in methods)


def _image_part(image_processor: Any) -> dict[str, Any]:
    typed = image_processor.valid_kwargs
    names = set(getattr(typed, "__required_keys__", ())) | set(typed.__optional_keys__)
    attributes = _attributes(image_processor)
    return {
        "class": type(image_processor).__name__,
        "backend": image_processor.backend,
        "valid_kwargs": sorted(names),
        "attributes": attributes,
        "names": _names(image_processor, attributes),
        "torchvision_operations": _torchvision_operations(image_processor),
    }


def snapshot(hf_processor: Any) -> tuple[dict[str, Any], str]:
    """The stored form of an HF processor (or of a reference an adapter takes in its place):
    its spec and its tokenizer's ``tokenizer.json``."""
    tokenizer = hf_processor.tokenizer
    attributes = _attributes(hf_processor)
    spec: dict[str, Any] = {
        "class": type(hf_processor).__name__,
        "attributes": attributes,
        "names": _names(hf_processor, attributes),
        "tokenizer_attributes": _tokenizer_attributes(tokenizer),
    }
    for part in ("image_processor", "video_processor"):
        if getattr(hf_processor, part, None) is not None:
            spec[part] = _image_part(getattr(hf_processor, part))
    extractor = getattr(hf_processor, "feature_extractor", None)
    if extractor is not None:
        stored = _attributes(extractor)
        spec["feature_extractor"] = {
            "class": type(extractor).__name__,
            "attributes": stored,
            "names": _names(extractor, stored),
        }
    return spec, tokenizer.backend_tokenizer.to_str()


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
