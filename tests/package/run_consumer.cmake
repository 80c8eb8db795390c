# ctest -P script: configure, build and run the consumer project in a fresh directory.
# Inputs: MODE, SOURCE_DIR (sdpa), WORK_DIR, GENERATOR, PREFIX for find_package, EXPECT_MPI
# (whether sdpa::mpi must be there) and CXX, the compiler of the build that runs the test (clang++
# under the test preset compiles main.cpp in 7 s, g++ in 12).
file(REMOVE_RECURSE "${WORK_DIR}")
set(args -S "${SOURCE_DIR}/tests/package" -B "${WORK_DIR}" -G "${GENERATOR}" -DSDPA_CONSUME=${MODE}
         -DSDPA_SOURCE_DIR=${SOURCE_DIR} -DSDPA_EXPECT_MPI=${EXPECT_MPI})
if(CXX)
  list(APPEND args -DCMAKE_CXX_COMPILER=${CXX})
endif()
if(PREFIX)
  list(APPEND args -DCMAKE_PREFIX_PATH=${PREFIX})
endif()
foreach(step IN ITEMS configure build run)
  if(step STREQUAL "configure")
    execute_process(COMMAND ${CMAKE_COMMAND} ${args} RESULT_VARIABLE rc)
  elseif(step STREQUAL "build")
    execute_process(COMMAND ${CMAKE_COMMAND} --build "${WORK_DIR}" RESULT_VARIABLE rc)
  else()
    execute_process(COMMAND "${WORK_DIR}/consumer" RESULT_VARIABLE rc)
  endif()
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "consumer (${MODE}): ${step} failed: ${rc}")
  endif()
endforeach()
