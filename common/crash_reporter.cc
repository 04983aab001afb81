#include "common/crash_reporter.h"

#include <errno.h>  // program_invocation_short_name
#include <execinfo.h>
#include <signal.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstring>

#include "absl/debugging/symbolize.h"

namespace tessera {
namespace {

constexpr int kSignals[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT};
constexpr int kMaxFrames = 64;
// Big enough for the symboliser's own buffers on an overflowed stack.
constexpr size_t kAltStackBytes = 256 * 1024;

std::atomic<bool> installed{false};
// One report at a time: a second thread crashing meanwhile waits for the first to end the process.
std::atomic<bool> reporting{false};

// The instruction the signal interrupted: the first frame worth showing.
const void* InterruptedPc(const void* context) {
  if (context == nullptr) return nullptr;
  const auto* uc = static_cast<const ucontext_t*>(context);
#if defined(__x86_64__)
  return reinterpret_cast<const void*>(uc->uc_mcontext.gregs[REG_RIP]);
#elif defined(__aarch64__)
  return reinterpret_cast<const void*>(uc->uc_mcontext.pc);
#else
  (void)uc;
  return nullptr;
#endif
}

// Async-signal-safe output: no allocation, no locks, no stdio.
void Write(const char* text) {
  size_t left = std::strlen(text);
  while (left > 0) {
    const ssize_t n = ::write(STDERR_FILENO, text, left);
    if (n <= 0) return;
    text += n;
    left -= static_cast<size_t>(n);
  }
}

void WriteNumber(uint64_t value, int base) {
  char digits[24];
  int i = sizeof(digits);
  digits[--i] = '\0';
  do {
    digits[--i] = "0123456789abcdef"[value % base];
    value /= base;
  } while (value != 0 && i > 0);
  if (base == 16) Write("0x");
  Write(digits + i);
}

const char* SignalName(int sig) {
  switch (sig) {
    case SIGSEGV:
      return "SIGSEGV";
    case SIGBUS:
      return "SIGBUS";
    case SIGILL:
      return "SIGILL";
    case SIGFPE:
      return "SIGFPE";
    case SIGABRT:
      return "SIGABRT";
  }
  return "signal";
}

void Report(int sig, siginfo_t* info, void* context) {
  if (reporting.exchange(true)) {
    for (;;) pause();
  }
  Write("*** ");
  Write(SignalName(sig));
  if (sig != SIGABRT && info != nullptr) {
    Write(" (fault address ");
    WriteNumber(reinterpret_cast<uintptr_t>(info->si_addr), 16);
    Write(")");
  }
  Write(" in thread ");
  WriteNumber(static_cast<uint64_t>(syscall(SYS_gettid)), 10);
  Write(" of ");
  Write(program_invocation_short_name);
  Write(" (pid ");
  WriteNumber(static_cast<uint64_t>(getpid()), 10);
  Write(") ***\n");
  void* frames[kMaxFrames];
  const int n = backtrace(frames, kMaxFrames);
  // The unwinder's first frames are this handler and the kernel's signal trampoline; the stack
  // proper starts at the interrupted instruction when it is found among them.
  const void* interrupted = InterruptedPc(context);
  int first = 0;
  for (int i = 0; i < n; ++i) {
    if (frames[i] == interrupted) {
      first = i;
      break;
    }
  }
  char symbol[1024];
  for (int i = first; i < n; ++i) {
    Write("  #");
    WriteNumber(static_cast<uint64_t>(i - first), 10);
    Write(" ");
    WriteNumber(reinterpret_cast<uintptr_t>(frames[i]), 16);
    Write(" ");
    // A return address is one past its call: look up the call's own instruction. The interrupted
    // instruction is itself.
    const char* pc = static_cast<const char*>(frames[i]) - (frames[i] == interrupted ? 0 : 1);
    Write(absl::Symbolize(pc, symbol, sizeof(symbol)) ? symbol : "(unknown)");
    Write("\n");
  }
  // The handler was reset to the default on entry (SA_RESETHAND): this ends the process with the
  // signal once the handler returns (a fault re-executes and faults again).
  raise(sig);
}

}  // namespace

void InstallCrashReporter(const char* argv0) {
  if (installed.exchange(true)) return;
  absl::InitializeSymbolizer(argv0);
  // backtrace() loads libgcc's unwinder on first use, which allocates: never in the handler.
  void* warm[1];
  backtrace(warm, 1);
  stack_t alt{};
  alt.ss_sp = new char[kAltStackBytes];
  alt.ss_size = kAltStackBytes;
  sigaltstack(&alt, nullptr);
  struct sigaction action {};
  action.sa_sigaction = Report;
  action.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESETHAND;
  sigemptyset(&action.sa_mask);
  for (const int sig : kSignals) sigaction(sig, &action, nullptr);
}

}  // namespace tessera
