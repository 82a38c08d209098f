// Decode attention read straight from KIVI's packed codes (Liu et al. 2024) on the CPU: the two products of
// headlab/decode/codes.py (key_scores, value_output), each one pass over the codes, accumulating in float32,
// with no dequantized copy of the cache and no unpacked copy larger than one token's codes. The PyTorch
// functions in codes.py compute the same numbers and are the reference in tests; this file is compiled with
// onepass.cpp into the one extension (setup.py) and called only by headlab/attention/backends/native.py.
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
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
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

// One token's codes in plane order: u[p * nb + i] = code of channel per * i + p.
template <int bits>
inline void unpack_planes(const uint8_t* x, int64_t nb, float* u) {
  constexpr int per = 8 / bits;
  constexpr uint8_t mask = static_cast<uint8_t>((1 << bits) - 1);
  for (int p = 0; p < per; ++p) {
    const int sh = bits * p;
    float* up = u + p * nb;
    for (int64_t i = 0; i < nb; ++i) up[i] = static_cast<float>((x[i] >> sh) & mask);
  }
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
      int64_t row = -1;
      for (int64_t j = a; j < b; ++j) {
        const int64_t g = j < head ? 0 : off + (j - head) / group;
        if (g != row) {  // q * s[g] in plane order, and q . z[g], for every query row
          row = g;
          TORCH_CHECK(g < rows, "the keys' scale rows do not cover token ", j);
          const S* sg = scale + (bh * rows + g) * d;
          const S* zg = zero + (bh * rows + g) * d;
          for (int64_t k = 0; k < r; ++k) {
            float z = 0.f;
            for (int64_t c = 0; c < d; ++c) {
              qs[k * d + perm[c]] = qh[k * d + c] * static_cast<float>(sg[c]);
              z += qh[k * d + c] * static_cast<float>(zg[c]);
            }
            qz[k] = z;
          }
        }
        unpack_planes<bits>(codes + (bh * t + j) * nb, nb, u.data());
        for (int64_t k = 0; k < r; ++k) {
          const float* qk = qs.data() + k * d;
          Vec vacc(0.f);
          int64_t c = 0;
          for (; c + Vec::size() <= d; c += Vec::size())
            vacc = at::vec::fmadd(Vec::loadu(qk + c), Vec::loadu(u.data() + c), vacc);
          float lanes[Vec::size()];
          vacc.store(lanes);
          for (int w = Vec::size() / 2; w > 0; w /= 2)  // a tree: log2(lanes) additions deep, not one chain
            for (int l = 0; l < w; ++l) lanes[l] += lanes[l + w];
          float acc = lanes[0];
          for (; c < d; ++c) acc += qk[c] * u[c];
          oh[k * t + j] = acc + qz[k];
        }
      }
    }
  });
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
  const int64_t n_chunks = std::max<int64_t>(1, (t + kChunk - 1) / kChunk);
  // partial sums per (head, chunk): the codes' part in plane order, then the zeros' part per group
  std::vector<float> part(BH * n_chunks * r * (dv + G), 0.f);
  at::parallel_for(0, BH * n_chunks, 1, [&](int64_t u0, int64_t u1) {
    std::vector<float> u(dv), w(dv), sr(G), sf(kChunk * G), zf(kChunk * G);
    for (int64_t unit = u0; unit < u1; ++unit) {
      const int64_t bh = unit / n_chunks, ci = unit % n_chunks;
      const int64_t a = ci * kChunk, b = std::min(t, a + kChunk);
      float* acc = part.data() + unit * r * (dv + G);
      for (int64_t i = 0; i < (b - a) * G; ++i) {  // the chunk's scales and zeros as float32, once
        sf[i] = static_cast<float>(scale[(bh * t + a) * G + i]);
        zf[i] = static_cast<float>(zero[(bh * t + a) * G + i]);
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

void register_codes(pybind11::module& m) {
  m.def("codes_key_scores", &codes_key_scores, "q . k on KIVI's packed key codes (CPU, float32)",
        py::call_guard<py::gil_scoped_release>());
  m.def("codes_value_output", &codes_value_output, "sum_t p_t v_t on KIVI's packed value codes (CPU, float32)",
        py::call_guard<py::gil_scoped_release>());
}
