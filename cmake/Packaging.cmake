# `cpack -G DEB` in a build directory: one package, chorus_<version>_<arch>.deb,
# holding the library, the headers, the CMake package, chorus.pc and `chorus`
# (scripts/package_deb.sh builds the shared, CPU-only one). Its Depends are
# the runtime libraries dpkg-shlibdeps finds in libchorus.so and `chorus`
# (libopenblas0, libfmt9, zlib1g, libgloo0, ...) plus the -dev packages that
# find_package(Chorus) and the headers need on the user's machine.
# A CUDA build links the CUDA toolkit, cuDNN and NCCL, which are not Debian
# packages: such a .deb expects them installed (README "Use Chorus in your
# project"), and its Depends do not name them.
set(CPACK_PACKAGE_NAME chorus)
set(CPACK_PACKAGE_VENDOR "Chorus")
set(CPACK_PACKAGE_CONTACT "Chorus maintainers <chorus@localhost>")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "C++20 deep-learning engine for training one network on many devices")
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)  # chorus_0.1.0_amd64.deb
set(CPACK_DEBIAN_PACKAGE_SECTION science)
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
set(_chorus_dev_depends "libopenblas-dev, libfmt-dev, nlohmann-json3-dev, zlib1g-dev, cmake (>= 3.25) | pkg-config")
if(CHORUS_HAVE_GLOO)
  string(APPEND _chorus_dev_depends ", libgloo-dev")
endif()
set(CPACK_DEBIAN_PACKAGE_DEPENDS "${_chorus_dev_depends}")
set(CPACK_DEBIAN_PACKAGE_RECOMMENDS "g++ (>= 4:12)")
set(CPACK_DEBIAN_PACKAGE_SUGGESTS "dataset-fashion-mnist")
if(CHORUS_HAVE_CUDA)
  # dpkg-shlibdeps knows no package for libcudart & co.: let it pass them by.
  set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS_PRIVATE_DIRS ${CUDAToolkit_LIBRARY_DIR})
endif()
include(CPack)
