/* opts.h: a GPU program's options as a table (C11, no CUDA or NCCL). One
 * getopt loop serves every table: each option's default and each value given
 * are parsed and bounded by its kind, -h prints the usage, and a bad value
 * gets the same message in every program.
 *
 *   static cfg c;
 *   const ps_opt_t opts[] = {
 *     PS_OPT_INT('n', &c.iters, "20", 1, 1 << 24),
 *     PS_OPT_SIZE('e', &c.max_bytes, "1M", 1, 64 << 20),
 *     PS_OPT_STR('t', &c.list, "1,8,64"),
 *   };
 *   ps_opts_parse(argc, argv, "prog", opts, PS_OPTS_N(opts), usage, 1); */
#ifndef PS_HARNESS_OPTS_H
#define PS_HARNESS_OPTS_H

#include <stddef.h>
#include <stdint.h>
#include <getopt.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

enum ps_opt_kind {
  PS_OPTK_INT,  /* int in [lo, hi] */
  PS_OPTK_SIZE, /* size_t byte count, K/M/G suffixes, in [lo, hi]; hi 0: no bound */
  PS_OPTK_SEED, /* uint64_t: any number strtoull reads (base 0); default NULL: a
                 * seed from the clock and the pid */
  PS_OPTK_STR,  /* const char *: the argument itself, for the caller to parse */
  PS_OPTK_FLAG, /* int set to 1; the option takes no argument */
  PS_OPTK_NAME, /* int: argument names[i] (i < hi) sets values[i], or i without values */
  PS_OPTK_FN,   /* fn(out, argument) parses it; nonzero: a bad value */
};

typedef struct {
  char letter;
  enum ps_opt_kind kind;
  void *out;
  const char *def; /* parsed as if given before the options; NULL: *out keeps its
                    * value (SEED: see above) */
  long long lo, hi;
  const char *const *names;
  const int *values;
  int (*fn)(void *out, const char *arg);
} ps_opt_t;

/* (void *)p, where p must have type T (a compile error otherwise) */
#define PS_OPT_OUT(p, T) ((void *)(1 ? (p) : (T)0))
#define PS_OPT_INT(c, p, def, lo, hi) \
  {(c), PS_OPTK_INT, PS_OPT_OUT(p, int *), (def), (lo), (hi), NULL, NULL, NULL}
#define PS_OPT_SIZE(c, p, def, lo, hi) \
  {(c), PS_OPTK_SIZE, PS_OPT_OUT(p, size_t *), (def), (lo), (hi), NULL, NULL, NULL}
#define PS_OPT_SEED(c, p, def) \
  {(c), PS_OPTK_SEED, PS_OPT_OUT(p, uint64_t *), (def), 0, 0, NULL, NULL, NULL}
#define PS_OPT_STR(c, p, def) \
  {(c), PS_OPTK_STR, PS_OPT_OUT(p, const char **), (def), 0, 0, NULL, NULL, NULL}
#define PS_OPT_FLAG(c, p) {(c), PS_OPTK_FLAG, PS_OPT_OUT(p, int *), NULL, 0, 0, NULL, NULL, NULL}
/* n names; values NULL: the index of the name given */
#define PS_OPT_NAME(c, p, def, names, values, n) \
  {(c), PS_OPTK_NAME, PS_OPT_OUT(p, int *), (def), 0, (n), (names), (values), NULL}
#define PS_OPT_FN(c, p, def, fn) {(c), PS_OPTK_FN, (void *)(p), (def), 0, 0, NULL, NULL, (fn)}
#define PS_OPTS_N(table) ((int)(sizeof(table) / sizeof((table)[0])))

/* getopt_long's table of the one long option every program takes: --help,
 * as -h. */
extern const struct option ps_help_longopts[];

/* A program's options, first thing in main: every default of the n options
 * of the table, then getopt over argv in the order given. -h (or --help) prints usage on
 * stdout and exits 0. An option not in the table (getopt says which), a
 * value its kind refuses ("<prog>: bad value for -X: 'VALUE'") and, where
 * no_args is nonzero, an argument after the options ("<prog>: unexpected
 * argument 'ARG'") print that (the first with the usage on stderr) and exit
 * 2, as the CPU benchmarks do (a benchmark's 1: wrong bytes). Returns with
 * optind at the first argument after the options. */
void ps_opts_parse(int argc, char **argv, const char *prog, const ps_opt_t *opts, int n,
                   void (*usage)(FILE *), int no_args);

#ifdef __cplusplus
}
#endif
#endif
