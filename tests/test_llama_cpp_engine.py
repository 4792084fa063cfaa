"""The llama.cpp engine (k2vec.engines.llama_cpp, docs/llama-cpp.md).

Without llama-cpp-python: how it runs llama.cpp's converter, the converter's extraction from the sdist, the GGUF
cache, and its entry being left out with one notice (the HF checkpoint it converts: tests/test_checkpoint_cache.py).
With it (`-m thirdparty`, skipped where llama_cpp or its converter is missing): its pipeline runs on every
default bundle, greedy and score, against the golden and against the reference under llama.cpp's convention
(q_a/kv_a layernorm eps = rms_norm_eps)."""
import importlib.util
import io
import os
import json
import tarfile
from pathlib import Path

import pytest

from conftest import REPO, default_config, snakemake
from test_workflow import scheduled_job_wildcards

from support.conventions import assert_exact_under_the_convention, run_engine_alone

from k2vec.digests import sha256_file
from k2vec.engines import checkpoint_cache
from k2vec.engines.llama_cpp import converter, gguf_cache


def fake_converter_tree(root: Path, script_body: str) -> Path:
    """A stand-in for llama.cpp's converter directory: a `conversion` package whose DeepSeek-V3 class
    insists on a tokenizer, a gguf-py/ whose `gguf` says it is the tree's, and a script."""
    (root / "conversion").mkdir(parents=True)
    (root / "conversion/base.py").write_text(
        "class TextModel:\n    def _set_vocab_none(self):\n        return 'none'\n")
    (root / "conversion/__init__.py").write_text(
        "from conversion.base import TextModel\n\n"
        "class DeepseekV3Model(TextModel):\n"
        "    def set_vocab(self):\n        raise RuntimeError('BPE pre-tokenizer was not recognized')\n\n"
        "def get_model_class(name, mmproj=False):\n"
        "    assert name == 'DeepseekV3ForCausalLM', name\n    return DeepseekV3Model\n")
    (root / "gguf-py/gguf").mkdir(parents=True)
    (root / "gguf-py/gguf/__init__.py").write_text("SOURCE = 'the converter tree'\n")
    (root / converter.SCRIPT).write_text(script_body)
    return root


CONVERT_SCRIPT = """import json, sys
import gguf
from conversion import get_model_class
model = get_model_class("DeepseekV3ForCausalLM")()
out = sys.argv[sys.argv.index("--outfile") + 1]
open(out, "w").write(json.dumps({"vocab": model.set_vocab(), "argv": sys.argv[1:], "gguf": gguf.SOURCE}))
"""


def test_converter_runs_as_its_command_line_with_no_vocabulary(tmp_path):
    """vocabless: the architecture's set_vocab is the converter's own _set_vocab_none, the converter's
    gguf-py is the `gguf` it imports (not an installed one), and it gets our options after its own."""
    tree = fake_converter_tree(tmp_path / "tree", CONVERT_SCRIPT)
    (tmp_path / "model").mkdir()
    (tmp_path / "model/config.json").write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"]}))
    gguf_cache.convert(tree, tmp_path / "model", tmp_path / "out.gguf")
    ran = json.loads((tmp_path / "out.gguf").read_text())
    assert ran == {"vocab": "none", "gguf": "the converter tree",
                   "argv": [str(tmp_path / "model"), "--outfile", str(tmp_path / "out.gguf"), "--outtype", "f32"]}


def test_a_failing_converter_is_an_error_naming_its_last_line(tmp_path):
    tree = fake_converter_tree(tmp_path / "tree", "raise SystemExit('Model Foo is not supported')\n")
    (tmp_path / "model").mkdir()
    (tmp_path / "model/config.json").write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"]}))
    with pytest.raises(gguf_cache.ConversionError, match="exited with code 1 .*: Model Foo is not supported"):
        gguf_cache.convert(tree, tmp_path / "model", tmp_path / "out.gguf")


