"""Resource estimates of a config, checked against this machine before any job runs.

From each model's resolved dimensions (closed forms, no per-tensor loop: a 100,000-layer model is
estimated as fast as a 4-layer one) this module bounds, per stage, the peak memory of one job, the
disk of all outputs and the number of files; `check_budget` refuses a config that cannot fit, naming
the config key that drives the estimate (`_driver`).

Where the bytes go (per element of the largest tensor T, or of the model's P parameters); every stage
streams (README "Scale"), so none holds a layer or the model:
  weights   one chunk of at most 4M values being drawn (~20 B each: the uint64 PCG64 stream and
            float32 results), written and hashed as it goes
  quantize  the mapped fp32 pages of the tensor being quantized (4 B x T, each tensor has its own
            mapping) plus packed codes, scales and blocked temporaries (~8 B x T, generous)
  golden    the float64 weight cache (8 B x P, at most WEIGHT_CACHE_BYTES), the mapped pages of
            the largest weight (4 B x T) and a float64 block or copy of at most STREAM_BYTES; plus logits,
            KV cache and fingerprints of every prompt (float64)
  bundle    the mapped pages of the tensor being copied (4 B x T) and, to be safe, as much again
  engine    the numpy engine is the reference model again (as golden), plus its JSON result
Every process also carries the interpreter, numpy and the package (PROCESS_BASE), and the sum of
the terms is raised by SLACK for the allocator.

The estimate is meant as an upper bound of each stage's measured peak RSS, never below it, with room
for the allocator and what the terms leave out. `python bench/budget.py` measures each stage in a fresh
process against it; the figures are in bench/RESULTS.md: "budget" (tiny, small and a 115 M-parameter
model, measured before the stages streamed: rerun it for the estimates above) and "k2slice end to end"
with "k2slice stage estimates" (real K2 widths).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k2vec.errors import ConfigError
from k2vec.kdtr.format import DEFAULT_ALIGNMENT, ENTRY_SIZE, MAX_DIR_SIZE, align_up
from k2vec.model.conventions import CONVENTIONS
from k2vec.model.limits import CHUNK_VALUES, STREAM_BYTES, WEIGHT_CACHE_BYTES

MiB, GiB = 1 << 20, 1 << 30
# Allocator slack: glibc keeps freed blocks and fragments, so a peak runs a little over the sum of
# the arrays alive at once (the golden stage measured 1.06x of that sum on the "medium" model).
SLACK = 1.2
# Peak RSS of each stage's process on the `tiny` preset, where data is negligible (bench/budget.py):
# Python, numpy, safetensors and the modules the stage imports. Rounded up.
PROCESS_BASE = {"weights": 48 * MiB, "quantize": 48 * MiB, "golden": 112 * MiB, "bundle": 48 * MiB,
                "engine": 64 * MiB}
# A plain limit on files per run: each is an inode, a directory entry, an fsync and a Snakemake
# bookkeeping record; beyond this the run spends its time in the filesystem, not in numpy.
MAX_FILES = 100_000
# Longest tensor name of a layer-indexed checkpoint, plus the digits of the layer and expert index.
_NAME_LEN = len("model.layers..mlp.experts..gate_proj.weight")
# The keys whose doubling is tried to find what drives an estimate.
SIZE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
             "num_attention_heads", "n_routed_experts", "n_shared_experts", "q_lora_rank", "kv_lora_rank",
             "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
RUN_KEYS = ("prompts.count", "prompts.max_length", "decoding.max_new_tokens")
SKIP_ENV = "K2VEC_SKIP_BUDGET"


@dataclass(frozen=True)
class Counts:
    """Element counts of one model's checkpoint (closed forms of architecture.tensor_shapes)."""

    params: int           # P: every parameter
    mlp_params: int       # of which in SwiGLU MLPs (dense, routed and shared experts)
    expert_params: int    # of which in routed experts
    largest_tensor: int   # elements of the largest tensor
    largest_name: str     # its name and shape, e.g. "model.embed_tokens.weight [2048, 256]"
    largest_shard: int    # elements of the largest safetensors shard (a layer, or the top-level tensors)
    largest_layer: int    # elements of the largest decoder layer's shard
    largest_mlp: int      # elements of the largest SwiGLU matrix (dense, routed or shared expert)
    tensors: int          # number of tensors
    layers: int


