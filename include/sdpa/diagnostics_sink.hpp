/**
 * \file sdpa/diagnostics_sink.hpp
 * \brief A sink for the per-row diagnostics gathered during a forward pass (see diagnostics.hpp).
 */
#ifndef SDPA_DIAGNOSTICS_SINK_HPP
#define SDPA_DIAGNOSTICS_SINK_HPP

#include <vector>

#include "internal/diagnostics_rows.hpp"

namespace sdpa {

/**
 * \brief Pass its address as the last argument of attentionForward or multiHeadAttentionForward
 * to collect, per head and query row, the statistics `diagnostics(sink)` folds into a
 * Diagnostics, without a second pass over P. Each forward pass overwrites it. The tiled kernel
 * streams each row's figures beside its online softmax (a few running sums per row, O(n_q) memory);
 * the naive kernel reads each materialised row.
 */
class DiagnosticsSink {
 public:
  Index heads() const { return Index(m_rows.size()); }
  const std::vector<internal::RowStats>& rows(Index h) const { return m_rows[size_t(h)]; }
  const internal::HeadInputs& inputs(Index h) const { return m_inputs[size_t(h)]; }

  /// Called by the kernels: sizes the sink for `heads` heads of `queries` rows.
  void start(Index heads, Index queries) {
    // Resized in place: a sink reused across calls keeps its memory (fresh pages cost more than
    // the rows' statistics).
    m_rows.resize(size_t(heads));
    for (auto& rows : m_rows) rows.assign(size_t(queries), internal::RowStats{});
    m_inputs.assign(size_t(heads), internal::HeadInputs{});
  }
  std::vector<internal::RowStats>& rows(Index h) { return m_rows[size_t(h)]; }
  internal::HeadInputs& inputs(Index h) { return m_inputs[size_t(h)]; }

 private:
  std::vector<std::vector<internal::RowStats>> m_rows;
  std::vector<internal::HeadInputs> m_inputs;
};

}  // namespace sdpa

#endif  // SDPA_DIAGNOSTICS_SINK_HPP
