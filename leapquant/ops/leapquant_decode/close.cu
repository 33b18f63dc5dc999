// Window close of a LeapQuant pool in CUDA C++: the same arithmetic as close.py's close_kernel (and
// naive.close_ref), written with explicit data placement.  Built at run time by NVRTC (close_cuda.py) with
// the pool's shape as macros:
//
//   LQ_P window, LQ_R compensator tokens (0..8), LQ_ITERS power iterations, LQ_RESIDUAL 2 (int8 bytes:
//   int8, int6), 3 (fp8 e4m3) or 4 (packed int4), LQ_SMOOTH, LQ_VECTOR_DECAY (KDA), LQ_REC16 (fp16 records),
//   LQ_LS (least-squares channel scales, +ls: integer residuals), LQ_PREFETCH (stage the next head's inputs in
//   shared memory while this one closes: close_cuda.prefetches decides, from the shared memory of an SM),
//   LQ_DROP (the fraction of its norm under which a fit column is dropped as rounding noise).
//
// One 256-thread block per closing head holds the whole state S [V, K] = [128, 128] in registers, 8 x 8 per
// thread, rebuilt once from the pool (close.py rebuilds it at every pass because its tiles cannot stay in
// Triton's registers).  Thread (rb, cb) = (tid / 16, tid % 16) owns value rows rb*8 .. rb*8+7 and key
// columns cb*4 .. cb*4+3 and 64+cb*4 .. 64+cb*4+3 (so a row's 16 threads read 64 contiguous bytes of int8
// codes and shared-memory float4 reads fall on distinct banks).  The 16 threads of a row sit in one warp, so
// sums along the keys (token values, row maxima) are four shuffles; sums along the values (the fit's
// product, the smoothing sums) are one shuffle and one pass through shared memory over the 8 warps.
//
// Persistent: block b closes list entries b, b + gridDim.x, ... (the step kernel wrote the list).  With
// LQ_PREFETCH the inputs of a block's next head (codes, scales, records, tokens) are copied into a staging
// area by cp.async while the present head closes, so that only the first head of a block waits for global
// memory; without it each head loads its own at the start.

#if !defined(LQ_P) || !defined(LQ_R) || !defined(LQ_ITERS) || !defined(LQ_RESIDUAL) || !defined(LQ_SMOOTH) || \
    !defined(LQ_VECTOR_DECAY) || !defined(LQ_REC16) || !defined(LQ_LS) || !defined(LQ_PREFETCH) || !defined(LQ_DROP)
#error "close.cu is built by close_cuda.py, which defines LQ_P, LQ_R, LQ_ITERS, LQ_RESIDUAL, LQ_SMOOTH, ..."
#endif
#define K 128
#define V 128
#define NT 256
#define P LQ_P
#define R LQ_R
#define RG (R < 4 ? R : 4)  // tokens per group of a product (registers: 8 x RG partial sums)

#if R > 8
#error "at most 8 compensator tokens (and 5 to 7 are not supported: close_cuda.unsupported)"
#endif
// Timing ablations (scripts/close_cuda_ablation.py; the states they leave are wrong): bit 0 leaves out the
// tokens' and records' rank-one updates of the rebuild, bit 1 the fit, bit 2 the quantization arithmetic,
// bit 3 the fit's Gram-Schmidt.
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

// One level of a reduce-scatter over the 16 threads of a row: a thread holding N partial sums keeps half
// (the upper half where bit ``o`` of its column block is set) and adds the partner's copy of that half;
// with one sum left it adds the partner's whole.  ``first`` tracks the index of the sums kept.
template <int N>
__device__ __forceinline__ void scatter_level(float* a, int cb, int o, int& first) {
    if (N > 1) {
        const bool upper = (cb & o) != 0;
        #pragma unroll
        for (int t = 0; t < N / 2; ++t) {
            const float recv = __shfl_xor_sync(0xffffffffu, upper ? a[t] : a[N / 2 + t], o);
            a[t] = (upper ? a[N / 2 + t] : a[t]) + recv;
        }
        first += upper ? N / 2 : 0;
    } else {
        a[0] += __shfl_xor_sync(0xffffffffu, a[0], o);
    }
}

