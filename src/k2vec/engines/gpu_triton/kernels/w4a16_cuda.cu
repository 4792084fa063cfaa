// Dense W4A16 GEMM on the tensor cores, y[M, N] = x[M, K] @ W^T for bf16 x (M <= 8 * MT), INT4 codes with
// group-32 scales (bf16 or float32), float32 accumulation; compiled at run time by NVRTC (w4a16_cuda.py), sm_90
// (sm_90a where x is multicast).
//
// Why CUDA and not Triton: a K step here is one 16-byte load of codes per lane, issued PF steps ahead into
// registers, and a split-K partial is summed through the shared memory of a thread block cluster, never through
// global memory; Triton's tl can express neither (bench/RESULTS.md, issue 27).
//
// The weight is the load-time copy w4a16_cuda.cuda_order_copy makes: per 16-row tile T and 64-wide K step kb,
// 32 lanes x 16 bytes. Lane (g, t) = (lane / 4, lane % 4) holds four words: rows g and g + 8 of the tile, for the
// step's two groups of 32. In the mma.m16n8k16 of K sub-step j = 2 h + jj (group h, jj 0..1) the tile's rows are the
// A operand and x's rows the B operand; A-slot c (0..15) of sub-step j stands for K element 32 h + 8 (c % 8 / 2)
// + 4 jj + 2 (c / 8) + c % 2, so lane t's B operands of a group's two sub-steps are x[32 h + 8 t .. + 7], one
// 16-byte read, and each sub-step lies in one group: its product is scaled once, in float32, per row. Word nibbles p
// and p + 4 are the (lower, upper) halves of one A register, so a register is one shift and one lop3 from the codes,
// then (128 + q) - 136 = q - 8 exactly in bf16.
//
// Compile-time constants (w4a16_cuda.py defines them): NWN warps along N, TPW 16-row tiles per warp (each B operand
// read from shared memory serves TPW MMAs), NWK warps along K in a block, CL blocks along K in a cluster, STEPS K steps
// of 64 per warp, MT m8 tiles of x's rows, XROWS of them in shared memory (MT * 8, or 1, 2 or 4 for M up to that: the
// other columns of B read those rows again, and their outputs are dropped), PF steps of codes in flight, CH steps of x
// per copy to shared memory; NXR 0: a K warp group's whole slice of x in shared memory, else a ring of NXR (>= 2)
// chunks of it, each refilled with a later chunk once the group's warps are past it; RING 1: codes and scales in flight
// through shared memory rather than registers (below); MINB blocks per SM the registers are budgeted for
// (__launch_bounds__); SF32 1 for float32 scales (else bf16); FOLD 1: each weight is scaled before the MMA, (q - 8) * s
// rounded to bf16 as the Triton tiles do, so that the MMAs accumulate in place (no per-group product to scale: half the
// accumulator registers and no FMAs per x row, which at 32-64 rows of x outweighs the rounding's cost). XMC > 1 (NXR 0
// only): the cluster also spans XMC blocks along N, which share x: each copies every XMC-th row of its K slice with one
// bulk copy per row and chunk, multicast into the same place in all XMC blocks' shared memory, and a chunk's mbarrier
// (its bytes of all M rows expected) says when it has landed, so that the blocks read x from L2 once per cluster rather
// than once per block.
//
// MOE 1: the fused MoE's gate/up launch, one (token, expert) pair per blockIdx.z: x's row is pair / TOPK, the expert
// ids[pair] (int64 where IDS64, else int32), which picks the weight, the experts' copies stacked (N rows each), each
// expert's gate and up rows interleaved in 16-row tiles (w4a16_cuda.gate_up_order_copy), so that a block holds both
// halves of its outputs; y is h [pairs, N / 2] = silu(gate) * up in bf16 (OUT_PLANES: column c at (c % 8) N / 16 +
// c / 8, the down launch's plane-major x). The routing comes from the kernel before: the weights wait for it.
// MOE 2: the down launch, one token per blockIdx.z: x is its TOPK rows of h side by side (K = TOPK times an expert's
// K), each K warp group's slice within one pair, whose expert ids[pair] picks the weight (the experts' copies
// stacked) and whose routing weight route_w[pair] scales the group's sum, so that the cluster's sum in K's order is
// the token's weighted sum over its pairs, in pair order; y [tokens, N].

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

