"""The code-digest cache kept across Snakemake starts (k2vec.pipeline.code_digest.DigestCache): the digest it gives
is code_digest's, reused only while every file it covers is unchanged."""
import os

import pytest

from k2vec.pipeline.code_digest import DigestCache, code_digest


@pytest.fixture
def tree(tmp_path):
    for name, text in {"a.py": "def f():\n    return 1\n", "b.py": "X = 2\n"}.items():
        (tmp_path / name).write_text(text)
    return tmp_path


def cached(cache_path, tree, calls, save=True):
    """One workflow start: the digest of a.py and b.py through the cache, `calls` counting the reads of them."""
    def files():
        calls.append(1)
        return [str(tree / "a.py"), str(tree / "b.py")]
    cache = DigestCache(cache_path)
    value = cache.digest("stage", files, str(tree))
    if save:
        cache.save()
    return value


def test_a_new_start_reuses_the_digest_of_unchanged_files(tree, tmp_path):
    calls = []
    path = tmp_path / "cache" / "digests.json"
    first = cached(path, tree, calls, save=False)
    assert first == code_digest([str(tree / "a.py"), str(tree / "b.py")], str(tree))
    assert cached(path, tree, calls) == first and len(calls) == 2   # nothing saved before: read again
    assert cached(path, tree, calls) == first and len(calls) == 2   # saved: a new start reads nothing


@pytest.mark.parametrize("change", ["edit", "delete", "comment", "corrupt cache"])
def test_a_changed_file_or_a_bad_cache_recomputes(tree, tmp_path, change):
    path = tmp_path / "digests.json"
    before = cached(path, tree, [])
    calls = []
    if change == "edit":
        (tree / "a.py").write_text("def f():\n    return 2\n")
    elif change == "delete":
        os.unlink(tree / "b.py")
        (tree / "b.py").write_text("X = 3\n")
    elif change == "comment":   # recomputed (the file changed) but the meaning is the same
        (tree / "a.py").write_text("def f():  # why\n    return 1\n")
    else:
        path.write_text("{not json")
    after = cached(path, tree, calls)
    assert len(calls) == 1
    assert (after == before) == (change in ("comment", "corrupt cache"))


def fresh_process():
    """What a new Snakemake start has: no result of this process's parses, only what a DigestCache loads."""
    from k2vec.pipeline import code_digest as cd
    for f in (cd._parse, cd._imports, cd._meaning_of, cd.module_sources):
        f.cache_clear()
    cd._FILE_MEMO.clear()


def test_after_an_edit_only_the_edited_file_is_read_again(tree, tmp_path, monkeypatch):
    """A digest over several files, one edited: the others' meanings come from the cache's per-file records, and
    the digest equals a cold computation's."""
    from k2vec.pipeline import code_digest as cd
    path = tmp_path / "digests.json"
    fresh_process()
    cached(path, tree, [])
    (tree / "a.py").write_text("def f():\n    return 2\n")
    fresh_process()
    read = []
    meaning_of = cd._meaning_of.__wrapped__
    monkeypatch.setattr(cd, "_meaning_of", lambda p, *state: read.append(os.path.basename(p)) or meaning_of(p, *state))
    after = cached(path, tree, [])
    assert read == ["a.py"]
    monkeypatch.undo()
    fresh_process()
    assert after == code_digest([str(tree / "a.py"), str(tree / "b.py")], str(tree))