def fake_sdist(path: Path, version: str, with_script: bool = True) -> Path:
    """A llama-cpp-python sdist in miniature: its version, the vendored llama.cpp's converter, gguf-py, the
    library sources the converter does not need, and the submodule's commit."""
    top = f"llama_cpp_python-{version}"
    files = {f"{top}/llama_cpp/__init__.py": f'from .llama import *\n\n__version__ = "{version}"\n',
             f"{top}/vendor/llama.cpp/conversion/__init__.py": "# conversion\n",
             f"{top}/vendor/llama.cpp/gguf-py/gguf/__init__.py": "# gguf\n",
             f"{top}/vendor/llama.cpp/ggml/src/ggml.c": "/* the library */\n",
             f"{top}/vendor/llama.cpp/convert_lora_to_gguf.py": "# another script\n",
             f"{top}/.git/modules/vendor/llama.cpp/HEAD": "0c1e57098bba43ac29e6e3b677cdceebdd22334f\n"}
    if with_script:
        files[f"{top}/vendor/llama.cpp/{converter.SCRIPT}"] = "# the converter\n"
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_converter_is_extracted_from_the_sdist_of_the_installed_version(tmp_path, monkeypatch):
    sdist = fake_sdist(tmp_path / "llama_cpp_python-0.3.36.tar.gz", "0.3.36")
    manifest = converter.extract(sdist, tmp_path / "tree", "0.3.36")
    tree = tmp_path / "tree"
    assert sorted(p.relative_to(tree).as_posix() for p in tree.rglob("*") if p.is_file()) == [
        "conversion/__init__.py", converter.SCRIPT, "gguf-py/gguf/__init__.py", converter.MANIFEST]
    assert manifest["llama_cpp_commit"] == "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
    assert manifest["sdist_sha256"] == __import__("hashlib").sha256(sdist.read_bytes()).hexdigest()
    monkeypatch.setenv(converter.TREE_ENV, str(tree))
    monkeypatch.setattr(converter, "installed_version", lambda: "0.3.36")
    assert converter.find_tree() == (tree, manifest)
    # A library upgraded since: its converter may map the model otherwise, so the old one is refused.
    monkeypatch.setattr(converter, "installed_version", lambda: "0.3.37")
    with pytest.raises(converter.ConverterError, match="comes from llama-cpp-python 0.3.36, the installed library "
                                                       "is 0.3.37; rerun `install`"):
        converter.find_tree()


