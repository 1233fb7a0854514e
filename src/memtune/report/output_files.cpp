#include "memtune/report/output_files.h"

#include <system_error>

#include "memtune/core/error.h"
#include "memtune/io/file_util.h"

namespace memtune {

void write_output_files(const std::filesystem::path& out_dir, std::string_view what,
                        const std::vector<std::pair<std::string, std::string>>& files) {
  std::error_code error;
  std::filesystem::create_directories(out_dir, error);
  MT_USER_CHECK(!error, "{}: cannot create the {} directory: {}", out_dir.string(), what, error.message());
  for (const auto& [name, text] : files) write_file_atomic(out_dir / name, text);
}

}  // namespace memtune
