// One-pass attention (output, log-sum-exp and statistics) on the CPU: for each (query head, block of query rows), one
// matmul for the scores, one fused pass per score row (maximum, then exp, row sum, sum e*t,
// sum e*|i-j| and, when asked, the column sums), and one matmul for the output. The
// pure-PyTorch paths (headlab/attention/stats/fused.py, the tiled backend) compute the same
// quantities and are the reference in tests; this file is compiled at install time by
// torch.utils.cpp_extension (setup.py, the extension headlab.attention.backends._onepass) and
// called only by headlab/attention/backends/native.py.
//
// Inputs (float32, contiguous): q (BH, Lq, D) (scores are scale * q k^T, the scale applied in the matmul); k (BHkv, Lk, D); v (BHkv, Lk, Dv) or
// an empty tensor; key_bias (Bb, Lk) additive 0 / -1e30 (Bb = 1 or the batch), or empty. Query
// head bh reads kv head bh / group; bh / heads is its batch element. causal: key j <= query i.
// Outputs: lse, max_weight, entropy, mean_distance (BH, Lq) float32, argmax (BH, Lq) int64,
// out (BH, Lq, Dv), received (BH, Lk) (added to), shift (BH, Lq) the row maximum (or empty).
// A row that sees no key: lse -inf, argmax -1, zeros. Work units are the (query head, block of
// block_q rows), on torch's OpenMP threads; the GIL is released meanwhile.

#include <torch/extension.h>
#include <omp.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

using Vec = at::vec::Vectorized<float>;

// BLAS's sgemm (column-major), as exported by libtorch_cpu (MKL or OpenBLAS): called directly,
// without a tensor and a dispatch per score chunk.
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc);


namespace {

constexpr int64_t kChunk = 256;  // partial sums in float over this many keys, then into double

struct Flags {
  bool entropy, distance, argmax;
};

// The keys [cs, w) that hold every key the rows [i0, i1) see: causal (j <= i) and a window
// (i - win_lo <= j <= i + win_hi; -1 = unbounded).
inline void unit_span(int64_t i0, int64_t i1, int64_t Lk, bool causal, int64_t win_lo, int64_t win_hi,
                      int64_t& cs, int64_t& w) {
  w = causal ? std::min(Lk, i1) : Lk;
  if (win_hi >= 0) w = std::min(w, i1 + win_hi);
  cs = win_lo >= 0 ? std::min(w, std::max<int64_t>(0, i0 - win_lo)) : 0;
}

// The columns [lo, hi) of the chunk [c0, c0 + bw) that row i sees (lo == hi: none).
inline void row_range(int64_t i, int64_t c0, int64_t bw, bool causal, int64_t win_lo, int64_t win_hi,
                      int64_t& lo, int64_t& hi) {
  hi = causal ? std::min(bw, i + 1 - c0) : bw;
  if (win_hi >= 0) hi = std::min(hi, i + win_hi + 1 - c0);
  lo = win_lo >= 0 ? std::min(bw, std::max<int64_t>(0, i - win_lo - c0)) : 0;
  hi = std::max(hi, lo);
}

inline float hsum(const Vec& v) {
  alignas(64) float a[Vec::size()];
  v.store(a);
  float t = 0.f;
  for (int64_t i = 0; i < Vec::size(); ++i) t += a[i];
  return t;
}

inline float hmax(const Vec& v) {
  alignas(64) float a[Vec::size()];
  v.store(a);
  float t = a[0];
  for (int64_t i = 0; i < Vec::size(); ++i) {
    if (std::isnan(a[i])) return a[i];  // NaN propagates
    t = std::max(t, a[i]);
  }
  return t;
}

// max over s[0, n) (NaN propagates)
inline float row_max(const float* s, int64_t n) {
  int64_t j = 0;
  Vec vm(-std::numeric_limits<float>::infinity());
  for (; j + Vec::size() <= n; j += Vec::size()) vm = at::vec::maximum(vm, Vec::loadu(s + j));
  float m = hmax(vm);
  for (; j < n; ++j) m = (std::isnan(m) || std::isnan(s[j])) ? NAN : std::max(m, s[j]);
  return m;
}

// e = exp(s - m) in place over [0, n); returns sum e, sum e * (s - m), sum e * |i - (j0 + j)|
inline void row_exp(float* s, int64_t n, float m, int64_t i, int64_t j0, const Flags& f,
                    double& l, double& u, double& md) {
  const Vec vmx(m);
  l = u = md = 0.0;
  alignas(64) float iota[Vec::size()];
  for (int64_t t = 0; t < Vec::size(); ++t) iota[t] = static_cast<float>(t);
  const Vec viota = Vec::loadu(iota);
  for (int64_t c = 0; c < n; c += kChunk) {
    const int64_t ce = std::min(n, c + kChunk);
    Vec vl(0.f), vu(0.f), vd(0.f);
    int64_t j = c;
    for (; j + Vec::size() <= ce; j += Vec::size()) {
      Vec t = Vec::loadu(s + j) - vmx;
      Vec e = t.exp_u20();
      e.store(s + j);
      vl = vl + e;
      if (f.entropy) vu = at::vec::fmadd(e, t, vu);
      if (f.distance) {
        Vec dist = (viota + Vec(static_cast<float>(j0 + j - i))).abs();
        vd = at::vec::fmadd(e, dist, vd);
      }
    }
    float sl = hsum(vl);
    float su = f.entropy ? hsum(vu) : 0.f;
    float sd = f.distance ? hsum(vd) : 0.f;
    for (; j < ce; ++j) {
      float t = s[j] - m;
      float e = std::exp(t);
      s[j] = e;
      sl += e;
      su += e * t;
      sd += e * static_cast<float>(std::abs(j0 + j - i));
    }
    l += sl;
    u += su;
    md += sd;
  }
}

inline int64_t first_equal(const float* s, int64_t n, float m) {
  int64_t j = 0;
  const Vec vm(m);
  for (; j + Vec::size() <= n; j += Vec::size()) {
    Vec hit = (Vec::loadu(s + j) == vm);
    alignas(64) float h[Vec::size()];
    hit.store(h);
    for (int64_t t = 0; t < Vec::size(); ++t)
      if (h[t] != 0.f) return j + t;
  }
  for (; j < n; ++j)
    if (s[j] == m) return j;
  return -1;
}

}  // namespace

