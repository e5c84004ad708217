// genscore's linear for CPUs with AVX-512: y = x W^T + b with W packed once into blocks of 32 output columns, each
// block's inputs in steps side by side ([out / 32, in / step, 32, step]): steps of two for bfloat16, the pairs the
// vdpbf16ps instruction reads (CPUs with avx512_bf16), steps of one for float32 (FMA). A bfloat16 weight can also be
// widened: its inputs in float32 (given so, or a chunk of bfloat16 rows widened at a time into a per-thread buffer),
// each pair of weights widened to float32 in registers and multiplied by FMA, for CPUs whose vdpbf16ps issues at a
// fraction of their FMA rate (models/prepack.py says which). Each block's 32 columns are accumulated in registers
// for up to 14 rows of x at a time over the whole input (float32 calls of many rows: two blocks for up to 6 rows),
// so a weight byte is read from memory once per chunk of rows (a decode step's few rows are bound by that read).
// Built by models/attention_cpu.py with the other CPU kernels; only the avx512 build holds the kernel.
//
// Numbers: products summed in float32 over the whole input in order (float32: in runs of 64 inputs, each run's sum
// added to the total in order), the bias added in float32, one rounding to the output dtype at the end (as oneDNN
// rounds once), so a row's result never depends on the other rows.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t kBlock = 32;  // output columns per block: two vectors of 16 float32 accumulators
constexpr int kMaxRows = 14;    // rows per tile: 28 accumulators + 2 weight vectors + 1 broadcast of 32 registers

int64_t step_of(at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "genscore's linear packs bfloat16 or float32 weights");
  return dtype == at::kBFloat16 ? 2 : 1;
}

at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "an [out, in] weight is packed");
  const int64_t out = weight.size(0), in = weight.size(1), step = step_of(weight.scalar_type());
  TORCH_CHECK(out % kBlock == 0 && in % step == 0, "the packed layout needs out % 32 == 0 and in % ", step, " == 0");
  // [out, in] -> [out / 32, in / step, 32, step]: per block, per step of inputs, the 32 columns' inputs
  return weight.contiguous().view({out / kBlock, kBlock, in / step, step}).permute({0, 2, 1, 3}).contiguous();
}

#if defined(__AVX512F__)

// Rows a chunk holds: chunks whose inputs stay in L2 while every block of the weight passes over them, rather than
// inputs streamed from L3 once per block. bfloat16 inputs: eight tiles, measured on the model's shapes; float32
// inputs: as many rows as fill half of a core's L2, the other half holding the block and the outputs.
template <typename X>
int64_t chunk_rows(int64_t in) {
  if constexpr (!std::is_same_v<X, float>) return 8 * kMaxRows;
  static const int64_t l2_bytes = [] {
#if defined(_SC_LEVEL2_CACHE_SIZE)
    const long reported = sysconf(_SC_LEVEL2_CACHE_SIZE);
    if (reported > 0) return int64_t(reported);
#endif
    return int64_t(1) << 20;  // where the C library does not say
  }();
  return std::max<int64_t>(kMaxRows, l2_bytes / 2 / (in * int64_t(sizeof(float))));
}

// Ask for the cache lines of `next` (the block a tile computes after this one) at the offset this step reads of its
// own block: a tile that rereads its block from cache then keeps memory streaming the next one.
inline void fetch_step(const void* next, int64_t offset_bytes) {
  if (next == nullptr) return;
  const char* p = static_cast<const char*>(next) + offset_bytes;
  __builtin_prefetch(p, 0, 3);  // into L1: measured faster than into L2 (in float32 at 16 rows, L2 gained nothing)
  __builtin_prefetch(p + 64, 0, 3);
}

// y[rows, 32] = a tile's float32 sums (+ bias[32]), each rounded once to bfloat16.
template <int Rows>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) inline void store_bf16_rows(
    const __m512 (&acc)[Rows][2], const float* bias, at::BFloat16* y, int64_t ldy) {
  const __m512 b0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps();
  for (int r = 0; r < Rows; ++r) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[r][0], b0)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy + 16),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[r][1], b1)));
  }
}

