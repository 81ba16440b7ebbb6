"""Triton KV block gather/scatter (kernels/triton_kv.py) against the reference
copies and against kv_ops (the torch path it stands in for on a GPU)."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")      # before triton is first imported

from testbed.kernels import kv_ops                                                 # noqa: E402
from testbed.kernels.reference import ref_gather_blocks, ref_scatter_blocks       # noqa: E402
from testbed.kernels.triton_kv import gather_blocks, scatter_blocks               # noqa: E402

HAS_CUDA = torch.cuda.is_available()
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(HAS_CUDA, reason="on a GPU machine the kernels are compiled "
                                                 "for CUDA; the interpreter runs them where there is no GPU")),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]),
]


def engine_cache(dtype, device, num_blocks=9):
    # [layers, 2, num_blocks, block_size, Hkv, D], as the real executor holds it
    return torch.randn(3, 2, num_blocks, 4, 2, 8, generator=torch.Generator().manual_seed(1)).to(dtype).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gather_then_scatter_whole_cache(device, dtype):
    cache = engine_cache(dtype, device)
    ids = torch.tensor([7, 2, 5])
    sent = gather_blocks(cache, ids, dim=2)                       # [3, 2, 3, 4, 2, 8]
    assert torch.equal(sent.cpu(), kv_ops.gather_blocks(cache.cpu(), ids, dim=2))
    dest = torch.zeros_like(cache)
    scatter_blocks(dest, torch.tensor([0, 8, 3]), sent, dim=2)
    expected = torch.zeros_like(cache).cpu()
    kv_ops.scatter_blocks(expected, torch.tensor([0, 8, 3]), sent.cpu(), dim=2)
    assert torch.equal(dest.cpu(), expected)
    assert dest[:, :, [1, 2, 4, 5, 6, 7]].abs().sum().item() == 0     # other blocks untouched


@pytest.mark.parametrize("device", DEVICES)
def test_one_layer_against_reference(device):
    layer = engine_cache(torch.float32, device)[1, 0]                # [num_blocks, 4, 2, 8]
    ids = [4, 0, 8, 1]
    out = torch.empty(4, 4, 2, 8, device=device)
    got = gather_blocks(layer, torch.tensor(ids), out=out)
    assert got is out and torch.equal(out.cpu(), ref_gather_blocks(layer.cpu(), ids))
    dest, ref = torch.zeros_like(layer), torch.zeros_like(layer).cpu()
    scatter_blocks(dest, torch.tensor(ids), out)
    ref_scatter_blocks(ref, ids, out.cpu())
    assert torch.equal(dest.cpu(), ref)


@pytest.mark.parametrize("device", DEVICES)
def test_no_blocks(device):
    cache = engine_cache(torch.float32, device)
    empty = torch.tensor([], dtype=torch.long)
    assert gather_blocks(cache, empty, dim=2).shape == (3, 2, 0, 4, 2, 8)
    before = cache.clone()
    scatter_blocks(cache, empty, cache[:, :, :0], dim=2)
    assert torch.equal(cache, before)


def test_bad_input_is_named():
    cache = engine_cache(torch.float32, "cpu")
    with pytest.raises(ValueError, match="out of range for 9 blocks"):
        gather_blocks(cache, torch.tensor([9]), dim=2)
    with pytest.raises(ValueError, match="1-D integer"):
        gather_blocks(cache, torch.tensor([1.0]), dim=2)
    with pytest.raises(ValueError, match="data"):
        scatter_blocks(cache, torch.tensor([1, 2]), cache[:, :, :1], dim=2)
    with pytest.raises(ValueError, match="contiguous"):
        gather_blocks(cache.transpose(3, 4), torch.tensor([1]), dim=2)
