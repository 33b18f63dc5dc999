// Window close of a LeapQuant pool in CUDA C++: the same arithmetic as close.py's close_kernel (and
// naive.close_ref), written with explicit data placement and the state's products on tensor cores.  Built at
// run time by NVRTC (close_cuda.py) with the pool's shape as macros:
//
//   LQ_P window, LQ_R compensator tokens (0..8), LQ_ITERS power iterations, LQ_RESIDUAL 2 (int8 bytes:
//   int8, int6), 3 (fp8 e4m3) or 4 (packed int4), LQ_SMOOTH, LQ_VECTOR_DECAY (KDA), LQ_REC16 (fp16 records),
//   LQ_LS (least-squares channel scales, +ls: integer residuals), LQ_PREFETCH (stage the next head's inputs in
//   shared memory while this one closes: close_cuda.prefetches decides, from the shared memory of an SM),
//   LQ_DROP (the fraction of its norm under which a fit column is dropped as rounding noise).
//
// One 256-thread block per closing head holds the whole state S [V, K] = [128, 128] in registers, 64 entries
// a thread, laid out as the accumulators of m16n8k8 tensor-core products (mma.sync, tf32): warp w owns key
// columns 16w .. 16w+15 of every value row, and lane (g, t) = (lane / 4, lane % 4) holds rows 16m + g and
// 16m + g + 8 (m = 0..7) of columns 16w + 4t .. 16w + 4t + 3.  So, with no data moved between layouts:
//
// * the rebuild S = scale C col + [Tu | vals] [Tk; keys] (tokens and records, rank R + P) is a product
//   accumulated onto the dequantized codes; its inexact operand is split into tf32 halves (GDN: the values
//   times their decays, against the fp16 keys; KDA: the decayed keys, against the fp16 values), so it is
//   fp32-accurate as close.py's is;
// * the fit's U = S Q uses the registers as the A operand of the same product (k-steps over this warp's 16
//   columns, both operands split: three products), partial over the warps, summed in shared memory;
//   Z = S^T basis sums along the values, which within a warp is a sum over its 8 lanes g, and needs no
//   other warp: each warp owns its columns;
// * the token subtraction S - U16 Q16^T is one exact product (fp16 operands are exact in tf32);
// * the smoothing sums (along the values) are shuffles within a warp, the channel maxima and least-squares
//   sums (along the keys) shuffles and one pass through shared memory over the 8 warps.
//
// Persistent: block b closes list entries b, b + gridDim.x, ... (the step kernel wrote the list).  With
// LQ_PREFETCH the inputs of a block's next head (codes, scales, records, tokens) are copied into a staging
// area by cp.async while the present head closes, so that only the first head of a block waits for global
// memory; without it each head loads its own at the start.  Staged codes have the 16-byte pieces of each row
// XOR-swizzled by the row, so that the loads of a warp's 8 rows g fall on distinct banks.

#if !defined(LQ_P) || !defined(LQ_R) || !defined(LQ_ITERS) || !defined(LQ_RESIDUAL) || !defined(LQ_SMOOTH) || \
    !defined(LQ_VECTOR_DECAY) || !defined(LQ_REC16) || !defined(LQ_LS) || !defined(LQ_PREFETCH) || !defined(LQ_DROP)
#error "close.cu is built by close_cuda.py, which defines LQ_P, LQ_R, LQ_ITERS, LQ_RESIDUAL, LQ_SMOOTH, ..."
#endif
#define K 128
#define V 128
#define NT 256
#define P LQ_P
#define R LQ_R
#define RG (R < 4 ? R : 4)                 // tokens per group of the fit's Z (registers: 4 x RG sums)
#define RGP (RG == 3 ? 4 : RG)             // ... padded to a power of two for the reduce-scatter

#if R > 8
#error "at most 8 compensator tokens (and 5 to 7 are not supported: close_cuda.unsupported)"
#endif
// Timing ablations (scripts/close_cuda_ablation.py; the states they leave are wrong): bit 0 leaves out the
// tokens' and records' product of the rebuild, bit 1 the fit, bit 2 the quantization arithmetic, bit 3 the
// fit's Gram-Schmidt.
#ifndef LQ_ABLATE
#define LQ_ABLATE 0
#endif

typedef unsigned short half_bits;