def test_converter_of_another_version_or_none_is_refused(tmp_path, monkeypatch):
    with pytest.raises(converter.ConverterError, match="is llama-cpp-python 0.3.35, the installed library is 0.3.36"):
        converter.extract(fake_sdist(tmp_path / "old.tar.gz", "0.3.35"), tmp_path / "a", "0.3.36")
    with pytest.raises(converter.ConverterError, match="holds no vendor/llama.cpp/convert_hf_to_gguf.py"):
        converter.extract(fake_sdist(tmp_path / "bare.tar.gz", "0.3.36", with_script=False), tmp_path / "b", "0.3.36")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    monkeypatch.setenv(converter.TREE_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(converter.ConverterError,
                       match="wheel does not ship it; run `python -m k2vec.engines.llama_cpp.converter install`"):
        converter.find_tree()


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / gguf_cache.CACHE_NAME


def counting_build(calls: list):
    def build(out: Path):
        calls.append(out)
        out.write_bytes(b"GGUF" + bytes(len(calls)))
    return build


MANIFEST = {"llama_cpp_python": "0.3.36", "llama_cpp_commit": "0c1e570", "sdist_sha256": "ab"}


def test_a_conversion_is_made_once_per_bundle_and_variant(tmp_path, cache_home, monkeypatch):
    monkeypatch.setattr(checkpoint_cache, "KEEP_PER_SLOT", 10)   # none removed here (the next test removes)
    bundle = tmp_path / "b.kdtr"
    bundle.write_bytes(b"bundle one")
    calls = []
    first, reused = gguf_cache.cached(bundle, "f32", counting_build(calls), MANIFEST)
    assert not reused and first.parent == cache_home and first.read_bytes() == b"GGUF\0"
    again, reused = gguf_cache.cached(bundle, "f32", counting_build(calls), MANIFEST)
    assert reused and again == first and len(calls) == 1
    # Another variant, another converter, other bundle bytes: each its own file.
    others = [gguf_cache.cached(bundle, "q4_0", counting_build(calls), MANIFEST)[0],
              gguf_cache.cached(bundle, "f32", counting_build(calls), {**MANIFEST, "llama_cpp_commit": "1d2"})[0]]
    bundle.write_bytes(b"bundle two")
    others.append(gguf_cache.cached(bundle, "f32", counting_build(calls), MANIFEST)[0])
    assert len(calls) == 4 and len({first, *others}) == 4
    assert sorted(p.name for p in cache_home.glob("*.gguf")) == sorted(p.name for p in [first, *others])


def test_of_a_bundle_files_conversions_of_a_variant_the_two_last_used_are_kept(tmp_path, cache_home):
    bundle, other = tmp_path / "b.kdtr", tmp_path / "c.kdtr"
    made = []
    for i, content in enumerate([b"one", b"two"]):   # two edits of the bundle, an hour apart
        bundle.write_bytes(content)
        made.append(gguf_cache.cached(bundle, "f32", counting_build([]), MANIFEST)[0])
        os.utime(made[-1], (3600.0 * (i + 1),) * 2)
    other.write_bytes(b"other")
    kept = [gguf_cache.cached(other, "f32", counting_build([]), MANIFEST)[0],   # another bundle file
            gguf_cache.cached(bundle, "q4_0", counting_build([]), MANIFEST)[0]]   # another variant
    bundle.write_bytes(b"one")   # back to the first: found, and now the last used
    again, reused = gguf_cache.cached(bundle, "f32", counting_build([]), MANIFEST)
    assert reused and again == made[0] and made[0].stat().st_mtime > 7200
    bundle.write_bytes(b"three")
    third, reused = gguf_cache.cached(bundle, "f32", counting_build([]), MANIFEST)
    assert not reused
    assert sorted(p.name for p in cache_home.iterdir() if not p.name.endswith(".lock")) == sorted(
        p.name for p in [made[0], third, *kept])   # "two", the least recently used, is gone, its lock with it
    assert not (cache_home / (made[1].name + ".lock")).exists()


def test_a_failed_conversion_leaves_nothing_under_the_final_name(tmp_path, cache_home):
    bundle = tmp_path / "b.kdtr"
    bundle.write_bytes(b"bundle")
    final = cache_home / checkpoint_cache.cache_key(bundle, sha256_file(bundle), "f32", MANIFEST,
                                                    (gguf_cache.__name__, checkpoint_cache.__name__), ".gguf")
    cache_home.mkdir(parents=True)
    stale = cache_home / f".{final.name}.4242.x1y2.tmp"   # a killed writer's temporary
    stale.write_bytes(b"half")

    def broken(out: Path):
        out.write_bytes(b"GG")
        raise gguf_cache.ConversionError("converter died")

    with pytest.raises(gguf_cache.ConversionError, match="converter died"):
        gguf_cache.cached(bundle, "f32", broken, MANIFEST)
    assert not final.exists() and not stale.exists()
    assert [p.name for p in cache_home.iterdir() if not p.name.endswith(".lock")] == []
    path, reused = gguf_cache.cached(bundle, "f32", counting_build([]), MANIFEST)
    assert path == final and not reused and final.read_bytes() == b"GGUF\0"


def test_without_a_writable_cache_the_conversion_is_made_for_the_run(tmp_path, monkeypatch):
    (tmp_path / "file").write_bytes(b"")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))   # a file: no directory can be made in it
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", None)   # re-read TMPDIR
    bundle = tmp_path / "b.kdtr"
    bundle.write_bytes(b"bundle")
    path, reused = gguf_cache.cached(bundle, "f32", counting_build([]), MANIFEST)
    assert not reused and path.is_relative_to(tmp_path / "tmp") and path.read_bytes() == b"GGUF\0"


