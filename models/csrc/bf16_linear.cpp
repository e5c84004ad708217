// genscore's bfloat16 linear for CPUs with avx512_bf16 (and no AMX): y = x W^T + b with W packed once into blocks of
// 32 output columns whose input pairs sit next to each other, the layout the vdpbf16ps instruction reads. Each block's
// 32 columns are accumulated in registers for up to 14 rows of x at a time over the whole input, so a weight byte is
// read from memory once per call whatever the row count (decode steps' few rows are bound by that read).
// Built by models/attention_cpu.py with the other CPU kernels; only the avx512 build holds the kernel.
//
// Numbers: products summed in float32 over the whole input in order, the bias added in float32, one rounding to
// bfloat16 at the end (as oneDNN's bfloat16 GEMM rounds once), so a row's result never depends on the other rows.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <array>
#include <cstdint>
#include <utility>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;  // output columns per block: two vectors of 16 float32 accumulators
constexpr int kMaxRows = 14;    // rows per tile: 28 accumulators + 2 weight vectors + 1 broadcast of 32 registers
constexpr int64_t kChunkRows = 8 * kMaxRows;  // rows whose inputs stay in L2 while the weight's blocks pass

at::Tensor pack_bf16_linear(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "a bfloat16 [out, in] weight is packed");
  const int64_t out = weight.size(0), in = weight.size(1);
  TORCH_CHECK(out % kBlock == 0 && in % 2 == 0, "the packed layout needs out % 32 == 0 and an even in");
  // [out, in] -> [out / 32, in / 2, 32, 2]: per block, per input pair, the 32 columns' pairs
  return weight.contiguous().view({out / kBlock, kBlock, in / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

#if defined(__AVX512F__)

// y[rows, 32] = a[rows, in] x one block [in / 2][32][2] (+ bias[32]); a and y by rows of `lda`/`ldy` elements.
template <int Rows>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void tile(
    const uint32_t* a, int64_t lda_pairs, const uint16_t* block, int64_t pairs, const float* bias, uint16_t* y,
    int64_t ldy) {
  __m512 acc[Rows][2];
  for (int r = 0; r < Rows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(block + p * 2 * kBlock);  // columns 0-15, input pair p
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(block + p * 2 * kBlock + kBlock);  // columns 16-31
#pragma GCC unroll 14
    for (int r = 0; r < Rows; ++r) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32(a[r * lda_pairs + p]);  // row r's pair p, in every lane
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, w1);
    }
  }
  const __m512 b0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps();
  for (int r = 0; r < Rows; ++r) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy), (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[r][0], b0)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy + 16),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[r][1], b1)));
  }
}

using Tile = decltype(&tile<1>);

template <int... Rows>
constexpr std::array<Tile, sizeof...(Rows)> tiles(std::integer_sequence<int, Rows...>) {
  return {{&tile<Rows + 1>...}};
}

constexpr auto kTiles = tiles(std::make_integer_sequence<int, kMaxRows>{});  // kTiles[r - 1] computes r rows

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 && packed.dim() == 4,
              "bf16_linear takes a bfloat16 input and a weight packed by pack_bf16_linear");
  const int64_t in = x.size(-1), pairs = packed.size(1), out = packed.size(0) * kBlock;
  TORCH_CHECK(in == 2 * pairs, "the input has ", in, " features, the packed weight ", 2 * pairs);
  const at::Tensor rows = x.reshape({-1, in}).contiguous();  // [M, in]
  const int64_t m = rows.size(0);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out;
  at::Tensor y = at::empty({m, out}, x.options());  // [M, out]
  at::Tensor bias_f;
  if (bias.has_value()) bias_f = bias->to(at::kFloat).contiguous();  // [out]
  const float* b = bias.has_value() ? bias_f.data_ptr<float>() : nullptr;
  const auto* a = reinterpret_cast<const uint32_t*>(rows.data_ptr());
  const auto* w = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  // Rows in chunks whose inputs stay in cache while every block of the weight passes over them; within a chunk,
  // tiles of equal size, the block reread from cache after the first.
  const int64_t chunks = (m + kChunkRows - 1) / kChunkRows, blocks = packed.size(0);
  at::parallel_for(0, chunks * blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      const int64_t chunk = i / blocks, blk = i % blocks;
      const int64_t c0 = chunk * m / chunks, rows_in_chunk = (chunk + 1) * m / chunks - c0;
      const int64_t tiles = (rows_in_chunk + kMaxRows - 1) / kMaxRows;
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t r0 = c0 + t * rows_in_chunk / tiles, r1 = c0 + (t + 1) * rows_in_chunk / tiles;
        kTiles[r1 - r0 - 1](a + r0 * pairs, pairs, w + blk * pairs * 2 * kBlock, pairs, b ? b + blk * kBlock : nullptr,
                            yp + r0 * out + blk * kBlock, out);
      }
    }
  });
  return y.view(shape);
}

#else

at::Tensor bf16_linear(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&) {
  TORCH_CHECK(false, "bf16_linear is built for AVX-512 only");
}

#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(genscore_cpu, m) {
  m.def("pack_bf16_linear(Tensor weight) -> Tensor");
  m.def("bf16_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(genscore_cpu, CPU, m) {
  m.impl("pack_bf16_linear", &pack_bf16_linear);
  m.impl("bf16_linear", &bf16_linear);
}