def counts(m: dict[str, Any]) -> Counts:
    H, V, L = m["hidden_size"], m["vocab_size"], m["num_hidden_layers"]
    heads, q = m["num_attention_heads"], m["q_lora_rank"]
    qk = m["qk_nope_head_dim"] + m["qk_rope_head_dim"]
    dense = min(m["first_k_dense_replace"], L)
    moe = L - dense
    E, Im, I = m["n_routed_experts"], m["moe_intermediate_size"], m["intermediate_size"]
    shared = Im * m["n_shared_experts"]
    # (name, elements) of one layer's tensors other than the MLP
    attn = [("input_layernorm", H), ("post_attention_layernorm", H),
            ("kv_a_proj_with_mqa", (m["kv_lora_rank"] + m["qk_rope_head_dim"]) * H),
            ("kv_a_layernorm", m["kv_lora_rank"]),
            ("kv_b_proj", heads * (m["qk_nope_head_dim"] + m["v_head_dim"]) * m["kv_lora_rank"]),
            ("o_proj", H * heads * m["v_head_dim"])]
    attn += [("q_proj", heads * qk * H)] if q is None else [
        ("q_a_proj", q * H), ("q_a_layernorm", q), ("q_b_proj", heads * qk * q)]
    attn_params = sum(n for _, n in attn)
    dense_mlp, expert, shared_mlp = 3 * I * H, 3 * Im * H, 3 * shared * H
    moe_layer = attn_params + E * H + E + E * expert + shared_mlp
    dense_layer = attn_params + dense_mlp
    top = 2 * V * H + H
    candidates = [("model.embed_tokens.weight", V, H), ("mlp.gate.weight", E, H)]
    candidates += [(f"self_attn.{n}.weight", n_elems // H, H) for n, n_elems in attn if n_elems % H == 0]
    if dense:
        candidates.append(("mlp.gate_proj.weight", I, H))
    if moe:
        candidates.append(("mlp.experts.*.gate_proj.weight", Im, H))
        if shared:
            candidates.append(("mlp.shared_experts.gate_proj.weight", shared, H))
    name, rows, cols = max(candidates, key=lambda c: c[1] * c[2])
    per_attn = len(attn)
    return Counts(
        params=top + dense * dense_layer + moe * moe_layer,
        mlp_params=dense * dense_mlp + moe * (E * expert + shared_mlp),
        expert_params=moe * E * expert,
        largest_tensor=rows * cols, largest_name=f"{name} [{rows}, {cols}]",
        largest_shard=max(top, dense_layer if dense else 0, moe_layer if moe else 0),
        largest_layer=max(dense_layer if dense else 0, moe_layer if moe else 0),
        largest_mlp=H * max(I if dense else 0, Im if moe else 0, shared if moe else 0),
        tensors=3 + dense * (per_attn + 3) + moe * (per_attn + 2 + 3 * E + (3 if shared else 0)),
        layers=L,
    )


def _fmt(n: int) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / MiB:.0f} MiB"


@dataclass(frozen=True)
class Need:
    """One estimate: `what` needs `bytes` (or a count), mostly because of `because`."""

    what: str
    amount: int
    because: str


def _run_shape(config: dict[str, Any]) -> tuple[int, int, int]:
    """(prompts, positions per sequence, tokens generated per prompt)."""
    p, d = config["prompts"], config["decoding"]
    return p["count"], p["max_length"] + d["max_new_tokens"], d["max_new_tokens"]


def _need(what: str, terms: list[tuple[str, int]]) -> Need:
    """A stage's peak: its process base plus its terms; the reason lists the largest terms."""
    terms = sorted(((label, int(b)) for label, b in terms if b > 0), key=lambda t: -t[1])
    because = ", ".join(f"{label} ~{_fmt(b)}" for label, b in terms[:3])
    return Need(what, PROCESS_BASE[what] + int(SLACK * sum(b for _, b in terms)), because)


def stage_memory(m: dict[str, Any], config: dict[str, Any]) -> list[Need]:
    """Peak memory of one job of each stage for model `m` (resolved architecture)."""
    c = counts(m)
    n_prompts, S, _ = _run_shape(config)
    heads, H, V, L = m["num_attention_heads"], m["hidden_size"], m["vocab_size"], m["num_hidden_layers"]
    dd = config["decoding"]["ddtree"]
    seq = S + max(dd["budgets"]) + dd["block_size"]  # positions of a sequence, DDTree nodes included
    rows = n_prompts * seq                           # rows one forward call may carry: every prompt
    inner = max(m["intermediate_size"], m["moe_intermediate_size"] * (m["num_experts_per_tok"] + m["n_shared_experts"]))
    cache = min(8 * c.params, WEIGHT_CACHE_BYTES)
    model = [
        (f"float64 weight cache ({c.params:,} parameters, at most {_fmt(WEIGHT_CACHE_BYTES)})", cache),
        (f"mapped pages of {c.largest_name} and a float64 block of it",
         4 * c.largest_tensor + min(8 * c.largest_tensor, STREAM_BYTES)),
        (f"KV cache ({n_prompts} prompts x {seq} positions x {L} layers, float64, a spare copy)",
         8 * 2 * L * rows * heads * (m["qk_nope_head_dim"] + m["qk_rope_head_dim"] + m["v_head_dim"])),
        (f"float64 logits of {rows} rows x {V} tokens and two softmax temporaries", 8 * 3 * rows * V),
        ("float64 activations and attention scores",
         8 * 4 * rows * max(H, inner) + 8 * 2 * heads * n_prompts * seq * seq),
    ]
    # The quantize stage reads the tensors it quantizes: with the schemes' targets, MLP weights only;
    # custom targets may include embed_tokens / lm_head.
    q = config["quantization"]
    custom = "targets" in q or "ignore" in q
    biggest = c.largest_tensor if custom else c.largest_mlp
    fingerprints = ("hidden-state fingerprints [prompts, positions, layers, hidden]", 8 * n_prompts * S * L * H)
    chunk = min(c.largest_tensor, CHUNK_VALUES)
    return [
        _need("weights", [(f"drawing a chunk of {chunk:,} values (uint64 stream and float32, ~20 B a value)",
                           20 * chunk)]),
        _need("quantize", [(f"the mapped fp32 pages of a {biggest:,}-value tensor", 4 * biggest),
                           (f"codes, scales and temporaries of a {biggest:,}-value tensor", 8 * biggest)]),
        _need("golden", model + [fingerprints]),
        _need("bundle", [(f"the mapped pages of {c.largest_name}", 4 * c.largest_tensor),
                         (f"a copy of {c.largest_name}", 4 * c.largest_tensor), fingerprints]),
        _need("engine", model + [("its JSON result (Python floats and text)", 8 * fingerprints[1])]),
    ]


# Every KDTR tensor starts at an aligned offset: a bundle pads each of its entries up to this.
_BUNDLE_ALIGN = DEFAULT_ALIGNMENT
_KiB = 1 << 10


def _golden(m: dict[str, Any], config: dict[str, Any]) -> tuple[int, int]:
    """(bytes, entries) of one golden file: fp32 fingerprints of every generated position, the recorded
    DDTree drafts (ids and log-probabilities per accuracy, prompt, step, drafted position and width),
    trees, top-k and routing records (small; bounded per entry)."""
    n_prompts, _, new = _run_shape(config)
    dd = config["decoding"]["ddtree"]
    A, B = len(dd["accuracies"]), len(dd["budgets"])
    fingerprints = 4 * n_prompts * new * m["num_hidden_layers"] * m["hidden_size"]
    drafts = 8 * A * n_prompts * new * (dd["block_size"] - 1) * max(dd["budgets"])
    entries = n_prompts * (8 + 2 * A + 8 * A * B) + 8
    trees = 16 * A * n_prompts * new * sum(dd["budgets"])
    return fingerprints + drafts + trees + entries * 4 * _KiB, entries


def _result(m: dict[str, Any], config: dict[str, Any], mode: str) -> int:
    """Bytes of one run's result (JSON text, ~20 B a number), its integrity records and log."""
    n_prompts, _, new = _run_shape(config)
    if mode.startswith("ddtree-b"):  # rounds of one tree each: a few numbers per node
        return 16 * int(mode[len("ddtree-b"):]) * n_prompts * new + 32 * _KiB
    return 20 * n_prompts * new * m["num_hidden_layers"] * m["hidden_size"] + 64 * _KiB  # fingerprints


def output_disk(m: dict[str, Any], config: dict[str, Any], modes: list[str]) -> Need:
    """Disk of every output of one model whose runs are `modes` (a mode per engine run): checkpoints, INT4
    files, goldens, noise models, convention variants, bundles, run results and the format-effect table. An upper bound
    within about 2x of what a run writes (tests/test_pipeline.py measures the default config's)."""
    c = counts(m)
    q = config["quantization"]
    custom = "targets" in q or "ignore" in q
    quantized = 0 if custom else (c.expert_params if q["scheme"] == "k2-checkpoint" else c.mlp_params)
    int4 = int(quantized * (0.5 + 4 / q["group_size"]))  # .qw codes and .sc scales
    exported = 4 * (c.params - quantized) + int4          # compressed-tensors: the rest stays fp32
    golden, golden_entries = _golden(m, config)
    padding = (2 * c.tensors + golden_entries) * _BUNDLE_ALIGN
    bundles = (4 * c.params + golden + padding) + (exported + golden + padding)
    # fp32 and int4, each with a noise model under a quarter of it and a convention variant of each known
    # convention (rule convention), a golden's size
    goldens = 2 * golden * (1 + len(CONVENTIONS)) + 2 * (golden // 4)
    results = sum(_result(m, config, mode) for mode in modes)
    format_effect = 2 * _result(m, config, "greedy")
    total = 4 * c.params + int4 + exported + goldens + bundles + results + format_effect
    return Need("disk", total, f"fp32 checkpoint and bundle ({c.params:,} parameters x 4 B each), INT4 files, "
                               f"compressed-tensors export and INT4 bundle, goldens, {len(modes)} run results")


def output_files(m: dict[str, Any], config: dict[str, Any], n_runs: int) -> Need:
    c = counts(m)
    # a run writes its result, sha256 and HMAC records, log and benchmark; the stages' own files, logs
    # and benchmarks (goldens, bundles, noise models, cases, the engines' builds) are the fixed 64
    files = 2 * (c.layers + 1) + 2 * c.tensors + 64 + 6 * n_runs
    return Need("files", files, f"{c.layers + 1:,} safetensors shards x 2 (fp32, compressed-tensors), "
                                f"a .qw and a .sc file per quantized weight (up to {c.tensors:,}), logs and "
                                f"{n_runs} run results")


def bundle_directory(m: dict[str, Any]) -> Need:
    c = counts(m)
    digits = len(str(c.layers)) + len(str(m["n_routed_experts"]))
    return Need("bundle directory", c.tensors * (ENTRY_SIZE + align_up(_NAME_LEN + digits, 8)),
                f"{c.tensors:,} tensors, one KDTR directory entry each")


# ---------------------------------------------------------------------------------------- machine


def available_memory() -> tuple[int, str]:
    """Bytes a job can use now: MemAvailable, or less where a cgroup limit says so."""
    best, source = None, ""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                best, source = int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
    except OSError:
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            raw = Path(path).read_text().strip()
        except OSError:
            continue
        if raw.isdigit() and (best is None or int(raw) < best):
            best, source = int(raw), f"cgroup limit {path}"
    if best is None:  # not Linux: physical memory, if the OS tells
        try:
            best, source = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "physical memory"
        except (ValueError, OSError, AttributeError):
            return (1 << 62), "unknown (not checked)"
    return best, source


def free_disk(path: str | Path) -> int:
    """Free bytes on the filesystem that holds `path` (its nearest existing parent)."""
    p = Path(path).resolve()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def _existing_bytes(results: Path, name: str) -> int:
    """Bytes of this model's outputs already on disk (a rerun replaces them, so they count as free)."""
    files = [p for d in (results / "models" / name, results / "golden" / name) for p in d.rglob("*")]
    files += list(results.glob(f"bundles/{name}-*.kdtr")) + list(results.glob(f"runs/*/{name}-*.json"))
    return sum(p.stat().st_size for p in files if p.is_file())


# ------------------------------------------------------------------------------------------ check


def _driver(estimate, m: dict[str, Any], config: dict[str, Any], prefix: str) -> str:
    """The dotted config key that drives `estimate(m, config)`: of the settings changed from the
    model's preset, the one whose reset to the preset value shrinks the estimate most; failing that
    (the preset itself is too big), the size or run key whose doubling grows it most."""
    from k2vec.config.presets import PRESETS

    if m["preset"] is None:  # an imported checkpoint slice: its size is the layers and experts it keeps
        return f"{prefix}.layers"
    base = estimate(m, config)
    preset = PRESETS[m["preset"]]
    shrink = {f"{prefix}.{k}": base - estimate({**m, k: preset[k]}, config)
              for k in SIZE_KEYS if m[k] != preset[k]}
    if shrink and max(shrink.values()) > 0:
        return max(shrink, key=shrink.get)
    growth = {}
    for k in SIZE_KEYS:
        if m.get(k):  # None (no q_lora) and 0 (no shared expert) do not drive anything
            growth[f"{prefix}.{k}"] = estimate({**m, k: 2 * m[k]}, config) - base
    for dotted in RUN_KEYS:
        section, k = dotted.split(".")
        growth[dotted] = estimate(m, {**config, section: {**config[section], k: 2 * config[section][k]}}) - base
    return max(growth, key=growth.get)


def check_budget(models: dict[str, dict[str, Any]], config: dict[str, Any], modes_per_model: dict[str, list[str]],
                 results_dir: str | Path) -> None:
    """Raise ConfigError when a model of `models` (name -> resolved architecture) cannot fit here.

    Memory: each stage's job alone against the memory available now (Snakemake may run several jobs
    at once: --cores bounds that). Disk: all outputs of all models against the free space (plus what
    their previous outputs occupy). Files and the bundle directory: fixed limits."""
    if os.environ.get(SKIP_ENV) == "1":
        return
    memory, memory_source = available_memory()
    results = Path(results_dir)
    disk_total, disk_free = 0, free_disk(results)
    for name, m in models.items():
        prefix = f"models.{name}"
        for i, need in enumerate(stage_memory(m, config)):
            if need.amount > memory:
                key = _driver(lambda mm, cc, i=i: stage_memory(mm, cc)[i].amount, m, config, prefix)
                raise ConfigError(key, f"the {need.what} stage of model '{name}' needs ~{_fmt(need.amount)} of "
                                  f"memory ({need.because}); this machine has {_fmt(memory)} available "
                                  f"({memory_source}). Reduce {key}, or set {SKIP_ENV}=1 to run anyway")
        modes = modes_per_model.get(name, [])
        n_runs = len(modes)
        files = output_files(m, config, n_runs)
        if files.amount > MAX_FILES:
            key = _driver(lambda mm, cc: output_files(mm, cc, n_runs).amount, m, config, prefix)
            raise ConfigError(key, f"model '{name}' would write ~{files.amount:,} files ({files.because}), more "
                              f"than the limit of {MAX_FILES:,}: past that the run spends its time creating, "
                              f"syncing and tracking files. Reduce {key}")
        directory = bundle_directory(m)
        if directory.amount > MAX_DIR_SIZE:
            key = _driver(lambda mm, cc: bundle_directory(mm).amount, m, config, prefix)
            raise ConfigError(key, f"model '{name}' has {counts(m).tensors:,} tensors: its KDTR bundles would need "
                              f"a ~{_fmt(directory.amount)} directory, more than the format's "
                              f"{_fmt(MAX_DIR_SIZE)} limit (docs/kdtr-format.md §7 rule 12). Reduce {key}")
        disk = output_disk(m, config, modes)
        disk_total += disk.amount
        disk_free += _existing_bytes(results, name)
        if disk_total > disk_free:
            key = _driver(lambda mm, cc: output_disk(mm, cc, modes).amount, m, config, prefix)
            raise ConfigError(key, f"the outputs need ~{_fmt(disk_total)} of disk (model '{name}': "
                              f"{disk.because}); {results} has {_fmt(disk_free)} free. Reduce {key}, or set "
                              f"{SKIP_ENV}=1 to run anyway")


def check_config(config: dict[str, Any], runs: list[tuple[str, str, str, str]], results_dir: str | Path) -> None:
    """check_budget for a schema-valid config and the engine runs that will run (k2vec.config.engines.engine_runs,
    left-out engines excluded), before expand_config: resolving the architectures is cheap, listing a huge
    model's tensors is not."""
    from k2vec.config.expand import resolve_model

    models = config.get("models")
    if not isinstance(models, dict):
        return  # expand_config names the problem
    resolved = {name: resolve_model(name, entry) for name, entry in models.items()}
    per_model: dict[str, list[str]] = {}
    for _, model, _, mode in runs:
        per_model.setdefault(model, []).append(mode)
    check_budget(resolved, config, per_model, results_dir)