def test_entry_is_left_out_with_one_notice_without_llama_cpp(tmp_path):
    """Where llama-cpp-python is not installed (hidden here: tests/support/hide_modules), the pipeline runs as
    before: no llama.cpp run scheduled, one line naming the engine and the package."""
    entry = default_config()["engines"]["llama_cpp"]
    assert entry["requires"] == ["llama_cpp", "torch", "transformers"] and entry["precision"] == "float32"
    env = {"PYTHONPATH": f"{REPO / 'src'}:{REPO / 'tests/support/hide_modules'}", "K2VEC_HIDE_MODULES": "llama_cpp",
           "CUDA_VISIBLE_DEVICES": ""}
    res = snakemake("-n", "--directory", str(tmp_path), cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    notice = [line for line in res.stderr.splitlines() if line.startswith("k2vec: no run of") and "llama_cpp" in line]
    assert len(notice) == 1, res.stderr[-2000:]
    engines, modules = notice[0].removeprefix("k2vec: no run of engine(s) ").split(": ", 1)
    # one line for every engine missing a package (vllm too, where it is not installed)
    assert "llama_cpp" in engines.split(", ") and "llama_cpp" in modules.split(" not importable by")[0].split(", ")
    runs = [w for rule, w in scheduled_job_wildcards(res.stdout) if rule == "engine_run"]
    assert runs and "llama_cpp" not in {w["engine"] for w in runs}


# ---- with llama-cpp-python and its converter (-m thirdparty) -------------------------------------------

def _converter_problem() -> str | None:
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed (the [llamacpp] extra)"
    try:
        converter.find_tree()
    except converter.ConverterError as err:
        return str(err)
    return None


PROBLEM = _converter_problem()
needs_llama_cpp = pytest.mark.skipif(PROBLEM is not None, reason=PROBLEM or "")
BUNDLES = [f"{m}-{p}" for m in ("tiny", "small") for p in ("fp32", "int4")]
LLAMA_RUNS = [(b, mode) for b in BUNDLES for mode in ("greedy", "score")]


@pytest.fixture(scope="module")
def llama_pipeline(tmp_path_factory):
    """The default config with the llama.cpp engine alone: every default bundle, greedy and score, sandboxed
    where bwrap works, its GGUF files in results/cache/llama_cpp."""
    return run_engine_alone(tmp_path_factory.mktemp("llama"), None,
                            {"llama_cpp": default_config()["engines"]["llama_cpp"]})


@pytest.mark.thirdparty
@needs_llama_cpp
@pytest.mark.parametrize("bundle, mode", LLAMA_RUNS, ids=[f"{b}-{m}" for b, m in LLAMA_RUNS])
def test_llama_cpp_matches_the_reference_under_its_convention(llama_pipeline, bundle, mode):
    result = json.loads((llama_pipeline / f"results/runs/llama_cpp/{bundle}-{mode}.json").read_text())
    assert_exact_under_the_convention(result, llama_pipeline / f"results/bundles/{bundle}.kdtr", mode)


@pytest.mark.thirdparty
@needs_llama_cpp
def test_each_bundle_is_converted_once(llama_pipeline):
    ggufs = sorted((llama_pipeline / "results/cache/llama_cpp" / gguf_cache.CACHE_NAME).glob("*.gguf"))
    assert len(ggufs) == len(BUNDLES), ggufs
    for bundle in BUNDLES:
        reused = [json.loads((llama_pipeline / f"results/runs/llama_cpp/{bundle}-{mode}.json").read_text())
                  ["timing"]["gguf_reused"] for mode in ("greedy", "score")]
        assert sorted(reused) == [False, True], (bundle, reused)
