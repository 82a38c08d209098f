// Decode attention read straight from KIVI's packed codes (Liu et al. 2024) on the CPU: the two products of
// headlab/decode/codes.py (key_scores, value_output), each one pass over the codes, accumulating in float32,
// with no dequantized copy of the cache (the value output unpacks at most 64 tokens' codes at a time), and
// KIVI's quantizer for the value a decode step stores (quantize_values in headlab/decode/quant.py). The PyTorch
// functions compute the same numbers and are the reference in tests; this file is compiled with onepass.cpp into
// the one extension (setup.py) and called only by headlab/attention/backends/native_codes.py.
//
// Packing (headlab/decode/quant.py): 8 / bits codes to a byte along the channels, the first in the low bits,
// so byte i holds channels per * i + p, p = 0 .. per - 1, read as (byte >> (bits * p)) & mask.
//
// Keys, per channel: codes (BH, t, d * bits / 8) uint8; scale and zero (BH, G, d), row 0 covering the first
// `head` tokens (a window may have cut the first group short) and row k >= 1 the `group` tokens from
// head + (k - 1) * group. A query row q scores key j of row g as (q * s[g]) . code_j + q . z[g].
// Values, per token: codes (BH, t, dv * bits / 8); scale and zero (BH, t, G), G groups of dv / G channels.
// The output of weights p over them is sum_t p_t s[t, g(c)] code[t, c] + sum_t p_t z[t, g(c)].
// Scales and zeros are float32, float16 or bfloat16 (the cache's storage dtype), read as float32.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kChunk = 1024;  // tokens per work unit (a unit of keys starts at a whole scale row)

void check_codes(const torch::Tensor& codes, const torch::Tensor& scale, const torch::Tensor& zero, int64_t bits) {
  TORCH_CHECK(bits == 2 || bits == 4 || bits == 8, "bits must be 2, 4 or 8, got ", bits);
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 3 && codes.is_contiguous(),
              "codes: a contiguous (BH, t, bytes) uint8 tensor");
  TORCH_CHECK(scale.sizes() == zero.sizes() && scale.dim() == 3 && scale.is_contiguous() && zero.is_contiguous() &&
                  scale.scalar_type() == zero.scalar_type(),
              "scale and zero: contiguous (BH, rows, n) tensors of one shape and dtype");
  TORCH_CHECK(scale.size(0) == codes.size(0), "scale and codes hold different numbers of heads");
}

// One token's codes in plane order: u[p * nb + i] = code of channel per * i + p. The pointers do not alias (the
// codes are bytes, which may alias anything, so without __restrict__ the loop is not vectorized).
template <int bits>
inline void unpack_planes(const uint8_t* __restrict__ x, int64_t nb, float* __restrict__ u) {
  constexpr int per = 8 / bits;
  constexpr unsigned mask = (1u << bits) - 1u;
  for (int p = 0; p < per; ++p) {
    const int sh = bits * p;
    float* __restrict__ up = u + p * nb;
    for (int64_t i = 0; i < nb; ++i) up[i] = static_cast<float>((static_cast<unsigned>(x[i]) >> sh) & mask);
  }
}

inline float sum_lanes(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return a + b; }, v);
}

