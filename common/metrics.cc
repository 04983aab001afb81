#include "common/metrics.h"

#include <dirent.h>
#include <dlfcn.h>
#include <pthread.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <fstream>
#include <map>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "google/protobuf/descriptor.h"
#include "prometheus/collectable.h"
#include "prometheus/counter.h"
#include "prometheus/exposer.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/metric_family.h"
#include "prometheus/text_serializer.h"

// Debian builds civetweb (the HTTP server inside prometheus-cpp's Exposer) with 100 KiB thread
// stacks (USE_STACK_SIZE=102400). glibc carves a thread's static TLS out of its stack, and the
// CUDA libraries the worker and the coordinator load (cuBLAS, cuDNN) hold more static TLS than
// that, so every civetweb pthread_create failed with EINVAL and the endpoint could not start
// ("null context when constructing CivetServer"). This definition, exported from every binary
// that links tessera_metrics (see common/CMakeLists.txt), raises requested stack sizes to at
// least 8 MiB of address space (what a default thread gets) before passing them on to glibc.
extern "C" int pthread_attr_setstacksize(pthread_attr_t* attr, size_t stacksize) {
  using Fn = int (*)(pthread_attr_t*, size_t);
  static const Fn real = reinterpret_cast<Fn>(dlsym(RTLD_NEXT, "pthread_attr_setstacksize"));
  constexpr size_t kFloor = size_t{8} << 20;
  if (real == nullptr) return EINVAL;
  return real(attr, std::max(stacksize, kFloor));
}

namespace tessera {
namespace {

// Label value for every method the server did not register (and beyond kMaxMethods).
constexpr char kOtherMethod[] = "other";
// Distinct method labels at most; a server registers far fewer.
constexpr size_t kMaxMethods = 256;

// Methods served by gRPC's own services, whose descriptors are not in the generated pool (the
// health service is built on upb).
constexpr const char* kLibraryMethods[] = {
    "/grpc.health.v1.Health/Check",
    "/grpc.health.v1.Health/Watch",
};

const char* CodeName(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK:
      return "OK";
    case grpc::StatusCode::CANCELLED:
      return "CANCELLED";
    case grpc::StatusCode::UNKNOWN:
      return "UNKNOWN";
    case grpc::StatusCode::INVALID_ARGUMENT:
      return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND:
      return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS:
      return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED:
      return "PERMISSION_DENIED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION:
      return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED:
      return "ABORTED";
    case grpc::StatusCode::OUT_OF_RANGE:
      return "OUT_OF_RANGE";
    case grpc::StatusCode::UNIMPLEMENTED:
      return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL:
      return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE:
      return "UNAVAILABLE";
    case grpc::StatusCode::DATA_LOSS:
      return "DATA_LOSS";
    case grpc::StatusCode::UNAUTHENTICATED:
      return "UNAUTHENTICATED";
    default:
      return "UNKNOWN";
  }
}

// True for "/package.Service/Method" when the generated descriptor pool (every service linked
// into this binary, ours and reflection) declares it, or for gRPC's health methods.
bool IsKnownMethod(const std::string& method) {
  for (const char* m : kLibraryMethods) {
    if (method == m) return true;
  }
  if (method.size() < 4 || method[0] != '/') return false;
  const size_t slash = method.find('/', 1);
  if (slash == std::string::npos || slash + 1 >= method.size()) return false;
  const google::protobuf::ServiceDescriptor* service =
      google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(
          method.substr(1, slash - 1));
  return service != nullptr && service->FindMethodByName(method.substr(slash + 1)) != nullptr;
}

// /proc/self, read at scrape time.
class ProcessCollector final : public prometheus::Collectable {
 public:
  ProcessCollector() : start_time_seconds_(ReadStartTimeSeconds()) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    std::vector<prometheus::MetricFamily> out;
    const Stat stat = ReadStat();
    auto gauge = [&out](const char* name, const char* help, double value) {
      prometheus::MetricFamily family;
      family.name = name;
      family.help = help;
      family.type = prometheus::MetricType::Gauge;
      prometheus::ClientMetric metric;
      metric.gauge.value = value;
      family.metric.push_back(std::move(metric));
      out.push_back(std::move(family));
    };
    gauge("process_resident_memory_bytes", "Resident memory size in bytes.", stat.rss_bytes);
    gauge("process_virtual_memory_bytes", "Virtual memory size in bytes.", stat.vsize_bytes);
    gauge("process_open_fds", "Number of open file descriptors.", CountOpenFds());
    gauge("process_threads", "Number of OS threads in the process.", stat.threads);
    gauge("process_start_time_seconds",
          "Start time of the process since the Unix epoch in seconds.", start_time_seconds_);
    prometheus::MetricFamily cpu;
    cpu.name = "process_cpu_seconds_total";
    cpu.help = "Total user and system CPU time spent in seconds.";
    cpu.type = prometheus::MetricType::Counter;
    prometheus::ClientMetric metric;
    metric.counter.value = stat.cpu_seconds;
    cpu.metric.push_back(std::move(metric));
    out.push_back(std::move(cpu));
    return out;
  }

