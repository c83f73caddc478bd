"""TP styles: one class per style (its cut, its forward, its cost) and the registry of names.

Pure: the plan places tensors with a style's cut; the runtime installs the forward hooks its
`forward` describes.
"""

from .base import (
    ANY,
    EMBEDDING,
    LINEAR,
    MODULE_NAMES,
    PARTIAL,
    REPLICATE,
    ROUTED,
    Cut,
    Forward,
    Style,
    is_bias,
    module_kind,
)
from .registry import (
    ALIASES,
    DEFAULT_STYLE,
    STYLES,
    UNSUPPORTED,
    UnknownStyle,
    UnsupportedStyle,
    canonical,
    executable,
)

__all__ = [
    "ALIASES",
    "ANY",
    "DEFAULT_STYLE",
    "EMBEDDING",
    "LINEAR",
    "MODULE_NAMES",
    "PARTIAL",
    "REPLICATE",
    "ROUTED",
    "STYLES",
    "UNSUPPORTED",
    "Cut",
    "Forward",
    "Style",
    "UnknownStyle",
    "UnsupportedStyle",
    "canonical",
    "executable",
    "is_bias",
    "module_kind",
]
