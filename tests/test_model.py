"""Our Llama-family model over the paged KV cache against Hugging Face
transformers, for the same random weights saved as a safetensors checkpoint and
loaded through `ModelConfig(path=...)` (so the loader is tested too).

The HF models get weights scaled like our seeded init (unit activations, peaked
logits) rather than HF's tiny default init, under which every logit would be
~0 and a wrong rotary base or a swapped k/v would still pass a 1e-4 tolerance.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from testbed.block_manager import BlockManager
from testbed.engine import Engine, WallClock
from testbed.kernels.attention import AttentionMetadata
from testbed.model.config import ModelConfig
from testbed.model.loader import load_model
from testbed.model_executor import ModelExecutor
from testbed.request import Request
from testbed.schedulers import SchedulerConfig, make_scheduler

transformers = pytest.importorskip("transformers")

BLOCK_SIZE = 16
NUM_BLOCKS = 16
LOGIT_TOL = 1e-4

ARCHS = {
    # GQA 4:2 with head_dim 32 != hidden/heads, a rope base far from 10000
    "llama": dict(cls="LlamaForCausalLM", cfg="LlamaConfig", hidden_size=96, intermediate_size=160,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  rope_theta=50_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
    "llama_tied": dict(cls="LlamaForCausalLM", cfg="LlamaConfig", hidden_size=128, intermediate_size=192,
                       num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                       rope_theta=500_000.0, rms_norm_eps=1e-5, tie_word_embeddings=True),
    # Qwen2: q/k/v biases
    "qwen2": dict(cls="Qwen2ForCausalLM", cfg="Qwen2Config", hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
}


def _hf_config(arch: str):
    spec = dict(ARCHS[arch])
    cls_name, cfg_name, rope_theta = spec.pop("cls"), spec.pop("cfg"), spec.pop("rope_theta")
    cfg = getattr(transformers, cfg_name)(vocab_size=512, max_position_embeddings=256, rope_theta=rope_theta,
                                          attn_implementation="eager", **spec)
    return getattr(transformers, cls_name), cfg


def save_hf_checkpoint(arch: str, path: Path, seed: int = 0):
    """A random HF model saved to `path` (config.json + model.safetensors); returns it."""
    cls, cfg = _hf_config(arch)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))   # not all-ones: catches a dropped norm
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name == "lm_head.weight":
                p.copy_(torch.randn(p.shape, generator=gen) * (4.0 / math.sqrt(p.shape[1])))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(scope="module", params=sorted(ARCHS))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, save_hf_checkpoint(request.param, path)


def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()          # [T, vocab]


def paged_logits(ex: ModelExecutor, bm: BlockManager, tokens: list[int], slice_lens: list[int]) -> torch.Tensor:
    """Run `tokens` through ex.model over the paged cache as consecutive slices
    of one request (a chunk, then decode-like slices of 1); logits of every position."""
    assert sum(slice_lens) == len(tokens)
    req = Request("seq", tokens, max_tokens=1)
    out, start = [], 0
    for n in slice_lens:
        end = start + n
        assert bm.allocate(req, end)
        table = bm.block_table("seq")
        slots = torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)])
        meta = AttentionMetadata([0, n], [end], [list(table)], slots, BLOCK_SIZE)
        with torch.inference_mode():
            hidden = ex.model(torch.tensor(tokens[start:end]), torch.arange(start, end), ex.kv_cache, meta,
                              ex.backend)
            out.append(ex.model.compute_logits(hidden))
        start = end
    bm.free("seq")
    return torch.cat(out)


def top2_margin(logits: torch.Tensor) -> float:
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def test_loader_reads_the_architecture_from_config_json(checkpoint):
    arch, path, hf = checkpoint
    _, cfg = load_model(ModelConfig(path=str(path)))
    spec = ARCHS[arch]
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (512, spec["hidden_size"],
                                                                        spec["intermediate_size"])
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (
        spec["num_hidden_layers"], spec["num_attention_heads"], spec["num_key_value_heads"])
    assert cfg.resolved_head_dim == spec.get("head_dim", spec["hidden_size"] // spec["num_attention_heads"])
    assert cfg.rope_theta == spec["rope_theta"]
    assert cfg.rms_norm_eps == spec["rms_norm_eps"]
    assert cfg.tie_word_embeddings == spec["tie_word_embeddings"]
    assert cfg.attention_bias == (arch == "qwen2")


def test_paged_logits_equal_hf_at_every_position(checkpoint):
    """A 37-token chunk (crossing two block boundaries), a 12-token chunk, then
    six 1-token decode-like steps: every position's logits match HF's full forward."""
    arch, path, hf = checkpoint
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 512, (55,), generator=gen).tolist()
    bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
    ex = ModelExecutor(ModelConfig(path=str(path)), NUM_BLOCKS, BLOCK_SIZE, bm.block_table)
    ours = paged_logits(ex, bm, tokens, [37, 12, 1, 1, 1, 1, 1, 1])
    ref = hf_logits(hf, tokens)
    assert ref.abs().max() > 5.0             # peaked logits: a real comparison, not noise around 0
    torch.testing.assert_close(ours, ref, atol=LOGIT_TOL, rtol=LOGIT_TOL)
    assert bm.all_free()


def test_engine_greedy_tokens_equal_hf_greedy(checkpoint):
    """End to end through the engine (sarathi, chunks of 16) against HF's
    greedy continuation computed with full forwards."""
    arch, path, hf = checkpoint
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, 512, (40,), generator=gen).tolist()
    seq, margins = list(prompt), []
    for _ in range(8):
        logits = hf_logits(hf, seq)[-1]
        seq.append(int(torch.argmax(logits)))
        margins.append(top2_margin(logits))
    bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
    sched = make_scheduler("sarathi", SchedulerConfig(token_budget=16, max_num_seqs=4,
                                                      max_num_batched_tokens=512), bm)
    ex = ModelExecutor(ModelConfig(path=str(path)), NUM_BLOCKS, BLOCK_SIZE, bm.block_table)
    engine = Engine(sched, ex, WallClock())
    req = Request("r0", prompt, max_tokens=8)
    engine.add_request(req)
    while engine.has_work():
        engine.step()
    expected = seq[len(prompt):]
    diverged = next((i for i, (a, b) in enumerate(zip(req.output_token_ids, expected)) if a != b), None)
    # a divergence at a near tie is fp32 rounding, not a bug: the message says which
    assert diverged is None, (f"token {diverged} differs: ours {req.output_token_ids[diverged]}, HF {expected[diverged]}; "
                              f"HF top-2 logit margin there {margins[diverged]:.2e}")
    assert req.output_token_ids == expected
    assert bm.all_free()


# ---- loader errors ---------------------------------------------------------------

@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_err")
    save_hf_checkpoint("llama", path)
    return path


def _edited_copy(src: Path, dst: Path, edit) -> Path:
    """Copy of checkpoint `src` in `dst` with edit(tensors) applied to its weights."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_missing_tensor_is_named(llama_dir, tmp_path):
    name = "model.layers.1.self_attn.k_proj.weight"
    path = _edited_copy(llama_dir, tmp_path / "ckpt", lambda t: t.pop(name))
    with pytest.raises(ValueError, match=f"missing tensor '{name}'"):
        load_model(ModelConfig(path=str(path)))