struct alignas(16) Codes { u32 g0, h0, g1, h1; };   // rows g / g + 8 ("h"), groups 0 / 1 of the step
#if SF32
struct alignas(16) Scales { float g0, h0, g1, h1; };  // rows g / g + 8, groups 0 / 1
#else
struct alignas(8) Scales { u32 grp0, grp1; };        // bf16 pairs (row g, row g + 8) per group
#endif
struct alignas(16) XQuad { u32 b[4]; };              // x[k .. k + 7]: B operands (b[2 jj], b[2 jj + 1]) of sub-step jj

#define NT (NWN * NWK * 32)
#define N_CTA (16 * NWN * TPW)
#define KC (NWK * STEPS * 64)        // K elements of one block
#define XSW (STEPS * 64 + 32)        // x row stride in a K warp group's slice (bf16): +64 bytes, so that a quarter
                                     // warp's 16-byte reads (rows g, g + 1, 4 lanes each) cover all 32 banks once
#define XCW (CH * 64 + 32)           // NXR: x row stride in a chunk's slot
#if NXR
#define X_BYTES (NWK * NXR * XROWS * XCW * 2)
#else
#define X_BYTES (NWK * XROWS * XSW * 2)
#endif
#define MROWS (MT * 8)
#if XROWS != MROWS && (MT != 1 || (XROWS != 1 && XROWS != 2 && XROWS != 4))
#error "x's rows in shared memory: all of its m8 tiles', or 1, 2 or 4 (lane group g reads row g % XROWS)"
#endif
#define NCH ((STEPS + CH - 1) / CH)  // chunks of x per K warp group
#define RS (PF + 1)                  // RING: slots per warp
#define CLUSTER (CL * XMC)           // blocks in a cluster: CL along K (blockIdx.x), XMC along N
#if XMC > 1 && NXR
#error "x multicast (XMC > 1) needs x's whole slice in shared memory (NXR 0)"
#endif
#define BAR_BYTES (XMC > 1 ? (NWK * NCH * 8 + 127) / 128 * 128 : 0)   // XMC: the chunks' mbarriers, ahead of x
#if MOE == 1 && (N_CTA % 32 || N_CTA / 2 % CL)
#error "the MoE gate/up launch needs whole gate/up tile pairs in every block's share of its outputs"
#endif
#if MOE && XMC > 1
#error "the MoE launches take one row of x per block: nothing to multicast"
#endif

__device__ __forceinline__ Codes load_codes(const Codes* p) {
    Codes c;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(c.g0), "=r"(c.h0), "=r"(c.g1), "=r"(c.h1) : "l"(p));
    return c;
}

__device__ __forceinline__ Scales load_scales(const Scales* p) {
    Scales s;
#if SF32
    asm volatile("ld.global.nc.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(s.g0), "=f"(s.h0), "=f"(s.g1), "=f"(s.h1)
                 : "l"(p));
#else
    asm volatile("ld.global.nc.v2.u32 {%0, %1}, [%2];" : "=r"(s.grp0), "=r"(s.grp1) : "l"(p));
#endif
    return s;
}

__device__ __forceinline__ u32 shared_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

__device__ __forceinline__ float lo_bf16(u32 v) { return __int_as_float(int(v << 16)); }
__device__ __forceinline__ float hi_bf16(u32 v) { return __int_as_float(int(v & 0xffff0000u)); }

// nibbles p and p + 4 of w as a bf16 pair (q - 8): lower half nibble p
__device__ __forceinline__ u32 code_pair(u32 w, int p) {
    u32 t = ((w >> (4 * p)) & 0x000f000fu) | 0x43004300u;
    u32 r;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(t), "r"(0x3f803f80u), "r"(0xc308c308u));
    return r;
}

