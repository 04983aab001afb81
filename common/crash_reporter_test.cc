// InstallCrashReporter: a crash names its signal and where it happened, and the process still dies
// of that signal; SIGTERM's handling is left to the daemon.
#include "common/crash_reporter.h"

#include <signal.h>
#include <unistd.h>

#include <cstdlib>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera {
namespace {

// Not inlined, so that the stack the reporter prints has a frame with this name.
[[gnu::noinline]] void CrashInsideTesseraFrame(volatile int* p) {
  *p = 1;
  asm volatile("");
}

TEST(CrashReporterDeathTest, ACrashPrintsTheSignalAndTheStackAndDiesOfTheSignal) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        InstallCrashReporter("/proc/self/exe");
        CrashInsideTesseraFrame(nullptr);
      },
      // The stack starts at the fault, not in the handler.
      testing::KilledBySignal(SIGSEGV),
      "SIGSEGV \\(fault address 0x0\\) in thread [0-9]+ of tessera_common_test \\(pid [0-9]+\\) "
      "\\*\\*\\*\n.*#0 0x[0-9a-f]+ tessera::\\(anonymous namespace\\)::CrashInsideTesseraFrame");
}

TEST(CrashReporterDeathTest, AnAbortIsReportedAndStillAborts) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        InstallCrashReporter("/proc/self/exe");
        std::abort();
      },
      testing::KilledBySignal(SIGABRT), "SIGABRT in thread [0-9]+ of tessera_common_test");
}

TEST(CrashReporterDeathTest, SigtermKeepsItsHandling) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        InstallCrashReporter("/proc/self/exe");
        struct sigaction term {};
        sigaction(SIGTERM, nullptr, &term);
        struct sigaction segv {};
        sigaction(SIGSEGV, nullptr, &segv);
        const bool term_default = term.sa_handler == SIG_DFL;
        const bool segv_caught = segv.sa_handler != SIG_DFL;
        _exit(term_default && segv_caught ? 7 : 1);
      },
      testing::ExitedWithCode(7), "");
}

}  // namespace
}  // namespace tessera
