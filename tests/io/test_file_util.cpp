#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "memtune/core/error.h"
#include "memtune/io/file_util.h"
#include "../support/expect_error.h"
#include "../support/temp_dir.h"

using namespace memtune;
using memtune::test::error_of;
namespace fs = std::filesystem;

namespace {

// A fresh directory per test, removed afterwards; tests run in parallel under ctest.
class FileUtilTest : public test::TempDirTest {
 protected:
  FileUtilTest() : TempDirTest("memtune_io") {}
};

}  // namespace

TEST_F(FileUtilTest, AtomicWriteCreatesThenReplacesAndLeavesNoTempFile) {
  const fs::path path = dir_ / "out.bin";
  write_file_atomic(path, std::string("first\0bytes", 11));
  EXPECT_EQ(read_file(path), std::string("first\0bytes", 11));
  write_file_atomic(path, "second");
  EXPECT_EQ(read_file(path), "second");
  EXPECT_FALSE(fs::exists(atomic_temp_path(path)));
  EXPECT_EQ(std::distance(fs::directory_iterator(dir_), fs::directory_iterator()), 1);
}

TEST_F(FileUtilTest, AtomicTempPathIsBesideTargetWithPid) {
  const fs::path temp = atomic_temp_path(dir_ / "a.safetensors");
  EXPECT_EQ(temp.parent_path(), dir_);
  EXPECT_EQ(temp.filename().string(), "a.safetensors.tmp." + std::to_string(::getpid()));
}

TEST_F(FileUtilTest, StreamingWriteCoalescesSmallAndPassesLargeChunks) {
  const fs::path path = dir_ / "stream.bin";
  std::string expected;
  write_file_atomic_streaming(path, [&](FileSink& sink) {
    for (int i = 0; i < 1000; ++i) {
      const std::string piece = std::to_string(i) + ",";
      sink.write(piece);
      expected += piece;
    }
    const std::string large(3 << 20, 'x');  // larger than the sink's buffer
    sink.write(large);
    expected += large;
    sink.write("tail");
    expected += "tail";
    EXPECT_EQ(sink.bytes_written(), expected.size());
  });
  EXPECT_EQ(read_file(path), expected);
}

TEST_F(FileUtilTest, ProducerThrowingMidwayKeepsOldFileAndRemovesTemp) {
  const fs::path path = dir_ / "adapter.safetensors";
  write_file_atomic(path, "old contents");
  const std::string message = error_of([&] {
    write_file_atomic_streaming(path, [](FileSink& sink) {
      sink.write(std::string(5 << 20, 'n'));  // well past the buffer: bytes reach the temp file
      mt_fail("producer gave up");
    });
  });
  EXPECT_CONTAINS(message, path.string());
  EXPECT_CONTAINS(message, "producer gave up");
  EXPECT_EQ(read_file(path), "old contents");
  EXPECT_FALSE(fs::exists(atomic_temp_path(path)));
}

TEST_F(FileUtilTest, ProducerThrowingOtherExceptionIsRethrownUnchanged) {
  const fs::path path = dir_ / "x.bin";
  write_file_atomic(path, "old");
  EXPECT_THROW(write_file_atomic_streaming(path,
                                           [](FileSink& sink) {
                                             sink.write("partial");
                                             throw std::out_of_range("boom");
                                           }),
               std::out_of_range);
  EXPECT_EQ(read_file(path), "old");
  EXPECT_FALSE(fs::exists(atomic_temp_path(path)));
}

// A real write(2) failure, as disk-full would give: a file size limit makes write() fail with
// EFBIG part-way. It runs in a child process so that the limit cannot touch anything else.
TEST_F(FileUtilTest, WriteFailureFromTheSystemKeepsOldFileAndNamesPathAndReason) {
  const fs::path path = dir_ / "model.safetensors";
  write_file_atomic(path, "previous checkpoint");
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::signal(SIGXFSZ, SIG_IGN);
    rlimit limit;
    ::getrlimit(RLIMIT_FSIZE, &limit);
    limit.rlim_cur = 1 << 16;
    ::setrlimit(RLIMIT_FSIZE, &limit);
    int status = 10;
    try {
      write_file_atomic(path, std::string(4 << 20, 'z'));
      status = 11;  // it should not have succeeded
    } catch (const Error& error) {
      const std::string message = error.what();
      status = 0;
      if (message.find(path.string()) == std::string::npos) status = 12;
      if (message.find("File too large") == std::string::npos) status = 13;
      if (fs::exists(atomic_temp_path(path))) status = 14;
    }
    ::_exit(status);
  }
  int wait_status = 0;
  ASSERT_EQ(::waitpid(child, &wait_status, 0), child);
  ASSERT_TRUE(WIFEXITED(wait_status));
  EXPECT_EQ(WEXITSTATUS(wait_status), 0)
      << "10: no memtune::Error, 11: succeeded, 12: no path, 13: no reason, 14: temp left";
  EXPECT_EQ(read_file(path), "previous checkpoint");
}

