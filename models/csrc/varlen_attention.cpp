// genscore's CPU attention kernels. varlen_attention: causal attention inside each segment of a packed row, every
// segment and head of a layer in one call; a segment may also read a span of other keys in full first (a shared
// prefix's). decode_attention: a decode step's one query per row against that row's own keys in the decode cache,
// every row and head of a layer in one call. Built by models/attention_cpu.py for one instruction set (its TARGETS).
//
// Numbers: scores, softmax and the weighted sum of values are computed in float32 whatever the input dtype (as
// SDPA's CPU flash kernel does), each query's over exactly the keys it sees, so a query's result depends only on
// its own segment.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

// Floats in one vector (a block of keys' scores, a slice of a value row): one register of the widest the build targets.
// A vector wider than the registers is split by the compiler and the accumulators no longer fit in registers.
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
#elif defined(__AVX2__)
constexpr int64_t kLanes = 8;
#else
constexpr int64_t kLanes = 4;
#endif
constexpr int64_t kRows = 4;    // queries computed together, so each key block loaded serves them all
constexpr int64_t kChunk = 64;  // queries per work item: a long segment is shared out across threads

typedef float vec __attribute__((vector_size(kLanes * sizeof(float))));

inline vec load(const float* p) {
  vec v;
  __builtin_memcpy(&v, p, sizeof(vec));
  return v;
}

inline void store(float* p, const vec& v) { __builtin_memcpy(p, &v, sizeof(vec)); }

typedef uint32_t bits __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef uint16_t half_bits __attribute__((vector_size(kLanes * sizeof(uint16_t))));

// A row of D results, rows[c] * factor, stored as T. bfloat16 is rounded as c10::BFloat16 rounds (to nearest even,
// NaN to 0x7FC0), a vector at a time: converting element by element costs as much as the attention's sums.
template <typename T, int64_t D>
inline void store_row(T* out, const vec* rows, float factor) {
  for (int64_t c = 0; c < D / kLanes; ++c) {
    const vec x = rows[c] * factor;
    if constexpr (std::is_same_v<T, float>) {
      store(out + c * kLanes, x);
    } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
      bits u;
      __builtin_memcpy(&u, &x, sizeof(u));
      bits rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
      const bits nan = (bits)(x != x);  // all ones in the lanes that hold NaN
      rounded = (rounded & ~nan) | (0x7FC0u & nan);
      const half_bits narrow = __builtin_convertvector(rounded, half_bits);
      __builtin_memcpy(out + c * kLanes, &narrow, sizeof(narrow));
    } else {
      for (int64_t l = 0; l < kLanes; ++l) out[c * kLanes + l] = static_cast<T>(x[l]);
    }
  }
}

