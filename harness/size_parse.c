/* size_parse.c: option value parsers (see size_parse.h). */
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "size_parse.h"

int sp_parse_size(const char *s, int allow_t, size_t *out)
{
  char *end;
  if (!isdigit((unsigned char)s[0])) return -1;
  errno = 0;
  unsigned long long v = strtoull(s, &end, 10), mul = 1;
  if (errno) return -1;
  switch (toupper((unsigned char)*end)) {
  case 'K': mul = 1ULL << 10; end++; break;
  case 'M': mul = 1ULL << 20; end++; break;
  case 'G': mul = 1ULL << 30; end++; break;
  case 'T':
    if (allow_t) {
      mul = 1ULL << 40;
      end++;
    }
    break;
  default: break;
  }
  if (*end == 'B' || *end == 'b') end++;
  if (*end || v > SIZE_MAX / mul) return -1;
  *out = (size_t)(v * mul);
  return 0;
}

int sp_parse_int(const char *s, long lo, long hi, int *out)
{
  char *end;
  /* digits, with a leading minus only: strtol would also take spaces and '+' */
  if (!isdigit((unsigned char)s[s[0] == '-']) || (s[0] == '-' && lo >= 0)) return -1;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (errno || end == s || *end || v < lo || v > hi) return -1;
  *out = (int)v;
  return 0;
}

int sp_list_next(const char **cursor, char *item, size_t cap)
{
  if (!*cursor) return 0;
  size_t len = strcspn(*cursor, ",");
  if (len == 0 || len >= cap) return -1;
  memcpy(item, *cursor, len);
  item[len] = '\0';
  *cursor = (*cursor)[len] ? *cursor + len + 1 : NULL;
  return 1;
}

int sp_parse_int_list(const char *s, long lo, long hi, int *out, int max)
{
  char item[24];
  int n = 0, r;
  while ((r = sp_list_next(&s, item, sizeof(item))) > 0)
    if (n == max || sp_parse_int(item, lo, hi, &out[n++])) return -1;
  return r < 0 ? -1 : n;
}

int sp_parse_u64(const char *s, uint64_t *out)
{
  char *end;
  if (!isdigit((unsigned char)s[0])) return -1; /* strtoull takes "-1" as 2^64 - 1 */
  errno = 0;
  unsigned long long v = strtoull(s, &end, 0);
  if (errno || end == s || *end) return -1;
  *out = (uint64_t)v;
  return 0;
}

int sp_parse_factor(const char *s, double hi, double *out)
{
  char *end;
  if (!isdigit((unsigned char)s[0])) return -1;
  errno = 0;
  double v = strtod(s, &end);
  if (errno || *end || !isfinite(v) || !(v > 1) || v > hi) return -1;
  *out = v;
  return 0;
}
