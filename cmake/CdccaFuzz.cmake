# libFuzzer targets for the decoders of untrusted bytes (issue 20): one declaration each.
#
# A fuzzer is compiled by clang directly from torch-free sources (-fsanitize=fuzzer,address,
# undefined, UB fatal), apart from the main gcc build, and registered as a ctest in the
# default `unit` label that runs it for a bounded time on a fresh seed corpus. Nothing is
# declared where clang++, libFuzzer's runtime or the pkg-config files are missing, so
# machines without them build as before.
#
# Usage (paths relative to the calling CMakeLists.txt):
#   cdcca_add_fuzzer(my_decoder                      # target my_decoder_fuzzer, test my_decoder_fuzz
#     SOURCES fuzz/my_decoder_fuzzer.cc my_decoder.cc hash64.cc   # entry + what it needs
#     SEED_GENERATOR my_decoder_fuzz_seeds           # optional: a gcc-built program run as
#                                                    #   `GEN OUT_DIR` at test time
#     SEED_FILES ${PROJECT_SOURCE_DIR}/configs/x.json   # optional: committed seed files
#     SECONDS 15            # run time per ctest run (default 15)
#     MAX_LEN 8192          # largest input libFuzzer builds (default 8192 bytes)
#     MALLOC_LIMIT_MB 512   # any single allocation above this is a finding (default 512)
#     PKG_DEPS libfoo       # pkg-config modules beyond the default set (Abseil status/
#                           # strings/containers, libzstd, nlohmann_json)
#     DEPENDS_TARGETS cdcca_proto)  # targets that generate some of SOURCES (the build
#                           # tree is on the include path: "proto/store.pb.h")
# The entry defines `extern "C" int LLVMFuzzerTestOneInput(const uint8_t*, size_t)`; the
# seed generator is an ordinary add_executable (gcc, may link project libraries) declared
# before the call inside `if(CDCCA_FUZZ_ENABLED)`, so that it is not built for nothing. A decoder whose bytes end in a Hash64 checksum can use
# compress/fuzz/reseal.h so mutations get past the checksum.
# Run one by hand: `ctest -R my_decoder_fuzz`. Longer: `ctest -R my_decoder_fuzz -N -V`
# prints the runner's command line; run it with CDCCA_FUZZ_SECONDS=600 in front (the
# ctest TIMEOUT is sized for SECONDS).

find_program(CDCCA_CLANGXX NAMES clang++ clang++-14)
find_package(PkgConfig QUIET)
set(CDCCA_FUZZ_ENABLED OFF)
if(CDCCA_BUILD_TESTS AND CDCCA_CLANGXX AND PkgConfig_FOUND AND NOT CDCCA_DEPS_PREFIX)
  pkg_check_modules(CDCCA_FUZZ_DEPS QUIET absl_status absl_statusor absl_str_format
                    absl_strings absl_flat_hash_map absl_flat_hash_set libzstd nlohmann_json)
  if(CDCCA_FUZZ_DEPS_FOUND AND NOT DEFINED CDCCA_FUZZ_RUNTIME_OK)
    # clang without libclang-rt-*-dev cannot link -fsanitize=fuzzer: probe once.
    set(_probe ${CMAKE_BINARY_DIR}/CMakeFiles/cdcca_fuzz_probe)
    file(WRITE ${_probe}.cc
         "#include <cstddef>\n#include <cstdint>\nextern \"C\" int LLVMFuzzerTestOneInput("
         "const uint8_t*, size_t) { return 0; }\n")
    execute_process(
      COMMAND ${CDCCA_CLANGXX} -fsanitize=fuzzer,address,undefined ${_probe}.cc -o ${_probe}
      RESULT_VARIABLE _probe_rc OUTPUT_QUIET ERROR_QUIET)
    if(_probe_rc EQUAL 0)
      set(CDCCA_FUZZ_RUNTIME_OK ON CACHE INTERNAL "clang links -fsanitize=fuzzer")
    else()
      set(CDCCA_FUZZ_RUNTIME_OK OFF CACHE INTERNAL "clang links -fsanitize=fuzzer")
      message(STATUS "cdcca: fuzzers off (${CDCCA_CLANGXX} cannot link -fsanitize=fuzzer; "
                     "install libclang-rt-14-dev)")
    endif()
  endif()
  if(CDCCA_FUZZ_DEPS_FOUND AND CDCCA_FUZZ_RUNTIME_OK)
    set(CDCCA_FUZZ_ENABLED ON)
  endif()
