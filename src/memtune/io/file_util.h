// Whole-file reads, read-only memory maps, and atomic writes.
//
// Atomic writes exist because a run must never destroy what is already on disk (DESIGN.md:
// "nothing already written is lost"): a checkpoint or adapter that fails half-way (disk full,
// a crash, an exception while producing the bytes) leaves the previous file exactly as it was.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>

namespace memtune {

// Where the bytes of a file being produced go. The atomic writer hands one to a callback so
// that multi-GB files can be written in pieces without holding them in memory.
class FileSink {
 public:
  virtual ~FileSink() = default;
  virtual void write(const void* data, size_t size) = 0;
  void write(std::string_view bytes) { write(bytes.data(), bytes.size()); }
  virtual uint64_t bytes_written() const = 0;
};

// Collects the bytes in memory: for tests, the fuzzer, and small files.
class StringSink final : public FileSink {
 public:
  using FileSink::write;
  void write(const void* data, size_t size) override;
  uint64_t bytes_written() const override { return bytes_.size(); }
  const std::string& bytes() const { return bytes_; }
  std::string take() { return std::move(bytes_); }

 private:
  std::string bytes_;
};

// Writes `<path>.tmp.<pid>` in the same directory, fsyncs it, renames it over `path`, then
// fsyncs the directory. On any failure (including an exception thrown by `write_contents`) the
// temporary file is removed, an existing `path` is left untouched, and memtune::Error (naming
// the path and the system's reason) is thrown; exceptions of other types are rethrown as they
// were. The parent directory must exist.
void write_file_atomic(const std::filesystem::path& path, std::string_view bytes);
void write_file_atomic_streaming(const std::filesystem::path& path,
                                 const std::function<void(FileSink&)>& write_contents);

// The temporary name write_file_atomic uses for `path` in this process.
std::filesystem::path atomic_temp_path(const std::filesystem::path& path);

// The whole file. memtune::Error when it is missing, a directory, or unreadable.
std::string read_file(const std::filesystem::path& path);

// A read-only, private memory map of a whole file. Move-only; unmaps on destruction. The
// mapping's address does not change when the object moves, so pointers into data() stay
// valid for as long as some MappedFile owns the mapping.
//
// If another process truncates the file while it is mapped, touching the lost pages raises
// SIGBUS; the kernel gives no way to turn that into an error, so checkpoints must not be
// rewritten in place while a run reads them (write_file_atomic never does that: it renames).
class MappedFile {
 public:
  MappedFile() = default;
  // memtune::Error when the file is missing, not a regular file, or cannot be mapped.
  static MappedFile open(const std::filesystem::path& path);

  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();

  // nullptr for an empty file (mmap cannot map zero bytes).
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::filesystem::path& path() const { return path_; }

  // Tells the kernel that [offset, offset + length) will not be read again soon, so its page
  // cache pages can leave this process's resident set. Loading converts a checkpoint layer by
  // layer; releasing each layer after converting it keeps host memory bounded. Reading the
  // range again later is still correct (the pages fault back in from the file).
  void release_pages(size_t offset, size_t length) const;

 private:
  void unmap() noexcept;

  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
  std::filesystem::path path_;
};

// strerror(errnum) as a std::string, thread-safe.
std::string system_error_text(int errnum);

// The machine's available memory (MemAvailable of /proc/meminfo), 0 when it cannot be read.
uint64_t host_memory_available();

}  // namespace memtune
