// MatMulQ: y = x @ W for W held as 4-, 5-, 6- or 8-bit codes in blocks of 16 or 32 along K,
// an onnxruntime custom op (domain "meshserve"). It serves a GGUF's block types at their
// own bits: Q5_0 / Q5_1 / Q5_K at 5 bits a weight plus scales and Q6_K at 6, where
// onnxruntime's MatMulNBits holds them as 8-bit blocks, and Q8_0 / Q4_x / Q3_K / Q2_K in a
// layout that its int8 dot products read without horizontal sums.
//
//   w[k, n] = scale[n, s] * (q[n, k] - zp[n, s]) + bias[n, s],  s = k / block_size
//
// (bias: an affine block's min, Q4_1 / Q4_K / Q5_1 / Q5_K / Q2_K, beyond its integer zero
// point). The layout is written by common/custom_ops.py (pack), its one owner; in short,
// per group of 16 output columns g and 32 weights along K (b), one record:
//   8-bit: 8 vectors of 64 bytes; byte 4c+t of vector j is the code of column 16g+c at
//          k = 32b + 4j + t
//   4-bit: 4 x 64 bytes; vector j < 4 is the low nibbles of bytes 64j.., j >= 4 the high
//          nibbles of bytes 64(j-4)..
//   5-bit: the 4-bit record, then 8 uint64: bit 4c+t of the j-th is that code's bit 4
//   6-bit: the 5-bit record, then 8 uint64 more: bit 5
// so that one 64-byte vector holds 4 consecutive weights of 16 columns: the int8 dot
// product instructions (VNNI vpdpbusd, AVX2 vpmaddubsw) sum groups of 4 bytes into one
// int32 lane, and 8 of them (4 for a block of 16) leave lane c holding column c's whole
// block: no horizontal sums, one scale multiply per 16 columns and block. scales:
// [G, K / block_size, 16] fp16 or fp32; zero points (optional): uint8, the same shape, else
// 2^(bits-1); bias (optional): fp32, the same shape.
//
// x is quantized per 32 to int8 as llama.cpp's Q8_0 does (d = amax / 127 held in fp16,
// q = round(x / d)), so the dot products are those of llama.cpp's; a block's bias and zero
// point are applied against x's block sum d * sum(q), as llama.cpp's Q8_1 / Q8_K sums are.
//
// Kernels: AVX-512 VNNI (BW, VL), AVX2, and plain C++; the best the CPU has is used, or the
// one MESHSERVE_OPS_ISA names (avx512 / avx2 / scalar: tests compare them).

#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kGroup = 16;                  // output columns per record

enum class Isa { kScalar, kAvx2, kAvx512 };

Isa BestIsa() {
  const char* forced = std::getenv("MESHSERVE_OPS_ISA");
  if (forced != nullptr && *forced != '\0') {
    std::string name(forced);
    if (name == "scalar") return Isa::kScalar;
    if (name == "avx2") return Isa::kAvx2;
    if (name == "avx512") return Isa::kAvx512;
    throw std::runtime_error("MESHSERVE_OPS_ISA=" + name + ": expected avx512, avx2 or scalar");
  }
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("f16c"))
    return Isa::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c"))
    return Isa::kAvx2;
#endif
  return Isa::kScalar;
}

// ---- fp16 <-> fp32 without F16C (the scalar path) -------------------------------------

