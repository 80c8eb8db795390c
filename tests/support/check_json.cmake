# Runs sdpa_check --json and validates the output with Python's json module.
execute_process(COMMAND ${CHECK} ${DIR}/q.npy ${DIR}/k.npy --scale none --json OUTPUT_FILE ${DIR}/report.json
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "sdpa_check --json failed: ${rc}")
endif()
execute_process(COMMAND ${PYTHON} -c
  "import json,sys; d=json.load(open(sys.argv[1])); assert len(d['heads'])==2 and d['verdicts'], d"
  ${DIR}/report.json RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "sdpa_check --json printed invalid JSON")
endif()