// Queries [begin, end) of one segment and one query head. Its own keys: keys_t [D, stride], the head's keys
// transposed, the segment's first key at column 0, zeros past the last row; values [., D] likewise. Its span (keys it
// reads in full before its own, span_length of them, none when 0): span_keys_t and span_values, laid out the same.
// q and out point at the segment's first token of that head. window: a query sees itself and the window - 1 own
// keys before it (0: all; never with a span).
template <typename T, int64_t D>
void attend(const T* q, int64_t q_step, const float* keys_t, const float* values, const float* span_keys_t,
            const float* span_values, int64_t span_length, int64_t stride, T* out, int64_t out_step, int64_t begin,
            int64_t end, float scale, int64_t window, std::vector<float>& scores) {
  const int64_t span_width = (span_length + kLanes - 1) / kLanes * kLanes;  // score columns, whole blocks
  const int64_t width = span_width + (end + kLanes - 1) / kLanes * kLanes;
  scores.resize(kRows * width);
  float query[kRows][D];
  // scores [r, offset + j) = Q K^T for keys [from, to) of keys_t, one block of kLanes keys at a time
  auto score = [&](const float* kt, int64_t from, int64_t to, int64_t offset) {
    for (int64_t jb = from; jb < to; jb += kLanes) {
      vec acc[kRows] = {};
      for (int64_t d = 0; d < D; ++d) {
        const vec k = load(kt + d * stride + jb);
        for (int64_t r = 0; r < kRows; ++r) acc[r] += query[r][d] * k;
      }
      for (int64_t r = 0; r < kRows; ++r) store(scores.data() + r * width + offset + jb, acc[r]);
    }
  };
  vec acc[kRows][D / kLanes];
  // acc += P V for keys [from, to) of values, their weights at scores [r, offset + j)
  auto weigh = [&](const float* vs, int64_t from, int64_t to, int64_t offset) {
    for (int64_t j = from; j < to; ++j) {
      vec v[D / kLanes];
      __builtin_memcpy(v, vs + j * D, sizeof(v));
      for (int64_t r = 0; r < kRows; ++r) {
        const float p = scores[r * width + offset + j];
        for (int64_t c = 0; c < D / kLanes; ++c) acc[r][c] += p * v[c];
      }
    }
  };
  for (int64_t i0 = begin; i0 < end; i0 += kRows) {
    const int64_t rows = std::min(kRows, end - i0);
    for (int64_t r = 0; r < kRows; ++r)
      for (int64_t d = 0; d < D; ++d)
        query[r][d] = r < rows ? static_cast<float>(q[(i0 + r) * q_step + d]) * scale : 0.f;
    // own keys [first, last) cover every row of the block; first starts a whole block
    const int64_t last = i0 + rows;
    const int64_t first = window > 0 ? std::max<int64_t>(0, i0 - window + 1) / kLanes * kLanes : 0;
    score(span_keys_t, 0, span_length, 0);
    score(keys_t, first, last, span_width);
    float inverse[kRows] = {};
    for (int64_t r = 0; r < kRows; ++r) {  // softmax over the keys each row sees; weight 0 for the rest
      float* span_row = scores.data() + r * width;
      float* row = span_row + span_width;
      if (r >= rows) {
        std::fill(span_row, span_row + span_length, 0.f);
        std::fill(row + first, row + last, 0.f);
        continue;
      }
      const int64_t own = i0 + r;
      const int64_t lo = window > 0 ? std::max<int64_t>(0, own - window + 1) : 0;
      float top = row[lo];
      for (int64_t j = lo + 1; j <= own; ++j) top = std::max(top, row[j]);
      for (int64_t j = 0; j < span_length; ++j) top = std::max(top, span_row[j]);
      float total = 0.f;
      for (int64_t j = 0; j < span_length; ++j) {
        span_row[j] = std::exp(span_row[j] - top);
        total += span_row[j];
      }
      for (int64_t j = lo; j <= own; ++j) {
        row[j] = std::exp(row[j] - top);
        total += row[j];
      }
      std::fill(row + first, row + lo, 0.f);
      std::fill(row + own + 1, row + last, 0.f);
      inverse[r] = 1.f / total;
    }
    for (int64_t r = 0; r < kRows; ++r)
      for (int64_t c = 0; c < D / kLanes; ++c) acc[r][c] = vec{};
    weigh(span_values, 0, span_length, 0);
    weigh(values, first, last, span_width);
    for (int64_t r = 0; r < rows; ++r) store_row<T, D>(out + (i0 + r) * out_step, acc[r], inverse[r]);
  }
}

template <typename T, int64_t D>
void attend_all(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, at::Tensor& out,
                const int64_t* bounds, const int64_t* spans, int64_t segments, float scale, int64_t window,
                int64_t max_segment) {
  const int64_t tokens = query.size(0), heads = query.size(1), kv_heads = key.size(1), group = heads / kv_heads;
  const int64_t keys = key.size(0), past = keys - tokens;  // own keys of the row follow `past` earlier ones
  const T* q = query.data_ptr<T>();
  const T* k = key.data_ptr<T>();
  const T* v = value.data_ptr<T>();
  T* o = out.data_ptr<T>();
  // Keys transposed and values, in float32, once per call: [H_kv, D, stride] and [H_kv, keys, D]. A block of keys
  // may read past the last key: those columns are zeros.
  const int64_t stride = keys + kLanes;
  std::vector<float> keys_t(kv_heads * D * stride, 0.f), values(kv_heads * keys * D);
  at::parallel_for(0, kv_heads * keys, 256, [&](int64_t first, int64_t last) {
    for (int64_t x = first; x < last; ++x) {
      const int64_t h = x / keys, t = x % keys;
      const T* kx = k + t * key.stride(0) + h * key.stride(1);
      const T* vx = v + t * value.stride(0) + h * value.stride(1);
      for (int64_t d = 0; d < D; ++d) {
        keys_t[(h * D + d) * stride + t] = static_cast<float>(kx[d]);
        values[(h * keys + t) * D + d] = static_cast<float>(vx[d]);
      }
    }
  });
  std::vector<std::pair<int64_t, int64_t>> chunks;  // (segment, first query) of each work item, for every head
  for (int64_t seg = 0; seg < segments; ++seg) {
    if (max_segment > 0 && bounds[seg + 1] - bounds[seg] > max_segment) continue;  // left to the caller
    for (int64_t i = 0; i < bounds[seg + 1] - bounds[seg]; i += kChunk) chunks.emplace_back(seg, i);
  }
  const int64_t items = static_cast<int64_t>(chunks.size()) * heads;
  std::atomic<int64_t> next{0};  // items are taken one by one: segments of different lengths stay balanced
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> scores;
    for (int64_t item = next++; item < items; item = next++) {
      const auto [seg, begin] = chunks[item / heads];
      const int64_t h = item % heads, kv = h / group, start = bounds[seg];
      const int64_t end = std::min(begin + kChunk, bounds[seg + 1] - start);
      const int64_t span_start = spans ? spans[2 * seg] : 0, span_length = spans ? spans[2 * seg + 1] - span_start : 0;
      const float* head_keys_t = keys_t.data() + kv * D * stride;
      const float* head_values = values.data() + kv * keys * D;
      attend<T, D>(q + start * query.stride(0) + h * query.stride(1), query.stride(0),
                   head_keys_t + past + start, head_values + (past + start) * D, head_keys_t + span_start,
                   head_values + span_start * D, span_length, stride, o + start * out.stride(0) + h * out.stride(1),
                   out.stride(0), begin, end, scale, window, scores);
    }
  });
}

