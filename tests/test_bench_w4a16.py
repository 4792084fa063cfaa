"""bench/w4a16.py's Triton sweep beside the CUDA kernel's keys: what it times, and the tables it writes."""
import json
from dataclasses import asdict, dataclass

import pytest

from conftest import bench_module

from k2vec.engines.gpu_triton.kernels import configs
from k2vec.engines.gpu_triton.kernels.w4a16_cuda import CudaTile


@pytest.fixture(scope="module")
def bench():
    return bench_module("w4a16")


@pytest.fixture
def committed_tables():
    """install_configs replaces the kernels' tables in this process: put the committed ones back afterwards."""
    saved = (list(configs.DENSE_CONFIGS), dict(configs.DENSE_SHAPE_CONFIGS), list(configs.MOE_CONFIGS))
    yield
    configs.DENSE_CONFIGS[:] = saved[0]
    configs.DENSE_SHAPE_CONFIGS.clear()
    configs.DENSE_SHAPE_CONFIGS.update(saved[1])
    configs.MOE_CONFIGS[:] = saved[2]


def test_sweep_candidates_are_triton_configs_json_can_hold(bench):
    """The committed tables carry CudaTiles; the Triton sweep's candidates (json.dumps'd to tell them apart) must
    not (its weights have no CUDA-order copy, so the key would be ignored, and a CudaTile is no JSON)."""
    for m in bench.MS:
        candidates = bench.dense_candidates(m)
        assert candidates, m
        for cfg in candidates:
            assert not set(cfg) & set(bench.CUDA_KEYS), (m, cfg)
            json.dumps(cfg)
    assert bench.warm_jobs(moe=False)


@dataclass(frozen=True)
class CarryCase:
    name: str
    shape: tuple[int, int] | None    # None: the generic table (DENSE_CONFIGS)
    bound: int                       # a swept table's entry: M up to this


CARRY_CASES = [
    CarryCase("7168->2048 at M <= 1: the CUDA tile of its own table", (7168, 2048), 1),
    CarryCase("7168->2048 at M <= 16", (7168, 2048), 16),
    CarryCase("2048->7168 at M <= 8: two tiles per warp", (2048, 7168), 8),
    CarryCase("2048->7168 at M <= 1: Triton's GEMV, no CUDA key", (2048, 7168), 1),
    CarryCase("the last bound (any M): as the committed M = 64", (7168, 4096), 1 << 62),
    CarryCase("the generic table at M <= 4: the fit rule", None, 4),
    CarryCase("a shape without a table of its own: the generic one's keys", (1024, 512), 16),
]


@pytest.mark.parametrize("case", CARRY_CASES, ids=lambda c: c.name)
def test_swept_tables_keep_the_committed_cuda_keys(bench, case):
    committed_table = configs.DENSE_SHAPE_CONFIGS.get(case.shape, configs.DENSE_CONFIGS)
    committed = configs.pick_config(committed_table, min(case.bound, 64))
    swept = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "MMA_ORDER": True, "CUDA": CudaTile(8, 8, 8, 8)}
    [[bound, cfg]] = bench.with_cuda_keys([[case.bound, swept]], case.shape)
    assert bound == case.bound
    assert {k: v for k, v in cfg.items() if k not in bench.CUDA_KEYS} == bench.triton_only(swept)
    assert cfg.get("CUDA") == committed.get("CUDA")     # the stray tile of the swept entry is gone
    assert cfg.get("CUDA_PDL") == committed.get("CUDA_PDL")


def test_configs_json_round_trip_keeps_the_cuda_tiles(bench, committed_tables):
    """A sweep's configs.json, installed again by --configs, runs the CUDA kernel where the committed tables did."""
    shapes = {f"{k}x{n}": [[bound, cfg] for bound, cfg in table]
              for (k, n), table in configs.DENSE_SHAPE_CONFIGS.items()}
    dense = [[bound, cfg] for bound, cfg in configs.DENSE_CONFIGS]
    text = json.dumps({"dense_table": dense, "dense_shape_table": shapes}, default=bench.config_json)
    before = {shape: list(table) for shape, table in configs.DENSE_SHAPE_CONFIGS.items()}
    generic = list(configs.DENSE_CONFIGS)
    saved = json.loads(text)
    bench.install_configs(saved["dense_table"], None, saved["dense_shape_table"])
    assert configs.DENSE_SHAPE_CONFIGS == before
    assert configs.DENSE_CONFIGS == generic
    tiles = [cfg["CUDA"] for table in before.values() for _, cfg in table if isinstance(cfg.get("CUDA"), CudaTile)]
    assert any(tile.tpw == 2 for tile in tiles)    # every field survives, not only the positional ones


