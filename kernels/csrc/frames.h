/* protos/frames.py's frame header and constants, for the C code that reads or writes frames
 * (shm_serve.c in workers, stages.c on the attention node). */
#ifndef HETERO_MOE_FRAMES_H
#define HETERO_MOE_FRAMES_H

#include <stdint.h>

enum { HEADER_BYTES = 56 };
enum { KIND_FORWARD = 1, KIND_PARTIAL = 2 };
enum { WIRE_FLOAT32 = 1, WIRE_FLOAT16 = 2, WIRE_BFLOAT16 = 3 }; /* protos/expert.proto DType */
static const uint32_t MAGIC = 0x454F4D48u;
static const uint16_t FRAME_VERSION = 2;
static const int64_t PAIR_BYTES = 12; /* int32 row, int32 expert, float32 weight */

/* protos/frames.py's HEADER, byte for byte on this little-endian host. */
typedef struct __attribute__((packed)) {
    uint32_t magic;
    uint16_t version, kind;
    uint64_t request;
    uint32_t layer, slot, rows, hidden, pairs;
    uint16_t dtype, status;
    uint64_t payload, compute_ns;
} header;
_Static_assert(sizeof(header) == HEADER_BYTES, "the frame header is 56 bytes");
_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "frames are little-endian");

#endif