endif()

function(cdcca_add_fuzzer name)
  if(NOT CDCCA_FUZZ_ENABLED)
    return()
  endif()
  cmake_parse_arguments(F "" "SEED_GENERATOR;SECONDS;MAX_LEN;MALLOC_LIMIT_MB"
                        "SOURCES;SEED_FILES;PKG_DEPS;DEPENDS_TARGETS" ${ARGN})
  if(NOT F_SECONDS)
    set(F_SECONDS 15)
  endif()
  if(NOT F_MAX_LEN)
    set(F_MAX_LEN 8192)
  endif()
  if(NOT F_MALLOC_LIMIT_MB)
    set(F_MALLOC_LIMIT_MB 512)
  endif()
  set(_ldflags ${CDCCA_FUZZ_DEPS_LDFLAGS})
  set(_cflags ${CDCCA_FUZZ_DEPS_CFLAGS_OTHER})
  if(F_PKG_DEPS)
    pkg_check_modules(_F_EXTRA_${name} QUIET ${F_PKG_DEPS})
    if(NOT _F_EXTRA_${name}_FOUND)
      message(STATUS "cdcca: fuzzer ${name} skipped (pkg-config lacks ${F_PKG_DEPS})")
      return()
    endif()
    list(APPEND _ldflags ${_F_EXTRA_${name}_LDFLAGS})
    list(APPEND _cflags ${_F_EXTRA_${name}_CFLAGS_OTHER})
  endif()
  set(_sources)
  set(_headers)
  foreach(s ${F_SOURCES})
    get_filename_component(_abs ${s} ABSOLUTE BASE_DIR ${CMAKE_CURRENT_SOURCE_DIR})
    list(APPEND _sources ${_abs})
    # Headers beside each source: the rebuild trigger (clang -MD cannot name one depfile
    # for a compile-and-link of several sources).
    get_filename_component(_dir ${_abs} DIRECTORY)
    file(GLOB _h ${_dir}/*.h)
    list(APPEND _headers ${_h})
  endforeach()
  list(REMOVE_DUPLICATES _headers)
  set(_out ${CMAKE_CURRENT_BINARY_DIR}/fuzz/${name}_fuzzer)
  add_custom_command(
    OUTPUT ${_out}
    COMMAND ${CMAKE_COMMAND} -E make_directory ${CMAKE_CURRENT_BINARY_DIR}/fuzz
    COMMAND ${CDCCA_CLANGXX} -std=c++17 -O1 -g -fno-omit-frame-pointer
            -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined
            ${_cflags} -I${PROJECT_SOURCE_DIR} -I${CMAKE_BINARY_DIR} ${_sources} -o ${_out}
            ${_ldflags}
    DEPENDS ${_sources} ${_headers}
    COMMENT "clang libFuzzer: ${name}_fuzzer"
    VERBATIM)
  add_custom_target(${name}_fuzzer ALL DEPENDS ${_out})
  if(F_DEPENDS_TARGETS)
    add_dependencies(${name}_fuzzer ${F_DEPENDS_TARGETS})
  endif()
  set(_args ${_out} ${CMAKE_CURRENT_BINARY_DIR}/fuzz_work/${name} ${F_SECONDS} ${F_MAX_LEN}
            ${F_MALLOC_LIMIT_MB})
  if(F_SEED_GENERATOR)
    list(APPEND _args --gen $<TARGET_FILE:${F_SEED_GENERATOR}>)
  endif()
  foreach(f ${F_SEED_FILES})
    get_filename_component(_abs ${f} ABSOLUTE BASE_DIR ${CMAKE_CURRENT_SOURCE_DIR})
    list(APPEND _args --seed ${_abs})
  endforeach()
  add_test(NAME ${name}_fuzz COMMAND ${PROJECT_SOURCE_DIR}/scripts/run_fuzzer.sh ${_args})
  # Timeout: the run, plus seeds, startup and the final corpus pass.
  math(EXPR _timeout "${F_SECONDS} * 3 + 60")
  set_tests_properties(${name}_fuzz PROPERTIES LABELS unit TIMEOUT ${_timeout})
endfunction()
