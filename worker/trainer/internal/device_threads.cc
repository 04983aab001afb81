#include "worker/trainer/internal/device_threads.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace tessera::trainer::internal {

absl::StatusOr<std::unique_ptr<DeviceThreads>> DeviceThreads::Start(
    int n, const std::string& what, const std::function<absl::Status(int)>& init) {
  if (n < 1) return absl::InternalError(absl::StrCat("DeviceThreads: ", n, " threads"));
  std::unique_ptr<DeviceThreads> t(new DeviceThreads());
  {
    absl::MutexLock lock(&t->mu_);
    t->running_ = n;
  }
  for (int i = 0; i < n; ++i) {
    t->threads_.emplace_back([raw = t.get(), i, what, init] { raw->Serve(i, what, init); });
  }
  absl::Status started;
  {
    absl::MutexLock lock(&t->mu_);
    t->mu_.Await(absl::Condition(
        +[](int* running) { return *running == 0; }, &t->running_));
    started = std::exchange(t->error_, absl::OkStatus());
  }
  if (!started.ok()) return started;  // the destructor stops the threads
  return t;
}

DeviceThreads::~DeviceThreads() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& t : threads_) {
    if (t.joinable()) t.join();
  }
}

void DeviceThreads::Serve(int i, const std::string& what,
                          const std::function<absl::Status(int)>& init) {
  const absl::Status status = init(i);
  uint64_t seen = 0;
  {
    absl::MutexLock lock(&mu_);
    if (!status.ok() && error_.ok()) {
      error_ = absl::Status(status.code(), absl::StrCat(what, " ", i, ": ", status.message()));
    }
    --running_;
    seen = generation_;
  }
  while (true) {
    const std::function<absl::Status(int)>* task = nullptr;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this, &seen]()
                       ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_ || generation_ != seen; };
      mu_.Await(absl::Condition(&ready));
      if (stopping_) return;
      seen = generation_;
      task = task_;
    }
    absl::Status s = (*task)(i);
    absl::MutexLock lock(&mu_);
    if (!s.ok() && error_.ok()) error_ = std::move(s);
    --running_;
  }
}

absl::Status DeviceThreads::RunOnAll(const std::function<absl::Status(int)>& task) {
  absl::MutexLock lock(&mu_);
  task_ = &task;
  running_ = size();
  error_ = absl::OkStatus();
  ++generation_;
  mu_.Await(absl::Condition(
      +[](int* running) { return *running == 0; }, &running_));
  task_ = nullptr;
  return std::exchange(error_, absl::OkStatus());
}

}  // namespace tessera::trainer::internal