template <typename S, int bits>
void key_scores_impl(const float* q, const uint8_t* codes, const S* scale, const S* zero, float* out, int64_t BH,
                     int64_t r, int64_t d, int64_t t, int64_t rows, int64_t group, int64_t head) {
  constexpr int per = 8 / bits;
  const int64_t nb = d / per;
  std::vector<int64_t> perm(d);  // channel c's column in plane order
  for (int64_t c = 0; c < d; ++c) perm[c] = (c % per) * nb + c / per;
  const int64_t off = head > 0 ? 1 : 0;  // scale rows before the whole groups
  // work units: (head, chunk of tokens): the first row's tokens, then whole scale rows at a time
  const int64_t step = std::max<int64_t>(group, kChunk / group * group);
  std::vector<int64_t> starts{0};
  for (int64_t a = head > 0 ? head : step; a < t; a += step) starts.push_back(a);
  const int64_t n_chunks = static_cast<int64_t>(starts.size());
  at::parallel_for(0, BH * n_chunks, 1, [&](int64_t u0, int64_t u1) {
    std::vector<float> qs(r * d), qz(r), u(d);
    for (int64_t unit = u0; unit < u1; ++unit) {
      const int64_t bh = unit / n_chunks, ci = unit % n_chunks;
      const int64_t a = starts[ci], b = ci + 1 < n_chunks ? starts[ci + 1] : t;
      const float* qh = q + bh * r * d;
      float* oh = out + bh * r * t;
      for (int64_t j = a; j < b;) {  // one scale row at a time: its tokens share q * s[g] and q . z[g]
        const int64_t g = j < head ? 0 : off + (j - head) / group;
        const int64_t e = std::min(b, j < head ? head : head + (g - off + 1) * group);
        TORCH_CHECK(g < rows, "the keys' scale rows do not cover token ", j);
        const S* sg = scale + (bh * rows + g) * d;
        const S* zg = zero + (bh * rows + g) * d;
        for (int64_t k = 0; k < r; ++k) {  // q * s[g] in plane order, and q . z[g], for every query row
          float z = 0.f;
          for (int64_t c = 0; c < d; ++c) {
            qs[k * d + perm[c]] = qh[k * d + c] * static_cast<float>(sg[c]);
            z += qh[k * d + c] * static_cast<float>(zg[c]);
          }
          qz[k] = z;
        }
        for (; j < e; ++j) {
          unpack_planes<bits>(codes + (bh * t + j) * nb, nb, u.data());
          for (int64_t k = 0; k < r; ++k) {
            const float* qk = qs.data() + k * d;
            Vec vacc(0.f);
            int64_t c = 0;
            for (; c + Vec::size() <= d; c += Vec::size())
              vacc = at::vec::fmadd(Vec::loadu(qk + c), Vec::loadu(u.data() + c), vacc);
            float acc = sum_lanes(vacc);
            for (; c < d; ++c) acc += qk[c] * u[c];
            oh[k * t + j] = acc + qz[k];
          }
        }
      }
    }
  });
}

// ak[c + i V] += sum_j W[j, gs[i]] U[j, c + i V] for i < N vectors of V = Vec::size() columns: the N sums stay in
// registers over the n tokens (U: n rows of dv plane-order columns; W: n rows of G weights).
template <int N>
inline void add_columns(const float* __restrict__ U, const float* __restrict__ W, int64_t n, int64_t dv, int64_t G,
                        int64_t c, const int64_t* gs, float* __restrict__ ak) {
  Vec acc[N];
  for (int i = 0; i < N; ++i) acc[i] = Vec(0.f);
  for (int64_t j = 0; j < n; ++j) {
    const float* uj = U + j * dv + c;
    const float* wj = W + j * G;
    for (int i = 0; i < N; ++i) acc[i] = at::vec::fmadd(Vec::loadu(uj + i * Vec::size()), Vec(wj[gs[i]]), acc[i]);
  }
  for (int i = 0; i < N; ++i) (acc[i] + Vec::loadu(ak + c + i * Vec::size())).store(ak + c + i * Vec::size());
}