__device__ __forceinline__ float h2f(half_bits h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ half_bits f2h(float f) {
    half_bits h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ float round_f16(float f) { return h2f(f2h(f)); }

#if LQ_REC16
typedef half_bits rec_t;
__device__ __forceinline__ float rec_load(const rec_t* p) { return h2f(*p); }
#else
typedef float rec_t;
__device__ __forceinline__ float rec_load(const rec_t* p) { return *p; }
#endif
// The records' log decays (pool.py): KDA keeps each token's own at the record precision, GDN the fp32
// running sums since the window start.
#if LQ_VECTOR_DECAY
typedef rec_t dec_t;
__device__ __forceinline__ float dec_load(const dec_t* p) { return rec_load(p); }
#else
typedef float dec_t;
__device__ __forceinline__ float dec_load(const dec_t* p) { return *p; }
#endif

// One level of a reduce-scatter over the lanes that differ in bit ``o``: a lane holding N partial sums (or
// maxima) keeps half (the upper half where its bit ``o`` is set) and combines the partner's copy of that
// half; with one left it combines the partner's whole.  ``first`` tracks the index of the values kept.
template <int N, bool MAX>
__device__ __forceinline__ void scatter_level(float* a, int lane, int o, int& first) {
    if (N > 1) {
        const bool upper = (lane & o) != 0;
        #pragma unroll
        for (int t = 0; t < N / 2; ++t) {
            const float recv = __shfl_xor_sync(0xffffffffu, upper ? a[t] : a[N / 2 + t], o);
            const float mine = upper ? a[N / 2 + t] : a[t];
            a[t] = MAX ? fmaxf(mine, recv) : mine + recv;
        }
        first += upper ? N / 2 : 0;
    } else {
        const float recv = __shfl_xor_sync(0xffffffffu, a[0], o);
        a[0] = MAX ? fmaxf(a[0], recv) : a[0] + recv;
    }
}

__device__ __forceinline__ float warp_sum(float x) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

// The +-1 start vectors of methods.compensators.start_vectors (uint32 hash of row and column).
__device__ __forceinline__ float start_vector(unsigned v, unsigned r) {
    unsigned x = v * 0x9E3779B1u + (r + 1u) * 0x85EBCA77u;
    x = (x ^ (x >> 15)) * 0x2C1B3C6Du;
    x = x ^ (x >> 12);
    return (x & 1u) ? 1.0f : -1.0f;
}

#if LQ_RESIDUAL == 3
// fp32 in [-448, 448] -> nearest-even E4M3 value (ops/common.py e4m3_grid, sign of zero kept)
__device__ __forceinline__ float e4m3_grid(float x) {
    unsigned bits = __float_as_uint(x);
    int e = (int)((bits >> 23) & 0xFF) - 127;
    e = max(e, -6) - 3;
    float step = __uint_as_float((unsigned)(e + 127) << 23);
    float inv = __uint_as_float((unsigned)(127 - e) << 23);
    float y = fminf(fmaxf(rintf(x * inv) * step, -448.0f), 448.0f);
    return __uint_as_float(__float_as_uint(y) | (bits & 0x80000000u));
}
// an E4M3 grid value -> its byte (torch.float8_e4m3fn)
__device__ __forceinline__ unsigned e4m3_byte(float y) {
    unsigned b = __float_as_uint(y);
    unsigned s = (b >> 24) & 0x80u;
    float a = fabsf(y);
    if (a == 0.0f) return s;
    int e = (int)((b >> 23) & 0xFF) - 127;
    if (e < -6) return s | (unsigned)(a * 512.0f);  // subnormal: a = m 2^-9
    return s | ((unsigned)(e + 7) << 3) | ((b >> 20) & 7u);
}
__device__ __forceinline__ float e4m3_value(unsigned byte) {
    unsigned e = (byte >> 3) & 0xF, m = byte & 7u;
    float a;
    if (e == 15 && m == 7) a = __int_as_float(0x7fc00000);
    else if (e == 0) a = (float)m * 0.001953125f;  // 2^-9
    else a = __uint_as_float(((e + 120u) << 23) | (m << 20));
    return (byte & 0x80u) ? -a : a;
}
#endif

#if LQ_RESIDUAL == 4
#define ROW_BYTES (K / 2)
#else
#define ROW_BYTES K
#endif
#define CHUNKS (ROW_BYTES / 16)  // 16-byte pieces of a row of codes

// Byte ``b`` of row ``v`` of a head's codes: staged codes (LQ_PREFETCH) have each row's 16-byte pieces
// XOR-swizzled by the row; the pool's own are as stored.
__device__ __forceinline__ int code_offset(int v, int b) {
#if LQ_PREFETCH
    return v * ROW_BYTES + ((((b >> 4) ^ v) & (CHUNKS - 1)) << 4) + (b & 15);
#else
    return v * ROW_BYTES + b;
#endif
}

// The 4 codes of row v at this thread's columns 16w + 4t .. 16w + 4t + 3, as stored (int4: 16 bits).
__device__ __forceinline__ unsigned load_codes(const unsigned char* codes, int v, int warp, int t) {
#if LQ_RESIDUAL == 4
    return *(const unsigned short*)(codes + code_offset(v, 8 * warp + 2 * t));
#else
    return *(const unsigned*)(codes + code_offset(v, 16 * warp + 4 * t));
#endif
}

// Those codes as floats.
__device__ __forceinline__ void decode_codes(unsigned w, float* c) {
    #pragma unroll
    for (int u = 0; u < 4; ++u) {
#if LQ_RESIDUAL == 4
        c[u] = (float)(((int)(w << (28 - 4 * u))) >> 28);
#elif LQ_RESIDUAL == 3
        c[u] = e4m3_value((w >> (8 * u)) & 0xFFu);
#else
        c[u] = (float)(((int)(w << (24 - 8 * u))) >> 24);
#endif
    }
}

// Store 4 codes (integer-valued or E4M3 grid floats) of row v at this thread's columns; ``head``: the closing
// head's payload (head_at).
__device__ __forceinline__ void store_codes(unsigned char* head, int v, int warp, int t, const float* x) {
    unsigned w = 0;
#if LQ_RESIDUAL == 4
    #pragma unroll
    for (int u = 0; u < 4; ++u) w |= ((unsigned)(int)x[u] & 0xFu) << (4 * u);
    *(unsigned short*)(head + v * (K / 2) + 8 * warp + 2 * t) = (unsigned short)w;
#else
    #pragma unroll
    for (int u = 0; u < 4; ++u) {
#if LQ_RESIDUAL == 3
        w |= e4m3_byte(x[u]) << (8 * u);
#else
        w |= ((unsigned)(int)x[u] & 0xFFu) << (8 * u);
#endif
    }
    *(unsigned*)(head + v * K + 16 * warp + 4 * t) = w;
#endif
}

// D += A B on tensor cores, m16n8k8, tf32 operands (the upper 19 bits of each register), fp32 accumulators.
__device__ __forceinline__ void mma_tf32(float& d0, float& d1, float& d2, float& d3, unsigned a0, unsigned a1,
                                         unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3)
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// x = hi + lo with hi exact in tf32 (low 13 mantissa bits cleared) and lo rounded to tf32: a product of the
// halves against an exact operand is fp32-accurate (close.py's _tf32_split).
__device__ __forceinline__ unsigned tf32_hi(float x) { return __float_as_uint(x) & 0xFFFFE000u; }
__device__ __forceinline__ unsigned tf32_lo(float x) {
    unsigned lo;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(lo) : "f"(x - __uint_as_float(tf32_hi(x))));
    return lo;
}

// Row i (0..15) of this thread's state registers is value row 16 (i / 2) + g + 8 (i % 2).
__device__ __forceinline__ int row_of(int i, int g) { return 16 * (i >> 1) + g + 8 * (i & 1); }

#define G_N (P * (1 + (K - 1) * LQ_VECTOR_DECAY))    // log decays a head's records hold: [P] or [P][K]
#define DEC_BYTES (4 - 2 * LQ_REC16 * LQ_VECTOR_DECAY)  // sizeof(dec_t)

// The rebuild's product: ranks 0..R-1 the old tokens, R..R+P-1 the records, in CL_KS k-steps of 8 (zero
// padded).  Its inexact operand is split: GDN's values (times their decays; its keys are fp16), KDA's keys
// (decayed; its values are fp16), both with fp32 records.
#define CL_KS ((R + P + 7) / 8)
#define CL_ASPLIT (1 - LQ_VECTOR_DECAY * LQ_REC16)
#define CL_BSPLIT (1 - (1 - LQ_VECTOR_DECAY) * LQ_REC16)
#define CL_AW (4 + 4 * CL_ASPLIT)  // floats a lane's A fragment takes: 4 tf32 values (hi), and 4 lo if split
#define CL_BW (4 + 4 * CL_BSPLIT)  // and its B fragments of a k-step (two n-tiles of 8 columns)
#define CL_RP (4 + 4 * (R > 4))    // token values a value row holds in shared memory
#define CL_MAX(a, b) ((a) > (b) ? (a) : (b))

// Shared memory, in floats.  The fragments of the rebuild are dead once it is done: the reductions over the
// warps (SM_RED) reuse their space.
#define SM_FA 0                                   // [KS][8 m-tiles][32 lanes][AW] A fragments: values
#define SM_FB (SM_FA + CL_KS * 8 * 32 * CL_AW)    // [KS][8 warps][32 lanes][BW] B fragments: keys
#define SM_RED 0  // [8 warps][V][RP] partial token values; [8][V] channel maxima, [V][4] scales, [8][V][2] +ls
#define SM_SCL (8 * V)                            // within SM_RED: [V][4] channel scale, reciprocal, fast
#define SM_LS (12 * V)                            // within SM_RED: [8 warps][V][2] +ls sums
#define SM_COL CL_MAX(SM_FB + CL_KS * 8 * 32 * CL_BW, CL_MAX(8 * V * CL_RP * (R > 0), 28 * V))  // [K]
#define SM_BASIS (SM_COL + K)                     // [V][RP] the fit's value vectors (start, then tokens)
#define SM_Q (SM_BASIS + V * CL_RP)               // [R][K] the fit's products, then orthonormal keys
// LQ_PREFETCH: the next head's inputs as stored (close_cuda.shared_bytes mirrors this; every region starts
// on 16 bytes for cp.async)
#define SM_STAGE (SM_Q + R * K)
#define SM_ST_CODES SM_STAGE                                                   // [V][K] codes
#define SM_ST_SCALE (SM_ST_CODES + V * K * (8 - 4 * (LQ_RESIDUAL == 4)) / 32)  // [V] channel scales
#define SM_ST_G (SM_ST_SCALE + V)                                  // [G_N] log decays
#define SM_ST_RK (SM_ST_G + (G_N * DEC_BYTES + 15) / 16 * 4)       // [P][K] record keys
#define SM_ST_RU (SM_ST_RK + P * K * (2 - LQ_REC16) / 2)           // [P][V] record values
#define SM_ST_SMOOTH (SM_ST_RU + P * V * (2 - LQ_REC16) / 2)       // [K] smoothing scales
#define SM_ST_CK (SM_ST_SMOOTH + K * LQ_SMOOTH)                    // [R][K] fp16 token keys
#define SM_ST_CU (SM_ST_CK + R * K / 2)                            // [R][V] fp16 token values
#define SM_STAGE_END (SM_ST_CU + R * V / 2)
#define SM_FLOATS (SM_STAGE + LQ_PREFETCH * (SM_STAGE_END - SM_STAGE))

#if LQ_PREFETCH
__device__ __forceinline__ unsigned shared_address(const void* p) {
    unsigned s;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(s) : "l"(p));
    return s;
}
// Asynchronous copy of BYTES from global to shared memory by the whole block, in PIECE-byte pieces (16 where
// the sizes allow: close_cuda.py builds this only for pools whose tensors start on 16 bytes).
template <int BYTES, int PIECE = (BYTES % 16 == 0 ? 16 : 4)>
__device__ __forceinline__ void copy_async(float* dst, const void* src, int tid) {
    static_assert(BYTES % 4 == 0, "the inputs are 4-byte multiples");
    const unsigned s = shared_address(dst);
    const char* g = (const char*)src;
    #pragma unroll
    for (int i = 0; i < (BYTES + NT * PIECE - 1) / (NT * PIECE); ++i) {  // a fixed count: unrolled
        const int o = (i * NT + tid) * PIECE;
        if (BYTES % (NT * PIECE) != 0 && o >= BYTES) break;
        if (PIECE == 16)
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s + o), "l"(g + o) : "memory");
        else
            asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(s + o), "l"(g + o) : "memory");
    }
}
// The same for a head's codes, each row's 16-byte pieces swizzled (code_offset).
__device__ __forceinline__ void copy_codes_async(float* dst, const unsigned char* src, int tid) {
    static_assert(V * CHUNKS % NT == 0, "whole pieces per thread");
    const unsigned s = shared_address(dst);
    #pragma unroll
    for (int i = 0; i < V * CHUNKS / NT; ++i) {
        const int piece = i * NT + tid, v = piece / CHUNKS;
        const int o = code_offset(v, (piece % CHUNKS) * 16);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s + o), "l"(src + piece * 16) : "memory");
    }
}
#endif

