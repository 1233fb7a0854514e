#include "memtune/io/file_util.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <system_error>
#include <utility>

#include "memtune/core/error.h"

namespace memtune {

std::string system_error_text(int errnum) { return std::generic_category().message(errnum); }

uint64_t host_memory_available() {
  std::ifstream meminfo("/proc/meminfo");
  for (std::string line; std::getline(meminfo, line);) {
    unsigned long long kib = 0;
    if (std::sscanf(line.c_str(), "MemAvailable: %llu kB", &kib) == 1) return static_cast<uint64_t>(kib) * 1024;
  }
  return 0;
}

void StringSink::write(const void* data, size_t size) {
  if (size > 0) bytes_.append(static_cast<const char*>(data), size);
}

std::filesystem::path atomic_temp_path(const std::filesystem::path& path) {
  std::filesystem::path temp = path;
  temp += ".tmp." + std::to_string(::getpid());
  return temp;
}

namespace {

// Removes the temporary file unless the rename went through, so that a failed write leaves
// nothing behind but the untouched original.
struct TempFileGuard {
  std::filesystem::path temp_path;
  int fd = -1;
  bool renamed = false;

  ~TempFileGuard() {
    if (fd >= 0) ::close(fd);
    if (!renamed) ::unlink(temp_path.c_str());
  }
};

// Small writes (the safetensors header, per-row producers) are coalesced so that the number of
// system calls does not depend on how finely the producer slices its output; large writes go
// straight through rather than being copied.
class DescriptorSink final : public FileSink {
 public:
  static constexpr size_t kBufferBytes = size_t{1} << 20;

  DescriptorSink(int fd, const std::filesystem::path& target) : fd_(fd), target_(target) {
    buffer_.reserve(kBufferBytes);
  }

  using FileSink::write;
  void write(const void* data, size_t size) override {
    if (size == 0) return;
    if (buffer_.size() + size > kBufferBytes) flush();
    if (size >= kBufferBytes) {
      write_all(static_cast<const char*>(data), size);
    } else {
      buffer_.append(static_cast<const char*>(data), size);
    }
    written_ += size;
  }
  uint64_t bytes_written() const override { return written_; }
  // True once a write to the file itself failed (as opposed to the producer failing).
  bool failed() const { return failed_; }

  void flush() {
    write_all(buffer_.data(), buffer_.size());
    buffer_.clear();
  }

 private:
  void write_all(const char* data, size_t size) {
    while (size > 0) {
      const ssize_t n = ::write(fd_, data, size);
      if (n < 0) {
        const int write_errno = errno;
        if (write_errno == EINTR) continue;
        failed_ = true;
        mt_fail("writing {} failed after {} bytes: {}; any existing {} is unchanged",
                target_.string(), written_, system_error_text(write_errno),
                target_.filename().string());
      }
      data += n;
      size -= static_cast<size_t>(n);
    }
  }

  int fd_;
  const std::filesystem::path& target_;
  std::string buffer_;
  uint64_t written_ = 0;
  bool failed_ = false;
};

// Makes the rename itself durable: without it a crash can bring back the old directory entry.
void sync_directory(const std::filesystem::path& target) {
  std::filesystem::path directory = target.parent_path();
  if (directory.empty()) directory = ".";
  const int fd = ::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) {
    const int open_errno = errno;
    mt_fail("wrote {}, but cannot open its directory to sync it: {}", target.string(),
            system_error_text(open_errno));
  }
  const int rc = ::fsync(fd);
  const int sync_errno = errno;
  ::close(fd);
  // Some filesystems cannot fsync a directory at all; the rename is as durable as they allow.
  if (rc != 0 && sync_errno != EINVAL && sync_errno != ENOTSUP) {
    mt_fail("wrote {}, but syncing its directory failed: {}; the new file may not survive a crash",
            target.string(), system_error_text(sync_errno));
  }
}

}  // namespace

