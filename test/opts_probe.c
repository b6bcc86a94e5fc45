/* opts_probe: the GPU programs' option table (harness/opts.h) and list
 * parser on a CPU host, so their refusals are tested where nvcc is absent.
 * Prints the values it parsed. */
#include <stdio.h>

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

static void usage(FILE *f)
{
  fprintf(f, "usage: opts_probe [-n ITERS] [-e SIZE] [-t LIST] [-p lsa|gin] [-s SEED] [-v]\n");
}

int main(int argc, char **argv)
{
  static const char *const paths[] = {"lsa", "gin"};
  int iters = 0, path = 0, verbose = 0;
  size_t bytes = 0;
  uint64_t seed = 0;
  list_t tiles = {{0}, 0};
  const ps_opt_t opts[] = {
    PS_OPT_INT('n', &iters, "20", 1, 1 << 24),
    PS_OPT_SIZE('e', &bytes, "1M", 1, 1 << 30),
    PS_OPT_FN('t', &tiles, "1,8,64", parse_list),
    PS_OPT_NAME('p', &path, "lsa", paths, NULL, 2),
    PS_OPT_SEED('s', &seed, "1"),
    PS_OPT_FLAG('v', &verbose),
  };
  ps_opts_parse(argc, argv, "opts_probe", opts, PS_OPTS_N(opts), usage, 1);
  printf("n %d e %zu p %s s %llu v %d t", iters, bytes, paths[path], (unsigned long long)seed,
         verbose);
  for (int i = 0; i < tiles.n; i++) printf("%s%d", i ? "," : " ", tiles.v[i]);
  printf("\n");
  return 0;
}