// Head i_s of a pool tensor with n elements a head: heads are contiguous within a slot, and slots are
// hv * n + shift elements apart (LeapQuantPool.slot_shift: 0 for a contiguous pool; an engine's page padding,
// the other state tensors of the page included, for a paged one).
template <typename T>
__device__ __forceinline__ T* head_at(T* base, long long i_s, int n, int hv, int shift) {
    return base + i_s * n + (i_s / hv) * (long long)shift;
}

// Store a value of the rebuild's B operand (rank ``rank``, key column ``k``) into its fragment slot: the
// k-step's lane (g, t) of warp k / 16 holds ranks 8 ks + t (b0) and 8 ks + t + 4 (b1) of columns
// 16w + 4 (g / 2) + 2 e + g % 2 of its n-tiles e = 0, 1.
__device__ __forceinline__ void store_b(float* sm, int rank, int k, float x) {
    const int kk = k & 15, g = ((kk >> 2) << 1) | (kk & 1), e = (kk >> 1) & 1;
    float* f = sm + SM_FB + (((rank >> 3) * 8 + (k >> 4)) * 32 + 4 * g + (rank & 3)) * CL_BW + 2 * e + ((rank >> 2) & 1);
#if CL_BSPLIT
    f[0] = __uint_as_float(tf32_hi(x));
    f[4] = __uint_as_float(tf32_lo(x));
#else
    f[0] = x;
#endif
}

