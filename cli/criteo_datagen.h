// `tessera datagen criteo`: Criteo-format click logs drawn from a planted model, so that the best
// log loss and AUC any model can reach on them are known (issue #15). Nothing is downloaded.
//
// Each row: a label, 13 integer features and 26 categorical fields, as Criteo's TSV. Field c
// (0-based) has a vocabulary of round(10^(1 + 6 c / 25)) values, 10 for C1 up to 10^7 for C26,
// drawn Zipf-distributed (exponent 1.05 by default: a few values are very common, most are rare;
// a smaller one spreads the draws over more of each vocabulary) and written
// as 8 hex digits; each field is empty with probability 0.05. The integers are log-normal counts
// (floor(exp(N(1.5, 1.2^2))) - 1), empty with probability 0.1.
//
// The label is Bernoulli(sigmoid(logit)) with, for the logistic model,
//   logit = -1.2 + sum_c w_c(value_c) + sum_i u_i (log(1 + x_i) - 1.5),
// w_c(v) ~ N(0, 0.3^2) and u_i ~ N(0, 0.2^2), each a pure function of (seed, field, value), so
// vocabularies of 10^7 need no table; the factorisation-machine model adds the pairwise
// interactions sum_{c < d} <v_c(value_c), v_d(value_d)> of 4-dimensional factors ~ N(0, 0.17^2).
// A missing field adds nothing. The best achievable test log loss and AUC are those of the
// planted probabilities on the test rows; planted.json records them next to the data.
#ifndef TESSERA_CLI_CRITEO_DATAGEN_H_
#define TESSERA_CLI_CRITEO_DATAGEN_H_

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/statusor.h"

namespace tessera::cli {

struct CriteoDatagenOptions {
  std::string out_dir;     // created when absent; train.tsv, test.tsv and planted.json go there
  int64_t train_rows = 0;  // >= 1
  int64_t test_rows = -1;  // -1: train_rows / 10, at least 1000 (at most train_rows)
  uint64_t seed = 1;
  bool factorization_machine = false;  // else logistic
  double zipf_exponent = 1.05;         // in (0, 4], not 1 (the CDF's inverse needs 1 - s != 0)
  // Called about once a second with the rows written so far and the total (may be empty).
  std::function<void(int64_t written, int64_t total)> progress;
};

struct CriteoDatagenResult {
  int64_t train_rows = 0, test_rows = 0;
  double positive_rate = 0;       // of the test rows
  double best_test_log_loss = 0;  // of the planted probabilities
  double best_test_auc = 0;
  std::string train_path, test_path, planted_path;
};

// Writes the files (each to a temporary name, fsynced, then renamed into place). INVALID_ARGUMENT
// naming the option for bad rows; the file's error (with its path) for an unwritable folder.
absl::StatusOr<CriteoDatagenResult> GenerateCriteo(const CriteoDatagenOptions& options);

// planted.json's content for `r` and `options`.
std::string PlantedJson(const CriteoDatagenResult& r, const CriteoDatagenOptions& options);

}  // namespace tessera::cli

#endif  // TESSERA_CLI_CRITEO_DATAGEN_H_
