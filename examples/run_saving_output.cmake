# ctest -P script: runs PROGRAM, saving its standard output in OUTPUT (and echoing it); fails if
# the program does.
execute_process(COMMAND ${PROGRAM} OUTPUT_VARIABLE out RESULT_VARIABLE rc)
file(WRITE "${OUTPUT}" "${out}")
message("${out}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${PROGRAM} failed: ${rc}")
endif()
