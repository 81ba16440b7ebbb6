"""Workloads: readers on small files, strict errors, determinism, arrival
statistics, clipping, shared-prefix tokens and the lazy token sequence."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from testbed.request import Request
from testbed.workloads import SyntheticTokens, WorkloadConfig, build_workload, load_workload_preset
from testbed.workloads.arrivals import BurstArrivals, ConstantArrivals, GammaArrivals
from testbed.data import dataset_dir
from testbed.workloads.config import REPO_ROOT, make_workload_config, workload_preset_names
from testbed.workloads.lengths import LognormalLengths, UniformLengths, ZipfLengths
from testbed.workloads.readers import AzureReader

VOCAB = 4096


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def trace_cfg(path: Path, fmt: str, **kw) -> WorkloadConfig:
    base = dict(arrival="trace", prompt_dist="trace", output_dist="trace", trace_path=str(path), trace_format=fmt)
    base.update(kw)
    return WorkloadConfig(**base)


# --- readers -------------------------------------------------------------------

def test_azure_reader_lengths_and_relative_timestamps(tmp_path):
    path = write(tmp_path / "az.csv",
                 "TIMESTAMP,ContextTokens,GeneratedTokens\r\n"
                 "2024-03-01 09:00:00.1000000,4000,12\r\n"
                 "2024-03-01 09:00:00.1520000,3000,9\r\n"
                 "2024-03-01 09:00:01.12004,100,1\r\n")
    reqs = build_workload(trace_cfg(path, "azure"), VOCAB, seed=0)
    assert [r.request_id for r in reqs] == ["r0", "r1", "r2"]
    assert [r.prompt_len for r in reqs] == [4000, 3000, 100]
    assert [r.max_tokens for r in reqs] == [12, 9, 1]
    assert [r.arrival_s for r in reqs] == pytest.approx([0.0, 0.052, 1.02004], abs=1e-6)


def test_azure_public_trace_has_8819_rows():
    rows = AzureReader().read(dataset_dir("azure-code-2023", "test_workloads") / "AzureLLMInferenceTrace_code.csv")
    assert len(rows) == 8819
    assert (rows[0].prompt_len, rows[0].output_len) == (4808, 10)
    assert (rows[-1].prompt_len, rows[-1].output_len) == (549, 173)


def test_azure_code_preset_reads_the_trace_from_the_data_directory_and_clips(data_dir):
    cfg = load_workload_preset("azure_code")
    assert cfg.resolved_trace_path() == data_dir / "azure-code-2023" / "AzureLLMInferenceTrace_code.csv"
    reqs = build_workload(cfg, VOCAB, seed=0)
    assert len(reqs) == cfg.max_requests
    assert reqs[0].prompt_len == min(4808, cfg.max_prompt_len) and reqs[0].max_tokens == 10
    assert max(r.prompt_len for r in reqs) == cfg.max_prompt_len
    # the first 200 rows span 18:17:03.97996 .. 18:20:23.069545 = 199.089585 s, scaled
    assert reqs[-1].arrival_s == pytest.approx(199.089585 * cfg.time_scale, abs=1e-5)


def test_mooncake_shared_hash_ids_share_tokens(tmp_path):
    lines = [
        {"timestamp": 1000, "input_length": 1100, "output_length": 5, "hash_ids": [7, 8, 9]},
        {"timestamp": 1500, "input_length": 700, "output_length": 3, "hash_ids": [7, 10]},
        {"timestamp": 2500, "input_length": 512, "output_length": 2, "hash_ids": [11]},
    ]
    path = write(tmp_path / "mc.jsonl", "\n".join(json.dumps(x) for x in lines) + "\n")
    reqs = build_workload(trace_cfg(path, "mooncake"), VOCAB, seed=3)
    assert [r.arrival_s for r in reqs] == pytest.approx([0.0, 0.5, 1.5])
    assert [r.prompt_len for r in reqs] == [1100, 700, 512]
    a, b, c = (r.prompt_token_ids for r in reqs)
    assert a[:512] == b[:512]                   # block 7 shared
    assert a[512:700] != b[512:700]             # blocks 8 and 10 differ
    assert a[:512] != c[:512]
    # a request of its own (synthetic prompt) shares nothing with block 7
    own = build_workload(WorkloadConfig(num_requests=1, prompt_dist="fixed", prompt_len=512), VOCAB, 3)[0]
    assert own.prompt_token_ids[:] != a[:512]


def test_a_prompt_is_private_from_its_first_block_no_other_names(tmp_path):
    """Request.private_from: a synthetic prompt of its own is private from its
    first token; a trace's prompt from its first block whose id no other block
    of the workload names; a prompt whose every id recurs, not at all."""
    lines = [
        {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [7, 8, 9]},
        {"timestamp": 500, "input_length": 700, "output_length": 3, "hash_ids": [7, 10]},
        {"timestamp": 900, "input_length": 600, "output_length": 3, "hash_ids": [7, 10]},
        {"timestamp": 1500, "input_length": 512, "output_length": 2, "hash_ids": [11]},
    ]
    path = write(tmp_path / "mc.jsonl", "\n".join(json.dumps(x) for x in lines) + "\n")
    reqs = build_workload(trace_cfg(path, "mooncake"), VOCAB, seed=3)
    assert [r.private_from for r in reqs] == [512, None, None, 0]
    own = build_workload(WorkloadConfig(num_requests=2, prompt_dist="fixed", prompt_len=512), VOCAB, 3)
    assert [r.private_from for r in own] == [0, 0]
    exact = build_workload(trace_cfg(write(tmp_path / "ids.jsonl", '{"prompt_token_ids": [5, 6, 7], "max_tokens": 4, '
                                           '"arrival_s": 0.0}\n'), "jsonl"), VOCAB, 3)
    assert exact[0].private_from is None                 # exact token ids: not known


def test_mooncake_block_count_must_match_length(tmp_path):
    path = write(tmp_path / "mc.jsonl",
                 '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}\n'
                 '{"timestamp": 5, "input_length": 600, "output_length": 1, "hash_ids": [1]}\n')
    with pytest.raises(ValueError, match=rf"{path}:2: input_length=600 spans 2 blocks"):
        build_workload(trace_cfg(path, "mooncake"), VOCAB, 0)


def test_sarathi_csv_lengths_with_synthetic_arrivals(tmp_path):
    path = write(tmp_path / "arxiv.csv", "num_prefill_tokens,num_decode_tokens\n3000,200\n1500.0,90\n")
    cfg = trace_cfg(path, "sarathi_csv", arrival="constant", rate=4.0)
    reqs = build_workload(cfg, VOCAB, 0)
    assert [(r.prompt_len, r.max_tokens, r.arrival_s) for r in reqs] == [(3000, 200, 0.0), (1500, 90, 0.25)]
    with pytest.raises(ValueError, match="workload.arrival: trace_format=sarathi_csv has no timestamps"):
        trace_cfg(path, "sarathi_csv")


def test_jsonl_exact_tokens_and_shapes(tmp_path):
    path = write(tmp_path / "req.jsonl",
                 '{"prompt_token_ids": [5, 6, 7], "max_tokens": 4, "arrival_s": 2.0}\n'
                 '\n'
                 '{"prompt_len": 9, "max_tokens": 1, "arrival_s": 0.5}\n')
    reqs = build_workload(trace_cfg(path, "jsonl"), VOCAB, 0)
    assert [r.arrival_s for r in reqs] == [0.0, 1.5]
    assert reqs[0].prompt_len == 9 and isinstance(reqs[0].prompt_token_ids, SyntheticTokens)
    assert reqs[1].prompt_token_ids == [5, 6, 7] and reqs[1].max_tokens == 4


@pytest.mark.parametrize("line, message", [
    ('{"prompt_token_ids": [1, 4096], "max_tokens": 2}', r"prompt_token_ids\[1\]=4096 is not a token id in \[0, 4096\)"),
    ('{"prompt_token_ids": [1, -1], "max_tokens": 2}', r"prompt_token_ids\[1\]=-1"),
    ('{"prompt_len": 3}', "missing 'max_tokens'"),
    ('{"prompt_len": 3, "max_token": 2}', r"unknown key\(s\) \['max_token'\]"),
    ('{"prompt_len": 0, "max_tokens": 2}', "prompt_len=0 must be >= 1"),
    ('{"prompt_len": 3, "max_tokens": 2', "not valid JSON"),
    ('[1, 2]', "expected a JSON object"),
])
def test_jsonl_malformed_line_names_file_and_line(tmp_path, line, message):
    path = write(tmp_path / "bad.jsonl", '{"prompt_len": 3, "max_tokens": 2}\n' + line + "\n")
    with pytest.raises(ValueError, match=rf"{path}:2: .*{message}"):
        build_workload(trace_cfg(path, "jsonl", arrival="burst"), VOCAB, 0)


@pytest.mark.parametrize("row, message", [
    ("2024-03-01 09:00:00.2,abc,8", "ContextTokens='abc' is not an integer"),
    ("2024-03-01 09:00:00.2,3000", "expected 3 fields"),
    ("2024-03-01 09:00:00.2,3000,8,9", "expected 3 fields"),
    ("yesterday,3000,8", "TIMESTAMP='yesterday' is not"),
    ("2024-03-01 09:00:00.2,3000,0", "GeneratedTokens='0' must be >= 1"),
])
def test_azure_malformed_line_names_file_and_line(tmp_path, row, message):
    path = write(tmp_path / "bad.csv", f"TIMESTAMP,ContextTokens,GeneratedTokens\n2024-03-01 09:00:00.1,4000,12\n{row}\n")
    with pytest.raises(ValueError, match=rf"{path}:3: {message}"):
        build_workload(trace_cfg(path, "azure"), VOCAB, 0)


def test_csv_header_missing_column(tmp_path):
    path = write(tmp_path / "bad.csv", "TIMESTAMP,Context,GeneratedTokens\n2024-03-01 09:00:00,1,1\n")
    with pytest.raises(ValueError, match=rf"{path}:1: header .* lacks column\(s\) \['ContextTokens'\]"):
        build_workload(trace_cfg(path, "azure"), VOCAB, 0)


def test_trace_arrival_needs_every_timestamp(tmp_path):
    path = write(tmp_path / "req.jsonl", '{"prompt_len": 3, "max_tokens": 2, "arrival_s": 0}\n'
                                         '{"prompt_len": 3, "max_tokens": 2}\n')
    with pytest.raises(ValueError, match=rf"workload.arrival: trace {path}:2 has no arrival time"):
        build_workload(trace_cfg(path, "jsonl"), VOCAB, 0)


# --- synthetic workloads -----------------------------------------------------

def test_same_seed_same_workload_other_seed_differs():
    cfg = load_workload_preset("mixed")

    def shape(reqs):
        return [(r.request_id, r.arrival_s, r.prompt_len, r.max_tokens, r.prompt_token_ids[:]) for r in reqs]
    assert shape(build_workload(cfg, VOCAB, 7)) == shape(build_workload(cfg, VOCAB, 7))
    assert shape(build_workload(cfg, VOCAB, 7)) != shape(build_workload(cfg, VOCAB, 8))


def test_sorted_by_arrival_with_ids_in_order_and_lengths_in_range():
    cfg = load_workload_preset("mixed")
    reqs = build_workload(cfg, VOCAB, 0)
    assert len(reqs) == cfg.num_requests
    assert [r.request_id for r in reqs] == [f"r{i}" for i in range(len(reqs))]
    times = [r.arrival_s for r in reqs]
    assert times[0] == 0.0 and times == sorted(times)
    assert all(32 <= r.prompt_len <= 1024 and 16 <= r.max_tokens <= 128 for r in reqs)


def test_arrival_process_does_not_change_lengths():
    a = build_workload(WorkloadConfig(num_requests=50, arrival="poisson"), VOCAB, 1)
    b = build_workload(WorkloadConfig(num_requests=50, arrival="burst"), VOCAB, 1)
    assert [r.prompt_len for r in a] == [r.prompt_len for r in b]


def test_stall_preset_shape():
    cfg = load_workload_preset("stall")
    reqs = build_workload(cfg, VOCAB, 0)
    assert len(reqs) == 10
    assert [r.arrival_s for r in reqs[:8]] == [0.0] * 8
    assert all(r.prompt_len == cfg.prompt_len and r.max_tokens == cfg.output_len for r in reqs[:8])
    assert [(r.arrival_s, r.prompt_len) for r in reqs[8:]] == list(zip(cfg.inject_arrival_s, cfg.inject_prompt_len))


def test_every_preset_builds():
    names = workload_preset_names()
    assert {"chat", "stall", "azure_code", "mixed"} <= set(names)
    for name in names:
        assert build_workload(load_workload_preset(name), VOCAB, 0)


def test_time_scale_multiplies_arrivals():
    base = build_workload(WorkloadConfig(num_requests=20, rate=2.0), VOCAB, 4)
    fast = build_workload(WorkloadConfig(num_requests=20, rate=2.0, time_scale=0.1), VOCAB, 4)
    assert [f.arrival_s for f in fast] == pytest.approx([0.1 * b.arrival_s for b in base])


def test_poisson_mean_gap_is_one_over_rate():
    gaps = np.diff(GammaArrivals(rate=5.0).times(np.random.default_rng(0), 40_001))
    assert gaps.mean() == pytest.approx(0.2, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)     # exponential: CV 1


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_burstiness_sets_cv_not_mean(burstiness):
    gaps = np.diff(GammaArrivals(rate=5.0, burstiness=burstiness).times(np.random.default_rng(1), 40_001))
    assert gaps.mean() == pytest.approx(0.2, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / np.sqrt(burstiness), rel=0.07)


def test_constant_and_burst_arrivals():
    rng = np.random.default_rng(0)
    assert ConstantArrivals(rate=4.0).times(rng, 4).tolist() == [0.0, 0.25, 0.5, 0.75]
    assert BurstArrivals().times(rng, 3).tolist() == [0.0, 0.0, 0.0]


def test_length_distributions_bounds_and_shape():
    rng = np.random.default_rng(0)
    u = UniformLengths(3, 5).sample(rng, 3000)
    assert set(u.tolist()) == {3, 4, 5}
    z = ZipfLengths(10, 1000, a=1.5).sample(rng, 20_000)
    assert z.min() == 10 and z.max() <= 1000
    # rank 1 has probability 1 / sum_{r<=991} r^-1.5 ~= 0.384
    assert (z == 10).mean() == pytest.approx(1 / np.sum(np.arange(1, 992) ** -1.5), abs=0.015)
    ln = LognormalLengths(median=200, sigma=0.5, low=1, high=100_000).sample(rng, 20_000)
    assert np.median(ln) == pytest.approx(200, rel=0.03)
    assert LognormalLengths(200, 2.0, 50, 300).sample(rng, 1000).min() >= 50


def test_max_requests_and_max_prompt_len_clip(tmp_path):
    reqs = build_workload(WorkloadConfig(num_requests=30, max_requests=12, prompt_dist="fixed",
                                         prompt_len=900, max_prompt_len=100), VOCAB, 0)
    assert len(reqs) == 12 and {r.prompt_len for r in reqs} == {100}
    path = write(tmp_path / "req.jsonl", "".join(
        json.dumps({"prompt_token_ids": [i, i + 1, i + 2], "max_tokens": 50, "arrival_s": i}) + "\n" for i in range(5)))
    reqs = build_workload(trace_cfg(path, "jsonl", max_requests=3, max_prompt_len=2, max_output_len=7), VOCAB, 0)
    assert [r.prompt_token_ids for r in reqs] == [[0, 1], [1, 2], [2, 3]]
    assert [r.max_tokens for r in reqs] == [7, 7, 7]


def test_exact_tokens_need_prompt_dist_trace(tmp_path):
    path = write(tmp_path / "req.jsonl", '{"prompt_token_ids": [1, 2], "max_tokens": 2, "arrival_s": 0}\n')
    with pytest.raises(ValueError, match="workload.prompt_dist: .* gives exact prompt_token_ids"):
        build_workload(trace_cfg(path, "jsonl", prompt_dist="fixed"), VOCAB, 0)


# --- config validation -------------------------------------------------------

@pytest.mark.parametrize("kw, message", [
    ({"rate": 0}, "workload.rate: must be > 0, got 0"),
    ({"burstiness": -1.0}, "workload.burstiness: must be > 0, got -1.0"),
    ({"arrival": "weibull"}, "workload.arrival: 'weibull' is not one of poisson, gamma"),
    ({"prompt_min": 50, "prompt_max": 10}, "workload.prompt_max: 10 is below prompt_min=50"),
    ({"max_prompt_len": 0}, "workload.max_prompt_len: must be >= 1 or null"),
    ({"inject_arrival_s": [1.0], "inject_prompt_len": [5]}, "workload.inject_output_len: has 0 entries"),
    ({"arrival": "trace"}, "workload.trace_path: not set"),
    ({"prompt_dist": "trace", "trace_path": "no/such/trace.csv"}, "workload.trace_path: .*no/such/trace.csv does not exist"),
    ({"num_requests": 0}, "workload.num_requests: the workload has no requests"),
])
def test_config_errors_name_the_field(kw, message):
    with pytest.raises(ValueError, match=message):
        WorkloadConfig(**kw)


def test_unknown_field_and_unknown_preset():
    with pytest.raises(ValueError, match=r"workload: unknown field\(s\) \['rat'\]"):
        make_workload_config({"rat": 2.0})
    with pytest.raises(ValueError, match="workload='nope' is not a known preset; choose one of: .*mixed"):
        load_workload_preset("nope")


# --- lazy tokens ----------------------------------------------------------------

def test_synthetic_tokens_equal_their_materialized_list():
    toks = SyntheticTokens(key=123, length=1300, vocab_size=VOCAB, block_size=512)
    full = list(toks)
    assert len(full) == 1300 and toks == full and full == toks[:]
    assert all(0 <= t < VOCAB for t in full) and len(set(full)) > 1000
    assert toks[0] == full[0] and toks[-1] == full[-1] and toks[1299] == full[1299]
    assert toks[500:530] == full[500:530] and toks[1290:5000] == full[1290:]
    assert toks[10:100:7] == full[10:100:7] and toks[100:10:-9] == full[100:10:-9]
    assert toks.numpy().tolist() == full and np.asarray(toks).tolist() == full
    assert toks != full[:-1] and toks != full[:-1] + [(full[-1] + 1) % VOCAB]
    assert SyntheticTokens.from_spec(toks.to_spec()) == toks
    with pytest.raises(IndexError):
        toks[1300]


def test_synthetic_tokens_match_the_per_token_definition():
    """numpy() lays the hash out over whole blocks and cuts it: every token,
    across block boundaries and with shared block ids, is still
    mix(mix(block * golden ^ key) + offset * mix1) % vocab."""
    from testbed.workloads.tokens import _GOLDEN, _MASK64, _MIX1, _mix_int

    def token(key, i, block_size, block_ids=None):
        block = i // block_size if block_ids is None else block_ids[i // block_size] & _MASK64
        return _mix_int(_mix_int(block * _GOLDEN ^ key) + (i % block_size) * _MIX1) % VOCAB

    for block_ids in (None, [7, -3, 2**70 + 5, 7]):
        toks = SyntheticTokens(2**63 + 11, 50, VOCAB, block_ids, block_size=13)
        for start, stop in ((0, 50), (12, 14), (13, 26), (25, 27), (49, 50), (5, 6)):
            assert toks.numpy(start, stop).tolist() == [token(toks._key, i, 13, block_ids)
                                                        for i in range(start, stop)]


def test_synthetic_tokens_blocks_reorder_like_the_trace_says():
    ab = SyntheticTokens(9, 1024, VOCAB, block_ids=[1, 2], block_size=512)
    ba = SyntheticTokens(9, 1024, VOCAB, block_ids=[2, 1], block_size=512)
    assert ab[:512] == ba[512:] and ab[512:] == ba[:512]
    with pytest.raises(ValueError, match="1024 tokens need 2 blocks of 512, got 1 block ids"):
        SyntheticTokens(9, 1024, VOCAB, block_ids=[1])


def test_request_works_with_a_lazy_prompt():
    toks = SyntheticTokens(5, 40, VOCAB)
    req = Request("r0", toks, max_tokens=3)
    req.output_token_ids += [7, 8]
    assert req.prompt_len == 40 and req.num_tokens == 42
    assert req.token_ids(0, 10) == list(toks)[:10]
    assert req.token_ids(38, 42) == list(toks)[38:] + [7, 8]
    assert req.all_token_ids() == list(toks) + [7, 8]


def test_large_workload_stays_lazy():
    cfg = WorkloadConfig(num_requests=20_000, rate=100.0, prompt_dist="fixed", prompt_len=1_000_000)
    reqs = build_workload(cfg, 128_000, 0)
    assert len(reqs) == 20_000 and all(isinstance(r.prompt_token_ids, SyntheticTokens) for r in reqs[:10])
    assert reqs[-1].prompt_token_ids[999_990:] == reqs[-1].prompt_token_ids.numpy(999_990).tolist()
