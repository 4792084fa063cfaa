"""k2vec.pipeline.checksum_once: a finished job's inputs hashed once for the metadata of all its outputs."""
import asyncio

from k2vec.pipeline import checksum_once


class FakeFile:
    """An input file as Snakemake's _IOFile: its checksum coroutine counts how often it hashes."""
    hashed = 0

    def __init__(self, name):
        self.name = name

    def __str__(self):
        return self.name

    async def checksum(self, threshold=None, force=False):
        FakeFile.hashed += 1
        return f"sha256:{self.name}:{threshold}:{force}"


class FakePersistence:
    """Snakemake's metadata step: a record per output, each hashing every input again."""

    async def finished(self, job):
        return [{str(f): await f.checksum(100) for f in job} for _output in range(3)]


def test_a_finished_jobs_inputs_are_hashed_once_for_all_its_outputs(monkeypatch):
    monkeypatch.setattr(checksum_once, "_targets", lambda: (FakePersistence, FakeFile))
    monkeypatch.setattr(FakeFile, "hashed", 0)
    job = [FakeFile("a.kdtr"), FakeFile("b.json")]
    plain = asyncio.run(FakePersistence().finished(job))
    assert FakeFile.hashed == 6
    assert checksum_once.install() and checksum_once.install()  # a second install wraps nothing twice
    FakeFile.hashed = 0
    assert asyncio.run(FakePersistence().finished(job)) == plain
    assert FakeFile.hashed == 2
    # each call of the step hashes afresh (a file rewritten by a later job), and outside it nothing is kept
    asyncio.run(FakePersistence().finished(job))
    assert FakeFile.hashed == 4
    asyncio.run(job[0].checksum(100)), asyncio.run(job[0].checksum(100))
    assert FakeFile.hashed == 6
    # another threshold or flag is another checksum call
    assert asyncio.run(job[0].checksum(100, force=True)) == "sha256:a.kdtr:100:True"


def test_the_installed_snakemake_has_the_step_it_wraps():
    """Where a Snakemake release renames its metadata step or checksum coroutine, install() wraps nothing (the run
    stays correct, only slower): this test says so."""
    import snakemake.io
    import snakemake.persistence

    assert checksum_once._targets() is not None
    assert checksum_once.install()
    persistence = getattr(snakemake.persistence, "PersistenceBase", None) or snakemake.persistence.Persistence
    assert getattr(persistence.finished, checksum_once._WRAPPED)
    assert getattr(snakemake.io._IOFile.checksum, checksum_once._WRAPPED)
