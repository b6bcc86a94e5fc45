/* Expert shapes of a few public MoE models, for benchmarks and tests. Only
 * the shapes are theirs: routing is always this layer's softmax top-k
 * (DeepSeek-V3's sigmoid scores, bias and group limits are not modeled). */
#include <string.h>

#include "ps_moe_ref.h"

static const ps_moe_preset_t ps_moe_preset_table[] = {
    /* name             hidden  ffn experts topk renormalize */
    {"qwen3-30b-a3b", 2048, 768, 128, 8, 1},
    {"gpt-oss-120b", 2880, 2880, 128, 4, 1}, /* 2880 = 45 * PERSEUS_MOE_TILE */
    {"deepseek-v3", 7168, 2048, 256, 8, 1},
};

const ps_moe_preset_t *ps_moe_presets(int *n) {
  if (n) *n = (int)(sizeof ps_moe_preset_table / sizeof ps_moe_preset_table[0]);
  return ps_moe_preset_table;
}

const ps_moe_preset_t *ps_moe_preset_find(const char *name) {
  int n;
  const ps_moe_preset_t *p = ps_moe_presets(&n);
  for (int i = 0; name && i < n; i++)
    if (!strcmp(p[i].name, name)) return &p[i];
  return NULL;
}

perseus_moe_config_t ps_moe_preset_config(const ps_moe_preset_t *p, int max_tokens, int batch) {
  perseus_moe_config_t c = {
      .hidden = p->hidden,
      .ffn = p->ffn,
      .experts = p->experts,
      .topk = p->topk,
      .max_tokens = max_tokens,
      .renormalize = p->renormalize,
      .batch = batch,
  };
  return c;
}