float HalfToFloat(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      int e = -1;
      uint32_t m = man;
      do {
        ++e;
        m <<= 1;
      } while ((m & 0x400) == 0);
      bits = sign | ((127 - 15 - e) << 23) | ((m & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t FloatToHalf(float f) {  // round to nearest even, as F16C's vcvtps2ph
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) return static_cast<uint16_t>(sign | 0x7c00u | (x > 0x7f800000u ? 0x200u : 0));
  if (x >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflows to inf
  if (x < 0x38800000u) {                                               // subnormal or zero
    float a;
    std::memcpy(&a, &x, 4);
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(a * 16777216.0f)));
  }
  const uint32_t mant_odd = (x >> 13) & 1;
  x += 0xc8000fffu + mant_odd;  // rebias the exponent (-112 << 23) and round
  return static_cast<uint16_t>(sign | (x >> 13));
}

// ---- x quantized to int8 per block (llama.cpp's Q8_0) ----------------------------------

struct QuantizedRows {
  int64_t rows = 0, blocks = 0;
  std::vector<int8_t> q;      // [rows, blocks * 32]
  std::vector<float> d;       // [rows, blocks] the scale, rounded to fp16
  std::vector<int32_t> sums;  // [rows, blocks, 2] sums of the block's two halves' codes
};

void QuantizeRowScalar(const float* x, int64_t blocks, int8_t* q, float* d, int32_t* sums) {
  for (int64_t b = 0; b < blocks; ++b) {
    float amax = 0.0f;
    for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(x[b * kBlock + i]));
    const float scale = amax / 127.0f, inv = scale != 0.0f ? 1.0f / scale : 0.0f;
    int32_t sum[2] = {0, 0};
    for (int i = 0; i < kBlock; ++i) {
      const int v = static_cast<int>(std::nearbyint(x[b * kBlock + i] * inv));
      q[b * kBlock + i] = static_cast<int8_t>(v);
      sum[i / 16] += v;
    }
    d[b] = HalfToFloat(FloatToHalf(scale));
    sums[2 * b] = sum[0];
    sums[2 * b + 1] = sum[1];
  }
}

__attribute__((target("avx512f,avx512bw,avx512vl,f16c")))
void QuantizeRowAvx512(const float* x, int64_t blocks, int8_t* q, float* d, int32_t* sums) {
  for (int64_t b = 0; b < blocks; ++b) {
    const __m512 v0 = _mm512_loadu_ps(x + b * kBlock), v1 = _mm512_loadu_ps(x + b * kBlock + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float scale = amax / 127.0f, inv = scale != 0.0f ? 1.0f / scale : 0.0f;
    const __m512 m = _mm512_set1_ps(inv);
    // vcvtps2dq rounds to nearest even (the MXCSR default), as llama.cpp's AVX path does
    const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, m));
    const __m512i i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, m));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock), _mm512_cvtepi32_epi8(i0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock + 16), _mm512_cvtepi32_epi8(i1));
    sums[2 * b] = _mm512_reduce_add_epi32(i0);
    sums[2 * b + 1] = _mm512_reduce_add_epi32(i1);
    d[b] = _cvtsh_ss(_cvtss_sh(scale, _MM_FROUND_TO_NEAREST_INT));
  }
}

__attribute__((target("avx2,fma,f16c")))
void QuantizeRowAvx2(const float* x, int64_t blocks, int8_t* q, float* d, int32_t* sums) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b < blocks; ++b) {
    __m256 v[4], mx = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(x + b * kBlock + 8 * i);
      mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float scale = _mm_cvtss_f32(m4) / 127.0f, inv = scale != 0.0f ? 1.0f / scale : 0.0f;
    const __m256 m = _mm256_set1_ps(inv);
    __m256i i[4];
    for (int k = 0; k < 4; ++k) i[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], m));
    for (int h = 0; h < 2; ++h) {
      const __m256i s = _mm256_add_epi32(i[2 * h], i[2 * h + 1]);
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
      s4 = _mm_hadd_epi32(s4, s4);
      s4 = _mm_hadd_epi32(s4, s4);
      sums[2 * b + h] = _mm_cvtsi128_si32(s4);
    }
    // int32 -> int16 -> int8 with saturation (values are within -127..127), in order
    __m256i p01 = _mm256_packs_epi32(i[0], i[1]), p23 = _mm256_packs_epi32(i[2], i[3]);
    __m256i p = _mm256_packs_epi16(p01, p23);
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kBlock), p);
    d[b] = _cvtsh_ss(_cvtss_sh(scale, _MM_FROUND_TO_NEAREST_INT));
  }
}

// ---- the problem, as the kernels see it -------------------------------------------------

constexpr int64_t RecordBytes(int bits) {
  return bits == 8 ? 512 : bits == 6 ? 384 : bits == 5 ? 320 : 256;
}
constexpr int DefaultZeroPoint(int bits) { return 1 << (bits - 1); }

