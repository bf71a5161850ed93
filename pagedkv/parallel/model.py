"""Loading a transformers decoder sharded over the ranks with transformers' own tensor-parallel plan.

The plan is the model config's `base_model_tp_plan` (Llama, Qwen, Mistral, SmolLM2 ... ship one):
q/k/v and gate/up projections column-parallel (each rank computes its own heads and its slice of the
MLP), o/down projections row-parallel followed by an all-reduce, the embedding vocabulary-parallel
(all-reduced) and the LM head column-parallel with a gathered output, so every rank ends a forward
with the full logits. transformers applies it while loading (`DistributedConfig(tp_size=N)`): each
rank reads only its shard of the weights. It runs over gloo on the CPU as well as NCCL on GPUs.

The attention modules reshape their projections with `-1` heads, so on each rank they produce
`num_heads / N` query heads and `num_kv_heads / N` KV heads, and the paged cache, which sizes its pages
from the first write, holds `[num_blocks, block_size, num_kv_heads / N, width]` per layer.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..devices import same_device
from ..errors import ConfigError, ModelNotFoundError
from ..hf import text_config
from .group import TensorParallelGroup, check_tensor_parallel

_KEY_PROJECTIONS = ("k_proj", "qkv_proj", "query_key_value")


def check_model(folder: str | Path, world_size: int, device_type: str, ranks_here: int | None = None) -> None:
    """Raise ConfigError unless the model in `folder` can be sharded over `world_size` ranks on `device_type`
    (`ranks_here` of them on this host; default all)."""
    from transformers import AutoConfig

    try:
        config = text_config(AutoConfig.from_pretrained(str(folder)))
    except (OSError, ValueError) as exc:
        raise ModelNotFoundError(f"could not read a model config from {folder}: {exc}") from None
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    check_tensor_parallel(world_size, num_kv_heads, num_heads, device_type, ranks_here)
    vocab = getattr(config, "vocab_size", None)
    if world_size > 1 and vocab and vocab % world_size and not _splits_lm_head_unevenly():
        import transformers

        ranks = [n for n in range(1, world_size) if vocab % n == 0 and num_kv_heads % n == 0 and num_heads % n == 0]
        raise ConfigError(f"--tensor-parallel {world_size}: this model's vocabulary ({vocab} tokens) does not split "
                          f"evenly over {world_size} ranks, and transformers {transformers.__version__} shards the LM "
                          f"head only evenly; upgrade transformers (5.24 splits it unevenly) or use "
                          f"--tensor-parallel {max(ranks)}")
    plan = getattr(config, "base_model_tp_plan", None) or {}
    if world_size > 1 and not any(k.rsplit(".", 1)[-1] in _KEY_PROJECTIONS and "colwise" in v for k, v in plan.items()):
        raise ConfigError(f"--tensor-parallel {world_size}: transformers has no tensor-parallel plan that shards the "
                          f"attention heads of {config.model_type} models; run it with --tensor-parallel 1")


def _splits_lm_head_unevenly() -> bool:
    """Whether this transformers shards a column-parallel LM head whose vocabulary the ranks do not divide."""
    try:
        from transformers.distributed.tensor_parallel import TensorParallelLayer
    except ImportError:
        return False
    return hasattr(TensorParallelLayer, "_from_local_last_dim_shard")


def _distributed_kwargs(world_size: int) -> dict:
    try:
        from transformers.distributed import DistributedConfig
    except ImportError:  # releases before DistributedConfig took tp_plan / tp_size directly
        return {"tp_plan": "auto", "tp_size": world_size}
    return {"distributed_config": DistributedConfig(tp_size=world_size)}


def load_sharded_model(folder: str | Path, group: TensorParallelGroup, *, dtype: torch.dtype = torch.float32,
                       gguf_file: str | None = None):
    """This rank's shard of the causal LM in `folder` (every rank calls it together), on the rank's device, and its
    tokenizer. One rank loads the whole model, unsharded (no collectives in its forward)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    extra = {"gguf_file": gguf_file} if gguf_file else {}
    if group.world_size > 1:
        placement = _distributed_kwargs(group.world_size)
    else:  # straight onto the GPU, not through host memory
        placement = {"device_map": str(group.device)} if group.device.type == "cuda" else {}
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, **placement, **extra)
    if any(not same_device(p.device, group.device) for p in model.parameters()):
        model.to(group.device)  # one rank loads the whole model where transformers puts it (the CPU)
    model.eval()
    tokenizer = None
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), **extra)
    except (OSError, ValueError, TypeError):
        pass  # a weights-only folder: callers pass token ids
    if tokenizer is not None and tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer
