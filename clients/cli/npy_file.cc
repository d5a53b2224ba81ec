#include "clients/cli/npy_file.h"

#include <cstdint>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace attnserve::client {
namespace {

constexpr char kMagic[] = "\x93NUMPY";

// The value of `key` in the header's Python dict literal: 'descr': '<f4' gives '<f4' (quotes
// kept), 'shape': (2, 3) gives (2, 3).
std::string HeaderValue(const std::string& header, const std::string& key) {
  const size_t at = header.find("'" + key + "'");
  if (at == std::string::npos) return "";
  const size_t colon = header.find(':', at);
  if (colon == std::string::npos) return "";
  const size_t first = header.find_first_not_of(' ', colon + 1);
  if (first == std::string::npos) return "";
  const size_t end =
      header[first] == '(' ? header.find(')', first) + 1 : header.find_first_of(",}", first);
  if (end == std::string::npos || end == 0) return "";
  return std::string(absl::StripAsciiWhitespace(header.substr(first, end - first)));
}

}  // namespace

absl::StatusOr<v1::Tensor> ReadNpy(const std::string& path, bool u2_is_bf16) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::ostringstream all;
  all << in.rdbuf();
  const std::string bytes = all.str();
  if (bytes.size() < 10 || bytes.compare(0, 6, kMagic, 6) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not an .npy file"));
  }
  const int major = static_cast<unsigned char>(bytes[6]);
  size_t header_len, header_at;
  if (major == 1) {
    header_len = static_cast<unsigned char>(bytes[8]) | static_cast<unsigned char>(bytes[9]) << 8;
    header_at = 10;
  } else {
    if (bytes.size() < 12) return absl::InvalidArgumentError(absl::StrCat(path, ": truncated"));
    header_len = 0;
    for (int i = 0; i < 4; ++i)
      header_len |= size_t{static_cast<unsigned char>(bytes[8 + i])} << (8 * i);
    header_at = 12;
  }
  if (bytes.size() < header_at + header_len) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": truncated header"));
  }
  const std::string header = bytes.substr(header_at, header_len);
  const std::string descr = HeaderValue(header, "descr");
  v1::Tensor t;
  int64_t element = 0;
  if (descr == "'<f4'") {
    t.set_dtype(v1::DTYPE_FLOAT32);
    element = 4;
  } else if (descr == "'<f2'") {
    t.set_dtype(v1::DTYPE_FLOAT16);
    element = 2;
  } else if (descr == "'<u2'" && u2_is_bf16) {
    t.set_dtype(v1::DTYPE_BFLOAT16);
    element = 2;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": dtype ", descr, " (expected '<f4', '<f2' or '<u2' for bfloat16)"));
  }
  if (HeaderValue(header, "fortran_order") != "False") {
    return absl::InvalidArgumentError(absl::StrCat(path, ": Fortran order is not supported"));
  }
  std::string shape = HeaderValue(header, "shape");
  shape = std::string(absl::StripSuffix(absl::StripPrefix(shape, "("), ")"));
  int64_t count = 1;
  for (absl::string_view dim : absl::StrSplit(shape, ',', absl::SkipWhitespace())) {
    int64_t d = 0;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(dim), &d) || d < 0) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": bad shape (", shape, ")"));
    }
    t.add_shape(d);
    count *= d;
  }
  const size_t data_at = header_at + header_len;
  if (bytes.size() - data_at != static_cast<size_t>(count * element)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", bytes.size() - data_at,
                                                   " data bytes, shape needs ", count * element));
  }
  t.set_data(bytes.substr(data_at));
  return t;
}

absl::Status WriteNpy(const std::string& path, const v1::Tensor& tensor) {
  const char* descr = tensor.dtype() == v1::DTYPE_FLOAT32   ? "<f4"
                      : tensor.dtype() == v1::DTYPE_FLOAT16 ? "<f2"
                                                            : "<u2";
  std::string shape = absl::StrJoin(tensor.shape(), ", ");
  if (tensor.shape_size() == 1) shape += ",";
  std::string header =
      absl::StrCat("{'descr': '", descr, "', 'fortran_order': False, 'shape': (", shape, "), }");
  // Pad with spaces so that the data starts on a 64-byte boundary; the header ends in '\n'.
  const size_t unpadded = 10 + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header += '\n';
  std::ofstream out(path, std::ios::binary);
  if (!out) return absl::PermissionDeniedError(absl::StrCat(path, ": cannot write"));
  out.write(kMagic, 6);
  const char version[2] = {1, 0};
  out.write(version, 2);
  const char len[2] = {static_cast<char>(header.size() & 0xff),
                       static_cast<char>(header.size() >> 8)};
  out.write(len, 2);
  out << header;
  out.write(tensor.data().data(), static_cast<std::streamsize>(tensor.data().size()));
  if (!out) return absl::DataLossError(absl::StrCat(path, ": write failed"));
  return absl::OkStatus();
}

}  // namespace attnserve::client