struct Problem {
  const QuantizedRows* x;
  const uint8_t* codes;        // [G, nb, RecordBytes(bits)], nb = K / 32
  const void* scales;          // [G, ns, 16] fp16 or fp32, ns = K / block_size
  bool half_scales;
  const uint8_t* zero_points;  // [G, ns, 16] or nullptr (DefaultZeroPoint)
  const float* bias;           // [G, ns, 16] or nullptr
  float* y;                    // [rows, n]
  int64_t n, groups;
};

inline float ScaleAt(const Problem& p, int64_t i) {
  return p.half_scales ? HalfToFloat(static_cast<const uint16_t*>(p.scales)[i])
                       : static_cast<const float*>(p.scales)[i];
}

// the code of column c at k = 4j + t of a record
template <int BITS>
inline int CodeAt(const uint8_t* rec, int c, int j, int t) {
  if (BITS == 8) return rec[64 * j + 4 * c + t];
  const uint8_t nib = rec[(j & 3) * 64 + 4 * c + t];
  int code = j < 4 ? (nib & 15) : (nib >> 4);
  for (int plane = 0; plane < BITS - 4; ++plane) {
    uint64_t bits;
    std::memcpy(&bits, rec + 256 + 64 * plane + 8 * j, 8);
    code |= static_cast<int>(((bits >> (4 * c + t)) & 1) << (4 + plane));
  }
  return code;
}

// A sub-block's part of a record: SUB sub-blocks of 32 / SUB weights each (1: blocks of 32,
// 2: blocks of 16), vectors [8 / SUB * h, 8 / SUB * (h + 1)).
template <int BITS, int SUB>
void GroupScalar(const Problem& p, int64_t g) {
  const int64_t nb = p.x->blocks;
  for (int64_t r = 0; r < p.x->rows; ++r) {
    float acc[kGroup] = {};
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* rec = p.codes + (g * nb + b) * RecordBytes(BITS);
      const int8_t* xq = p.x->q.data() + (r * nb + b) * kBlock;
      const int32_t* half_sums = p.x->sums.data() + 2 * (r * nb + b);
      const float xd = p.x->d[r * nb + b];
      for (int h = 0; h < SUB; ++h) {
        const int32_t xsum = SUB == 1 ? half_sums[0] + half_sums[1] : half_sums[h];
        for (int c = 0; c < kGroup; ++c) {
          int32_t dot = 0;
          for (int j = 8 / SUB * h; j < 8 / SUB * (h + 1); ++j)
            for (int t = 0; t < 4; ++t) dot += CodeAt<BITS>(rec, c, j, t) * xq[4 * j + t];
          const int64_t at = ((g * nb + b) * SUB + h) * kGroup + c;
          const int zp = p.zero_points ? p.zero_points[at] : DefaultZeroPoint(BITS);
          const float offset = ScaleAt(p, at) * static_cast<float>(zp) - (p.bias ? p.bias[at] : 0.0f);
          acc[c] += static_cast<float>(dot) * (ScaleAt(p, at) * xd) - offset * (xd * static_cast<float>(xsum));
        }
      }
    }
    for (int c = 0; c < kGroup && g * kGroup + c < p.n; ++c) p.y[r * p.n + g * kGroup + c] = acc[c];
  }
}

// AVX-512: one zmm is one vector of the record (16 columns x 4 weights). vpdpbusd takes
// the codes unsigned (0..255) and x signed, 4 products into each int32 lane, x's 4 bytes
// broadcast. The zero point and bias are taken off in float: scale x zp - bias per column
// once a block, times x's block sum. A block's codes are unpacked into 8 registers once for
// up to 8 rows held in registers, or for a tile of 64 rows whose sums wait in L1.
#define MESHSERVE_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))

