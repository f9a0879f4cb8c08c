// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3").
// Counter-based: element i of a random tensor is a pure function of (seed,
// counter offset, i), so results depend on the seed and not on how many threads
// or devices compute them, and CPU and CUDA draw identical numbers.
// Header-only and usable from .cu files.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define CHORUS_HD __host__ __device__ __forceinline__
#else
#define CHORUS_HD inline
#endif

namespace chorus::philox {

struct U4 {
  uint32_t x, y, z, w;
};

CHORUS_HD uint32_t mulhilo(uint32_t a, uint32_t b, uint32_t* hi) {
  uint64_t p = static_cast<uint64_t>(a) * b;
  *hi = static_cast<uint32_t>(p >> 32);
  return static_cast<uint32_t>(p);
}

// Four 32-bit random words for 128-bit counter `ctr` under 64-bit key `seed`.
CHORUS_HD U4 philox4x32(uint64_t seed, uint64_t ctr_lo, uint64_t ctr_hi) {
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  uint32_t c0 = static_cast<uint32_t>(ctr_lo), c1 = static_cast<uint32_t>(ctr_lo >> 32);
  uint32_t c2 = static_cast<uint32_t>(ctr_hi), c3 = static_cast<uint32_t>(ctr_hi >> 32);
  for (int r = 0; r < 10; ++r) {
    uint32_t hi0, hi1;
    uint32_t lo0 = mulhilo(0xD2511F53u, c0, &hi0);
    uint32_t lo1 = mulhilo(0xCD9E8D57u, c2, &hi1);
    uint32_t n0 = hi1 ^ c1 ^ k0, n1 = lo1, n2 = hi0 ^ c3 ^ k1, n3 = lo0;
    c0 = n0; c1 = n1; c2 = n2; c3 = n3;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return U4{c0, c1, c2, c3};
}

// Uniform float in [0, 1) from 24 random bits.
CHORUS_HD float to_unit(uint32_t r) { return static_cast<float>(r >> 8) * (1.0f / 16777216.0f); }

// Random word number i of the stream (seed, offset): word i%4 of block offset+i/4.
CHORUS_HD uint32_t word(uint64_t seed, uint64_t offset, uint64_t i) {
  U4 r = philox4x32(seed, offset + i / 4, 0);
  switch (i % 4) {
    case 0: return r.x;
    case 1: return r.y;
    case 2: return r.z;
    default: return r.w;
  }
}

// Uniform [0,1) number i. Normals use words 2i and 2i+1 of the stream through
// Box-Muller (see Note [Random formulas] in cuda/kernels/random.cu; cpu/random.cpp matches).
CHORUS_HD float uniform(uint64_t seed, uint64_t offset, uint64_t i) {
  return to_unit(word(seed, offset, i));
}

}  // namespace chorus::philox
