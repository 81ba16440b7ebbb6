"""The crossover arithmetic: re-read and transfer bytes, the closed
form L* = C·(1 + 2·hbm/link) against a scan, and the time-based crossover from
the cost and link models."""
import pytest

from testbed.model.config import load_model_preset
from testbed.sim.config import load_hardware_preset, load_link_preset
from testbed.sim.cost_model import CostModel
from testbed.sim.crossover import (chunk_slices, chunked_prefill_s, closed_form_crossover, crossover_by_bytes,
                                   crossover_by_time, crossover_point, first_crossing, piggyback_tax_s,
                                   reread_bytes, transfer_bytes)
from testbed.sim.link_model import LinkModel

KV = 131072          # llama3-8b: 2 · 8 KV heads · 128 · 2 bytes · 32 layers


def test_reread_bytes_exact_values():
    assert KV == load_model_preset("llama3-8b").kv_bytes_per_token
    # 4096 = 8 chunks of 512: chunks re-read 0, 512, ..., 3584 tokens = 512 · 28
    assert reread_bytes(KV, 4096, 512) == KV * 512 * 28
    assert reread_bytes(KV, 512, 512) == 0                   # one chunk re-reads nothing
    assert reread_bytes(KV, 1000, 512) == KV * 512           # short last chunk re-reads its prefix
    assert transfer_bytes(KV, 4096) == KV * 4096
    with pytest.raises(ValueError, match="chunk_size"):
        reread_bytes(KV, 100, 0)


@pytest.mark.parametrize("chunk", [1, 7, 256, 512])
def test_reread_bytes_is_the_sum_over_chunks_of_each_prefix(chunk):
    for length in range(1, 3000, 37):
        prefixes = sum(range(0, length, chunk))              # chunk starts: the prefix each re-reads
        assert reread_bytes(3, length, chunk) == 3 * prefixes


def test_reread_bytes_match_the_cost_models_kv_accounting():
    cost = CostModel(load_model_preset("llama3-8b"), load_hardware_preset("h100-sxm"))
    for length, chunk in [(4096, 512), (5000, 1024), (300, 512)]:
        chunks = [(min(chunk, length - s), min(s + chunk, length)) for s in range(0, length, chunk)]
        read_chunked = sum(cost.kv_bytes_read([c]) for c in chunks)
        assert read_chunked - cost.kv_bytes_read([(length, length)]) == reread_bytes(KV, length, chunk)


@pytest.mark.parametrize("chunk", [256, 512, 2048])
@pytest.mark.parametrize("link", ["nvlink", "rdma-400", "rdma-200"])
def test_scanned_crossover_matches_the_closed_form(chunk, link):
    hbm = load_hardware_preset("h100-sxm").hbm_bw_gbps * 1e9
    link_bw = load_link_preset(link).bytes_per_s
    closed = closed_form_crossover(chunk, hbm, link_bw)
    scanned = crossover_by_bytes(KV, chunk, hbm, link_bw, max_context_len=1 << 21)
    assert scanned == pytest.approx(closed, rel=0.05)
    assert abs(scanned - closed) < chunk                     # the scan is good to within one chunk


def test_closed_form_values():
    # H100 HBM 3.35 TB/s against 400 Gbit/s: ratio 67, L* = 135 chunks
    assert closed_form_crossover(512, 3.35e12, 50e9) == pytest.approx(512 * 135)
    assert closed_form_crossover(2048, 3.35e12, 50e9) == pytest.approx(2048 * 135)
    # out of range: 25 Gbit/s TCP crosses only at 1.1M tokens for C=512
    assert crossover_by_bytes(KV, 512, 3.35e12, 25e9 / 8) is None


def test_first_crossing_interpolates_and_reports_none():
    assert first_crossing([1, 2, 3, 4], [0, 1, 2, 3], [1.5, 1.5, 1.5, 1.5]) == pytest.approx(2.5)
    assert first_crossing([1, 2], [5, 6], [1, 1]) == 1.0
    assert first_crossing([1, 2], [0, 0], [1, 1]) is None


def test_time_based_point_on_h100_over_400g():
    cost = CostModel(load_model_preset("llama3-8b"), load_hardware_preset("h100-sxm"))
    link = LinkModel(load_link_preset("rdma-400"))
    p = crossover_point(cost, link, 512, 8192)
    assert p.reread_bytes == reread_bytes(KV, 8192, 512) and p.transfer_bytes == KV * 8192
    assert p.chunked_prefill_ms == pytest.approx(chunked_prefill_s(cost, 8192, 512) * 1e3)
    assert p.whole_prefill_ms == pytest.approx(cost.iteration_time_s([(8192, 8192)], num_sampled=1) * 1e3)
    assert p.reread_ms == pytest.approx(p.chunked_prefill_ms - p.whole_prefill_ms)
    assert p.reread_ms > 0
    # 1 GiB at 50 GB/s, one message per layer
    assert p.transfer_ms == pytest.approx(link.transfer_time_s(KV * 8192, 32) * 1e3)
    assert p.transfer_ms == pytest.approx(KV * 8192 / 50e9 * 1e3, rel=0.01)
    # 400G keeps up with an 8K prefill's layers: only about one layer's send is exposed
    assert p.exposed_transfer_ms == pytest.approx(p.transfer_ms / 32, rel=0.05)


