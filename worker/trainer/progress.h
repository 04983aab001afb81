// Training progress for people: a redrawn progress bar on a terminal, plain lines otherwise.
#ifndef TESSERA_WORKER_TRAINER_PROGRESS_H_
#define TESSERA_WORKER_TRAINER_PROGRESS_H_

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>

namespace tessera::trainer {

// A snapshot of a training run, reported after every step and at every epoch end.
struct Progress {
  bool epoch_end = false;
  int epoch = 0;  // 1-based
  int epochs = 0;
  int64_t step_in_epoch = 0;  // steps done in this epoch
  int64_t steps_per_epoch = 0;
  int64_t step = 0;  // steps done in the run
  int64_t total_steps = 0;
  double loss = 0;      // mean training loss over this epoch so far
  double accuracy = 0;  // training accuracy over this epoch so far
  double samples_per_second = 0;
  double eta_seconds = 0;
  // Epoch end only.
  bool evaluated = false;
  double test_loss = 0;
  double test_accuracy = 0;
  std::optional<double> test_auc;  // binary tasks
  double epoch_seconds = 0;
};

// Writes progress to `out` (not owned). On a terminal the bar is redrawn at most every 100 ms;
// otherwise a line is written at every tenth of an epoch. Epoch ends always get a line.
// Not thread-safe.
class ProgressPrinter {
 public:
  ProgressPrinter(std::FILE* out, bool terminal) : out_(out), terminal_(terminal) {}
  void Report(const Progress& p);
  // Ends a bar that is still on screen.
  void Finish();
  // A line of its own (below a bar that is on screen, which the next Report redraws).
  void Note(const std::string& line);

 private:
  std::FILE* out_;
  bool terminal_;
  bool bar_on_screen_ = false;
  std::chrono::steady_clock::time_point last_draw_{};
};

// "1:05", "12:00:01".
std::string FormatDuration(double seconds);

}  // namespace tessera::trainer

#endif  // TESSERA_WORKER_TRAINER_PROGRESS_H_
