#include "cli/criteo_datagen.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/binary_metrics.h"
#include "common/status_macros.h"

namespace tessera::cli {
namespace {

constexpr int kIntegers = 13;
constexpr int kCategories = 26;
constexpr int kFactors = 4;
constexpr double kBias = -1.2;
constexpr double kCategoryStddev = 0.3;
constexpr double kIntegerStddev = 0.2;
constexpr double kFactorStddev = 0.17;
constexpr double kMissingCategory = 0.05;
constexpr double kMissingInteger = 0.1;
constexpr double kPi = 3.14159265358979323846;

uint64_t Mix(uint64_t a, uint64_t b) {
  uint64_t z = a + 0x9E3779B97F4A7C15ULL * (b + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// A standard normal that is a pure function of `key` (Box-Muller on two mixed words).
double NormalOf(uint64_t key) {
  const double u1 = (static_cast<double>(Mix(key, 1) >> 11) + 1.0) / 9007199254740993.0;
  const double u2 = static_cast<double>(Mix(key, 2) >> 11) / 9007199254740992.0;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * kPi * u2);
}

int64_t Vocabulary(int field) {
  return static_cast<int64_t>(std::llround(std::pow(10.0, 1.0 + 6.0 * field / (kCategories - 1))));
}

// A Zipf-like rank in [1, v]: the inverse of the continuous power law's CDF.
int64_t ZipfRank(double u, int64_t v, double exponent) {
  const double a = 1.0 - exponent;
  const double top = std::pow(static_cast<double>(v) + 1.0, a);
  const double k = std::pow(u * (top - 1.0) + 1.0, 1.0 / a);
  return std::clamp<int64_t>(static_cast<int64_t>(k), 1, v);
}

// Writes a file to a temporary name, fsyncs it and renames it into place.
class AtomicFile {
 public:
  static absl::StatusOr<std::unique_ptr<AtomicFile>> Create(const std::string& path) {
    auto f = std::unique_ptr<AtomicFile>(new AtomicFile(path));
    f->fd_ = open(f->tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (f->fd_ < 0) return f->Error("cannot create");
    return f;
  }
  ~AtomicFile() {
    if (fd_ >= 0) {
      close(fd_);
      unlink(tmp_.c_str());
    }
  }
  absl::Status Append(absl::string_view s) {
    buffer_.append(s.data(), s.size());
    return buffer_.size() >= (1 << 20) ? Flush() : absl::OkStatus();
  }
  absl::Status Commit() {
    TESSERA_RETURN_IF_ERROR(Flush());
    if (fsync(fd_) != 0) return Error("fsync failed");
    if (close(fd_) != 0) {
      fd_ = -1;
      return Error("close failed");
    }
    fd_ = -1;
    if (rename(tmp_.c_str(), path_.c_str()) != 0) return Error("rename failed");
    return absl::OkStatus();
  }

 private:
  explicit AtomicFile(const std::string& path) : path_(path), tmp_(path + ".tmp") {}
  absl::Status Flush() {
    size_t off = 0;
    while (off < buffer_.size()) {
      const ssize_t n = write(fd_, buffer_.data() + off, buffer_.size() - off);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return Error("write failed");
      off += static_cast<size_t>(n);
    }
    buffer_.clear();
    return absl::OkStatus();
  }
  absl::Status Error(const char* what) const {
    return absl::UnavailableError(absl::StrCat(path_, ": ", what, ": ", std::strerror(errno)));
  }
  std::string path_, tmp_;
  int fd_ = -1;
  std::string buffer_;
};

struct Generator {
  const CriteoDatagenOptions& o;
  std::mt19937_64 rng;
  std::uniform_real_distribution<double> unit{0.0, 1.0};
  std::normal_distribution<double> normal{0.0, 1.0};
  std::vector<int64_t> vocabularies;

  explicit Generator(const CriteoDatagenOptions& options)
      : o(options), rng(Mix(options.seed, 0xC1)) {
    for (int c = 0; c < kCategories; ++c) vocabularies.push_back(Vocabulary(c));
  }

  // Appends one row to *line and returns its planted probability and label.
  double Row(std::string* line, float* label) {
    double logit = kBias;
    int64_t ints[kIntegers];
    bool has_int[kIntegers];
    for (int i = 0; i < kIntegers; ++i) {
      ints[i] = 0;
      has_int[i] = unit(rng) >= kMissingInteger;
      if (!has_int[i]) continue;
      ints[i] = static_cast<int64_t>(std::floor(std::exp(1.5 + 1.2 * normal(rng)))) - 1;
      const double u = kIntegerStddev * NormalOf(Mix(o.seed, 0x100 + i));
      logit += u * (std::log1p(static_cast<double>(std::max<int64_t>(ints[i], 0))) - 1.5);
    }
    uint32_t hex[kCategories];
    bool present[kCategories];
    double sum[kFactors] = {0, 0, 0, 0};
    double squares = 0;
    for (int c = 0; c < kCategories; ++c) {
      present[c] = unit(rng) >= kMissingCategory;
      if (!present[c]) continue;
      const int64_t rank = ZipfRank(unit(rng), vocabularies[c], o.zipf_exponent);
      const uint64_t key = Mix(Mix(o.seed, 0x200 + c), static_cast<uint64_t>(rank));
      hex[c] = static_cast<uint32_t>(key >> 32);
      logit += kCategoryStddev * NormalOf(key);
      if (o.factorization_machine) {
        for (int f = 0; f < kFactors; ++f) {
          const double v = kFactorStddev * NormalOf(Mix(key, 0x300 + f));
          sum[f] += v;
          squares += v * v;
        }
      }
    }
    if (o.factorization_machine) {
      double norm = 0;
      for (double s : sum) norm += s * s;
      logit += 0.5 * (norm - squares);  // sum over pairs c < d of <v_c, v_d>
    }
    const double p = 1.0 / (1.0 + std::exp(-logit));
    *label = unit(rng) < p ? 1.0f : 0.0f;
    absl::StrAppend(line, *label > 0.5f ? "1" : "0");
    for (int i = 0; i < kIntegers; ++i) {
      line->push_back('\t');
      if (has_int[i]) absl::StrAppend(line, ints[i]);
    }
    for (int c = 0; c < kCategories; ++c) {
      line->push_back('\t');
      if (present[c]) absl::StrAppend(line, absl::Hex(hex[c], absl::kZeroPad8));
    }
    line->push_back('\n');
    return p;
  }
};

}  // namespace

absl::StatusOr<CriteoDatagenResult> GenerateCriteo(const CriteoDatagenOptions& options) {
  if (options.train_rows < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--rows: must be >= 1, got ", options.train_rows));
  }
  int64_t test_rows = options.test_rows;
  if (test_rows < 0) {
    test_rows = std::min(options.train_rows, std::max<int64_t>(1000, options.train_rows / 10));
  }
  if (test_rows < 1) {
    return absl::InvalidArgumentError(absl::StrCat("--test_rows: must be >= 1, got ", test_rows));
  }
  if (options.out_dir.empty()) return absl::InvalidArgumentError("--out: must be set");
  if (!(options.zipf_exponent > 0 && options.zipf_exponent <= 4) ||
      std::fabs(options.zipf_exponent - 1.0) < 1e-6) {
    return absl::InvalidArgumentError(
        absl::StrCat("--zipf: must be in (0, 4] and not 1, got ", options.zipf_exponent));
  }
  if (mkdir(options.out_dir.c_str(), 0755) != 0 && errno != EEXIST) {
    return absl::UnavailableError(
        absl::StrCat(options.out_dir, ": cannot create: ", std::strerror(errno)));
  }
  CriteoDatagenResult r;
  r.train_rows = options.train_rows;
  r.test_rows = test_rows;
  r.train_path = options.out_dir + "/train.tsv";
  r.test_path = options.out_dir + "/test.tsv";
  r.planted_path = options.out_dir + "/planted.json";
  Generator g(options);
  const int64_t total = options.train_rows + test_rows;
  int64_t written = 0;
  auto last = std::chrono::steady_clock::now();
  std::vector<float> test_probabilities, test_labels;
  std::vector<double> test_p;
  std::string line;
  for (int split = 0; split < 2; ++split) {
    const bool test = split == 1;
    TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<AtomicFile> file,
                             AtomicFile::Create(test ? r.test_path : r.train_path));
    const int64_t rows = test ? test_rows : options.train_rows;
    for (int64_t i = 0; i < rows; ++i) {
      line.clear();
      float label = 0;
      const double p = g.Row(&line, &label);
      TESSERA_RETURN_IF_ERROR(file->Append(line));
      if (test) {
        test_p.push_back(p);
        test_probabilities.push_back(static_cast<float>(p));
        test_labels.push_back(label);
      }
      ++written;
      if (options.progress && (written & 1023) == 0) {
        const auto now = std::chrono::steady_clock::now();
        if (now - last >= std::chrono::seconds(1)) {
          options.progress(written, total);
          last = now;
        }
      }
    }
    TESSERA_RETURN_IF_ERROR(file->Commit());
  }
  double positives = 0;
  for (float y : test_labels) positives += y;
  r.positive_rate = positives / static_cast<double>(test_rows);
  r.best_test_log_loss = LogLoss(test_p, test_labels);
  r.best_test_auc = RocAuc(test_probabilities, test_labels);
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<AtomicFile> planted, AtomicFile::Create(r.planted_path));
  TESSERA_RETURN_IF_ERROR(planted->Append(PlantedJson(r, options)));
  TESSERA_RETURN_IF_ERROR(planted->Commit());
  if (options.progress) options.progress(total, total);
  return r;
}

std::string PlantedJson(const CriteoDatagenResult& r, const CriteoDatagenOptions& options) {
  std::string vocabularies;
  for (int c = 0; c < kCategories; ++c) {
    absl::StrAppend(&vocabularies, c > 0 ? "," : "", Vocabulary(c));
  }
  const auto num = [](double v) { return std::isfinite(v) ? absl::StrFormat("%.6f", v) : "null"; };
  return absl::StrCat(
      "{\"format\":\"criteo\",\"model\":\"",
      options.factorization_machine ? "factorization_machine" : "logistic",
      "\",\"seed\":", options.seed, ",\"zipf_exponent\":", num(options.zipf_exponent),
      ",\"train_rows\":", r.train_rows, ",\"test_rows\":", r.test_rows,
      ",\"test_positive_rate\":", num(r.positive_rate),
      ",\"best_test_log_loss\":", num(r.best_test_log_loss),
      ",\"best_test_auc\":", num(r.best_test_auc), ",\"vocabularies\":[", vocabularies, "]}\n");
}

}  // namespace tessera::cli