TEST_F(FileUtilTest, WriteIntoMissingDirectoryNamesPath) {
  const fs::path path = dir_ / "no_such_dir" / "out.bin";
  const std::string message = error_of([&] { write_file_atomic(path, "x"); });
  EXPECT_CONTAINS(message, path.string());
  EXPECT_CONTAINS(message, "No such file or directory");
}

TEST_F(FileUtilTest, WriteOverADirectoryFailsAndRemovesTemp) {
  const fs::path path = dir_ / "occupied";
  fs::create_directories(path / "child");
  const std::string message = error_of([&] { write_file_atomic(path, "x"); });
  EXPECT_CONTAINS(message, path.string());
  EXPECT_TRUE(fs::is_directory(path / "child"));
  EXPECT_FALSE(fs::exists(atomic_temp_path(path)));
}

TEST_F(FileUtilTest, ReadFileMissingIsClearError) {
  const fs::path path = dir_ / "missing.json";
  const std::string message = error_of([&] { read_file(path); });
  EXPECT_CONTAINS(message, path.string());
  EXPECT_CONTAINS(message, "No such file or directory");
}

TEST_F(FileUtilTest, ReadFileOfDirectoryIsClearError) {
  EXPECT_CONTAINS(error_of([&] { read_file(dir_); }), "is a directory");
}

TEST_F(FileUtilTest, ReadFileEmpty) {
  write_file_atomic(dir_ / "empty", "");
  EXPECT_EQ(read_file(dir_ / "empty"), "");
}

TEST_F(FileUtilTest, MappedFileMapsBytesAndSurvivesMoves) {
  const std::string bytes = "0123456789abcdef";
  write_file_atomic(dir_ / "m.bin", bytes);
  MappedFile first = MappedFile::open(dir_ / "m.bin");
  ASSERT_EQ(first.size(), bytes.size());
  const uint8_t* address = first.data();
  MappedFile second = std::move(first);
  EXPECT_EQ(first.data(), nullptr);
  EXPECT_EQ(first.size(), 0u);
  EXPECT_EQ(second.data(), address);
  MappedFile third;
  third = std::move(second);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(third.data()), third.size()), bytes);
  EXPECT_EQ(third.path(), dir_ / "m.bin");
}

TEST_F(FileUtilTest, MappedFileEmptyHasNoData) {
  write_file_atomic(dir_ / "empty", "");
  MappedFile file = MappedFile::open(dir_ / "empty");
  EXPECT_EQ(file.size(), 0u);
  EXPECT_EQ(file.data(), nullptr);
  file.release_pages(0, 100);  // harmless
}

TEST_F(FileUtilTest, MappedFileMissingOrDirectoryIsClearError) {
  const std::string missing = error_of([&] { MappedFile::open(dir_ / "nope.safetensors"); });
  EXPECT_CONTAINS(missing, "nope.safetensors");
  EXPECT_CONTAINS(missing, "No such file or directory");
  EXPECT_CONTAINS(error_of([&] { MappedFile::open(dir_); }), "is a directory");
}

TEST_F(FileUtilTest, ReleasedPagesReadBackTheSameBytes) {
  std::string bytes(3 * 4096 + 123, '\0');
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(i * 7);
  write_file_atomic(dir_ / "pages.bin", bytes);
  MappedFile file = MappedFile::open(dir_ / "pages.bin");
  file.release_pages(100, 5000);
  file.release_pages(0, bytes.size() * 2);  // clamped to the file
  file.release_pages(bytes.size() + 10, 10);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(file.data()), file.size()), bytes);
}
