/* Preloaded into a program that counts nodes by host name (NCCL EP's
 * ncclEpCreateGroup does), so that ranks on one machine can pretend to be on
 * several hosts, as NCCL_HOSTID makes them for NCCL: gethostname() answers
 * $PERSEUS_TEST_HOSTNAME where it is set, the real name otherwise. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/utsname.h>
#include <unistd.h>

int gethostname(char *name, size_t len) {
  const char *h = getenv("PERSEUS_TEST_HOSTNAME");
  struct utsname u;
  if (!h || !*h) {
    if (uname(&u)) return -1;
    h = u.nodename;
  }
  size_t n = strlen(h);
  if (n >= len) {
    errno = ENAMETOOLONG;
    return -1;
  }
  memcpy(name, h, n + 1);
  return 0;
}