// Store a lane's A fragment of the rebuild (4 values: rows g, g + 8 of ranks t, t + 4) into its slots.
__device__ __forceinline__ void store_a(float* f, const float* x) {
#if CL_ASPLIT
    *(float4*)f = make_float4(__uint_as_float(tf32_hi(x[0])), __uint_as_float(tf32_hi(x[1])),
                              __uint_as_float(tf32_hi(x[2])), __uint_as_float(tf32_hi(x[3])));
    *(float4*)(f + 4) = make_float4(__uint_as_float(tf32_lo(x[0])), __uint_as_float(tf32_lo(x[1])),
                                    __uint_as_float(tf32_lo(x[2])), __uint_as_float(tf32_lo(x[3])));
#else
    *(float4*)f = make_float4(x[0], x[1], x[2], x[3]);
#endif
}

extern "C" __global__ void __launch_bounds__(NT, 2) leapquant_close(
    const int* __restrict__ close_list, const int* __restrict__ close_count, unsigned char* payload,
    float* scale_v, float* smooth, half_bits* comp_k, half_bits* comp_u, const dec_t* __restrict__ rec_g,
    const rec_t* __restrict__ rec_k, const rec_t* __restrict__ rec_u, int* pos, double smooth_floor_d,
    double qmax_d, int hv, int sh_payload, int sh_scale, int sh_smooth, int sh_comp_k, int sh_comp_u, int sh_rec_g,
    int sh_rec_k, int sh_rec_u, int sh_pos) {
    extern __shared__ __align__(16) float sm[];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    const float smooth_floor = (float)smooth_floor_d, qmax = (float)qmax_d;
    const int count = *close_count;
    (void)smooth_floor;

#if LQ_PREFETCH
    // a head's inputs, copied into the staging area (one commit group; a block has one in flight)
    auto stage = [&](int head) {
        const long long h = head;
        static_assert(sizeof(dec_t) == DEC_BYTES, "the staging layout's decay size");
        copy_codes_async(sm + SM_ST_CODES, head_at(payload, h, V * ROW_BYTES, hv, sh_payload), tid);
        copy_async<V * 4>(sm + SM_ST_SCALE, head_at(scale_v, h, V, hv, sh_scale), tid);
        copy_async<G_N * DEC_BYTES>(sm + SM_ST_G, head_at(rec_g, h, G_N, hv, sh_rec_g), tid);
        copy_async<P * K * (int)sizeof(rec_t)>(sm + SM_ST_RK, head_at(rec_k, h, P * K, hv, sh_rec_k), tid);
        copy_async<P * V * (int)sizeof(rec_t)>(sm + SM_ST_RU, head_at(rec_u, h, P * V, hv, sh_rec_u), tid);
#if LQ_SMOOTH
        copy_async<K * 4>(sm + SM_ST_SMOOTH, head_at(smooth, h, K, hv, sh_smooth), tid);
#endif
#if R > 0
        copy_async<R * K * 2>(sm + SM_ST_CK, head_at(comp_k, h, R * K, hv, sh_comp_k), tid);
        copy_async<R * V * 2>(sm + SM_ST_CU, head_at(comp_u, h, R * V, hv, sh_comp_u), tid);
#endif
        asm volatile("cp.async.commit_group;" ::: "memory");
    };
    // the list entries one and two heads ahead (-1: none), read a head early so that no copy waits on them
    int i_next = blockIdx.x < count ? close_list[blockIdx.x] : -1;
    if (i_next >= 0) stage(i_next);
    int i_after = blockIdx.x + gridDim.x < count ? close_list[blockIdx.x + gridDim.x] : -1;
#endif

    for (int idx = blockIdx.x; idx < count; idx += gridDim.x) {
#if LQ_PREFETCH
        const long long i_s = i_next;
        i_next = i_after;
        asm volatile("cp.async.wait_all;" ::: "memory");
        __syncthreads();  // every thread's copies have landed
        const unsigned char* in_codes = (const unsigned char*)(sm + SM_ST_CODES);
        const float* in_scale = sm + SM_ST_SCALE;
        const dec_t* in_g = (const dec_t*)(sm + SM_ST_G);
        const rec_t* in_rk = (const rec_t*)(sm + SM_ST_RK);
        const rec_t* in_ru = (const rec_t*)(sm + SM_ST_RU);
        const float* in_smooth = sm + SM_ST_SMOOTH;
        const half_bits* in_ck = (const half_bits*)(sm + SM_ST_CK);
        const half_bits* in_cu = (const half_bits*)(sm + SM_ST_CU);
#else
        const long long i_s = close_list[idx];
        const unsigned char* in_codes = head_at(payload, i_s, V * ROW_BYTES, hv, sh_payload);
        const float* in_scale = head_at(scale_v, i_s, V, hv, sh_scale);
        const dec_t* in_g = head_at(rec_g, i_s, G_N, hv, sh_rec_g);
        const rec_t* in_rk = head_at(rec_k, i_s, P * K, hv, sh_rec_k);
        const rec_t* in_ru = head_at(rec_u, i_s, P * V, hv, sh_rec_u);
        const float* in_smooth = head_at(smooth, i_s, K, hv, sh_smooth);
        const half_bits* in_ck = head_at(comp_k, i_s, R * K, hv, sh_comp_k);
        const half_bits* in_cu = head_at(comp_u, i_s, R * V, hv, sh_comp_u);
#endif
        (void)in_smooth, (void)in_ck, (void)in_cu;
        unsigned char* out_codes = head_at(payload, i_s, V * ROW_BYTES, hv, sh_payload);  // written at the end
        float* out_scale = head_at(scale_v, i_s, V, hv, sh_scale);

        // the codes and channel scales first: (without staging) their loads are in flight while the factors
        // are prepared
        unsigned words[16];
        float sc[16];
        #pragma unroll
        for (int i = 0; i < 16; ++i) {
            words[i] = load_codes(in_codes, row_of(i, g), warp, t);
            sc[i] = in_scale[row_of(i, g)];
        }

        // ---- the head's factors (close.py _window_factors) as the rebuild's fragments ----
#if LQ_VECTOR_DECAY
        // KDA: the decay from record p to the window's end is the sum of the decays after it, summed from the
        // window's end down (the Triton close and naive.py sum the same terms in other orders)
        static_assert(NT >= 2 * K, "a thread per key channel, and as many for the values");
        if (tid < K) {  // key channel tid: its decays, its record keys decayed to the end, its token keys
            float since = 0.f;
            #pragma unroll
            for (int p = P - 1; p >= 0; --p) {
                store_b(sm, R + p, tid, rec_load(in_rk + p * K + tid) * expf(since));
                since += dec_load(in_g + p * K + tid);
            }
            const float end = expf(since);
#if LQ_SMOOTH
            sm[SM_COL + tid] = in_smooth[tid] * end;
#else
            sm[SM_COL + tid] = end;
#endif
            #pragma unroll
            for (int r = 0; r < R; ++r) store_b(sm, r, tid, h2f(in_ck[r * K + tid]) * end);
            #pragma unroll
            for (int rank = R + P; rank < 8 * CL_KS; ++rank) store_b(sm, rank, tid, 0.0f);
        } else {  // the other threads: the record and token values as stored, lane by lane of each m-tile
            for (int blk = tid - K; blk < CL_KS * 8 * 32; blk += NT - K) {
                const int ks = blk >> 8, m = (blk >> 5) & 7, bl = blk & 31;
                float x[4];
                #pragma unroll
                for (int u = 0; u < 4; ++u) {
                    const int v = 16 * m + (bl >> 2) + 8 * (u & 1), rank = 8 * ks + (bl & 3) + 4 * (u >> 1);
                    x[u] = rank < R ? h2f(in_cu[rank * V + v]) : rank < R + P ? rec_load(in_ru + (rank - R) * V + v) : 0.0f;
                }
                store_a(sm + SM_FA + blk * CL_AW, x);
            }
        }
#else  // GDN: the running sums as stored; the decays go with the values (the keys stay exact)
        {
            const float* gs = in_g;
            const float g_end = gs[P - 1];
            const float end = expf(g_end);
            #pragma unroll
            for (int ks = 0; ks < CL_KS; ++ks) {  // fragment (ks, m = warp, lane) of A, (ks, warp, lane) of B
                float x[4], y[4];
                #pragma unroll
                for (int u = 0; u < 4; ++u) {
                    const int v = 16 * warp + g + 8 * (u & 1), rank = 8 * ks + t + 4 * (u >> 1);
                    x[u] = rank < R ? h2f(in_cu[rank * V + v]) * end
                         : rank < R + P ? rec_load(in_ru + (rank - R) * V + v) * expf(g_end - gs[rank - R]) : 0.0f;
                    const int rb = 8 * ks + t + 4 * (u & 1);
                    const int k = 16 * warp + 4 * (g >> 1) + 2 * (u >> 1) + (g & 1);
                    y[u] = rb < R ? h2f(in_ck[rb * K + k]) : rb < R + P ? rec_load(in_rk + (rb - R) * K + k) : 0.0f;
                }
                store_a(sm + SM_FA + ((ks * 8 + warp) * 32 + lane) * CL_AW, x);
                float* fb = sm + SM_FB + ((ks * 8 + warp) * 32 + lane) * CL_BW;
#if CL_BSPLIT
                *(float4*)fb = make_float4(__uint_as_float(tf32_hi(y[0])), __uint_as_float(tf32_hi(y[1])),
                                           __uint_as_float(tf32_hi(y[2])), __uint_as_float(tf32_hi(y[3])));
                *(float4*)(fb + 4) = make_float4(__uint_as_float(tf32_lo(y[0])), __uint_as_float(tf32_lo(y[1])),
                                                 __uint_as_float(tf32_lo(y[2])), __uint_as_float(tf32_lo(y[3])));
#else
                *(float4*)fb = make_float4(y[0], y[1], y[2], y[3]);
#endif
            }
            if (tid < K) {
#if LQ_SMOOTH
                sm[SM_COL + tid] = in_smooth[tid] * end;
#else
                sm[SM_COL + tid] = end;
#endif
            }
        }
#endif
#if R > 0 && !(LQ_ABLATE & 2)
        // the fit's warm start: the previous token values (hashed +-1 where a token is zero)
        if (warp < R) {  // warp r decides whether token r's old values are usable
            float n2 = 0.0f;
            for (int e = lane; e < V; e += 32) {
                const float u = h2f(in_cu[warp * V + e]);
                n2 += u * u;
            }
            const bool usable = sqrtf(warp_sum(n2)) > 1e-30f;
            for (int e = lane; e < V; e += 32)
                sm[SM_BASIS + e * CL_RP + warp] = usable ? h2f(in_cu[warp * V + e]) : start_vector(e, warp);
        }
#endif
        __syncthreads();
#if LQ_PREFETCH
        // the staging area is read (codes and scales in registers, factors prepared): the next head's copies
        if (i_next >= 0) stage(i_next);
#endif

        // ---- the state at the window's end, S = scale C col + [Tu | vals] [Tk; keys], in registers ----
        // s[i][c] = S[row_of(i, g)][16 warp + 4 t + c]; the product's n-tile e of m-tile m accumulates
        // s[2m][2e], s[2m][2e + 1], s[2m + 1][2e], s[2m + 1][2e + 1]
        float s[16][4];
        {
            const float4 cv = *(const float4*)(sm + SM_COL + 16 * warp + 4 * t);
            const float col[4] = {cv.x, cv.y, cv.z, cv.w};
            #pragma unroll
            for (int i = 0; i < 16; ++i) {
                float c[4];
                decode_codes(words[i], c);
                #pragma unroll
                for (int u = 0; u < 4; ++u) s[i][u] = c[u] * sc[i] * col[u];
            }
        }
#if !(LQ_ABLATE & 1)
        for (int ks = 0; ks < CL_KS; ++ks) {
            const float* fb = sm + SM_FB + ((ks * 8 + warp) * 32 + lane) * CL_BW;
            const uint4 bh = *(const uint4*)fb;
#if CL_BSPLIT
            const uint4 bl = *(const uint4*)(fb + 4);
#endif
            #pragma unroll
            for (int m = 0; m < 8; ++m) {
                const float* fa = sm + SM_FA + ((ks * 8 + m) * 32 + lane) * CL_AW;
                const uint4 ah = *(const uint4*)fa;
#if CL_ASPLIT
                const uint4 al = *(const uint4*)(fa + 4);
#endif
                #pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float &d0 = s[2 * m][2 * e], &d1 = s[2 * m][2 * e + 1];
                    float &d2 = s[2 * m + 1][2 * e], &d3 = s[2 * m + 1][2 * e + 1];
                    const unsigned b0 = e ? bh.z : bh.x, b1 = e ? bh.w : bh.y;
#if CL_ASPLIT
                    mma_tf32(d0, d1, d2, d3, al.x, al.y, al.z, al.w, b0, b1);
#endif
#if CL_BSPLIT
                    mma_tf32(d0, d1, d2, d3, ah.x, ah.y, ah.z, ah.w, e ? bl.z : bl.x, e ? bl.w : bl.y);
#endif
                    mma_tf32(d0, d1, d2, d3, ah.x, ah.y, ah.z, ah.w, b0, b1);
                }
            }
        }
#endif

#if R > 0 && !(LQ_ABLATE & 2)
        // ---- the fit ----
        for (int it = 0; it < LQ_ITERS; ++it) {
            // Z = S^T basis [K, R]: this thread's 16 rows, then a reduce-scatter over the warp's 8 lanes g;
            // the warp's columns are its own, so each sum is whole there
            for (int r0 = 0; r0 < R; r0 += RG) {
                float z[4 * RGP];
                #pragma unroll
                for (int q = 0; q < 4 * RGP; ++q) z[q] = 0.0f;
                #pragma unroll
                for (int i = 0; i < 16; ++i) {
                    const float4 b4 = *(const float4*)(sm + SM_BASIS + row_of(i, g) * CL_RP + r0);
                    const float bv[4] = {b4.x, b4.y, b4.z, b4.w};
                    #pragma unroll
                    for (int rr = 0; rr < RG; ++rr)
                        #pragma unroll
                        for (int u = 0; u < 4; ++u) z[rr * 4 + u] = fmaf(s[i][u], bv[rr], z[rr * 4 + u]);
                }
                int first = 0;
                scatter_level<4 * RGP, false>(z, lane, 16, first);
                scatter_level<2 * RGP, false>(z, lane, 8, first);
                scatter_level<RGP, false>(z, lane, 4, first);
                #pragma unroll
                for (int q = 0; q < (RGP > 1 ? RGP / 2 : 1); ++q) {
                    const int rr = (first + q) >> 2, u = (first + q) & 3;
                    if (rr < RG) sm[SM_Q + (r0 + rr) * K + 16 * warp + 4 * t + u] = z[q];
                }
            }
            __syncthreads();
            // Q = orth(Z): modified Gram-Schmidt, as methods.compensators.orthonormalize, right-looking: warp h
            // holds column h; once warp p has normalized q_p, every later column subtracts its projection on
            // q_p at once.  Each column sees the same operations in the same order as in the one-column-at-a-
            // time loop (the same bits), but the dependent chain is 2R - 1 warp sums instead of R(R + 1) / 2.
#if !(LQ_ABLATE & 8)
            {
                // a column left with under LQ_DROP of its norm once the earlier ones are taken out is
                // rounding noise (methods.compensators.DROP_FRACTION) and becomes zero
                float c[4], before = 0.0f;
                if (warp < R) {
                    #pragma unroll
                    for (int q = 0; q < 4; ++q) c[q] = sm[SM_Q + warp * K + lane + 32 * q];
                    #pragma unroll
                    for (int q = 0; q < 4; ++q) before += c[q] * c[q];
                    before = __fsqrt_rn(warp_sum(before));
                }
                #pragma unroll
                for (int p = 0; p < R; ++p) {
                    if (warp == p) {
                        float n2 = 0.0f;
                        #pragma unroll
                        for (int q = 0; q < 4; ++q) n2 += c[q] * c[q];
                        const float norm = __fsqrt_rn(warp_sum(n2));
                        const bool keep = norm > 1e-30f && norm > (float)(LQ_DROP) * before;
                        #pragma unroll
                        for (int q = 0; q < 4; ++q)
                            sm[SM_Q + p * K + lane + 32 * q] = keep ? __fdiv_rn(c[q], fmaxf(norm, 1e-30f)) : 0.0f;
                    }
                    if (p + 1 < R) {
                        __syncthreads();  // q_p is written; every thread meets this barrier
                        if (warp > p && warp < R) {
                            float d = 0.0f;
                            #pragma unroll
                            for (int q = 0; q < 4; ++q) d += sm[SM_Q + p * K + lane + 32 * q] * c[q];
                            d = warp_sum(d);
                            #pragma unroll
                            for (int q = 0; q < 4; ++q) c[q] -= d * sm[SM_Q + p * K + lane + 32 * q];
                        }
                    }
                }
            }
#endif
            __syncthreads();
            // token values U = S Q [V, R]: the state's registers are the A operand (k-step e of this warp:
            // slots t and t + 4 are columns 16 warp + 4t + 2e and + 1), Q the B operand (column g: token g),
            // both split into tf32 halves; partial over this warp's columns, summed over the warps below
            {
                unsigned qh[4], ql[4];
                #pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float2 q2 = make_float2(0.0f, 0.0f);
                    if (g < R) q2 = *(const float2*)(sm + SM_Q + g * K + 16 * warp + 4 * t + 2 * e);
                    qh[2 * e] = tf32_hi(q2.x), qh[2 * e + 1] = tf32_hi(q2.y);
                    ql[2 * e] = tf32_lo(q2.x), ql[2 * e + 1] = tf32_lo(q2.y);
                }
                #pragma unroll
                for (int m = 0; m < 8; ++m) {
                    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                    #pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float a[4] = {s[2 * m][2 * e], s[2 * m + 1][2 * e], s[2 * m][2 * e + 1], s[2 * m + 1][2 * e + 1]};
                        unsigned ah[4], al[4];
                        #pragma unroll
                        for (int u = 0; u < 4; ++u) ah[u] = tf32_hi(a[u]), al[u] = tf32_lo(a[u]);
                        mma_tf32(acc[0], acc[1], acc[2], acc[3], al[0], al[1], al[2], al[3], qh[2 * e], qh[2 * e + 1]);
                        mma_tf32(acc[0], acc[1], acc[2], acc[3], ah[0], ah[1], ah[2], ah[3], ql[2 * e], ql[2 * e + 1]);
                        mma_tf32(acc[0], acc[1], acc[2], acc[3], ah[0], ah[1], ah[2], ah[3], qh[2 * e], qh[2 * e + 1]);
                    }
                    // acc: U[16m + g][2t], [16m + g][2t + 1], [16m + g + 8][2t], [16m + g + 8][2t + 1]
                    if (2 * t < R) {
                        float* red = sm + SM_RED + (warp * V + 16 * m + g) * CL_RP + 2 * t;
                        red[0] = acc[0];
                        red[8 * CL_RP] = acc[2];
                        if (2 * t + 1 < R) red[1] = acc[1], red[8 * CL_RP + 1] = acc[3];
                    }
                }
            }
            __syncthreads();
            for (int e = tid; e < V * CL_RP; e += NT) {
                if (e % CL_RP < R) {
                    float u = 0.0f;
                    #pragma unroll
                    for (int w = 0; w < 8; ++w) u += sm[SM_RED + w * V * CL_RP + e];
                    sm[SM_BASIS + e] = u;
                }
            }
            __syncthreads();
        }
        // residual S - U16 Q16^T (both rounded to fp16, as they are stored): one exact product, ranks t and t + 4
        {
            unsigned qb[4];
            #pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int k = 16 * warp + 4 * (g >> 1) + 2 * e + (g & 1);
                qb[2 * e] = t < R ? __float_as_uint(round_f16(sm[SM_Q + t * K + k])) : 0u;
                qb[2 * e + 1] = t + 4 < R ? __float_as_uint(round_f16(sm[SM_Q + (t + 4) * K + k])) : 0u;
            }
            #pragma unroll
            for (int m = 0; m < 8; ++m) {
                const float* u0 = sm + SM_BASIS + (16 * m + g) * CL_RP;
                const float* u1 = u0 + 8 * CL_RP;
                const unsigned a0 = t < R ? __float_as_uint(-round_f16(u0[t])) : 0u;
                const unsigned a1 = t < R ? __float_as_uint(-round_f16(u1[t])) : 0u;
                const unsigned a2 = t + 4 < R ? __float_as_uint(-round_f16(u0[t + 4])) : 0u;
                const unsigned a3 = t + 4 < R ? __float_as_uint(-round_f16(u1[t + 4])) : 0u;
                #pragma unroll
                for (int e = 0; e < 2; ++e)
                    mma_tf32(s[2 * m][2 * e], s[2 * m][2 * e + 1], s[2 * m + 1][2 * e], s[2 * m + 1][2 * e + 1],
                             a0, a1, a2, a3, qb[2 * e], qb[2 * e + 1]);
            }
        }