def test_moe_cuda_sweep_candidates_fit_their_launches(bench):
    """Every tile --moe-cuda-sweep times fits the K2 layer's launch it is timed on (a tile that did not would fall back
    to Triton in fused_moe and be timed as if it were the CUDA kernel's)."""
    gate_ups, downs = bench.moe_cuda_candidates(1), bench.moe_down_cuda_candidates(1)
    assert gate_ups and downs
    assert all(tile.fits_gate_up(2 * bench.INTER, bench.HIDDEN) for tile in gate_ups)
    assert all(tile.fits_down(bench.HIDDEN, bench.INTER, bench.TOP_K) for tile in downs)


def test_moe_tables_keep_and_round_trip_their_cuda_tiles(bench, committed_tables, monkeypatch):
    """A MoE table naming CUDA tiles survives configs.json (install_configs reads the tiles back), and the Triton
    sweep's MoE table keeps the committed CUDA keys of each bound while its candidates carry none."""
    gate_up, down = CudaTile(2, 8, 1, 8, ch=4), CudaTile(1, 8, 1, 8)
    table = [[bound, [dict(c13, CUDA=gate_up), dict(c2, CUDA=down)]] for bound, (c13, c2) in configs.MOE_CONFIGS]
    saved = json.loads(json.dumps({"moe_table": table}, default=bench.config_json))
    bench.install_configs(None, saved["moe_table"], None)
    assert all(c13["CUDA"] == gate_up and c2["CUDA"] == down for _, (c13, c2) in configs.MOE_CONFIGS)
    assert all(not set(c) & set(bench.CUDA_KEYS) for m in bench.SWEEP_MOE_MS for c in bench.OLD_MOE[m])
    monkeypatch.setitem(bench.OLD_MOE_CUDA, 4, ({"CUDA": gate_up}, {}))
    swept = [{**c, "CUDA": CudaTile(8, 8, 8, 8)} for c in bench.OLD_MOE[4]]
    assert bench.with_moe_cuda_keys(swept, 4) == [dict(bench.OLD_MOE[4][0], CUDA=gate_up), bench.OLD_MOE[4][1]]


GU, GU2, DN = CudaTile(2, 4, 1, 12, ch=4, ring=True), CudaTile(4, 2, 2, 12, ch=4, ring=True), CudaTile(4, 2, 8, 12)


@dataclass(frozen=True)
class TakeCase:
    name: str
    m: int
    committed: float
    gate_ups: tuple     # (tile, µs[, rel err]) per timed gate/up tile
    downs: tuple        # the same per down tile (timed after the best gate/up wherever it beat the committed)
    taken: tuple        # (gate/up tile or None, down tile or None) at bound m


def sweep_row(m, launch, tile, us, committed, rel_err=3e-4):
    return dict(m=m, launch=launch, tile=asdict(tile), us=us, rel_err=rel_err, committed_us=committed, read_us=60.0)


TAKE_CASES = [
    TakeCase("gate/up 4.5% ahead, down behind it: gate/up alone", 4, 293.3, ((GU, 280.0), (GU2, 284.5)),
             ((DN, 281.3),), (GU, None)),
    TakeCase("gate/up 2.4% ahead: nothing", 1, 79.9, ((GU2, 78.0),), ((DN, 82.6),), (None, None)),
    TakeCase("the pair 5% ahead of gate/up's 2%: both, gate/up being what down was timed after", 8, 100.0,
             ((GU, 98.0),), ((DN, 93.0),), (GU, DN)),
    TakeCase("gate/up behind the committed, down 4% ahead: down alone", 16, 100.0, ((GU, 101.0),), ((DN, 96.0),),
             (None, DN)),
    TakeCase("the fastest gate/up over the bf16 tolerance: the next one", 4, 100.0, ((GU, 90.0, 0.5), (GU2, 95.0)),
             (), (GU2, None)),
    TakeCase("an M that is no bound of the table decides nothing", 2, 100.0, ((GU, 50.0),), ((DN, 40.0),),
             (None, None)),
]


