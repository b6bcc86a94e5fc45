/* size_parse.h: option value parsers of every test and benchmark (through
 * ps_driver.h, gin_proc.h, or directly). C11, no CUDA or NCCL. */
#ifndef PERSEUS_SIZE_PARSE_H
#define PERSEUS_SIZE_PARSE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* A byte count: decimal digits, then an optional K, M or G suffix (powers of
 * 2; T too where allow_t is nonzero, any case), then an optional B or b.
 * Returns 0 and sets *out, or -1 on anything else or on overflow. */
int sp_parse_size(const char *s, int allow_t, size_t *out);
/* A decimal integer in [lo, hi] (digits, a minus sign only where lo < 0; no
 * spaces or '+'); returns 0 and sets *out, or -1. */
int sp_parse_int(const char *s, long lo, long hi, int *out);
/* The next entry of a comma list at *cursor, copied into item (cap bytes):
 * 1, with *cursor moved past it (NULL after the last); 0 when *cursor is
 * NULL; -1 for an empty entry ("", ",,", a leading or trailing comma) or
 * one of cap or more characters. */
int sp_list_next(const char **cursor, char *item, size_t cap);
/* Comma-separated decimal integers in [lo, hi], as sp_parse_int takes
 * them, at most max; an empty entry (",,", a leading or trailing comma, "")
 * is refused. Returns the count, or -1. */
int sp_parse_int_list(const char *s, long lo, long hi, int *out, int max);
/* An unsigned 64-bit number strtoull reads (base 0: 0x.. hex, 0.. octal),
 * starting with a digit;
 * returns 0 and sets *out, or -1. */
int sp_parse_u64(const char *s, uint64_t *out);
/* A growth factor: a finite decimal number > 1 and <= hi; returns 0 and
 * sets *out, or -1. */
int sp_parse_factor(const char *s, double hi, double *out);

#ifdef __cplusplus
}
#endif
#endif
