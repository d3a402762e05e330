// A step's new keys (or values) of one layer stored in their slots of the paged pool, on the CPU.
//
// torch's index_copy_ took ~10 us a layer with the pool in cache and 40-90 us in the engine, where each slot's
// lines are cold (a decode step of 64 sequences, float32, the record model: 512 rows of 256 bytes a layer for K
// and V). Here each row is one memcpy, a head's rows in token order, the next row's destination fetched while
// one is copied. Bytes only: every storage dtype takes the same path.
//
// src  : [heads, rows, row_bytes] with byte strides (src_head, src_row), each row contiguous
// pool : [heads, slots, row_bytes], each head `pool_head` bytes apart; row r goes to slot slots[r]
#include <cstdint>
#include <cstring>

extern "C" void genq_write_rows(const char *src, int64_t src_head, int64_t src_row, char *pool, int64_t pool_head,
                                const int64_t *slots, int64_t heads, int64_t rows, int64_t row_bytes) {
    for (int64_t h = 0; h < heads; h++) {
        const char *from = src + h * src_head;
        char *to = pool + h * pool_head;
        for (int64_t r = 0; r < rows; r++) {
            if (r + 1 < rows) __builtin_prefetch(to + slots[r + 1] * row_bytes, 1, 3);
            std::memcpy(to + slots[r] * row_bytes, from + r * src_row, static_cast<size_t>(row_bytes));
        }
    }
}
