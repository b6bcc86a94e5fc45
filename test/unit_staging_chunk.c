/* Unit test of PERSEUS_STAGING_CHUNK (ps_env.c): a value in range that is
 * not a multiple of 64 is refused with ncclInvalidArgument and a warning
 * naming the variable, its value and what is expected; a staged write pads
 * each chunk to a multiple of 64 bytes, so such a chunk would not fit its
 * receive slot. Multiples of 64 in range are taken as they are.
 * Exit: 0 pass, 1 fail. */
#include <stdlib.h>
#include <string.h>

#include "ps_env.h"

#include "unit_capture.h"
#include "unit_check.h"

static ncclResult_t load_chunk(const char *value, ps_config_t *cfg) {
  setenv("PERSEUS_STAGING_CHUNK", value, 1);
  return ps_config_load(cfg);
}

int main(void) {
  /* ps_log reads NCCL_DEBUG once: the default level (WARN) must be in force
   * so that the warnings can be checked. */
  unsetenv("NCCL_DEBUG");
  ps_config_t cfg;
  static const char *const good[] = {"4096", "4160", "65600", "524288", "67108800", "67108864", NULL};
  for (int i = 0; good[i]; i++) {
    capture_begin();
    ncclResult_t rc = load_chunk(good[i], &cfg);
    const char *log = capture_end();
    EXPECT(rc == ncclSuccess && cfg.staging_chunk == atoll(good[i]),
           "PERSEUS_STAGING_CHUNK=%s: rc %d, chunk %lld", good[i], rc, (long long)cfg.staging_chunk);
    EXPECT(log[0] == '\0', "PERSEUS_STAGING_CHUNK=%s logged: '%s'", good[i], log);
  }
  static const char *const bad[] = {"4100", "4097", "4127", "8191", "65537", "67108863", NULL};
  for (int i = 0; bad[i]; i++) {
    capture_begin();
    ncclResult_t rc = load_chunk(bad[i], &cfg);
    const char *log = capture_end();
    EXPECT(rc == ncclInvalidArgument, "PERSEUS_STAGING_CHUNK=%s: rc %d, expected ncclInvalidArgument",
           bad[i], rc);
    char value[32];
    snprintf(value, sizeof value, "'%s'", bad[i]);
    EXPECT(strstr(log, "WARN") && strstr(log, "PERSEUS_STAGING_CHUNK") && strstr(log, value) &&
               strstr(log, "multiple of 64"),
           "PERSEUS_STAGING_CHUNK=%s: the warning does not name the variable, the value and the "
           "multiple of 64 expected: '%s'", bad[i], log);
  }
  unsetenv("PERSEUS_STAGING_CHUNK");
  return unit_report("unit_staging_chunk");
}
