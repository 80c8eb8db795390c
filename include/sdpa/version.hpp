/**
 * \file sdpa/version.hpp
 * \brief Library version. CMake reads the three numbers below; keep the format.
 */
#ifndef SDPA_VERSION_HPP
#define SDPA_VERSION_HPP

#define SDPA_VERSION_MAJOR 0
#define SDPA_VERSION_MINOR 1
#define SDPA_VERSION_PATCH 0

/// Single comparable number, e.g. 0.1.0 -> 100.
#define SDPA_VERSION (SDPA_VERSION_MAJOR * 10000 + SDPA_VERSION_MINOR * 100 + SDPA_VERSION_PATCH)

#endif  // SDPA_VERSION_HPP
