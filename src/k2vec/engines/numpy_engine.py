"""The numpy engine: reads nothing but a KDTR bundle and decodes through the engine contract.

It proves that a bundle alone is enough to reproduce the golden data: the model config comes from the
bundle's metadata, the weights from its tensors, and the INT4 weights are unpacked here from the
packed nibbles with this module's own decoder (docs/int4-format.md §2), not the quantizer's. The
transformer math is the reference model's (k2vec.reference), as the engine contract allows.

    python -m k2vec.engines.numpy_engine --bundle B.kdtr --mode greedy|ddtree|score --budget N --output R.json
        [--precision bfloat16|float16|fp8]
    python -m k2vec.engines.numpy_engine --bundle B.kdtr --batch LISTING.json   (every run of the bundle)

In a batch, the DDTree runs are verified together (`decode_ddtree`): every (budget, drafter accuracy,
prompt) advances in one lockstep pass, so a round reads the weights once for all of them, and those in the
same state (one prompt, the same tokens emitted so far) share one cache and verify the union of their trees
once (`ddtree_generate`); their results are written in the listing's order once that pass ends. A DDTree
result holds only tokens and tree indices, which the pass leaves as a single run computes them
(tests/test_pipeline.py checks, byte for byte).

--precision emulates an engine of that precision (k2vec.model.precision: its values rounded to the format
at the op boundaries of ENGINE_SCHEDULE, a schedule the noise model does not use); the default computes
in float64.

`run(..., install=hook)` calls `hook(model)` on the freshly built reference model before decoding: the
mutation run's engine (k2vec.mutation.engine) injects one catalogue fault that way; this module knows
nothing of the catalogue.

Small matrices: run it with OPENBLAS_NUM_THREADS=1 (config.yaml does), extra BLAS threads only contend.
"""

from __future__ import annotations

import platform
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping

import numpy as np

from k2vec.ddtree.drafter import RecordedDrafts
from k2vec.engines.cli import contract_parser, contract_runs, write_output
from k2vec.engines.contract.modes import CONTRACT_MODES
from k2vec.engines.contract.serialize import ddtree_round, greedy_prompt, score_prompt
from k2vec.errors import K2VecError
from k2vec.kdtr import bf16_to_f32, open_bundle
from k2vec.model.limits import WEIGHT_CACHE_BYTES
from k2vec.model.precision import ENGINE_SCHEDULE, EXACT, FORMATS, get_format
from k2vec.reference.generate import greedy_generate
from k2vec.reference.model import ReferenceModel
from k2vec.reference.speculative import DDTreeJob, ddtree_generate



def unpack_int4(packed: np.ndarray) -> np.ndarray:
    """u8 [N, K/2] -> int8 codes [N, K]: element 2j in the low nibble, 2j+1 in the high; stored as q + 8."""
    low = (packed & 0x0F).astype(np.int8) - 8
    high = (packed >> 4).astype(np.int8) - 8
    return np.stack([low, high], axis=-1).reshape(packed.shape[0], -1)


