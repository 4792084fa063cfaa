"""The C reader (include/kdtr.h via tools/kdtr_tool.c), built with ASan+UBSan at test time:
same table as Python's `list`, same verdict, field and offset as the Python reader on every
malformed and fuzzed file, no sanitizer report, no allocation larger than the input."""

import io
import os
import random
import shutil
import subprocess
import zlib
from pathlib import Path

import numpy as np
import pytest

from k2vec.kdtr import KdtrError, bf16, int4, open_bundle_buffer, write_bundle
from k2vec.kdtr.cli import main as kdtr_main
from k2vec.kdtr.fuzz import cases, malformed_cases, seed_bundles, write_corpus

REPO = Path(__file__).resolve().parents[1]
GCC = shutil.which("gcc")
pytestmark = pytest.mark.skipif(GCC is None, reason="gcc not installed")
WARN = ["-Wall", "-Wextra", "-Werror", "-Wpedantic", "-Wconversion", "-Wshadow"]
SAN = ["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined", "-fno-sanitize-recover=all"]
ENV = {**os.environ, "ASAN_OPTIONS": "detect_leaks=1:exitcode=99", "UBSAN_OPTIONS": "print_stacktrace=1"}


def _compile(src: Path, out: Path, std: str = "c11") -> None:
    cmd = [GCC, f"-std={std}", *WARN, *SAN, f"-I{REPO / 'include'}", str(src), "-o", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    if r.returncode and "asan" in r.stderr.lower() and "cannot find" in r.stderr:
        pytest.skip("gcc has no sanitizer runtime")
    assert r.returncode == 0, r.stderr


@pytest.fixture(scope="module")
def tool(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("kdtr_c") / "kdtr_tool"
    _compile(REPO / "tools" / "kdtr_tool.c", out)
    return out


def run(tool: Path, *args, timeout: float = 120) -> subprocess.CompletedProcess:
    r = subprocess.run([str(tool), *map(str, args)], capture_output=True, text=True, timeout=timeout, env=ENV)
    assert "Sanitizer" not in r.stderr and "runtime error" not in r.stderr, r.stderr[-3000:]
    assert r.returncode != 99
    return r


@pytest.mark.parametrize("std", ["c99", "c11"])
def test_header_builds_warning_free(tmp_path, std):
    _compile(REPO / "tools" / "kdtr_tool.c", tmp_path / "t", std)


def _python_list(path: Path) -> str:
    out = io.StringIO()
    assert kdtr_main(["list", str(path)], out=out) == 0
    return out.getvalue()


def _representative(tmp_path: Path) -> list[Path]:
    paths = []
    for i, data in enumerate(seed_bundles()):
        paths.append(tmp_path / f"seed{i}.kdtr")
        paths[-1].write_bytes(data)
    rng = np.random.default_rng(5)
    big = {
        "model.layers.0.mlp.experts.7.down_proj.weight_packed": int4(rng.integers(0, 255, (64, 32), dtype=np.uint8)),
        "model.layers.0.mlp.experts.7.down_proj.weight_scale": rng.standard_normal((64, 2)).astype(np.float32),
        "rank8": np.zeros((1, 2, 1, 2, 1, 2, 1, 3), np.int16),
        "scalar": np.float64(-1.25),
        "bf": bf16(np.arange(300, dtype=np.uint16)),
        "x" * 256: np.zeros(0, np.uint64),
        "~!@#$%^&*()_+-={}[]|:;'<>,?": np.arange(3, dtype=np.int8),
    }
    paths.append(tmp_path / "page.kdtr")
    write_bundle(paths[-1], big, {"quantization": {"scheme": "w4a16", "group_size": 32}})
    return paths


def test_c_list_is_byte_identical_to_python_list(tool, tmp_path):
    for path in _representative(tmp_path):
        r = run(tool, "list", path)
        assert r.returncode == 0, r.stderr
        assert r.stdout == _python_list(path)
        assert r.stdout.count("\n") == 1 + len(open_bundle_buffer(path.read_bytes()).tensors)  # header + rows


def test_c_verify_exit_status_and_message(tool, tmp_path):
    good = _representative(tmp_path)
    r = run(tool, "verify", *good)
    assert r.returncode == 0 and r.stdout.count(": OK, ") == len(good)
    bad = tmp_path / "bad.kdtr"
    data = bytearray(good[-1].read_bytes())
    data[-1] = 1  # padding after the last tensor
    bad.write_bytes(data)
    r = run(tool, "verify", good[0], bad)
    assert r.returncode == 1
    assert f"{bad}: FAILED: offset {len(data) - 1} (padding):" in r.stderr
    r = run(tool, "list", bad)  # list only checks the structure, as Python's open does
    assert r.returncode == 0
    bad.write_bytes(data[:100])
    r = run(tool, "list", bad)
    assert r.returncode == 1 and "(header.file_size)" in r.stderr and r.stdout == ""


def test_c_usage_and_io_errors(tool, tmp_path):
    assert run(tool).returncode == 2
    assert run(tool, "frobnicate", "x").returncode == 2
    r = run(tool, "verify", tmp_path / "missing.kdtr")
    assert r.returncode == 2 and "No such file" in r.stderr
    (tmp_path / "empty.kdtr").write_bytes(b"")
    r = run(tool, "list", tmp_path / "empty.kdtr")
    assert r.returncode == 1 and "offset 0 (header.magic)" in r.stderr


def _python_verdict(data: bytes):
    try:
        open_bundle_buffer(data, verify=True)
        return ("ok",)
    except KdtrError as e:
        return ("err", e.offset, e.field)


def _c_verdicts(tool: Path, bufs: list[bytes], tmp_path: Path) -> list[tuple]:
    corpus = tmp_path / "corpus.bin"
    write_corpus(corpus, bufs)
    r = run(tool, "fuzz", corpus, timeout=600)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])  # 3 = an allocation exceeded a file
    out = []
    for line in r.stdout.splitlines():
        parts = line.split()
        out.append(("ok",) if parts[1] == "ok" else ("err", int(parts[2]), parts[3]))
    assert len(out) == len(bufs)
    return out