template <int BITS>
MESHSERVE_AVX512 inline void UnpackAvx512(const uint8_t* rec, __m512i w[8]) {
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  if constexpr (BITS == 8) {
    for (int j = 0; j < 8; ++j) w[j] = _mm512_loadu_si512(rec + 64 * j);
  } else {
    for (int j = 0; j < 4; ++j) {
      const __m512i nib = _mm512_loadu_si512(rec + 64 * j);
      w[j] = _mm512_and_si512(nib, low4);
      w[j + 4] = _mm512_and_si512(_mm512_srli_epi16(nib, 4), low4);
    }
    for (int plane = 0; plane < BITS - 4; ++plane) {
      const __m512i bit = _mm512_set1_epi8(static_cast<char>(16 << plane));
      for (int j = 0; j < 8; ++j) {
        __mmask64 set;
        std::memcpy(&set, rec + 256 + 64 * plane + 8 * j, 8);
        w[j] = _mm512_mask_add_epi8(w[j], set, w[j], bit);
      }
    }
  }
}

// a sub-block's (scale, scale x zero point - bias) for 16 columns
template <int BITS>
MESHSERVE_AVX512 inline void ScalesAvx512(const Problem& p, int64_t at, __m512* scale,
                                          __m512* offset) {
  *scale = p.half_scales
               ? _mm512_cvtph_ps(_mm256_loadu_si256(
                     reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p.scales) + at)))
               : _mm512_loadu_ps(static_cast<const float*>(p.scales) + at);
  const __m512 zp =
      p.zero_points
          ? _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                _mm_loadu_si128(reinterpret_cast<const __m128i*>(p.zero_points + at))))
          : _mm512_set1_ps(static_cast<float>(DefaultZeroPoint(BITS)));
  *offset = _mm512_mul_ps(*scale, zp);
  if (p.bias) *offset = _mm512_sub_ps(*offset, _mm512_loadu_ps(p.bias + at));
}

template <int SUB>
struct BlockScales {
  __m512 scale[SUB], offset[SUB];
};

template <int BITS, int SUB>
MESHSERVE_AVX512 inline BlockScales<SUB> BlockScalesAvx512(const Problem& p, int64_t g, int64_t b) {
  BlockScales<SUB> out;
  for (int h = 0; h < SUB; ++h)
    ScalesAvx512<BITS>(p, ((g * p.x->blocks + b) * SUB + h) * kGroup, &out.scale[h], &out.offset[h]);
  return out;
}

// acc += row block rb's dot products, scaled, less the zero point's and bias' share
template <int SUB, int kChains>
MESHSERVE_AVX512 inline __m512 BlockAvx512(const Problem& p, int64_t rb, const __m512i w[8],
                                           const BlockScales<SUB>& s, __m512 acc) {
  const int32_t* xq = reinterpret_cast<const int32_t*>(p.x->q.data() + rb * kBlock);
  const int32_t* half_sums = p.x->sums.data() + 2 * rb;
  const float xd = p.x->d[rb];
  const __m512 dx = _mm512_set1_ps(xd);
  for (int h = 0; h < SUB; ++h) {
    constexpr int kPer = 8 / SUB;
    __m512i dot[kChains];
    for (int c = 0; c < kChains; ++c) dot[c] = _mm512_setzero_si512();
    for (int j = 0; j < kPer; ++j)
      dot[j % kChains] = _mm512_dpbusd_epi32(dot[j % kChains], w[kPer * h + j],
                                             _mm512_set1_epi32(xq[kPer * h + j]));
    for (int c = 1; c < kChains; ++c) dot[0] = _mm512_add_epi32(dot[0], dot[c]);
    const int32_t xsum = SUB == 1 ? half_sums[0] + half_sums[1] : half_sums[h];
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[0]), _mm512_mul_ps(s.scale[h], dx), acc);
    acc = _mm512_fnmadd_ps(s.offset[h], _mm512_set1_ps(xd * static_cast<float>(xsum)), acc);
  }
  return acc;
}

template <int BITS, int SUB, int R>
MESHSERVE_AVX512 void RowsAvx512(const Problem& p, int64_t g, int64_t r0) {
  constexpr int kChains = R == 1 ? 4 / SUB : (R == 2 ? 2 : 1);
  const int64_t nb = p.x->blocks;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i w[8];
    UnpackAvx512<BITS>(p.codes + (g * nb + b) * RecordBytes(BITS), w);
    const BlockScales<SUB> s = BlockScalesAvx512<BITS, SUB>(p, g, b);
    for (int r = 0; r < R; ++r) acc[r] = BlockAvx512<SUB, kChains>(p, (r0 + r) * nb + b, w, s, acc[r]);
  }
  const int64_t col = g * kGroup, valid = std::min<int64_t>(kGroup, p.n - col);
  const __mmask16 keep = static_cast<__mmask16>((1u << valid) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(p.y + (r0 + r) * p.n + col, keep, acc[r]);
}