def test_crossover_by_time_orders_links_and_chunk_sizes():
    cost = CostModel(load_model_preset("llama3-8b"), load_hardware_preset("h100-sxm"))
    lengths = [1024 << i for i in range(9)]                  # 1K .. 256K
    inf = float("inf")

    def l_star(link: str, chunk: int, against: str = "transfer_ms") -> float:
        points = [crossover_point(cost, LinkModel(load_link_preset(link)), chunk, n) for n in lengths]
        found = crossover_by_time(points, against)
        assert found is None or lengths[0] <= found <= lengths[-1]
        return inf if found is None else found

    for chunk in (256, 512):
        by_link = [l_star(link, chunk) for link in ("rdma-400", "rdma-100", "tcp-25")]
        assert by_link == sorted(by_link)                    # a slower link crosses later, or never
        assert by_link[0] < inf                              # 400G: chunking costs more than shipping
        for link in ("rdma-400", "rdma-100", "tcp-25"):      # streaming hides transfer: crosses no later
            assert l_star(link, chunk, "exposed_transfer_ms") <= l_star(link, chunk)
    assert l_star("rdma-100", 256) <= l_star("rdma-100", 512)   # bigger chunks re-read less
    with pytest.raises(ValueError, match="against"):
        crossover_by_time([], "reread_ms")


# -- the piggyback tax ----------------------------------------------------------------------------------
def test_piggyback_tax_without_decodes_is_the_isolated_tax():
    cost = CostModel(load_model_preset("llama3-8b"), load_hardware_preset("h100-sxm"))
    for n, c in ((8192, 512), (5000, 2048), (1024, 2048)):
        isolated = chunked_prefill_s(cost, n, c) - cost.iteration_time_s([(n, n)], num_sampled=1)
        assert piggyback_tax_s(cost, n, c, 0, 1024) == pytest.approx(isolated)


def test_piggyback_tax_is_each_chunks_added_time_to_the_decode_batch():
    cost = CostModel(load_model_preset("llama3-8b"), load_hardware_preset("h100-sxm"))
    decodes = [(1, 2048)] * 8
    assert chunk_slices(1300, 512) == [(512, 512), (512, 1024), (276, 1300)]
    base = cost.iteration_time_s(decodes, num_sampled=8)
    by_hand = (cost.iteration_time_s(decodes + [(512, 512)], num_sampled=8) - base
               + cost.iteration_time_s(decodes + [(512, 1024)], num_sampled=8) - base
               + cost.iteration_time_s(decodes + [(276, 1300)], num_sampled=9) - base
               - cost.iteration_time_s([(1300, 1300)], num_sampled=1))
    assert piggyback_tax_s(cost, 1300, 512, 8, 2048) == pytest.approx(by_hand)
    with pytest.raises(ValueError, match="num_decodes"):
        piggyback_tax_s(cost, 1300, 512, -1, 2048)


def test_riding_on_decodes_makes_small_chunks_cheaper_and_the_crossover_later():
    """The essay's argument: the decodes stream the weights anyway, so the
    weights each small chunk re-streams alone stop counting against it; the
    tax then crosses the transfer tax later (or not at all in range)."""
    cost = CostModel(load_model_preset("llama3-8b"), load_hardware_preset("h100-sxm"))
    link = LinkModel(load_link_preset("rdma-400"))
    lengths = [1024 << i for i in range(8)]                      # 1K .. 128K
    points = [crossover_point(cost, link, 256, n) for n in lengths]
    isolated = [p.reread_ms for p in points]
    loaded = [piggyback_tax_s(cost, n, 256, 32, 1024) * 1e3 for n in lengths]
    assert all(b < a for a, b in zip(isolated, loaded))
    inf = float("inf")
    at_rest = crossover_by_time(points, "transfer_ms")
    riding = crossover_by_time(points, "transfer_ms", loaded)
    assert at_rest is not None and (riding or inf) > at_rest
    assert crossover_by_time(points, "transfer_ms", isolated) == at_rest
    with pytest.raises(ValueError, match="taxes"):
        crossover_by_time(points, "transfer_ms", loaded[:-1])