// Column j (0..7) of thread cb's 8 key columns.
__device__ __forceinline__ int key_col(int cb, int j) { return cb * 4 + (j & 3) + (j >> 2) * 64; }

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

// The raw code words of row v of a head's codes, this thread's 8 key columns (two words: columns cb*4..
// and 64+cb*4..).
__device__ __forceinline__ void load_code_words(const unsigned char* codes, int v, int cb, unsigned* w) {
    const unsigned char* row = codes + v * ROW_BYTES;
#if LQ_RESIDUAL == 4
    w[0] = *(const unsigned short*)(row + cb * 2);
    w[1] = *(const unsigned short*)(row + 32 + cb * 2);
#else
    w[0] = *(const unsigned*)(row + cb * 4);
    w[1] = *(const unsigned*)(row + 64 + cb * 4);
#endif
}

// Those words as 8 float codes.
__device__ __forceinline__ void decode_codes(const unsigned* w, float* c) {
    #pragma unroll
    for (int h = 0; h < 2; ++h)
        #pragma unroll
        for (int t = 0; t < 4; ++t) {
#if LQ_RESIDUAL == 4
            c[h * 4 + t] = (float)(((int)(w[h] << (28 - 4 * t))) >> 28);
#elif LQ_RESIDUAL == 3
            c[h * 4 + t] = e4m3_value((w[h] >> (8 * t)) & 0xFFu);
#else
            c[h * 4 + t] = (float)(((int)(w[h] << (24 - 8 * t))) >> 24);
#endif
        }
}

// ``head``: the closing head's payload (head_at).
__device__ __forceinline__ void store_codes(unsigned char* head, int v, int cb, const float* x) {
#if LQ_RESIDUAL == 4
    unsigned char* row = head + v * (K / 2);
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        unsigned w = 0;
        #pragma unroll
        for (int t = 0; t < 4; ++t) w |= ((unsigned)(int)x[h * 4 + t] & 0xFu) << (4 * t);
        *(unsigned short*)(row + h * 32 + cb * 2) = (unsigned short)w;
    }
#else
    unsigned char* row = head + v * K;
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        unsigned w = 0;
        #pragma unroll
        for (int t = 0; t < 4; ++t) {
#if LQ_RESIDUAL == 3
            w |= e4m3_byte(x[h * 4 + t]) << (8 * t);
#else
            w |= ((unsigned)(int)x[h * 4 + t] & 0xFFu) << (8 * t);
#endif
        }
        *(unsigned*)(row + h * 64 + cb * 4) = w;
    }
#endif
}

#define G_N (P * (1 + (K - 1) * LQ_VECTOR_DECAY))    // log decays a head's records hold: [P] or [P][K]
#define DEC_BYTES (4 - 2 * LQ_REC16 * LQ_VECTOR_DECAY)  // sizeof(dec_t)

// Shared memory, in floats.
#define SM_KEYS 0                    // [P][K] record keys (KDA: decayed to the window's end)
#define SM_VALS (SM_KEYS + P * K)    // [P][V] record values (GDN: times the decay to the window's end)
#define SM_TK (SM_VALS + P * V)      // [R][K] old token keys times the decay to the window's end
#define SM_TU (SM_TK + R * K)        // [R][V] old token values
#define SM_COL (SM_TU + R * V)       // [K] smoothing scale times the decay to the window's end
#define SM_BASIS (SM_COL + K)        // [R][V] the fit's value vectors (start, then token values)
#define SM_Q (SM_BASIS + R * V)      // [R][K] the fit's products, then orthonormal keys
#define SM_RED (SM_Q + R * K)        // [8 warps][4][K] per-warp partial sums along the values
#define SM_C (SM_RED + 8 * 4 * K)    // [K] smoothing scales
#define SM_RC (SM_C + K)             // [K] their reciprocals
// LQ_PREFETCH: the next head's inputs as stored (close_cuda.shared_bytes mirrors this; every region starts
// on 16 bytes for cp.async)
#define SM_STAGE (SM_RC + K)
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
// Asynchronous copy of BYTES from global to shared memory by the whole block, in PIECE-byte pieces (16 where
// the sizes allow: close_cuda.py builds this only for pools whose tensors start on 16 bytes).
template <int BYTES, int PIECE = (BYTES % 16 == 0 ? 16 : 4)>
__device__ __forceinline__ void copy_async(float* dst, const void* src, int tid) {
    static_assert(BYTES % 4 == 0, "the inputs are 4-byte multiples");
    unsigned s;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(s) : "l"(dst));
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
#endif

