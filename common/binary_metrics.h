// Metrics of binary classifiers (click-through rate and the like): the area under the ROC curve
// and the log loss. Used by the trainers' evaluations and by `tessera datagen`, which reports the
// best values a planted model reaches, so both are computed one way.
#ifndef TESSERA_COMMON_BINARY_METRICS_H_
#define TESSERA_COMMON_BINARY_METRICS_H_

#include "absl/types/span.h"

namespace tessera {

// The area under the ROC curve of `scores` (any monotone score: logits or probabilities) against
// `labels` (> 0.5 is positive): the probability that a random positive scores above a random
// negative, ties counting one half (the Mann-Whitney statistic). NaN when either class is absent.
// O(n log n). REQUIRES: scores.size() == labels.size().
double RocAuc(absl::Span<const float> scores, absl::Span<const float> labels);

// The mean of -(y log p + (1 - y) log(1 - p)) over the examples, p clamped to
// [1e-7, 1 - 1e-7]; 0 for no examples. REQUIRES: sizes equal.
double LogLoss(absl::Span<const double> probabilities, absl::Span<const float> labels);

}  // namespace tessera

#endif  // TESSERA_COMMON_BINARY_METRICS_H_