def dequantize(codes: np.ndarray, scales: np.ndarray, group: int) -> np.ndarray:
    """int8 codes [N, K] x float32 scales [N, K/group] -> float32 weights [N, K]."""
    n, k = codes.shape
    groups = codes.reshape(n, k // group, group).astype(np.float32)
    return (groups * scales[:, :, None].astype(np.float32)).reshape(n, k)


class BundleWeights(Mapping[str, np.ndarray]):
    """Weight name -> float32 array, dequantizing `<name>.qw` / `<name>.sc` pairs on access."""

    def __init__(self, bundle, quantization: dict | None):
        self.bundle = bundle
        self.group = quantization["group_size"] if quantization else None
        self.bf16_scales = bool(quantization) and quantization["scale_dtype"] == "bfloat16"
        self.quantized = set(quantization["tensors"]) if quantization else set()
        # The decoding steps as attributes: a mutant (k2vec.mutation.catalogue) swaps one on this instance.
        self.unpack, self.dequantize = unpack_int4, dequantize

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self.quantized:
            return self.bundle[name]
        return self.dequantize(self.unpack(self.bundle[name + ".qw"]), self.scales(name), self.group)

    def scales(self, name: str) -> np.ndarray:
        """float32 [N, K/group] scales of a quantized tensor."""
        scales = self.bundle[name + ".sc"]
        return bf16_to_f32(scales) if self.bf16_scales else scales

    def shape_of(self, name: str) -> tuple[int, ...]:
        if name not in self.quantized:
            return self.bundle.info(name).shape
        n, half = self.bundle.info(name + ".qw").shape
        return (n, 2 * half)

    def block(self, name: str, r0: int, r1: int) -> np.ndarray:
        """Rows r0:r1 of `self[name]`, dequantizing only those rows of an INT4 weight."""
        if name not in self.quantized:
            return self.bundle[name][r0:r1]
        return self.dequantize(self.unpack(self.bundle[name + ".qw"][r0:r1]), self.scales(name)[r0:r1], self.group)

    def release(self, name: str) -> None:
        for part in ((name + ".qw", name + ".sc") if name in self.quantized else (name,)):
            self.bundle.release(part)

    def __iter__(self) -> Iterator[str]:
        return iter(n for n in self.bundle.keys() if n.startswith(("model.", "lm_head")))

    def __len__(self) -> int:
        return sum(1 for _ in self)


@dataclass
class Loaded:
    """A bundle opened and its reference model built, for any number of runs on it."""

    bundle: object
    meta: dict
    prompts: list[np.ndarray]
    model: ReferenceModel
    load_s: float


def load(bundle_path: str, install: Callable[[ReferenceModel], None] | None = None,
         precision: str | None = None) -> Loaded:
    """Open the bundle and build its model; `install(model)`, when given, changes the model before it decodes;
    `precision` (a k2vec.model.precision format) emulates an engine of it."""
    rounding = EXACT if precision is None else ENGINE_SCHEDULE.rounder(get_format(precision))
    t0 = time.perf_counter()
    bundle = open_bundle(bundle_path)
    meta = bundle.metadata
    prompts = [np.asarray(bundle[f"prompt.p{i}.tokens"]) for i in range(meta["golden"]["prompts"])]
    model = ReferenceModel(meta["hf_config"], BundleWeights(bundle, meta["quantization"]), dtype=np.float64,
                           latent_norm_eps=meta["golden"]["reference"]["latent_norm_eps"],
                           weight_cache_bytes=WEIGHT_CACHE_BYTES, rounding=rounding)  # the golden stage's cache
    if install is not None:
        install(model)
    return Loaded(bundle, meta, prompts, model, time.perf_counter() - t0)


def run(bundle_path: str, mode: str, budget: int, install: Callable[[ReferenceModel], None] | None = None,
        precision: str | None = None) -> dict:
    """The result object of one contract run (load, then decode)."""
    return decode(load(bundle_path, install, precision), mode, budget, precision)


def decode(loaded: Loaded, mode: str, budget: int, precision: str | None = None, first: bool = True) -> dict:
    """The result object of one run on a loaded bundle; `first`: the process's first run, which reports the load
    (later ones: 0 s)."""
    bundle, meta, prompts, model = loaded.bundle, loaded.meta, loaded.prompts, loaded.model
    decoding = meta["decoding"]
    n_prompts = len(prompts)
    t_load = time.perf_counter()
    n_new = decoding["max_new_tokens"]
    if mode == "greedy":
        results = greedy_generate(model, prompts, n_new, top_k=decoding["top_k"])
        runs = [{"drafter": None, "prompts": [greedy_prompt(r, len(p)) for r, p in zip(results, prompts)]}]
    elif mode == "score":
        # the only golden tensor an engine may read, and only in this mode (docs/engine-contract.md §3)
        golden = [np.asarray(bundle[f"golden.p{i}.tokens"]) for i in range(n_prompts)]
        results = greedy_generate(model, prompts, n_new, top_k=decoding["top_k"], forced=golden)
        runs = [{"drafter": None, "prompts": [score_prompt(r) for r in results]}]
    elif mode == "ddtree":
        return decode_ddtree(loaded, [budget], precision, first)[budget]
    else:
        raise K2VecError(f"unknown mode {mode!r}; the contract's modes: {', '.join(CONTRACT_MODES)}")
    return _result(loaded, runs, precision, first, time.perf_counter() - t_load)


def decode_ddtree(loaded: Loaded, budgets: list[int], precision: str | None = None,
                  first: bool = True) -> dict[int, dict]:
    """budget -> the result object of the DDTree run at that budget, all of them decoded in one lockstep
    `ddtree_generate` over every (budget, drafter accuracy, prompt), where jobs in the same state verify one
    union tree; `first`: the process's first run (the first budget's result reports the load). Each run's
    decode_s is its share of the pass, by the nodes of its own trees (a node shared by several runs' trees is
    verified once but counted in each)."""
    bundle, meta, prompts = loaded.bundle, loaded.meta, loaded.prompts
    accuracies = meta["golden"]["ddtree"]["accuracies"]
    budgets = list(dict.fromkeys(budgets))
    drafts = [[_recorded_drafts(bundle, a_i, i, len(p)) for i, p in enumerate(prompts)]
              for a_i in range(len(accuracies))]
    jobs = [DDTreeJob(p, drafts[a_i][i], budget)
            for budget in budgets for a_i in range(len(accuracies)) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    results = ddtree_generate(loaded.model, jobs, meta["decoding"]["max_new_tokens"])
    seconds = time.perf_counter() - t0
    per_run = len(accuracies) * len(prompts)
    nodes = np.array([sum(len(x.node_tokens) for x in r.rounds) for r in results]).reshape(len(budgets), per_run)
    out = {}
    for b_i, budget in enumerate(budgets):
        mine = results[b_i * per_run:(b_i + 1) * per_run]
        runs = [{"drafter": {"accuracy": accuracy},
                 "prompts": [{"tokens": r.tokens.tolist(), "rounds": [ddtree_round(x) for x in r.rounds]}
                             for r in mine[a_i * len(prompts):(a_i + 1) * len(prompts)]]}
                for a_i, accuracy in enumerate(accuracies)]
        out[budget] = _result(loaded, runs, precision, first and b_i == 0,
                              seconds * nodes[b_i].sum() / nodes.sum())
    return out


def _recorded_drafts(bundle, accuracy_index: int, prompt_index: int, prompt_len: int) -> RecordedDrafts:
    ids = np.asarray(bundle[f"drafts.a{accuracy_index}.p{prompt_index}.ids"])
    return RecordedDrafts(ids, np.asarray(bundle[f"drafts.a{accuracy_index}.p{prompt_index}.logprobs"]),
                          np.full(ids.shape[:2], -1, np.int32), prompt_len)


def _result(loaded: Loaded, runs: list[dict], precision: str | None, first: bool, decode_s: float) -> dict:
    return {"format": "k2vec-engine-result", "version": 1,
            "device": f"cpu ({platform.machine()}, numpy {np.__version__}, "
                      f"{'float64' if precision is None else precision + ' emulated in float64'})",
            "timing": {"load_s": loaded.load_s if first else 0.0, "decode_s": decode_s},
            "runs": runs}


def main(argv: list[str] | None = None) -> int:
    ap = contract_parser(__doc__.splitlines()[0])
    ap.add_argument("--precision", choices=list(FORMATS), help="emulate an engine of this precision (default: float64)")
    args = ap.parse_args(argv)
    runs = contract_runs(ap, args)
    loaded = load(args.bundle, precision=args.precision)
    ddtree: dict[int, dict] | None = None
    for i, r in enumerate(runs):   # the bundle is loaded once: the first result carries the load time
        if r.mode == "ddtree" and ddtree is None:
            try:
                ddtree = decode_ddtree(loaded, [x.budget for x in runs[i:] if x.mode == "ddtree"], args.precision,
                                       first=i == 0)
            except Exception:   # decoded one by one instead, so that an error fails only the run it belongs to
                ddtree = {}
        if r.mode == "ddtree" and r.budget in ddtree:
            result = ddtree[r.budget]
        else:
            result = decode(loaded, r.mode, r.budget, args.precision, first=i == 0)
        write_output(r.output, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
