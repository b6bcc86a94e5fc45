/* fp64 CPU reference of the MoE layer in include/perseus/moe.h (for tests),
 * the bf16 conversions and the deterministic test data generator. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "ps_moe_ref.h"

float ps_bf16_to_float(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

uint16_t ps_float_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  /* a NaN whose payload sits in the dropped bits would truncate to infinity */
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

static double ps_bf(uint16_t b) { return (double)ps_bf16_to_float(b); }

static double ps_dot(const uint16_t *a, const uint16_t *b, size_t n) {
  double s = 0.0;
  for (size_t i = 0; i < n; i++) s += ps_bf(a[i]) * ps_bf(b[i]);
  return s;
}

void ps_moe_ref_logits(const perseus_moe_config_t *c, const uint16_t *x, int T, const uint16_t *gate,
                       double *logits) {
  size_t H = (size_t)c->hidden, E = (size_t)c->experts;
  for (size_t t = 0; t < (size_t)T; t++)
    for (size_t e = 0; e < E; e++) logits[t * E + e] = ps_dot(x + t * H, gate + e * H, H);
}

/* --- routing --- */

PS_MOE_PRINTF(3, 4) static int ps_why(char *why, size_t len, const char *fmt, ...) {
  if (why && len) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, len, fmt, ap);
    va_end(ap);
  }
  return -1;
}

/* The k-th largest of v[0..n) (k <= PERSEUS_MOE_MAX_TOPK <= n): a sorted
 * window of the k largest, so no allocation and O(n k). */
static double ps_kth_largest(const double *v, int n, int k) {
  double top[PERSEUS_MOE_MAX_TOPK];
  for (int i = 0; i < k; i++) top[i] = -INFINITY;
  for (int i = 0; i < n; i++) {
    if (!(v[i] > top[k - 1])) continue;
    int j = k - 1;
    for (; j > 0 && top[j - 1] < v[i]; j--) top[j] = top[j - 1];
    top[j] = v[i];
  }
  return top[k - 1];
}

int ps_moe_ref_check_routing(const perseus_moe_config_t *c, const double *logits_row, const int32_t *idx,
                             const float *w, double tol, char *why, size_t whylen) {
  int E = c->experts, k = c->topk;
  if (why && whylen) why[0] = '\0';
  if (k < 1 || k > PERSEUS_MOE_MAX_TOPK || k > E) return ps_why(why, whylen, "topk %d is not valid", k);
  for (int i = 0; i < k; i++) {
    if (idx[i] < 0 || idx[i] >= E)
      return ps_why(why, whylen, "idx[%d] = %d is not an expert (0..%d)", i, (int)idx[i], E - 1);
    for (int j = 0; j < i; j++)
      if (idx[j] == idx[i])
        return ps_why(why, whylen, "expert %d chosen twice (idx[%d], idx[%d])", (int)idx[i], j, i);
  }
  double kth = ps_kth_largest(logits_row, E, k);
  for (int i = 0; i < k; i++) {
    double l = logits_row[idx[i]];
    if (!(l >= kth - tol))
      return ps_why(why, whylen, "expert %d has logit %.9g, below the %d-th largest %.9g by more than %g",
                    (int)idx[i], l, k, kth, tol);
  }
  /* softmax over all experts, evaluated only where chosen */
  double mx = -INFINITY, sum = 0.0, chosen = 0.0, p[PERSEUS_MOE_MAX_TOPK];
  for (int e = 0; e < E; e++) mx = logits_row[e] > mx ? logits_row[e] : mx;
  for (int e = 0; e < E; e++) sum += exp(logits_row[e] - mx);
  for (int i = 0; i < k; i++) {
    p[i] = exp(logits_row[idx[i]] - mx) / sum;
    chosen += p[i];
  }
  for (int i = 0; i < k; i++) {
    double want = c->renormalize ? p[i] / chosen : p[i];
    if (!(fabs((double)w[i] - want) <= 1e-3 + 1e-2 * fabs(want)))
      return ps_why(why, whylen, "weight %.9g for expert %d (idx[%d]), expected %.9g", (double)w[i],
                    (int)idx[i], i, want);
  }
  return 0;
}

