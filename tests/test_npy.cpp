// sdpa/npy.hpp: the float32/float64 little-endian subset, C and Fortran order, and
// clear errors for everything else; sdpa_check's strict arguments and input layouts.
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include <sdpa/npy.hpp>
#include "../tools/cli_args.hpp"
#include "support/catch.hpp"

using Catch::Matchers::Contains;
using sdpa::npy::bytes;
using sdpa::npy::parse;

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

TEST_CASE("npy: float64 and float32, C and Fortran order, 1-4 dimensions", "[npy]") {
  const auto a = parse(bytes({2, 3}, {1, 2, 3, 4, 5, 6}), "a");
  CHECK(a.shape == std::vector<Eigen::Index>{2, 3});
  CHECK(a.data == std::vector<double>{1, 2, 3, 4, 5, 6});
  const auto f =
      parse(npyFile("{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }", payload({1.5f, -2.f, 3.f})), "f");
  CHECK(f.data == std::vector<double>{1.5, -2, 3});
  // Fortran order: memory holds columns; the reader returns C order.
  const auto fo = parse(
      npyFile("{'descr': '<f8', 'fortran_order': True, 'shape': (2, 3), }", payload({1.0, 4.0, 2.0, 5.0, 3.0, 6.0})),
      "fo");
  CHECK(fo.data == std::vector<double>{1, 2, 3, 4, 5, 6});
  // Fortran order in 4-D: element (a, b, c, e) of shape (2, 1, 2, 3) holds 1000a + 100b + 10c + e.
  std::vector<double> fortran, c;
  for (int e = 0; e < 3; ++e)
    for (int cc = 0; cc < 2; ++cc)
      for (int a = 0; a < 2; ++a) fortran.push_back(1000 * a + 10 * cc + e);
  for (int a = 0; a < 2; ++a)
    for (int cc = 0; cc < 2; ++cc)
      for (int e = 0; e < 3; ++e) c.push_back(1000 * a + 10 * cc + e);
  std::string raw;
  for (const double v : fortran) raw.append(reinterpret_cast<const char*>(&v), sizeof v);
  CHECK(parse(npyFile("{'descr': '<f8', 'fortran_order': True, 'shape': (2, 1, 2, 3), }", raw), "f4").data == c);
}

TEST_CASE("npy: write, read back, and a 2-D array as a matrix", "[npy]") {
  const std::string path = "sdpa_test_npy_roundtrip.npy";
  sdpa::npy::write(path, {2, 3}, {1, 2, 3, 4, 5, 6.5});
  const sdpa::npy::Array a = sdpa::npy::read(path);
  CHECK(a.shape == std::vector<Eigen::Index>{2, 3});
  const Eigen::MatrixXd m = sdpa::npy::matrix(a, path);
  CHECK(m(0, 2) == 3);
  CHECK(m(1, 2) == 6.5);
  CHECK_THROWS_WITH(sdpa::npy::matrix(parse(bytes({2, 1, 1}, {1, 2}), "t"), "t"),
                    Contains("3-D array is not a matrix"));
  CHECK_THROWS_WITH(sdpa::npy::write(path, {2, 2}, {1, 2, 3}), Contains("shape holds 4 values, data 3"));
  CHECK_THROWS_WITH(sdpa::npy::write("/nonexistent/dir/x.npy", {1}, {1}), Contains("cannot write"));
  std::remove(path.c_str());
}

