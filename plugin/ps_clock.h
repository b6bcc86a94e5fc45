/* Time and randomness for every layer: the two-sided path, the one-sided
 * engine and the endpoint all read them, so they live below all three. */
#ifndef PS_CLOCK_H
#define PS_CLOCK_H

#include <stdint.h>

uint64_t ps_now_ns(void); /* CLOCK_MONOTONIC */
uint64_t ps_random64(void); /* never 0 */

#endif