#endif

        // ---- smoothing scales c_k = sqrt(mean_v |R_vk|): sums over this thread's rows, then the warp's g ----
#if LQ_SMOOTH
        float cval[4];
        {
            #pragma unroll
            for (int u = 0; u < 4; ++u) {
                float a = 0.0f;
                #pragma unroll
                for (int i = 0; i < 16; ++i) a += fabsf(s[i][u]);
                cval[u] = a;
            }
            #pragma unroll
            for (int o = 4; o < 32; o <<= 1)
                #pragma unroll
                for (int u = 0; u < 4; ++u) cval[u] += __shfl_xor_sync(0xffffffffu, cval[u], o);
            #pragma unroll
            for (int u = 0; u < 4; ++u) {
                cval[u] = fmaxf(__fsqrt_rn(cval[u] * (1.0f / V)), smooth_floor);
                const float rc = __frcp_rn(cval[u]);
                #pragma unroll
                for (int i = 0; i < 16; ++i) s[i][u] *= rc;
            }
        }
#endif

        // ---- per-value-channel scales and codes ----
        // Both divisions (by the smoothing scale, by the channel scale) multiply by the correctly rounded
        // reciprocal: within 1.5 ulp of the quotient, where close.py keeps the exact one.  The exact one buys
        // nothing here: the state itself differs from the reference's by fp32 summation order, and a code
        // moves only when a value sits within those few ulp of a rounding boundary either way.  Channel
        // scales outside [2^-60, 2^60] (their reciprocals could leave the normal range) divide exactly.
