"""The floor under a decode step: what this machine needs at least for one step's weights.

- bandwidth floor: the time to read every weight once, the faster of numpy's vectorised
  max over zero-copy views of the weights (one core) and the model's weight GEMMs at batch 1
  (matrix-vector products through the BLAS): no decode step of any batch size can take
  less, since every row's token multiplies by every weight. (MLX's own CPU reductions are
  not vectorised well enough to measure this: mx.sum over the weights ran at ~1.6 GB/s
  where numpy's max reached ~12.7 GB/s on the same loaded machine.);
- FLOP floor: 2 FLOPs per parameter per token x batch, at the rate mx.matmul reaches for
  the model's own weight shapes at a large batch (compute-bound: the peak);
- GEMM time at the batch itself: the model's weight GEMMs alone at this batch size, which
  is what the forward's matrix work costs here (between the two floors).
The floor of a step is the larger of the first two. Fastest of the repeats, because a floor
is what the machine can do, and it is shared."""

from __future__ import annotations

import time
from dataclasses import dataclass


def _matrices(model) -> list:
    from mlx.utils import tree_flatten

    # embed_tokens appears once; tied, it is also the head's GEMM.
    return [w for _, w in tree_flatten(model.parameters()) if w.ndim == 2]


def _fastest(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats + 2):  # two warm-ups: allocation and first-call costs
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times[2:])


def weight_read_s(model, mx, repeats: int) -> tuple[float, int]:
    """(seconds to read every parameter once, bytes read): the faster of numpy's max over
    zero-copy views and the weight GEMMs at batch 1."""
    import numpy as np
    from mlx.utils import tree_flatten

    weights = [w for _, w in tree_flatten(model.parameters())]
    mx.eval(weights)
    # The buffer protocol: no copy (numpy has no bfloat16: read those as 16-bit integers).
    views = [np.asarray(w.view(mx.uint16) if w.dtype == mx.bfloat16 else w) for w in weights]
    nbytes = sum(w.nbytes for w in weights)
    numpy_read = _fastest(lambda: [np.max(v) for v in views], repeats)
    gemv, _ = gemm_rate(model, 1, mx, repeats)
    return min(numpy_read, gemv), nbytes


def gemm_rate(model, batch: int, mx, repeats: int) -> tuple[float, float]:
    """(seconds for one forward's weight GEMMs at this batch, FLOP/s) with mx.matmul."""
    weights = _matrices(model)
    inputs = {w.shape[1]: mx.random.normal((batch, w.shape[1])).astype(w.dtype) for w in weights}
    mx.eval(list(inputs.values()))
    flops = sum(2 * batch * w.shape[0] * w.shape[1] for w in weights)
    best = _fastest(lambda: mx.eval([mx.matmul(inputs[w.shape[1]], w.T) for w in weights]), repeats)
    return best, flops / best


@dataclass(frozen=True)
class Floors:
    """The machine's figures for one model, measured once per run."""

    parameters: int
    weight_bytes: int
    read_s: float  # every weight once
    peak_flops: float  # FLOP/s at peak_batch
    peak_batch: int

    @classmethod
    def measure(cls, model, mx, repeats: int, peak_batch: int) -> Floors:
        from mlx.utils import tree_flatten

        params = sum(w.size for _, w in tree_flatten(model.parameters()))
        read_s, nbytes = weight_read_s(model, mx, repeats)
        _, peak = gemm_rate(model, peak_batch, mx, repeats)
        return cls(params, nbytes, read_s, peak, peak_batch)

    def bandwidth_floor_s(self) -> float:
        return self.read_s

    def flop_floor_s(self, batch: int) -> float:
        return 2 * self.parameters * batch / self.peak_flops

    def floor_s(self, batch: int) -> float:
        return max(self.bandwidth_floor_s(), self.flop_floor_s(batch))

    def bound(self, batch: int) -> str:
        return "bandwidth" if self.bandwidth_floor_s() >= self.flop_floor_s(batch) else "FLOP"

    def row(self, model, batch: int, mx, repeats: int) -> dict:
        """The floor figures of one batch size, in ms (and the GEMMs' own rate there)."""
        gemm_s, rate = gemm_rate(model, batch, mx, repeats)
        return {
            "floor_ms": round(self.floor_s(batch) * 1000, 3),
            "bound": self.bound(batch),
            "bandwidth_floor_ms": round(self.bandwidth_floor_s() * 1000, 3),
            "flop_floor_ms": round(self.flop_floor_s(batch) * 1000, 3),
            "gemm_ms": round(gemm_s * 1000, 3),
            "gemm_gflops": round(rate / 1e9, 1),
        }

    def as_dict(self) -> dict:
        return {
            "parameters": self.parameters,
            "weight_bytes": self.weight_bytes,
            "weight_read_ms": round(self.read_s * 1000, 3),
            "read_gb_s": round(self.weight_bytes / self.read_s / 1e9, 2),
            "peak_gemm_gflops": round(self.peak_flops / 1e9, 1),
            "peak_batch": self.peak_batch,
        }
