# Imported targets for the libraries Chorus links that ship no CMake package of
# their own: OpenBLAS's CBLAS (Chorus::openblas), cuDNN (Chorus::cudnn) and
# NCCL (Chorus::nccl). CMakeLists.txt includes this after it has found them,
# and the installed ChorusConfig.cmake includes it to find them again on the
# user's machine, so the build and its users name them the same way and the
# exported Chorus::chorus carries no absolute path of the build machine.

# _chorus_import(<target> <include dir variable> <library variable>)
function(_chorus_import target include_var library_var)
  if(TARGET ${target})
    return()
  endif()
  if(NOT ${include_var} OR NOT ${library_var})
    message(FATAL_ERROR "Chorus: ${target}: ${include_var}='${${include_var}}' ${library_var}='${${library_var}}' "
                        "(not found; install it or point these cache variables at it)")
  endif()
  add_library(${target} UNKNOWN IMPORTED)
  set_target_properties(${target} PROPERTIES IMPORTED_LOCATION "${${library_var}}"
                                             INTERFACE_INCLUDE_DIRECTORIES "${${include_var}}")
endfunction()

find_path(CBLAS_INCLUDE_DIR cblas.h PATH_SUFFIXES openblas-pthread openblas)
find_library(OPENBLAS_LIBRARY NAMES openblas)
_chorus_import(Chorus::openblas CBLAS_INCLUDE_DIR OPENBLAS_LIBRARY)

if(CHORUS_HAVE_CUDNN)
  find_path(CUDNN_INCLUDE_DIR cudnn.h HINTS ${CUDAToolkit_INCLUDE_DIRS} /usr/include /usr/include/x86_64-linux-gnu)
  find_library(CUDNN_LIBRARY cudnn HINTS ${CUDAToolkit_LIBRARY_DIR} /usr/lib/x86_64-linux-gnu)
  _chorus_import(Chorus::cudnn CUDNN_INCLUDE_DIR CUDNN_LIBRARY)
endif()
if(CHORUS_HAVE_NCCL)
  find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} /usr/include)
  find_library(NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} /usr/lib/x86_64-linux-gnu)
  _chorus_import(Chorus::nccl NCCL_INCLUDE_DIR NCCL_LIBRARY)
endif()
