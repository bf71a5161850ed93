"""Kernel tests run compiled on a CUDA device when there is one, else under the Triton interpreter on the CPU.

The interpreter is chosen when Triton decorates a function (its own library too), so tests/conftest.py
sets TRITON_INTERPRET before anything imports Triton; it is set here again for runs of this folder alone.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

    def _allow_scalar_loop_bounds() -> None:
        """Triton 3.6's interpreter holds scalars as 1-element arrays and converts them with int(), which
        NumPy >= 2.4 refuses; loops with bounds read from memory (`range(lo, hi, step)`) then fail."""
        from triton.runtime import interpreter

        patch_tensor = interpreter._patch_lang_tensor

        def patched(tensor, scope):
            patch_tensor(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        interpreter._patch_lang_tensor = patched

    _allow_scalar_loop_bounds()