// y[rows, 32] = x[rows, in] x one block (+ bias[32]), x and y by rows of `ldx` / `ldy` elements; `steps` = in / 2.
// `next` (or nullptr): the block to fetch while this one is computed.
template <int Rows>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void bf16_tile(
    const at::BFloat16* x, int64_t ldx, const at::BFloat16* block, int64_t steps, const float* bias, at::BFloat16* y,
    int64_t ldy, const at::BFloat16* next) {
  const auto* pairs = reinterpret_cast<const uint32_t*>(x);  // a row's inputs two by two
  const int64_t ldp = ldx / 2;
  __m512 acc[Rows][2];
  for (int r = 0; r < Rows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < steps; ++p) {
    fetch_step(next, p * 2 * kBlock * 2);  // a step reads 2 x 32 bfloat16
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(block + p * 2 * kBlock);  // columns 0-15, input pair p
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(block + p * 2 * kBlock + kBlock);  // columns 16-31
#pragma GCC unroll 14
    for (int r = 0; r < Rows; ++r) {
      const __m512bh v = (__m512bh)_mm512_set1_epi32(pairs[r * ldp + p]);  // row r's pair p, in every lane
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], v, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], v, w1);
    }
  }
  store_bf16_rows<Rows>(acc, bias, y, ldy);
}

constexpr __mmask32 kHighHalves = 0xAAAAAAAAu;  // the odd 16-bit halves of 32-bit lanes: each pair's second input

// The same product from float32 inputs: each step's pairs widened to float32 (a bfloat16 is the high half of a
// float32), the first input's column weights then the second's, each multiplied by FMA; no vdpbf16ps.
template <int Rows>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void widened_bf16_tile(
    const float* x, int64_t ldx, const at::BFloat16* block, int64_t steps, const float* bias, at::BFloat16* y,
    int64_t ldy, const at::BFloat16* next) {
  __m512 acc[Rows][2];
  for (int r = 0; r < Rows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < steps; ++p) {
    fetch_step(next, p * 2 * kBlock * 2);  // a step reads 2 x 32 bfloat16
    const at::BFloat16* pair = block + p * 2 * kBlock;  // [32 columns, 2 inputs]
    for (int half = 0; half < 2; ++half) {  // input 2p (the low halves), then input 2p + 1 (the high halves)
      __m512i raw0 = _mm512_loadu_si512(pair), raw1 = _mm512_loadu_si512(pair + kBlock);
      // The second input's halves kept by a mask register, not a zmm constant: with 28 accumulators a zmm
      // constant left the compiler too few registers, and it spilled accumulators to the stack.
      raw0 = half == 0 ? _mm512_slli_epi32(raw0, 16) : _mm512_maskz_mov_epi16(kHighHalves, raw0);
      raw1 = half == 0 ? _mm512_slli_epi32(raw1, 16) : _mm512_maskz_mov_epi16(kHighHalves, raw1);
      const __m512 w0 = _mm512_castsi512_ps(raw0), w1 = _mm512_castsi512_ps(raw1);  // columns 0-15, 16-31
#pragma GCC unroll 14
      for (int r = 0; r < Rows; ++r) {
        const __m512 v = _mm512_set1_ps(x[r * ldx + 2 * p + half]);  // row r's input, in every lane
        acc[r][0] = _mm512_fmadd_ps(v, w0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(v, w1, acc[r][1]);
      }
    }
  }
  store_bf16_rows<Rows>(acc, bias, y, ldy);
}

// `rows` rows of `in` bfloat16 inputs as float32, in this thread's buffer (valid until its next call): the widened
// tiles' inputs, a chunk of rows at a time, so that they are written where the tiles then read them (L2) and no
// float32 copy of the whole input is made.
const float* widened_rows(const at::BFloat16* x, int64_t rows, int64_t in) {
  thread_local std::vector<float> buffer;
  const int64_t n = rows * in;
  if (int64_t(buffer.size()) < n) buffer.resize(n);
  const auto* bits = reinterpret_cast<const uint16_t*>(x);
  float* out = buffer.data();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {  // a bfloat16 is the high half of a float32
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bits + i)));
    _mm512_storeu_ps(out + i, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
  }
  for (; i < n; ++i) out[i] = static_cast<float>(x[i]);
  return out;
}

// The same for float32, one input a step (`steps` = in). The registers sum runs of kRunSteps inputs and each run's
// sum joins the row's total in memory: a float32 sum's rounding error grows with the number of terms added to one
// accumulator, and float32 must stay within the self-check's bound on models with wide inputs.
constexpr int64_t kRunSteps = 64;

