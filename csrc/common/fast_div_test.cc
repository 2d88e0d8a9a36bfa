// GoogleTest checks of common/fast_div.h: the multiply-and-shift quotient equals n / d for
// every divisor up to 2^12 against a spread of numerators (the edges of the 32-bit range,
// the multiples of d and their neighbours, random values), for powers of two and their
// neighbours up to 2^31 + 1 and for the largest divisors, and a divisor of 0 acts as 1.
#include "common/fast_div.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

namespace lowbit {
namespace {

void ExpectDividesExactly(uint32_t d, std::mt19937& gen) {
  const FastDivU32 div(d);
  std::vector<uint32_t> ns = {0u, 1u, 2u, d - 1, d, d + 1, 0x7FFFFFFFu, 0x80000000u, 0xFFFFFFFEu, 0xFFFFFFFFu};
  for (uint32_t q : {1u, 2u, 3u, 1000u, 0xFFFFFFFFu / d}) {
    const uint64_t m = uint64_t(q) * d;
    for (int64_t delta = -1; delta <= 1; ++delta) {
      const int64_t n = int64_t(m) + delta;
      if (n >= 0 && n <= 0xFFFFFFFFll) ns.push_back(uint32_t(n));
    }
  }
  std::uniform_int_distribution<uint32_t> any;
  for (int i = 0; i < 64; ++i) ns.push_back(any(gen));
  for (uint32_t n : ns) ASSERT_EQ(div.Div(n), n / d) << n << " / " << d;
}

TEST(FastDivU32, SmallDivisors) {
  std::mt19937 gen(1);
  for (uint32_t d = 1; d <= 4096; ++d) ExpectDividesExactly(d, gen);
}

TEST(FastDivU32, PowersOfTwoTheirNeighboursAndTheLargest) {
  std::mt19937 gen(2);
  for (int s = 1; s <= 31; ++s) {
    const uint32_t p = uint32_t(1) << s;
    for (uint32_t d : {p - 1, p, p + 1}) ExpectDividesExactly(d, gen);
  }
  for (uint32_t d : {0x7FFFFFFFu, 0x80000001u, 0xFFFFFFFEu, 0xFFFFFFFFu}) ExpectDividesExactly(d, gen);
  std::uniform_int_distribution<uint32_t> any(1);
  for (int i = 0; i < 2000; ++i) ExpectDividesExactly(any(gen), gen);
}

TEST(FastDivU32, ZeroDivisorActsAsOne) {
  const FastDivU32 div(0);
  EXPECT_EQ(div.d, 1u);
  EXPECT_EQ(div.Div(12345u), 12345u);
  EXPECT_EQ(div.Div(0xFFFFFFFFu), 0xFFFFFFFFu);
}

}  // namespace
}  // namespace lowbit