#if FOLD
__device__ __forceinline__ u32 mul_bf16x2(u32 a, u32 b) {
    u32 r;
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

// one row's scale as a bf16 pair for both halves of an A register
__device__ __forceinline__ u32 scale_pair(float s) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %1;" : "=r"(r) : "f"(s));
    return r;
}
#endif

// cp.async.wait_group takes an immediate: at most `pending` of this thread's groups still in flight (more than 63:
// wait for 63, which waits longer than needed and stays correct); the K loop is unrolled, so the switch folds
#define WAIT_CASE(n) case n: asm volatile("cp.async.wait_group " #n ";" ::: "memory"); break;
#define WAIT_CASES10(a) WAIT_CASE(a##0) WAIT_CASE(a##1) WAIT_CASE(a##2) WAIT_CASE(a##3) WAIT_CASE(a##4) \
    WAIT_CASE(a##5) WAIT_CASE(a##6) WAIT_CASE(a##7) WAIT_CASE(a##8) WAIT_CASE(a##9)
__device__ __forceinline__ void cp_async_wait(int pending) {
    switch (pending) {
    WAIT_CASE(0) WAIT_CASE(1) WAIT_CASE(2) WAIT_CASE(3) WAIT_CASE(4) WAIT_CASE(5) WAIT_CASE(6) WAIT_CASE(7)
    WAIT_CASE(8) WAIT_CASE(9) WAIT_CASES10(1) WAIT_CASES10(2) WAIT_CASES10(3) WAIT_CASES10(4) WAIT_CASES10(5)
    WAIT_CASE(60) WAIT_CASE(61) WAIT_CASE(62)
    default: asm volatile("cp.async.wait_group 63;" ::: "memory"); break;
    }
}

__device__ __forceinline__ constexpr int imin(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ constexpr int chunk_steps(int ch) { return imin(CH, STEPS - ch * CH); }   // the last: short
__device__ __forceinline__ constexpr int imax(int a, int b) { return a > b ? a : b; }

// chunk ch of a K warp group's slice of x (its live rows) to dst, row stride `stride`, by the group's NWN warps; one
// cp.async group
__device__ __forceinline__ void copy_x(u16* dst, int stride, const u16* __restrict__ x, int M, int K, int kg0, int ch,
                                       int wn, int lane) {
    const int s0 = ch * CH, per_row = chunk_steps(ch) * 8;   // 16-byte pieces
    for (int p = wn * 32 + lane; p < M * per_row; p += NWN * 32) {
        const int row = p / per_row, piece = p % per_row;
        const u16* src = x + (size_t)row * K + kg0 + s0 * 64 + piece * 8;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"
                     :: "r"(shared_addr(dst + row * stride + piece * 8)), "l"(src) : "memory");
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
}

#if XMC > 1
// XMC: the chunks' mbarriers, [NWK][NCH], each one arrival (its initialising thread's, expecting the chunk's bytes of
// all M rows) and the bulk copies' bytes; a thread per barrier
__device__ __forceinline__ void x_barriers_init(u32 bars, int M) {
    for (int i = threadIdx.x; i < NWK * NCH; i += NT) {
        const int bytes = M * chunk_steps(i % NCH) * 128;
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bars + 8 * i) : "memory");
        asm volatile("{ .reg .b64 st; mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1; }"
                     :: "r"(bars + 8 * i), "r"(bytes) : "memory");
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// a K warp group's share of x's rows (rows rn, rn + XMC, ... of its slice, chunk by chunk), each row's chunk one bulk
// copy multicast to the cluster's blocks at this K place (ranks kblock + CL j); the group's threads issue them
__device__ __forceinline__ void multicast_x(u16* xg, const u16* __restrict__ x, int M, int K, int kg0, u32 bars,
                                            int kblock, int rn, int wn, int lane) {
    u32 mask = 0;
#pragma unroll
    for (int j = 0; j < XMC; ++j) mask |= 1u << (kblock + CL * j);
    const int mine = rn < M ? (M - rn + XMC - 1) / XMC : 0;
    for (int p = wn * 32 + lane; p < mine * NCH; p += NWN * 32) {
        const int ch = p / mine, row = rn + XMC * (p % mine), s0 = ch * CH;
        const int bytes = chunk_steps(ch) * 128;
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster "
                     "[%0], [%1], %2, [%3], %4;"
                     :: "r"(shared_addr(xg + row * XSW + s0 * 64)), "l"(x + (size_t)row * K + kg0 + s0 * 64),
                        "r"(bytes), "r"(bars + 8 * ch), "h"((u16)mask) : "memory");
    }
}

// until the mbarrier's first phase has completed (its chunk of x landed, and is visible to this thread); the loop in
// one asm block, its label local to the braces (a C++ loop around try_wait took 3 more registers at 7168->2048 M = 16)
__device__ __forceinline__ void x_wait(u32 bar) {
    asm volatile("{\n .reg .pred p;\n WAIT:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], 0;\n @!p bra WAIT;\n}"
                 :: "r"(bar) : "memory");
}
#endif

#if NXR
// The cp.async groups in commit order: (RING) steps 0 .. PF - 1; chunks 0 .. NXR - 1 of x; then per step s, (RING)
// step s + PF, and at the start of chunk c >= 1 (after the group's barrier) chunk c - 1 + NXR into chunk c - 1's slot.
__device__ __forceinline__ constexpr int ring_at(int s) { return RING && s + PF < STEPS ? 1 : 0; }
__device__ __forceinline__ constexpr int groups_before(int s) {     // committed by steps 0 .. s - 1
    return (RING ? imin(s, STEPS - PF) : 0) + imax(0, imin((s + CH - 1) / CH - 1, NCH - NXR));
}
// groups that may stay in flight at step s's wait: those committed after the later of its codes and its x chunk
__device__ __forceinline__ constexpr int pending_at(int s) {
    const int base = (RING ? PF : 0) + NXR, c = s / CH, refilled = (c - NXR + 1) * CH;
    const int need_x = c < NXR ? (RING ? PF : 0) + c : base + groups_before(refilled) + ring_at(refilled);
    const int need_c = !RING ? 0 : s < PF ? s : base + groups_before(s - PF);
    return base + groups_before(s) + ring_at(s) - 1 - imax(need_x, need_c);
}
#endif

#if RING
// one step of a tile into a slot of the warp's ring: each lane its own 16 bytes of codes, lane (g, 0) the scales
// of lane group g
__device__ __forceinline__ void copy_step(Codes* cdst, const Codes* csrc, Scales* sdst, const Scales* ssrc, int t) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(shared_addr(cdst)), "l"(csrc) : "memory");
    if (t == 0) {
#if SF32
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(shared_addr(sdst)), "l"(ssrc) : "memory");
#else
        asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" :: "r"(shared_addr(sdst)), "l"(ssrc) : "memory");
