#include "common/failpoint.h"

#include <stdlib.h>

#include <atomic>

#include "gtest/gtest.h"

namespace tessera::failpoint {
namespace {

// TESSERA_FAILPOINTS is read at the first hit, so it is set here before any.
TEST(FailpointTest, HangsOnlyAtItsValueUntilCancelledAndIgnoresWhatDoesNotParse) {
  ASSERT_EQ(::setenv("TESSERA_FAILPOINTS", "x.step=hang@3, bad ,y.step=hang@zz,z.fill=at@2", 1), 0);
  int polls = 0;
  const auto never = [&] {
    ++polls;
    return false;
  };
  MaybeHang("x.step", 2, never);
  MaybeHang("x.step", 4, never);
  MaybeHang("y.step", 3, never);
  MaybeHang("other", 3, never);
  EXPECT_EQ(polls, 0);
  // At its value it blocks until cancelled: here after the third poll.
  int left = 3;
  MaybeHang("x.step", 3, [&] { return --left < 0; });
  EXPECT_EQ(left, -1);
  // An at@ failpoint is hit at its value only, and never hangs.
  EXPECT_FALSE(Hit("z.fill", 1));
  EXPECT_TRUE(Hit("z.fill", 2));
  EXPECT_FALSE(Hit("x.step", 3));  // a hang is not a hit
  MaybeHang("z.fill", 2, never);   // nor a hit a hang
  EXPECT_EQ(polls, 0);
}

}  // namespace
}  // namespace tessera::failpoint
