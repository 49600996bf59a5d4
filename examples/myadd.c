#include <stdint.h>

/* A C function for the disco-rpc examples: linked into a minimal server. */
int64_t myadd(int64_t a, int64_t b) { return a + b; }
