#include "memtune/parallel/tcp_bootstrap.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

#include "memtune/core/error.h"

namespace memtune {
namespace {

using Clock = std::chrono::steady_clock;
constexpr uint32_t kMagic = 0x3142544du;  // "MTB1" read as little-endian bytes
constexpr uint32_t kVersion = 1;
constexpr uint32_t kMaxBlobBytes = 1u << 20;

class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  Socket(Socket&& other) noexcept : fd_(other.fd_) { other.fd_ = -1; }
  Socket& operator=(Socket&& other) noexcept {
    std::swap(fd_, other.fd_);
    return *this;
  }
  ~Socket() {
    if (fd_ >= 0) ::close(fd_);
  }
  int fd() const { return fd_; }
  bool valid() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

std::string errno_text(int error) { return std::strerror(error); }

int remaining_ms(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left <= 0 ? 0 : static_cast<int>(std::min<int64_t>(left, 1 << 30));
}

void set_nonblocking(int fd) { ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL, 0) | O_NONBLOCK); }

// What a failed exchange with one peer means, for the message: "rank 3" or "rank 0".
struct Peer {
  std::string who;   // "rank 0 at host:port", "a peer"
  std::string hint;  // what to check
};

// Waits for `events` on fd until the deadline: false on timeout.
bool wait_for(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int n = ::poll(&p, 1, remaining_ms(deadline));
    if (n > 0) return true;
    if (n == 0) return false;
    if (errno != EINTR) return false;
  }
}

void send_all(int fd, const void* data, size_t bytes, Clock::time_point deadline, const Peer& peer) {
  const char* at = static_cast<const char*>(data);
  while (bytes > 0) {
    MT_USER_CHECK(wait_for(fd, POLLOUT, deadline), "bootstrap: sending to {} timed out{}", peer.who, peer.hint);
    const ssize_t n = ::send(fd, at, bytes, MSG_NOSIGNAL);
    if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    MT_USER_CHECK(n > 0, "bootstrap: {} went away while memtune was sending to it ({}){}", peer.who,
                  errno_text(errno), peer.hint);
    at += n;
    bytes -= static_cast<size_t>(n);
  }
}

void recv_all(int fd, void* data, size_t bytes, Clock::time_point deadline, const Peer& peer) {
  char* at = static_cast<char*>(data);
  while (bytes > 0) {
    MT_USER_CHECK(wait_for(fd, POLLIN, deadline), "bootstrap: waiting for {} timed out{}", peer.who, peer.hint);
    const ssize_t n = ::recv(fd, at, bytes, 0);
    if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    MT_USER_CHECK(n != 0, "bootstrap: {} closed its connection (did that process exit?){}", peer.who, peer.hint);
    MT_USER_CHECK(n > 0, "bootstrap: receiving from {} failed ({}){}", peer.who, errno_text(errno), peer.hint);
    at += n;
    bytes -= static_cast<size_t>(n);
  }
}

void put_u32(std::vector<uint8_t>& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}
uint32_t get_u32(const uint8_t* in) {
  return static_cast<uint32_t>(in[0]) | static_cast<uint32_t>(in[1]) << 8 | static_cast<uint32_t>(in[2]) << 16 |
         static_cast<uint32_t>(in[3]) << 24;
}
uint32_t recv_u32(int fd, Clock::time_point deadline, const Peer& peer) {
  uint8_t bytes[4];
  recv_all(fd, bytes, 4, deadline, peer);
  return get_u32(bytes);
}

addrinfo* resolve(const std::string& address, int port, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  addrinfo* result = nullptr;
  const std::string service = std::to_string(port);
  const int rc = ::getaddrinfo(address.empty() ? nullptr : address.c_str(), service.c_str(), &hints, &result);
  MT_USER_CHECK(rc == 0 && result != nullptr, "bootstrap: cannot resolve MASTER_ADDR {}: {}", address,
                ::gai_strerror(rc));
  return result;
}