template <typename S, int bits>
void value_output_impl(const float* p, const uint8_t* codes, const S* scale, const S* zero, float* out, int64_t BH,
                       int64_t r, int64_t dv, int64_t t, int64_t G) {
  constexpr int per = 8 / bits;
  const int64_t nb = dv / per, gsize = dv / G;
  // the group of each plane-order column; when a group is whole bytes (gsize % per == 0), its columns in a
  // plane are one block of cols = gsize / per
  const bool blocks = gsize % per == 0;
  const int64_t cols = gsize / per;
  std::vector<int64_t> grp(dv);
  for (int p = 0; p < per; ++p)
    for (int64_t i = 0; i < nb; ++i) grp[p * nb + i] = (per * i + p) / gsize;
  // the fast path: every vector of V plane-order columns lies in one group (a group is whole vectors of bytes)
  constexpr int64_t V = Vec::size(), kSub = 64;
  const bool fast = blocks && cols % V == 0;
  std::vector<int64_t> vgrp(fast ? dv / V : 0);  // the group of each vector of columns
  for (size_t i = 0; i < vgrp.size(); ++i) vgrp[i] = grp[i * V];
  const int64_t n_chunks = std::max<int64_t>(1, (t + kChunk - 1) / kChunk);
  // partial sums per (head, chunk): the codes' part in plane order, then the zeros' part per group
  std::vector<float> part(BH * n_chunks * r * (dv + G), 0.f);
  at::parallel_for(0, BH * n_chunks, 1, [&](int64_t u0, int64_t u1) {
    std::vector<float> u(dv), w(dv), sr(G), sf(kChunk * G), zf(kChunk * G);
    std::vector<float> U(fast ? kSub * dv : 0), W(fast ? kSub * G : 0);
    for (int64_t unit = u0; unit < u1; ++unit) {
      const int64_t bh = unit / n_chunks, ci = unit % n_chunks;
      const int64_t a = ci * kChunk, b = std::min(t, a + kChunk);
      float* acc = part.data() + unit * r * (dv + G);
      for (int64_t i = 0; i < (b - a) * G; ++i) {  // the chunk's scales and zeros as float32, once
        sf[i] = static_cast<float>(scale[(bh * t + a) * G + i]);
        zf[i] = static_cast<float>(zero[(bh * t + a) * G + i]);
      }
      if (fast) {  // blocks of kSub tokens unpacked once, then each head's sums in registers over the block
        for (int64_t s0 = a; s0 < b; s0 += kSub) {
          const int64_t n = std::min(kSub, b - s0);
          for (int64_t j = 0; j < n; ++j) unpack_planes<bits>(codes + (bh * t + s0 + j) * nb, nb, U.data() + j * dv);
          for (int64_t k = 0; k < r; ++k) {
            const float* pk = p + (bh * r + k) * t + s0;
            float* ak = acc + k * (dv + G);
            for (int64_t j = 0; j < n; ++j)
              for (int64_t g = 0; g < G; ++g) {
                W[j * G + g] = pk[j] * sf[(s0 - a + j) * G + g];
                ak[dv + g] += pk[j] * zf[(s0 - a + j) * G + g];
              }
            int64_t c = 0;
            for (; c + 4 * V <= dv; c += 4 * V) add_columns<4>(U.data(), W.data(), n, dv, G, c, vgrp.data() + c / V, ak);
            for (; c + 2 * V <= dv; c += 2 * V) add_columns<2>(U.data(), W.data(), n, dv, G, c, vgrp.data() + c / V, ak);
            for (; c < dv; c += V) add_columns<1>(U.data(), W.data(), n, dv, G, c, vgrp.data() + c / V, ak);
          }
        }
        continue;
      }
      for (int64_t j = a; j < b; ++j) {
        unpack_planes<bits>(codes + (bh * t + j) * nb, nb, u.data());
        const float* sj = sf.data() + (j - a) * G;
        const float* zj = zf.data() + (j - a) * G;
        for (int64_t k = 0; k < r; ++k) {
          const float pk = p[(bh * r + k) * t + j];
          float* ak = acc + k * (dv + G);
          for (int64_t g = 0; g < G; ++g) {
            sr[g] = pk * sj[g];
            ak[dv + g] += pk * zj[g];
          }
          if (blocks) {
            for (int p = 0; p < per; ++p)
              for (int64_t g = 0; g < G; ++g) {
                const int64_t c0 = p * nb + g * cols;
                const Vec vs(sr[g]);
                int64_t c = 0;
                for (; c + Vec::size() <= cols; c += Vec::size())
                  at::vec::fmadd(Vec::loadu(u.data() + c0 + c), vs, Vec::loadu(ak + c0 + c)).store(ak + c0 + c);
                for (; c < cols; ++c) ak[c0 + c] += sr[g] * u[c0 + c];
              }
          } else {
            for (int64_t c = 0; c < dv; ++c) w[c] = sr[grp[c]];
            for (int64_t c = 0; c < dv; ++c) ak[c] += w[c] * u[c];
          }
        }
      }
    }
  });
  for (int64_t bh = 0; bh < BH; ++bh)
    for (int64_t k = 0; k < r; ++k) {
      float* o = out + (bh * r + k) * dv;
      for (int64_t c = 0; c < dv; ++c) o[c] = 0.f;
      for (int64_t ci = 0; ci < n_chunks; ++ci) {
        const float* ak = part.data() + ((bh * n_chunks + ci) * r + k) * (dv + G);
        for (int p = 0; p < per; ++p)
          for (int64_t i = 0; i < nb; ++i) {
            const int64_t c = per * i + p;
            o[c] += ak[p * nb + i] + ak[dv + c / gsize];
          }
      }
    }
}

