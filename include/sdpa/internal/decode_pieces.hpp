#ifndef SDPA_INTERNAL_DECODE_PIECES_HPP
#define SDPA_INTERNAL_DECODE_PIECES_HPP

// What the KvCache's decoding kernels read: a sequence's pieces of keys and values, the spans of
// values, and the requests that bring the next chunk or the next short piece into L2 while the
// kernels compute. decode_cache.hpp cuts a sequence into these; the kernels
// (decode_cache_isa.inc, which decode_rows.hpp builds beside its row kernels, so that decoding
// over plain matrices takes their wide blocks too) take them.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu.hpp"
#include "macros.hpp"

namespace sdpa::internal::cache {

/// Keys [pos, pos + count) of a sequence, stored contiguously. For kv head h, its k starts at
/// k + h kHead bytes: float-like storage keeps key j, channel c at element j + c ld; quantised
/// storage keeps consecutive groups of 32 keys (count a multiple of 32).
struct Piece {
  Index pos = 0, count = 0;
  const unsigned char* k = nullptr;
  const unsigned char* v = nullptr;
  Index kHead = 0, vHead = 0, ld = 0;
  bool quantised = false;
};

/// A sequence as the kernel reads it: its pieces in logical order, its length and the first
/// position a ring still holds (earlier keys of a piece's first group are hidden).
struct SequenceView {
  const std::vector<Piece>* pieces = nullptr;
  Index length = 0, first = 0;
};

/**
 * The next chunk's keys and values brought into L2 while a multi-row block computes the current
 * one: a list of byte runs, one line fetched each time `step` has been called often enough that
 * the whole list is spread evenly over `steps` calls. With 8 or more query rows the products of
 * a chunk take longer than its memory stream; without this the stream and the products follow
 * each other (the hardware prefetcher does not run past a chunk's short column runs: AMD EPYC,
 * sessions 25-26). Filled only where CpuVendor::chunkRequests(): on an Emerald Rapids Xeon (session
 * 29; d 128, one thread, kernels without spills) fp32 decoding of 8 query rows over 65536 keys
 * took 6.2 ms with it and 4.3-4.4 without, 16 rows 8.6 and 7.3-7.4, GQA Heads{32, 4} at n_k 8192
 * 2.67 and 2.18. (Likely, not measured, this VM has no hardware counters: its requests to
 * memory, one or two per column of 24 FMAs, hold the line fill buffers that the kernels' own
 * loads from L2 then wait for.)
 */
struct ChunkPrefetch {
  struct Run {
    const char* p;
    Index bytes, lines;
  };
  std::vector<Run> runs;
  size_t run = 0;
  Index line = 0, credit = 0, lines = 0, steps = 1;

  void clear() {
    runs.clear();
    run = 0;
    line = credit = lines = 0;
  }
  void add(const void* p, Index bytes) {
    if (bytes <= 0) return;
    const auto at = Index(reinterpret_cast<std::uintptr_t>(p) % 64);
    const Index n = (at + bytes + 63) / 64;  // the cache lines the run touches
    runs.push_back({static_cast<const char*>(p), bytes, n});
    lines += n;
  }
  /// Spreads the runs' lines over `calls` calls of step.
  void spreadOver(Index calls) { steps = std::max<Index>(1, calls); }

  /// The stepping state as a kernel's local (its counters in registers): stepped through the
  /// struct, every call's counters went to memory and back, a store-to-load chain in the
  /// multi-row kernels' inner loops (one call per column of 8 multiply-adds with AVX2).
  struct Cursor {
    const Run* runs = nullptr;
    size_t count = 0, run = 0;
    Index line = 0, credit = 0, lines = 0, steps = 1;
    void step() {
      for (credit += lines; credit >= steps && run < count; credit -= steps) {
        // Line `line` of the run holds byte 64 line of it, or (the last line) its last byte.
        const Run& r = runs[run];
        __builtin_prefetch(r.p + std::min(line * 64, r.bytes - 1), 0, 2);
        if (++line == r.lines) {
          ++run;
          line = 0;
        }
      }
    }
  };
  Cursor cursor() const { return {runs.data(), runs.size(), run, line, credit, lines, steps}; }
  void save(const Cursor& c) {
    run = c.run;
    line = c.line;
    credit = c.credit;
  }
};

/**
 * A short piece's columns (a paged block of up to 64 keys: a column is a run of one to four
 * cache lines) requested one at a time, as the kernel reads the same column of its own piece.
 * Spread so, the requests keep pace with the reads; asked for all at once before the piece (as
 * until session 27), they queued behind each other and the kernel's own reads waited: fp32
 * blocks of 16 and 32 keys decoded 1.7x slower than the contiguous cache, now as fast.
 * p: null for none.
 */
struct ColumnsAhead {
  /// Pieces of at most this many keys have their successor's successor requested.
  static constexpr Index kKeys = 64;