/* --- experts --- */

static double ps_silu(double a) { return a / (1.0 + exp(-a)); }

/* y += scale * W2 (silu(W1 x) * (W3 x)). The activation is built a chunk of
 * F at a time so that no buffer of F (or H) doubles has to be allocated, and
 * W2 is still read along its rows. */
enum { PS_MOE_REF_CHUNK = 256 };

static void ps_expert_acc(const perseus_moe_config_t *c, const uint16_t *x, const uint16_t *w1,
                          const uint16_t *w3, const uint16_t *w2, double scale, double *y) {
  size_t H = (size_t)c->hidden, F = (size_t)c->ffn;
  double act[PS_MOE_REF_CHUNK];
  for (size_t f0 = 0; f0 < F; f0 += PS_MOE_REF_CHUNK) {
    size_t n = F - f0 < PS_MOE_REF_CHUNK ? F - f0 : PS_MOE_REF_CHUNK;
    for (size_t i = 0; i < n; i++)
      act[i] = scale * ps_silu(ps_dot(w1 + (f0 + i) * H, x, H)) * ps_dot(w3 + (f0 + i) * H, x, H);
    for (size_t h = 0; h < H; h++) {
      const uint16_t *row = w2 + h * F + f0;
      double s = 0.0;
      for (size_t i = 0; i < n; i++) s += ps_bf(row[i]) * act[i];
      y[h] += s;
    }
  }
}

void ps_moe_ref_expert(const perseus_moe_config_t *c, const uint16_t *x_row, const uint16_t *w1,
                       const uint16_t *w3, const uint16_t *w2, double *y) {
  for (int h = 0; h < c->hidden; h++) y[h] = 0.0;
  ps_expert_acc(c, x_row, w1, w3, w2, 1.0, y);
}

void ps_moe_ref_token(const perseus_moe_config_t *c, const uint16_t *x_row, const int32_t *idx,
                      const float *w, const uint16_t *w1_all, const uint16_t *w3_all, const uint16_t *w2_all,
                      double *out_row) {
  size_t per_expert = (size_t)c->ffn * (size_t)c->hidden;
  for (int h = 0; h < c->hidden; h++) out_row[h] = 0.0;
  for (int i = 0; i < c->topk; i++) {
    size_t off = (size_t)idx[i] * per_expert;
    ps_expert_acc(c, x_row, w1_all + off, w3_all + off, w2_all + off, (double)w[i], out_row);
  }
}

/* --- comparison --- */

int ps_moe_ref_compare(const uint16_t *got, const double *want, size_t n, double rtol, double atol,
                       size_t *nbad, double *max_err, size_t *first_bad) {
  size_t bad = 0, first = n;
  double worst = 0.0;
  for (size_t i = 0; i < n; i++) {
    double err = fabs(ps_bf(got[i]) - want[i]);
    if (isnan(err)) err = INFINITY;
    if (err > worst) worst = err;
    if (err > atol + rtol * fabs(want[i])) {
      if (!bad) first = i;
      bad++;
    }
  }
  if (nbad) *nbad = bad;
  if (max_err) *max_err = worst;
  if (first_bad) *first_bad = first;
  return bad ? -1 : 0;
}

double ps_moe_rms(const double *v, size_t n) {
  double s = 0.0;
  for (size_t i = 0; i < n; i++) s += v[i] * v[i];
  return n ? sqrt(s / (double)n) : 0.0;
}

/* --- test data --- */

/* splitmix64 (Steele, Lea, Flood 2014): a Weyl sequence through a mixer. */
uint64_t ps_moe_rand(uint64_t *state) {
  uint64_t z = (*state += 0x9e3779b97f4a7c15u);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9u;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebu;
  return z ^ (z >> 31);
}

void ps_moe_fill_bf16(uint16_t *dst, size_t n, uint64_t seed, float scale) {
  uint64_t s = seed;
  for (size_t i = 0; i < n; i++) {
    double u = (double)(ps_moe_rand(&s) >> 11) * 0x1p-53; /* [0, 1) */
    dst[i] = ps_float_to_bf16((float)((2.0 * u - 1.0) * (double)scale));
  }
}
