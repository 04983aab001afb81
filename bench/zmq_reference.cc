#include "bench/zmq_reference.h"

#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zmq.h>

#include <cerrno>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace tessera::bench {
namespace {

std::string ZmqError(const char* what) {
  return absl::StrCat("zmq: ", what, ": ", zmq_strerror(zmq_errno()));
}

// A server's whole life, in the forked child: bind, report the endpoint on `report_fd`, then
// answer every [identity][gradient slice] with [identity][weights after w -= lr * g].
[[noreturn]] void ServeSlice(int64_t floats, float learning_rate, int report_fd) {
  void* context = zmq_ctx_new();
  void* router = zmq_socket(context, ZMQ_ROUTER);
  const int zero = 0;
  zmq_setsockopt(router, ZMQ_LINGER, &zero, sizeof(zero));
  char endpoint[256] = {};
  size_t length = sizeof(endpoint) - 1;
  if (router == nullptr || zmq_bind(router, "tcp://127.0.0.1:*") != 0 ||
      zmq_getsockopt(router, ZMQ_LAST_ENDPOINT, endpoint, &length) != 0) {
    _exit(1);
  }
  const size_t n = std::strlen(endpoint);
  if (write(report_fd, endpoint, n) != static_cast<ssize_t>(n)) _exit(1);
  close(report_fd);
  const size_t slice_bytes = static_cast<size_t>(floats) * sizeof(float);
  std::vector<float> weights(static_cast<size_t>(floats), 0.0f);
  for (;;) {
    zmq_msg_t identity, gradient, answer;
    zmq_msg_init(&identity);
    zmq_msg_init(&gradient);
    if (zmq_msg_recv(&identity, router, 0) < 0 || !zmq_msg_more(&identity) ||
        zmq_msg_recv(&gradient, router, 0) < 0) {
      if (zmq_errno() == EINTR) continue;
      _exit(2);
    }
    if (zmq_msg_size(&gradient) != slice_bytes) _exit(3);  // only our own clients connect
    const float* g = static_cast<const float*>(zmq_msg_data(&gradient));
    for (size_t i = 0; i < weights.size(); ++i) weights[i] -= learning_rate * g[i];
    zmq_msg_close(&gradient);
    zmq_msg_init_size(&answer, slice_bytes);
    std::memcpy(zmq_msg_data(&answer), weights.data(), slice_bytes);
    if (zmq_msg_send(&identity, router, ZMQ_SNDMORE) < 0 || zmq_msg_send(&answer, router, 0) < 0) {
      _exit(4);
    }
  }
}

// Reads the child's endpoint from `fd` within 10 s.
absl::StatusOr<std::string> ReadEndpoint(int fd) {
  std::string endpoint;
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  char buf[256];
  for (;;) {
    pollfd p{fd, POLLIN, 0};
    const int left = static_cast<int>(absl::ToInt64Milliseconds(deadline - absl::Now()));
    if (left <= 0 || poll(&p, 1, left) <= 0) {
      return absl::DeadlineExceededError("zmq: a server did not report its endpoint within 10 s");
    }
    const ssize_t r = read(fd, buf, sizeof(buf));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    endpoint.append(buf, static_cast<size_t>(r));
  }
  if (endpoint.empty()) return absl::InternalError("zmq: a server exited before binding");
  return endpoint;
}

// One client: a DEALER socket per server, its gradient and its weights.
struct Client {
  std::vector<void*> sockets;
  std::vector<float> grads, weights;
};

absl::Status Iterate(Client& c, const std::vector<int64_t>& offsets,
                     const std::vector<int64_t>& floats) {
  for (size_t s = 0; s < c.sockets.size(); ++s) {
    zmq_msg_t m;
    // Zero-copy: the buffer outlives the send (the answer comes only after the server has it all).
    zmq_msg_init_data(&m, c.grads.data() + offsets[s], static_cast<size_t>(floats[s]) * 4, nullptr,
                      nullptr);
    if (zmq_msg_send(&m, c.sockets[s], 0) < 0) return absl::InternalError(ZmqError("send"));
  }
  for (size_t s = 0; s < c.sockets.size(); ++s) {
    zmq_msg_t m;
    zmq_msg_init(&m);
    if (zmq_msg_recv(&m, c.sockets[s], 0) < 0) return absl::InternalError(ZmqError("recv"));
    const size_t size = zmq_msg_size(&m);
    if (size != static_cast<size_t>(floats[s]) * 4) {
      zmq_msg_close(&m);
      return absl::InternalError(absl::StrCat("zmq: server ", s, " answered ", size, " bytes"));
    }
    std::memcpy(c.weights.data() + offsets[s], zmq_msg_data(&m), size);
    zmq_msg_close(&m);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<ZmqReference>> ZmqReference::Start(int servers, int64_t bytes,
                                                                  float learning_rate) {
  if (servers < 1 || bytes % 4 != 0 || bytes / 4 < servers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "zmq: need servers >= 1 and a multiple of 4 bytes, at least 4 per server; got ", servers,
        " servers, ", bytes, " bytes"));
  }
  auto ref = std::unique_ptr<ZmqReference>(new ZmqReference());
  ref->bytes_ = bytes;
  const int64_t n = bytes / 4;
  for (int s = 0; s < servers; ++s) {
    ref->slice_floats_.push_back(n / servers + (s < n % servers ? 1 : 0));
  }
  for (int s = 0; s < servers; ++s) {
    int fds[2];
    if (pipe(fds) != 0) return absl::InternalError(absl::StrCat("pipe: ", std::strerror(errno)));
    const pid_t pid = fork();
    if (pid < 0) return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGTERM);  // never outlive the benchmark
      close(fds[0]);
      ServeSlice(ref->slice_floats_[s], learning_rate, fds[1]);
    }
    close(fds[1]);
    ref->pids_.push_back(pid);
    absl::StatusOr<std::string> endpoint = ReadEndpoint(fds[0]);
    close(fds[0]);
    if (!endpoint.ok()) return endpoint.status();  // the destructor reaps what was started
    ref->endpoints_.push_back(*endpoint);
  }
  ref->context_ = zmq_ctx_new();
  if (ref->context_ == nullptr) return absl::InternalError(ZmqError("zmq_ctx_new"));
  return ref;
}

