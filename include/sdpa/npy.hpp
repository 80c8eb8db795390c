/**
 * \file sdpa/npy.hpp
 * \brief NumPy `.npy` files in and out: the subset PyTorch and NumPy users dump in one line
 * (`np.save("q.npy", q.detach().float().numpy())`), little-endian float32 or float64, C or
 * Fortran order, 1 to 4 dimensions. Anything else is refused with a std::runtime_error that
 * names the file and what is unsupported. Not part of `<sdpa/sdpa.hpp>`: include it where
 * files are read (sdpa_check does). Format:
 * https://numpy.org/doc/stable/reference/generated/numpy.lib.format.html
 *
 * ```cpp
 * sdpa::npy::Array a = sdpa::npy::read("q.npy");   // a.shape {1, 12, 21, 32}, a.data in C order
 * Eigen::MatrixXd m = sdpa::npy::matrix(sdpa::npy::read("k2d.npy"));   // a 2-D array
 * sdpa::npy::write("out.npy", {2, 3}, {1, 2, 3, 4, 5, 6});              // float64, C order
 * ```
 */
#ifndef SDPA_NPY_HPP
#define SDPA_NPY_HPP

#include <Eigen/Core>
#include <cctype>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace sdpa::npy {

/// \brief An array read from .npy: its shape and its values in C (row-major) order, as double.
struct Array {
  std::vector<Eigen::Index> shape;
  std::vector<double> data;
};

namespace detail {
[[noreturn]] inline void fail(const std::string& path, const std::string& what) {
  throw std::runtime_error("npy: " + path + ": " + what);
}
}  // namespace detail

/// \brief Parses the bytes of a .npy file (`path` only names the source in errors).
inline Array parse(const std::string& bytes, const std::string& path) {
  using detail::fail;
  if (bytes.size() < 10 || bytes.compare(0, 6, "\x93NUMPY") != 0) fail(path, "not a .npy file (bad magic string)");
  const int major = static_cast<unsigned char>(bytes[6]);
  if (major < 1 || major > 3) fail(path, "unsupported .npy format version " + std::to_string(major));
  size_t headerLen = 0, offset = 0;
  if (major == 1) {
    headerLen = size_t(static_cast<unsigned char>(bytes[8])) | size_t(static_cast<unsigned char>(bytes[9])) << 8;
    offset = 10;
  } else {
    if (bytes.size() < 12) fail(path, "truncated header");
    for (int i = 0; i < 4; ++i) headerLen |= size_t(static_cast<unsigned char>(bytes[8 + size_t(i)])) << (8 * i);
    offset = 12;
  }
  if (bytes.size() < offset + headerLen) fail(path, "truncated header");
  const std::string header = bytes.substr(offset, headerLen);
  // The header is a Python dict literal: {'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }
  const auto valueOf = [&](const std::string& key) {
    const size_t k = header.find("'" + key + "'");
    if (k == std::string::npos) fail(path, "header has no '" + key + "'");
    const size_t colon = header.find(':', k);
    if (colon == std::string::npos) fail(path, "malformed header");
    return header.find_first_not_of(' ', colon + 1);
  };
  size_t at = valueOf("descr");
  const size_t descrEnd = header.find('\'', at + 1);
  if (header[at] != '\'' || descrEnd == std::string::npos) fail(path, "malformed 'descr'");
  const std::string descr = header.substr(at + 1, descrEnd - at - 1);
  size_t itemSize = 0;
  if (descr == "<f4")
    itemSize = 4;
  else if (descr == "<f8")
    itemSize = 8;
  else
    fail(path, "unsupported dtype '" + descr + "': only little-endian float32 ('<f4') and float64 ('<f8')");
  at = valueOf("fortran_order");
  const bool fortran = header.compare(at, 4, "True") == 0;
  if (!fortran && header.compare(at, 5, "False") != 0) fail(path, "malformed 'fortran_order'");
  at = valueOf("shape");
  const size_t shapeEnd = header.find(')', at);
  if (header[at] != '(' || shapeEnd == std::string::npos) fail(path, "malformed 'shape'");
  Array a;
  for (size_t i = at + 1; i < shapeEnd;) {
    if (std::isdigit(static_cast<unsigned char>(header[i]))) {
      size_t used = 0;
      a.shape.push_back(std::stoll(header.substr(i), &used));
      i += used;
    } else {
      ++i;
    }
  }
  if (a.shape.empty() || a.shape.size() > 4)
    fail(path, "unsupported shape of " + std::to_string(a.shape.size()) + " dimensions: need 1 to 4");
  size_t count = 1;
  for (const Eigen::Index d : a.shape) count *= size_t(d);
  const size_t dataOffset = offset + headerLen;
  if (bytes.size() - dataOffset < count * itemSize)
    fail(path, "truncated data: " + std::to_string(bytes.size() - dataOffset) + " bytes for " + std::to_string(count) +
                   " values of " + std::to_string(itemSize) + " bytes");
  std::vector<double> raw(count);
  for (size_t i = 0; i < count; ++i) {
    const char* p = bytes.data() + dataOffset + i * itemSize;
    if (itemSize == 4) {
      float f;
      std::memcpy(&f, p, 4);
      raw[i] = f;
    } else {
      std::memcpy(&raw[i], p, 8);
    }
  }
  if (!fortran || a.shape.size() == 1) {
    a.data = std::move(raw);
    return a;
  }
  // Fortran order: the first index varies fastest; reorder to C order.
  a.data.resize(count);
  std::vector<size_t> dims(a.shape.begin(), a.shape.end()), index(dims.size(), 0);
  for (size_t f = 0; f < count; ++f) {  // f walks Fortran order; c is the same element's C offset
    size_t c = 0;
    for (size_t d = 0; d < dims.size(); ++d) c = c * dims[d] + index[d];
    a.data[c] = raw[f];
    for (size_t d = 0; d < dims.size() && ++index[d] == dims[d]; ++d) index[d] = 0;
  }
  return a;
}