#endif
    }
}
#endif

// partial sum `at` of the block of cluster rank r + CL (blockIdx.y % XMC) (its peer along K), or of this block
__device__ __forceinline__ float partial(const float* part, u32 part0, int at, int r) {
#if CL > 1
    u32 remote;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
                 : "=r"(remote) : "r"(part0 + at * 4), "r"(r + CL * (int)(blockIdx.y % XMC)));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
    return v;
#else
    return part[at];
#endif
}

__device__ __forceinline__ void mma(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1, const float* c) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%10, %11, %12, %13};"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}

extern "C" __global__ void __launch_bounds__(NT, MINB)
w4a16_mma(const u16* __restrict__ x, const Codes* __restrict__ codes, const Scales* __restrict__ scales,
          u16* __restrict__ y, int M, int N, int K, const void* __restrict__ ids, const float* __restrict__ route_w) {
    extern __shared__ __attribute__((aligned(128))) unsigned char smem_all[];
    unsigned char* smem = smem_all + BAR_BYTES;                  // XMC: the mbarriers first
    u16* xs = reinterpret_cast<u16*>(smem);                      // [NWK][XROWS][XSW], NXR: [NWK][NXR][XROWS][XCW]
    float* part = reinterpret_cast<float*>(smem + X_BYTES);      // [NWK][MROWS][N_CTA]

    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane / 4, t = lane % 4;
    const int wn = warp % NWN, wk = warp / NWN;
    const int kblock = blockIdx.x;                 // the block's place along K (its rank in the cluster)
    const int tile = (blockIdx.y * NWN + wn) * TPW;    // the warp's first 16-row tile
#if MOE == 2
    const int ksteps = K / TOPK / 64;              // one expert's steps (K: the token's TOPK rows of h side by side)
    const int step0 = (kblock * NWK + wk) * STEPS % ksteps;
#else
    const int ksteps = K / 64;
    const int step0 = (kblock * NWK + wk) * STEPS;
#endif
#if MOE == 1
    // the routing and x may come from the kernel just before (PDL): wait before reading either, and so before the
    // weights, which the routing picks
    asm volatile("griddepcontrol.wait;" ::: "memory");
    const int pair = blockIdx.z;
    x += (size_t)(pair / TOPK) * K;
#elif MOE == 2
    // the down launch, token blockIdx.z: the K warp group's slice lies in one pair (w4a16_cuda's fits_down), whose
    // expert's weight it reads, its sum scaled by the pair's routing weight. The routing was complete before the
    // gate/up launch this one follows began (that launch read it after its own wait), so it is read before this
    // kernel's wait and the weights stream from the start, as the Triton down launch's ROUTED; x (h) after the wait
    const int pair = blockIdx.z * TOPK + (kblock * NWK + wk) * STEPS / ksteps;
    x += (size_t)blockIdx.z * K;
    y += (size_t)blockIdx.z * N;
#endif
#if MOE
#if IDS64
    const long long expert = static_cast<const long long*>(ids)[pair];
#else
    const long long expert = static_cast<const int*>(ids)[pair];
#endif
    codes += (size_t)expert * (N / 16) * ksteps * 32;
    scales += (size_t)expert * (N / 16) * ksteps * 8;
#endif

    // the weight stream first: PF steps of codes and scales in flight before anything else waits (tile u of the
    // warp is ksteps steps further on)
    const Codes* cp = codes + ((size_t)tile * ksteps + step0) * 32 + lane;
    const Scales* sp = scales + ((size_t)tile * ksteps + step0) * 8 + g;
#if RING
    // RING: the steps in flight land in the warp's ring of RS slots, step s in slot s % RS, one cp.async group per
    // step: a lane reads back its own codes (cp.async.wait_group orders them for it) and its lane group's scales,
    // copied by lane (g, 0) (a __syncwarp after the wait shows them to the others). Groups in commit order: steps
    // 0 .. PF - 1, then x's NCH chunks, then one per refill (step s + PF, issued at step s)
    unsigned char* ring = smem + X_BYTES + NWK * MROWS * N_CTA * 4;
    Codes* rc = reinterpret_cast<Codes*>(ring) + (size_t)warp * RS * TPW * 32 + lane;      // [warp][RS][TPW][32]
    Scales* rsc = reinterpret_cast<Scales*>(ring + NWN * NWK * RS * TPW * 32 * 16)         // [warp][RS][TPW][8]
                  + (size_t)warp * RS * TPW * 8 + g;
#pragma unroll
    for (int s = 0; s < PF; ++s) {
#pragma unroll
        for (int u = 0; u < TPW; ++u)
            copy_step(rc + (s * TPW + u) * 32, cp + ((size_t)u * ksteps + s) * 32, rsc + (s * TPW + u) * 8,
                      sp + ((size_t)u * ksteps + s) * 8, t);
        asm volatile("cp.async.commit_group;" ::: "memory");
    }
#else
    Codes cw[PF][TPW];
    Scales sw[PF][TPW];
#pragma unroll
    for (int s = 0; s < PF; ++s) {
#pragma unroll
        for (int u = 0; u < TPW; ++u) {
            cw[s][u] = load_codes(cp + ((size_t)u * ksteps + s) * 32);
            sw[s][u] = load_scales(sp + ((size_t)u * ksteps + s) * 8);
        }
    }
#endif

#if XMC > 1
    // the mbarriers initialised in every block of the cluster before any block's copies signal them
    const u32 xbars = shared_addr(smem_all) + 8 * wk * NCH;
    x_barriers_init(shared_addr(smem_all), M);
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif

    // x may be the previous kernel's output: wait for it (PDL; MOE 1 waited above). Each K warp group (the NWN warps of
    // one wk) copies the live rows of its own K slice to shared memory in chunks of CH steps, one cp.async group each
    // (all of them, or with NXR the first NXR into the ring's slots), and starts on a chunk as soon as it has landed
    // (rows past M are never read into the live outputs: left unwritten)
#if MOE != 1
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    const int kg0 = kblock * KC + wk * STEPS * 64;
#if NXR
    u16* xg = xs + wk * NXR * XROWS * XCW;
#pragma unroll
    for (int ch = 0; ch < NXR; ++ch) copy_x(xg + ch * XROWS * XCW, XCW, x, M, K, kg0, ch, wn, lane);
#elif XMC > 1
    u16* xg = xs + wk * XROWS * XSW;
    multicast_x(xg, x, M, K, kg0, xbars, kblock, blockIdx.y % XMC, wn, lane);
#else
    u16* xg = xs + wk * XROWS * XSW;
#pragma unroll
    for (int ch = 0; ch < NCH; ++ch) copy_x(xg + ch * CH * 64, XSW, x, M, K, kg0, ch, wn, lane);
#endif

    float acc[TPW][MT][4];
#pragma unroll
    for (int u = 0; u < TPW; ++u)
#pragma unroll
        for (int m = 0; m < MT; ++m) acc[u][m][0] = acc[u][m][1] = acc[u][m][2] = acc[u][m][3] = 0.0f;
#if !FOLD
    const float zero[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#endif
#if NXR
    const u16* xw = xg + g % XROWS * XCW + 8 * t;    // XROWS < 8: lane groups read rows again (their outputs dropped)
#else
    const u16* xw = xg + g % XROWS * XSW + 8 * t;
#endif

#pragma unroll
    for (int s = 0; s < STEPS; ++s) {
#if RING
        if (s + PF < STEPS) {                      // step s + PF into the slot every lane read at step s - 1
            __syncwarp();
#pragma unroll
            for (int u = 0; u < TPW; ++u)
                copy_step(rc + (((s + PF) % RS) * TPW + u) * 32, cp + ((size_t)u * ksteps + s + PF) * 32,
                          rsc + (((s + PF) % RS) * TPW + u) * 8, sp + ((size_t)u * ksteps + s + PF) * 8, t);
            asm volatile("cp.async.commit_group;" ::: "memory");
        }
        {   // step s landed, and x's chunk of it: the groups committed after the later of the two may stay pending
            const int refills = s + 1 < STEPS - PF ? s + 1 : STEPS - PF;
#if NXR
            cp_async_wait(pending_at(s));
#elif XMC > 1
            cp_async_wait(PF + refills - s - 1);   // x is not in the groups: step s's codes only
#else
            cp_async_wait(s < PF ? NCH - 1 - s / CH + refills : refills - (s - PF) - 1);
#endif
        }
#if XMC > 1
        if (s % CH == 0) x_wait(xbars + 8 * (s / CH));
        __syncwarp();                              // the scales lane (g, 0) copied
#else
        if (s % CH == 0 && NWN > 1)                // x's chunk landed for every lane of the K warp group
            asm volatile("bar.sync %0, %1;" :: "r"(1 + wk), "r"(NWN * 32) : "memory");
        else
            __syncwarp();                          // the scales lane (g, 0) copied
#endif
#else
#if XMC > 1
        if (s % CH == 0) x_wait(xbars + 8 * (s / CH));
#else
        if (s % CH == 0) {                         // this chunk of x landed, for every lane of the group
#if NXR
            cp_async_wait(pending_at(s));
#else
            cp_async_wait(NCH - 1 - s / CH);
#endif
            if (NWN == 1) __syncwarp();
            else asm volatile("bar.sync %0, %1;" :: "r"(1 + wk), "r"(NWN * 32) : "memory");
        }
#endif
#endif
#if NXR
        if (s % CH == 0 && s >= CH && s / CH - 1 + NXR < NCH)   // every warp of the group is past chunk c - 1: its slot
            copy_x(xg + ((s / CH - 1) % NXR) * XROWS * XCW, XCW, x, M, K, kg0, s / CH - 1 + NXR, wn, lane);
#endif
        Codes c[TPW];
        Scales sc[TPW];
#pragma unroll
        for (int u = 0; u < TPW; ++u) {
#if RING
            c[u] = rc[((s % RS) * TPW + u) * 32];
            sc[u] = rsc[((s % RS) * TPW + u) * 8];
#else
            c[u] = cw[s % PF][u];
            sc[u] = sw[s % PF][u];
            if (s + PF < STEPS) {
                cw[s % PF][u] = load_codes(cp + ((size_t)u * ksteps + s + PF) * 32);
                sw[s % PF][u] = load_scales(sp + ((size_t)u * ksteps + s + PF) * 8);
            }
#endif
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {              // the step's two groups
            float s_g[TPW], s_h[TPW];              // the group's scales of rows g and g + 8
#pragma unroll
            for (int u = 0; u < TPW; ++u) {
#if SF32
                s_g[u] = h ? sc[u].g1 : sc[u].g0, s_h[u] = h ? sc[u].h1 : sc[u].h0;
#else
                const u32 sbits = h ? sc[u].grp1 : sc[u].grp0;
                s_g[u] = lo_bf16(sbits), s_h[u] = hi_bf16(sbits);
#endif
            }
#if FOLD
            u32 f_g[TPW], f_h[TPW];
#pragma unroll
            for (int u = 0; u < TPW; ++u) f_g[u] = scale_pair(s_g[u]), f_h[u] = scale_pair(s_h[u]);
#else
            float part_acc[TPW][MT][4];
#endif
            u32 a[TPW][2][4];                      // the A registers of the group's two sub-steps
#pragma unroll
            for (int u = 0; u < TPW; ++u) {
                const u32 rg = h ? c[u].g1 : c[u].g0, rh = h ? c[u].h1 : c[u].h0;
#pragma unroll
                for (int jj = 0; jj < 2; ++jj) {
                    a[u][jj][0] = code_pair(rg, 2 * jj), a[u][jj][1] = code_pair(rh, 2 * jj);
                    a[u][jj][2] = code_pair(rg, 2 * jj + 1), a[u][jj][3] = code_pair(rh, 2 * jj + 1);
#if FOLD
                    a[u][jj][0] = mul_bf16x2(a[u][jj][0], f_g[u]), a[u][jj][1] = mul_bf16x2(a[u][jj][1], f_h[u]);
                    a[u][jj][2] = mul_bf16x2(a[u][jj][2], f_g[u]), a[u][jj][3] = mul_bf16x2(a[u][jj][3], f_h[u]);
#endif
                }
            }
#pragma unroll
            for (int m = 0; m < MT; ++m) {
#if NXR
                const XQuad b = *reinterpret_cast<const XQuad*>(xw + ((s / CH) % NXR) * XROWS * XCW + m * 8 * XCW
                                                               + (s % CH) * 64 + 32 * h);
#else
                const XQuad b = *reinterpret_cast<const XQuad*>(xw + m * 8 * XSW + s * 64 + 32 * h);
#endif
#pragma unroll
                for (int jj = 0; jj < 2; ++jj)     // two K sub-steps of 16 per group
#pragma unroll
                    for (int u = 0; u < TPW; ++u)
#if FOLD
                        mma(acc[u][m], a[u][jj][0], a[u][jj][1], a[u][jj][2], a[u][jj][3], b.b[2 * jj],
                            b.b[2 * jj + 1], acc[u][m]);
#else
                        mma(part_acc[u][m], a[u][jj][0], a[u][jj][1], a[u][jj][2], a[u][jj][3], b.b[2 * jj],
                            b.b[2 * jj + 1], jj ? part_acc[u][m] : zero);
#endif
            }
#if !FOLD
#pragma unroll
            for (int u = 0; u < TPW; ++u) {
#pragma unroll
                for (int m = 0; m < MT; ++m) {
                    acc[u][m][0] += part_acc[u][m][0] * s_g[u];
                    acc[u][m][1] += part_acc[u][m][1] * s_g[u];
                    acc[u][m][2] += part_acc[u][m][2] * s_h[u];
                    acc[u][m][3] += part_acc[u][m][3] * s_h[u];
                }
            }
#endif
        }
    }
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#if MOE == 2
    {
        const float w = route_w[pair];
#pragma unroll
        for (int u = 0; u < TPW; ++u)
#pragma unroll
            for (int m = 0; m < MT; ++m) acc[u][m][0] *= w, acc[u][m][1] *= w, acc[u][m][2] *= w, acc[u][m][3] *= w;
    }
#endif

    // the warp's partial: d0, d1 at (row g, x rows 2t, 2t + 1), d2, d3 at row g + 8 of each of its tiles
#pragma unroll
    for (int u = 0; u < TPW; ++u)
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            float* p = part + (wk * MROWS + m * 8 + 2 * t) * N_CTA + (wn * TPW + u) * 16 + g;
            p[0] = acc[u][m][0];
            p[N_CTA] = acc[u][m][1];
            p[8] = acc[u][m][2];
            p[N_CTA + 8] = acc[u][m][3];
        }
#if CL > 1
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#else
    __syncthreads();
#endif

    // block `kblock` sums its share of the tile's rows over the cluster's blocks and its own K warps, in K's order,
    // so that the result does not depend on timing
#if CL > 1
    const u32 part0 = shared_addr(part);
#else
    const u32 part0 = 0;
#endif
#if MOE == 1
    // gate/up: output q of the block's share [kblock, kblock + 1) * N_CTA / 2 / CL is the pair of gate row
    // 32 (q / 16) + q % 16 and the up row 16 on (the interleaved tiles): h column blockIdx.y * N_CTA / 2 + q of the
    // pair's row of h, silu(gate) * up; one row of x
    const int per = N_CTA / 2 / CL;
    for (int e = threadIdx.x; e < per; e += NT) {
        const int q = kblock * per + e, row = 32 * (q / 16) + q % 16;
        float gate = 0.0f, up = 0.0f;
#pragma unroll
        for (int r = 0; r < CL; ++r) {
#pragma unroll
            for (int w = 0; w < NWK; ++w) {
                gate += partial(part, part0, w * MROWS * N_CTA + row, r);
                up += partial(part, part0, w * MROWS * N_CTA + row + 16, r);
            }
        }
        const float h = gate / (1.0f + __expf(-gate)) * up;
        const int col = blockIdx.y * (N_CTA / 2) + q;
#if OUT_PLANES
        const int at = col % 8 * (N / 16) + col / 8;
#else
        const int at = col;
#endif
        u16 out;
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(out) : "f"(h));
        y[(size_t)pair * (N / 2) + at] = out;
    }
#else
    // rows [kblock, kblock + 1) * N_CTA / CL
    const int per = N_CTA / CL;
    for (int e = threadIdx.x; e < per * MROWS; e += NT) {
        const int m = e / per, n = kblock * per + e % per;
        if (m >= M) continue;
        float sum = 0.0f;
#pragma unroll
        for (int r = 0; r < CL; ++r) {
#pragma unroll
            for (int w = 0; w < NWK; ++w) sum += partial(part, part0, (w * MROWS + m) * N_CTA + n, r);
        }
        u16 out;
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(out) : "f"(sum));
        y[(size_t)m * N + (size_t)blockIdx.y * N_CTA + n] = out;
    }
#endif
#if CLUSTER > 1
    // the other blocks read this block's partials (CL), or copy x into it (XMC): stay until they have
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}