 private:
  struct Stat {
    double rss_bytes = 0;
    double vsize_bytes = 0;
    double threads = 0;
    double cpu_seconds = 0;
    double start_ticks = 0;
  };

  // The fields of /proc/self/stat after the command name (which may hold spaces and parens).
  static std::vector<std::string> StatFields() {
    std::ifstream in("/proc/self/stat");
    std::string line;
    if (!std::getline(in, line)) return {};
    const size_t close = line.rfind(')');
    if (close == std::string::npos) return {};
    return absl::StrSplit(line.substr(close + 1), ' ', absl::SkipEmpty());
  }

  static Stat ReadStat() {
    Stat stat;
    const std::vector<std::string> f = StatFields();
    // f[0] is field 3 (state) of proc(5): utime 14, stime 15, num_threads 20, starttime 22,
    // vsize 23, rss 24 (pages).
    if (f.size() < 22) return stat;
    const double ticks = static_cast<double>(sysconf(_SC_CLK_TCK));
    const double page = static_cast<double>(sysconf(_SC_PAGESIZE));
    double utime = 0, stime = 0, threads = 0, start = 0, vsize = 0, rss = 0;
    if (absl::SimpleAtod(f[11], &utime) && absl::SimpleAtod(f[12], &stime) && ticks > 0) {
      stat.cpu_seconds = (utime + stime) / ticks;
    }
    if (absl::SimpleAtod(f[17], &threads)) stat.threads = threads;
    if (absl::SimpleAtod(f[19], &start)) stat.start_ticks = start;
    if (absl::SimpleAtod(f[20], &vsize)) stat.vsize_bytes = vsize;
    if (absl::SimpleAtod(f[21], &rss)) stat.rss_bytes = rss * page;
    return stat;
  }

  static double CountOpenFds() {
    DIR* dir = opendir("/proc/self/fd");
    if (dir == nullptr) return 0;
    double n = 0;
    while (const dirent* entry = readdir(dir)) {
      if (entry->d_name[0] != '.') ++n;
    }
    closedir(dir);
    return n - 1;  // the descriptor of `dir` itself
  }

  // The wall-clock time now minus the process's age: starttime (field 22 of /proc/self/stat) is
  // clock ticks after boot, and CLOCK_BOOTTIME is the time since boot (suspend included, as is
  // starttime). No /proc/stat (its btime), which the units' ProcSubset=pid hides.
  static double ReadStartTimeSeconds() {
    timespec realtime{};
    timespec boottime{};
    const double ticks = static_cast<double>(sysconf(_SC_CLK_TCK));
    if (clock_gettime(CLOCK_REALTIME, &realtime) != 0 ||
        clock_gettime(CLOCK_BOOTTIME, &boottime) != 0 || ticks <= 0) {
      return 0;
    }
    const Stat stat = ReadStat();
    const double realtime_now = static_cast<double>(realtime.tv_sec) + realtime.tv_nsec * 1e-9;
    const double boottime_now = static_cast<double>(boottime.tv_sec) + boottime.tv_nsec * 1e-9;
    return realtime_now - (boottime_now - stat.start_ticks / ticks);
  }

  const double start_time_seconds_;
};

// The per-method series of the tessera_rpc_* families, made once per method.
struct MethodSeries {
  prometheus::Counter* calls = nullptr;
  prometheus::Histogram* latency = nullptr;
  std::string label;
};

}  // namespace

class Metrics::Impl {
 public:
  Impl(std::string daemon)
      : daemon_(std::move(daemon)), registry_(std::make_shared<prometheus::Registry>()) {
    rpc_calls_ = &prometheus::BuildCounter()
                      .Name("tessera_rpc_calls_total")
                      .Help("RPCs started, by method.")
                      .Register(*registry_);
    rpc_errors_ = &prometheus::BuildCounter()
                       .Name("tessera_rpc_errors_total")
                       .Help("RPCs that ended with a status other than OK, by method and code.")
                       .Register(*registry_);
    rpc_latency_ = &prometheus::BuildHistogram()
                        .Name("tessera_rpc_latency_seconds")
                        .Help(
                            "Seconds from the start of a unary RPC to its status, by method "
                            "(streaming RPCs are not timed).")
                        .Register(*registry_);
    prometheus::BuildGauge()
        .Name("tessera_build_info")
        .Help("Constant 1, labelled with the daemon and the Tessera version.")
        .Register(*registry_)
        .Add({{"daemon", daemon_}, {"version", kVersion}})
        .Set(1);
    collectables_.push_back(registry_);
    collectables_.push_back(std::make_shared<ProcessCollector>());
  }

