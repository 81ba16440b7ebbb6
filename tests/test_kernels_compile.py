"""The Triton kernels compile for a Hopper GPU (sm_90) with the launch shapes
the host wrappers choose on CUDA, checked on a machine without a GPU: Triton
lowers to PTX and its bundled ptxas assembles it. The interpreter tests check
the arithmetic; this checks what the interpreter cannot (layouts, shared
memory, register spills), in a subprocess because the interpreter switch is
per process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

SCRIPT = textwrap.dedent("""
    import json, os, subprocess, sys, tempfile
    import torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from testbed.kernels.triton_attention import _combine_splits_kernel as combine, _paged_attention_kernel as attn
    from testbed.kernels.triton_attention import default_tile
    from testbed.kernels.triton_kv import _copy_blocks_kernel as copy

    TL = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")

    def build(kernel, types, constexprs, aligned, **options):
        sig = {n: types.get(n, "i32") for n in kernel.arg_names}
        sig.update({n: "constexpr" for n in constexprs})
        # what the launcher specialises at run time: 16-byte aligned pointers, strides that are multiples of 16
        attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
        ck = triton.compile(ASTSource(kernel, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                            options=options)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(ck.asm["cubin"]); f.flush()
            usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        line = next(l for l in usage.splitlines() if "REG:" in l)
        fields = dict(kv.split(":") for kv in line.split() if ":" in kv)
        return {"regs": int(fields["REG"]), "local": int(fields["LOCAL"]), "shared": ck.metadata.shared}

    results = {}
    ptrs = ["out_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr", "block_tables_ptr", "seq_lens_ptr",
            "query_start_loc_ptr", "work_seq_ptr", "work_q_first_ptr", "part_ptr", "lse_ptr"]
    strides = ["stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_cb", "stride_ct", "stride_ch"]
    for name, dtype, head_dim, group, max_q, splits in [("decode_bf16_d128_g4", torch.bfloat16, 128, 4, 1, 1),
                                                        ("decode_split8_bf16_d128_g4", torch.bfloat16, 128, 4, 1, 8),
                                                        ("chunk_bf16_d128_g4", torch.bfloat16, 128, 4, 512, 1),
                                                        ("chunk_fp16_d64_g8", torch.float16, 64, 8, 2048, 1),
                                                        ("chunk_fp32_d128_g1", torch.float32, 128, 1, 64, 1)]:
        tile = default_tile(max_q, group, torch.device("cuda"))
        types = {n: "*" + TL[dtype] for n in ptrs[:4]}
        types.update({n: "*i32" for n in ptrs[4:9]}, part_ptr="*fp32", lse_ptr="*fp32", scale_log2e="fp32")
        const = dict(BLOCK_SIZE=16, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=head_dim, BLOCK_M=tile.block_m,
                     BLOCK_Q=tile.block_m // group,
                     BLOCK_N=tile.block_n, DOT_FP32=False,
                     DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32", NUM_SPLITS=splits)
        results[name] = build(attn, types, const, ptrs + strides,
                              num_warps=tile.num_warps, num_stages=tile.num_stages)
    results["combine_splits_bf16"] = build(combine, {"out_ptr": "*bf16", "part_ptr": "*fp32", "lse_ptr": "*fp32"},
                                           dict(NUM_SPLITS=8, HEAD_DIM=128, BLOCK_D=128, BLOCK_R=16),
                                           ["out_ptr", "part_ptr", "lse_ptr", "stride_ot", "stride_oh"], num_warps=4)
    results["copy_blocks_i16"] = build(copy, {"src_ptr": "*i16", "dst_ptr": "*i16", "block_ids_ptr": "*i64"},
                                       dict(GATHER=True, BLOCK=4096), ["src_ptr", "dst_ptr", "inner"], num_warps=4)
    print(json.dumps(results))
""")


@pytest.mark.skipif(sys.platform != "linux", reason="Triton's bundled ptxas is a Linux binary")
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the CUDA tests compile and run the kernels")
def test_kernels_compile_for_sm90():
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    print(results)
    assert len(results) == 7
    for name, r in results.items():
        assert r["local"] == 0, f"{name} spills registers to local memory: {r}"
        assert r["shared"] <= 227 * 1024, f"{name} needs more shared memory than an SM has: {r}"
