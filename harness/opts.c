/* opts.c: options by table (see opts.h). */
#include "opts.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "size_parse.h"

/* Parses one value into o->out; 0, or -1 for a bad value. */
static int parse_one(const ps_opt_t *o, const char *arg)
{
  switch (o->kind) {
  case PS_OPTK_INT:
    return sp_parse_int(arg, (long)o->lo, (long)o->hi, (int *)o->out);
  case PS_OPTK_SIZE: {
    size_t *v = (size_t *)o->out;
    if (sp_parse_size(arg, 0, v)) return -1;
    return *v < (size_t)o->lo || (o->hi > 0 && *v > (size_t)o->hi) ? -1 : 0;
  }
  case PS_OPTK_SEED:
    return sp_parse_u64(arg, (uint64_t *)o->out);
  case PS_OPTK_STR:
    *(const char **)o->out = arg;
    return 0;
  case PS_OPTK_FLAG:
    *(int *)o->out = 1;
    return 0;
  case PS_OPTK_NAME:
    for (long long i = 0; i < o->hi; i++)
      if (!strcmp(arg, o->names[i])) {
        *(int *)o->out = o->values ? o->values[i] : (int)i;
        return 0;
      }
    return -1;
  case PS_OPTK_FN:
    return o->fn(o->out, arg) ? -1 : 0;
  }
  return -1;
}

/* What option o takes, for a refusal. */
static void expected(FILE *f, const ps_opt_t *o)
{
  switch (o->kind) {
  case PS_OPTK_INT:
    fprintf(f, "expected an integer from %lld to %lld", o->lo, o->hi);
    break;
  case PS_OPTK_SIZE:
    fprintf(f, "expected a size from %lld bytes", o->lo);
    if (o->hi > 0) fprintf(f, " to %lld", o->hi);
    fprintf(f, ", digits with an optional K, M or G");
    break;
  case PS_OPTK_SEED:
    fprintf(f, "expected an unsigned number: decimal, 0x hex or 0 octal");
    break;
  case PS_OPTK_NAME:
    fprintf(f, "expected one of");
    for (long long i = 0; i < o->hi; i++) fprintf(f, "%s %s", i ? "," : "", o->names[i]);
    break;
  default:
    fprintf(f, "see -h");
    break;
  }
}

const struct option ps_help_longopts[] = {{"help", no_argument, NULL, 'h'}, {NULL, 0, NULL, 0}};

void ps_opts_parse(int argc, char **argv, const char *prog, const ps_opt_t *opts, int n,
                   void (*usage)(FILE *), int no_args)
{
  char optstring[2 * 64 + 2];
  int len = 0;
  for (int i = 0; i < n; i++) {
    /* a default the option itself would refuse is the program's own bug */
    if (opts[i].kind == PS_OPTK_SEED && !opts[i].def)
      *(uint64_t *)opts[i].out = (uint64_t)time(NULL) * 2654435761u ^ (uint64_t)getpid();
    if (opts[i].def && parse_one(&opts[i], opts[i].def)) {
      fprintf(stderr, "%s: the default of -%c, '%s', is not a valid value\n", prog,
              opts[i].letter, opts[i].def);
      exit(1);
    }
    if (len < (int)sizeof(optstring) - 3) {
      optstring[len++] = opts[i].letter;
      if (opts[i].kind != PS_OPTK_FLAG) optstring[len++] = ':';
    }
  }
  optstring[len++] = 'h';
  optstring[len] = '\0';
  int opt;
  while ((opt = getopt_long(argc, argv, optstring, ps_help_longopts, NULL)) != -1) {
    if (opt == 'h') {
      usage(stdout);
      exit(0);
    }
    const ps_opt_t *o = NULL;
    for (int i = 0; i < n && !o; i++)
      if (opts[i].letter == opt) o = &opts[i];
    if (!o) {
      usage(stderr);
      exit(2);
    }
    if (parse_one(o, optarg)) {
      fprintf(stderr, "%s: bad value for -%c: '%s' (", prog, opt, optarg);
      expected(stderr, o);
      fprintf(stderr, ")\n");
      exit(2);
    }
  }
  if (no_args && optind < argc) {
    fprintf(stderr, "%s: unexpected argument '%s'\n", prog, argv[optind]);
    exit(2);
  }
}