/// \brief Reads a .npy file.
inline Array read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) detail::fail(path, "cannot open");
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return parse(bytes, path);
}

/// \brief A 2-D array as a matrix (rows x columns); other ranks are refused.
inline Eigen::MatrixXd matrix(const Array& a, const std::string& path = "array") {
  if (a.shape.size() != 2)
    detail::fail(path, "a " + std::to_string(a.shape.size()) + "-D array is not a matrix (need 2-D)");
  Eigen::MatrixXd m(a.shape[0], a.shape[1]);
  for (Eigen::Index i = 0; i < m.rows(); ++i)
    for (Eigen::Index j = 0; j < m.cols(); ++j) m(i, j) = a.data[size_t(i * m.cols() + j)];
  return m;
}

/// \brief The .npy bytes (format version 1) of a float64 array in C order.
inline std::string bytes(const std::vector<Eigen::Index>& shape, const std::vector<double>& data) {
  std::string dims;
  for (const Eigen::Index d : shape) dims += std::to_string(d) + ",";
  if (shape.size() > 1) dims.pop_back();
  std::string header = "{'descr': '<f8', 'fortran_order': False, 'shape': (" + dims + "), }";
  header.append((64 - (10 + header.size() + 1) % 64) % 64, ' ');  // total length a multiple of 64
  header += '\n';
  std::string out = std::string("\x93NUMPY\x01\x00", 8);
  out += char(header.size() & 0xff);
  out += char(header.size() >> 8);
  out += header;
  out.append(reinterpret_cast<const char*>(data.data()), data.size() * sizeof(double));
  return out;
}

/// \brief Writes a float64 array in C order to a .npy file; throws if the file cannot be written.
inline void write(const std::string& path, const std::vector<Eigen::Index>& shape, const std::vector<double>& data) {
  size_t count = 1;
  for (const Eigen::Index d : shape) count *= size_t(d);
  if (count != data.size())
    detail::fail(path, "shape holds " + std::to_string(count) + " values, data " + std::to_string(data.size()));
  std::ofstream out(path, std::ios::binary);
  out << bytes(shape, data);
  if (!out) detail::fail(path, "cannot write");
}

}  // namespace sdpa::npy

#endif  // SDPA_NPY_HPP