void onepass(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor key_bias, int64_t heads,
                 int64_t group, bool causal, bool want_entropy, bool want_distance, bool want_received,
                 bool want_argmax, int64_t block_q, int64_t block_k, torch::Tensor lse, torch::Tensor mw,
                 torch::Tensor ent, torch::Tensor md, torch::Tensor arg, torch::Tensor out, torch::Tensor rec_t,
                 torch::Tensor shift, int64_t win_lo, int64_t win_hi, double scale) {
  const float alpha = static_cast<float>(scale);
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k.dtype() == torch::kFloat32, "onepass: float32 only");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous(), "onepass: contiguous inputs");
  const int64_t Lq = q.size(1), Lk = k.size(1);
  const bool has_v = v.numel() > 0, has_bias = key_bias.numel() > 0;
  TORCH_CHECK(!has_v || v.is_contiguous(), "onepass: contiguous v");
  const int64_t Dv = has_v ? v.size(2) : 0;
  const Flags f{want_entropy, want_distance, want_argmax};
  const int64_t n_qb = (Lq + block_q - 1) / block_q;
  const int64_t n_kc = (Lk + block_k - 1) / block_k;
  const int64_t D = q.size(2);
  const float* qd = q.data_ptr<float>();
  const float* kd = k.data_ptr<float>();
  const float* vd = has_v ? v.data_ptr<float>() : nullptr;
  const float* bd = has_bias ? key_bias.data_ptr<float>() : nullptr;
  const int64_t Bb = has_bias ? key_bias.size(0) : 1;
  float *lsed = lse.data_ptr<float>(), *mwd = mw.data_ptr<float>(), *entd = ent.data_ptr<float>();
  float *mdd = md.data_ptr<float>(), *recd = want_received ? rec_t.data_ptr<float>() : nullptr;
  float* outd = has_v ? out.data_ptr<float>() : nullptr;
  int64_t* argd = arg.data_ptr<int64_t>();
  float* shd = shift.numel() > 0 ? shift.data_ptr<float>() : nullptr;  // the row maximum m (0 without a key)
  const float ninf = -std::numeric_limits<float>::infinity();
  const float fnan = std::numeric_limits<float>::quiet_NaN();

  // one chunk of units [begin, end) on the calling thread, column sums into recd (BH, Lk)
  auto work = [&](int64_t begin, int64_t end, float* recd) {
    // scratch per thread: one score chunk, the output accumulator, per-row running values, and
    // (for the column sums) every chunk's exp of the block with the shift it was taken at
    std::vector<float> sbuf(block_q * block_k), acc(block_q * std::max<int64_t>(Dv, 1));
    std::vector<float> m(block_q), store(want_received ? block_q * Lk : 0), m_at(want_received ? block_q * n_kc : 0);
    std::vector<double> l(block_q), u(block_q), dsum(block_q);
    std::vector<int64_t> a(block_q);
    std::vector<char> bad(block_q);
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t bh = unit / n_qb, qb = unit % n_qb;
      const int64_t i0 = qb * block_q, i1 = std::min(Lq, i0 + block_q), n = i1 - i0;
      const int64_t kvh = bh / group, b = bh / heads;
      int64_t cs, w;
      unit_span(i0, i1, Lk, causal, win_lo, win_hi, cs, w);
      const float* bias = has_bias ? bd + (Bb > 1 ? b : 0) * Lk : nullptr;
      std::fill(m.begin(), m.begin() + n, ninf);
      std::fill(l.begin(), l.begin() + n, 0.0);
      std::fill(u.begin(), u.begin() + n, 0.0);
      std::fill(dsum.begin(), dsum.begin() + n, 0.0);
      std::fill(a.begin(), a.begin() + n, int64_t(-1));
      std::fill(bad.begin(), bad.begin() + n, 0);
      if (has_v) std::fill(acc.begin(), acc.begin() + n * Dv, 0.f);
      const float* qrow = qd + (bh * Lq + i0) * D;
      for (int64_t c0 = cs, ci = 0; c0 < w; c0 += block_k, ++ci) {
        const int64_t c1 = std::min(w, c0 + block_k), bw = c1 - c0;
        float* s = sbuf.data();
        {  // S = Q K_c^T (n, bw), row-major: column-major S^T = K_c Q^T
          const int M = bw, N = n, K = D, ld = D;
          const float one = 1.f, zero = 0.f;
          sgemm_("T", "N", &M, &N, &K, &alpha, kd + (kvh * Lk + c0) * D, &ld, qrow, &ld, &zero, s, &M);
        }
        for (int64_t r = 0; r < n; ++r) {
          const int64_t i = i0 + r;
          float* const full = s + r * bw;
          int64_t lo, hi;  // visible: [lo, hi) of the chunk
          row_range(i, c0, bw, causal, win_lo, win_hi, lo, hi);
          const int64_t wr = hi - lo;
          float* row = full + lo;  // the visible part
          std::fill(full, row, 0.f);  // hidden by the window: no mass
          if (bias) {
            int64_t j = 0;
            for (; j + Vec::size() <= wr; j += Vec::size())
              (Vec::loadu(row + j) + Vec::loadu(bias + c0 + lo + j)).store(row + j);
            for (; j < wr; ++j) row[j] += bias[c0 + lo + j];
          }
          const float cm = wr > 0 ? row_max(row, wr) : ninf;
          if (want_received) m_at[r * n_kc + ci] = m[r];
          if (std::isnan(cm)) bad[r] = 1;
          if (bad[r] || cm <= -1e29f) {  // nothing visible in this chunk (or a NaN row): no mass
            std::fill(full, full + bw, 0.f);
            continue;
          }
          if (cm > m[r]) {  // a new maximum: rescale what the row holds so far
            if (m[r] == ninf) {
              l[r] = u[r] = dsum[r] = 0.0;
            } else {
              const double d = static_cast<double>(cm) - m[r], resc = std::exp(-d);
              u[r] = resc * (u[r] - l[r] * d);
              l[r] *= resc;
              dsum[r] *= resc;
              if (has_v) {
                const Vec va(static_cast<float>(resc));
                float* ar = acc.data() + r * Dv;
                int64_t c = 0;
                for (; c + Vec::size() <= Dv; c += Vec::size()) (Vec::loadu(ar + c) * va).store(ar + c);
                for (; c < Dv; ++c) ar[c] *= static_cast<float>(resc);
              }
            }
            m[r] = cm;
            if (f.argmax) a[r] = c0 + lo + first_equal(row, wr, cm);
          }
          if (want_received) m_at[r * n_kc + ci] = m[r];
          double lc, uc, dc;
          row_exp(row, wr, m[r], i, c0 + lo, f, lc, uc, dc);
          std::fill(row + wr, full + bw, 0.f);  // hidden by causal or the window
          l[r] += lc;
          u[r] += uc;
          dsum[r] += dc;
        }
        if (has_v) {  // acc += E_c V_c (n, Dv): column-major acc^T += V_c^T E_c^T
          const int M = Dv, N = n, K = bw;
          const float one = 1.f;
          sgemm_("N", "N", &M, &N, &K, &one, vd + (kvh * Lk + c0) * Dv, &M, s, &K, &one, acc.data(), &M);
        }
        if (want_received) {
          for (int64_t r = 0; r < n; ++r) std::copy(s + r * bw, s + (r + 1) * bw, store.data() + r * Lk + c0);
        }
      }
      for (int64_t r = 0; r < n; ++r) {
        const int64_t o = bh * Lq + i0 + r;
        float* dst = has_v ? outd + o * Dv : nullptr;
        if (shd) shd[o] = (bad[r] || m[r] == ninf) ? 0.f : m[r];
        if (bad[r]) {
          lsed[o] = mwd[o] = entd[o] = mdd[o] = fnan;
          argd[o] = -1;
          if (has_v) std::fill(dst, dst + Dv, fnan);
          continue;
        }
        if (m[r] == ninf) {  // sees no key
          lsed[o] = ninf; mwd[o] = 0.f; entd[o] = 0.f; mdd[o] = 0.f; argd[o] = -1;
          if (has_v) std::fill(dst, dst + Dv, 0.f);
          continue;
        }
        const double il = 1.0 / l[r];
        lsed[o] = static_cast<float>(m[r] + std::log(l[r]));
        mwd[o] = static_cast<float>(il);
        entd[o] = static_cast<float>(std::log(l[r]) - u[r] * il);
        mdd[o] = static_cast<float>(dsum[r] * il);
        argd[o] = a[r];
        if (has_v) {
          const Vec vi(static_cast<float>(il));
          const float* src = acc.data() + r * Dv;
          int64_t c = 0;
          for (; c + Vec::size() <= Dv; c += Vec::size()) (Vec::loadu(src + c) * vi).store(dst + c);
          for (; c < Dv; ++c) dst[c] = src[c] * static_cast<float>(il);
        }
      }
      if (want_received && w > cs) {  // sum_i P_ij = sum_i e_ij exp(m_at - m_i) / l_i, chunk by chunk
        float* rec = recd + bh * Lk;
        for (int64_t r = 0; r < n; ++r) {
          if (bad[r] || m[r] == ninf) continue;
          const float* row = store.data() + r * Lk;
          for (int64_t c0 = cs, ci = 0; c0 < w; c0 += block_k, ++ci) {
            const int64_t c1 = std::min(w, c0 + block_k);
            const float ma = m_at[r * n_kc + ci];
            if (ma == ninf) continue;  // the chunk held nothing of this row
            const float fac = static_cast<float>(std::exp(static_cast<double>(ma) - m[r]) / l[r]);
            const Vec vf(fac);
            int64_t j = c0;
            for (; j + Vec::size() <= c1; j += Vec::size())
              at::vec::fmadd(Vec::loadu(row + j), vf, Vec::loadu(rec + j)).store(rec + j);
            for (; j < c1; ++j) rec[j] += row[j] * fac;
          }
        }
      }
    }
  };

  // torch's own OpenMP team (libgomp, loaded by torch), each thread taking chunks of units from a
  // shared counter; BLAS runs sequentially inside the parallel region. Measured against the
  // alternatives: threads of our own, or a pool of Python threads, competed with torch's spinning
  // OpenMP workers (1.4x slower at 1,024 tokens); ATen's mm inside at::parallel_for started
  // threads of its own (1.5x slower, erratic).
  const int64_t BH = q.size(0), n_units = BH * n_qb;
  const int nt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n_units)));
  const int64_t step = std::max<int64_t>(1, n_units / (4 * nt));
  std::atomic<int64_t> next{0};
  std::vector<std::vector<float>> recs(want_received && nt > 1 ? nt : 0);
  auto worker = [&](int t) {
    float* rd = recd;
    if (!recs.empty()) {
      recs[t].assign(BH * Lk, 0.f);
      rd = recs[t].data();
    }
    for (;;) {
      const int64_t u0 = next.fetch_add(step);
      if (u0 >= n_units) break;
      work(u0, std::min(n_units, u0 + step), rd);
    }
  };
  if (nt == 1) {
    worker(0);
  } else {
#pragma omp parallel num_threads(nt)
    worker(omp_get_thread_num());
  }
  if (nt > 1) {
    for (auto& r : recs)
      for (int64_t j = 0; j < BH * Lk; ++j) recd[j] += r[j];
  }
}