// `Blocks` adjacent blocks at a time: float32 batches of many rows take tiles of kWideRows rows over two blocks (64
// columns, 24 accumulators), where each input read feeds four vectors instead of two; with few rows the tall tiles
// are faster, since a block is read from cache once per tile.
template <int Rows, int Blocks>
void f32_tile(const float* x, int64_t ldx, const float* block, int64_t steps, const float* bias, float* y,
              int64_t ldy, const float* next) {
  constexpr int kVectors = 2 * Blocks;  // of 16 columns, per row
  const int64_t block_size = steps * kBlock;  // the next block's distance
  alignas(64) float total[Rows][kVectors * 16];  // [Rows, 32 x Blocks], the runs' sums so far
  for (int64_t k0 = 0; k0 < steps; k0 += kRunSteps) {
    const int64_t k1 = std::min(steps, k0 + kRunSteps);
    __m512 acc[Rows][kVectors];
    for (int r = 0; r < Rows; ++r)
      for (int v = 0; v < kVectors; ++v) acc[r][v] = _mm512_setzero_ps();
    for (int64_t k = k0; k < k1; ++k) {
      __m512 w[kVectors];  // input k's weights for the tile's columns
      for (int b = 0; b < Blocks; ++b) {
        if (next != nullptr) fetch_step(next + b * block_size, k * kBlock * 4);  // a step reads 32 float32 a block
        w[2 * b] = _mm512_loadu_ps(block + b * block_size + k * kBlock);  // columns 0-15 of block b
        w[2 * b + 1] = _mm512_loadu_ps(block + b * block_size + k * kBlock + 16);  // columns 16-31
      }
#pragma GCC unroll 14
      for (int r = 0; r < Rows; ++r) {
        const __m512 v = _mm512_set1_ps(x[r * ldx + k]);  // row r's input k, in every lane
        for (int c = 0; c < kVectors; ++c) acc[r][c] = _mm512_fmadd_ps(v, w[c], acc[r][c]);
      }
    }
    for (int r = 0; r < Rows; ++r) {
      for (int c = 0; c < kVectors; ++c) {
        if (k0 > 0) acc[r][c] = _mm512_add_ps(_mm512_load_ps(total[r] + 16 * c), acc[r][c]);
        _mm512_store_ps(total[r] + 16 * c, acc[r][c]);
      }
    }
  }
  for (int r = 0; r < Rows; ++r) {
    for (int c = 0; c < kVectors; ++c) {
      const __m512 b = bias ? _mm512_loadu_ps(bias + 16 * c) : _mm512_setzero_ps();
      _mm512_storeu_ps(y + r * ldy + 16 * c, _mm512_add_ps(_mm512_load_ps(total[r] + 16 * c), b));
    }
  }
}

constexpr int kWideRows = 6;  // rows per two-block tile: 24 accumulators + 4 weight vectors + 1 broadcast
constexpr int64_t kWideFromRows = 512;  // float32 calls of this many rows take two-block tiles: measured on the model's
                                        // shapes (even at 304 rows, faster at 608, slower at 152 and fewer)

// A tile's inputs are X, its weights and outputs T.
template <typename X, typename T>
using Tile = void (*)(const X*, int64_t, const T*, int64_t, const float*, T*, int64_t, const T*);

// tiles<X, T>()[r - 1] computes r rows of one block; kWideTiles[r - 1] r rows of two float32 blocks
template <typename X, typename T, int... Rows>
constexpr std::array<Tile<X, T>, sizeof...(Rows)> tiles(std::integer_sequence<int, Rows...>) {
  if constexpr (std::is_same_v<T, float>) {
    return {{&f32_tile<Rows + 1, 1>...}};
  } else if constexpr (std::is_same_v<X, float>) {
    return {{&widened_bf16_tile<Rows + 1>...}};
  } else {
    return {{&bf16_tile<Rows + 1>...}};
  }
}
template <int... Rows>
constexpr std::array<Tile<float, float>, sizeof...(Rows)> wide_tiles(std::integer_sequence<int, Rows...>) {
  return {{&f32_tile<Rows + 1, 2>...}};
}
constexpr auto kWideTiles = wide_tiles(std::make_integer_sequence<int, kWideRows>{});