// query [T, H, D]; key and value [past + T, H_kv, D], the row's own keys last; all with the head dim contiguous.
// cu_seqlens [n + 1]: the segments' boundaries in the row. spans (optional) [n, 2]: per segment, the [start, end)
// of the key rows it reads in full before its own (empty: none). max_segment (0: none): segments longer than this
// are not computed, their rows of the result left unwritten for the caller. Returns [T, H, D].
at::Tensor varlen_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                            const at::Tensor& cu_seqlens, const std::optional<at::Tensor>& spans, double scale,
                            int64_t window, int64_t max_segment) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.dim() == 3, "query, key, value must be [T, heads, dim]");
  TORCH_CHECK(query.stride(2) == 1 && key.stride(2) == 1 && value.stride(2) == 1, "the head dim must be contiguous");
  TORCH_CHECK(key.sizes() == value.sizes() && key.size(2) == query.size(2), "key and value must match the query");
  TORCH_CHECK(key.size(0) >= query.size(0), "the row's own keys must be the last key rows");
  TORCH_CHECK(query.size(1) % key.size(1) == 0, "query heads must be a multiple of key/value heads");
  TORCH_CHECK(query.scalar_type() == key.scalar_type() && key.scalar_type() == value.scalar_type(),
              "query, key and value must share a dtype");
  const auto bounds = cu_seqlens.to(at::kLong).contiguous();
  const int64_t* b = bounds.data_ptr<int64_t>();
  const int64_t segments = bounds.numel() - 1;
  TORCH_CHECK(segments >= 0 && b[0] == 0 && b[segments] == query.size(0), "cu_seqlens must span the row");
  at::Tensor span_bounds;
  const int64_t* sp = nullptr;
  if (spans.has_value()) {
    span_bounds = spans->to(at::kLong).contiguous();
    TORCH_CHECK(span_bounds.numel() == 2 * segments, "spans must be [segments, 2]");
    TORCH_CHECK(window == 0, "a sliding window with spans is not built");
    sp = span_bounds.data_ptr<int64_t>();
    for (int64_t seg = 0; seg < segments; ++seg)
      TORCH_CHECK(0 <= sp[2 * seg] && sp[2 * seg] <= sp[2 * seg + 1] && sp[2 * seg + 1] <= key.size(0),
                  "a span must lie within the key rows");
  }
  auto out = at::empty(query.sizes(), query.options());
  const float s = static_cast<float>(scale);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, query.scalar_type(), "varlen_attention", [&] {
    switch (query.size(2)) {
      case 16: attend_all<scalar_t, 16>(query, key, value, out, b, sp, segments, s, window, max_segment); break;
      case 32: attend_all<scalar_t, 32>(query, key, value, out, b, sp, segments, s, window, max_segment); break;
      case 64: attend_all<scalar_t, 64>(query, key, value, out, b, sp, segments, s, window, max_segment); break;
      case 80: attend_all<scalar_t, 80>(query, key, value, out, b, sp, segments, s, window, max_segment); break;
      case 96: attend_all<scalar_t, 96>(query, key, value, out, b, sp, segments, s, window, max_segment); break;
      case 128: attend_all<scalar_t, 128>(query, key, value, out, b, sp, segments, s, window, max_segment); break;
      case 256: attend_all<scalar_t, 256>(query, key, value, out, b, sp, segments, s, window, max_segment); break;
      default: TORCH_CHECK(false, "no build for a head dimension of ", query.size(2));
    }
  });
  return out;
}