TEST_CASE("sdpa_check inputs: every layout gives the same packed matrix, ambiguous ones are refused", "[npy][cli]") {
  using sdpa_tools::attentionInput;
  // Two heads of 3 positions x 2 features: value 100 h + 10 i + j.
  std::vector<double> hld, lhd;
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < 3; ++i)
      for (int j = 0; j < 2; ++j) hld.push_back(100 * h + 10 * i + j);
  for (int i = 0; i < 3; ++i)
    for (int h = 0; h < 2; ++h)
      for (int j = 0; j < 2; ++j) lhd.push_back(100 * h + 10 * i + j);
  Eigen::MatrixXd expected(3, 4);
  for (int i = 0; i < 3; ++i)
    for (int h = 0; h < 2; ++h)
      for (int j = 0; j < 2; ++j) expected(i, 2 * h + j) = 100 * h + 10 * i + j;
  const auto read = [](const std::vector<Eigen::Index>& shape, const std::vector<double>& data, Eigen::Index given,
                       Eigen::Index implied) {
    return attentionInput(parse(bytes(shape, data), "x.npy"), "x.npy", "q", given, implied);
  };
  const auto four = read({1, 2, 3, 2}, hld, 0, 0);
  CHECK(four.packed == expected);
  CHECK(four.layout == "(1, H, L, d)");
  CHECK(read({2, 3, 2}, hld, 0, 0).packed == expected);
  CHECK(read({2, 3, 2}, hld, 2, 0).packed == expected);
  CHECK(read({1, 3, 4}, lhd, 2, 0).packed == expected);  // a Linear output with --heads 2
  CHECK(read({3, 4}, lhd, 2, 0).packed == expected);
  CHECK(read({3, 4}, lhd, 0, 2).packed == expected);  // heads implied by the other file
  CHECK(read({3, 4}, lhd, 0, 2).headDim == 2);
  CHECK(read({3, 4}, lhd, 1, 0).headDim == 4);  // --heads 1: one head of d_k 4
  CHECK_THROWS_WITH(read({3, 4}, lhd, 0, 0), Contains("2-D") && Contains("pass --heads H"));
  CHECK_THROWS_WITH(read({1, 3, 4}, lhd, 0, 0), Contains("Linear layer's output") && Contains("pass --heads H"));
  CHECK_THROWS_WITH(read({3, 4}, lhd, 3, 0), Contains("do not split into 3 heads"));
  CHECK_THROWS_WITH(read({2, 3, 2}, hld, 3, 0), Contains("holds 2 heads, but --heads says 3"));
  CHECK_THROWS_WITH(read({2, 1, 3, 2}, hld, 0, 0), Contains("a batch of 2"));
  CHECK_THROWS_WITH(read({1, 3, 2, 2}, lhd, 2, 0), Contains("(batch, seq, heads, dim)"));
  CHECK_THROWS_WITH(read({12}, std::vector<double>(12), 0, 0), Contains("not a matrix"));
}

TEST_CASE("sdpa_check arguments parse whole or are refused by name", "[npy][cli]") {
  using sdpa_tools::parseScale;
  CHECK(parseScale("inv_sqrt_dk").value(64) == 0.125);
  CHECK(parseScale("none").value(64) == 1);
  CHECK(parseScale("0.125").value(7) == 0.125);
  CHECK(parseScale("1/8").value(7) == 0.125);
  CHECK(parseScale("1/sqrt(64)").value(7) == 0.125);
  CHECK(parseScale("rsqrt(64)").value(7) == 0.125);
  CHECK(parseScale("T=8").value(7) == 0.125);
  for (const char* bad : {"", "0.5abc", "T=4foo", "1e400", "1/0", "T=0", "T=-1", "1/sqrt(0)", "rsqrt(64", "abc",
                          "1/sqrt(x)", " 1", "nan", "inf"})
    CHECK_THROWS_WITH(parseScale(bad), Contains("--scale '" + std::string(bad) + "'") && Contains("accepted:"));
  CHECK(sdpa_tools::parseHeads("12") == std::pair<Eigen::Index, Eigen::Index>{12, 12});
  CHECK(sdpa_tools::parseHeads("32:8") == std::pair<Eigen::Index, Eigen::Index>{32, 8});
  for (const char* bad : {"0", "12:0", "12x", "", ":4", "12:", "-3", "1.5", "12:5"})
    CHECK_THROWS_WITH(sdpa_tools::parseHeads(bad), Contains("--heads '" + std::string(bad) + "'"));
  CHECK(sdpa_tools::parseCount("--key-length", "17") == 17);
  CHECK_THROWS_WITH(sdpa_tools::parseCount("--key-length", "0"), Contains("--key-length '0'"));
  CHECK_THROWS_WITH(sdpa_tools::parseCount("--key-length", "9999999999999"), Contains("too large"));
}

TEST_CASE("npy: bad files give clear errors", "[npy][errors]") {
  CHECK_THROWS_WITH(parse("PK\x03\x04 not numpy at all", "x.npy"), Contains("x.npy") && Contains("bad magic"));
  const std::string full = bytes({4}, {1, 2, 3, 4});
  CHECK((full.size() - 32) % 64 == 0);  // header padded to a multiple of 64 bytes, then 4 doubles
  CHECK_THROWS_WITH(parse(full.substr(0, 40), "t.npy"), Contains("truncated header"));
  CHECK_THROWS_WITH(parse(full.substr(0, full.size() - 8), "t.npy"), Contains("truncated data"));
  CHECK_THROWS_WITH(parse(npyFile("{'descr': '<i4', 'fortran_order': False, 'shape': (1,), }", payload({1})), "i"),
                    Contains("unsupported dtype '<i4'"));
  CHECK_THROWS_WITH(parse(npyFile("{'descr': '>f8', 'fortran_order': False, 'shape': (1,), }", payload({1.0})), "b"),
                    Contains("unsupported dtype '>f8'"));
  CHECK_THROWS_WITH(
      parse(npyFile("{'descr': '<f8', 'fortran_order': False, 'shape': (1, 1, 1, 1, 1), }", payload({1.0})), "s"),
      Contains("5 dimensions"));
  CHECK_THROWS_WITH(sdpa::npy::read("/nonexistent/q.npy"), Contains("cannot open"));
}
