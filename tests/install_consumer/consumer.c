/* The C ABI through the installed package (ctest install_and_consume), from C: a
   small BSHD problem on the cpu backend, checked against a direct evaluation of
   d_weights (docs/math.md, stage 2: dW_h = sm_scale * sum_i gs_i relu(q_h . k_id_i)),
   then one argument error. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "dsaib/dsaib.h"

enum { B = 1, S = 6, SKV = 9, H = 8, D = 64, TOPK = 4 };

/* bf16 bits of a float (round to nearest even) and back. */
static uint16_t to_bf16(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
static float from_bf16(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float x;
  memcpy(&x, &u, 4);
  return x;
}
/* A fixed linear congruential stream in [-1, 1): no zeros by construction of the draws below. */
static uint32_t state = 12345u;
static float draw(void) {
  state = state * 1664525u + 1013904223u;
  return (float)((state >> 8) & 0xffffffu) / 8388608.0f - 1.0f;
}

int main(void) {
  static uint16_t q[B * S * H * D], w[B * S * H], k[B * SKV * D];
  static int32_t ids[B * S * TOPK];
  static float t[B * S * TOPK], p[B * S * TOPK], dq[B * S * H * D], dw[B * S * H], dk[B * SKV * D];
  for (int i = 0; i < B * S * H * D; ++i) q[i] = to_bf16(draw());
  for (int i = 0; i < B * S * H; ++i) w[i] = to_bf16(draw() * 0.5f + 0.75f);
  for (int i = 0; i < B * SKV * D; ++i) k[i] = to_bf16(draw());
  for (int r = 0; r < S; ++r) {
    float tsum = 0.f;
    for (int j = 0; j < TOPK; ++j) {
      ids[r * TOPK + j] = (r + 2 * j) % SKV; /* distinct keys per row */
      t[r * TOPK + j] = 1.0f + draw() * 0.5f;
      p[r * TOPK + j] = 0.2f + 0.1f * (float)j;
      tsum += t[r * TOPK + j];
    }
    for (int j = 0; j < TOPK; ++j) t[r * TOPK + j] /= tsum;
  }
  for (int i = 0; i < B * S * H * D; ++i) dq[i] = NAN;
  for (int i = 0; i < B * S * H; ++i) dw[i] = NAN;
  for (int i = 0; i < B * SKV * D; ++i) dk[i] = NAN;

  const int64_t q_shape[4] = {B, S, H, D}, w_shape[3] = {B, S, H}, k_shape[3] = {B, SKV, D},
                s_shape[3] = {B, S, TOPK};
  dsaib_inputs in;
  dsaib_outputs out;
  memset(&in, 0, sizeof in);
  memset(&out, 0, sizeof out);
  int bad = 0;
  bad |= dsaib_contiguous_tensor(&in.index_q, q, DSAIB_BF16, q_shape, 4, DSAIB_CPU, 0) != DSAIB_OK;
  bad |= dsaib_contiguous_tensor(&in.weights, w, DSAIB_BF16, w_shape, 3, DSAIB_CPU, 0) != DSAIB_OK;
  bad |= dsaib_contiguous_tensor(&in.index_k, k, DSAIB_BF16, k_shape, 3, DSAIB_CPU, 0) != DSAIB_OK;
  bad |= dsaib_contiguous_tensor(&in.topk_indices, ids, DSAIB_I32, s_shape, 3, DSAIB_CPU, 0) != DSAIB_OK;
  bad |= dsaib_contiguous_tensor(&in.attn_score, t, DSAIB_F32, s_shape, 3, DSAIB_CPU, 0) != DSAIB_OK;
  bad |= dsaib_contiguous_tensor(&in.index_score, p, DSAIB_F32, s_shape, 3, DSAIB_CPU, 0) != DSAIB_OK;
  bad |= dsaib_contiguous_tensor(&out.d_index_q, dq, DSAIB_F32, q_shape, 4, DSAIB_CPU, 0) != DSAIB_OK;
  bad |= dsaib_contiguous_tensor(&out.d_weights, dw, DSAIB_F32, w_shape, 3, DSAIB_CPU, 0) != DSAIB_OK;
  bad |= dsaib_contiguous_tensor(&out.d_index_k, dk, DSAIB_F32, k_shape, 3, DSAIB_CPU, 0) != DSAIB_OK;
  if (bad) {
    printf("consumer_c: FAIL: dsaib_contiguous_tensor: %s\n", dsaib_last_error());
    return 1;
  }
  dsaib_options opt;
  dsaib_default_options(&opt);
  opt.sm_scale = 0.125f;
  if (dsaib_indexer_backward(&in, &out, &opt, NULL, 0) != DSAIB_OK) {
    printf("consumer_c: FAIL: dsaib_indexer_backward: %s\n", dsaib_last_error());
    return 1;
  }

  /* d_weights in double, straight from the math (c = grad_loss * loss_coeff / N, N = B*S). */
  const double c = 1.0 * 1.0 / (B * S);
  double num = 0.0, den = 0.0;
  for (int r = 0; r < S; ++r) {
    double g[TOPK], G = 0.0;
    for (int j = 0; j < TOPK; ++j) {
      g[j] = -c * t[r * TOPK + j];
      G += g[j];
    }
    for (int h = 0; h < H; ++h) {
      double ref = 0.0;
      for (int j = 0; j < TOPK; ++j) {
        double x = 0.0;
        for (int d = 0; d < D; ++d)
          x += (double)from_bf16(q[(r * H + h) * D + d]) * (double)from_bf16(k[ids[r * TOPK + j] * D + d]);
        ref += (g[j] - (double)p[r * TOPK + j] * G) * (x > 0.0 ? x : 0.0);
      }
      ref *= opt.sm_scale;
      const double got = dw[r * H + h];
      if (!isfinite(got)) {
        printf("consumer_c: FAIL: d_weights[%d, %d] not finite\n", r, h);
        return 1;
      }
      num += (got - ref) * (got - ref);
      den += ref * ref;
    }
  }
  const double rel = sqrt(num / den);
  printf("consumer_c: d_weights against a direct fp64 evaluation: relative RMS %.3g\n", rel);
  if (!(den > 0.0 && rel < 1e-5)) {
    printf("consumer_c: FAIL: relative RMS above 1e-5\n");
    return 1;
  }
  for (int i = 0; i < B * S * H * D; ++i)
    if (!isfinite(dq[i])) {
      printf("consumer_c: FAIL: d_index_q[%d] not finite\n", i);
      return 1;
    }
  for (int i = 0; i < B * SKV * D; ++i)
    if (!isfinite(dk[i])) {
      printf("consumer_c: FAIL: d_index_k[%d] not finite\n", i);
      return 1;
    }

  /* A wrong dtype for topk_indices: DSAIB_INVALID_ARGUMENT and a message naming it. */
  in.topk_indices.dtype = DSAIB_F32;
  const dsaib_status st = dsaib_indexer_backward(&in, &out, &opt, NULL, 0);
  printf("consumer_c: f32 topk_indices: status %d, \"%s\"\n", (int)st, dsaib_last_error());
  if (st != DSAIB_INVALID_ARGUMENT || strstr(dsaib_last_error(), "topk_indices") == NULL) {
    printf("consumer_c: FAIL: expected DSAIB_INVALID_ARGUMENT naming topk_indices\n");
    return 1;
  }
  printf("consumer_c: PASS\n");
  return 0;
}