constexpr int64_t kHeadTile = 4;  // query heads of one key/value head computed together in decode_all
// Key and value rows fetched ahead of use: a decode step reads each layer's cache once, so its rows come from memory,
// and a work item's few rows are too short a stream for the hardware prefetcher to hide that.
constexpr int64_t kAhead = 8;

// The row of D values at p as float32 vectors (bfloat16 widened).
template <typename T, int64_t D>
inline void load_row(const T* p, vec* out) {
  if constexpr (std::is_same_v<T, float>) {
    __builtin_memcpy(out, p, D * sizeof(float));
  } else {
    float row[D];
    for (int64_t d = 0; d < D; ++d) row[d] = static_cast<float>(p[d]);
    __builtin_memcpy(out, row, D * sizeof(float));
  }
}

// Ask for the cache lines of the row at p before it is read.
template <typename T, int64_t D>
inline void fetch_row(const T* p) {
  for (int64_t byte = 0; byte < D * static_cast<int64_t>(sizeof(T)); byte += 64)
    __builtin_prefetch(reinterpret_cast<const char*>(p) + byte);
}

inline float lane_sum(const vec& v) {
  float total = 0.f;
  for (int64_t l = 0; l < kLanes; ++l) total += v[l];
  return total;
}

// R query heads (queries [R][D], scaled) against `length` key rows: out rows [R] of D. Scores, softmax and the
// weighted sum in float32; each key and value row is loaded once for the R heads.
template <typename T, int64_t D, int64_t R>
void decode_heads(const float (*queries)[D], const T* keys, int64_t key_step, const T* values, int64_t value_step,
                  int64_t length, T* out, int64_t out_step, std::vector<float>& scores) {
  constexpr int64_t C = D / kLanes;
  scores.resize(R * length);
  vec q[R][C];
  for (int64_t r = 0; r < R; ++r) __builtin_memcpy(q[r], queries[r], sizeof(q[r]));
  for (int64_t j = 0; j < std::min(kAhead, length); ++j) {
    fetch_row<T, D>(keys + j * key_step);
    fetch_row<T, D>(values + j * value_step);
  }
  for (int64_t j = 0; j < length; ++j) {  // scores [r, j] = q_r . k_j; the values are fetched here for the sum below
    if (j + kAhead < length) {
      fetch_row<T, D>(keys + (j + kAhead) * key_step);
      fetch_row<T, D>(values + (j + kAhead) * value_step);
    }
    vec k[C];
    load_row<T, D>(keys + j * key_step, k);
    for (int64_t r = 0; r < R; ++r) {
      vec acc = q[r][0] * k[0];
      for (int64_t c = 1; c < C; ++c) acc += q[r][c] * k[c];
      scores[r * length + j] = lane_sum(acc);
    }
  }
  float inverse[R];
  for (int64_t r = 0; r < R; ++r) {  // softmax over the row's keys
    float* p = scores.data() + r * length;
    const float top = *std::max_element(p, p + length);
    float total = 0.f;
    for (int64_t j = 0; j < length; ++j) {
      p[j] = std::exp(p[j] - top);
      total += p[j];
    }
    inverse[r] = 1.f / total;
  }
  vec acc[R][C] = {};
  for (int64_t j = 0; j < length; ++j) {  // acc [r] += p [r, j] v_j
    vec v[C];
    load_row<T, D>(values + j * value_step, v);
    for (int64_t r = 0; r < R; ++r) {
      const float p = scores[r * length + j];
      for (int64_t c = 0; c < C; ++c) acc[r][c] += p * v[c];
    }
  }
  for (int64_t r = 0; r < R; ++r) store_row<T, D>(out + r * out_step, acc[r], inverse[r]);
}

