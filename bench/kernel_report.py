"""What the compiler makes of the decode attention kernel for an H100/H200 (sm_90), without a GPU.

    python bench/kernel_report.py [--formats off,q8,q4,turboquant] [--configs 64x4x5,128x4x2] [--json OUT]
    python bench/kernel_report.py --compile-all [--formats ...]
    python bench/kernel_report.py --count-variants [--formats ...]
    python bench/kernel_report.py --warp-split [--formats q4,turboquant]   # the warp-split decode kernel
    python bench/kernel_report.py --sass-digest > before.txt   # a hash of each decode kernel's SASS
    python bench/kernel_report.py --gluon-offsets   # the Gluon decode kernels, page offsets in 64 and in 32 bits
    python bench/kernel_report.py --gluon-copies    # TurboQuant's Gluon decode and its copies-only / work-only probes
    python bench/kernel_report.py --gluon-inner     # the dense decode with its splits inside a program
    python bench/kernel_report.py --gluon-ids-ahead # off and TurboQuant decodes with block ids loaded a step ahead
    python bench/kernel_report.py --gluon-lean      # TurboQuant decodes with half-register scales, codebook tables;
                                                    # q4 keys over their offsets
    python bench/kernel_report.py --gluon-skew      # TurboQuant's decode with its loop software-pipelined

For each page format and tile config (keys per step x warps x pipeline stages) it compiles
`paged_attention_kernel` for sm_90 with Triton's own toolchain (ptxas and cuobjdump ship in the triton
wheel) and prints: registers per thread and spills (ptxas), how many shared-memory buffers the software
pipeliner gave each page tile (1 = the next tile's copy waits for the current one to be consumed),
and the instructions of the main key loop per key row (per warp x warps / keys per step): a static
cost model for comparing kernel variants when no GPU is at hand. Time on a GPU is the only final word.

`--compile-all` compiles every kernel for sm_90 through its real host wrapper (cache write, varlen
attention for decode and prefill tiles, split-K and its reduce) for each format, query dtype and
head_dim, launching nothing: the Triton interpreter the CPU tests use never lowers a kernel, so this
is what catches a kernel that would not compile for the GPU. Exits 1 if any fails; with `--stack-limit BYTES`,
also if a format's kernels spill to a stack frame larger than that.

`--sass-digest` prints one line per decode launch (Gluon and tile-language kernels, every format, both 16-bit
dtypes, head_dim 64 and 128, one and four splits, grid and longest-first order, with and without a dense recent
window) and a hash of the SASS of each kernel it compiled: a change meant to leave the served kernels as they are
(a refactor, a variant removed) diffs two such listings instead of timing them.

`--count-variants` runs the decode and split-K kernels over batches of several sizes and block-table
widths and prints how many kernels each compiled: 1 each, or a server compiles again mid-stream.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pagedkv.config import KVFormat  # noqa: E402
from pagedkv.formats import make_format  # noqa: E402
from pagedkv.ops.triton import attention  # noqa: E402
from pagedkv.ops.triton.page_view import page_view, stride3  # noqa: E402
from pagedkv.ops.triton.tuning import TileConfig, choose_tiles, page_class  # noqa: E402

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16   # as bench/kernel_bench.py
TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


class _Sm90Target:
    """Just enough of Triton's driver interface for `JITFunction.warmup` to compile for sm_90 on a CPU."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_interface(self):
        return torch.cuda

    def get_benchmarker(self):
        return None

    def is_active(self):
        return True

    def map_python_to_cpp_type(self, t):
        return t


