"""An import-only torchvision stand-in, installed before SGLang's host pools and controllers load.

SGLang 0.5.23 imports two vision configs that `import torchvision.transforms` at module level; the
published torchvision wheels are CUDA-linked and break a CPU torch. Nothing on the HiCache path
uses torchvision, so a stub whose every call raises is enough (and safer than a real install).
"""

from __future__ import annotations

import enum
import importlib.machinery
import sys
import types


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def _module(name: str, package: bool) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=package)
    if package:
        mod.__path__ = []

    def missing(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)

        def unavailable(*args, **kwargs):
            raise RuntimeError(f"{name}.{attr} is unavailable: torchvision is stubbed (kvcr's SGLang adapter)")
        return unavailable

    mod.__getattr__ = missing
    return mod


def install() -> None:
    """Idempotent; a real torchvision already imported is left alone."""
    if "torchvision" in sys.modules:
        return
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()  # its lru_cache pins False while torchvision is absent
    root = _module("torchvision", True)
    root.__version__ = "0.0.0+stub"
    transforms = _module("torchvision.transforms", True)
    functional = _module("torchvision.transforms.functional", False)
    transforms.InterpolationMode = functional.InterpolationMode = InterpolationMode
    transforms.functional = functional
    root.transforms = transforms
    sys.modules.update({"torchvision": root, "torchvision.transforms": transforms,
                        "torchvision.transforms.functional": functional})