template <int BITS, int SUB>
MESHSERVE_AVX512 void TileAvx512(const Problem& p, int64_t g, int64_t r0, int64_t tile) {
  constexpr int64_t kTile = 64;
  const int64_t nb = p.x->blocks;
  alignas(64) float acc[kTile * kGroup];
  for (int64_t r = 0; r < tile; ++r) _mm512_store_ps(acc + r * kGroup, _mm512_setzero_ps());
  for (int64_t b = 0; b < nb; ++b) {
    __m512i w[8];
    UnpackAvx512<BITS>(p.codes + (g * nb + b) * RecordBytes(BITS), w);
    const BlockScales<SUB> s = BlockScalesAvx512<BITS, SUB>(p, g, b);
    for (int64_t r = 0; r < tile; ++r)
      _mm512_store_ps(acc + r * kGroup, BlockAvx512<SUB, 2 / SUB>(p, (r0 + r) * nb + b, w, s,
                                                                 _mm512_load_ps(acc + r * kGroup)));
  }
  const int64_t col = g * kGroup, valid = std::min<int64_t>(kGroup, p.n - col);
  const __mmask16 keep = static_cast<__mmask16>((1u << valid) - 1);
  for (int64_t r = 0; r < tile; ++r)
    _mm512_mask_storeu_ps(p.y + (r0 + r) * p.n + col, keep, _mm512_load_ps(acc + r * kGroup));
}

template <int BITS, int SUB>
void GroupAvx512(const Problem& p, int64_t g) {
  const int64_t rows = p.x->rows;
  if (rows > 8) {
    for (int64_t r = 0; r < rows; r += 64)
      TileAvx512<BITS, SUB>(p, g, r, std::min<int64_t>(64, rows - r));
    return;
  }
  switch (rows) {
    case 8: RowsAvx512<BITS, SUB, 8>(p, g, 0); break;
    case 7: RowsAvx512<BITS, SUB, 7>(p, g, 0); break;
    case 6: RowsAvx512<BITS, SUB, 6>(p, g, 0); break;
    case 5: RowsAvx512<BITS, SUB, 5>(p, g, 0); break;
    case 4: RowsAvx512<BITS, SUB, 4>(p, g, 0); break;
    case 3: RowsAvx512<BITS, SUB, 3>(p, g, 0); break;
    case 2: RowsAvx512<BITS, SUB, 2>(p, g, 0); break;
    case 1: RowsAvx512<BITS, SUB, 1>(p, g, 0); break;
    default: break;
  }
}

// AVX2: a record's vector is two ymm (columns 0-7, 8-15); each half is its own pass.
// vpmaddubsw multiplies unsigned codes by signed int8 x into int16 pairs: codes below 64
// cannot overflow them; 8-bit codes are taken signed (c - 128) and multiplied as
// |c - 128| times x with c - 128's sign, as llama.cpp's AVX2 dot products do.
#define MESHSERVE_AVX2 __attribute__((target("avx2,fma,f16c")))

MESHSERVE_AVX2 inline __m256i BitsToBytes(uint32_t bits, char value) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3,
                       3, 3, 3, 3, 3, 3, 3));
  const __m256i select = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
  return _mm256_and_si256(set, _mm256_set1_epi8(value));
}