@pytest.mark.parametrize("name", ["model.layers.0.mlp.down_proj.weight", "model.layers.2.self_attn.v_proj.weight",
                                  "model.norm.weight"])
def test_misshaped_tensor_is_named(llama_dir, tmp_path, name):
    def shrink(t):
        t[name] = t[name][:-1].clone()
    path = _edited_copy(llama_dir, tmp_path / "ckpt", shrink)
    with pytest.raises(ValueError, match=f"'{name}'.*shape"):
        load_model(ModelConfig(path=str(path)))


def test_qkv_rows_moved_between_tensors_are_caught(llama_dir, tmp_path):
    """q one head too big, k one head too small: the fused q|k|v has the right
    total shape, so only a per-tensor check can see it."""
    def move(t):
        q, k = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
        t[q] = torch.cat([t[q], t[k][:32]]).contiguous()
        t[k] = t[k][32:].clone()
    path = _edited_copy(llama_dir, tmp_path / "ckpt", move)
    with pytest.raises(ValueError, match="q_proj.weight'.*shape"):
        load_model(ModelConfig(path=str(path)))


def test_unexpected_tensor_is_named(llama_dir, tmp_path):
    def add(t):
        t["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(96)
    path = _edited_copy(llama_dir, tmp_path / "ckpt", add)
    with pytest.raises(ValueError, match="unexpected tensor.*o_proj.bias"):
        load_model(ModelConfig(path=str(path)))


def test_a_corrupt_safetensors_file_is_named(llama_dir, tmp_path):
    (tmp_path / "config.json").write_text((llama_dir / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes((llama_dir / "model.safetensors").read_bytes()[:1000])
    with pytest.raises(ValueError, match=r"model\.path: '.*model\.safetensors' is not a readable safetensors file"):
        load_model(ModelConfig(path=str(tmp_path)))


def test_missing_checkpoint_dir(tmp_path):
    with pytest.raises(ValueError, match=r"model\.path: checkpoint directory .*nope.* does not exist"):
        load_model(ModelConfig(path=str(tmp_path / "nope")))


def test_missing_config_json(llama_dir, tmp_path):
    (tmp_path / "model.safetensors").write_bytes((llama_dir / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match=r"model\.path: .* has no config\.json"):
        load_model(ModelConfig(path=str(tmp_path)))


def test_missing_safetensors(llama_dir, tmp_path):
    (tmp_path / "config.json").write_text((llama_dir / "config.json").read_text())
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        load_model(ModelConfig(path=str(tmp_path)))


def test_unsupported_rope_scaling_is_refused(llama_dir, tmp_path):
    """A Llama-3.1-style rope_type=llama3 would silently give wrong logits
    with plain rotary embeddings: refuse it, naming the field."""
    src = json.loads((llama_dir / "config.json").read_text())
    src["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}
    (tmp_path / "config.json").write_text(json.dumps(src))
    (tmp_path / "model.safetensors").write_bytes((llama_dir / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="rope_type.*llama3"):
        load_model(ModelConfig(path=str(tmp_path)))


def test_bad_model_type(llama_dir, tmp_path):
    src = json.loads((llama_dir / "config.json").read_text())
    src["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(src))
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        load_model(ModelConfig(path=str(tmp_path)))

