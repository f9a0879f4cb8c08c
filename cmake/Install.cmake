# Install rules: `cmake --install build --prefix P` puts the library in
# P/lib…, the public headers in P/include/chorus/, the `chorus` program in
# P/bin, the CMake package (find_package(Chorus), target Chorus::chorus) in
# P/lib…/cmake/Chorus and chorus.pc in P/lib…/pkgconfig. Included at the end
# of CMakeLists.txt, once every target and CHORUS_HAVE_* is known.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set_target_properties(chorus PROPERTIES VERSION ${PROJECT_VERSION}
                                        SOVERSION ${PROJECT_VERSION_MAJOR}.${PROJECT_VERSION_MINOR})
target_compile_features(chorus PUBLIC cxx_std_20)  # users compile the headers as C++20 too
if(TARGET chorus_cli AND BUILD_SHARED_LIBS AND NOT CMAKE_INSTALL_PREFIX STREQUAL "/usr")
  # An installed `chorus` finds libchorus.so beside it wherever the prefix is moved.
  set_target_properties(chorus_cli PROPERTIES INSTALL_RPATH "$ORIGIN/../${CMAKE_INSTALL_LIBDIR}")
endif()

# --- public headers ---------------------------------------------------------------
# Every header of the layers a user programs against: all of src/chorus except
# the kernel internals of cpu/ and cuda/ (.cuh files, headers that need the CUDA
# toolkit's own headers). Then whatever those include, followed to the end, so
# that an installed header never names a missing one (ops/dispatch.h brings
# cpu/kernels.h and cuda/kernels/kernels.h). tests/install/out_of_tree.sh compiles each
# installed header alone against the installed tree.
file(GLOB_RECURSE _chorus_todo RELATIVE ${PROJECT_SOURCE_DIR}/src ${PROJECT_SOURCE_DIR}/src/chorus/*.h)
list(FILTER _chorus_todo EXCLUDE REGEX "^chorus/(cpu|cuda)/")
set(CHORUS_PUBLIC_HEADERS)
while(_chorus_todo)
  list(POP_FRONT _chorus_todo _h)
  if(_h IN_LIST CHORUS_PUBLIC_HEADERS)
    continue()
  endif()
  if(NOT EXISTS ${PROJECT_SOURCE_DIR}/src/${_h})
    message(FATAL_ERROR "Chorus install: a public header includes <${_h}>, which does not exist")
  endif()
  list(APPEND CHORUS_PUBLIC_HEADERS ${_h})
  file(STRINGS ${PROJECT_SOURCE_DIR}/src/${_h} _includes REGEX "^[ \t]*#[ \t]*include[ \t]*[\"<]chorus/")
  foreach(_line IN LISTS _includes)
    string(REGEX REPLACE "^[^\"<]*[\"<](chorus/[^\">]+)[\">].*$" "\\1" _inc "${_line}")
    list(APPEND _chorus_todo ${_inc})
  endforeach()
endwhile()
list(SORT CHORUS_PUBLIC_HEADERS)
foreach(_h IN LISTS CHORUS_PUBLIC_HEADERS)
  get_filename_component(_dir ${_h} DIRECTORY)
  install(FILES ${PROJECT_SOURCE_DIR}/src/${_h} DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/${_dir})
endforeach()

# --- library, program, exported targets -----------------------------------------
install(TARGETS chorus EXPORT ChorusTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
if(TARGET chorus_cli)
  install(TARGETS chorus_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()
set(CHORUS_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/Chorus)
install(EXPORT ChorusTargets NAMESPACE Chorus:: DESTINATION ${CHORUS_CMAKE_DIR})

# --- CMake package ----------------------------------------------------------------
# The optional backends this build has; undefined (a CMakeLists without that
# detection) reads as OFF.
foreach(_f CUDA CUDNN NCCL GLOO MPI)
  if(CHORUS_HAVE_${_f})
    set(CHORUS_CONFIG_WITH_${_f} ON)
  else()
    set(CHORUS_CONFIG_WITH_${_f} OFF)
  endif()
endforeach()
if(BUILD_SHARED_LIBS)
  set(CHORUS_CONFIG_SHARED ON)
else()
  set(CHORUS_CONFIG_SHARED OFF)
endif()
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/ChorusConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/ChorusConfig.cmake INSTALL_DESTINATION ${CHORUS_CMAKE_DIR})
# 0.x: a new minor version may break the API, so only the same minor matches.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/ChorusConfigVersion.cmake
                                 VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/ChorusConfig.cmake ${PROJECT_BINARY_DIR}/ChorusConfigVersion.cmake
              ${PROJECT_SOURCE_DIR}/cmake/ChorusFindLibraries.cmake
        DESTINATION ${CHORUS_CMAKE_DIR})

# --- pkg-config -------------------------------------------------------------------
# Relocatable: prefix is found from where chorus.pc lies (${pcfiledir}).
file(RELATIVE_PATH CHORUS_PC_UP /_/${CMAKE_INSTALL_LIBDIR}/pkgconfig /_)
get_target_property(_defs chorus INTERFACE_COMPILE_DEFINITIONS)
set(CHORUS_PC_CFLAGS "")
foreach(_d IN LISTS _defs)
  # The feature switches the headers test (CHORUS_WITH_CUDA, ...). String values
  # (CHORUS_VERSION="0.1.0") are left out: no header reads them, and quotes do
  # not survive `$(pkg-config --cflags chorus)` in a shell.
  if(NOT _d MATCHES "[\" ]")
    string(APPEND CHORUS_PC_CFLAGS " -D${_d}")
  endif()
endforeach()
# Libraries without a .pc of their own; pkg-config's Requires names the others.
set(_pc_libs "-pthread")
if(CHORUS_HAVE_CUDA)
  string(APPEND _pc_libs " -L${CUDAToolkit_LIBRARY_DIR} -lcudart -ldl")
endif()
if(CHORUS_HAVE_CUPTI)
  get_filename_component(_dir ${CUDA_cupti_LIBRARY} DIRECTORY)
  string(APPEND _pc_libs " -L${_dir} -lcupti")
endif()
foreach(_lib IN ITEMS CUDNN NCCL)
  if(CHORUS_HAVE_${_lib})
    get_filename_component(_dir ${${_lib}_LIBRARY} DIRECTORY)
    string(TOLOWER ${_lib} _name)
    string(APPEND _pc_libs " -L${_dir} -l${_name}")
  endif()
endforeach()
if(CHORUS_HAVE_GLOO)
  string(APPEND _pc_libs " -lgloo")
endif()
if(BUILD_SHARED_LIBS)  # libchorus.so names its own dependencies
  set(CHORUS_PC_REQUIRES "nlohmann_json")
  set(CHORUS_PC_REQUIRES_PRIVATE "fmt zlib openblas")
  set(CHORUS_PC_LIBS "")
  set(CHORUS_PC_LIBS_PRIVATE "${_pc_libs}")
else()  # libchorus.a: a user's link line needs everything it uses
  set(CHORUS_PC_REQUIRES "nlohmann_json fmt zlib openblas")
  set(CHORUS_PC_REQUIRES_PRIVATE "")
  set(CHORUS_PC_LIBS "${_pc_libs}")
  set(CHORUS_PC_LIBS_PRIVATE "")
endif()
configure_file(${PROJECT_SOURCE_DIR}/cmake/chorus.pc.in ${PROJECT_BINARY_DIR}/chorus.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/chorus.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)

# --- CI: the installed tree, used from outside (tests/install/out_of_tree.sh) ---
if(CHORUS_BUILD_TESTS)
  add_test(NAME install.out_of_tree
           COMMAND bash ${PROJECT_SOURCE_DIR}/tests/install/out_of_tree.sh ${PROJECT_BINARY_DIR} ${PROJECT_SOURCE_DIR})
  set_tests_properties(install.out_of_tree PROPERTIES TIMEOUT 900)
endif()