@pytest.mark.parametrize("case", TAKE_CASES, ids=lambda c: c.name)
def test_moe_cuda_sweep_takes_its_winners_into_the_table(bench, case, committed_tables):
    """--moe-cuda-sweep's configs.json: the committed MoE table with the winners (CUDA_GAIN ahead of the committed
    call in the same run) at the swept bound, every other entry as committed, read back by install_configs."""
    rows = [sweep_row(case.m, "gate/up", *g[:2], case.committed, *g[2:]) for g in case.gate_ups]
    rows += [sweep_row(case.m, "down", *d[:2], case.committed, *d[2:]) for d in case.downs]
    committed = list(configs.MOE_CONFIGS)
    table = bench.moe_cuda_table(rows)
    saved = json.loads(json.dumps({"moe_table": table}, default=bench.config_json))
    bench.install_configs(None, saved["moe_table"], None)
    for (bound, pair), (_, old) in zip(configs.MOE_CONFIGS, committed):
        if bound == case.m:
            assert tuple(c.get("CUDA") for c in pair) == case.taken
            assert [{k: v for k, v in c.items() if k != "CUDA"} for c in pair] == list(old)
        else:
            assert pair == old, bound


@dataclass(frozen=True)
class DenseTakeCase:
    name: str
    shape: tuple        # (K, N)
    m: int
    committed: float    # the committed call's µs (whichever kernel the table ran)
    tiles: tuple        # (tile, µs[, rel err])
    taken: object       # the CUDA key at bound m afterwards: a tile, None, or "committed"


TILE_A, TILE_B = CudaTile(4, 2, 1, 8, ch=2), CudaTile(2, 4, 1, 12, ch=4, ring=True)
DENSE_TAKE_CASES = [
    DenseTakeCase("5% ahead of the committed CUDA tile: taken", (7168, 2048), 8, 6.0, ((TILE_A, 5.7), (TILE_B, 5.9)),
                  TILE_A),
    DenseTakeCase("2% ahead: the committed tile stays", (2048, 7168), 2, 6.0, ((TILE_A, 5.88),), "committed"),
    DenseTakeCase("ahead of the committed Triton call: a CUDA key where there was none", (2048, 7168), 1, 4.2,
                  ((TILE_B, 4.0),), TILE_B),
    DenseTakeCase("the fastest over the bf16 tolerance: the next one", (7168, 4096), 16, 10.0,
                  ((TILE_A, 8.0, 0.5), (TILE_B, 9.5)), TILE_B),
    DenseTakeCase("M = 64 decides the table's last, open bound", (2048, 7168), 64, 12.0, ((TILE_A, 11.0),), TILE_A),
    DenseTakeCase("an M that is no bound decides nothing", (7168, 2048), 3, 6.0, ((TILE_A, 1.0),), "committed"),
]


@pytest.mark.parametrize("case", DENSE_TAKE_CASES, ids=lambda c: c.name)
def test_cuda_sweep_takes_its_winners_into_the_shape_tables(bench, case, committed_tables):
    """--cuda-sweep's configs.json: each shape's committed table with the winners (CUDA_GAIN ahead of the committed
    call timed beside them) at the swept bound, the Triton keys kept, every other entry as committed."""
    k, n = case.shape
    rows = [dict(k=k, n=n, m=case.m, tile=asdict(t[0]), us=t[1], rel_err=(t[2:] or (1e-3,))[0]) for t in case.tiles]
    anchors = [dict(k=k, n=n, m=case.m, kernel="CUDA", committed_us=case.committed, bf16_us=12.0)]
    committed = {shape: list(table) for shape, table in configs.DENSE_SHAPE_CONFIGS.items()}
    saved = json.loads(json.dumps({"t": bench.dense_cuda_tables(rows, anchors)}, default=bench.config_json))
    bench.install_configs(None, None, saved["t"])
    bound = next(b for b, _ in committed[case.shape] if min(b, bench.MS[-1]) >= case.m)
    for shape, table in configs.DENSE_SHAPE_CONFIGS.items():
        for (b, cfg), (_, old) in zip(table, committed[shape]):
            if shape == case.shape and b == bound and case.taken != "committed":
                assert cfg == dict(old, CUDA=case.taken)
            else:
                assert cfg == old, (shape, b)


def test_configs_files_stack_a_later_ones_tables_over_an_earlier_ones(bench, tmp_path):
    """--configs A B: a dense sweep's file and a MoE sweep's measured together; a table B gives replaces A's."""
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"dense_table": [[1, {"x": 1}]], "moe_table": None, "dense_shape_table": {"1x2": []}}))
    b.write_text(json.dumps({"dense_table": None, "moe_table": [[1, [{}, {}]]], "dense_shape_table": {"3x4": []}}))
    assert bench.load_tables([a, b]) == [[[1, {"x": 1}]], [[1, [{}, {}]]], {"3x4": []}]
    assert bench.load_tables([b, a]) == [[[1, {"x": 1}]], [[1, [{}, {}]]], {"1x2": []}]