template <int BITS, int SUB, int R>
MESHSERVE_AVX2 void RowsAvx2(const Problem& p, int64_t g, int64_t r0, int half) {
  constexpr int kShift = BITS == 8 ? 128 : 0;  // 8-bit codes made signed: c ^ 0x80 = c - 128
  constexpr int kPer = 8 / SUB;
  const int64_t nb = p.x->blocks;
  const __m256i low4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* rec = p.codes + (g * nb + b) * RecordBytes(BITS);
    __m256i w[8];
    if constexpr (BITS == 8) {
      for (int j = 0; j < 8; ++j)
        w[j] = _mm256_xor_si256(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 64 * j + 32 * half)),
            _mm256_set1_epi8(static_cast<char>(0x80)));
    } else {
      for (int j = 0; j < 4; ++j) {
        const __m256i nib =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 64 * j + 32 * half));
        w[j] = _mm256_and_si256(nib, low4);
        w[j + 4] = _mm256_and_si256(_mm256_srli_epi16(nib, 4), low4);
      }
      for (int plane = 0; plane < BITS - 4; ++plane)
        for (int j = 0; j < 8; ++j) {
          uint32_t bits;
          std::memcpy(&bits, rec + 256 + 64 * plane + 8 * j + 4 * half, 4);
          w[j] = _mm256_or_si256(w[j], BitsToBytes(bits, static_cast<char>(16 << plane)));
        }
    }
    __m256 scale[SUB], offset[SUB];
    for (int h = 0; h < SUB; ++h) {
      const int64_t at = ((g * nb + b) * SUB + h) * kGroup + 8 * half;
      scale[h] = p.half_scales
                     ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(
                           static_cast<const uint16_t*>(p.scales) + at)))
                     : _mm256_loadu_ps(static_cast<const float*>(p.scales) + at);
      const __m256 zp =
          p.zero_points
              ? _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                    _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p.zero_points + at))))
              : _mm256_set1_ps(static_cast<float>(DefaultZeroPoint(BITS)));
      // the dot products below are of c - kShift: the zero point moves by kShift
      offset[h] = _mm256_mul_ps(scale[h], _mm256_sub_ps(zp, _mm256_set1_ps(kShift)));
      if (p.bias) offset[h] = _mm256_sub_ps(offset[h], _mm256_loadu_ps(p.bias + at));
    }
    for (int r = 0; r < R; ++r) {
      const int64_t rb = (r0 + r) * nb + b;
      const int32_t* xq = reinterpret_cast<const int32_t*>(p.x->q.data() + rb * kBlock);
      const int32_t* half_sums = p.x->sums.data() + 2 * rb;
      const float xd = p.x->d[rb];
      for (int h = 0; h < SUB; ++h) {
        __m256i dot = _mm256_setzero_si256();
        for (int j = kPer * h; j < kPer * (h + 1); ++j) {
          const __m256i xj = _mm256_set1_epi32(xq[j]);
          const __m256i pairs =
              BITS == 8 ? _mm256_maddubs_epi16(_mm256_sign_epi8(w[j], w[j]), _mm256_sign_epi8(xj, w[j]))
                        : _mm256_maddubs_epi16(w[j], xj);
          dot = _mm256_add_epi32(dot, _mm256_madd_epi16(pairs, ones));
        }
        const int32_t xsum = SUB == 1 ? half_sums[0] + half_sums[1] : half_sums[h];
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                                 _mm256_mul_ps(scale[h], _mm256_set1_ps(xd)), acc[r]);
        acc[r] = _mm256_fnmadd_ps(offset[h], _mm256_set1_ps(xd * static_cast<float>(xsum)), acc[r]);
      }
    }
  }
  const int64_t col = g * kGroup + 8 * half;
  for (int r = 0; r < R; ++r) {
    if (col + 8 <= p.n) {
      _mm256_storeu_ps(p.y + (r0 + r) * p.n + col, acc[r]);
    } else {
      alignas(32) float out[8];
      _mm256_store_ps(out, acc[r]);
      for (int64_t c = col; c < p.n; ++c) p.y[(r0 + r) * p.n + c] = out[c - col];
    }
  }
}

template <int BITS, int SUB>
void GroupAvx2(const Problem& p, int64_t g) {
  const int64_t rows = p.x->rows;
  for (int half = 0; half < 2; ++half) {
    if (g * kGroup + 8 * half >= p.n) break;
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) RowsAvx2<BITS, SUB, 4>(p, g, r, half);
    switch (rows - r) {
      case 3: RowsAvx2<BITS, SUB, 3>(p, g, r, half); break;
      case 2: RowsAvx2<BITS, SUB, 2>(p, g, r, half); break;
      case 1: RowsAvx2<BITS, SUB, 1>(p, g, r, half); break;
      default: break;
    }
  }
}