// The backward of the one-pass forward, FlashAttention-2 style, for the masks the forward walks
// (none, causal, a window, key padding). Inputs as the forward's, plus dout (BH, Lq, Dv), the
// forward's shift m and log l per row (BH, Lq) (log l = +inf: the row sees no key) and
// delta = rowsum(dout * out) (BH, Lq). Per tile, with P = exp((S - m) - log l):
//   dV += P^T dO,  dP = dO V^T,  dS = P * (dP - delta),  dQ += dS K,  dK += dS^T (scale q)
// Work units are kv heads (their query heads' dQ rows and their own dK, dV belong to no other unit).
// Scores are scale * q k^T with the scale applied in the matmul, exactly as in the forward.
void onepass_backward(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor key_bias, int64_t heads,
                      int64_t group, bool causal, torch::Tensor dout, torch::Tensor shift, torch::Tensor logl,
                      torch::Tensor delta, int64_t block_q, int64_t block_k, torch::Tensor dq, torch::Tensor dk,
                      torch::Tensor dv, int64_t win_lo, int64_t win_hi, double scale) {
  const float alpha = static_cast<float>(scale);
  const int64_t Lq = q.size(1), Lk = k.size(1), D = q.size(2), Dv = v.size(2), BHkv = k.size(0);
  const bool has_bias = key_bias.numel() > 0;
  const float *qd = q.data_ptr<float>(), *kd = k.data_ptr<float>(), *vd = v.data_ptr<float>();
  const float *dod = dout.data_ptr<float>(), *md = shift.data_ptr<float>(), *ld = logl.data_ptr<float>();
  const float* ded = delta.data_ptr<float>();
  const float* bd = has_bias ? key_bias.data_ptr<float>() : nullptr;
  const int64_t Bb = has_bias ? key_bias.size(0) : 1;
  float *dqd = dq.data_ptr<float>(), *dkd = dk.data_ptr<float>(), *dvd = dv.data_ptr<float>();
  const int64_t n_qb = (Lq + block_q - 1) / block_q;

  auto work = [&](int64_t kvh) {
    std::vector<float> p(block_q * block_k), dp(block_q * block_k);
    const int64_t hk = kvh % (heads / group);  // kv head within its batch element
    const int64_t b = kvh / (heads / group);
    const float* bias = has_bias ? bd + (Bb > 1 ? b : 0) * Lk : nullptr;
    const float* K = kd + kvh * Lk * D;
    const float* V = vd + kvh * Lk * Dv;
    float* dK = dkd + kvh * Lk * D;
    float* dV = dvd + kvh * Lk * Dv;
    for (int64_t g = 0; g < group; ++g) {
      const int64_t bh = b * heads + hk * group + g;
      for (int64_t qb = 0; qb < n_qb; ++qb) {
        const int64_t i0 = qb * block_q, i1 = std::min(Lq, i0 + block_q), n = i1 - i0;
        int64_t cs, w;
        unit_span(i0, i1, Lk, causal, win_lo, win_hi, cs, w);
        const float* Q = qd + (bh * Lq + i0) * D;
        const float* dO = dod + (bh * Lq + i0) * Dv;
        float* dQ = dqd + (bh * Lq + i0) * D;
        for (int64_t c0 = cs; c0 < w; c0 += block_k) {
          const int64_t c1 = std::min(w, c0 + block_k), bw = c1 - c0;
          const float one = 1.f, zero = 0.f;
          {  // S = Q K_c^T (n, bw)
            const int M = bw, N = n, Kd = D, ldk = D;
            sgemm_("T", "N", &M, &N, &Kd, &alpha, K + c0 * D, &ldk, Q, &ldk, &zero, p.data(), &M);
          }
          {  // dP = dO V_c^T (n, bw)
            const int M = bw, N = n, Kd = Dv, ldv = Dv;
            sgemm_("T", "N", &M, &N, &Kd, &one, V + c0 * Dv, &ldv, dO, &ldv, &zero, dp.data(), &M);
          }
          for (int64_t r = 0; r < n; ++r) {
            const int64_t i = i0 + r, o = bh * Lq + i;
            float* pr = p.data() + r * bw;
            float* dr = dp.data() + r * bw;
            int64_t lo, hi;
            row_range(i, c0, bw, causal, win_lo, win_hi, lo, hi);
            const float m = md[o], ll = ld[o], de = ded[o];
            if (std::isinf(ll) && ll > 0) hi = lo;  // the row sees no key: no gradient
            std::fill(pr, pr + lo, 0.f);
            std::fill(dr, dr + lo, 0.f);
            const Vec vm(m), vl(ll), vde(de);
            int64_t j = lo;
            for (; j + Vec::size() <= hi; j += Vec::size()) {
              Vec sv = Vec::loadu(pr + j);
              if (bias) sv = sv + Vec::loadu(bias + c0 + j);
              Vec pv = ((sv - vm) - vl).exp_u20();
              pv.store(pr + j);
              (pv * (Vec::loadu(dr + j) - vde)).store(dr + j);  // dS
            }
            for (; j < hi; ++j) {
              float sv = pr[j] + (bias ? bias[c0 + j] : 0.f);
              float pv = std::exp((sv - m) - ll);
              pr[j] = pv;
              dr[j] = pv * (dr[j] - de);
            }
            std::fill(pr + hi, pr + bw, 0.f);
            std::fill(dr + hi, dr + bw, 0.f);
          }
          {  // dV_c += P^T dO: column-major dV_c^T (Dv, bw) += dO^T (Dv, n) P (n, bw)
            const int M = Dv, N = bw, Kd = n;
            sgemm_("N", "T", &M, &N, &Kd, &one, dO, &M, p.data(), &N, &one, dV + c0 * Dv, &M);
          }
          {  // dK_c += dS^T Q: dK_c^T (D, bw) += Q^T (D, n) dS (n, bw)
            const int M = D, N = bw, Kd = n;
            sgemm_("N", "T", &M, &N, &Kd, &alpha, Q, &M, dp.data(), &N, &one, dK + c0 * D, &M);
          }
          {  // dQ += dS K_c: dQ^T (D, n) += K_c^T (D, bw) dS^T (bw, n)
            const int M = D, N = n, Kd = bw;
            sgemm_("N", "N", &M, &N, &Kd, &alpha, K + c0 * D, &M, dp.data(), &Kd, &one, dQ, &M);
          }
        }
      }
    }
  };
  const int nt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), BHkv)));
  std::atomic<int64_t> next{0};
  auto worker = [&]() {
    for (;;) {
      const int64_t u = next.fetch_add(1);
      if (u >= BHkv) break;
      work(u);
    }
  };
  if (nt == 1) {
    worker();
  } else {
#pragma omp parallel num_threads(nt)
    worker();
  }
}

// The SHA-1 of the sources as setup.py compiled them (this file, then codes.cpp, as one string of
// bytes; -DHEADLAB_SOURCE_SHA1=sha1_<hex>), kept in the binary as one string: native.py reads it from
// the file before loading and refuses a kernel built from another version of the sources.
#ifndef HEADLAB_SOURCE_SHA1
#define HEADLAB_SOURCE_SHA1 unknown
#endif
#define HEADLAB_STR2(x) #x
#define HEADLAB_STR(x) HEADLAB_STR2(x)
static const char kSourceTag[] = "headlab-onepass-source:" HEADLAB_STR(HEADLAB_SOURCE_SHA1);

void register_codes(pybind11::module& m);  // codes.cpp: decode attention on KIVI's packed codes

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("source_tag") = kSourceTag;
  register_codes(m);
  // the GIL is released while the kernel's OpenMP threads run
  m.def("onepass", &onepass, "one-pass attention statistics (CPU, float32), units [begin, end)",
        py::call_guard<py::gil_scoped_release>());
  m.def("onepass_backward", &onepass_backward, "its backward (CPU, float32)",
        py::call_guard<py::gil_scoped_release>());
}
