"""LinkModel: transfer times, serialisation on a shared link, layer-wise
streaming and ring all-reduce, against hand-computed values."""
import pytest

from testbed.sim.config import LinkConfig, link_preset_names, load_link_preset
from testbed.sim.link_model import LinkModel


def link(bw_gbps=400.0, latency_us=3.0, per_message_us=2.0) -> LinkModel:
    return LinkModel(LinkConfig("test", bw_gbps, latency_us, per_message_us))


def test_transfer_time_is_latency_plus_messages_plus_bytes_over_bandwidth():
    lm = link()
    # 1 GB over 400 Gbit/s = 50 GB/s: 20 ms, plus 3 us latency, plus 2 us per message
    assert lm.transfer_time_s(1e9) == pytest.approx(0.02 + 3e-6 + 2e-6, rel=1e-12)
    assert lm.transfer_time_s(1e9, num_messages=80) == pytest.approx(0.02 + 3e-6 + 80 * 2e-6, rel=1e-12)
    assert lm.transfer_time_s(0) == pytest.approx(5e-6)


def test_presets_load_and_name_their_units():
    assert {"nvlink", "rdma-400", "rdma-200", "rdma-100", "tcp-25", "pcie4", "pcie5"} <= set(link_preset_names())
    nv = load_link_preset("nvlink")
    assert nv.bytes_per_s == pytest.approx(450e9)           # 900 GB/s both ways on H100
    assert load_link_preset("rdma-400").bytes_per_s == pytest.approx(50e9)
    with pytest.raises(ValueError, match="known preset.*rdma-400"):
        load_link_preset("infiniband")


def test_bad_link_config_names_the_field():
    with pytest.raises(ValueError, match="link.bandwidth_gbps"):
        LinkConfig("x", 0.0)
    with pytest.raises(ValueError, match="link.latency_us"):
        LinkConfig("x", 10.0, latency_us=-1)
    with pytest.raises(ValueError, match="num_messages"):
        link().transfer_time_s(10, num_messages=0)


def test_reserve_serialises_transfers_on_one_link():
    lm = link(bw_gbps=8.0, latency_us=10.0, per_message_us=0.0)   # 1 GB/s: 1 MB takes 1 ms
    a = lm.reserve(0.0, 1e6)
    b = lm.reserve(0.0, 1e6)        # ready at once, waits for a to finish sending
    c = lm.reserve(0.005, 1e6)      # link idle again by then
    assert a == pytest.approx((0.0, 0.001 + 10e-6))
    assert b == pytest.approx((0.001, 0.002 + 10e-6))
    assert c == pytest.approx((0.005, 0.006 + 10e-6))
    lm.reset()
    assert lm.reserve(0.0, 1e6)[0] == 0.0


@pytest.mark.parametrize("compute_s,nbytes", [(1e-3, 1e5), (1e-3, 1e6), (1e-3, 3e6), (2e-4, 1e6), (1e-3, 0.0)])
def test_layerwise_exposed_matches_a_layer_by_layer_schedule(compute_s, nbytes):
    layers = 32
    lm = link(bw_gbps=8.0, latency_us=5.0, per_message_us=1.0)
    for i in range(layers):                     # layer i's KV is ready when layer i is computed
        _, arrived = lm.reserve((i + 1) * compute_s, nbytes)
    expected = arrived - layers * compute_s
    assert lm.layerwise_exposed_s(compute_s, nbytes, layers) == pytest.approx(expected, rel=1e-9)


def test_layerwise_hides_all_but_one_layer_when_the_link_keeps_up():
    lm = link(bw_gbps=8.0, latency_us=0.0, per_message_us=0.0)
    whole = lm.transfer_time_s(32e5)
    exposed = lm.layerwise_exposed_s(1e-3, 1e5, 32)          # 0.1 ms per layer against 1 ms of compute
    assert exposed == pytest.approx(whole / 32)
    slow = lm.layerwise_exposed_s(1e-4, 1e6, 32)             # 1 ms per layer against 0.1 ms of compute
    assert slow == pytest.approx(whole * 10 - 31 * 1e-4)


def test_ring_allreduce():
    lm = link(bw_gbps=8.0, latency_us=2.0, per_message_us=5.0)
    assert lm.allreduce_time_s(1e6, 1) == 0.0
    # 2 ranks: one launch, 2 steps of latency + 0.5 MB at 1 GB/s
    assert lm.allreduce_time_s(1e6, 2) == pytest.approx(5e-6 + 2 * (2e-6 + 0.5e-3))
    # 8 ranks: 14 steps of 1/8 of the data: bandwidth term 2·(7/8)·nbytes / bw
    assert lm.allreduce_time_s(8e6, 8) == pytest.approx(5e-6 + 14 * (2e-6 + 1e-3))