  ~Impl() {
    // The exposer's threads stop before the collectables go.
    exposer_.reset();
  }

  absl::Status Listen(const std::string& listen) {
    const size_t colon = listen.rfind(':');
    if (colon == std::string::npos || colon == 0 || colon + 1 == listen.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--metrics_listen: '", listen, "' is not host:port"));
    }
    std::string host = listen.substr(0, colon);
    const std::string port_text = listen.substr(colon + 1);
    int port = -1;
    if (!absl::SimpleAtoi(port_text, &port) || port < 0 || port > 65535 ||
        port_text.find_first_not_of("0123456789") != std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("--metrics_listen: '", listen, "': port must be a number in [0, 65535]"));
    }
    if (host == "localhost") host = "127.0.0.1";
    if (host.find(':') != std::string::npos && host.front() != '[') {
      return absl::InvalidArgumentError(absl::StrCat(
          "--metrics_listen: '", listen, "': write an IPv6 address in brackets, [::1]:9470"));
    }
    try {
      // Two threads: scrapes are rare and short.
      exposer_ = std::make_unique<prometheus::Exposer>(absl::StrCat(host, ":", port), 2);
    } catch (const std::exception& e) {
      return absl::UnavailableError(
          absl::StrCat("--metrics_listen: cannot listen on ", listen, ": ", e.what()));
    }
    const std::vector<int> ports = exposer_->GetListeningPorts();
    if (ports.empty() || ports.front() <= 0) {
      exposer_.reset();
      return absl::UnavailableError(absl::StrCat("--metrics_listen: no port bound for ", listen));
    }
    port_ = ports.front();
    absl::MutexLock lock(&mu_);
    for (const auto& c : collectables_) exposer_->RegisterCollectable(c);
    return absl::OkStatus();
  }

  void AddCollectable(std::shared_ptr<prometheus::Collectable> collectable) {
    absl::MutexLock lock(&mu_);
    collectables_.push_back(collectable);
    if (exposer_ != nullptr) exposer_->RegisterCollectable(collectable);
  }

  std::string Serialize() const {
    std::vector<std::shared_ptr<prometheus::Collectable>> collectables;
    {
      absl::MutexLock lock(&mu_);
      collectables = collectables_;
    }
    std::vector<prometheus::MetricFamily> families;
    for (const auto& c : collectables) {
      std::vector<prometheus::MetricFamily> more = c->Collect();
      std::move(more.begin(), more.end(), std::back_inserter(families));
    }
    return prometheus::TextSerializer().Serialize(families);
  }

  // The series of `method` (a label in the bounded set). Thread-safe.
  MethodSeries* SeriesFor(const char* method) {
    const std::string name = method == nullptr ? std::string() : std::string(method);
    {
      absl::ReaderMutexLock lock(&series_mu_);
      auto it = series_.find(name);
      if (it != series_.end()) return it->second;
    }
    absl::MutexLock lock(&series_mu_);
    auto it = series_.find(name);
    if (it != series_.end()) return it->second;
    std::string label = name;
    if (series_.size() >= kMaxMethods || !IsKnownMethod(name)) label = kOtherMethod;
    // Every unknown name maps to the one "other" series; remember only known names, so that
    // random method names cannot grow this map either.
    MethodSeries* series = nullptr;
    auto existing = by_label_.find(label);
    if (existing != by_label_.end()) {
      series = existing->second;
    } else {
      auto owned = std::make_unique<MethodSeries>();
      owned->label = label;
      owned->calls = &rpc_calls_->Add({{"method", label}});
      owned->latency = &rpc_latency_->Add({{"method", label}}, LatencyBuckets());
      series = owned.get();
      by_label_.emplace(label, series);
      owned_.push_back(std::move(owned));
    }
    if (label != kOtherMethod) series_.emplace(name, series);
    return series;
  }

  // Records the end of a call: its latency when `seconds` is not null (unary calls), its code
  // unless OK. Thread-safe.
  void RecordEnd(MethodSeries* series, grpc::StatusCode code, const double* seconds) {
    if (seconds != nullptr) series->latency->Observe(*seconds);
    if (code == grpc::StatusCode::OK) return;
    prometheus::Counter* errors = nullptr;
    const auto key = std::make_pair(series, static_cast<int>(code));
    {
      absl::ReaderMutexLock lock(&series_mu_);
      auto it = errors_.find(key);
      if (it != errors_.end()) errors = it->second;
    }
    if (errors == nullptr) {
      absl::MutexLock lock(&series_mu_);
      prometheus::Counter*& slot = errors_[key];
      if (slot == nullptr) {
        slot = &rpc_errors_->Add({{"method", series->label}, {"code", CodeName(code)}});
      }
      errors = slot;
    }
    errors->Increment();
  }

  static const prometheus::Histogram::BucketBoundaries& LatencyBuckets() {
    static const prometheus::Histogram::BucketBoundaries* const kBuckets =
        new prometheus::Histogram::BucketBoundaries{0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005,
                                                    0.01,   0.025,   0.05,   0.1,   0.25,   0.5,
                                                    1,      2.5,     5,      10,    30,     60};
    return *kBuckets;
  }

  prometheus::Registry& registry() { return *registry_; }
  int port() const { return port_; }

 private:
  // The project version of the top CMakeLists.txt (project(tessera VERSION ...)).
  static constexpr char kVersion[] = TESSERA_VERSION;

  const std::string daemon_;
  const std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>* rpc_calls_ = nullptr;
  prometheus::Family<prometheus::Counter>* rpc_errors_ = nullptr;
  prometheus::Family<prometheus::Histogram>* rpc_latency_ = nullptr;

  mutable absl::Mutex mu_;
  std::vector<std::shared_ptr<prometheus::Collectable>> collectables_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<prometheus::Exposer> exposer_;
  int port_ = 0;

  absl::Mutex series_mu_;
  absl::flat_hash_map<std::string, MethodSeries*> series_ ABSL_GUARDED_BY(series_mu_);
  std::map<std::string, MethodSeries*> by_label_ ABSL_GUARDED_BY(series_mu_);
  std::vector<std::unique_ptr<MethodSeries>> owned_ ABSL_GUARDED_BY(series_mu_);
  std::map<std::pair<MethodSeries*, int>, prometheus::Counter*> errors_ ABSL_GUARDED_BY(series_mu_);
};