void write_file_atomic_streaming(const std::filesystem::path& path,
                                 const std::function<void(FileSink&)>& write_contents) {
  TempFileGuard guard;
  guard.temp_path = atomic_temp_path(path);
  guard.fd = ::open(guard.temp_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
  if (guard.fd < 0) {
    const int open_errno = errno;
    guard.renamed = true;  // nothing was created, so there is nothing to remove
    mt_fail("cannot write {}: creating {} failed: {}", path.string(),
            guard.temp_path.filename().string(), system_error_text(open_errno));
  }

  DescriptorSink sink(guard.fd, path);
  try {
    write_contents(sink);
  } catch (const Error& error) {
    if (sink.failed()) throw;
    mt_fail("{} was not written: {}; any existing {} is unchanged", path.string(), error.what(),
            path.filename().string());
  }
  sink.flush();
  // Disk-full is often reported only here, when the filesystem allocates delayed blocks.
  if (::fsync(guard.fd) != 0) {
    const int sync_errno = errno;
    mt_fail("writing {} failed: fsync: {}; any existing {} is unchanged", path.string(),
            system_error_text(sync_errno), path.filename().string());
  }
  const int close_rc = ::close(guard.fd);
  const int close_errno = errno;
  guard.fd = -1;
  if (close_rc != 0) {
    mt_fail("writing {} failed: close: {}; any existing {} is unchanged", path.string(),
            system_error_text(close_errno), path.filename().string());
  }
  if (::rename(guard.temp_path.c_str(), path.c_str()) != 0) {
    const int rename_errno = errno;
    mt_fail("writing {} failed: renaming {} over it: {}", path.string(),
            guard.temp_path.filename().string(), system_error_text(rename_errno));
  }
  guard.renamed = true;
  sync_directory(path);
}

void write_file_atomic(const std::filesystem::path& path, std::string_view bytes) {
  write_file_atomic_streaming(path, [bytes](FileSink& sink) { sink.write(bytes); });
}

namespace {

// Opens a path that must be a regular file; the descriptor is returned with its size.
int open_regular_file(const std::filesystem::path& path, size_t* size) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int open_errno = errno;
    mt_fail("cannot open {}: {}", path.string(), system_error_text(open_errno));
  }
  struct stat info;
  if (::fstat(fd, &info) != 0) {
    const int stat_errno = errno;
    ::close(fd);
    mt_fail("cannot stat {}: {}", path.string(), system_error_text(stat_errno));
  }
  if (S_ISDIR(info.st_mode)) {
    ::close(fd);
    mt_fail("{} is a directory, not a file", path.string());
  }
  if (!S_ISREG(info.st_mode)) {
    ::close(fd);
    mt_fail("{} is not a regular file", path.string());
  }
  *size = static_cast<size_t>(info.st_size);
  return fd;
}

}  // namespace

std::string read_file(const std::filesystem::path& path) {
  size_t expected_size = 0;
  const int fd = open_regular_file(path, &expected_size);
  std::string bytes;
  // The size from fstat is a hint: the file may change while it is read, so read to EOF.
  bytes.resize(expected_size + 1);
  size_t filled = 0;
  for (;;) {
    if (filled == bytes.size()) bytes.resize(bytes.size() * 2);
    const ssize_t n = ::read(fd, bytes.data() + filled, bytes.size() - filled);
    if (n < 0) {
      const int read_errno = errno;
      if (read_errno == EINTR) continue;
      ::close(fd);
      mt_fail("cannot read {}: {}", path.string(), system_error_text(read_errno));
    }
    if (n == 0) break;
    filled += static_cast<size_t>(n);
  }
  ::close(fd);
  bytes.resize(filled);
  return bytes;
}

MappedFile MappedFile::open(const std::filesystem::path& path) {
  size_t size = 0;
  const int fd = open_regular_file(path, &size);
  MappedFile file;
  file.path_ = path;
  if (size > 0) {
    void* mapping = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (mapping == MAP_FAILED) {
      const int map_errno = errno;
      ::close(fd);
      mt_fail("cannot memory-map {} ({} bytes): {}", path.string(), size,
              system_error_text(map_errno));
    }
    file.data_ = static_cast<const uint8_t*>(mapping);
    file.size_ = size;
  }
  // The mapping keeps its own reference to the file.
  ::close(fd);
  return file;
}

MappedFile::MappedFile(MappedFile&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      path_(std::move(other.path_)) {}

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this != &other) {
    unmap();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    path_ = std::move(other.path_);
  }
  return *this;
}

MappedFile::~MappedFile() { unmap(); }

void MappedFile::unmap() noexcept {
  if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
  data_ = nullptr;
  size_ = 0;
}

void MappedFile::release_pages(size_t offset, size_t length) const {
  if (data_ == nullptr || offset >= size_ || length == 0) return;
  length = std::min(length, size_ - offset);
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  // Pages shared with a neighbouring range are dropped too: the mapping is private and
  // read-only, so a later read of the neighbour just faults the page back in from the file.
  const size_t begin = offset / page * page;
  const size_t end = offset + length;
  // Advice only: on failure the pages simply stay cached.
  ::madvise(const_cast<uint8_t*>(data_) + begin, end - begin, MADV_DONTNEED);
}

}  // namespace memtune
