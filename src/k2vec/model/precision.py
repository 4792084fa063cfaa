"""Reduced-precision number formats, emulated exactly in float64, and the rounding schedules of engines.

numpy has no bfloat16 or fp8, so a value is rounded to a format by bit-exact arithmetic on float64:
the quantum of its binade is a power of two, so x / quantum is exact, and numpy's round is
round-half-to-even, the IEEE default every GPU cast uses. Subnormals keep the quantum of the smallest
binade; overflow goes to inf (bfloat16, float16) or saturates at the largest finite value (fp8 e4m3,
which has no inf: the saturating cast of `__nv_cvt_float_to_fp8(..., __NV_SATFINITE, ...)`).

A `Schedule` says where an engine of a precision rounds: its weights, every linear's output, the
residual stream, norms and elementwise ops, attention probabilities, the expert combine, the router
logits, the logits. Correct engines differ in exactly these choices (transformers in bfloat16 rounds
after nearly every op; a fused GPU engine rounds at kernel boundaries and keeps fp32 inside), so the
noise model (k2vec.stages.noise) runs the reference under several schedules and takes their spread as
what a correct engine of that precision may show. `SCHEDULES` names them; docs/report.md lists them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from k2vec.errors import K2VecError


class PrecisionError(K2VecError):
    """An unknown number format or rounding schedule."""


@dataclass(frozen=True)
class Format:
    name: str
    mantissa_bits: int   # explicit fraction bits
    min_exponent: int    # exponent of the smallest normal binade (2**min_exponent)
    max_finite: float
    saturates: bool      # overflow clamps to max_finite instead of going to inf

    def round(self, x: np.ndarray) -> np.ndarray:
        """x (any float array) rounded to the nearest value of this format, ties to even, as float64."""
        x = np.asarray(x, np.float64)
        _, e = np.frexp(x)                                  # x = f * 2**e, 0.5 <= |f| < 1
        e = np.maximum(e - 1, self.min_exponent)            # binade exponent, subnormals share the lowest
        quantum = np.ldexp(1.0, e - self.mantissa_bits)
        with np.errstate(invalid="ignore", over="ignore"):
            y = np.round(x / quantum) * quantum
        over = np.abs(y) > self.max_finite
        if over.any():
            y = np.where(over, np.sign(y) * (self.max_finite if self.saturates else np.inf), y)
        return np.where(np.isfinite(x), y, x)


FORMATS: dict[str, Format] = {
    "bfloat16": Format("bfloat16", 7, -126, float(np.ldexp(2.0 - 2.0 ** -7, 127)), False),
    "float16": Format("float16", 10, -14, 65504.0, False),
    "fp8": Format("fp8", 3, -6, 448.0, True),      # e4m3fn, the fp8 of K2-class checkpoints' activations
}


def _identity(x: np.ndarray) -> np.ndarray:
    return x


@dataclass(frozen=True)
class Schedule:
    """Where an engine rounds to its format (`fmt`); everything between two rounding points is exact
    (it stands for float32 accumulation, whose error is 1e-7, four orders below bfloat16's)."""
    name: str
    weights: bool = True       # every tensor of the checkpoint held in the format (INT4 weights dequantized to it)
    linear: bool = True        # each projection's output (the attention output before o_proj included)
    residual: bool = True      # the residual stream stored in the format between blocks
    norm: bool = False         # RMSNorm outputs
    elementwise: bool = False  # RoPE's cos/sin tables and outputs, silu(gate) * up
    scores: bool = False       # attention scores q.k before the softmax (eager attention's bf16 matmul)
    softmax: bool = False      # attention probabilities before P @ V
    combine: bool = False      # each weighted expert output and the running MoE sum
    router: bool = False       # router logits (else computed from the format's inputs in float32)
    logits: bool = False       # the LM head's output

    def rounder(self, fmt: Format) -> "Rounder":
        return Rounder(self, fmt)


# The schedules of correct engines. Each stands for a family of real implementations; their spread is
# the noise model's envelope. KV-cache entries are always held in the format (every engine stores them so).
SCHEDULES: dict[str, Schedule] = {s.name: s for s in (
    # everything between GEMMs fused in fp32: only weights, projection outputs and the residual rounded
    Schedule("fused"),
    # one kernel per op: norm outputs and silu(gate) * up written in the format; softmax, combine, router fp32
    Schedule("kernel-boundaries", norm=True, elementwise=True),
    # transformers eager: every op's output rounded, logits too; softmax and RMSNorm statistics in fp32
    Schedule("every-op", norm=True, elementwise=True, scores=True, softmax=True, combine=True, logits=True),
    # an fp32 residual stream (fused add + RMSNorm kernels that keep it in fp32)
    Schedule("fp32-residual", residual=False, norm=True, elementwise=True),
    # the gate GEMM in the format (vLLM's DeepSeek-V3 gate runs in the model dtype)
    Schedule("format-router", norm=True, elementwise=True, router=True),
)}


# The numpy engine's own schedule in its emulated-precision mode: not one of SCHEDULES, so its verdict
# against the noise model tests the envelope on an engine it was not built from.
ENGINE_SCHEDULE = Schedule("numpy-engine", norm=True, softmax=True, combine=True)


class Rounder:
    """The rounding functions of one (schedule, format); the identity where the schedule keeps full
    precision, and everywhere for `EXACT` (no format: the golden's float64)."""

    def __init__(self, schedule: Schedule, fmt: Format | None):
        self.schedule, self.fmt = schedule, fmt
        r: Callable[[np.ndarray], np.ndarray] = _identity if fmt is None else fmt.round
        s = schedule
        self.weights = r if s.weights else _identity
        self.linear = r if s.linear else _identity
        self.residual = r if s.residual else _identity
        self.norm = r if s.norm else _identity
        self.elementwise = r if s.elementwise else _identity
        self.scores = r if s.scores else _identity
        self.softmax = r if s.softmax else _identity
        self.combine = r if s.combine else _identity
        self.router = r if s.router else _identity
        self.logits = r if s.logits else _identity
        self.cache = r

    @property
    def exact(self) -> bool:
        return self.fmt is None


EXACT = Rounder(Schedule("exact"), None)


def get_format(name: str) -> Format:
    try:
        return FORMATS[name]
    except KeyError:
        raise PrecisionError(f"unknown number format {name!r}; known: {', '.join(FORMATS)}") from None


def get_schedule(name: str) -> Schedule:
    try:
        return SCHEDULES[name]
    except KeyError:
        raise PrecisionError(f"unknown rounding schedule {name!r}; known: {', '.join(SCHEDULES)}") from None


def rounder(precision: str, schedule: str) -> Rounder:
    """The rounder of an engine of `precision` (a FORMATS name) rounding by `schedule` (a SCHEDULES name)."""
    return get_schedule(schedule).rounder(get_format(precision))
