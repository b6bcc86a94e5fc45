/* opts_probe: the GPU programs' option table (harness/opts.h) and list
 * parser on a CPU host, so their refusals are tested where nvcc is absent.
 * Prints the values it parsed. */
#include <stdio.h>
#include <string.h>

#include "opts.h"
#include "size_parse.h"

#define MAX_LIST 8

typedef struct {
  int v[MAX_LIST], n;
} list_t;

static int parse_list(void *out, const char *arg)
{
  list_t *l = out;
  l->n = sp_parse_int_list(arg, 1, 65536, l->v, MAX_LIST);
  return l->n < 0;
}

/* names from lsa, tma, gin, as the GPU programs' name lists take them */
static int parse_names(void *out, const char *arg)
{
  static const char *const known[] = {"lsa", "tma", "gin"};
  list_t *l = out;
  char item[8];
  int r;
  l->n = 0;
  while ((r = sp_list_next(&arg, item, sizeof(item))) > 0) {
    int k = 0;
    while (k < 3 && strcmp(item, known[k])) k++;
    if (k == 3 || l->n == MAX_LIST) return -1;
    l->v[l->n++] = k;
  }
  return r;
}

static void usage(FILE *f)
{
  fprintf(f, "usage: opts_probe [-n ITERS] [-e SIZE] [-t LIST] [-P NAMES] [-p lsa|gin] [-s SEED] [-v]\n");
}

int main(int argc, char **argv)
{
  static const char *const paths[] = {"lsa", "gin"};
  int iters = 0, path = 0, verbose = 0;
  size_t bytes = 0;
  uint64_t seed = 0;
  list_t tiles = {{0}, 0}, names = {{0}, 0};
  const ps_opt_t opts[] = {
    PS_OPT_INT('n', &iters, "20", 1, 1 << 24),
    PS_OPT_SIZE('e', &bytes, "1M", 1, 1 << 30),
    PS_OPT_FN('t', &tiles, "1,8,64", parse_list),
    PS_OPT_FN('P', &names, "lsa,gin", parse_names),
    PS_OPT_NAME('p', &path, "lsa", paths, NULL, 2),
    PS_OPT_SEED('s', &seed, "1"),
    PS_OPT_FLAG('v', &verbose),
  };
  ps_opts_parse(argc, argv, "opts_probe", opts, PS_OPTS_N(opts), usage, 1);
  printf("n %d e %zu p %s s %llu v %d t", iters, bytes, paths[path], (unsigned long long)seed,
         verbose);
  for (int i = 0; i < tiles.n; i++) printf("%s%d", i ? "," : " ", tiles.v[i]);
  printf(" P");
  for (int i = 0; i < names.n; i++) printf("%s%d", i ? "," : " ", names.v[i]);
  printf("\n");
  return 0;
}
