"""Per-architecture processors of aiomm, installed as ``aiomm.adapters``."""

if __name__ != "aiomm.adapters":  # pragma: no cover - guards a broken install or sys.path
    raise ImportError(
        "aiomm's adapters/ directory must be imported as 'aiomm.adapters'. "
        "Install aiomm (pip install -e .)."
    )

from ._stored import (
    hf_class_name as hf_class_name,
)
from .registry import (
    AdapterInfo as AdapterInfo,
)
from .registry import (
    build_processor as build_processor,
)
from .registry import (
    from_pretrained as from_pretrained,
)
from .registry import (
    get_adapter_info as get_adapter_info,
)
from .registry import (
    supported_adapters as supported_adapters,
)

__all__ = (
    "AdapterInfo",
    "build_processor",
    "from_pretrained",
    "get_adapter_info",
    "hf_class_name",
    "supported_adapters",
)