def test_c_agrees_with_python_on_every_malformed_case(tool, tmp_path):
    mc = malformed_cases()
    got = _c_verdicts(tool, [c[1] for c in mc], tmp_path)
    for (cid, _, field, offset, _), c in zip(mc, got):
        assert c[0] == "err" and c[2] == field and c[1] == offset, (cid, c)


def _agree(tool, tmp_path, n, seed):
    bufs = cases(seed, n)
    got = _c_verdicts(tool, bufs, tmp_path)
    mismatches = []
    for i, (data, c) in enumerate(zip(bufs, got)):
        p = _python_verdict(data)
        # same verdict, field and offset (metadata errors too: both at the block's start)
        if p[0] != c[0] or (p[0] == "err" and (p[2] != c[2] or p[1] != c[1])):
            mismatches.append((i, p, c))
    assert not mismatches, mismatches[:10]
    assert sum(v[0] == "ok" for v in got) > n // 20
    # the JSON validators are exercised, not only the structural checks before them
    assert sum(v[0] == "err" and v[2] == "metadata" for v in got) > n // 20


def test_c_fuzz_agrees_with_python(tool, tmp_path):
    _agree(tool, tmp_path, 5_000, seed=99)


@pytest.mark.slow
def test_c_fuzz_agrees_with_python_long(tool, tmp_path):
    _agree(tool, tmp_path, 100_000, seed=12345)


CRC_PROBE = r"""
#include <stdio.h>
#include "kdtr.h"
int main(void) {
    static unsigned char buf[4096 + 16];
    size_t i, off, len;
    for (i = 0; i < sizeof buf; i++) buf[i] = (unsigned char)(i * 131u + 7u);
    for (off = 0; off < 16; off++)
        for (len = 0; len <= 70; len++) printf("%08x\n", kdtr_crc32(0, buf + off, len));
    printf("%08x\n", kdtr_crc32(kdtr_crc32(0, buf, 1000), buf + 1000, 3000)); /* running CRC */
    return 0;
}
"""


def test_c_crc32_matches_zlib_at_every_alignment(tmp_path):
    (tmp_path / "probe.c").write_text(CRC_PROBE)
    _compile(tmp_path / "probe.c", tmp_path / "probe")
    r = subprocess.run([str(tmp_path / "probe")], capture_output=True, text=True, timeout=60, env=ENV)
    assert r.returncode == 0, r.stderr
    buf = bytes((i * 131 + 7) & 0xFF for i in range(4096 + 16))
    want = [f"{zlib.crc32(buf[off: off + n]):08x}" for off in range(16) for n in range(71)]
    want.append(f"{zlib.crc32(buf[:4000]):08x}")
    assert r.stdout.split() == want


def test_random_bundles_list_identically(tool, tmp_path):
    rng = random.Random(8)
    for k in range(5):
        tensors = {}
        for _ in range(rng.randint(0, 12)):
            name = "".join(rng.choice("abc._-09") for _ in range(rng.randint(1, 20))).strip(".") or "n"
            if ".." in name:
                continue
            shape = tuple(rng.randint(0, 4) for _ in range(rng.randint(0, 4)))
            tensors[name] = np.ones(shape, rng.choice([np.float32, np.int64, np.uint8, np.float16]))
        p = tmp_path / f"r{k}.kdtr"
        write_bundle(p, tensors, {"k": k}, alignment=rng.choice([64, 128, 4096]))
        r = run(tool, "list", p)
        assert r.returncode == 0 and r.stdout == _python_list(p)