// KIVI's quantizer for values (headlab/decode/quant.py, quantize_values), per token in groups of dv / G channels:
// scale = (max - min) / (2^bits - 1) and zero = min, rounded to the storage dtype S, then code = round((x - zero) /
// scale) (half to even, as torch.round) clamped to the levels, from the rounded numbers; a group holding a NaN gets
// NaN scale and zero (and codes 0), as torch's amin/amax give. One call for what is a score of small PyTorch
// operations on a decode step's one new value.
template <typename S, int bits>
void quantize_values_impl(const S* x, int64_t N, int64_t dv, int64_t G, uint8_t* codes, S* scale, S* zero) {
  constexpr int per = 8 / bits;
  constexpr float levels = static_cast<float>((1 << bits) - 1);
  const int64_t gsize = dv / G, nb = dv / per;
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    std::vector<float> xf(dv);
    std::vector<uint8_t> c(dv);
    for (int64_t n = n0; n < n1; ++n) {
      for (int64_t i = 0; i < dv; ++i) xf[i] = static_cast<float>(x[n * dv + i]);
      for (int64_t g = 0; g < G; ++g) {
        const float* xg = xf.data() + g * gsize;
        float lo = xg[0], hi = xg[0];
        bool nan = false;
        for (int64_t i = 0; i < gsize; ++i) {
          nan |= std::isnan(xg[i]);
          lo = std::min(lo, xg[i]);
          hi = std::max(hi, xg[i]);
        }
        if (nan) lo = hi = std::numeric_limits<float>::quiet_NaN();
        const S sc = static_cast<S>((hi - lo) / levels), ze = static_cast<S>(lo);
        scale[n * G + g] = sc;
        zero[n * G + g] = ze;
        const float sf = static_cast<float>(sc), zf = static_cast<float>(ze), div = sf == 0.f ? 1.f : sf;
        for (int64_t i = 0; i < gsize; ++i) {
          const float q = std::nearbyint((xg[i] - zf) / div);
          c[g * gsize + i] = std::isnan(q) ? 0 : static_cast<uint8_t>(std::min(std::max(q, 0.f), levels));
        }
      }
      uint8_t* out = codes + n * nb;
      for (int64_t i = 0; i < nb; ++i) {
        uint8_t b = 0;
        for (int p = 0; p < per; ++p) b |= static_cast<uint8_t>(c[per * i + p] << (bits * p));
        out[i] = b;
      }
    }
  });
}

// f(std::integral_constant<int, bits>) for bits 2, 4 or 8 (checked before)
template <typename F>
void dispatch_bits(int64_t bits, const F& f) {
  if (bits == 2) f(std::integral_constant<int, 2>());
  else if (bits == 4) f(std::integral_constant<int, 4>());
  else f(std::integral_constant<int, 8>());
}

}  // namespace

