/* dl_find.c: a loaded library's path (see dl_find.h). */
#include "dl_find.h"

#include <link.h>
#include <stdio.h>
#include <string.h>

struct dl_find_arg {
  const char *part;
  char *out;
  size_t len;
};

static int match(struct dl_phdr_info *info, size_t size, void *arg)
{
  struct dl_find_arg *a = arg;
  (void)size;
  if (!info->dlpi_name || !strstr(info->dlpi_name, a->part)) return 0;
  snprintf(a->out, a->len, "%s", info->dlpi_name);
  return 1;
}

int ps_dl_find(const char *part, char *out, size_t len)
{
  struct dl_find_arg a = {part, out, len};
  return dl_iterate_phdr(match, &a) ? 0 : -1;
}