using GroupFn = void (*)(const Problem&, int64_t);

template <int BITS, int SUB>
GroupFn GroupFor(Isa isa) {
  return isa == Isa::kAvx512 ? GroupAvx512<BITS, SUB>
         : isa == Isa::kAvx2 ? GroupAvx2<BITS, SUB>
                             : GroupScalar<BITS, SUB>;
}

template <int BITS>
GroupFn GroupFor(Isa isa, int64_t block_size) {
  return block_size == 16 ? GroupFor<BITS, 2>(isa) : GroupFor<BITS, 1>(isa);
}

GroupFn GroupFor(Isa isa, int bits, int64_t block_size) {
  switch (bits) {
    case 8: return GroupFor<8>(isa, block_size);
    case 6: return GroupFor<6>(isa, block_size);
    case 5: return GroupFor<5>(isa, block_size);
    default: return GroupFor<4>(isa, block_size);
  }
}

// ---- the op ---------------------------------------------------------------------------

struct Batch {
  const Problem* problem;
  GroupFn group;
  int64_t groups_per_task;
};

void RunTask(void* data, size_t task) {
  const Batch& batch = *static_cast<const Batch*>(data);
  const int64_t first = static_cast<int64_t>(task) * batch.groups_per_task;
  const int64_t last = std::min(first + batch.groups_per_task, batch.problem->groups);
  for (int64_t g = first; g < last; ++g) batch.group(*batch.problem, g);
}

OrtStatusPtr Failed(const std::string& what) {
  return Ort::GetApi().CreateStatus(ORT_INVALID_ARGUMENT, ("MatMulQ: " + what).c_str());
}

struct MatMulQKernel {
  MatMulQKernel(int64_t k, int64_t n, int bits, int64_t block_size, Isa isa)
      : k_(k), n_(n), bits_(bits), block_size_(block_size), isa_(isa) {}

  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    try {
      return Compute(context);
    } catch (const std::exception& e) {
      return Failed(e.what());
    }
  }

 private:
  OrtStatusPtr Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    const Ort::ConstValue a = ctx.GetInput(0), codes = ctx.GetInput(1), scales = ctx.GetInput(2);
    const Ort::ConstValue zero_points =
        ctx.GetInputCount() > 3 ? ctx.GetInput(3) : Ort::ConstValue{nullptr};
    const Ort::ConstValue bias = ctx.GetInputCount() > 4 ? ctx.GetInput(4) : Ort::ConstValue{nullptr};
    const std::vector<int64_t> shape = a.GetTensorTypeAndShapeInfo().GetShape();
    if (shape.empty() || shape.back() != k_)
      return Failed("the input's last dimension must be K = " + std::to_string(k_));
    const int64_t groups = (n_ + kGroup - 1) / kGroup, nb = k_ / kBlock;
    const size_t want = static_cast<size_t>(groups * nb * RecordBytes(bits_));
    const size_t have = codes.GetTensorTypeAndShapeInfo().GetElementCount();
    if (have != want)
      return Failed("codes hold " + std::to_string(have) + " bytes, expected " + std::to_string(want));
    const auto scale_type = scales.GetTensorTypeAndShapeInfo().GetElementType();
    if (scale_type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 &&
        scale_type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT)
      return Failed("scales must be float16 or float");
    const size_t per_block = static_cast<size_t>(groups * (k_ / block_size_) * kGroup);
    if (scales.GetTensorTypeAndShapeInfo().GetElementCount() != per_block ||
        (zero_points && zero_points.GetTensorTypeAndShapeInfo().GetElementCount() != per_block) ||
        (bias && bias.GetTensorTypeAndShapeInfo().GetElementCount() != per_block))
      return Failed("scales, zero points and bias must hold " + std::to_string(per_block) +
                    " values each");

    std::vector<int64_t> out_shape(shape);
    out_shape.back() = n_;
    Ort::UnownedValue y = ctx.GetOutput(0, out_shape);
    int64_t rows = 1;
    for (size_t i = 0; i + 1 < shape.size(); ++i) rows *= shape[i];
    if (rows == 0) return nullptr;

    // per thread, not per kernel: a session may be run from several threads at once
    thread_local QuantizedRows x;
    x.rows = rows;
    x.blocks = nb;
    x.q.resize(static_cast<size_t>(rows * k_));
    x.d.resize(static_cast<size_t>(rows * nb));
    x.sums.resize(static_cast<size_t>(2 * rows * nb));
    auto quantize = isa_ == Isa::kAvx512 ? QuantizeRowAvx512
                    : isa_ == Isa::kAvx2 ? QuantizeRowAvx2
                                         : QuantizeRowScalar;
    const float* in = a.GetTensorData<float>();
    for (int64_t r = 0; r < rows; ++r)
      quantize(in + r * k_, nb, x.q.data() + r * k_, x.d.data() + r * nb, x.sums.data() + 2 * r * nb);

    const Problem problem{&x,
                          codes.GetTensorData<uint8_t>(),
                          scales.GetTensorRawData(),
                          scale_type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16,
                          zero_points ? zero_points.GetTensorData<uint8_t>() : nullptr,
                          bias ? bias.GetTensorData<float>() : nullptr,
                          y.GetTensorMutableData<float>(),
                          n_,
                          groups};
    // tasks of a few groups each: enough of them to balance the pool's threads, each a
    // contiguous run of the weight so that the hardware prefetcher streams it
    const int64_t per_task = std::max<int64_t>(1, groups / 64);
    Batch batch{&problem, GroupFor(isa_, bits_, block_size_), per_task};
    const size_t tasks = static_cast<size_t>((groups + per_task - 1) / per_task);
    ctx.ParallelFor(RunTask, tasks, 0, &batch);
    return nullptr;
  }

  int64_t k_, n_;
  int bits_;
  int64_t block_size_;
  Isa isa_;
};