#if LQ_ABLATE & 4
        #pragma unroll
        for (int i = 0; i < 16; ++i) {
            float x[4];
            #pragma unroll
            for (int u = 0; u < 4; ++u) x[u] = fminf(fmaxf(s[i][u], -qmax), qmax);
            store_codes(out_codes, row_of(i, g), warp, t, x);
        }
        if (tid < V) out_scale[tid] = 1.0f;
#else
        {
            // channel maxima: this thread's 4 columns, a reduce-scatter over the lanes t, then over the warps
            float mx[16];
            #pragma unroll
            for (int i = 0; i < 16; ++i) {
                float a = 0.0f;
                #pragma unroll
                for (int u = 0; u < 4; ++u) a = fmaxf(a, fabsf(s[i][u]));
                mx[i] = a;
            }
            int first = 0;
            scatter_level<16, true>(mx, lane, 2, first);
            scatter_level<8, true>(mx, lane, 1, first);
            #pragma unroll
            for (int q = 0; q < 4; ++q) sm[SM_RED + warp * V + row_of(first + q, g)] = mx[q];
        }
        __syncthreads();
        bool fast = true;
        if (tid < V) {
            float a = 0.0f;
            #pragma unroll
            for (int w = 0; w < 8; ++w) a = fmaxf(a, sm[SM_RED + w * V + tid]);
            float scale = __fdiv_rn(a, qmax);
            fast = scale == 0.0f || (scale >= 0x1p-60f && scale <= 0x1p60f);  // NaN: false
            scale = scale == 0.0f ? 1.0f : scale;
            *(float4*)(sm + SM_RED + SM_SCL + 4 * tid) = make_float4(scale, __frcp_rn(scale), fast ? 1.0f : 0.0f, 0.0f);
#if !(LQ_LS && LQ_RESIDUAL != 3)
            out_scale[tid] = scale;
#endif
        }
        // every thread quantizes rows of every channel: whether all of them divide by reciprocals
        const bool all_fast = __syncthreads_and(fast) != 0;
        {
#if LQ_LS && LQ_RESIDUAL != 3
            float nd[32];  // +ls: <c, q> and <c, c> of each row over this thread's 4 keys
#endif
            #pragma unroll
            for (int i = 0; i < 16; ++i) {
                const float4 f = *(const float4*)(sm + SM_RED + SM_SCL + 4 * row_of(i, g));
                float x[4];
                #pragma unroll
                for (int u = 0; u < 4; ++u) x[u] = all_fast || f.z != 0.0f ? s[i][u] * f.y : __fdiv_rn(s[i][u], f.x);
                float num = 0.0f, den = 0.0f;
                #pragma unroll
                for (int u = 0; u < 4; ++u) {
#if LQ_RESIDUAL == 3
                    x[u] = e4m3_grid(fminf(fmaxf(x[u], -qmax), qmax));
#else
                    const float q = x[u];
                    x[u] = fminf(fmaxf(rintf(q), -qmax), qmax);
                    num = fmaf(x[u], q, num);
                    den = fmaf(x[u], x[u], den);
#endif
                }
                (void)num, (void)den;
                store_codes(out_codes, row_of(i, g), warp, t, x);
#if LQ_LS && LQ_RESIDUAL != 3
                nd[2 * i] = num;
                nd[2 * i + 1] = den;
#endif
            }
#if LQ_LS && LQ_RESIDUAL != 3
            // the refit as a ratio of quotients (|q| <= qmax: no overflow), as close.py and scale_fit.py: the
            // sums over the lanes t (reduce-scatter), then over the warps
            int first = 0;
            scatter_level<32, false>(nd, lane, 2, first);
            scatter_level<16, false>(nd, lane, 1, first);
            #pragma unroll
            for (int q = 0; q < 8; ++q)
                sm[SM_RED + SM_LS + (warp * V + row_of((first + q) >> 1, g)) * 2 + ((first + q) & 1)] = nd[q];
            __syncthreads();
            if (tid < V) {
                float num = 0.0f, den = 0.0f;
                #pragma unroll
                for (int w = 0; w < 8; ++w) {
                    num += sm[SM_RED + SM_LS + (w * V + tid) * 2];
                    den += sm[SM_RED + SM_LS + (w * V + tid) * 2 + 1];
                }
                const float scale = sm[SM_RED + SM_SCL + 4 * tid];
                const float ratio = __fdiv_rn(num, den > 0.0f ? den : 1.0f);
                out_scale[tid] = den > 0.0f && ratio > 0.0f ? __fmul_rn(scale, ratio) : scale;
            }
#endif
        }
#endif

        // ---- the head's new tokens, smoothing scales and position ----
#if R > 0
        for (int e = tid; e < R * K; e += NT) head_at(comp_k, i_s, R * K, hv, sh_comp_k)[e] = f2h(sm[SM_Q + e]);
        for (int e = tid; e < R * V; e += NT)
            head_at(comp_u, i_s, R * V, hv, sh_comp_u)[e] = f2h(sm[SM_BASIS + (e % V) * CL_RP + e / V]);
#endif
#if LQ_SMOOTH
        if (g == 0)  // lanes g hold the same sums: one of them writes (4-byte stores: a pool may be off 16 bytes)
            #pragma unroll
            for (int u = 0; u < 4; ++u) head_at(smooth, i_s, K, hv, sh_smooth)[16 * warp + 4 * t + u] = cval[u];
#endif
        if (tid == 0) *head_at(pos, i_s, 1, hv, sh_pos) = 0;
#if LQ_PREFETCH
        // read here, where few registers are live, a head before its copies are issued
        i_after = idx + 2 * gridDim.x < count ? close_list[idx + 2 * gridDim.x] : -1;
#endif
        __syncthreads();  // the next head reuses shared memory
    }
}
