#include "worker/trainer/progress.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_format.h"

namespace tessera::trainer {

std::string FormatDuration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const int64_t s = static_cast<int64_t>(std::llround(seconds));
  if (s >= 3600) return absl::StrFormat("%d:%02d:%02d", s / 3600, (s / 60) % 60, s % 60);
  return absl::StrFormat("%d:%02d", s / 60, s % 60);
}

namespace {

std::string Rate(double samples_per_second) {
  if (samples_per_second >= 1000) return absl::StrFormat("%.1fk", samples_per_second / 1000);
  return absl::StrFormat("%.0f", samples_per_second);
}

std::string EpochLine(const Progress& p) {
  std::string line = absl::StrFormat("epoch %d/%d: train loss %.4f acc %.4f", p.epoch, p.epochs,
                                     p.loss, p.accuracy);
  if (p.evaluated) {
    line += absl::StrFormat(", test loss %.4f acc %.4f", p.test_loss, p.test_accuracy);
    if (p.test_auc.has_value()) line += absl::StrFormat(" auc %.4f", *p.test_auc);
  }
  line += absl::StrFormat(", %.1f s, %s samples/s, step %d/%d", p.epoch_seconds,
                          Rate(p.samples_per_second), p.step, p.total_steps);
  return line;
}

}  // namespace

void ProgressPrinter::Report(const Progress& p) {
  if (p.epoch_end) {
    if (bar_on_screen_) std::fputs("\r\033[K", out_);
    bar_on_screen_ = false;
    std::fprintf(out_, "%s\n", EpochLine(p).c_str());
    std::fflush(out_);
    return;
  }
  if (terminal_) {
    const auto now = std::chrono::steady_clock::now();
    const bool last = p.step_in_epoch == p.steps_per_epoch;
    if (!last && now - last_draw_ < std::chrono::milliseconds(100)) return;
    last_draw_ = now;
    constexpr int kWidth = 30;
    const double frac =
        p.steps_per_epoch > 0 ? static_cast<double>(p.step_in_epoch) / p.steps_per_epoch : 0;
    const int filled = std::clamp(static_cast<int>(frac * kWidth), 0, kWidth);
    std::fprintf(out_, "\r\033[Kepoch %d/%d [%s%s] %lld/%lld loss %.4f %s samples/s ETA %s",
                 p.epoch, p.epochs, std::string(filled, '#').c_str(),
                 std::string(kWidth - filled, '.').c_str(), static_cast<long long>(p.step_in_epoch),
                 static_cast<long long>(p.steps_per_epoch), p.loss,
                 Rate(p.samples_per_second).c_str(), FormatDuration(p.eta_seconds).c_str());
    std::fflush(out_);
    bar_on_screen_ = true;
    return;
  }
  const int64_t every = std::max<int64_t>(1, p.steps_per_epoch / 10);
  if (p.step_in_epoch % every != 0 || p.step_in_epoch == p.steps_per_epoch) return;
  std::fprintf(out_, "epoch %d/%d step %lld/%lld (total %lld/%lld) loss %.4f %s samples/s ETA %s\n",
               p.epoch, p.epochs, static_cast<long long>(p.step_in_epoch),
               static_cast<long long>(p.steps_per_epoch), static_cast<long long>(p.step),
               static_cast<long long>(p.total_steps), p.loss, Rate(p.samples_per_second).c_str(),
               FormatDuration(p.eta_seconds).c_str());
  std::fflush(out_);
}

void ProgressPrinter::Note(const std::string& line) {
  Finish();
  std::fprintf(out_, "%s\n", line.c_str());
  std::fflush(out_);
}

void ProgressPrinter::Finish() {
  if (bar_on_screen_) {
    std::fputs("\n", out_);
    std::fflush(out_);
    bar_on_screen_ = false;
  }
}

}  // namespace tessera::trainer
