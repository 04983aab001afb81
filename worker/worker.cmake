# The tessera-worker binary (included by worker/CMakeLists.txt after its subdirectories).
add_executable(tessera-worker ${CMAKE_CURRENT_SOURCE_DIR}/main.cc)
target_compile_options(tessera-worker PRIVATE ${TESSERA_WARNINGS})
target_link_libraries(tessera-worker PRIVATE tessera_trainer tessera_worker_daemon tessera_common
  tessera_daemon tessera_metrics)

if(TESSERA_BUILD_TESTS)
  # Runs the real binary on the examples; the convergence case trains the MLP for 2 epochs.
  tessera_add_test(tessera_worker_standalone_test
    SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/standalone_main_test.cc
    LIBS absl::strings absl::str_format
    LABELS slow
    TIMEOUT 600)
  target_compile_definitions(tessera_worker_standalone_test PRIVATE
    TESSERA_WORKER_BINARY="$<TARGET_FILE:tessera-worker>"
    TESSERA_SOURCE_DIR="${CMAKE_SOURCE_DIR}")
  add_dependencies(tessera_worker_standalone_test tessera-worker)
endif()
