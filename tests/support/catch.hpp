// Catch2 2.13 (Debian 12) or 3.x, whichever CMake found.
#pragma once
#if __has_include(<catch2/catch_all.hpp>)
#include <catch2/catch_all.hpp>
#else
#include <catch2/catch.hpp>
#endif
