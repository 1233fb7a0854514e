// The TCP bootstrap between threads on localhost: the blob reaches every rank, a missing rank 0
// is a timeout with a clear error, and a rank that dies mid-exchange is an error on the others.
#include "memtune/parallel/tcp_bootstrap.h"

#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <functional>
#include <thread>

#include "memtune/core/error.h"
#include "inprocess_communicator.h"

using namespace memtune;
using namespace std::chrono_literals;

namespace {

// A port that was free a moment ago (bound to 0, read back, closed).
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  socklen_t len = sizeof addr;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

BootstrapOptions options(int port, int rank, int world, std::chrono::milliseconds timeout = 10s) {
  BootstrapOptions o;
  o.address = "127.0.0.1";
  o.port = port;
  o.rank = rank;
  o.world_size = world;
  o.timeout = timeout;
  o.retry_interval = 20ms;
  return o;
}

std::string error_text(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const Error& error) {
    return error.what();
  } catch (...) {
    return "not a memtune::Error";
  }
}

// Runs body(0) ... body(count - 1), each on a thread of its own, and returns what each threw
// (null where it threw nothing).
std::vector<std::exception_ptr> errors_of_threads(int count, const std::function<void(int)>& body) {
  std::vector<std::exception_ptr> errors(static_cast<size_t>(count));
  std::vector<std::thread> threads;
  for (int i = 0; i < count; ++i)
    threads.emplace_back([&, i] {
      try {
        body(i);
      } catch (...) {
        errors[static_cast<size_t>(i)] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

}  // namespace

TEST(TcpBootstrap, EveryRankGetsRankZerosBlob) {
  const int port = free_port();
  const int world = 4;
  std::vector<uint8_t> blob(128);
  for (size_t i = 0; i < blob.size(); ++i) blob[i] = static_cast<uint8_t>(i * 7 + 1);
  std::vector<std::vector<uint8_t>> got(world);
  // The peers start first: they must retry until rank 0 listens.
  disttest::run_ranks(world, [&](int rank) {
    if (rank == 0) std::this_thread::sleep_for(200ms);
    got[static_cast<size_t>(rank)] = bootstrap_broadcast(options(port, rank, world), rank == 0 ? blob : std::vector<uint8_t>{});
  });
  for (const auto& g : got) EXPECT_EQ(g, blob);
}

TEST(TcpBootstrap, OneRankNeedsNoSocket) {
  EXPECT_EQ(bootstrap_broadcast(options(0, 0, 1), {1, 2, 3}), (std::vector<uint8_t>{1, 2, 3}));
}

TEST(TcpBootstrap, APeerTimesOutWhenRankZeroNeverAppears) {
  const auto start = std::chrono::steady_clock::now();
  try {
    bootstrap_broadcast(options(free_port(), 1, 2, 500ms));
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1 could not reach rank 0 at 127.0.0.1"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("MASTER_PORT"), std::string::npos);
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
}

TEST(TcpBootstrap, RankZeroTimesOutNamingTheMissingRanks) {
  const int port = free_port();
  // Ranks 0 and 1 of 3.
  const auto errors = errors_of_threads(2, [&](int rank) {
    bootstrap_broadcast(options(port, rank, 3, 800ms), rank == 0 ? std::vector<uint8_t>{9} : std::vector<uint8_t>{});
  });
  ASSERT_TRUE(errors[0]);
  EXPECT_NE(error_text(errors[0]).find("only 2 of 3 ranks arrived (missing: 2)"), std::string::npos)
      << error_text(errors[0]);
  ASSERT_TRUE(errors[1]);  // rank 1 waited for the blob in vain
  EXPECT_NE(error_text(errors[1]).find("rank 0"), std::string::npos) << error_text(errors[1]);
}

TEST(TcpBootstrap, APeerThatDiesIsAnErrorOnRankZero) {
  const int port = free_port();
  std::exception_ptr rank0_error;
  std::thread rank0([&] {
    try {
      bootstrap_broadcast(options(port, 0, 3, 5s), {1, 2, 3});
    } catch (...) {
      rank0_error = std::current_exception();
    }
  });
  // Rank 2 says hello by hand and exits before the blob comes; rank 1 is a real peer.
  std::thread rank2([&] {
    int fd = -1;
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    for (int attempt = 0; attempt < 200; ++attempt) {
      fd = ::socket(AF_INET, SOCK_STREAM, 0);
      if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) break;
      ::close(fd);
      fd = -1;
      std::this_thread::sleep_for(10ms);
    }
    ASSERT_GE(fd, 0);
    const uint32_t hello[4] = {0x3142544du, 1, 2, 3};  // magic, version, rank 2, world 3 (little-endian host)
    ASSERT_EQ(::send(fd, hello, sizeof hello, 0), static_cast<ssize_t>(sizeof hello));
    ::close(fd);
  });
  rank2.join();
  std::exception_ptr rank1_error;
  std::thread rank1([&] {
    try {
      bootstrap_broadcast(options(port, 1, 3, 5s));
    } catch (...) {
      rank1_error = std::current_exception();
    }
  });
  rank0.join();
  rank1.join();
  ASSERT_TRUE(rank0_error);
  const std::string message = error_text(rank0_error);
  EXPECT_TRUE(message.find("rank 2 closed its connection") != std::string::npos ||
              message.find("rank 2 went away") != std::string::npos)
      << message;
}

TEST(TcpBootstrap, TwoProcessesClaimingOneRankAreRefused) {
  const int port = free_port();
  const auto errors = errors_of_threads(3, [&](int i) {
    const int rank = i == 0 ? 0 : 1;  // threads 1 and 2 both say rank 1
    bootstrap_broadcast(options(port, rank, 3, 2s), rank == 0 ? std::vector<uint8_t>{5} : std::vector<uint8_t>{});
  });
  ASSERT_TRUE(errors[0]);
  EXPECT_NE(error_text(errors[0]).find("two processes say they are rank 1"), std::string::npos)
      << error_text(errors[0]);
}