def compile_decode(spec: str, tiles: TileConfig, batch: int = 64, context: int = 8192):
    fmt = make_format(KVFormat.parse(spec), NUM_KV_HEADS, HEAD_DIM, torch.bfloat16, "cpu")
    view = page_view(fmt, fmt.allocate_pages(4, BLOCK_SIZE))
    q = torch.empty(batch, NUM_Q_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    table = torch.zeros(batch, context // BLOCK_SIZE, dtype=torch.int32)
    lens, qsl = torch.zeros(batch, dtype=torch.int32), torch.zeros(batch + 1, dtype=torch.int32)
    group = NUM_Q_HEADS // NUM_KV_HEADS
    return attention.paged_attention_kernel.warmup(
        out, q, *attention.launch_args(view, q.dtype), table, lens, qsl,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), table.stride(0),
        stride3(view.k), stride3(view.v), stride3(view.k_scale), stride3(view.v_scale),
        batch, 0.1, 1.0, 0,
        GROUP=group, HEAD_DIM=HEAD_DIM, HEAD_DIM_PAD=HEAD_DIM, BLOCK_SIZE=BLOCK_SIZE, BLOCK_M=tiles.block_m,
        BLOCK_Q=tiles.block_m // group, TILE_N=tiles.tile_n, USE_SOFTCAP=False, USE_WINDOW=False, KIND=view.kind,
        K_BITS=view.k_bits, V_BITS=view.v_bits, ROTATE_Q=view.rotate_keys, ROTATE_OUT=view.rotate_out,
        DOT_PRECISION="tf32", num_warps=tiles.num_warps, num_stages=tiles.num_stages, grid=(1,))


def sass_instructions(sass: str) -> list[tuple[int, str]]:
    """(address, instruction text) of each instruction of a SASS listing."""
    return [(int(m.group(1), 16), m.group(2).strip())
            for m in re.finditer(r"^\s+/\*([0-9a-f]{4,6})\*/\s+(.*?);", sass, re.M)]


def ptxas_usage(info: str) -> dict:
    """Registers per thread, spill-store bytes and the largest stack frame a thread (spilled registers, local
    arrays: the driver reserves it for every thread a GPU can hold, so tens of KB take gigabytes at launch) from a
    `ptxas -v` report."""
    return {"registers": int(re.search(r"Used (\d+) registers", info).group(1)),
            "spill_bytes": sum(int(x) for x in re.findall(r"(\d+) bytes spill stores", info)),
            "stack_bytes": max((int(n) for n in re.findall(r"(\d+) bytes stack frame", info)), default=0)}


def sass_branches(ins: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """(address, target) of each branch among a SASS listing's instructions (`sass_instructions`)."""
    return [(addr, int(m.group(1), 16)) for addr, text in ins if (m := re.search(r"BRA\s.*?0x([0-9a-f]+)", text))]


def loop_ranges(ins: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """(first, last) addresses of each loop among a SASS listing's instructions (a backward branch and the body it
    repeats), longest first."""
    return sorted(((target, addr) for addr, target in sass_branches(ins) if target < addr), key=lambda r: r[0] - r[1])


def sass_loops(sass: str) -> list[list[str]]:
    """Bodies of the backward branches of a SASS listing (loops), longest first."""
    ins = sass_instructions(sass)
    return [[t for a, t in ins if lo <= a <= hi] for lo, hi in loop_ranges(ins)]


def decode_batch(batch: int, context: int, window: bool, head_dim: int, dtype: torch.dtype):
    """(metadata, rings or None) of a decode batch of `batch` sequences of `context` tokens (all block ids 0: the
    compile sees the shapes only); with `window`, a dense recent window of 128 tokens planned and its rings."""
    from pagedkv.ops.metadata import AttentionMetadata, WindowPlan

    table = torch.zeros(batch, context // BLOCK_SIZE, dtype=torch.int32)
    lens, qsl = [context] * batch, list(range(batch + 1))
    meta = AttentionMetadata(table, torch.tensor(lens, dtype=torch.int32), torch.tensor(qsl, dtype=torch.int32),
                             torch.arange(batch, dtype=torch.int64), None, lens, qsl, BLOCK_SIZE)
    if not window:
        return meta, None
    num_ring_blocks = 128 // BLOCK_SIZE + 1
    rows, first = list(range(batch)), [(context - 128) // BLOCK_SIZE] * batch
    empty = torch.empty(0, dtype=torch.int64)
    meta.window = WindowPlan(empty, empty, torch.tensor(rows, dtype=torch.int32), torch.tensor(first, dtype=torch.int32),
                             rows, first, num_ring_blocks)
    rings = tuple(torch.empty(batch, num_ring_blocks, BLOCK_SIZE, NUM_KV_HEADS, head_dim, dtype=dtype) for _ in range(2))
    return meta, rings


def compile_warp_split(spec: str, tiles, batch: int = 64, context: int = 8192, window: bool = False):
    """The warp-split decode kernel (`ops/triton/decode.py`) with DecodeTiles `tiles`, compiled for sm_90; with
    `window`, the variant that reads a dense recent window (recent_tokens=128) beside the pages."""
    from pagedkv.ops.triton import decode

    fmt = make_format(KVFormat.parse(spec), NUM_KV_HEADS, HEAD_DIM, torch.bfloat16, "cpu")
    pages = fmt.allocate_pages(4, BLOCK_SIZE)
    meta, rings = decode_batch(batch, context, window, HEAD_DIM, torch.bfloat16)
    q = torch.empty(batch, NUM_Q_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    with _CompileOnly() as launches:
        decode.paged_attention(q, pages, fmt, meta, scale=0.1, tiles=tiles, window=rings)
    return launches.compiled[0]


def assemble(kernel) -> tuple[str, str]:
    """(ptxas -v report, SASS listing) of a compiled kernel, assembled for sm_90a."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = Path(tmp, "k.ptx"), Path(tmp, "k.cubin")
        ptx.write_text(kernel.asm["ptx"])
        maxnreg = getattr(kernel.metadata, "maxnreg", None)
        cap = [f"--maxrregcount={maxnreg}"] if maxnreg else []
        info = subprocess.run([str(TOOLS / "ptxas"), "-arch=sm_90a", "-v", *cap, str(ptx), "-o", str(cubin)],
                              capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([str(TOOLS / "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    return info, sass


def loop_ops(loop: list[str]) -> Counter:
    """Opcode counts (without modifiers) of a SASS loop body."""
    return Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in loop)


def gluon_report(head_dim: int, dtype: torch.dtype, num_splits: int, spec: str = "q8", window: bool = False,
                 **launch_options) -> dict:
    """A Gluon decode kernel (`ops/triton/decode_gluon.py`: q8, q4, q6, TurboQuant, off) compiled for sm_90:
    registers, spills, shared memory, keys a loop step (16, or 32 where the launcher picks PAIRS) and its loop's
    opcodes; with `window`, the variant whose splits stop where a dense recent window (recent_tokens=128) begins;
    `launch_options` go to the launch (`pairs=True`)."""
    from pagedkv.ops.triton import decode_gluon

    batch, context = 64, 8192
    fmt = make_format(KVFormat.parse(spec), NUM_KV_HEADS, head_dim, dtype, "cpu")
    meta, rings = decode_batch(batch, context, window, head_dim, dtype)
    options = dict(launch_options, **({"window": rings} if window else {}))
    with _CompileOnly() as launches:
        q = torch.empty(batch, NUM_Q_HEADS, head_dim, dtype=dtype)
        launch, _ = decode_gluon.launcher(fmt, q, BLOCK_SIZE, kernels=decode_gluon.KERNELS)
        launch(q, fmt.allocate_pages(4, BLOCK_SIZE), fmt, meta, scale=0.1, num_splits=num_splits, **options)
    kernel = launches.compiled[0]
    info, sass = assemble(kernel)
    ops = loop_ops(sass_loops(sass)[0])
    return {"format": spec, "head_dim": head_dim, "dtype": str(dtype), "num_splits": num_splits, "window": window,
            "keys_per_step": 32 if launches.options[0].get("PAIRS", False) else 16,
            "kv_heads_per_program": launches.options[0].get("HEADS", 1),
            "inner_splits": launches.options[0].get("INNER", 1), **ptxas_usage(info),
            "shared_bytes": kernel.metadata.shared, "loop_ops": dict(ops)}


def sass_digest(kernels) -> str:
    """A short hash of the compiled kernels' SASS instructions (names and line info left out)."""
    import hashlib

    h = hashlib.sha256()
    for kernel in kernels:
        h.update("\n".join(text for _, text in sass_instructions(assemble(kernel)[1])).encode())
    return h.hexdigest()[:16]


def sass_digests():
    """(launch description, SASS hash) of the decode kernels as served: `--sass-digest`."""
    from functools import partial
    from itertools import product

    from pagedkv.ops.triton import decode, decode_gluon
    from pagedkv.ops.triton.tuning import warp_split_tiles

    specs = ("q8", "q6", "q4", "turboquant", "turboquant:k=q4_0,v=q4_0", "off")
    for spec, head_dim, dtype, window, num_splits, ordered in product(
            specs, (64, 128), (torch.bfloat16, torch.float16), (False, True), (1, 4), (False, True)):
        fmt = make_format(KVFormat.parse(spec), NUM_KV_HEADS, head_dim, dtype, "cpu")
        q = torch.empty(64, NUM_Q_HEADS, head_dim, dtype=dtype)
        meta, rings = decode_batch(64, 8192, window, head_dim, dtype)
        gluon = decode_gluon.launcher(fmt, q, BLOCK_SIZE, kernels=decode_gluon.KERNELS, window=rings)
        families = {"gluon": gluon and gluon[0],
                    "decode.py": decode.is_supported(fmt, transposed=True)
                    and partial(decode.paged_attention, tiles=warp_split_tiles(fmt))}
        name = f"{spec} d{head_dim} {str(dtype)[6:]} window={window} splits={num_splits} ordered={ordered}"
        for family, launch in families.items():
            if launch:
                with _CompileOnly() as launches:
                    launch(q, fmt.allocate_pages(4, BLOCK_SIZE), fmt, meta, scale=0.1, num_splits=num_splits,
                           ordered=ordered, **({"window": rings} if window else {}))
                yield f"{family} {name}", sass_digest(launches.compiled)


def gluon_prefill_report(head_dim: int, dtype: torch.dtype, block_size: int = BLOCK_SIZE) -> dict:
    """The Gluon prefill kernel (`ops/triton/prefill_gluon.py`, dense pages) compiled for sm_90 for a 2,048-token
    chunk: registers, spills, shared memory and the opcodes of the whole kernel (its barrier waits branch back into
    the body, so its loops do not stand out as in the decode kernels)."""
    from pagedkv.ops.metadata import AttentionMetadata
    from pagedkv.ops.triton import prefill_gluon

    fmt = make_format(KVFormat.parse("off"), NUM_KV_HEADS, head_dim, dtype, "cpu")
    n = 2048
    q = torch.empty(n, NUM_Q_HEADS, head_dim, dtype=dtype)
    table = torch.zeros(1, n // block_size, dtype=torch.int32)
    meta = AttentionMetadata(table, torch.tensor([n], dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32),
                             torch.zeros(n, dtype=torch.int64), None, [n], [0, n], block_size)
    with _CompileOnly() as launches:
        prefill_gluon.paged_attention(q, fmt.allocate_pages(n // block_size, block_size), fmt, meta, scale=0.1)
    info, sass = assemble(launches.compiled[0])
    return {"head_dim": head_dim, "dtype": str(dtype), "block_size": block_size, **ptxas_usage(info),
            "shared_bytes": launches.compiled[0].metadata.shared,
            "ops": dict(loop_ops([text for _, text in sass_instructions(sass)]))}


def report(spec: str, tiles: TileConfig, kernel=None) -> dict:
    kernel = kernel or compile_decode(spec, tiles)
    info, sass = assemble(kernel)
    ttgir = kernel.asm["ttgir"]
    buffers = sorted({int(n) for n in re.findall(r"local_alloc : \(\) -> !ttg.memdesc<(\d+)x", ttgir)})
    loop = sass_loops(sass)[0]
    ops = loop_ops(loop)
    return {"format": spec, "tile_n": tiles.tile_n, "warps": tiles.num_warps, "stages": tiles.num_stages,
            **ptxas_usage(info), "shared_bytes": kernel.metadata.shared, "page_tile_buffers": buffers,
            "loop_instructions": len(loop), "per_key_row": round(len(loop) * tiles.num_warps / tiles.tile_n, 1),
            "top_ops": dict(ops.most_common(8)), "barriers": ops.get("BAR"), "local_loads": ops.get("LDL", 0)}


def dependent_launch_report() -> dict:
    """The grid-dependency instructions of the kernels of a split decode launched as programmatic dependents
    (`split_k.dependent_launch`, as on an sm_90 GPU), compiled for sm_90: kernel name -> its griddepcontrol lines,
    whether it is launched as a dependent and whether they follow all of its global stores.
    A K q4_0 / V q4_0 decode with a dense recent window (page kernel, window kernel, reduce), a dense one with its
    splits across programs, and a dense one laid out by `decode_gluon.dense_plan` (eight splits: four inside each
    program, two across), whatever `decode_gluon.DENSE_INNER` serves."""
    from pagedkv.ops.triton import decode_gluon, split_k

    found = {}
    saved = split_k.dependent_launch
    split_k.dependent_launch = lambda device: True
    try:
        # (name, format, with a window, splits, launch options); planned, `off` takes up to four splits inside a
        # program (`decode_gluon.dense_plan`): eight need a reduce
        cases = (("turboquant:k=q4_0,v=q4_0", "turboquant:k=q4_0,v=q4_0", True, 4, {}),
                 ("off", "off", False, 4, {"plan": False}), ("off-plan", "off", False, 8, {"plan": True}))
        for name, spec, window, num_splits, options in cases:
            fmt = make_format(KVFormat.parse(spec), NUM_KV_HEADS, HEAD_DIM, torch.bfloat16, "cpu")
            meta, rings = decode_batch(64, 8192, window, HEAD_DIM, torch.bfloat16)
            q = torch.empty(64, NUM_Q_HEADS, HEAD_DIM, dtype=torch.bfloat16)
            launch, _ = decode_gluon.launcher(fmt, q, BLOCK_SIZE, kernels=decode_gluon.KERNELS)
            with _CompileOnly() as launches:
                launch(q, fmt.allocate_pages(4, BLOCK_SIZE), fmt, meta, scale=0.1, num_splits=num_splits,
                       **({"window": rings} if window else {}), **options)
            for kernel, launched in zip(launches.compiled, launches.options):
                ptx = kernel.asm["ptx"].splitlines()
                at = [i for i, ln in enumerate(ptx) if "griddepcontrol" in ln]
                stores = [i for i, ln in enumerate(ptx) if "st.global" in ln]
                found[f"{name}/{kernel.name}"] = {"lines": [ptx[i].split(";")[0].strip() for i in at],
                                                  "launch_pdl": bool(launched.get("launch_pdl")),
                                                  "after_stores": bool(at and stores and at[0] > stores[-1])}
    finally:
        split_k.dependent_launch = saved
    return found


class _CompileOnly:
    """Within it, `kernel[grid](...)` compiles for the active target and launches nothing; `compiled` holds the
    compiled kernels in launch order, `options` each launch's keyword arguments (the constexprs among them)."""

    def __enter__(self):
        from triton.runtime.jit import JITFunction

        self.compiled, self.options = [], []
        self._run = JITFunction.run

        def compile_only(fn, *args, grid, warmup, **kw):
            self.options.append(kw)
            kernel = self._run(fn, *args, grid=grid, warmup=True, **kw)
            self.compiled.append(kernel)
            return kernel

        JITFunction.run = compile_only
        return self

    def __exit__(self, *exc):
        from triton.runtime.jit import JITFunction

        JITFunction.run = self._run


def compile_all(spec: str, dtype: torch.dtype, head_dim: int, num_q_heads: int = 8, num_kv_heads: int = 2) -> list:
    """Compile the write, attention (decode and prefill tiles), split-K, warp-split decode (formats it reads)
    and reduce kernels of one format, with the tiles the library gives `dtype`; returns the compiled kernels."""
    from pagedkv.ops.metadata import AttentionMetadata
    from pagedkv.ops.metadata import WindowPlan
    from pagedkv.ops.triton import decode, dense_prefill, kv_write, split_k
    from pagedkv.ops.triton.tuning import split_tiles

    cuda = torch.device("cuda")
    fmt = make_format(KVFormat.parse(spec), num_kv_heads, head_dim, dtype, "cpu")
    pages = fmt.allocate_pages(8, BLOCK_SIZE)
    seqs, new = 2, 3
    table = torch.arange(8, dtype=torch.int32).view(seqs, 4)
    meta = AttentionMetadata(table, torch.tensor([40, 20], dtype=torch.int32), torch.tensor([0, new, 2 * new], dtype=torch.int32),
                             torch.arange(seqs * new, dtype=torch.int64), None, [40, 20], [0, new, 2 * new], BLOCK_SIZE)
    q = torch.empty(seqs * new, num_q_heads, head_dim, dtype=dtype)
    k = torch.empty(seqs * new, num_kv_heads, head_dim, dtype=dtype)
    group = num_q_heads // num_kv_heads
    pages_kind = page_class(fmt)
    with _CompileOnly() as launches:
        kv_write.write_kv(pages, fmt, k, k, meta)
        for tiles in (choose_tiles(seqs, seqs, group, head_dim, cuda, pages=pages_kind, dtype=dtype),     # decode
                      choose_tiles(4096, seqs, group, head_dim, cuda, pages=pages_kind, dtype=dtype)):    # prefill
            attention.paged_attention(q, pages, fmt, meta, scale=0.1, tiles=tiles)
        split_k.paged_attention(q, pages, fmt, meta, scale=0.1, num_splits=4,
                                tiles=split_tiles(group, head_dim, pages_kind, dtype=dtype))
        if decode.is_supported(fmt):
            for num_splits in (1, 4):
                decode.paged_attention(q, pages, fmt, meta, scale=0.1, num_splits=num_splits)
        if fmt.spec.kind != "dense" and not head_dim & (head_dim - 1):   # prefill through dense scratch pages,
            dense_prefill.paged_attention(q, pages, fmt, meta, scale=0.1)   # without and with a dense window
            rings = tuple(torch.empty(seqs, 2, BLOCK_SIZE, num_kv_heads, head_dim, dtype=dtype) for _ in range(2))
            per_seq = torch.tensor([[0, 1], [2, 1]], dtype=torch.int32)
            empty = torch.empty(0, dtype=torch.int64)
            windowed = dataclasses.replace(meta, window=WindowPlan(empty, empty, per_seq[0], per_seq[1], [0, 1], [2, 1], 2))
            dense_prefill.paged_attention(q, pages, fmt, windowed, scale=0.1, window=rings)
    return launches.compiled


def count_variants(spec: str) -> dict:
    """Compile the decode and split-K attention kernels for batches of several sizes and block-table widths
    (1, 2, 3, 16 sequences; 1 to 17 blocks each); return how many kernels each one compiled."""
    from pagedkv.ops.metadata import AttentionMetadata
    from pagedkv.ops.triton import decode, split_k
    from pagedkv.ops.triton.tuning import split_tiles

    fmt = make_format(KVFormat.parse(spec), 2, 64, torch.bfloat16, "cpu")
    pages = fmt.allocate_pages(64, BLOCK_SIZE)
    kernels = (attention.paged_attention_kernel, split_k.split_attention_kernel, split_k.reduce_splits_kernel)
    from pagedkv.ops.triton.tuning import warp_split_tiles

    warp_split = None
    if decode.is_supported(fmt) and spec != "off":
        warp_split = decode.decode_kernel_transposed if warp_split_tiles(fmt).transposed else decode.decode_kernel
        kernels += (warp_split,)
    before = {k.fn.__name__: len(k.device_caches[0][0]) for k in kernels}
    with _CompileOnly():
        for seqs, width in ((1, 1), (2, 4), (16, 16), (3, 17)):
            table = torch.arange(seqs * width, dtype=torch.int32).remainder(64).view(seqs, width)
            lens = [width * BLOCK_SIZE] * seqs
            qsl = list(range(seqs + 1))
            meta = AttentionMetadata(table, torch.tensor(lens, dtype=torch.int32), torch.tensor(qsl, dtype=torch.int32),
                                     torch.arange(seqs, dtype=torch.int64), None, lens, qsl, BLOCK_SIZE)
            q = torch.empty(seqs, 8, 64, dtype=torch.bfloat16)
            tiles = choose_tiles(seqs, seqs, 4, 64, torch.device("cuda"), pages=page_class(fmt))
            attention.paged_attention(q, pages, fmt, meta, scale=0.1, tiles=tiles)
            split_k.paged_attention(q, pages, fmt, meta, scale=0.1, num_splits=4, tiles=split_tiles(4, 64, page_class(fmt)))
            if warp_split is not None:
                for num_splits in (1, 4):
                    decode.paged_attention(q, pages, fmt, meta, scale=0.1, num_splits=num_splits)
    return {k.fn.__name__: len(k.device_caches[0][0]) - before[k.fn.__name__] for k in kernels}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--formats", default="off,q8,q4,turboquant", help="','-separated; use ';' if a format has commas")
    parser.add_argument("--configs", default="default",
                        help="TILE_NxWARPSxSTAGES list, e.g. 64x4x5,128x4x2; 'default' = the decode defaults")
    parser.add_argument("--json", default=None)
    parser.add_argument("--compile-all", action="store_true", help="compile every kernel for each format, dtype, head_dim")
    parser.add_argument("--dtypes", default="bfloat16,float16,float32", help="with --compile-all: query dtypes")
    parser.add_argument("--head-dims", default="64,128,256", help="with --compile-all")
    parser.add_argument("--stack-limit", type=int, default=None,
                        help="with --compile-all: fail a format whose kernels take more stack a thread (bytes)")
    parser.add_argument("--warp-split", action="store_true",
                        help="the warp-split decode kernel: each format's default, the original orientation, lower register caps; "
                             "both orientations reading a recent window")
    parser.add_argument("--count-variants", action="store_true",
                        help="print (JSON) how many kernels a run over several batch shapes compiles; 1 each is right, "
                             "2 for the split reduce (small grids share channels)")
    parser.add_argument("--gluon", action="store_true",
                        help="print (JSON) the Gluon decode kernels' registers, spills and loop opcodes (q8 per head_dim, "
                             "dtype and split; TurboQuant q8_0/q3_0 and q4_0/q4_0, q4, q6 and off, per dtype; q8, "
                             "TurboQuant and q4 with a dense recent window)")
    parser.add_argument("--gluon-offsets", action="store_true",
                        help="print (JSON) the Gluon decode kernels (q8, q4, q6, TurboQuant q8_0/q3_0 and q4_0/q4_0, "
                             "off; bfloat16, head_dim 128, 4 splits, longest first) with page offsets in int64 and in "
                             "int32 (`decode_gluon.offsets_in_32_bits`)")
    parser.add_argument("--gluon-skew", action="store_true",
                        help="print (JSON) the TurboQuant Gluon decode kernel (K q8_0 / V q3_0) as served, with its "
                             "loop software-pipelined (`skew`: TQ_SKEW; with three stages; with every lean option) "
                             "and its work-only probe both ways; q4 as served and skewed (Q4_SKEW)")
    parser.add_argument("--gluon-copies", action="store_true",
                        help="print (JSON) the TurboQuant Gluon decode kernels (16 keys a step) and their probes "
                             "(probe='copies': the page copies alone; probe='work': the work alone)")
    parser.add_argument("--gluon-lean", action="store_true",
                        help="print (JSON) the TurboQuant Gluon decode kernels with their scale columns shifted out "
                             "of their words and widened from half registers (`halves`, served); K q8_0 / V q3_0 also "
                             "with its codebook tables in registers (`tables`), capped as served and uncapped; q4 with "
                             "its keys over their offsets (`offset_keys`); K q8_0 / V q3_0 with constant slot strides "
                             "(`rows`), then with the tables, 32-bit page offsets and the softmax sums in the lanes "
                             "too; q4 with its keys over their offsets, the sums in the lanes and 32-bit page offsets")
    parser.add_argument("--sass-digest", action="store_true",
                        help="print a hash of each decode kernel's SASS per launch (formats, dtypes, head_dims, "
                             "splits, orders, window): diff two runs to see that a change left the kernels as they are")
    parser.add_argument("--ordered", action="store_true",
                        help="with --gluon: the kernels launched longest sequence first (`ordered=True`, `launch_grid`)")
    parser.add_argument("--dependent-launch", action="store_true",
                        help="print (JSON) the griddepcontrol instructions of a split decode's kernels (PDL)")
    parser.add_argument("--gluon-ids-ahead", action="store_true",
                        help="print (JSON) the dense Gluon decode kernel (head_dim 64 and 128) and the TurboQuant ones (16 "
                             "keys a step) with block ids loaded a step ahead and without (`ids_ahead`), 4 splits")
    parser.add_argument("--gluon-inner", action="store_true",
                        help="print (JSON) the dense Gluon decode kernel (head_dim 64 and 128) as served (4 splits) "
                             "and with its splits inside a program (`inner`: 2 heads x 4 warps, 1 and 4 splits)")
    parser.add_argument("--gluon-prefill", action="store_true",
                        help="print (JSON) the Gluon prefill kernel's registers, spills, shared memory and opcodes "
                             "(head_dim 64 and 128, both 16-bit dtypes; blocks of 16 and 64)")
    args = parser.parse_args()
    driver.set_active(_Sm90Target())
    if args.dependent_launch:
        print(json.dumps(dependent_launch_report()), flush=True)
        return
    if args.gluon_ids_ahead:
        for spec, head_dim, options in (("off", 64, {}), ("off", 128, {}), ("turboquant", 128, {"pairs": False}),
                                        ("turboquant:k=q4_0,v=q4_0", 128, {"pairs": False})):
            for ids_ahead in (False, True):
                row = gluon_report(head_dim, torch.bfloat16, 4, spec, ids_ahead=ids_ahead, **options)
                print(json.dumps({**row, "ids_ahead": ids_ahead}), flush=True)
        return
    if args.gluon_inner:
        for head_dim in (64, 128):
            for inner, heads, splits in ((1, None, 4), (4, 2, 1), (4, 2, 4)):
                row = gluon_report(head_dim, torch.bfloat16, splits, "off", ordered=True, inner=inner, heads=heads)
                print(json.dumps({**row, "inner": inner}), flush=True)
        return
    if args.gluon_offsets:
        for spec in ("q8", "q4", "q6", "turboquant", "turboquant:k=q4_0,v=q4_0", "off"):
            for offsets32 in (False, True):
                row = gluon_report(128, torch.bfloat16, 4, spec, ordered=True, offsets32=offsets32,
                                   **({"inner": 1} if spec == "off" else {}))
                print(json.dumps({**row, "offsets32": offsets32}), flush=True)
        return
    if args.gluon_skew:
        tq = ({}, {"skew": True}, {"skew": True, "stages": 3},
              {"skew": True, "rows": True, "tables": True, "offsets32": True}, {"probe": "work"},
              {"probe": "work", "skew": True})
        for spec, options in [("turboquant", o) for o in tq] + [("q4", {}), ("q4", {"skew": True})]:
            row = gluon_report(128, torch.bfloat16, 2, spec, ordered=True, **options)
            print(json.dumps({**row, "options": options}), flush=True)
        return
    if args.gluon_copies:
        for spec in ("turboquant", "turboquant:k=q4_0,v=q4_0"):
            for probe in (None, "copies", "work"):
                row = gluon_report(128, torch.bfloat16, 2, spec, ordered=True, pairs=False, probe=probe)
                print(json.dumps({**row, "probe": probe or "kernel"}), flush=True)
        return
    if args.gluon_lean:
        # the scale columns shifted out of their words (as served before TQ_HALVES) first, then the lean variants;
        # the softmax sums across the lanes every step (as served before LANE_SUMS) where a row does not name them
        for spec, variants in (("turboquant", ({"halves": False}, {"halves": True}, {"halves": True, "tables": True},
                                               {"halves": True, "tables": True, "max_registers": 0})),
                               ("turboquant:k=q4_0,v=q4_0", ({"halves": False}, {"halves": True})),
                               ("q4", ({"offset_keys": False}, {"offset_keys": True})),
                               ("turboquant", ({"rows": True}, {"rows": True, "tables": True, "offsets32": True,
                                                               "lane_sums": True})),
                               ("q4", ({"offset_keys": True, "lane_sums": True, "offsets32": True},))):
            for options in variants:
                options = {"lane_sums": False, **options}
                row = gluon_report(128, torch.bfloat16, 2, spec, ordered=True, **options)
                print(json.dumps({**row, "options": options}), flush=True)
        return
    if args.sass_digest:
        for name, digest in sass_digests():
            print(f"{name}: {digest}", flush=True)
        return
    if args.gluon_prefill:
        for head_dim in (64, 128):
            for dtype in (torch.bfloat16, torch.float16):
                print(json.dumps(gluon_prefill_report(head_dim, dtype)), flush=True)
        print(json.dumps(gluon_prefill_report(128, torch.bfloat16, block_size=64)), flush=True)
        return
    if args.gluon:
        order = {"ordered": True} if args.ordered else {}
        for head_dim in (64, 128):
            for dtype in (torch.bfloat16, torch.float16):
                for num_splits in (1, 4):
                    print(json.dumps(gluon_report(head_dim, dtype, num_splits, **order)), flush=True)
        for spec in ("turboquant", "turboquant:k=q4_0,v=q4_0", "q4", "q6", "off"):
            for dtype in (torch.bfloat16, torch.float16):
                print(json.dumps(gluon_report(128, dtype, 4, spec, **order)), flush=True)
        for dtype in (torch.bfloat16, torch.float16):   # `off` one KV head a program (the default: four)
            print(json.dumps(gluon_report(128, dtype, 4, "off", heads=1, **order)), flush=True)
        for spec in ("q8", "turboquant", "q4"):   # the pages' splits of a decode with a dense recent window
            print(json.dumps(gluon_report(128, torch.bfloat16, 4, spec, window=True, **order)), flush=True)
        return
    formats = args.formats.split(";") if ";" in args.formats else args.formats.split(",")
    if args.count_variants:
        for spec in formats:
            print(json.dumps(count_variants(spec)), flush=True)
        return
    if args.compile_all:
        failed = 0
        for spec in formats:
            for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
                for head_dim in map(int, args.head_dims.split(",")):
                    try:
                        kernels = compile_all(spec, dtype, head_dim)
                        status = "ok"
                        if args.stack_limit is not None:
                            stack = max(ptxas_usage(assemble(k)[0])["stack_bytes"] for k in kernels)
                            status = f"ok, stack {stack} bytes"
                            if stack > args.stack_limit:
                                failed += 1
                                status = f"FAILED stack {stack} bytes > {args.stack_limit}"
                    except Exception as e:  # noqa: BLE001  (reported, then the exit code says so)
                        failed += 1
                        status = f"FAILED {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
                    print(f"{spec:40s} {str(dtype):15s} head_dim {head_dim:3d}: {status}", flush=True)
        sys.exit(1 if failed else 0)
    if args.warp_split:
        import dataclasses

        from pagedkv.ops.triton import decode
        from pagedkv.ops.triton.tuning import DecodeTiles, warp_split_tiles

        rows = []
        for spec in formats:
            fmt = make_format(KVFormat.parse(spec), NUM_KV_HEADS, HEAD_DIM, torch.bfloat16, "cpu")
            base = warp_split_tiles(fmt)
            variants = [base]
            if decode.is_supported(fmt, transposed=False):
                variants.append(DecodeTiles(32, 4, 3))
            variants += [dataclasses.replace(base, max_registers=r) for r in (96, 80)]
            # then each orientation reading a dense recent window beside the pages
            for tiles, window in [(t, False) for t in variants] + [(t, True) for t in variants[:-2]]:
                r = report(spec, TileConfig(16, tiles.tile_n, tiles.num_warps, tiles.num_stages),
                           compile_warp_split(spec, tiles, window=window))
                r.update(transposed=tiles.transposed, num_stages=tiles.num_stages, max_registers=tiles.max_registers,
                         window=window)
                rows.append(r)
                print(json.dumps({k: r[k] for k in ("format", "tile_n", "transposed", "num_stages", "max_registers", "window",
                                                     "registers", "spill_bytes", "shared_bytes", "loop_instructions",
                                                     "per_key_row", "barriers")}),
                      flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
        return
    rows = []
    print(f"{'format':28s} {'tiles':>9s} {'regs':>5s} {'spill':>6s} {'smem KB':>8s} {'buffers':>8s} {'loop':>6s} {'/key row':>9s}")
    for spec in formats:
        fmt = make_format(KVFormat.parse(spec), NUM_KV_HEADS, HEAD_DIM, torch.bfloat16, "cpu")
        configs = ([choose_tiles(64, 64, 4, HEAD_DIM, torch.device("cuda"), pages=page_class(fmt))]
                   if args.configs == "default" else
                   [TileConfig(16, *map(int, c.split("x"))) for c in args.configs.split(",")])
        for tiles in configs:
            r = report(spec, tiles)
            rows.append(r)
            shape = "{tile_n}x{warps}x{stages}".format(**r)
            print(f"{spec:28s} {shape:>9s} {r['registers']:5d} {r['spill_bytes']:6d} "
                  f"{r['shared_bytes'] / 1024:8.1f} {str(r['page_tile_buffers']):>8s} {r['loop_instructions']:6d} "
                  f"{r['per_key_row']:9.1f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
