"""The llama.cpp engine: llama.cpp's DeepSeek-V3 graph (`deepseek2`) through llama-cpp-python, on a GGUF file
that llama.cpp's own converter made from the bundle (k2vec.engines.llama_cpp.gguf_cache).

    python -m k2vec.engines.llama_cpp --bundle B.kdtr --mode greedy|score --budget 0 --output R.json [--threads 1]

Prompts run one at a time on the CPU: the prompt in one batch (every position an output, as llama-cpp-python's
`logits_all` asks), then one token per step through llama.cpp's KV cache (docs/engine-contract.md: greedy and
score). Choices that decide what is measured (docs/llama-cpp.md):
- the KV cache is float32 (`type_k`/`type_v`): llama.cpp's default float16 cache rounds every cached latent
  and key, which moves the logits by about 1e-2, ten times float32's budget, and flips tokens;
- `use_extra_bufts` is off: the CPU backend's repacked weight buffers (AMX and interleaved kernels) are left
  out, as its AMX kernel for Q4_0 died with SIGILL on a CPU without AMX; float32 weights are not repacked anyway;
- the model's q_a/kv_a layernorms use llama.cpp's own epsilon, `rms_norm_eps` (1e-5 here), where the golden
  uses 1e-6 (transformers' DeepseekV3RMSNorm default): a convention of llama.cpp's, named in the result's
  `device` and beside the engine's entry in config.yaml.
"""

from __future__ import annotations

import importlib.metadata
import platform
import sys
import time

import llama_cpp
import numpy as np

from k2vec.engines.cli import contract_parser, write_output
from k2vec.engines.llama_cpp.converter import find_tree
from k2vec.engines.llama_cpp.gguf_cache import cached, convert_bundle
from k2vec.errors import K2VecError
from k2vec.kdtr import open_bundle

class LlamaCppError(K2VecError):
    """llama.cpp refused the model, the context or a batch."""


class Llama:
    """One llama.cpp model and context on the CPU, through llama.cpp's C API (llama-cpp-python's bindings)."""

    def __init__(self, gguf: str, n_ctx: int, n_threads: int):
        llama_cpp.llama_backend_init()
        mp = llama_cpp.llama_model_default_params()
        mp.n_gpu_layers = 0
        mp.use_extra_bufts = False   # no repacked CPU weight buffers (the AMX kernel's SIGILL: module docstring)
        self.model = llama_cpp.llama_model_load_from_file(gguf.encode(), mp)
        if not self.model:
            raise LlamaCppError(f"llama.cpp could not load {gguf} (its log, above, says why)")
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx = cp.n_batch = cp.n_ubatch = n_ctx   # a prompt is one batch and one micro-batch
        cp.n_seq_max = 1
        cp.n_threads = cp.n_threads_batch = n_threads
        cp.type_k = cp.type_v = llama_cpp.GGML_TYPE_F32
        cp.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cp.no_perf = True
        self.ctx = llama_cpp.llama_init_from_model(self.model, cp)
        if not self.ctx:
            llama_cpp.llama_model_free(self.model)
            raise LlamaCppError(f"llama.cpp could not make a context of {n_ctx} positions for {gguf}")
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.batch = llama_cpp.llama_batch_init(n_ctx, 0, 1)
        self.n_ctx = n_ctx

    def clear(self) -> None:
        """Empty the KV cache (a new prompt)."""
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), True)

    def forward(self, tokens: np.ndarray, start: int) -> np.ndarray:
        """Decode `tokens` at positions start.. (sequence 0, every position an output); the last one's logits
        as float32 [n_vocab]."""
        n = len(tokens)
        if start + n > self.n_ctx:
            raise LlamaCppError(f"positions {start}..{start + n - 1} do not fit the context of {self.n_ctx}")
        b = self.batch
        b.n_tokens = n
        for i, tok in enumerate(tokens):
            b.token[i] = int(tok)
            b.pos[i] = start + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = 1
        rc = llama_cpp.llama_decode(self.ctx, b)
        if rc != 0:
            raise LlamaCppError(f"llama_decode returned {rc} for {n} token(s) at position {start}")
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, -1), shape=(self.n_vocab,)).copy()

    def close(self) -> None:
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)
        llama_cpp.llama_model_free(self.model)