// One decode step's attention: per row b and query head, its one query against the last lengths[b] key columns of
// that row (its real tokens; the left padding before them is never read), in float32 as varlen_attention computes.
// The query heads that share a key/value head are one work item, taken kHeadTile at a time, so each key and value
// row is read once for them.
template <typename T, int64_t D>
void decode_all(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, at::Tensor& out,
                const int64_t* lengths, float scale) {
  const int64_t rows = query.size(0), heads = query.size(1), kv_heads = key.size(1), group = heads / kv_heads;
  const int64_t width = key.size(2);
  const T* q = query.data_ptr<T>();
  const T* k = key.data_ptr<T>();
  const T* v = value.data_ptr<T>();
  T* o = out.data_ptr<T>();
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t first, int64_t last) {
    std::vector<float> scores;
    float queries[kHeadTile][D];
    for (int64_t x = first; x < last; ++x) {
      const int64_t b = x / kv_heads, kv = x % kv_heads, length = lengths[b], start = width - length;
      const T* keys = k + b * key.stride(0) + kv * key.stride(1) + start * key.stride(2);
      const T* values = v + b * value.stride(0) + kv * value.stride(1) + start * value.stride(2);
      for (int64_t h0 = 0; h0 < group; h0 += kHeadTile) {
        const int64_t tile = std::min(kHeadTile, group - h0), h = kv * group + h0;
        for (int64_t r = 0; r < tile; ++r) {
          const T* qr = q + b * query.stride(0) + (h + r) * query.stride(1);
          for (int64_t d = 0; d < D; ++d) queries[r][d] = static_cast<float>(qr[d]) * scale;
        }
        T* out_rows = o + b * out.stride(0) + h * out.stride(1);
        const auto run = [&](auto heads_in_tile) {
          decode_heads<T, D, decltype(heads_in_tile)::value>(queries, keys, key.stride(2), values, value.stride(2),
                                                              length, out_rows, out.stride(1), scores);
        };
        switch (tile) {
          case 1: run(std::integral_constant<int64_t, 1>{}); break;
          case 2: run(std::integral_constant<int64_t, 2>{}); break;
          case 3: run(std::integral_constant<int64_t, 3>{}); break;
          default: run(std::integral_constant<int64_t, 4>{}); break;
        }
      }
    }
  });
}

// query [B, H, D]; key and value [B, H_kv, W, D] (views of larger buffers welcome), all with the head dim contiguous;
// lengths [B]: row b's keys are its last lengths[b] columns, 1 <= lengths[b] <= W. Returns [B, H, D].
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                            const at::Tensor& lengths, double scale) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 4 && value.dim() == 4, "query must be [B, H, D], key and value [B, H_kv, W, D]");
  TORCH_CHECK(query.stride(2) == 1 && key.stride(3) == 1 && value.stride(3) == 1, "the head dim must be contiguous");
  TORCH_CHECK(key.sizes() == value.sizes() && key.size(3) == query.size(2) && key.size(0) == query.size(0),
              "key and value must match the query");
  TORCH_CHECK(query.size(1) % key.size(1) == 0, "query heads must be a multiple of key/value heads");
  TORCH_CHECK(query.scalar_type() == key.scalar_type() && key.scalar_type() == value.scalar_type(),
              "query, key and value must share a dtype");
  const auto counts = lengths.to(at::kLong).contiguous();
  TORCH_CHECK(counts.numel() == query.size(0), "lengths must have one entry per row");
  const int64_t* n = counts.data_ptr<int64_t>();
  for (int64_t b = 0; b < counts.numel(); ++b)
    TORCH_CHECK(1 <= n[b] && n[b] <= key.size(2), "a row's length must be within the key columns");
  auto out = at::empty(query.sizes(), query.options());
  const float s = static_cast<float>(scale);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, query.scalar_type(), "decode_attention", [&] {
    switch (query.size(2)) {
      case 16: decode_all<scalar_t, 16>(query, key, value, out, n, s); break;
      case 32: decode_all<scalar_t, 32>(query, key, value, out, n, s); break;
      case 64: decode_all<scalar_t, 64>(query, key, value, out, n, s); break;
      case 80: decode_all<scalar_t, 80>(query, key, value, out, n, s); break;
      case 96: decode_all<scalar_t, 96>(query, key, value, out, n, s); break;
      case 128: decode_all<scalar_t, 128>(query, key, value, out, n, s); break;
      case 256: decode_all<scalar_t, 256>(query, key, value, out, n, s); break;
      default: TORCH_CHECK(false, "no build for a head dimension of ", query.size(2));
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(genscore_cpu, m) {
  m.def(
      "varlen_attention(Tensor query, Tensor key, Tensor value, Tensor cu_seqlens, Tensor? spans, float scale, "
      "int window, int max_segment) -> Tensor");
  m.def("decode_attention(Tensor query, Tensor key, Tensor value, Tensor lengths, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(genscore_cpu, CPU, m) {
  m.impl("varlen_attention", &varlen_attention);
  m.impl("decode_attention", &decode_attention);
}
