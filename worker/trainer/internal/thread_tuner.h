// Fast defaults (issue #17): without --threads a trainer does not take the OpenMP default (every
// core) on trust. On a small model that default can be several times slower than one thread
// (OpenMP's fork and join and the batch prefetcher's thread share the cores with the math), on a
// large one it is faster. The tuner measures the first training steps with both, in alternating
// blocks, and keeps the faster: they are real steps, only the thread count differs. Measuring
// costs nothing but those steps, and covers every model kind (sparse tables, multi-input) the
// same way, which a rule on the model's size would not.
//
// Schedule: 4 blocks of kBlockSteps steps, default, 1, default, 1 threads; each block's first step
// is left out (the OpenMP team changes size there). The candidate with the lower median step
// time wins; one thread wins a near tie (within 3%), being the gentler on a shared host.
#ifndef TESSERA_WORKER_TRAINER_INTERNAL_THREAD_TUNER_H_
#define TESSERA_WORKER_TRAINER_INTERNAL_THREAD_TUNER_H_

#include <optional>
#include <string>
#include <vector>

#include "kernels/backend.h"

namespace tessera::trainer::internal {

class ThreadTuner {
 public:
  static constexpr int kBlockSteps = 4;

  // Tunes `backend` (not owned) only when `requested_threads` is 0 (no --threads), the backend
  // runs on more than one CPU thread, and OMP_NUM_THREADS does not set the count already.
  ThreadTuner(kernels::Backend* backend, int requested_threads);

  // True while steps are being measured.
  bool active() const { return step_ < kBlocks * kBlockSteps; }
  // Before a step's compute: sets the thread count it runs with.
  void BeforeStep();
  // After it, with its wall seconds. Once the last measured step is in, the choice is applied
  // and returned as a line for the log; otherwise nullopt.
  std::optional<std::string> AfterStep(double seconds);

 private:
  static constexpr int kBlocks = 4;
  int Candidate(int block) const { return block % 2 == 0 ? many_ : 1; }

  kernels::Backend* backend_;
  int many_ = 1;                      // the default thread count
  int step_ = kBlocks * kBlockSteps;  // measured so far (at the end: inactive)
  std::vector<double> many_seconds_, one_seconds_;
};

}  // namespace tessera::trainer::internal

#endif  // TESSERA_WORKER_TRAINER_INTERNAL_THREAD_TUNER_H_
