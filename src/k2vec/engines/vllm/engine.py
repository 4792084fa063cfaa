"""The vLLM engine: vLLM's DeepseekV3ForCausalLM on an HF checkpoint written from the bundle.

    python -m k2vec.engines.vllm --bundle B.kdtr --batch LISTING.json   (every run of the bundle, one vLLM)
    python -m k2vec.engines.vllm --bundle B.kdtr --mode greedy|score --budget 0 --output R.json
        [--dtype float32|bfloat16] [--threads 1]

The checkpoint is float32, INT4 weights dequantized (k2vec.engines.checkpoint_cache, kept in
$XDG_CACHE_HOME/k2vec-vllm/): vLLM-CPU has no W4A16 kernel for DeepSeek-V3's MoE, so the INT4 *format* is judged
through vLLM's compressed-tensors path on a GPU only (docs/vllm.md). vLLM is built once per process (eager, no
prefix cache, one in-process engine core, seed 0) and asked for raw logits (`logprobs_mode="raw_logits"`), so
`topk_logits` are logits as the contract wants, not log-softmax values. Prompts run one at a time:
- greedy: temperature 0, `max_new_tokens` tokens, the top k of each step;
- score: the prompt and golden[0..N-2] as one prefill with prompt logprobs (the forced decode in one forward),
  then one generated token for the last step (k2vec.engines.vllm.steps.score_steps).
No fingerprints or router choices: vLLM has no hook for them short of patching its model (both optional).
vLLM's convention, named in the result's `device`: q_a/kv_a layernorm eps = rms_norm_eps (the golden: 1e-6).
"""

from __future__ import annotations

import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np

from k2vec.engines import checkpoint_cache
from k2vec.engines.cli import contract_parser, contract_runs, write_output
from k2vec.engines.vllm.steps import prompt_rows, score_steps
from k2vec.errors import K2VecError
from k2vec.kdtr import open_bundle

CACHE_NAME = "k2vec-vllm"
MODES = ("greedy", "score")   # no DDTree mode
# vLLM's own settings, where the caller left them unset: the engine core in this process (nothing to leave
# behind, no IPC sockets for a sandbox to refuse), no OpenMP core binding (the runner's OMP_NUM_THREADS and
# --threads decide), a 1 GiB CPU KV cache (a few prompts of tens of tokens), its and torch inductor's caches in
# TMPDIR (the run's scratch directory: HOME and /tmp are not writable in the sandbox).
VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


class VllmEngineError(K2VecError):
    """vLLM returned other than what was asked for."""


@dataclass
class Loaded:
    """A bundle's vLLM model, for any number of runs on it."""

    meta: dict
    bundle: object
    prompts: list[np.ndarray]
    llm: object
    device: str
    started_at: float
    load_s: float
    checkpoint_s: float
    checkpoint_reused: bool


def _writable(path: str | None) -> bool:
    """Whether `path` is a directory this process can make and write in (tried: a read-only mount refuses even
    root, whatever the permission bits say)."""
    if not path:
        return False
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            return True
    except OSError:
        return False


def load(bundle_path: str, dtype: str, threads: int) -> Loaded:
    started_at = time.time()
    t0 = time.perf_counter()
    for k, v in VLLM_ENV.items():
        os.environ.setdefault(k, v)
    tmp = os.environ.get("TMPDIR", "/tmp")
    # not /tmp: read-only in the sandbox; an inherited setting is kept only where it can be written (a shell's,
    # or one that importing torch's plugins put into a parent process, may point there)
    for key, name in (("VLLM_CACHE_ROOT", "vllm-cache"), ("VLLM_CONFIG_ROOT", "vllm-config"),
                      ("TORCHINDUCTOR_CACHE_DIR", "torchinductor")):
        if not _writable(os.environ.get(key)):
            os.environ[key] = os.path.join(tmp, name)
    import torch
    import vllm

    torch.set_num_threads(threads)
    bundle = open_bundle(bundle_path)
    meta = bundle.metadata
    n = meta["golden"]["prompts"]
    prompts = [np.asarray(bundle[f"prompt.p{i}.tokens"], dtype=np.int64) for i in range(n)]
    model_dir, reused = checkpoint_cache.cached(
        CACHE_NAME, bundle_path, "hf-f32", lambda out: checkpoint_cache.write_hf_checkpoint_into(bundle, out), {},
        (checkpoint_cache.__name__,), directory=True)
    t_ckpt = time.perf_counter()
    n_new, k = meta["decoding"]["max_new_tokens"], meta["decoding"]["top_k"]
    from vllm.platforms import current_platform

    # On a CPU with AMX, vLLM picks its AMX MLA backend, which packs the attention weights into bfloat16 and
    # refuses a float32 model; its reference CPU MLA computes in the model's dtype.
    attention = {"backend": "CPU_MLA"} if current_platform.is_cpu() else None
    llm = vllm.LLM(model=str(model_dir), skip_tokenizer_init=True, dtype=dtype, enforce_eager=True, seed=0,
                   max_model_len=max(p.size for p in prompts) + n_new, max_num_seqs=1, enable_prefix_caching=False,
                   logprobs_mode="raw_logits", max_logprobs=k, attention_config=attention)

    device = f"cpu ({platform.machine()})" if current_platform.is_cpu() else torch.cuda.get_device_name(0)
    device += (f", vLLM {vllm.__version__}, torch {torch.__version__}, {dtype}, {threads} thread(s), "
               f"float32 checkpoint (INT4 dequantized), q_a/kv_a norm eps = rms_norm_eps (vLLM's convention)")
    return Loaded(meta, bundle, prompts, llm, device, started_at, time.perf_counter() - t0, t_ckpt - t0, reused)