struct MatMulQOp : Ort::CustomOpBase<MatMulQOp, MatMulQKernel, /*WithStatus=*/true> {
  OrtStatusPtr CreateKernelV2(const OrtApi& /*api*/, const OrtKernelInfo* info, void** kernel) const {
    try {
      Ort::ConstKernelInfo ki(info);
      const int64_t k = ki.GetAttribute<int64_t>("K"), n = ki.GetAttribute<int64_t>("N");
      const int64_t bits = ki.GetAttribute<int64_t>("bits");
      const int64_t block_size = ki.GetAttribute<int64_t>("block_size");
      if (bits != 4 && bits != 5 && bits != 6 && bits != 8)
        return Failed("bits = " + std::to_string(bits) + ", expected 4, 5, 6 or 8");
      if (block_size != 16 && block_size != 32)
        return Failed("block_size = " + std::to_string(block_size) + ", expected 16 or 32");
      if (k <= 0 || k % kBlock != 0)
        return Failed("K = " + std::to_string(k) + ", expected a positive multiple of 32");
      if (n <= 0) return Failed("N = " + std::to_string(n) + ", expected a positive count");
      *kernel = new MatMulQKernel(k, n, static_cast<int>(bits), block_size, BestIsa());
      return nullptr;
    } catch (const std::exception& e) {
      return Failed(e.what());
    }
  }
  const char* GetName() const { return "MatMulQ"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 5; }  // x, codes, scales, zero points, bias
  ONNXTensorElementDataType GetInputType(size_t index) const {
    switch (index) {
      case 0: case 4: return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
      case 2: return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;  // float16 or float
      default: return ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8;
    }
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t index) const {
    return index >= 3 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t /*index*/) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

}  // namespace

extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL
RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  Ort::InitApi(api_base->GetApi(ORT_API_VERSION));
  static MatMulQOp op;
  static Ort::CustomOpDomain domain{nullptr};
  try {
    if (!domain) {
      domain = Ort::CustomOpDomain("meshserve");
      domain.Add(&op);
    }
    Ort::UnownedSessionOptions(options).Add(domain);
  } catch (const Ort::Exception& e) {
    return Ort::GetApi().CreateStatus(ORT_FAIL, e.what());
  }
  return nullptr;
}
