# Precompiled headers: the build's time goes into parsing, not code.
#
# A test file that includes <gtest/gtest.h> and <chorus/chorus.h> is ~170,000
# lines once preprocessed; parsing them took 6 of the 13 s it took to compile
# (2 cores, -O2), and CI compiles the tree twice (plain, ASan) plus the
# threaded tests under TSan. Each kind of translation unit gets one header
# precompiled for it:
#   chorus_pch_library(target)   the library: the standard headers it uses most
#   chorus_pch_tests(target)     gtest + the public API
#   chorus_pch_app(target)       JSON + the public API (not CLI11: its global
#                                validators would be compiled again in every file)
#   chorus_pch_program(target)   the many one-file programs (examples, probes,
#                                README snippets, fuzz replays) share one
#                                precompiled public API through REUSE_FROM
# A header that cannot be used (flags differ) is silently parsed as text, so a
# mismatch costs time, never correctness. -DCHORUS_PCH=OFF turns it all off
# (CI's install test and the header-alone checks do not depend on it).
option(CHORUS_PCH "Precompile the common headers" ON)

set(CHORUS_PCH_STD <algorithm> <atomic> <chrono> <condition_variable> <cstdint> <cstring> <functional> <map>
    <memory> <mutex> <optional> <sstream> <stdexcept> <string> <thread> <unordered_map> <vector>)

function(chorus_pch_library target)
  if(NOT CHORUS_PCH)
    return()
  endif()
  # C++ only: nvcc compiles the .cu files without it.
  foreach(h ${CHORUS_PCH_STD} "chorus/core/tensor.h" "chorus/core/error.h")
    target_precompile_headers(${target} PRIVATE "$<$<COMPILE_LANGUAGE:CXX>:${h}>")
  endforeach()
endfunction()

function(chorus_pch_tests target)
  if(CHORUS_PCH)
    target_precompile_headers(${target} PRIVATE ${CHORUS_PCH_STD} <gtest/gtest.h> <chorus/chorus.h>)
  endif()
endfunction()

function(chorus_pch_app target)
  if(CHORUS_PCH)
    target_precompile_headers(${target} PRIVATE ${CHORUS_PCH_STD} <nlohmann/json.hpp>
                              <chorus/chorus.h>)
  endif()
endfunction()

function(chorus_pch_program target)
  if(NOT CHORUS_PCH)
    return()
  endif()
  if(NOT TARGET chorus_program_pch)
    # An object library of one empty file whose only product is the header.
    set(src ${CMAKE_BINARY_DIR}/chorus_program_pch.cpp)
    if(NOT EXISTS ${src})
      file(WRITE ${src} "// the precompiled public API of Chorus for one-file programs (cmake/Pch.cmake)\n")
    endif()
    add_library(chorus_program_pch OBJECT ${src})
    target_link_libraries(chorus_program_pch PRIVATE chorus)
    chorus_test_program(chorus_program_pch)
    target_precompile_headers(chorus_program_pch PRIVATE ${CHORUS_PCH_STD} <chorus/chorus.h>)
  endif()
  target_precompile_headers(${target} REUSE_FROM chorus_program_pch)
endfunction()

# The unit tests are also compiled a few files at a time (a unity build): an
# empty test file costs 3.6 s with the precompiled header (templates that
# gtest and nlohmann::json instantiate at the end of every translation unit),
# paid once per batch instead of once per file. The files below define
# helpers of the same name as another test file's, so they compile alone.
set(CHORUS_TESTS_ALONE cpu/nn_kernels_test cpu/random_test cpu/softmax_test cuda/backend_test
    cuda/gemm_conv_test data_parallel/reducer_test data_parallel/sync_batch_norm_test ops/linalg_test ops/nn_test
    parallel/data_parallel_test parallel/device_threads_test parallel/pipeline_cuda_test parallel/pipeline_test
    optim/sgd_test cuda/elementwise_test cuda/optim_kernels_test cpu/optim_kernels_test cpu/pool_test)
option(CHORUS_UNITY_TESTS "Compile the unit tests in batches (unity build)" ON)
option(CHORUS_UNITY_LIBRARY "Compile the library's C++ files in batches (unity build)" ON)
function(chorus_unity_tests target)
  if(NOT CHORUS_UNITY_TESTS)
    return()
  endif()
  set_target_properties(${target} PROPERTIES UNITY_BUILD ON UNITY_BUILD_BATCH_SIZE 8)
  foreach(f ${CHORUS_TESTS_ALONE})
    set_source_files_properties(${PROJECT_SOURCE_DIR}/tests/${f}.cpp PROPERTIES SKIP_UNITY_BUILD_INCLUSION ON)
  endforeach()
endfunction()

# The library is compiled in batches too, a layer at a time (UNITY_GROUP: the
# files of one directory), for the same reason. The CPU kernels have flags of
# their own, and the CUDA layer's files (CUDA headers that clash once merged,
# helpers of the same name) are few: they compile alone.
function(chorus_unity_library target sources)
  if(NOT CHORUS_UNITY_LIBRARY)
    return()
  endif()
  set_target_properties(${target} PROPERTIES UNITY_BUILD ON UNITY_BUILD_MODE GROUP)
  # A class with a member of a file-local type is fine in its own .cpp; GCC
  # warns once the .cpp is #included into the batch's file.
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Wno-subobject-linkage>)
  foreach(src ${sources})
    get_filename_component(dir ${src} DIRECTORY)
    get_filename_component(layer ${dir} NAME)
    if(src MATCHES "/src/chorus/(cpu|cuda)/")
      continue()
    endif()
    set_source_files_properties(${src} PROPERTIES UNITY_GROUP ${layer})
  endforeach()
endfunction()
