"""The GEMM table `testbed profile` measures inside real engine steps."""
import torch

from testbed.model.config import load_model_preset
from testbed.model.loader import load_model
from testbed.profiling.engine_gemms import MAX_DECODE_BATCH, _LinearTimer, measure_engine_gemms, spread_rounds
from testbed.sim.layer_shapes import layer_shapes


def test_rows_cover_every_gemm_shape_at_every_token_count():
    model = load_model_preset("tiny")
    counts = [1, 3, MAX_DECODE_BATCH, 128]
    rows = measure_engine_gemms(model, counts, min_time_s=0.0)
    shapes = layer_shapes(model)
    got = {(int(m), int(n), int(k)) for m, n, k, _ in rows}
    layer = {(g.n, g.k) for g in shapes.gemms}
    lm_head = (shapes.lm_head.n, shapes.lm_head.k)
    # every layer GEMM at every count: decode batches up to MAX_DECODE_BATCH, then a prefill of m tokens
    assert {(m, n, k) for m in counts for n, k in layer} <= got
    # lm_head runs on the sampled rows: one per decode, one for a whole prefill
    assert {(m, *lm_head) for m in counts if m <= MAX_DECODE_BATCH} <= got
    assert (128, *lm_head) not in got
    assert got - {(m, n, k) for m in counts for n, k in layer | {lm_head}} == set()
    assert all(s > 0 for *_, s in rows)
    assert rows == sorted(rows, key=lambda r: (r[1], r[2], r[0]))


def test_timer_hooks_every_linear_and_leaves_none_behind():
    torch.manual_seed(0)
    model, _ = load_model(load_model_preset("tiny"))
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    timer = _LinearTimer(model)
    x = torch.randn(3, linears[0].in_features)
    with torch.inference_mode():
        expected = linears[0](x)
    [(key, (seconds, calls))] = timer.take().items()
    assert key == (3, linears[0].out_features, linears[0].in_features) and calls == 1 and seconds > 0
    assert timer.take() == {}
    timer.remove()
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in linears)
    with torch.inference_mode():
        assert torch.equal(linears[0](x), expected)


def test_a_shape_needing_few_rounds_gets_them_spread_over_the_whole_measurement():
    rounds = spread_rounds({1: 50, 2048: 3, 512: 5})
    assert len(rounds) == 50
    seen = {m: [r for r, shapes in enumerate(rounds) if m in shapes] for m in (1, 2048, 512)}
    assert seen[1] == list(range(50))
    assert seen[2048] == [0, 25, 49]                 # first, middle, last: not rounds 0-2
    assert seen[512] == [0, 13, 25, 37, 49]
    assert spread_rounds({1: 3, 2: 3}) == [[1, 2]] * 3
