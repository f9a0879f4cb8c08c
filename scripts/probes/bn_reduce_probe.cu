// Issue 14 probe: the channels-last batch-norm column reductions alone, in
// variants, on WRN-28-10's three layer shapes (bf16, batch 128): microseconds
// per call (events around one launch; L2 cold after a 256 MB memset, then
// warm) and GB/s, beside a plain read and copy of the same bytes. "in1" is
// the statistics (sum d, sum d^2), "in2" the backward's sums (two inputs).
// Variants: rows as a contiguous slice per block or a stride over all blocks
// ("inter"), 4 or 8 loads in flight a thread ("L"), blocks per SM, and the
// block tree's shared memory thread-major or channel-major (the layout that
// shipped: Note [NHWC column reductions] in src/chorus/cuda/conv/batch_norm_nhwc.cu).
// (Predicated tails and software-pipelined loads were tried here too, and
// were slower.) Standalone:
//   nvcc -O3 -std=c++17 -arch=sm_90 --extended-lambda -o bn_reduce_probe scripts/probes/bn_reduce_probe.cu
//   ./bn_reduce_probe        # the table;  ./bn_reduce_probe 1   # one launch each, for ncu
#include <cuda_bf16.h>
#include <cstdio>
#include <vector>
#include <algorithm>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)
typedef __nv_bfloat16 bf;
struct alignas(16) P8 { bf v[8]; };

template <int kLoads, bool kInter, int kIn, bool kChannelMajor = false>
__global__ void __launch_bounds__(256) red(const bf* __restrict__ x, const bf* __restrict__ x2, long m, long c, long rows_per_block, float* __restrict__ pa, float* __restrict__ pb) {
  const long col0 = ((long)blockIdx.x * blockDim.x + threadIdx.x) * 8;
  float k[8], s1[8], s2[8];
  for (int j = 0; j < 8; ++j) k[j] = s1[j] = s2[j] = 0;
  const bool active = col0 < c;
  if (active) {
    P8 f = *(const P8*)(x + col0);
    for (int j = 0; j < 8; ++j) k[j] = __bfloat162float(f.v[j]);
    auto add = [&](const P8& a, const P8& b) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float d = __bfloat162float(a.v[j]) - k[j];
        if (kIn == 1) { s1[j] += d; s2[j] = fmaf(d, d, s2[j]); }
        else { const float g = __bfloat162float(b.v[j]); s1[j] += g; s2[j] = fmaf(g, d, s2[j]); }
      }
    };
    long r, r1, step;
    if (kInter) { r = (long)blockIdx.y * blockDim.y + threadIdx.y; step = (long)gridDim.y * blockDim.y; r1 = m; }
    else { long r0 = (long)blockIdx.y * rows_per_block; r1 = min(m, r0 + rows_per_block); r = r0 + threadIdx.y; step = blockDim.y; }
    constexpr int R = kLoads / kIn;
    for (; r + (R - 1) * step < r1; r += R * step) {
      P8 a[R], b[R];
#pragma unroll
      for (int u = 0; u < R; ++u) { a[u] = *(const P8*)(x + (r + u * step) * c + col0); if (kIn == 2) b[u] = *(const P8*)(x2 + (r + u * step) * c + col0); }
#pragma unroll
      for (int u = 0; u < R; ++u) add(a[u], b[u]);
    }
    for (; r < r1; r += step) { P8 a = *(const P8*)(x + r * c + col0); P8 b = a; if (kIn == 2) b = *(const P8*)(x2 + r * c + col0); add(a, b); }
  }
  // Thread-major (t * 8 + j: 8-way bank conflicts) or channel-major (j * 256 + t).
  auto at = [](int t, int j) { return kChannelMajor ? j * 256 + t : t * 8 + j; };
  __shared__ float sa[256 * 8], sb[256 * 8];
  const int t = threadIdx.y * blockDim.x + threadIdx.x;
  for (int j = 0; j < 8; ++j) { sa[at(t, j)] = s1[j]; sb[at(t, j)] = s2[j]; }
  unsigned h = 1; while (h * 2 < blockDim.y) h *= 2; if (blockDim.y <= 1) h = 0;
  for (unsigned half = h; half > 0; half /= 2) {
    __syncthreads();
    if (threadIdx.y < half && threadIdx.y + half < blockDim.y) { int u = t + half * blockDim.x; for (int j = 0; j < 8; ++j) { sa[at(t, j)] += sa[at(u, j)]; sb[at(t, j)] += sb[at(u, j)]; } }
  }
  if (threadIdx.y != 0 || !active) return;
  for (int j = 0; j < 8; ++j) { pa[(long)blockIdx.y * c + col0 + j] = sa[at(t, j)]; pb[(long)blockIdx.y * c + col0 + j] = sb[at(t, j)]; }
}


// elementwise reference: read x (and x2), write y (copy-like) for bandwidth ceiling
__global__ void copyk(const P8* __restrict__ a, P8* __restrict__ b, long n) { for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) b[i] = a[i]; }
__global__ void readk(const P8* __restrict__ a, long n, float* out) { float s = 0; for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) s += __bfloat162float(a[i].v[0]); if (s == 12345.f) *out = s; }

