/* dl_find.h: which file a library already loaded in this process came from
 * (C11, no CUDA or NCCL), for the versions and paths the programs print and
 * for dlopen(RTLD_NOLOAD) of a plugin NCCL loaded by path. */
#ifndef PS_HARNESS_DL_FIND_H
#define PS_HARNESS_DL_FIND_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The path of the first loaded object whose name contains `part` (in
 * dl_iterate_phdr order), into out (len bytes). Returns 0, or -1 with out
 * untouched when none is loaded. */
int ps_dl_find(const char *part, char *out, size_t len);

#ifdef __cplusplus
}
#endif
#endif