def _params(vllm, max_tokens: int, k: int, prompt_logprobs: bool):
    return vllm.SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=k, detokenize=False,
                               prompt_logprobs=k if prompt_logprobs else None, ignore_eos=True)


def greedy(llm, vllm, prompt: np.ndarray, n_new: int, k: int, where: str) -> dict:
    out = llm.generate([{"prompt_token_ids": prompt.tolist()}], _params(vllm, n_new, k, False), use_tqdm=False)
    gen = out[0].outputs[0]
    if len(gen.token_ids) != n_new or len(gen.logprobs or []) != n_new:
        raise VllmEngineError(f"{where}: vLLM generated {len(gen.token_ids)} tokens, {n_new} asked for")
    rows = prompt_rows(gen.logprobs, k, where)
    if rows["tokens"] != list(gen.token_ids):   # its sampled token must be its own top-1 logit
        raise VllmEngineError(f"{where}: vLLM's greedy tokens {list(gen.token_ids)} are not the argmax of the "
                              f"logits it reported {rows['tokens']}")
    return rows


def score(llm, vllm, prompt: np.ndarray, golden: np.ndarray, n_new: int, k: int, where: str) -> dict:
    fed = [*prompt.tolist(), *golden[: n_new - 1].tolist()]
    out = llm.generate([{"prompt_token_ids": fed}], _params(vllm, 1, k, True), use_tqdm=False)[0]
    return prompt_rows(score_steps(out.prompt_logprobs or [], out.outputs[0].logprobs or [], prompt.size, n_new,
                                   where), k, where)


def decode(loaded: Loaded, mode: str, first: bool = True) -> dict:
    """One run on a loaded bundle; `first`: the process's first run, which reports the load (later ones: 0 s)."""
    import vllm

    started_at = loaded.started_at if first else time.time()
    t0 = time.perf_counter()
    meta, bundle, llm = loaded.meta, loaded.bundle, loaded.llm
    n_new, k = meta["decoding"]["max_new_tokens"], meta["decoding"]["top_k"]
    if mode == "greedy":
        results = [greedy(llm, vllm, p, n_new, k, f"prompt {i}") for i, p in enumerate(loaded.prompts)]
    elif mode == "score":  # golden.p{i}.tokens: the only golden tensor an engine may read, in score mode only
        results = [score(llm, vllm, p, np.asarray(bundle[f"golden.p{i}.tokens"]), n_new, k, f"prompt {i}")
                   for i, p in enumerate(loaded.prompts)]
    else:
        raise VllmEngineError(f"k2vec.engines.vllm: mode {mode!r} is not supported ({', '.join(MODES)})")
    timing = {"load_s": loaded.load_s if first else 0.0, "decode_s": time.perf_counter() - t0,
              "started_at": started_at, "ended_at": time.time()}
    if first:
        timing.update(checkpoint_s=loaded.checkpoint_s, checkpoint_reused=loaded.checkpoint_reused)
    return {"format": "k2vec-engine-result", "version": 1, "device": loaded.device, "timing": timing,
            "runs": [{"drafter": None, "prompts": results}]}


def main(argv: list[str] | None = None) -> int:
    ap = contract_parser(__doc__.splitlines()[0], modes=MODES)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--threads", type=int, default=1, help="torch's CPU threads (default 1: one core per job)")
    args = ap.parse_args(argv)
    runs = contract_runs(ap, args, MODES)
    loaded = load(args.bundle, args.dtype, args.threads)   # once for every run
    for i, r in enumerate(runs):
        write_output(r.output, decode(loaded, r.mode, first=i == 0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