// Scores (BH, r, t) float32 of q (BH, r, d) float32 on quantized keys, unscaled: q . k.
torch::Tensor codes_key_scores(const torch::Tensor& q, const torch::Tensor& codes, const torch::Tensor& scale,
                               const torch::Tensor& zero, int64_t bits, int64_t group, int64_t head) {
  check_codes(codes, scale, zero, bits);
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 3 && q.is_contiguous() && q.size(0) == codes.size(0),
              "q: a contiguous (BH, r, d) float32 tensor");
  const int64_t BH = q.size(0), r = q.size(1), d = q.size(2), t = codes.size(1);
  TORCH_CHECK(codes.size(2) * (8 / bits) == d && scale.size(2) == d, "codes and scales do not have q's channels");
  TORCH_CHECK(group >= 1 && head >= 0, "group must be at least 1 and head at least 0");
  auto out = torch::empty({BH, r, t}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, scale.scalar_type(), "codes_key_scores", [&] {
    const auto run = [&](auto b) {
      key_scores_impl<scalar_t, decltype(b)::value>(q.data_ptr<float>(), codes.data_ptr<uint8_t>(),
                                                   scale.data_ptr<scalar_t>(), zero.data_ptr<scalar_t>(),
                                                   out.data_ptr<float>(), BH, r, d, t, scale.size(1), group,
                                                   std::min(head, t));
    };
    dispatch_bits(bits, run);
  });
  return out;
}

// The output (BH, r, dv) float32 of weights p (BH, r, t) float32 on quantized values.
torch::Tensor codes_value_output(const torch::Tensor& p, const torch::Tensor& codes, const torch::Tensor& scale,
                                 const torch::Tensor& zero, int64_t bits) {
  check_codes(codes, scale, zero, bits);
  TORCH_CHECK(p.scalar_type() == at::kFloat && p.dim() == 3 && p.is_contiguous() && p.size(0) == codes.size(0) &&
                  p.size(2) == codes.size(1),
              "p: a contiguous (BH, r, t) float32 tensor over the codes' tokens");
  const int64_t BH = p.size(0), r = p.size(1), t = codes.size(1), dv = codes.size(2) * (8 / bits);
  const int64_t G = scale.size(2);
  TORCH_CHECK(scale.size(1) == t && G >= 1 && dv % G == 0, "values: one scale row per token, G dividing dv");
  auto out = torch::empty({BH, r, dv}, p.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, scale.scalar_type(), "codes_value_output", [&] {
    const auto run = [&](auto b) {
      value_output_impl<scalar_t, decltype(b)::value>(p.data_ptr<float>(), codes.data_ptr<uint8_t>(),
                                                     scale.data_ptr<scalar_t>(), zero.data_ptr<scalar_t>(),
                                                     out.data_ptr<float>(), BH, r, dv, t, G);
    };
    dispatch_bits(bits, run);
  });
  return out;
}

// Values (N, dv) in the storage dtype -> codes (N, dv * bits / 8) uint8, scale and zero (N, G) in that dtype.
std::vector<torch::Tensor> codes_quantize_values(const torch::Tensor& x, int64_t bits, int64_t G) {
  TORCH_CHECK(bits == 2 || bits == 4 || bits == 8, "bits must be 2, 4 or 8, got ", bits);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x: a contiguous (N, dv) tensor");
  const int64_t N = x.size(0), dv = x.size(1);
  TORCH_CHECK(G >= 1 && dv % G == 0 && dv % (8 / bits) == 0, "G must divide dv, and a byte's codes fit dv");
  auto codes = torch::empty({N, dv * bits / 8}, x.options().dtype(at::kByte));
  auto scale = torch::empty({N, G}, x.options()), zero = torch::empty({N, G}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "codes_quantize_values", [&] {
    const auto run = [&](auto b) {
      quantize_values_impl<scalar_t, decltype(b)::value>(x.data_ptr<scalar_t>(), N, dv, G, codes.data_ptr<uint8_t>(),
                                                         scale.data_ptr<scalar_t>(), zero.data_ptr<scalar_t>());
    };
    dispatch_bits(bits, run);
  });
  return {codes, scale, zero};
}

void register_codes(pybind11::module& m) {
  m.def("codes_key_scores", &codes_key_scores, "q . k on KIVI's packed key codes (CPU, float32)",
        py::call_guard<py::gil_scoped_release>());
  m.def("codes_quantize_values", &codes_quantize_values, "KIVI's per-token quantization of values (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("codes_value_output", &codes_value_output, "sum_t p_t v_t on KIVI's packed value codes (CPU, float32)",
        py::call_guard<py::gil_scoped_release>());
}
