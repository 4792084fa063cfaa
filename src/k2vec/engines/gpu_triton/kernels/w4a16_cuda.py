"""Dense W4A16 on the tensor cores in CUDA (w4a16_cuda.cu) for bf16 x of at most 64 rows and group-32 codes (K2's
format; bf16 or float32 scales), K a multiple of 64 and N of 16. Compiled at run time by NVRTC (the library
torch's CUDA build ships; no toolkit needed) and kept in $XDG_CACHE_HOME/k2vec-w4a16-cuda (a sandboxed run's is
results/cache/<engine>), so that the next process loads what an earlier one compiled; launched through the driver's
cuLaunchKernelEx with a thread block cluster (along K, and along N where x is multicast) and PDL.

The weight's load-time copy (cuda_order_copy) is the kernel's operand order: per 16-row tile and 64-wide K step,
32 lanes x 16 bytes of codes and 8 lane groups' scales (8 bytes each in bf16, 16 in float32), so that a warp's K
steps are one contiguous stretch.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from k2vec.entry_store import EntryStore, cache_dir
from k2vec.errors import K2VecError

SOURCE = Path(__file__).with_name("w4a16_cuda.cu")
MAX_ROWS = 64          # x rows: eight m8 tiles
SM_SHARED = 233_472    # bytes of shared memory of an sm_90 SM: each resident block takes its own and 1 KB more


class CudaKernelError(K2VecError):
    """The CUDA W4A16 kernel cannot run this call (shape, dtype, device) or the driver refused its launch."""


@dataclass(frozen=True)
class CudaOrder:
    """A weight's copy in the CUDA kernel's operand order (w4a16_cuda.cu's header)."""
    codes: torch.Tensor    # int32 [n / 16, k / 64, 32, 4]
    scales: torch.Tensor   # bf16 scales: int32 [n / 16, k / 64, 8, 2], pairs (row g, row g + 8) per group;
    #                        float32: [n / 16, k / 64, 8, 4], (row g, row g + 8) of group 0, then of group 1


def cuda_order_codes(packed: torch.Tensor, k: int) -> torch.Tensor:
    """uint8 [n, k / 2] (element 2i low nibble) -> int32 [n/16, k/64, 32, 4]. Lane 4g + t, word 2h + r holds row
    16T + 8r + g of group h of the step; its nibble 4e + 2jj + q is K element 64kb + 32h + 8t + 4jj + 2q + e (lane t's
    eight elements of the group, which its one 16-byte read of x meets)."""
    n = packed.shape[0]
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(n, k)
    # [T, r, g, kb, h, t, jj, q, e] -> [T, kb, g, t, h, r, e, jj, q]
    codes = codes.reshape(n // 16, 2, 8, k // 64, 2, 4, 2, 2, 2).permute(0, 3, 2, 5, 4, 1, 8, 6, 7)
    codes = codes.reshape(n // 16, k // 64, 32, 4, 8).to(torch.int64)
    words = (codes << torch.arange(0, 32, 4, dtype=torch.int64, device=packed.device)).sum(dim=-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def cuda_order_scales(scales: torch.Tensor, k: int) -> torch.Tensor:
    """Scales [n, k / 32] -> per 16-row tile, K step and lane group g: (row g, row g + 8) of the step's group 0,
    then of group 1; bf16 as int32 [n/16, k/64, 8, 2] (row g in the lower half), float32 [n/16, k/64, 8, 4]."""
    n = scales.shape[0]
    bits = scales.contiguous().view(torch.int16) if scales.dtype == torch.bfloat16 else scales.contiguous()
    # [T, r, g, kb, h] -> [T, kb, g, h, r]
    order = bits.reshape(n // 16, 2, 8, k // 64, 2).permute(0, 3, 2, 4, 1).contiguous()
    if scales.dtype == torch.bfloat16:
        return order.view(torch.int32).reshape(n // 16, k // 64, 8, 2)
    return order.reshape(n // 16, k // 64, 8, 4)


def cuda_order_copy(packed: torch.Tensor, scales: torch.Tensor, k: int) -> CudaOrder:
    return CudaOrder(cuda_order_codes(packed, k), cuda_order_scales(scales, k))


def interleave_gate_up(rows: torch.Tensor) -> torch.Tensor:
    """One expert's gate rows stacked over its up rows, [2I, ...] -> the same rows in 16-row tiles taken in turn:
    tile 2i gate rows 16i .. 16i + 15, tile 2i + 1 the same up rows (the MOE kernel's epilogue pairs them)."""
    n2 = rows.shape[0]
    return rows.reshape(2, n2 // 32, 16, *rows.shape[1:]).transpose(0, 1).reshape(rows.shape)


def gate_up_order_copy(w13: torch.Tensor, s13: torch.Tensor, k: int) -> CudaOrder:
    """The MoE's stacked gate/up weights (uint8 [E, 2I, k / 2], scales [E, 2I, k / 32]) in the kernel's operand order,
    each expert's gate and up rows interleaved (interleave_gate_up), the experts one after the other: codes
    [E 2I / 16, k / 64, 32, 4]."""
    return _experts_order_copy(w13, s13, k, interleave_gate_up)


def down_order_copy(w2: torch.Tensor, s2: torch.Tensor, k: int) -> CudaOrder:
    """The MoE's stacked down weights (uint8 [E, H, k / 2], scales [E, H, k / 32]) in the kernel's operand order, the
    experts one after the other: codes [E H / 16, k / 64, 32, 4]."""
    return _experts_order_copy(w2, s2, k, lambda rows: rows)


def _experts_order_copy(w: torch.Tensor, s: torch.Tensor, k: int, rows: Callable) -> CudaOrder:
    """Made one expert at a time: cuda_order_codes' int64 intermediate is 16 times the codes' bytes, too much for a
    layer's worth of experts at once."""
    first = cuda_order_copy(rows(w[0]), rows(s[0]), k)
    codes = torch.empty((w.shape[0], *first.codes.shape), dtype=first.codes.dtype, device=w.device)
    scales = torch.empty((w.shape[0], *first.scales.shape), dtype=first.scales.dtype, device=w.device)
    codes[0], scales[0] = first.codes, first.scales
    for e in range(1, w.shape[0]):
        copy = cuda_order_copy(rows(w[e]), rows(s[e]), k)
        codes[e], scales[e] = copy.codes, copy.scales
    return CudaOrder(codes.flatten(0, 1), scales.flatten(0, 1))


def supported(n: int, k: int, group_size: int, scale_dtype: torch.dtype) -> bool:
    """Whether a weight of this shape and format has a CUDA-order copy (the kernel's fixed layout)."""
    return group_size == 32 and scale_dtype in (torch.bfloat16, torch.float32) and n % 16 == 0 and k % 64 == 0


@dataclass(frozen=True)
class MoeLaunch:
    """One of the fused MoE's launches on the kernel (MOE 1 or 2): gate/up (one (token, expert) pair per block along
    the grid's z, x's row pair // top_k, h written plane-major where out_planes, for a down launch that reads x so) or
    down (one token per block along z, its top_k rows of h side by side along K); expert ids int64 (ids64) or int32."""
    down: bool
    top_k: int
    ids64: bool
    out_planes: bool = False


@dataclass(frozen=True)
class CudaTile:
    """A launch: NWN warps along N of TPW 16-row tiles each and NWK warps along K per block, CL blocks along K in a
    cluster, PF K steps of codes in flight per warp, x copied to shared memory CH steps at a time; fold: the scales
    applied to the weights before the MMA (rounded to bf16) rather than to each group's product in float32; ring:
    the steps in flight held in shared memory (a ring of PF + 1 slots per warp, filled by cp.async) rather than in
    registers; minb: blocks per SM the registers are budgeted for (two: half the registers per thread); nxr: 0, x's
    whole K slice in shared memory, else a ring of nxr (at least 2) chunks of it; xmc: blocks along N in the cluster
    that share x, multicast by bulk copies (with nxr 0 only), so that L2 sends each block's slice of x once per
    cluster rather than once per block; fit_x (M <= 4): x's rows in shared memory fitted to M (1, 2 or 4 rather than
    8), which the MMA's other B columns read again (at M = 1 an eighth of x's shared memory: at 7168->2048 15 KB a
    block rather than 119; the MoE's launches always keep one row)."""
    nwn: int
    nwk: int
    cl: int
    pf: int
    ch: int = 2
    tpw: int = 1
    fold: bool = False
    ring: bool = False
    minb: int = 1
    nxr: int = 0
    xmc: int = 1
    fit_x: bool = False

    @property
    def rows(self) -> int:
        """N rows per block."""
        return 16 * self.nwn * self.tpw

    def steps(self, k: int) -> int:
        return k // (64 * self.nwk * self.cl)

    def chunk(self, k: int) -> int:
        """Steps of x per copy: ch, or all of a warp's where it has fewer (CH)."""
        return min(self.ch, self.steps(k))

    def fits(self, n: int, k: int, m: int, moe: bool = False) -> bool:
        """moe: one of the fused MoE's launches (MoeLaunch), one row of x in shared memory."""
        steps = self.steps(k)
        return (steps >= 1 and steps * 64 * self.nwk * self.cl == k and n % self.rows == 0
                and self.rows % self.cl == 0 and 1 <= self.cl <= 8 and self.nwn * self.nwk <= 32
                and self.xmc in (1, 2, 4, 8) and self.cl * self.xmc <= 8 and (n // self.rows) % self.xmc == 0
                and (self.xmc == 1 or self.nxr == 0) and (not self.fit_x or m <= 4)
                and self.tpw in (1, 2, 4) and self.minb in (1, 2) and self.nxr != 1 and 1 <= m <= MAX_ROWS
                and self.minb * (self.shared_bytes(k, m, moe) + 1024) <= SM_SHARED)

    def shared_bytes(self, k: int, m: int, moe: bool = False) -> int:
        """With `xmc` the chunks' mbarriers (in 128-byte lines), x's slices (or their rings of chunks; one row of x
        for the MoE's launches), the partial sums, and with `ring` the warps' rings (codes, and scales sized for
        float32)."""
        rows, steps = 8 * m_tiles(m), self.steps(k)
        x_rows = self.x_rows(m, moe)
        slots = self.nwn * self.nwk * (min(self.pf, steps) + 1) * self.tpw
        ring = slots * (32 * 16 + 8 * 16) if self.ring else 0
        ch = self.chunk(k)
        x = self.nwk * x_rows * (self.x_chunks(k) * (ch * 64 + 32) if self.nxr else steps * 64 + 32)
        bars = -(-self.nwk * -(-steps // ch) * 8 // 128) * 128 if self.xmc > 1 else 0
        return bars + x * 2 + self.nwk * rows * self.rows * 4 + ring

    def x_rows(self, m: int, moe: bool = False) -> int:
        """x's rows in shared memory (XROWS): all of its m8 tiles', or with fit_x M's next power of two; one for the
        MoE's launches."""
        return 1 if moe else 1 << (m - 1).bit_length() if self.fit_x else 8 * m_tiles(m)

    def x_chunks(self, k: int) -> int:
        """NXR: the chunks in x's ring (0: the whole slice)."""
        return min(self.nxr, -(-self.steps(k) // self.chunk(k))) if self.nxr else 0

    def fits_gate_up(self, n: int, k: int) -> bool:
        """As `fits` for the MoE's gate/up launch over experts of n stacked gate and up rows (one row of x): blocks of
        whole gate/up tile pairs (then each block's share along K holds whole pairs too: a cluster is at most 8), no
        multicast (one row of x)."""
        return self.fits(n, k, 1, moe=True) and self.xmc == 1 and self.rows % 32 == 0

    def fits_down(self, n: int, k: int, top_k: int) -> bool:
        """As `fits` for the MoE's down launch over experts of n rows and K = k (one row of h per pair), top_k pairs a
        token side by side along K: each K warp group's slice within one pair, no multicast."""
        return (self.fits(n, top_k * k, 1, moe=True) and self.xmc == 1
                and k % (self.steps(top_k * k) * 64) == 0)

    def defines(self, k: int, m: int, float32_scales: bool, moe: MoeLaunch | None = None) -> dict[str, int]:
        """k: the launch's K (for the down launch top_k times an expert's)."""
        steps = self.steps(k)
        return dict(NWN=self.nwn, TPW=self.tpw, NWK=self.nwk, CL=self.cl, STEPS=steps, MT=m_tiles(m),
                    XROWS=self.x_rows(m, bool(moe)), PF=min(self.pf, steps), CH=self.chunk(k),
                    SF32=int(float32_scales), FOLD=int(self.fold), RING=int(self.ring), MINB=self.minb,
                    NXR=self.x_chunks(k), XMC=self.xmc, MOE=0 if moe is None else 2 if moe.down else 1,
                    TOPK=moe.top_k if moe else 1, IDS64=int(bool(moe and moe.ids64)),
                    OUT_PLANES=int(bool(moe and moe.out_planes)))


def fit_tile(n: int, k: int, m: int) -> CudaTile | None:
    """A tile for a shape without a swept one (configs.py's "fit"): one block per 16 rows (two past 8 rows of x,
    which share x's copy), the block's warps splitting K as far as 8, no cluster; None where the kernel cannot take
    the shape."""
    if n % 16 or k % 64:
        return None
    nwk = next(w for w in (8, 4, 2, 1) if (k // 64) % w == 0)
    tile = CudaTile(nwn=2 if m > 8 and n % 32 == 0 else 1, nwk=nwk, cl=1, pf=8, ch=4)
    return tile if tile.fits(n, k, m) else None


def m_tiles(m: int) -> int:
    """m8 tiles for m rows: 1, 2, 4 or 8 (compiled variants stay few)."""
    tiles = -(-m // 8)
    return 1 << (tiles - 1).bit_length()


# ---------------------------------------------------------------- NVRTC and the driver

class _LaunchAttribute(ctypes.Structure):    # CUlaunchAttribute: id, 4 bytes of padding, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint * 16)]


class _LaunchConfig(ctypes.Structure):       # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("n_attrs", ctypes.c_uint)]


_CLUSTER_DIMENSION, _PROGRAMMATIC_STREAM_SERIALIZATION = 4, 6
_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


@functools.lru_cache(maxsize=None)
def _driver():
    return ctypes.CDLL("libcuda.so.1")


def _check(rc: int, what: str) -> None:
    if rc != 0:
        name = ctypes.c_char_p()
        _driver().cuGetErrorName(rc, ctypes.byref(name))
        raise CudaKernelError(f"{what}: CUDA driver error {rc} ({(name.value or b'?').decode()})")


@dataclass
class Compiled:
    """A loaded kernel: its CUfunction and the shared memory it was allowed so far."""
    func: ctypes.c_void_p
    module: ctypes.c_void_p
    shared_allowed: int = 48 * 1024

    def allow_shared(self, nbytes: int) -> None:
        if nbytes > self.shared_allowed:
            _check(_driver().cuFuncSetAttribute(self.func, _MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes),
                   f"w4a16_cuda: {nbytes} bytes of shared memory")
            self.shared_allowed = nbytes


NVRTC_OPTIONS = ("-std=c++17",)   # beside --gpu-architecture
CUBIN_CACHE = "k2vec-w4a16-cuda"   # the CUBINs NVRTC made, under cache_dir


@functools.lru_cache(maxsize=None)
def _nvrtc():
    """NVRTC: the library torch's CUDA build ships, else (a CPU-only torch) the nvidia-cuda-nvrtc wheel's, which the
    [test] extra installs so that the kernel compiles on a machine without a GPU."""
    problems = []
    if torch.version.cuda is not None:
        from torch.cuda._utils import _get_gpu_rtc_library
        try:
            return _get_gpu_rtc_library()
        except OSError as exc:
            problems.append(f"torch's: {exc}")
    else:
        problems.append("torch is a CPU-only build")
    spec = importlib.util.find_spec("nvidia.cuda_nvrtc") if importlib.util.find_spec("nvidia") else None
    for folder in spec.submodule_search_locations if spec else ():
        for lib in sorted(Path(folder).glob("lib/libnvrtc.so.*")):
            try:
                return ctypes.CDLL(str(lib))
            except OSError as exc:
                problems.append(f"{lib}: {exc}")
    raise CudaKernelError(f"w4a16_cuda: NVRTC, which compiles the kernel, is not loadable ({'; '.join(problems)}); "
                          "torch's CUDA wheels bring it, or pip install nvidia-cuda-nvrtc-cu12")


def nvrtc_version() -> str:
    major, minor = ctypes.c_int(), ctypes.c_int()
    _nvrtc().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return f"nvrtc {major.value}.{minor.value}"


@dataclass(frozen=True)
class NvrtcOutput:
    cubin: bytes
    ptx: str
    log: str     # what NVRTC and ptxas said (with --ptxas-options=-v: registers, spills)


def nvrtc_compile(source: str, arch: str, extra: tuple[str, ...] = ()) -> NvrtcOutput:
    """`source` compiled for `arch` by NVRTC with NVRTC_OPTIONS and `extra`; no CUDA headers are included."""
    nvrtc = _nvrtc()
    prog = ctypes.c_void_p()
    if nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"w4a16_cuda.cu", 0, None, None):
        raise CudaKernelError("w4a16_cuda: NVRTC could not create the program")

    def get(size_fn, get_fn) -> bytes:
        size = ctypes.c_size_t()
        size_fn(prog, ctypes.byref(size))
        buffer = ctypes.create_string_buffer(size.value)
        get_fn(prog, buffer)
        return buffer.raw

    try:
        options = [f"--gpu-architecture={arch}".encode(), *(o.encode() for o in (*NVRTC_OPTIONS, *extra))]
        rc = nvrtc.nvrtcCompileProgram(prog, len(options), (ctypes.c_char_p * len(options))(*options))
        log = get(nvrtc.nvrtcGetProgramLogSize, nvrtc.nvrtcGetProgramLog).rstrip(b"\0").decode()
        if rc:
            raise CudaKernelError(f"w4a16_cuda.cu does not compile for {arch}:\n{log}")
        return NvrtcOutput(get(nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN),
                           get(nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX).rstrip(b"\0").decode(), log)
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))


def nvrtc_cubin(source: str, arch: str) -> bytes:
    """CUBIN for `arch` from NVRTC."""
    return nvrtc_compile(source, arch).cubin


def kernel_source(defines: tuple[tuple[str, int], ...], kernel: str | None = None) -> str:
    """The kernel's source (w4a16_cuda.cu, or `kernel`) with its compile-time constants in front."""
    return "".join(f"#define {k} {v}\n" for k, v in defines) + (SOURCE.read_text() if kernel is None else kernel)


@functools.lru_cache(maxsize=None)
def _cubin_store(directory: Path) -> EntryStore:
    return EntryStore(directory, "cubin")


_PRUNED: set[tuple[Path, str]] = set()   # (cache directory, kernel version) whose older entries this process removed


def cached_cubin(kernel: str, defines: tuple[tuple[str, int], ...], arch: str, compiler: str,
                 compile: Callable[[str, str], bytes] = nvrtc_cubin) -> bytes:
    """`compile(source, arch)` for the kernel source `kernel` with these constants, kept in the cache directory
    under a key of the kernel's text, the constants, the arch and the compiler (its version and options), so that
    another process with the same kernel loads the CUBIN instead of running NVRTC (bench/RESULTS.md: the time a
    variant takes). An entry is used only where its bytes match their digest (EntryStore); writing one removes
    those of other kernel texts, so the directory holds one version of the kernel. Without a writable directory
    it compiles."""
    source = kernel_source(defines, kernel)
    version = hashlib.sha256(kernel.encode()).hexdigest()[:16]
    key = version + "-" + hashlib.sha256(repr((source, arch, compiler, NVRTC_OPTIONS)).encode()).hexdigest()[:32]
    root = cache_dir(CUBIN_CACHE)
    store = _cubin_store(root) if root is not None else None
    cubin = store.get(key) if store is not None else None
    if cubin is None:
        cubin = compile(source, arch)
        if store is not None:
            try:
                store.put(key, cubin)
                if (root, version) not in _PRUNED:    # once, not at each of a sweep's thousand puts
                    for old in root.glob("*.cubin"):
                        if not old.name.startswith(version):
                            old.unlink(missing_ok=True)
                    _PRUNED.add((root, version))
            except OSError:    # a cache: the next process compiles again
                pass
    return cubin


@functools.lru_cache(maxsize=None)
def _primary_context(device_index: int) -> ctypes.c_void_p:
    """The device's primary context, torch's own (the runtime API uses it), for the driver API calls here."""
    torch.cuda.init()
    device, context = ctypes.c_int(), ctypes.c_void_p()
    _check(_driver().cuDeviceGet(ctypes.byref(device), device_index), f"w4a16_cuda: device {device_index}")
    _check(_driver().cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "w4a16_cuda: the primary context")
    return context


@functools.lru_cache(maxsize=None)
def runs_on(device_index: int) -> bool:
    """The kernel needs sm_90 or later (thread block clusters, griddepcontrol)."""
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def target(defines: tuple[tuple[str, int], ...], major: int, minor: int) -> str:
    """NVRTC's target for a variant on an sm_<major><minor> device: the architecture-specific one (sm_90a) where x is
    multicast, which bulk copies do at full speed only there (PTX ISA, cp.async.bulk)."""
    return f"sm_{major}{minor}" + ("a" if dict(defines)["XMC"] > 1 else "")


def make_current(device_index: int) -> None:
    _check(_driver().cuCtxSetCurrent(_primary_context(device_index)), "w4a16_cuda: the primary context")


_LOADED: dict[tuple[tuple[tuple[str, int], ...], int], Compiled] = {}


def load(defines: tuple[tuple[str, int], ...], device_index: int, cubin: bytes) -> Compiled:
    """Load a CUBIN of the kernel for these constants on one device, for `compiled` to find."""
    make_current(device_index)
    module, func = ctypes.c_void_p(), ctypes.c_void_p()
    _check(_driver().cuModuleLoadData(ctypes.byref(module), cubin), "w4a16_cuda: loading the module")
    _check(_driver().cuModuleGetFunction(ctypes.byref(func), module, b"w4a16_mma"), "w4a16_cuda: the kernel")
    _LOADED[defines, device_index] = Compiled(func, module)
    return _LOADED[defines, device_index]


def compiled(defines: tuple[tuple[str, int], ...], device_index: int) -> Compiled:
    """The kernel for one set of compile-time constants on one device (loaded once per process, compiled by NVRTC
    where no earlier process left it in the cache: cached_cubin)."""
    kernel = _LOADED.get((defines, device_index))
    if kernel is None:
        major, minor = torch.cuda.get_device_capability(device_index)
        if not runs_on(device_index):
            raise CudaKernelError(f"w4a16_cuda needs sm_90 (clusters, PDL); device {device_index} is "
                                  f"sm_{major}{minor}")
        cubin = cached_cubin(SOURCE.read_text(), defines, target(defines, major, minor), nvrtc_version())
        kernel = load(defines, device_index, cubin)
    return kernel


def w4a16_cuda_linear(x: torch.Tensor, weight: CudaOrder, n: int, k: int, out: torch.Tensor, tile: CudaTile,
                      pdl: bool = True) -> torch.Tensor:
    """out [M, n] (bf16, contiguous) = x [M, k] @ W^T on the CUDA kernel, after checking that the tile fits and x's
    format."""
    m = x.shape[0]
    if not tile.fits(n, k, m):
        raise CudaKernelError(f"w4a16_cuda: tile {tile} does not fit K={k} N={n} M={m}")
    if x.dtype != torch.bfloat16 or not x.is_contiguous() or x.data_ptr() % 16:
        raise CudaKernelError(f"w4a16_cuda: x must be contiguous 16-byte aligned bf16, got {x.dtype}")
    return w4a16_cuda_launch(x, weight, n, k, out, tile, pdl)


def w4a16_cuda_launch(x: torch.Tensor, weight: CudaOrder, n: int, k: int, out: torch.Tensor, tile: CudaTile,
                      pdl: bool = True) -> torch.Tensor:
    """w4a16_cuda_linear without its checks, for a caller that made them (w4a16.cuda_tile), so that a call does not
    make them twice."""
    m = x.shape[0]
    _launch(x, weight, out, m, n, k, tile, tile.defines(k, m, weight.scales.dtype == torch.float32), 1, pdl)
    return out


def w4a16_cuda_gate_up(x: torch.Tensor, w13: CudaOrder, ids: torch.Tensor, top_k: int, n: int, k: int,
                       h: torch.Tensor, tile: CudaTile, out_planes: bool = False, pdl: bool = True) -> torch.Tensor:
    """The MoE's gate/up launch: h [P, n / 2] (bf16, contiguous) row p = silu(x_t @ gate_e^T) * (x_t @ up_e^T) for
    pair p = t top_k + j, e = ids[p] (int64 or int32, P of them), on the experts' gate_up_order_copy (n: an expert's
    gate and up rows); out_planes: h's rows plane-major (column c at (c % 8) n / 16 + c / 8)."""
    pairs = ids.numel()
    if not tile.fits_gate_up(n, k):
        raise CudaKernelError(f"w4a16_cuda: tile {tile} does not fit the gate/up launch of K={k}, {n} rows per expert")
    _check_moe_call(x, k, ids, pairs, top_k, h, (pairs, n // 2), "h")
    if pairs:
        moe = MoeLaunch(False, top_k, ids.dtype == torch.int64, out_planes)
        _launch(x, w13, h, 1, n, k, tile, tile.defines(k, 1, w13.scales.dtype == torch.float32, moe), pairs, pdl,
                ids)
    return h


def w4a16_cuda_down(h: torch.Tensor, w2: CudaOrder, ids: torch.Tensor, route_w: torch.Tensor, top_k: int, n: int,
                    k: int, out: torch.Tensor, tile: CudaTile, pdl: bool = True) -> torch.Tensor:
    """The MoE's down launch, each token's pairs summed in it: out [M, n] (bf16, contiguous) row t = sum over j of
    route_w[p] (h[p] @ down_e^T), p = t top_k + j, e = ids[p], in j's order, on the experts' down_order_copy (k: an
    expert's K); h [M top_k, k] as the gate/up launch wrote it (not plane-major), route_w float32 [M top_k]. The
    routing is read before the kernel's wait for h (as the Triton launch's ROUTED): it must follow the gate/up
    launch, which read the routing after its own."""
    pairs = ids.numel()
    if not tile.fits_down(n, k, top_k):
        raise CudaKernelError(f"w4a16_cuda: tile {tile} does not fit the down launch of K={k} per pair, top-{top_k}, "
                              f"N={n}")
    _check_moe_call(h, k, ids, pairs, 1, out, (pairs // top_k, n), "out")
    if route_w.dtype != torch.float32 or not route_w.is_contiguous() or route_w.numel() != pairs:
        raise CudaKernelError(f"w4a16_cuda: route_w must be {pairs} contiguous float32, got {route_w.dtype} "
                              f"{tuple(route_w.shape)}")
    if pairs % top_k:
        raise CudaKernelError(f"w4a16_cuda: {pairs} pairs are not whole tokens of top-{top_k}")
    if pairs:
        moe = MoeLaunch(True, top_k, ids.dtype == torch.int64)
        _launch(h, w2, out, 1, n, top_k * k, tile, tile.defines(top_k * k, 1, w2.scales.dtype == torch.float32, moe),
                pairs // top_k, pdl, ids, route_w)
    return out


def _check_moe_call(x: torch.Tensor, k: int, ids: torch.Tensor, pairs: int, per_row: int, out: torch.Tensor,
                    out_shape: tuple[int, int], what: str) -> None:
    """x bf16 [pairs / per_row, k], ids of `pairs` int32 or int64, `what` (the output) bf16 of out_shape."""
    if x.dtype != torch.bfloat16 or not x.is_contiguous() or x.data_ptr() % 16 or x.shape[1:] != (k,):
        raise CudaKernelError(f"w4a16_cuda: x must be contiguous 16-byte aligned bf16 [*, {k}], got {x.dtype} "
                              f"{tuple(x.shape)}")
    if ids.dtype not in (torch.int32, torch.int64) or not ids.is_contiguous() or pairs != x.shape[0] * per_row:
        raise CudaKernelError(f"w4a16_cuda: expert ids must be {x.shape[0] * per_row} contiguous int32 or int64, got "
                              f"{ids.dtype} {tuple(ids.shape)}")
    if out.dtype != torch.bfloat16 or not out.is_contiguous() or tuple(out.shape) != out_shape:
        raise CudaKernelError(f"w4a16_cuda: {what} must be contiguous bf16 {list(out_shape)}, got {out.dtype} "
                              f"{tuple(out.shape)}")


def _launch(x: torch.Tensor, weight: CudaOrder, out: torch.Tensor, m: int, n: int, k: int, tile: CudaTile,
            defines: dict[str, int], grid_z: int, pdl: bool, ids: torch.Tensor | None = None,
            route_w: torch.Tensor | None = None) -> None:
    kernel = compiled(tuple(defines.items()), x.device.index)
    make_current(x.device.index)
    shared = tile.shared_bytes(k, m, defines["MOE"] > 0)
    kernel.allow_shared(shared)
    attrs = (_LaunchAttribute * 2)()
    n_attrs = 0
    if tile.cl * tile.xmc > 1:
        attrs[n_attrs].id = _CLUSTER_DIMENSION
        attrs[n_attrs].value[0], attrs[n_attrs].value[1], attrs[n_attrs].value[2] = tile.cl, tile.xmc, 1
        n_attrs += 1
    if pdl:
        attrs[n_attrs].id = _PROGRAMMATIC_STREAM_SERIALIZATION
        attrs[n_attrs].value[0] = 1
        n_attrs += 1
    config = _LaunchConfig((ctypes.c_uint * 3)(tile.cl, n // tile.rows, grid_z),
                           (ctypes.c_uint * 3)(32 * tile.nwn * tile.nwk, 1, 1), shared,
                           torch.cuda.current_stream(x.device).cuda_stream, attrs, n_attrs)
    args = [ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(weight.codes.data_ptr()),
            ctypes.c_void_p(weight.scales.data_ptr()), ctypes.c_void_p(out.data_ptr()),
            ctypes.c_int(m), ctypes.c_int(n), ctypes.c_int(k), ctypes.c_void_p(None if ids is None else ids.data_ptr()),
            ctypes.c_void_p(None if route_w is None else route_w.data_ptr())]
    params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args])
    what = {0: f"M={m}", 1: f"gate/up, {grid_z} pairs", 2: f"down, {grid_z} tokens"}[defines["MOE"]]
    _check(_driver().cuLaunchKernelEx(ctypes.byref(config), kernel.func, params, None),
           f"w4a16_cuda launch (K={k} N={n} {what}, {tile})")
