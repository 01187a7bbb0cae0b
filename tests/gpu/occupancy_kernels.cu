// Kernels whose register and shared-memory use is known, for checking
// gpuwatch.probes.cupti.occupancy against cuOccupancyMaxActiveBlocksPerMultiprocessor
// (tests/gpu/occupancy_check.py). They are never launched: only their resource use matters.
// build_occupancy_kernels.sh compiles one cubin per variant, selected with -D:
//   KIND_REGS   regs_hungry: needs more than 255 registers, so -maxrregcount sets its count
//   KIND_SMEM   smem_static: SMEM_BYTES of static shared memory, few registers
//   KIND_MIXED  mixed: registers (capped by -maxrregcount) and SMEM_BYTES of static shared memory
//   KIND_MISC   tiny (few registers), bounded_128 (__launch_bounds__(128)),
//               bounded_256x4 (__launch_bounds__(256, 4)), dyn_smem (dynamic shared memory only)

#ifndef NACC
#define NACC 256  // live accumulators: more than 255 registers hold, so -maxrregcount decides;
                  // smaller -DNACC values give natural counts below 255
#endif

// Every accumulator depends on its neighbour each round, so all stay live across the loop.
#define ACCUMULATE(acc, in, n)                                           \
    _Pragma("unroll") for (int i = 0; i < NACC; ++i) acc[i] = in[threadIdx.x + i]; \
    for (int k = 0; k < n; ++k) {                                        \
        float x = in[k];                                                 \
        _Pragma("unroll") for (int i = 0; i < NACC; ++i)                 \
            acc[i] = fmaf(acc[i], acc[(i + 1) % NACC], x);               \
    }

#ifdef KIND_REGS
extern "C" __global__ void regs_hungry(float* out, const float* in, int n) {
    float acc[NACC];
    ACCUMULATE(acc, in, n)
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < NACC; ++i) s += acc[i] * (float)(i + 1);
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
#endif

#ifdef KIND_SMEM
extern "C" __global__ void smem_static(float* out, const float* in, int n) {
    __shared__ float buf[SMEM_BYTES / sizeof(float)];
    const int len = SMEM_BYTES / sizeof(float);
    for (int i = threadIdx.x; i < len; i += blockDim.x) buf[i] = in[i % n];
    __syncthreads();
    out[blockIdx.x * blockDim.x + threadIdx.x] = buf[(threadIdx.x * 7 + n) % len];
}
#endif

#ifdef KIND_MIXED
extern "C" __global__ void mixed(float* out, const float* in, int n) {
    __shared__ float buf[SMEM_BYTES / sizeof(float)];
    const int len = SMEM_BYTES / sizeof(float);
    float acc[NACC];
    ACCUMULATE(acc, in, n)
    for (int i = threadIdx.x; i < len; i += blockDim.x) buf[i] = acc[i % NACC];
    __syncthreads();
    float s = buf[(threadIdx.x * 7 + n) % len];
#pragma unroll
    for (int i = 0; i < NACC; ++i) s += acc[i] * (float)(i + 1);
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
#endif

#ifdef KIND_MISC
extern "C" __global__ void tiny(float* out, const float* in, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = 2.f * in[i];
}

extern "C" __global__ void __launch_bounds__(128) bounded_128(float* out, const float* in, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = in[i] * in[(i + 1) % n] + 1.f;
}

// 4 blocks of 256 threads per SM: the compiler keeps it at 64 registers or fewer.
extern "C" __global__ void __launch_bounds__(256, 4) bounded_256x4(float* out, const float* in, int n) {
    float acc[NACC];
    ACCUMULATE(acc, in, n)
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < NACC; ++i) s += acc[i] * (float)(i + 1);
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

extern "C" __global__ void dyn_smem(float* out, const float* in, int n) {
    extern __shared__ float dyn[];
    dyn[threadIdx.x] = in[threadIdx.x % n];
    __syncthreads();
    out[blockIdx.x * blockDim.x + threadIdx.x] = dyn[(threadIdx.x + 1) % blockDim.x];
}
#endif
