"""Self-correction of a step-time predictor from measured steps.

The predictor (the cost model) may be wrong for this machine: a stale or
misprofiled table, or time the model leaves out (the scheduler's own work, the
engine's bookkeeping). Each finished step's measured (or simulated) duration
over the raw prediction updates an EWMA of that ratio, one per batch kind,
because the terms a profile gets wrong differ by kind: a decode-only step is
memory-bound, a prefill-only step compute-bound, a mixed one both. A
prediction is the raw one times its kind's ratio, so a profile off by a
constant factor converges within a few steps of each kind. A kind not seen
yet borrows the ratio pooled over every step, and starts its own from it."""
from __future__ import annotations

DECODE, PREFILL, MIXED = "decode", "prefill", "mixed"   # the batch kinds


def batch_kind(num_prefill_tokens: int, num_decode_tokens: int) -> str:
    if not num_prefill_tokens:
        return DECODE
    return MIXED if num_decode_tokens else PREFILL


class StepCorrection:
    def __init__(self, alpha: float):
        self.alpha = alpha
        self.pooled = 1.0                             # measured / raw predicted, smoothed over every step
        self.ratio: dict[str, float] = {}             # the same per batch kind seen

    def corrected(self, raw_s: float, kind: str) -> float:
        return raw_s * self.ratio.get(kind, self.pooled)

    def observe(self, kind: str, raw_s: float, measured_s: float) -> None:
        if raw_s > 0 and measured_s > 0:
            r = measured_s / raw_s
            own = self.ratio.get(kind, self.pooled)
            self.ratio[kind] = own + self.alpha * (r - own)
            self.pooled += self.alpha * (r - self.pooled)