int main(int argc, char** argv) {
  if (argc > 1) {  // ncu mode: one launch each of stage-3 and stage-1 stats (per_sm 2, L8) and a read
    int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const long maxn = 131072L * 160; bf *x, *x2; float *pa, *pb, *o;
    CK(cudaMalloc(&x, maxn * 2)); CK(cudaMalloc(&x2, maxn * 2)); CK(cudaMalloc(&pa, 64 << 20)); CK(cudaMalloc(&pb, 64 << 20)); CK(cudaMalloc(&o, 4));
    CK(cudaMemset(x, 0x3f, maxn * 2));
    const long shapes[2][2] = {{8192, 640}, {131072, 160}};
    for (auto& s : shapes) {
      const long m = s[0], c = s[1]; const int tx = (int)std::min<long>(c / 8, 256), ty = std::max(1, 256 / tx);
      long rb = std::min<long>(2L * sms, (m + ty - 1) / ty); const long rows = (m + rb - 1) / rb;
      red<8, false, 1><<<dim3(1, rb), dim3(tx, ty)>>>(x, x2, m, c, rows, pa, pb);
      red<16, false, 2><<<dim3(1, rb), dim3(tx, ty)>>>(x, x2, m, c, rows, pa, pb);
      readk<<<sms * 8, 256>>>((const P8*)x, m * c / 8, o);
    }
    CK(cudaDeviceSynchronize());
    return 0;
  }

  int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const long shapes[3][2] = {{131072, 160}, {32768, 320}, {8192, 640}};
  const long maxn = 131072L * 160;
  bf *x, *x2; float *pa, *pb; char* flush; float* o;
  CK(cudaMalloc(&x, maxn * 2)); CK(cudaMalloc(&x2, maxn * 2)); CK(cudaMalloc(&pa, 64 << 20)); CK(cudaMalloc(&pb, 64 << 20)); CK(cudaMalloc(&flush, 256 << 20)); CK(cudaMalloc(&o, 4));
  CK(cudaMemset(x, 0x3f, maxn * 2)); CK(cudaMemset(x2, 0x3e, maxn * 2));
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  for (int warm = 0; warm < 2; ++warm) {
  printf("== %s L2\n", warm ? "warm" : "cold (flushed)");
  for (auto& s : shapes) {
    const long m = s[0], c = s[1];
    const int tx = (int)std::min<long>(c / 8, 256), ty = std::max(1, 256 / tx);
    const long colb = (c / 8 + tx - 1) / tx;
    auto time = [&](auto launch) {
      float tot = 0; const int it = 30;
      for (int i = 0; i < it + 3; ++i) {
        if (!warm) CK(cudaMemsetAsync(flush, i, 256 << 20));
        else launch();
        cudaEventRecord(e0); launch(); cudaEventRecord(e1); CK(cudaEventSynchronize(e1));
        float ms; cudaEventElapsedTime(&ms, e0, e1); if (i >= 3) tot += ms;
      }
      return tot / it * 1000;
    };
    const double mb = m * c * 2 / 1e6;
    float tr = time([&] { readk<<<sms * 8, 256>>>((const P8*)x, m * c / 8, o); });
    float tc = time([&] { copyk<<<sms * 8, 256>>>((const P8*)x, (P8*)x2, m * c / 8); });
    printf("m %ld c %ld: %.1f MB  read %.1f us (%.0f GB/s)  copy %.1f us (%.0f GB/s)\n", m, c, mb, tr, mb * 1e3 / tr, tc, 2 * mb * 1e3 / tc);
    for (int in = 1; in <= 2; ++in)
    for (int per_sm : {1, 2, 3, 4}) {
      long rb = std::max<long>(1, (long)per_sm * sms / colb); rb = std::min<long>(rb, (m + ty - 1) / ty);
      const long rows = (m + rb - 1) / rb;
      dim3 grid(colb, rb), block(tx, ty);
      auto run = [&](auto kern) { return time([&] { kern<<<grid, block>>>(x, x2, m, c, rows, pa, pb); }); };
      float a4 = in == 1 ? run(red<4, false, 1>) : run(red<8, false, 2>);
      float a8 = in == 1 ? run(red<8, false, 1>) : run(red<16, false, 2>);
      float i4 = in == 1 ? run(red<4, true, 1>) : run(red<8, true, 2>);
      float i8 = in == 1 ? run(red<8, true, 1>) : run(red<16, true, 2>);
      auto gb = [&](float us) { return in * mb * 1e3 / us; };
      float p4 = in == 1 ? run(red<8, false, 1, true>) : run(red<16, false, 2, true>);
      float p8 = in == 1 ? run(red<8, true, 1, true>) : run(red<16, true, 2, true>);
      printf("  in%d per_sm %d blocks %ld: slice L%d %.1f (%.0f) L%d %.1f (%.0f) | inter L%d %.1f (%.0f) L%d %.1f (%.0f) | channel-major tree: slice L%d %.1f (%.0f) inter L%d %.1f (%.0f)\n", in, per_sm, rb,
             4 * in, a4, gb(a4), 8 * in, a8, gb(a8), 4 * in, i4, gb(i4), 8 * in, i8, gb(i8), 8 * in, p4, gb(p4), 8 * in, p8, gb(p8));
    }
  }
  }
  CK(cudaGetLastError());
  return 0;
}
