"""What the Triton runtime can do: whether kernels run compiled (not under the interpreter), whether the Gluon
kernels can run (the Triton they are written for), and which batches the prefill kernel takes. (A module of its
own, so that `dense_prefill`, the kernels' launchers and the package's dispatch all ask it without importing each
other.)"""

from __future__ import annotations

import functools
import os


def compiled() -> bool:
    """Whether kernels run compiled for the GPU, not under the Triton interpreter (TRITON_INTERPRET), which cannot
    run PTX: inline PTX conversions, `griddepcontrol`, and the TurboQuant write's division as the GPU computes it
    (`codecs.divide`) only where this holds."""
    return os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


def gluon_prefill(query, pages, fmt, meta, **options) -> bool:
    """Whether the Gluon prefill kernel (`prefill_gluon.py`: dense pages, Hopper) runs this batch."""
    if not (query.is_cuda and gluon_available()):
        return False
    from . import prefill_gluon

    return prefill_gluon.serves(query, pages, fmt, meta, **options)


def gluon_available() -> bool:
    """Gluon as the kernels are written for: Triton 3.6 or newer (its API moved between releases). Asked on every
    decode call, so answered once per Triton version."""
    import triton

    return _gluon_supported(triton.__version__)


@functools.cache
def _gluon_supported(version: str) -> bool:
    import importlib.util

    try:
        major_minor = tuple(int(x) for x in version.split(".")[:2])
        found = importlib.util.find_spec("triton.experimental.gluon") is not None
    except (ImportError, ValueError):
        return False
    return found and major_minor >= (3, 6)