ZmqReference::~ZmqReference() {
  if (context_ != nullptr) zmq_ctx_term(context_);
  for (pid_t pid : pids_) kill(pid, SIGTERM);
  for (pid_t pid : pids_) waitpid(pid, nullptr, 0);
}

absl::StatusOr<double> ZmqReference::Run(int clients, int64_t iterations) {
  if (clients < 1 || iterations < 0) return absl::InvalidArgumentError("zmq: clients >= 1");
  std::vector<int64_t> offsets;
  int64_t at = 0;
  for (int64_t f : slice_floats_) {
    offsets.push_back(at);
    at += f;
  }
  std::vector<Client> all(static_cast<size_t>(clients));
  absl::Status status;
  for (Client& c : all) {
    c.grads.assign(static_cast<size_t>(at), 1e-3f);
    c.weights.assign(static_cast<size_t>(at), 0.0f);
    for (const std::string& endpoint : endpoints_) {
      void* socket = zmq_socket(context_, ZMQ_DEALER);
      const int zero = 0;
      if (socket == nullptr) return absl::InternalError(ZmqError("zmq_socket"));
      zmq_setsockopt(socket, ZMQ_LINGER, &zero, sizeof(zero));
      c.sockets.push_back(socket);
      if (zmq_connect(socket, endpoint.c_str()) != 0) {
        status = absl::InternalError(ZmqError("connect"));
      }
    }
    if (status.ok()) status = Iterate(c, offsets, slice_floats_);  // warm-up, untimed
  }
  double seconds = 0;
  if (status.ok()) {
    std::vector<absl::Status> errors(all.size());
    std::vector<std::thread> threads;
    const absl::Time start = absl::Now();
    for (int c = 0; c < clients; ++c) {
      const int64_t mine = iterations / clients + (c < iterations % clients ? 1 : 0);
      threads.emplace_back([&, c, mine] {
        for (int64_t i = 0; i < mine && errors[c].ok(); ++i) {
          errors[c] = Iterate(all[c], offsets, slice_floats_);
        }
      });
    }
    for (std::thread& t : threads) t.join();
    seconds = absl::ToDoubleSeconds(absl::Now() - start);
    for (const absl::Status& e : errors) {
      if (status.ok() && !e.ok()) status = e;
    }
  }
  for (Client& c : all) {
    for (void* socket : c.sockets) zmq_close(socket);
  }
  if (!status.ok()) return status;
  last_weights_ = std::move(all[0].weights);
  return seconds;
}

}  // namespace tessera::bench
