/**
 * \file sdpa/sdpa.hpp
 * \brief The umbrella header: `#include <sdpa/sdpa.hpp>` is all a user needs.
 */
#ifndef SDPA_SDPA_HPP
#define SDPA_SDPA_HPP

#include "backward.hpp"
#include "diagnostics.hpp"
#include "diagnostics_sink.hpp"
#include "dropout.hpp"
#include "forward.hpp"
#include "kernel.hpp"
#include "kv_cache.hpp"
#include "layout.hpp"
#include "mask.hpp"
#include "multihead.hpp"
#include "scale.hpp"
#include "softmax.hpp"
#include "version.hpp"

#endif  // SDPA_SDPA_HPP