Socket listen_on(const BootstrapOptions& o) {
  addrinfo* list = resolve(o.address, o.port, /*passive=*/true);
  std::string last_error = "no address";
  for (addrinfo* ai = list; ai != nullptr; ai = ai->ai_next) {
    Socket s(::socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol));
    if (!s.valid()) continue;
    const int one = 1;
    // A previous run's socket in TIME_WAIT must not block the port of the next.
    ::setsockopt(s.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(s.fd(), ai->ai_addr, ai->ai_addrlen) != 0 || ::listen(s.fd(), o.world_size) != 0) {
      last_error = errno_text(errno);
      continue;
    }
    set_nonblocking(s.fd());
    ::freeaddrinfo(list);
    return s;
  }
  ::freeaddrinfo(list);
  mt_fail("bootstrap: rank 0 cannot listen on {}:{}: {} (is MASTER_ADDR this host, and is MASTER_PORT free? "
          "another run may hold it)",
          o.address.empty() ? "*" : o.address, o.port, last_error);
}

// One connection attempt to rank 0; an invalid socket when nothing listens there yet.
Socket try_connect(const BootstrapOptions& o, Clock::time_point deadline, std::string* last_error) {
  addrinfo* list = resolve(o.address, o.port, /*passive=*/false);
  for (addrinfo* ai = list; ai != nullptr; ai = ai->ai_next) {
    Socket s(::socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol));
    if (!s.valid()) continue;
    set_nonblocking(s.fd());
    int rc = ::connect(s.fd(), ai->ai_addr, ai->ai_addrlen);
    if (rc != 0 && errno == EINPROGRESS) {
      const auto attempt_deadline = std::min(deadline, Clock::now() + std::chrono::seconds(5));
      if (wait_for(s.fd(), POLLOUT, attempt_deadline)) {
        int error = 0;
        socklen_t len = sizeof error;
        ::getsockopt(s.fd(), SOL_SOCKET, SO_ERROR, &error, &len);
        rc = error == 0 ? 0 : -1;
        errno = error;
      } else {
        errno = ETIMEDOUT;
      }
    }
    if (rc == 0) {
      ::freeaddrinfo(list);
      const int one = 1;
      ::setsockopt(s.fd(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      return s;
    }
    *last_error = errno_text(errno);
  }
  ::freeaddrinfo(list);
  return Socket();
}

std::vector<uint8_t> run_rank0(const BootstrapOptions& o, const std::vector<uint8_t>& blob, Clock::time_point deadline) {
  MT_USER_CHECK(blob.size() <= kMaxBlobBytes, "bootstrap: a blob of {} bytes is larger than {}", blob.size(),
                kMaxBlobBytes);
  Socket listener = listen_on(o);
  std::vector<Socket> peers(static_cast<size_t>(o.world_size));
  const std::string hint = fmt::format(
      " (all ranks must use the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE={}; a rank that exited early "
      "has its own error above)",
      o.world_size);
  int connected = 1;
  while (connected < o.world_size) {
    if (!wait_for(listener.fd(), POLLIN, deadline)) {
      std::string missing;
      for (int r = 1; r < o.world_size; ++r)
        if (!peers[static_cast<size_t>(r)].valid()) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      mt_fail("bootstrap: rank 0 waited {} ms at {}:{} but only {} of {} ranks arrived (missing: {}){}",
              o.timeout.count(), o.address, o.port, connected, o.world_size, missing, hint);
    }
    Socket s(::accept(listener.fd(), nullptr, nullptr));
    if (!s.valid()) continue;
    set_nonblocking(s.fd());
    const Peer unknown{"a connecting rank", hint};
    const uint32_t magic = recv_u32(s.fd(), deadline, unknown);
    if (magic != kMagic) continue;  // not a memtune rank (a port scanner): ignore it
    const uint32_t version = recv_u32(s.fd(), deadline, unknown);
    const int rank = static_cast<int>(recv_u32(s.fd(), deadline, unknown));
    const int world = static_cast<int>(recv_u32(s.fd(), deadline, unknown));
    MT_USER_CHECK(version == kVersion, "bootstrap: rank {} speaks protocol version {}, rank 0 version {} (mixed "
                  "memtune binaries?)", rank, version, kVersion);
    MT_USER_CHECK(world == o.world_size, "bootstrap: rank {} was started with world size {}, rank 0 with {}", rank,
                  world, o.world_size);
    MT_USER_CHECK(rank >= 1 && rank < o.world_size, "bootstrap: a peer says it is rank {}, outside 1..{}", rank,
                  o.world_size - 1);
    MT_USER_CHECK(!peers[static_cast<size_t>(rank)].valid(),
                  "bootstrap: two processes say they are rank {} (check RANK / the launcher)", rank);
    peers[static_cast<size_t>(rank)] = std::move(s);
    ++connected;
  }
  std::vector<uint8_t> message;
  put_u32(message, kMagic);
  put_u32(message, static_cast<uint32_t>(blob.size()));
  message.insert(message.end(), blob.begin(), blob.end());
  for (int r = 1; r < o.world_size; ++r)
    send_all(peers[static_cast<size_t>(r)].fd(), message.data(), message.size(), deadline,
             {fmt::format("rank {}", r), hint});
  for (int r = 1; r < o.world_size; ++r) {
    const Peer peer{fmt::format("rank {}", r), hint};
    MT_USER_CHECK(recv_u32(peers[static_cast<size_t>(r)].fd(), deadline, peer) == kMagic,
                  "bootstrap: rank {} answered with bytes that are not memtune's", r);
  }
  return blob;
}

std::vector<uint8_t> run_peer(const BootstrapOptions& o, Clock::time_point deadline) {
  std::string last_error = "nothing listened";
  Socket s;
  while (!(s = try_connect(o, deadline, &last_error)).valid()) {
    MT_USER_CHECK(Clock::now() + o.retry_interval < deadline,
                  "bootstrap: rank {} could not reach rank 0 at {}:{} within {} ms (last error: {}); is rank 0 "
                  "running, and do all ranks use the same MASTER_ADDR and MASTER_PORT?",
                  o.rank, o.address, o.port, o.timeout.count(), last_error);
    std::this_thread::sleep_for(o.retry_interval);
  }
  const Peer rank0{fmt::format("rank 0 at {}:{}", o.address, o.port),
                   " (rank 0 waits for every rank before it answers: is a rank missing? rank 0's own error says)"};
  std::vector<uint8_t> hello;
  for (uint32_t v : {kMagic, kVersion, static_cast<uint32_t>(o.rank), static_cast<uint32_t>(o.world_size)})
    put_u32(hello, v);
  send_all(s.fd(), hello.data(), hello.size(), deadline, rank0);
  MT_USER_CHECK(recv_u32(s.fd(), deadline, rank0) == kMagic, "bootstrap: {} answered with bytes that are not "
                "memtune's (another service on MASTER_PORT?)", rank0.who);
  const uint32_t length = recv_u32(s.fd(), deadline, rank0);
  MT_USER_CHECK(length <= kMaxBlobBytes, "bootstrap: {} announced {} bytes, more than {}", rank0.who, length,
                kMaxBlobBytes);
  std::vector<uint8_t> blob(length);
  if (length > 0) recv_all(s.fd(), blob.data(), length, deadline, rank0);
  std::vector<uint8_t> ack;
  put_u32(ack, kMagic);
  send_all(s.fd(), ack.data(), ack.size(), deadline, rank0);
  return blob;
}

}  // namespace

std::vector<uint8_t> bootstrap_broadcast(const BootstrapOptions& options, const std::vector<uint8_t>& blob) {
  MT_USER_CHECK(options.world_size >= 1 && options.rank >= 0 && options.rank < options.world_size,
                "bootstrap: rank {} of world size {}", options.rank, options.world_size);
  if (options.world_size == 1) return blob;
  MT_USER_CHECK(options.port >= 1 && options.port <= 65535, "bootstrap: port {} is outside 1..65535", options.port);
  const Clock::time_point deadline = Clock::now() + options.timeout;
  return options.rank == 0 ? run_rank0(options, blob, deadline) : run_peer(options, deadline);
}

}  // namespace memtune