// Head i_s of a pool tensor with n elements a head: heads are contiguous within a slot, and slots are
// hv * n + shift elements apart (LeapQuantPool.slot_shift: 0 for a contiguous pool; an engine's page padding,
// the other state tensors of the page included, for a paged one).
template <typename T>
__device__ __forceinline__ T* head_at(T* base, long long i_s, int n, int hv, int shift) {
    return base + i_s * n + (i_s / hv) * (long long)shift;
}

extern "C" __global__ void __launch_bounds__(NT, 2) leapquant_close(
    const int* __restrict__ close_list, const int* __restrict__ close_count, unsigned char* payload,
    float* scale_v, float* smooth, half_bits* comp_k, half_bits* comp_u, const dec_t* __restrict__ rec_g,
    const rec_t* __restrict__ rec_k, const rec_t* __restrict__ rec_u, int* pos, double smooth_floor_d,
    double qmax_d, int hv, int sh_payload, int sh_scale, int sh_smooth, int sh_comp_k, int sh_comp_u, int sh_rec_g,
    int sh_rec_k, int sh_rec_u, int sh_pos) {
    extern __shared__ __align__(16) float sm[];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int rb = tid >> 4, cb = tid & 15;
    const float smooth_floor = (float)smooth_floor_d, qmax = (float)qmax_d;
    const int count = *close_count;
    (void)smooth_floor;

#if LQ_PREFETCH
    // a head's inputs, copied into the staging area (one commit group; a block has one in flight)
    auto stage = [&](int head) {
        const long long h = head;
        static_assert(sizeof(dec_t) == DEC_BYTES, "the staging layout's decay size");
        copy_async<V * ROW_BYTES>(sm + SM_ST_CODES, head_at(payload, h, V * ROW_BYTES, hv, sh_payload), tid);
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
        unsigned words[8][2];
        float sc[8];
        #pragma unroll
        for (int i = 0; i < 8; ++i) {
            load_code_words(in_codes, rb * 8 + i, cb, words[i]);
            sc[i] = in_scale[rb * 8 + i];
        }

        // ---- the head's factors (close.py _window_factors), every load of a loop issued at once ----
#if LQ_VECTOR_DECAY
        // KDA: the decay from record p to the window's end is the sum of the decays after it, summed from the
        // window's end down (the Triton close and naive.py sum the same terms in other orders)
        static_assert(NT >= 2 * K, "a thread per key channel, and as many for the values");
        if (tid < K) {  // key channel tid: its decays, its record keys decayed to the end, its token keys
            float since = 0.f;
            #pragma unroll
            for (int p = P - 1; p >= 0; --p) {
                sm[SM_KEYS + p * K + tid] = rec_load(in_rk + p * K + tid) * expf(since);
                since += dec_load(in_g + p * K + tid);
            }
            const float end = expf(since);
#if LQ_SMOOTH
            sm[SM_COL + tid] = in_smooth[tid] * end;
#else
            sm[SM_COL + tid] = end;
#endif
            #pragma unroll
            for (int r = 0; r < R; ++r) sm[SM_TK + r * K + tid] = h2f(in_ck[r * K + tid]) * end;
        } else {  // the other threads: the record and token values as stored
            #pragma unroll
            for (int t = 0; t < (P * V + NT - K - 1) / (NT - K); ++t) {
                const int e = tid - K + t * (NT - K);
                if (e < P * V) sm[SM_VALS + e] = rec_load(in_ru + e);
            }
            #pragma unroll
            for (int t = 0; t < (R * V + NT - K - 1) / (NT - K); ++t) {
                const int e = tid - K + t * (NT - K);
                if (e < R * V) sm[SM_TU + e] = h2f(in_cu[e]);
            }
        }
#else  // GDN: the running sums as stored
        const float* g = in_g;
        const float g_end = g[P - 1];
#define END_DECAY(k) expf(g_end)
        #pragma unroll
        for (int t = 0; t < (P * K + NT - 1) / NT; ++t) {
            const int e = tid + t * NT;
            if (e < P * K) sm[SM_KEYS + e] = rec_load(in_rk + e);
        }
        #pragma unroll
        for (int t = 0; t < (P * V + NT - 1) / NT; ++t) {
            const int e = tid + t * NT;
            if (e < P * V) sm[SM_VALS + e] = rec_load(in_ru + e) * expf(g_end - g[e / V]);
        }
        if (tid < K) {
#if LQ_SMOOTH
            sm[SM_COL + tid] = in_smooth[tid] * END_DECAY(tid);
#else
            sm[SM_COL + tid] = END_DECAY(tid);
#endif
        }
#if R > 0
        #pragma unroll
        for (int t = 0; t < (R * K + NT - 1) / NT; ++t) {
            const int e = tid + t * NT;
            if (e < R * K) sm[SM_TK + e] = h2f(in_ck[e]) * END_DECAY(e % K);
        }
        #pragma unroll
        for (int t = 0; t < (R * V + NT - 1) / NT; ++t) {
            const int e = tid + t * NT;
            if (e < R * V) sm[SM_TU + e] = h2f(in_cu[e]);
        }
#endif
#undef END_DECAY
#endif
        __syncthreads();
#if LQ_PREFETCH
        // the staging area is read (codes and scales in registers, factors prepared): the next head's copies
        if (i_next >= 0) stage(i_next);
#endif

        // ---- the state at the window's end, S = scale C col + Tu Tk^T + vals^T keys, in registers ----
        float s[8][8];
        {
            float col[8];
            #pragma unroll
            for (int j = 0; j < 8; ++j) col[j] = sm[SM_COL + key_col(cb, j)];
            #pragma unroll
            for (int i = 0; i < 8; ++i) {
                float c[8];
                decode_codes(words[i], c);
                #pragma unroll
                for (int j = 0; j < 8; ++j) s[i][j] = c[j] * sc[i] * col[j];
            }
        }
        // tokens, then records: rank-one updates, operands read from shared memory
#if !(LQ_ABLATE & 1)
        #pragma unroll 4
        for (int t = 0; t < R + P; ++t) {
            const float* a = t < R ? sm + SM_TU + t * V : sm + SM_VALS + (t - R) * V;
            const float* b = t < R ? sm + SM_TK + t * K : sm + SM_KEYS + (t - R) * K;
            const float4 a0 = *(const float4*)(a + rb * 8), a1 = *(const float4*)(a + rb * 8 + 4);
            const float4 b0 = *(const float4*)(b + cb * 4), b1 = *(const float4*)(b + 64 + cb * 4);
            const float av[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
            const float bv[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
            #pragma unroll
            for (int i = 0; i < 8; ++i)
                #pragma unroll
                for (int j = 0; j < 8; ++j) s[i][j] = fmaf(av[i], bv[j], s[i][j]);
        }
#endif

#if R > 0 && !(LQ_ABLATE & 2)
        // ---- the fit: warm start (previous token values; hashed +-1 where a token is zero) ----
        if (warp < R) {  // warp r decides whether token r's old values are usable
            float n2 = 0.0f;
            for (int e = lane; e < V; e += 32) n2 += sm[SM_TU + warp * V + e] * sm[SM_TU + warp * V + e];
            const bool usable = sqrtf(warp_sum(n2)) > 1e-30f;
            for (int e = lane; e < V; e += 32)
                sm[SM_BASIS + warp * V + e] = usable ? sm[SM_TU + warp * V + e] : start_vector(e, warp);
        }
        __syncthreads();
        for (int it = 0; it < LQ_ITERS; ++it) {
            // Z = S^T basis [K, R]: partial over this thread's rows, then over the warp's two row blocks,
            // then over the 8 warps through shared memory
            for (int r0 = 0; r0 < R; r0 += RG) {
                float acc[RG][8];
                #pragma unroll
                for (int rr = 0; rr < RG; ++rr) {
                    const float* bs = sm + SM_BASIS + (r0 + rr) * V + rb * 8;
                    #pragma unroll
                    for (int j = 0; j < 8; ++j) {
                        float z = 0.0f;
                        #pragma unroll
                        for (int i = 0; i < 8; ++i) z = fmaf(s[i][j], bs[i], z);
                        acc[rr][j] = z;
                    }
                }
                #pragma unroll
                for (int rr = 0; rr < RG; ++rr)
                    #pragma unroll
                    for (int j = 0; j < 8; ++j) acc[rr][j] += __shfl_xor_sync(0xffffffffu, acc[rr][j], 16);
                if (lane < 16)
                    #pragma unroll
                    for (int rr = 0; rr < RG; ++rr)
                        #pragma unroll
                        for (int j = 0; j < 8; ++j) sm[SM_RED + (warp * 4 + rr) * K + key_col(cb, j)] = acc[rr][j];
                __syncthreads();
                for (int e = tid; e < RG * K; e += NT) {
                    float z = 0.0f;
                    #pragma unroll
                    for (int w = 0; w < 8; ++w) z += sm[SM_RED + w * 4 * K + e];
                    sm[SM_Q + r0 * K + e] = z;
                }
                __syncthreads();
            }
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
                    for (int t = 0; t < 4; ++t) c[t] = sm[SM_Q + warp * K + lane + 32 * t];
                    #pragma unroll
                    for (int t = 0; t < 4; ++t) before += c[t] * c[t];
                    before = __fsqrt_rn(warp_sum(before));
                }
                #pragma unroll
                for (int p = 0; p < R; ++p) {
                    if (warp == p) {
                        float n2 = 0.0f;
                        #pragma unroll
                        for (int t = 0; t < 4; ++t) n2 += c[t] * c[t];
                        const float norm = __fsqrt_rn(warp_sum(n2));
                        const bool keep = norm > 1e-30f && norm > (float)(LQ_DROP) * before;
                        #pragma unroll
                        for (int t = 0; t < 4; ++t)
                            sm[SM_Q + p * K + lane + 32 * t] = keep ? __fdiv_rn(c[t], fmaxf(norm, 1e-30f)) : 0.0f;
                    }
                    if (p + 1 < R) {
                        __syncthreads();  // q_p is written; every thread meets this barrier
                        if (warp > p && warp < R) {
                            float d = 0.0f;
                            #pragma unroll
                            for (int t = 0; t < 4; ++t) d += sm[SM_Q + p * K + lane + 32 * t] * c[t];
                            d = warp_sum(d);
                            #pragma unroll
                            for (int t = 0; t < 4; ++t) c[t] -= d * sm[SM_Q + p * K + lane + 32 * t];
                        }
                    }
                }
            }
#endif
            __syncthreads();
            // token values U = S Q [V, R]: partial over this thread's columns, then over the row's 16 threads
            for (int r0 = 0; r0 < R; r0 += RG) {
                float acc[RG][8];
                #pragma unroll
                for (int rr = 0; rr < RG; ++rr) {
                    const float* q = sm + SM_Q + (r0 + rr) * K;
                    const float4 q0 = *(const float4*)(q + cb * 4), q1 = *(const float4*)(q + 64 + cb * 4);
                    const float qv[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
                    #pragma unroll
                    for (int i = 0; i < 8; ++i) {
                        float u = 0.0f;
                        #pragma unroll
                        for (int j = 0; j < 8; ++j) u = fmaf(s[i][j], qv[j], u);
                        acc[rr][i] = u;
                    }
                }
#if (RG & (RG - 1)) == 0
                // reduce-scatter over the row's 16 threads: at each level a thread keeps half of its sums
                // and adds the partner's half (30 shuffles for 4 tokens, not 128), ending with RG / 2 of them
                float a[RG * 8];  // a[m], m = rr * 8 + i
                #pragma unroll
                for (int m = 0; m < RG * 8; ++m) a[m] = acc[m / 8][m % 8];
                int first = 0;
                scatter_level<RG * 8>(a, cb, 8, first);
                scatter_level<RG * 4>(a, cb, 4, first);
                scatter_level<RG * 2>(a, cb, 2, first);
                scatter_level<RG>(a, cb, 1, first);
                #pragma unroll
                for (int t = 0; t < (RG > 1 ? RG / 2 : 1); ++t) {
                    const int m = first + t;
                    sm[SM_BASIS + (r0 + m / 8) * V + rb * 8 + m % 8] = a[t];
                }
#else
                #pragma unroll
                for (int o = 1; o < 16; o <<= 1)
                    #pragma unroll
                    for (int rr = 0; rr < RG; ++rr)
                        #pragma unroll
                        for (int i = 0; i < 8; ++i) acc[rr][i] += __shfl_xor_sync(0xffffffffu, acc[rr][i], o);
                if (cb == 0)
                    #pragma unroll
                    for (int rr = 0; rr < RG; ++rr)
                        #pragma unroll
                        for (int i = 0; i < 8; ++i) sm[SM_BASIS + (r0 + rr) * V + rb * 8 + i] = acc[rr][i];
#endif
            }
            __syncthreads();
        }
        // residual S - U16 Q16^T (both rounded to fp16, as they are stored)
        for (int r = 0; r < R; ++r) {
            const float* u = sm + SM_BASIS + r * V + rb * 8;
            const float* q = sm + SM_Q + r * K;
            float uv[8], qv[8];
            #pragma unroll
            for (int i = 0; i < 8; ++i) uv[i] = round_f16(u[i]);
            #pragma unroll
            for (int j = 0; j < 8; ++j) qv[j] = round_f16(q[key_col(cb, j)]);
            #pragma unroll
            for (int i = 0; i < 8; ++i)
                #pragma unroll
                for (int j = 0; j < 8; ++j) s[i][j] = fmaf(-uv[i], qv[j], s[i][j]);
        }
#endif

        // ---- smoothing scales c_k = sqrt(mean_v |R_vk|) ----
#if LQ_SMOOTH
        {
            float cs[8];
            #pragma unroll
            for (int j = 0; j < 8; ++j) {
                float a = 0.0f;
                #pragma unroll
                for (int i = 0; i < 8; ++i) a += fabsf(s[i][j]);
                cs[j] = a + __shfl_xor_sync(0xffffffffu, a, 16);
            }
            if (lane < 16)
                #pragma unroll
                for (int j = 0; j < 8; ++j) sm[SM_RED + warp * 4 * K + key_col(cb, j)] = cs[j];
            __syncthreads();
            if (tid < K) {
                float a = 0.0f;
                #pragma unroll
                for (int w = 0; w < 8; ++w) a += sm[SM_RED + w * 4 * K + tid];
                const float c = fmaxf(__fsqrt_rn(a * (1.0f / V)), smooth_floor);
                sm[SM_C + tid] = c;
                sm[SM_RC + tid] = __frcp_rn(c);
            }
            __syncthreads();
        }
        float rcv[8];
        #pragma unroll
        for (int j = 0; j < 8; ++j) rcv[j] = sm[SM_RC + key_col(cb, j)];
#define SMOOTHED(i, j) (s[i][j] * rcv[j])
#else
#define SMOOTHED(i, j) (s[i][j])
#endif

        // ---- per-value-channel scales and codes ----
        // Both divisions (by the smoothing scale, by the channel scale) multiply by the correctly rounded
        // reciprocal: within 1.5 ulp of the quotient, where close.py keeps the exact one.  The exact one buys
        // nothing here: the state itself differs from the reference's by fp32 summation order, and a code
        // moves only when a value sits within those few ulp of a rounding boundary either way.  Channel
        // scales outside [2^-60, 2^60] (their reciprocals could leave the normal range) divide exactly.
#if LQ_ABLATE & 4
        #pragma unroll
        for (int i = 0; i < 8; ++i) {
            float x[8];
            #pragma unroll
            for (int j = 0; j < 8; ++j) x[j] = fminf(fmaxf(s[i][j], -qmax), qmax);
            store_codes(out_codes, rb * 8 + i, cb, x);
            if (cb == 0) out_scale[rb * 8 + i] = 1.0f;
        }
#else
        float amax[8];
        #pragma unroll
        for (int i = 0; i < 8; ++i) {
            float a = 0.0f;
            #pragma unroll
            for (int j = 0; j < 8; ++j) a = fmaxf(a, fabsf(SMOOTHED(i, j)));
            amax[i] = a;
        }
        #pragma unroll
        for (int o = 1; o < 16; o <<= 1)
            #pragma unroll
            for (int i = 0; i < 8; ++i) amax[i] = fmaxf(amax[i], __shfl_xor_sync(0xffffffffu, amax[i], o));
        // thread cb works out the scale of row cb % 8 of its row group and hands it to the other 15
        float mine = amax[0];
        #pragma unroll
        for (int i = 1; i < 8; ++i) mine = (cb & 7) == i ? amax[i] : mine;
        float my_scale = __fdiv_rn(mine, qmax);
        const int my_fast = my_scale == 0.0f || (my_scale >= 0x1p-60f && my_scale <= 0x1p60f);  // NaN: 0
        my_scale = my_scale == 0.0f ? 1.0f : my_scale;
        const float my_rcp = __frcp_rn(my_scale);
        #pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int src = (lane & 16) | i;
            const float scale = __shfl_sync(0xffffffffu, my_scale, src);
            const float rcp = __shfl_sync(0xffffffffu, my_rcp, src);
            const bool fast = __shfl_sync(0xffffffffu, my_fast, src) != 0;
            float x[8];
            if (__all_sync(0xffffffffu, fast)) {
                #pragma unroll
                for (int j = 0; j < 8; ++j) x[j] = SMOOTHED(i, j) * rcp;
            } else {
                #pragma unroll
                for (int j = 0; j < 8; ++j) x[j] = fast ? SMOOTHED(i, j) * rcp : __fdiv_rn(SMOOTHED(i, j), scale);
            }
            float num = 0.0f, den = 0.0f;  // +ls: <c, q> and <c, c> over this thread's 8 keys
            #pragma unroll
            for (int j = 0; j < 8; ++j) {
#if LQ_RESIDUAL == 3
                x[j] = e4m3_grid(fminf(fmaxf(x[j], -qmax), qmax));
#else
                const float q = x[j];
                x[j] = fminf(fmaxf(rintf(q), -qmax), qmax);
                num = fmaf(x[j], q, num);
                den = fmaf(x[j], x[j], den);
#endif
            }
            store_codes(out_codes, rb * 8 + i, cb, x);
#if LQ_LS && LQ_RESIDUAL != 3
            // the refit as a ratio of quotients (|q| <= qmax: no overflow), as close.py and scale_fit.py
            #pragma unroll
            for (int o = 1; o < 16; o <<= 1) {
                num += __shfl_xor_sync(0xffffffffu, num, o);
                den += __shfl_xor_sync(0xffffffffu, den, o);
            }
            const float ratio = __fdiv_rn(num, den > 0.0f ? den : 1.0f);
            const float stored = den > 0.0f && ratio > 0.0f ? __fmul_rn(scale, ratio) : scale;
#else
            const float stored = scale;
#endif
            if (cb == 0) out_scale[rb * 8 + i] = stored;
        }
#endif
#undef SMOOTHED

        // ---- the head's new tokens, smoothing scales and position ----
#if R > 0
        for (int e = tid; e < R * K; e += NT) head_at(comp_k, i_s, R * K, hv, sh_comp_k)[e] = f2h(sm[SM_Q + e]);
        for (int e = tid; e < R * V; e += NT) head_at(comp_u, i_s, R * V, hv, sh_comp_u)[e] = f2h(sm[SM_BASIS + e]);
#endif
#if LQ_SMOOTH
        for (int e = tid; e < K; e += NT) head_at(smooth, i_s, K, hv, sh_smooth)[e] = sm[SM_C + e];
#endif
        if (tid == 0) *head_at(pos, i_s, 1, hv, sh_pos) = 0;
#if LQ_PREFETCH
        // read here, where few registers are live, a head before its copies are issued
        i_after = idx + 2 * gridDim.x < count ? close_list[idx + 2 * gridDim.x] : -1;
#endif
        __syncthreads();  // the next head reuses shared memory
    }
}
