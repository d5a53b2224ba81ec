# The include graph of kernels/ runs downward only: a file includes headers of its own room and
# of the rooms below it (below_<room>), never above, and nothing of the server, clients or
# tests. attn is the bottom, registry the top of the engines; cpu and cuda/ never include each
# other.
# Run as: cmake -DKERNELS=<path to kernels/> -P kernel_layers.cmake (a CTest, tests/common).
cmake_minimum_required(VERSION 3.25)
set(below_attn attn)
set(below_cpu attn cpu)
set(below_cuda/common attn cuda/common)
set(below_cuda/fused attn cuda/common cuda/fused)
set(below_cuda/naive attn cuda/common cuda/naive)
set(below_cuda attn cuda/common cuda/fused cuda/naive cuda)
set(below_registry attn cpu cuda/common cuda/fused cuda/naive cuda registry)
# The trainable layer over the engines (attn_layers links attn_kernels): above the registry.
set(below_layers attn cpu cuda/common cuda/fused cuda/naive cuda registry layers)
set(rooms attn cpu layers cuda/common cuda/fused cuda/naive cuda registry)

# The room of a path relative to kernels/: its folder, or "" outside the layer table.
function(room_of path out)
  get_filename_component(dir "${path}" DIRECTORY)
  if(dir IN_LIST rooms)
    set(${out} "${dir}" PARENT_SCOPE)
  else()
    set(${out} "" PARENT_SCOPE)
  endif()
endfunction()

file(GLOB_RECURSE files RELATIVE ${KERNELS}
     ${KERNELS}/*.h ${KERNELS}/*.cc ${KERNELS}/*.cu ${KERNELS}/*.cuh)
set(errors "")
set(checked 0)
foreach(file IN LISTS files)
  room_of("${file}" room)
  if(room STREQUAL "")
    string(APPEND errors "  ${file}: its folder is not in the layer table of kernel_layers.cmake\n")
    continue()
  endif()
  file(STRINGS ${KERNELS}/${file} includes REGEX "^[ \t]*#[ \t]*include[ \t]*\"")
  foreach(line IN LISTS includes)
    string(REGEX REPLACE "^[ \t]*#[ \t]*include[ \t]*\"([^\"]+)\".*" "\\1" target "${line}")
    math(EXPR checked "${checked} + 1")
    if(target MATCHES "^(server|clients|proto|tests|bench)/")
      string(APPEND errors "  ${file} includes ${target}: kernels/ knows nothing outside it\n")
      continue()
    endif()
    room_of("${target}" target_room)
    if(target_room STREQUAL "")
      continue()  # a library's header (absl/...) or a sibling without a folder
    endif()
    if(NOT target_room IN_LIST below_${room})
      string(APPEND errors
             "  ${file} (${room}) includes ${target} (${target_room}): an arrow up the layers\n")
    endif()
  endforeach()
endforeach()
if(NOT errors STREQUAL "")
  message(FATAL_ERROR "kernels/ include graph:\n${errors}")
endif()
list(LENGTH files count)
message(STATUS "kernels/: ${count} files, ${checked} includes, no arrow up the layers")