// The tiles of X inputs over input rows of type S: S = X, or bfloat16 rows widened to float32 a chunk at a time.
template <typename S, typename X, typename T>
void run_tiles(const S* x, const T* w, const float* bias, T* y, int64_t m, int64_t in, int64_t out, int64_t steps) {
  static constexpr auto kTiles = tiles<X, T>(std::make_integer_sequence<int, kMaxRows>{});
  const int64_t block_size = in * kBlock, blocks = out / kBlock;  // elements of one block; blocks
  const Tile<X, T>* table = kTiles.data();
  int64_t group = 1, max_rows = kMaxRows;  // blocks a tile computes, and its most rows
  if constexpr (std::is_same_v<T, float>) {
    if (m >= kWideFromRows && blocks % 2 == 0) table = kWideTiles.data(), group = 2, max_rows = kWideRows;
  }
  // Rows in chunks (chunk_rows) that every group of blocks passes over; within a chunk, tiles of equal size, the
  // blocks reread from cache after the first. Each thread takes a contiguous share, so it streams its part of the
  // weight in order.
  const int64_t rows_per_chunk = chunk_rows<X>(in);
  const int64_t chunks = m <= rows_per_chunk ? 1 : (m + rows_per_chunk - 1) / rows_per_chunk, groups = blocks / group;
  at::parallel_for(0, chunks * groups, 1, [&](int64_t first, int64_t last) {
    int64_t widened_chunk = -1;  // the chunk whose rows this thread's buffer holds
    const X* chunk_x = nullptr;  // [rows_in_chunk, in], the chunk's inputs as the tiles read them
    for (int64_t i = first; i < last; ++i) {
      const int64_t chunk = i / groups, blk = (i % groups) * group;  // the group's first block
      const int64_t c0 = chunk * m / chunks, rows_in_chunk = (chunk + 1) * m / chunks - c0;
      if constexpr (std::is_same_v<S, X>) {
        chunk_x = x + c0 * in;
      } else if (chunk != widened_chunk) {
        chunk_x = widened_rows(x + c0 * in, rows_in_chunk, in);
        widened_chunk = chunk;
      }
      const int64_t row_tiles = (rows_in_chunk + max_rows - 1) / max_rows;
      // With several tiles, the last (reading its blocks from cache) fetches the blocks this thread computes next,
      // so the next group's first tile finds them in cache; one tile streams its blocks in order, which the hardware
      // prefetcher follows on its own.
      const T* next = row_tiles > 1 && i + 1 < last ? w + ((i + 1) % groups) * group * block_size : nullptr;
      for (int64_t t = 0; t < row_tiles; ++t) {
        const int64_t r0 = c0 + t * rows_in_chunk / row_tiles, r1 = c0 + (t + 1) * rows_in_chunk / row_tiles;
        table[r1 - r0 - 1](chunk_x + (r0 - c0) * in, in, w + blk * block_size, steps,
                           bias ? bias + blk * kBlock : nullptr, y + r0 * out + blk * kBlock, out,
                           t == row_tiles - 1 ? next : nullptr);
      }
    }
  });
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                         bool widen) {
  const bool bf16_weight = packed.scalar_type() == at::kBFloat16;
  const bool float_input = x.scalar_type() == at::kFloat && bf16_weight;  // a bfloat16 weight's float32 input: widened
  TORCH_CHECK((x.scalar_type() == packed.scalar_type() || float_input) && packed.dim() == 4,
              "genscore's linear takes an input of its weight's dtype (or float32 for a bfloat16 weight) and a weight "
              "packed by pack_linear_weight");
  TORCH_CHECK(!widen || bf16_weight, "genscore's linear widens bfloat16 weights only");
  const int64_t in = x.size(-1), steps = packed.size(1), out = packed.size(0) * kBlock;
  TORCH_CHECK(in == steps * step_of(packed.scalar_type()), "the input has ", in, " features, the packed weight ",
              steps * packed.size(3));
  const at::Tensor rows = x.reshape({-1, in}).contiguous();  // [M, in]
  const int64_t m = rows.size(0);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out;
  at::Tensor y = at::empty({m, out}, x.options().dtype(packed.scalar_type()));  // [M, out]
  at::Tensor bias_f;
  if (bias.has_value()) bias_f = bias->to(at::kFloat).contiguous();  // [out]
  const float* b = bias.has_value() ? bias_f.data_ptr<float>() : nullptr;
  if (!bf16_weight) {
    run_tiles<float, float, float>(rows.data_ptr<float>(), packed.data_ptr<float>(), b, y.data_ptr<float>(), m, in,
                                   out, steps);
  } else if (float_input) {
    run_tiles<float, float, at::BFloat16>(rows.data_ptr<float>(), packed.data_ptr<at::BFloat16>(), b,
                                          y.data_ptr<at::BFloat16>(), m, in, out, steps);
  } else if (widen) {
    run_tiles<at::BFloat16, float, at::BFloat16>(rows.data_ptr<at::BFloat16>(), packed.data_ptr<at::BFloat16>(), b,
                                                 y.data_ptr<at::BFloat16>(), m, in, out, steps);
  } else {
    run_tiles<at::BFloat16, at::BFloat16, at::BFloat16>(rows.data_ptr<at::BFloat16>(), packed.data_ptr<at::BFloat16>(),
                                                        b, y.data_ptr<at::BFloat16>(), m, in, out, steps);
  }
  return y.view(shape);
}

#else

at::Tensor packed_linear(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, bool) {
  TORCH_CHECK(false, "genscore's linear is built for AVX-512 only");
}

#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(genscore_cpu, m) {
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, Tensor? bias, bool widen=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(genscore_cpu, CPU, m) {
  m.impl("pack_linear_weight", &pack_linear_weight);
  m.impl("packed_linear", &packed_linear);
}
