// The .npy reader of tools/: the float32/float64 little-endian subset, C and Fortran order, and
// clear errors for everything else.
#include <cstring>
#include <stdexcept>

#include "../tools/npy.hpp"
#include "support/catch.hpp"

using Catch::Matchers::Contains;
using sdpa_tools::npyBytes;
using sdpa_tools::parseNpy;

namespace {
/// A version-1 .npy file with the given header dict and payload.
std::string npyFile(const std::string& dict, const std::string& payload) {
  std::string header = dict;
  header.append((64 - (10 + header.size() + 1) % 64) % 64, ' ');
  header += '\n';
  std::string out("\x93NUMPY\x01\x00", 8);
  out += char(header.size() & 0xff);
  out += char(header.size() >> 8);
  return out + header + payload;
}
template <typename T>
std::string payload(std::initializer_list<T> values) {
  std::string s;
  for (const T v : values) s.append(reinterpret_cast<const char*>(&v), sizeof v);
  return s;
}
}  // namespace

TEST_CASE("npy: float64 and float32, C and Fortran order, 1-3 dimensions", "[npy]") {
  const auto a = parseNpy(npyBytes({2, 3}, {1, 2, 3, 4, 5, 6}), "a");
  CHECK(a.shape == std::vector<Eigen::Index>{2, 3});
  CHECK(a.data == std::vector<double>{1, 2, 3, 4, 5, 6});
  const auto f =
      parseNpy(npyFile("{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }", payload({1.5f, -2.f, 3.f})), "f");
  CHECK(f.data == std::vector<double>{1.5, -2, 3});
  // Fortran order: memory holds columns; the reader returns C order.
  const auto fo = parseNpy(
      npyFile("{'descr': '<f8', 'fortran_order': True, 'shape': (2, 3), }", payload({1.0, 4.0, 2.0, 5.0, 3.0, 6.0})),
      "fo");
  CHECK(fo.data == std::vector<double>{1, 2, 3, 4, 5, 6});
  Eigen::Index heads = 0;
  const auto three = parseNpy(npyBytes({2, 2, 3}, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}), "t");
  const Eigen::MatrixXd packed = sdpa_tools::packedMatrix(three, "t", heads);
  CHECK(heads == 2);
  CHECK(packed.rows() == 2);
  CHECK(packed.cols() == 6);
  CHECK(packed(0, 3) == 7);  // head 1, position 0, feature 0
  CHECK(packed(1, 2) == 6);
}

TEST_CASE("npy: bad files give clear errors", "[npy][errors]") {
  CHECK_THROWS_WITH(parseNpy("PK\x03\x04 not numpy at all", "x.npy"), Contains("x.npy") && Contains("bad magic"));
  const std::string full = npyBytes({4}, {1, 2, 3, 4});
  CHECK((full.size() - 32) % 64 == 0);  // header padded to a multiple of 64 bytes, then 4 doubles
  CHECK_THROWS_WITH(parseNpy(full.substr(0, 40), "t.npy"), Contains("truncated header"));
  CHECK_THROWS_WITH(parseNpy(full.substr(0, full.size() - 8), "t.npy"), Contains("truncated data"));
  CHECK_THROWS_WITH(parseNpy(npyFile("{'descr': '<i4', 'fortran_order': False, 'shape': (1,), }", payload({1})), "i"),
                    Contains("unsupported dtype '<i4'"));
  CHECK_THROWS_WITH(parseNpy(npyFile("{'descr': '>f8', 'fortran_order': False, 'shape': (1,), }", payload({1.0})), "b"),
                    Contains("unsupported dtype '>f8'"));
  CHECK_THROWS_WITH(
      parseNpy(npyFile("{'descr': '<f8', 'fortran_order': False, 'shape': (1, 1, 1, 1), }", payload({1.0})), "s"),
      Contains("4 dimensions"));
  Eigen::Index heads = 0;
  CHECK_THROWS_WITH(sdpa_tools::packedMatrix(parseNpy(npyBytes({3}, {1, 2, 3}), "v"), "v", heads),
                    Contains("1-D array is not a matrix"));
  CHECK_THROWS_WITH(sdpa_tools::readNpy("/nonexistent/q.npy"), Contains("cannot open"));
}