  const char* p = nullptr;
  Index ld = 0, bytes = 0;  // column stride and run, in bytes

  /**
   * Whether column() requests are made (withAhead), and ChunkPrefetch's: not in Intel's order
   * (CpuVendor). One token, d 128, the pieces' time over the contiguous cache's: on an AMD EPYC
   * (Zen 4, session 27) fp32 blocks of 16 keys 1.58-1.69x without the requests, 1.16-1.21x
   * with them; on an Emerald Rapids Xeon (session 28) fp32 blocks of 16 keys 0.99-1.00x without,
   * 1.10x with, fp16 blocks of 16 1.32-1.33x without, 1.99x with. (Until session 28 GCC 12 had
   * compiled column()'s __builtin_prefetch calls away in the kernels that inline it, hence
   * request()'s asm statement.)
   */
  static bool wanted() { return !CpuVendor::intel(); }

  /// Requests x's line into L2 (prefetcht1): an asm statement on x86, which the compiler keeps.
  static void request(const char* x) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    __asm__ volatile("prefetcht1 %0" : : "m"(*x));
#else
    __builtin_prefetch(x, 0, 2);
#endif
  }

  ColumnsAhead() = default;
  template <typename T>
  ColumnsAhead(const T* columns, Index ldColumns, Index rows)
      : p(reinterpret_cast<const char*>(columns)), ld(ldColumns * Index(sizeof(T))), bytes(rows * Index(sizeof(T))) {}
  /// Requests column c's lines: its first and last byte's, and every 64 bytes between. Lines
  /// that neighbouring columns share are requested again (measured faster than once each for
  /// fp32 blocks of 16 keys on an AVX2 EPYC); where columns are shorter than a line (fp16 blocks
  /// of 16 keys: two columns a line), each line once, by the first column in it (not yet
  /// measured where wanted(): on the Xeon of session 28, where it seemed faster than the whole
  /// piece at once, the compiler had dropped these requests).
  void column(Index c) const {
    if (!p) return;
    const char* r = p + c * ld;
    if (bytes < 64) {  // columns shorter than a line: each line once, from the first column in it
      const auto line = [](const char* x) { return reinterpret_cast<std::uintptr_t>(x) >> 6; };
      if (c == 0 || line(r) != line(r - ld + bytes - 1)) request(r);
      if (line(r + bytes - 1) != line(r)) request(r + bytes - 1);
      return;
    }
    for (Index b = 0; b < bytes; b += 64) request(r + b);
    request(r + bytes - 1);
  }
  /// Requests the first d columns now, a line at a time over their span, on every CPU (where a
  /// kernel does not read the piece column by column: half keys converted first, or only wide
  /// passes over it).
  void all(Index d) const {
    if (!p) return;
    for (Index b = 0; b < (d - 1) * ld + bytes; b += 64) request(p + b);
  }
};

/// ColumnsAhead's stand-in where nothing is requested: the kernels are instantiated for it, so
/// that their loops carry no request code (a check per column measured 5-8% on fp16 blocks of
/// 16 keys).
struct NoColumnsAhead {
  void column(Index) const {}
  void all(Index) const {}
};

/// f(ahead) where ahead has a piece and column-wise requests are wanted, else f(NoColumnsAhead{}).
/// (Its call sites keep one switch case per row count: folding them into one generic lambda
/// made fp16 blocks of 16 keys 7% slower on the Xeon of session 28, 1.89 -> 2.03 ms.)
template <typename F>
void withAhead(const ColumnsAhead& ahead, F&& f) {
  if (ahead.p && ColumnsAhead::wanted())
    f(ahead);
  else
    f(NoColumnsAhead{});
}

/// A run of `count` keys' values read in place (column stride ld), whose weights start at
/// `offset` of the weight rows: the pieces of a chunk as the values kernels (cacheValues,
/// cacheShortValues) take them, which keep each (row, column)'s vector of partial sums across
/// spans (a paged sequence's blocks of 16 keys cost no reduction each).
template <typename T = float>
struct SpanOf {
  const T* v;
  Index ld, count, offset;
};
using FloatSpan = SpanOf<float>;

}  // namespace sdpa::internal::cache

#endif  // SDPA_INTERNAL_DECODE_PIECES_HPP
