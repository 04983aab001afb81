// What a daemon prints when it crashes.
#ifndef TESSERA_COMMON_CRASH_REPORTER_H_
#define TESSERA_COMMON_CRASH_REPORTER_H_

namespace tessera {

// Makes a crash (SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT) write one report to stderr (the
// daemon's log or journal) and then die of the same signal, as it would have without it:
//
//   *** SIGSEGV (fault address 0x0) in thread 4711 of tessera-coordinator (pid 4700) ***
//     #0 0x55d0c2a1b2c3 tessera::coordinator::LoseRank()
//     ...
//
// The stack starts at the interrupted instruction and comes from the unwind tables (glibc's
// backtrace(), so it needs no frame pointers) and is symbolised from the binary's symbol table. The
// main thread's handler runs on a stack of its own, so an overflow of the main thread's stack is
// reported too (other threads' are not). SIGTERM, SIGINT and SIGHUP keep the daemons' own handling
// (WaitForShutdownSignal). Call first thing in main(), with main's argv[0]; later calls do nothing.
void InstallCrashReporter(const char* argv0);

}  // namespace tessera

#endif  // TESSERA_COMMON_CRASH_REPORTER_H_