def top_k(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, values) of the k largest logits, descending; ties: lower id first (the golden's argmax rule)."""
    order = np.argsort(-logits, kind="stable")[:k]
    return order, logits[order].astype(np.float64)


def decode_prompt(llm: Llama, prompt: np.ndarray, n_new: int, k: int, fed: np.ndarray | None) -> dict:
    """Prefill `prompt`, then `n_new` steps; step j feeds the argmax of step j-1 (greedy) or `fed[j-1]` (score)."""
    llm.clear()
    logits = llm.forward(prompt, 0)
    ids, vals = [], []
    for step in range(n_new):
        i, v = top_k(logits, k)
        ids.append(i)
        vals.append(v)
        if step + 1 < n_new:
            nxt = i[0] if fed is None else fed[step]
            logits = llm.forward(np.array([nxt]), prompt.size + step)
    ids_a = np.stack(ids)
    return {"tokens": ids_a[:, 0].tolist(), "topk_ids": ids_a.tolist(), "topk_logits": np.stack(vals).tolist()}


def run(bundle_path: str, mode: str, n_threads: int = 1) -> dict:
    started_at = time.time()
    t0 = time.perf_counter()
    bundle = open_bundle(bundle_path)
    meta = bundle.metadata
    n_new, k = meta["decoding"]["max_new_tokens"], meta["decoding"]["top_k"]
    prompts = [np.asarray(bundle[f"prompt.p{i}.tokens"], dtype=np.int64) for i in range(meta["golden"]["prompts"])]
    tree, manifest = find_tree()
    gguf, reused = cached(bundle_path, "f32", lambda out: convert_bundle(bundle, tree, out), manifest)
    t_convert = time.perf_counter()
    llm = Llama(str(gguf), max(p.size for p in prompts) + n_new, n_threads)
    if llm.n_vocab != meta["hf_config"]["vocab_size"]:
        raise LlamaCppError(f"{gguf}: llama.cpp reads a vocabulary of {llm.n_vocab}, the bundle's is "
                            f"{meta['hf_config']['vocab_size']}")
    t_load = time.perf_counter()
    try:
        if mode == "greedy":
            results = [decode_prompt(llm, p, n_new, k, None) for p in prompts]
        else:  # score: golden.p{i}.tokens, the only golden tensor an engine may read, in this mode only
            results = [decode_prompt(llm, p, n_new, k, np.asarray(bundle[f"golden.p{i}.tokens"]))
                       for i, p in enumerate(prompts)]
    finally:
        llm.close()
    t_end = time.perf_counter()
    commit = (manifest.get("llama_cpp_commit") or "unknown")[:10]
    return {"format": "k2vec-engine-result", "version": 1,
            "device": f"cpu ({platform.machine()}), llama.cpp {commit} via llama-cpp-python "
                      f"{importlib.metadata.version('llama_cpp_python')}, float32 GGUF, float32 KV cache, "
                      f"{n_threads} thread(s), q_a/kv_a norm eps = rms_norm_eps (llama.cpp's convention)",
            "timing": {"convert_s": t_convert - t0, "gguf_reused": reused, "load_s": t_load - t0,
                       "decode_s": t_end - t_load, "started_at": started_at, "ended_at": time.time()},
            "runs": [{"drafter": None, "prompts": results}]}


def main(argv: list[str] | None = None) -> int:
    ap = contract_parser(__doc__.splitlines()[0], modes=("greedy", "score"))   # no DDTree mode
    ap.add_argument("--threads", type=int, default=1, help="llama.cpp's CPU threads (default 1: one core per job)")
    args = ap.parse_args(argv)
    print(llama_cpp.llama_print_system_info().decode(errors="replace"), file=sys.stderr)
    result = run(args.bundle, args.mode, args.threads)
    write_output(args.output, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