namespace {

// One per call: counts it when made, and records its status code (and, for a unary call, its
// latency) when the status is sent (or, for a call that ends without one, CANCELLED when it is
// destroyed).
class RpcInterceptor final : public grpc::experimental::Interceptor {
 public:
  // `unary`: record the latency too (for a stream it would measure the stream's lifetime).
  RpcInterceptor(Metrics::Impl* impl, MethodSeries* series, bool unary)
      : impl_(impl), series_(series), unary_(unary), start_(std::chrono::steady_clock::now()) {
    series_->calls->Increment();
  }

  ~RpcInterceptor() override {
    if (!recorded_.exchange(true)) Record(grpc::StatusCode::CANCELLED);
  }

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS) &&
        !recorded_.exchange(true)) {
      Record(methods->GetSendStatus().error_code());
    }
    methods->Proceed();
  }

 private:
  void Record(grpc::StatusCode code) {
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    impl_->RecordEnd(series_, code, unary_ ? &seconds : nullptr);
  }

  Metrics::Impl* const impl_;
  MethodSeries* const series_;
  const bool unary_;
  const std::chrono::steady_clock::time_point start_;
  std::atomic<bool> recorded_{false};
};

class RpcInterceptorFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit RpcInterceptorFactory(Metrics::Impl* impl) : impl_(impl) {}

  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    return new RpcInterceptor(impl_, impl_->SeriesFor(info->method()),
                              info->type() == grpc::experimental::ServerRpcInfo::Type::UNARY);
  }

 private:
  Metrics::Impl* const impl_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Metrics>> Metrics::Create(const std::string& daemon,
                                                         const std::string& listen) {
  if (daemon.empty()) return absl::InvalidArgumentError("daemon: must not be empty");
  auto impl = std::make_unique<Impl>(daemon);
  if (!listen.empty()) {
    absl::Status status = impl->Listen(listen);
    if (!status.ok()) return status;
  }
  return std::unique_ptr<Metrics>(new Metrics(std::move(impl)));
}

Metrics::Metrics(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Metrics::~Metrics() = default;

prometheus::Registry& Metrics::registry() { return impl_->registry(); }
int Metrics::port() const { return impl_->port(); }

void Metrics::AddCollectable(std::shared_ptr<prometheus::Collectable> collectable) {
  impl_->AddCollectable(std::move(collectable));
}

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
Metrics::NewServerInterceptorFactory() {
  return std::make_unique<RpcInterceptorFactory>(impl_.get());
}

std::string Metrics::Serialize() const { return impl_->Serialize(); }

prometheus::MetricFamily MetricFamilyOf(const std::string& name, const std::string& help,
                                        prometheus::MetricType type) {
  prometheus::MetricFamily family;
  family.name = name;
  family.help = help;
  family.type = type;
  return family;
}

void AddSample(prometheus::MetricFamily* family, double value,
               std::vector<prometheus::ClientMetric::Label> labels) {
  prometheus::ClientMetric metric;
  metric.label = std::move(labels);
  if (family->type == prometheus::MetricType::Counter) {
    metric.counter.value = value;
  } else {
    metric.gauge.value = value;
  }
  family->metric.push_back(std::move(metric));
}

}  // namespace tessera
